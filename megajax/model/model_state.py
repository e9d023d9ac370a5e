"""The model's non-trainable state: the variables the optimizer never sees.

The model's variables are its weights and, beside them, state that each step moves by its own rule:

  fp8_<weight>   FP8 delayed scaling's amax counters (megajax/model/fp8.py), set from the exponents the step saw
  moe_stats      an MoE layer's routing statistics channel (always zero; megajax/model/moe/routing.py)
  router_bias    DeepSeek-V3's auxiliary-loss-free routing bias, moved by the step's expert loads
  mtp_stats      a multi-token prediction module's loss channel (always zero; megajax/model/gpt.py head_loss):
                 its gradient is the module's summed loss and token count

The forward reads both kinds from one tree (`merge`), because the layer stack, the pipeline's stages and the
gradient reduction treat them alike: the state's "gradients" are how a step's statistics leave the layers (summed
over micro batches, pipeline ticks and data ranks as every gradient is). The train state holds them apart
(`split`): TrainState.params, what the optimizer updates, and TrainState.model_state, what `step_update` moves
after the step. Params-only checkpoints, HF conversion and generation read the merged tree, as the model does.
"""

from __future__ import annotations

import jax

from megajax.model import fp8, moe

MTP_STATS = "mtp_stats"


def is_state_key(name: str) -> bool:
    """Whether a variable named `name` (its last key) is non-trainable state rather than a weight."""
    return name.startswith(fp8.META_PREFIX) or name in (moe.STATS, moe.ROUTER_BIAS, MTP_STATS)


def is_state(path) -> bool:
    """`is_state_key` of a jax.tree_util path."""
    return is_state_key(str(getattr(path[-1], "key", path[-1])))


def split(variables) -> tuple[dict, dict]:
    """(weights, state) of a nested dict of variables (any layout: canonical, pipeline-staged, abstract, specs);
    each keeps the nesting of its own leaves, with no empty dicts."""

    def part(tree, path, want):
        if not isinstance(tree, dict):
            return tree if is_state(path) == want else None
        out = {}
        for k, v in tree.items():
            kept = part(v, path + (jax.tree_util.DictKey(k),), want)
            if kept is not None and not (isinstance(kept, dict) and not kept):
                out[k] = kept
        return out

    return part(dict(variables), (), False), part(dict(variables), (), True)


def merge(params: dict, state: dict) -> dict:
    """The model's variables from `split`'s two halves."""
    out = dict(params)
    for k, v in state.items():
        out[k] = merge(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def step_update(state: dict, grads: dict, num_experts: int, drops: bool, bias_rate: float,
                amax_history: int) -> tuple[dict, dict]:
    """(the state after a step, the step's MoE metrics) from the state's gradients (`grads`, shaped as `state`, summed
    over the step's micro batches and ranks): the FP8 counters set from the amax exponents seen, the routing bias
    moved by the expert loads, the statistics channel left at zero."""
    metrics, loads = moe.step_stats(grads, num_experts, drops=drops)
    metrics.update(mtp_stats(grads))
    if bias_rate:
        state = moe.update_router_bias(state, loads, bias_rate)
    seen = fp8.seen_of(grads)
    if seen:
        state = fp8.update_meta(state, seen, amax_history)
    return state, metrics


def mtp_stats(grads) -> dict:
    """The step's multi-token prediction loss (`mtp_loss`: the modules' token mean, unscaled) from the gradients of
    their MTP_STATS channels (summed loss, tokens); {} without the modules."""
    found = []
    jax.tree_util.tree_map_with_path(
        lambda path, g: found.append(g) if getattr(path[-1], "key", None) == MTP_STATS else None, grads)
    if not found:
        return {}
    total = sum(found)
    return {"mtp_loss": total[0] / jax.numpy.maximum(total[1], 1.0)}
