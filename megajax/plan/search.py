"""The layout search: every valid layout of a model on a cluster, pruned by the analytical memory model, ranked by
the predicted step time (`megajax.plan.cost`), the closest few compiled for the target GPU.

The space: tensor, pipeline, context and expert sizes (data takes the rest), the schedule (1F1B, interleaved,
zero-bubble) and its virtual stages, the micro batch size, recomputation, the data-parallel sharding (the distributed
optimizer, or FSDP), sequence parallelism with and without tp_comm_overlap, overlap_grad_reduce with
overlap_param_gather, hybrid sharding (the sharded state's instances: one over every data rank, or one a node where
the data ranks span nodes), and with context parallelism the exchange (auto, or the all-to-alls where the heads
divide). With a pipeline the embedding and output layer are as parallel.vocab_over_pipeline=null's rule has them,
and split over the pipeline ranks where a layout does not fit with them whole. Keys the user fixes
(`--set parallel.tensor=8`) are not varied. Sequence parallelism is on whenever tensor > 1 (it moves the same bytes
as tensor parallelism alone and needs less memory) and the distributed optimizer whenever data > 1 (the same bytes
as an all-reduce), unless fixed.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time

from megajax.config import Config, ConfigError, InputError
from megajax.config.base import divisors
from megajax.config.parallel import context_a2a_sizes
from megajax.plan.cost import Estimate, estimate
from megajax.plan.hardware import GIB, Hardware

# The keys the search varies, as `--set` spells them (the written preset sets every one).
KEYS = ("parallel.data", "parallel.pipeline", "parallel.tensor", "parallel.context", "parallel.expert",
        "parallel.schedule", "parallel.virtual_stages", "train.micro_batch_size", "model.recompute",
        "parallel.sequence_parallel", "parallel.tp_comm_overlap", "parallel.data_parallel_sharding_strategy",
        "parallel.overlap_grad_reduce", "parallel.overlap_param_gather", "parallel.num_distributed_optimizer_instances",
        "parallel.context_comm", "parallel.context_a2a_size", "parallel.vocab_over_pipeline",
        "parallel.decoder_first_pipeline_num_layers", "parallel.decoder_last_pipeline_num_layers",
        "parallel.account_for_embedding_in_pipeline_split", "parallel.account_for_loss_in_pipeline_split")
EVEN = {"parallel.decoder_first_pipeline_num_layers": None, "parallel.decoder_last_pipeline_num_layers": None,
        "parallel.account_for_embedding_in_pipeline_split": False,
        "parallel.account_for_loss_in_pipeline_split": False}


@dataclasses.dataclass
class Candidate:
    settings: dict  # KEYS -> value
    cfg: Config  # resolved for the GPU count
    estimate: Estimate
    compiled: dict | None = None  # from the compile: peak_gib, fits, exposed_s (XLA's program)
    compile_error: str | None = None  # XLA could not compile it: the model's numbers stand
    margin: float = 0.0  # the share of memory the model's estimate must leave free to count as fitting
    activation_scale: float = 1.0  # XLA's activations over the model's, learned from compiled neighbours
    exposure_scale: float = 1.0  # the compiled program's exposed communication over the model's, likewise

    @property
    def step_s(self) -> float:
        """The predicted step: the analytical one, with the compiled program's exposed communication in place
        of the analytical one when compiled."""
        e = self.estimate
        if self.compiled is None:
            return e.step_s + (self.exposure_scale - 1) * self.model_exposed_s
        return e.step_s - self.model_exposed_s + self.compiled["exposed_s"]

    @property
    def model_exposed_s(self) -> float:
        """The model's exposed communication that a compile replaces: tensor, data, expert and context."""
        x = self.estimate.exposed_s
        return x["tensor"] + x["data"] + x["expert"] + x["context"]

    @property
    def memory_gib(self) -> float:
        if self.compiled:
            return self.compiled["peak_gib"]
        mem = self.estimate.memory
        return (mem["total"] + (self.activation_scale - 1) * mem["activations"]) / GIB

    @property
    def fits(self) -> bool:
        return self.compiled["fits"] if self.compiled else self.memory_gib * GIB <= self.capacity * (1 - self.margin)

    @property
    def capacity(self) -> float:
        return self.estimate.memory["capacity"]

    def learned_scale(self) -> float:
        """A compiled candidate's XLA activations over the model's: its peak less the terms the model counts
        exactly (weights, gradients, optimizer state, logits, reserve), over the model's activations."""
        mem = self.estimate.memory
        exact = mem["total"] - mem["activations"]
        return max(1.0, (self.compiled["peak_gib"] * GIB - exact) / max(mem["activations"], 1.0))


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def layouts(base: Config, gpus: int, gpus_per_node: int, fixed: dict) -> list[dict]:
    """Every layout's settings (KEYS -> value) for `gpus`, with the `fixed` keys as given. Sizes that divide the
    model (heads, layers, experts) and the batch; the configs that reject a combination drop it later."""
    m = base.model
    gbs = base.train.global_batch_size
    pick = lambda key, options: [fixed[key]] if key in fixed else options  # noqa: E731
    out = []
    tensors = [t for t in _powers_of_two(min(gpus, 4 * gpus_per_node))
               if m.num_heads % t == 0 and m.kv_heads % t == 0 or t == 1]
    contexts = _powers_of_two(gpus_per_node) if m.seq_length >= 8192 else [1]
    for t, c in itertools.product(pick("parallel.tensor", tensors), pick("parallel.context", contexts)):
        if gpus % (t * c):
            continue
        for p in pick("parallel.pipeline", divisors(gpus // (t * c))):
            d = gpus // (t * c * p)
            if p > m.stacked_layers or fixed.get("parallel.data", d) != d or gbs % d:
                continue
            experts = [e for e in divisors(d) if m.num_experts and m.num_experts % e == 0] or [1]
            for e, split in itertools.product(pick("parallel.expert", experts), splits(m, p, fixed)):
                rows = _inner(base, fixed, pick, d, p, t, c, e, split, gpus_per_node)
                out += [{**row, **split} for row in rows]
    return out


def splits(model, p: int, fixed: dict) -> list[dict]:
    """The ways to split the layers over p stages: evenly; else Megatron's accounting (the embedding and the
    output layer each count as a layer: num_layers + 2 split evenly); else a first and a last stage that take
    what an even middle leaves (k = ceil(layers / p) on each middle stage). Fixed split keys win."""
    if any(k in fixed for k in EVEN):
        return [{k: fixed.get(k, v) for k, v in EVEN.items()}]
    if p == 1:
        return [dict(EVEN)]
    n = model.num_layers
    if model.stacked_layers % p == 0:  # (a model's dense first layers ride on the first chunk)
        return [dict(EVEN)]
    out = []
    if (n + 2) % p == 0:
        out.append({**EVEN, "parallel.account_for_embedding_in_pipeline_split": True,
                    "parallel.account_for_loss_in_pipeline_split": True})
    k = -(-n // p)
    rest = n - (p - 2) * k
    if p > 2 and 2 <= rest <= 2 * k:
        first = min(k, rest - 1, max(model.first_dense_layers + 1, -(-rest // 2)))
        out.append({**EVEN, "parallel.decoder_first_pipeline_num_layers": first,
                    "parallel.decoder_last_pipeline_num_layers": rest - first})
    return out


def _inner(base: Config, fixed: dict, pick, d: int, p: int, t: int, c: int, e: int, split: dict,
           gpus_per_node: int) -> list[dict]:
    m = base.model
    per_rank = base.train.global_batch_size // d
    schedules = [("1f1b", 1)]
    uneven = split["parallel.decoder_first_pipeline_num_layers"] is not None
    if p > 1 and not uneven:
        total = m.num_layers + 2 * split["parallel.account_for_loss_in_pipeline_split"]
        schedules += [("interleaved", v) for v in (2, 3, 4, 5, 6, 8) if (total // p) % v == 0]
    if p > 1:  # the split backward on 1F1B's table, and on the interleaved ones
        schedules += [("zero_bubble", v) for _, v in schedules]
    if isinstance(fixed.get("parallel.schedule"), tuple):  # the schedules to choose among (checks.PAPER_SPACE)
        schedules = [(s, v) for s, v in schedules if s in fixed["parallel.schedule"]]
    elif "parallel.schedule" in fixed or "parallel.virtual_stages" in fixed:
        schedules = [(fixed.get("parallel.schedule", s), fixed.get("parallel.virtual_stages", v))
                     for s, v in schedules]
        schedules = list(dict.fromkeys(schedules))
    micro = [b for b in divisors(per_rank) if b <= 32]
    sharding = ["optim", "optim_grads_params"] if d * c > 1 else ["no_shard"]
    # hybrid sharding: one instance over every data rank, or (where the data ranks span nodes) one a node
    in_node = gpus_per_node // (p * c * t)
    instances = [1] + ([d // in_node] if 2 <= in_node < d and d % in_node == 0 else [])
    rows = []
    comms = ["auto", "a2a"] if c > 1 and m.num_heads % (t * c) == 0 else ["auto"]
    # hierarchical: all-to-alls inside a node, the ring across nodes (with a pipeline, whose branches cannot hold
    # the ring's permutes, an all-gather across them)
    a2a_sizes = context_a2a_sizes(c, t, m.num_heads, gpus_per_node)
    if a2a_sizes:
        comms.append("a2a+ring" if p == 1 else "a2a+all_gather")
    for (schedule, v), b, recompute, shard, tpo, ogr, r, comm in itertools.product(
            schedules, pick("train.micro_batch_size", micro), pick("model.recompute", ["none", "selective", "full"]),
            pick("parallel.data_parallel_sharding_strategy", sharding),
            pick("parallel.tp_comm_overlap", [False, True] if t > 1 else [False]),
            pick("parallel.overlap_grad_reduce", [False, True] if d * c > 1 else [False]),
            pick("parallel.num_distributed_optimizer_instances", instances), pick("parallel.context_comm", comms)):
        if r > 1 and shard == "no_shard" or schedule == "zero_bubble" and ogr:
            continue  # (zero_bubble reduces in B and W, not in the overlapped reduction's ticks)
        if p > 1 and recompute == "full" and "model.recompute" not in fixed:
            continue  # (a pipeline recomputes every chunk anyway: full only repeats selective's layout)
        if p > 1 and per_rank // b < p:
            continue  # fewer micro batches than stages
        row = {"parallel.data": d, "parallel.pipeline": p, "parallel.tensor": t, "parallel.context": c,
               "parallel.expert": e, "parallel.schedule": schedule, "parallel.virtual_stages": v,
               "train.micro_batch_size": b, "model.recompute": recompute,
               "parallel.sequence_parallel": fixed.get("parallel.sequence_parallel", t > 1),
               "parallel.tp_comm_overlap": tpo, "parallel.data_parallel_sharding_strategy": shard,
               "parallel.overlap_grad_reduce": ogr, "parallel.num_distributed_optimizer_instances": r,
               "parallel.context_comm": comm,
               "parallel.vocab_over_pipeline": fixed.get("parallel.vocab_over_pipeline"),  # (null: `search` tries)
               "parallel.context_a2a_size": fixed.get("parallel.context_a2a_size", max(a2a_sizes, default=None))
               if comm.startswith("a2a+") else None,
               "parallel.overlap_param_gather": fixed.get("parallel.overlap_param_gather",
                                                          ogr and shard == "optim")}
        if row["parallel.tp_comm_overlap"] and not row["parallel.sequence_parallel"]:
            continue
        rows.append(row)
    return rows


def configure(base: Config, settings: dict, gpus: int) -> Config:
    """`base` with `settings` applied, resolved for `gpus` (ConfigError where the combination is invalid)."""
    sections = {"parallel": {}, "train": {}, "model": {}}
    for key, value in settings.items():
        section, name = key.split(".")
        sections[section][name] = value
    cfg = dataclasses.replace(base, **{s: _replaced(getattr(base, s), tuple(sorted(kw.items())))
                                       for s, kw in sections.items() if kw})
    return cfg.for_devices(gpus)


@functools.lru_cache(maxsize=4096)
def _replaced(section, items: tuple):
    """A config section with `items` (KEYS' scalar values) set and checked: the search builds the same few model
    and train sections for thousands of layouts."""
    return dataclasses.replace(section, **dict(items))


def search(base: Config, hw: Hardware, gpus: int, gpus_per_node: int, fixed: dict, keep: int = 20,
           clock: bool = True, margin: float = 0.0) -> dict:
    """Scores every layout: the first pass with the bubble formula, the best `keep` again on megajax's schedule
    clock (`clock`; False keeps the papers' formula, as Megatron's schedules run). A layout fits when the model's
    memory leaves `margin` of the GPU's free (the compile judges the rest). Returns {"ranked": [Candidate] (fitting, best first), "too_big": [Candidate] (the smallest few),
    "counted": {layouts, invalid, too_big}, "seconds"}."""
    start = time.perf_counter()
    if base.model.fp8 != "none" and "float8" not in hw.gemm_flops:
        raise ConfigError(f"model.fp8={base.model.fp8}: the {hw.name} has no FP8 tensor cores; plan for "
                          "--target h100 (or h200), or set model.fp8=none")
    fits, too_big, invalid = [], [], 0
    settings = layouts(base, gpus, gpus_per_node, fixed)
    for row in settings:
        c = _scored(base, hw, gpus, gpus_per_node, row, margin)
        if c is not None and not c.fits and row["parallel.pipeline"] > 1 and not c.estimate.vocab_over_pipeline \
                and "parallel.vocab_over_pipeline" not in fixed:  # (the tables split: it may fit)
            spread = _scored(base, hw, gpus, gpus_per_node, {**row, "parallel.vocab_over_pipeline": True}, margin)
            c = spread if spread is not None and spread.fits else c
        if c is None:
            invalid += 1
        else:
            (fits if c.fits else too_big).append(c)
    fits.sort(key=lambda c: c.step_s)
    ranked = [Candidate(c.settings, c.cfg, estimate(c.cfg, hw, gpus_per_node, clock), margin=margin)
              for c in fits[:keep]]
    rank(ranked)
    too_big.sort(key=lambda c: c.estimate.memory["total"])
    return {"ranked": ranked + fits[keep:], "too_big": too_big[:5],
            "counted": {"layouts": len(settings), "invalid": invalid, "too_big": len(too_big), "fit": len(fits)},
            "seconds": time.perf_counter() - start}


def _scored(base: Config, hw: Hardware, gpus: int, gpus_per_node: int, row: dict, margin: float,
            clock: bool = False) -> Candidate | None:
    """The layout `row` scored by the bubble formula (the search's first pass; `clock`: on the schedule's clock),
    with the plan's choice of the tables in its settings; None where the config rejects it."""
    try:
        cfg = configure(base, row, gpus)
        est = estimate(cfg, hw, gpus_per_node, simulate=clock)
    except (ConfigError, InputError, ValueError):
        return None
    return Candidate({**row, "parallel.vocab_over_pipeline": est.vocab_over_pipeline}, cfg, est, margin=margin)


def own_layout(base: Config, hw: Hardware, gpus: int, gpus_per_node: int, margin: float = 0.0) -> Candidate | None:
    """The config's own layout (its values of KEYS) scored as the search scores a layout, on the schedule clock;
    None where it does not run on `gpus` (another GPU count, or an invalid combination there)."""
    settings = {key: getattr(getattr(base, key.split(".")[0]), key.split(".")[1]) for key in KEYS}
    own = _scored(base, hw, gpus, gpus_per_node, settings, margin, clock=True)
    if own is not None:  # (data: null takes what the other axes leave)
        own.settings["parallel.data"] = own.cfg.parallel.data
    return own


def _complexity(s: dict) -> int:
    """Features a layout turns on beyond what it needs: FSDP, the overlaps, virtual stages, the split backward, the
    tables over the pipeline."""
    return ((s["parallel.data_parallel_sharding_strategy"] == "optim_grads_params") + s["parallel.tp_comm_overlap"]
            + s["parallel.overlap_grad_reduce"] + (s["parallel.virtual_stages"] > 1)
            + (s["parallel.schedule"] == "zero_bubble") + bool(s.get("parallel.vocab_over_pipeline")))


def rank(candidates: list[Candidate], tie: float = 0.002) -> None:
    """Sorts by predicted step time; layouts within `tie` of each other (closer than the model can tell apart)
    by the fewest extra features, then the least memory. Of layouts that differ only in flags the prediction does
    not see (the same time and memory), the simplest stays."""
    candidates.sort(key=lambda c: c.step_s)
    if not candidates:
        return
    best = candidates[0].step_s
    buckets = lambda c: int((c.step_s / best - 1) / tie)  # noqa: E731
    candidates.sort(key=lambda c: (buckets(c), _complexity(c.settings), c.memory_gib))
    seen, keep = set(), []
    for c in candidates:
        key = (round(c.step_s, 9), round(c.memory_gib, 6), c.compiled is None, *(
            c.settings[k] for k in KEYS if k not in ("parallel.overlap_grad_reduce", "parallel.overlap_param_gather")))
        if key not in seen:
            seen.add(key)
            keep.append(c)
    candidates[:] = keep


def compile_candidate(c: Candidate, target: str) -> dict:
    """Compiles the candidate's step for compile-only `target` GPUs (`megajax.audit`): XLA's peak memory and
    the communication its scheduled program leaves exposed."""
    from megajax import audit

    report = audit.audit(c.cfg, target, c.cfg.parallel.data * c.cfg.parallel.pipeline * c.cfg.parallel.context
                         * c.cfg.parallel.tensor)
    mem, comm = report["memory_per_device"], report["communication"]
    by_kind: dict[str, float] = {}
    for name, group in comm["groups"].items():
        by_kind[name.split(" ")[0]] = by_kind.get(name.split(" ")[0], 0.0) + group["exposed_s"]
    return {"peak_gib": mem["peak_estimate_gib"] + c.estimate.memory["reserve"] / GIB,
            "fits": (mem["peak_estimate_gib"] * GIB + c.estimate.memory["reserve"]) <= mem["device_memory_gib"] * GIB,
            "exposed_s": comm["exposed_comm_s"], "exposed_by_collective": by_kind}
