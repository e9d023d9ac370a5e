"""How the pipeline splits the model's layers over its chunks (`pipeline_split`, Megatron's get_num_layers_to_build):
even, uneven first and last stages, or the embedding and loss counted as layers. Plain Python, no JAX: the config
checks a layout with it and the schedule CLI draws it."""

from __future__ import annotations

import dataclasses
import functools

from megajax.config.base import check

@dataclasses.dataclass(frozen=True)
class StageSplit:
    """How the pipeline splits the model: per global chunk c (= local chunk x p + rank; layout.py), its
    transformer layers (`layers`: model.moe_first_dense_layers counted on chunk 0) and its units of the scanned
    stack (`units`: layers / model.moe_layer_freq, dense first layers not counted). Every chunk has `slots`
    places for units in the staged layout; a chunk with fewer leaves the rest empty (skipped, zero weights)."""

    layers: tuple[int, ...]
    units: tuple[int, ...]

    @property
    def slots(self) -> int:
        return max(self.units)

    @property
    def even(self) -> bool:
        return len(set(self.units)) == 1

    @property
    def starts(self) -> tuple[int, ...]:
        """The stack index of each chunk's first unit."""
        return tuple(sum(self.units[:c]) for c in range(len(self.units)))

    def busiest_rank_layers(self, p: int, last_extra: int = 0) -> int:
        """The transformer layers of the pipeline rank (of p) that holds the most: its chunks are r, r + p, ...; the
        last rank with `last_extra` more (the multi-token prediction modules' layers, after its head)."""
        return max(sum(self.layers[r::p]) + (last_extra if r == p - 1 else 0) for r in range(p))


@functools.lru_cache(maxsize=4096)  # (a property of every Config: the planner builds thousands)
def pipeline_split(num_layers: int, p: int, v: int = 1, first: int | None = None, last: int | None = None,
                   embedding: bool = False, loss: bool = False, first_dense: int = 0, period: int = 1) -> StageSplit:
    """The layers of each of the p x v pipeline chunks, as Megatron's get_num_layers_to_build splits them: the first
    and the last stage `first` / `last` layers when given, the stages between the rest evenly; or, with `embedding`
    / `loss`, the embedding and the loss counted as a layer each on the first / last chunk; else the scanned stack
    (the layers after `first_dense`) evenly over the chunks, the dense first layers on chunk 0. A stage's layers
    split evenly over its v chunks. Raises ConfigError naming the fix."""
    chunks = p * v
    stack = num_layers - first_dense
    keys = ("parallel.decoder_first_pipeline_num_layers", "parallel.decoder_last_pipeline_num_layers")
    if first is not None or last is not None:
        ends = [n for n in (first, last) if n is not None]
        middle = p - len(ends)
        rest = num_layers - sum(ends)
        check(rest >= 0 and (rest % middle == 0 if middle else rest == 0),
              f"{' and '.join(f'{k}={n}' for k, n in zip(keys, (first, last)) if n is not None)} leave {rest} of "
              f"model.num_layers={num_layers} layers for the other {middle} stage(s) of parallel.pipeline={p}, "
              f"which do not split evenly: choose them so that the rest divides by "
              f"{middle or 'nothing (no stage left)'}")
        per = rest // middle if middle else 0
        stages = [first if first is not None else per] + [per] * (p - 2) + [last if last is not None else per]
        for name, n in ((keys[0], stages[0]), (keys[1], stages[-1]), ("each middle stage", per)):
            check(n % v == 0, f"{name} holds {n} layers, which parallel.virtual_stages={v} chunks do not split "
                  f"evenly: choose a multiple of {v}")
        layers = [stages[c % p] // v for c in range(chunks)]
    elif embedding or loss:
        total = num_layers + embedding + loss
        check(total % chunks == 0,
              f"model.num_layers={num_layers} plus the embedding and loss counted as layers "
              f"(parallel.account_for_*_in_pipeline_split) is {total}, not divisible by parallel.pipeline x "
              f"parallel.virtual_stages = {chunks}: choose a pipeline that divides {total}, or drop the accounting")
        layers = [total // chunks] * chunks
        layers[0] -= embedding
        layers[-1] -= loss
    else:
        what = (f"model.num_layers={num_layers}" if stack == num_layers else
                f"the {stack} layers after model.moe_first_dense_layers={first_dense}")
        check(stack % chunks == 0,
              f"{what} is not divisible by parallel.pipeline * parallel.virtual_stages = {chunks}: choose layers "
              f"that split evenly into {chunks} chunks, or split unevenly with {keys[0]} and {keys[1]} "
              "(docs/features/pipeline-schedules.md)")
        layers = [stack // chunks] * chunks
        layers[0] += first_dense
    check(min(layers) >= 1, f"the pipeline split gives a chunk no layer ({list(layers)} per chunk): every chunk "
          "needs at least one layer; change parallel.decoder_first/last_pipeline_num_layers or the pipeline")
    check(layers[0] >= first_dense,
          f"the first pipeline chunk holds {layers[0]} layers, fewer than model.moe_first_dense_layers="
          f"{first_dense}, which run with the embedding on it: give the first stage at least {first_dense * v}")
    stacked = [n - (first_dense if c == 0 else 0) for c, n in enumerate(layers)]
    bad = [c for c, n in enumerate(stacked) if n % period]
    check(not bad, f"a pipeline chunk holds whole groups of model.moe_layer_freq={period} layers (one MoE layer, "
          f"then dense ones), but chunk {bad[0] if bad else 0} would hold {stacked[bad[0]] if bad else 0} layers of "
          f"the stack: change the layers, the frequency or the pipeline so that every chunk holds a multiple of "
          f"{period} (after the dense first layers)")
    return StageSplit(tuple(layers), tuple(n // period for n in stacked))
