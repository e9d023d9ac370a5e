"""`impl="auto"` (model.attention_impl and model.norm_impl's default): the fused Pallas kernels where the step runs
on a GPU, XLA's reference on CPU.

The choice is made when the step is traced, by the platform of its devices (`step_plan.platform_dependent`), the
same on every rank. Outside a step (the model's init, generation, a module applied in a test) it is the default
backend's, where that code runs. Where the fused kernel cannot run a case, auto takes XLA's instead and `summary`
says why (the train log's "kernels:" line); an explicit `pallas` raises on that case instead.

- Attention: the flash kernel takes head dims up to MAX_HEAD_DIM (multi-latent attention's 192 included), segment
  masks (packed documents), grouped-query heads and dropout on the probabilities (the entries XLA's drops).
- Norms: rows up to MAX_DIM wide.
"""

from __future__ import annotations

import jax

from megajax.kernels.flash_attention import MAX_HEAD_DIM
from megajax.kernels.fused_norm import MAX_DIM
from megajax.parallel import step_plan

def attention_fallback(head_dim: int) -> str | None:
    """Why auto runs XLA's attention on a GPU for this case, or None where the flash kernel runs it."""
    if head_dim > MAX_HEAD_DIM:
        return f"head dim {head_dim} > {MAX_HEAD_DIM}, the flash kernel's largest"
    return None


def norm_fallback(d: int) -> str | None:
    """Why auto runs XLA's norm on a GPU for rows of width d, or None where the fused kernel runs it."""
    return f"width {d} > {MAX_DIM}, the fused norm's largest" if d > MAX_DIM else None


def platform() -> str | None:
    """The platform auto chooses for: the step's in force (StepPlan.platform; None in an export, decided when
    lowered), else the default backend's ("cpu" or "gpu")."""
    plan = step_plan.current()
    if plan is not None:
        return plan.platform
    return "cpu" if jax.default_backend() == "cpu" else "gpu"


def by_platform(*args, cpu, gpu):
    """`cpu(*args)` or `gpu(*args)` as `platform()` says; in an export, `step_plan.platform_dependent`'s choice."""
    where = platform()
    if where is None:
        return step_plan.platform_dependent(*args, cpu=cpu, default=gpu)
    return (cpu if where == "cpu" else gpu)(*args)


def resolve(impl: str, fallback: str | None, platform: str | None) -> str:
    """The implementation `impl` runs on `platform` ("cpu", "gpu"; None: decided when lowered, read as a GPU)."""
    if impl != "auto":
        return impl
    return "xla" if platform == "cpu" or fallback else "pallas"


def fused_attention(attention_impl: str, head_dim: int, platform: str | None) -> bool:
    """Whether the attention core runs a fused kernel (pallas or cudnn, chosen or by auto). Such a core keeps no
    [s, s] scores for the backward, only its output and log-sum-exp: model.recompute=selective, whose point is
    dropping the scores, does not recompute it (model/layers.py)."""
    return resolve(attention_impl, attention_fallback(head_dim), platform) != "xla"


def chosen(attention_impl: str, norm_impl: str, *, head_dim: int, width: int,
           platform: str | None) -> dict[str, tuple[str, str | None]]:
    """{"attention": (implementation, fallback), "norms": (...)}: what the step runs on `platform`, and why auto
    would take XLA's on a GPU (None where the fused kernel runs the case)."""
    whys = {"attention": attention_fallback(head_dim), "norms": norm_fallback(width)}
    impls = {"attention": attention_impl, "norms": norm_impl}
    return {what: (resolve(impls[what], why, platform), why) for what, why in whys.items()}


def summary(attention_impl: str, norm_impl: str, *, head_dim: int, width: int,
            platform: str | None) -> str:
    """One line for the train log: the attention and norm implementations the step runs, and why auto took XLA's
    where it did."""
    parts = []
    impls = {"attention": attention_impl, "norms": norm_impl}
    for what, (got, why) in chosen(attention_impl, norm_impl, head_dim=head_dim, width=width,
                                   platform=platform).items():
        note = ""
        if impls[what] == "auto":
            note = f" (auto: {why})" if why and platform != "cpu" else f" (auto on {platform or 'the target'})"
        parts.append(f"{what} {got}{note}")
    return ", ".join(parts)
