"""`python -m megajax.audit --config ... [--set ...] [--target cpu|a100|h100|h200] [--devices N]`

Compiles (does not run) the train step for a layout and prints JSON: per-device memory from XLA's memory
analysis, every collective by kind and mesh axes (executions and bytes per step), XLA's FLOP count, the
program's own GEMM FLOPs (`hlo.gemm_flops`: XLA's GPU compile-only cost analysis is empty) and Megatron's
analytic FLOPs (an MoE counts its active experts), and what Megatron's tensor/sequence parallelism and
expert parallelism should move, for comparison.

`--target h100` (a100, h200) compiles with XLA's real GPU compiler against compile-only GPUs (needs the
`gpu-audit` extra: jax-cuda12-plugin), on a machine without a GPU: the CPU compiler never forms
reduce-scatter, the GPU one does, and its memory analysis is what a GPU would hold.

`--lower-for cuda` instead exports the train step with `jax.export(..., platforms=["cuda"])` (lowering only,
no compiler, no plugin needed) and reports the Pallas kernel custom calls it contains (Triton or Mosaic
GPU) by kernel name: with model.attention_impl=pallas / model.norm_impl=pallas, proof that the kernels
lower for the GPU rather than falling back to their CPU interpreter.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import re
import sys
from pathlib import Path

import numpy as np

from megajax import quiet
from megajax.config import ConfigError

TARGETS = ("cpu", "a100", "h100", "h200")
FP8_TARGETS = ("h100", "h200")  # FP8 tensor cores (sm_90); the A100 (sm_80) has none
# XLA options a compile-only target's programs are compiled with. For sm_80 without a GPU (no autotuner) XLA cannot
# tile some of the step's Triton GEMM fusions ("Couldn't find output tile sizes that satisfy hlo: ... dot", jax
# 0.10.2; gpt2-124m's bf16[8192,768] GEMMs among them): the A100's programs run their GEMMs on cuBLAS.
TARGET_OPTIONS = {"a100": {"xla_gpu_enable_triton_gemm": False}}
# Custom-call targets of Pallas GPU kernels: Triton (XLA's own, and the FFI path used for ROCm), Mosaic GPU.
KERNEL_CALL_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi", "mosaic_gpu", "mosaic_gpu_v2")
GPUS_PER_HOST = 8


def _gpu_devices(target: str, n: int):
    from jax.experimental import topologies

    desc = (Path(__file__).parent / "targets" / f"{target}.txtpb").read_text()
    per_host = min(GPUS_PER_HOST, n)
    if n % per_host:
        raise ConfigError(f"--devices {n} must be a multiple of {GPUS_PER_HOST} (GPUs per host) for a GPU target")
    try:
        with quiet.without_probes():  # the CUDA plugin's first use probes for a driver
            topo = topologies.get_topology_desc(platform="cuda", topology=f"1x{n // per_host}x{per_host}",
                                                target_config=desc)
    except Exception as e:  # the plugin is missing or does not match jax
        raise ConfigError(
            f"cannot build compile-only {target} devices ({e}). Install the GPU compiler: "
            "pip install \"jax-cuda12-plugin==$(python -c 'import jax; print(jax.__version__)')\" "
            "\"jax-cuda12-pjrt==$(python -c 'import jax; print(jax.__version__)')\"") from None
    return list(topo.devices)


def _target_value(target: str, key: str) -> float:
    """A number from a target file: XLA's fields, or megajax's link bandwidths in its header comments."""
    desc = (Path(__file__).parent / "targets" / f"{target}.txtpb").read_text()
    return float(re.search(rf"{key}:\s*([0-9.e+]+)", desc).group(1))


def communication(colls, target: str, compute_dtype: str, gemm_flops: float, cfg=None, plan=None) -> dict:
    """The overlap report of a GPU program: per collective group (kind x mesh axes) bytes per step, the fraction
    with GEMMs scheduled under them and the estimated exposed time; the totals next to the GEMM time at peak.
    With a pipeline (`cfg`), `in_schedule`: the data-parallel reductions parallel.overlap_grad_reduce runs inside
    the schedule's ticks, and an estimate of what they add to the step."""
    from megajax import hlo, metrics

    peak = metrics.PEAK_FLOPS[target.upper()][compute_dtype]
    nvlink, network = _target_value(target, "nvlink_bytes_per_s"), _target_value(target, "network_bytes_per_s")
    groups = hlo.overlap(colls, peak, nvlink, network)
    out = {"groups": groups, "nvlink_bytes_per_s": nvlink, "network_bytes_per_s": network, "peak_flops": peak,
           "gemm_s_at_peak": gemm_flops / peak, "comm_s": sum(g["comm_s"] for g in groups.values()),
           "exposed_comm_s": sum(g["exposed_s"] for g in groups.values())}
    if plan is not None and plan.pipelined:
        out["in_schedule"] = _in_schedule(cfg, plan, colls, peak, nvlink, network)
    return out


def _in_schedule(cfg, plan, colls, peak: float, nvlink: float, network: float) -> dict:
    """The data-parallel collectives inside a pipeline's ticks: the reductions of parallel.overlap_grad_reduce and
    the weight gathers of parallel.overlap_param_gather, and an estimate of what they add to the step.

    Reductions: `data_parallel_bytes` per device; `in_backward_exposed_s`: per rank, the part of those run in a
    chunk's last backward (ranks with no idle tick after it: rank 0) that no GEMM hides; `idle_ticks_s`: per rank,
    the wire time of those run in idle ticks; `cooldown_delay_s`: in the lock step a tick ends when its slowest rank
    sends, so each tick adds the largest excess over its ranks: an idle tick's run beyond the tick the others
    compute (`cooldown_tick_s`: a chunk's recompute and backward at peak), a last backward's exposed part. Gathers,
    the mirror in the warm-up: `gather_bytes`, `in_forward_exposed_s` (rank 0's first forwards),
    `warmup_idle_ticks_s`, `warmup_delay_s` (against `warmup_tick_s`, a chunk's forward). A reduction after the
    schedule (a gather before it) costs its exposed time once instead. `comm_ratio`: one layer's reduce-scatter
    over its forward of one micro batch, what parallel.overlap_comm_ratio takes."""
    from megajax import hlo, metrics
    from megajax.parallel.pipeline import ticks

    data_axes = {"replica", "data", "expert", "context"}
    dp = [c for c in colls if c.in_conditional and c.kind in ("all-reduce", "reduce-scatter") and c.axes
          and set(c.axes) <= data_axes]
    # (the weights' gathers: not context parallelism's key-value gathers, over 'context' alone)
    gathers = [c for c in colls if c.in_conditional and c.kind == "all-gather" and c.axes and set(c.axes) <= data_axes
               and set(c.axes) != {"context"} and c.scope[-2:] in ("_f", "_g")]
    kinds = ticks.plan_of(plan, cfg.model)[2]
    devices = plan.data_ranks * plan.pipeline * plan.tensor * plan.context
    model = metrics.step_flops(cfg.model, cfg.train.global_batch_size * cfg.model.seq_length,
                               pipelined=True)["model_flops"] / devices
    forward = 1 / 3 * model / (plan.micro_batches * plan.virtual_stages) / peak  # one chunk, one micro batch

    def placed(in_compute: list, in_idle: list, runs: np.ndarray, marks: np.ndarray, tick_s: float):
        """(exposed in compute a rank, wire time in idle ticks a rank, one layer's wire time, the delay)."""
        exposed = sum(g["exposed_s"] for g in hlo.overlap(in_compute, peak, nvlink, network).values())
        wire = sum(hlo.link_seconds(c, nvlink, network) * c.count for c in in_idle)
        per_layer = wire / (runs.sum() / plan.pipeline) if runs.sum() else 0.0
        per_mark = plan.pipeline * exposed / marks.sum() if marks.sum() else 0.0  # one chunk's, on its rank
        excess = np.maximum(np.where(runs > 0, runs * per_layer - tick_s, 0.0), np.where(marks, per_mark, 0.0))
        return exposed, wire, per_layer, float(np.maximum(excess, 0.0).max(axis=1).sum())

    exposed_b, wire_x, layer_x, delay_x = placed(
        [c for c in dp if c.scope.endswith("_b")], [c for c in dp if c.scope.endswith("_x")], kinds["x"],
        (kinds["b"] & ticks.FINAL) > 0, 3 * forward)
    exposed_f, wire_g, layer_g, delay_g = placed(
        [c for c in gathers if c.scope.endswith("_f")], [c for c in gathers if c.scope.endswith("_g")], kinds["g"],
        (kinds["f"] & ticks.GATHER) > 0, forward)
    scatter = layer_x / (1 if plan.shard_optimizer else 2)  # one layer's reduce-scatter of its fp32 gradient
    return {"data_parallel_bytes": sum(c.bytes * c.count for c in dp), "in_backward_exposed_s": exposed_b,
            "idle_ticks_s": wire_x, "cooldown_tick_s": 3 * forward, "cooldown_delay_s": delay_x,
            "gather_bytes": sum(c.bytes * c.count for c in gathers), "in_forward_exposed_s": exposed_f,
            "warmup_idle_ticks_s": wire_g, "warmup_tick_s": forward, "warmup_delay_s": delay_g,
            "comm_ratio": scatter / (forward / ticks.chunk_layers(plan))}


def megatron_expected(cfg) -> dict:
    """What Megatron's tensor (and sequence) parallelism moves over 'tensor' in one step: per micro batch
    and layer, 2 all-reduces forward and 2 backward (+2 forward again with full recomputation), or with
    sequence parallelism an all-gather + reduce-scatter pair in place of each, of [b, s, d] activations; on the
    busiest pipeline rank (`_busiest_rank_layers`)."""
    m, p = cfg.model, cfg.parallel
    if p.tensor == 1:
        return {}
    mb = cfg.train.micro_batch_size
    act_bytes = mb * m.seq_length * m.hidden_size * (2 if m.compute_dtype != "float32" else 4)
    per_layer = 4 + (2 if m.recompute == "full" else 0)
    n = per_layer * _busiest_rank_layers(cfg) * cfg.num_micro_batches
    if p.sequence_parallel:
        return {"all-gather": {"count": n, "bytes_each": act_bytes},
                "reduce-scatter": {"count": n, "bytes_each": act_bytes}}
    return {"all-reduce": {"count": n, "bytes_each": act_bytes}}


def _busiest_rank_layers(cfg) -> int:
    """The transformer layers of the busiest pipeline rank, the last one's with the multi-token prediction modules'
    (model.mtp_num_layers)."""
    return cfg.stage_split.busiest_rank_layers(cfg.parallel.pipeline, cfg.model.mtp_num_layers)


def expected_all_to_all(cfg) -> dict:
    """What expert parallelism moves over 'expert' in one step, per device, per MoE layer and micro batch: a
    dispatch and a combine all-to-all forward, the same two backward, and two more where the forward runs again
    (full recomputation, or a 1F1B / interleaved / zero_bubble pipeline, which recomputes a chunk before its
    backward unless its forward kept the residuals, as the last chunk's does when its backward comes next:
    the schedule's recomputes, averaged over the ranks).
    `routed_bytes_each`: the analytic volume, tokens x k x hidden in the compute dtype (Megatron's dropless
    all-to-all sends exactly that); `buffer_bytes_each`: megajax's fixed-size buffer, capacity_factor times that
    with a capacity, or n x min(k, experts / n) / k times that dropless, n the ranks holding experts
    (moe.exchange_dropless), or with parallel.expert_buffer_factor the ragged exchange's receiving buffer.
    `bytes_each`: what each all-to-all moves, the buffer, or with parallel.expert_all_to_all=ragged (dropless) the
    routed rows alone (at most the receiving buffer), the program's ragged all-to-alls. With
    folded experts (parallel.expert_tensor=1) over `axes` 'expert' x 'tensor', the tokens are a tensor rank's
    sequence shard and n = expert x tensor; with context parallelism, a context rank's. Without a pipeline, the
    multi-token prediction modules' layers count (with a pipeline, the count is the ranks' mean of the stack's MoE
    layers)."""
    from megajax.model import moe

    m, p = cfg.model, cfg.parallel
    if not m.num_experts or (p.expert == 1 and not p.folded_experts):
        return {}
    tokens = cfg.train.micro_batch_size * m.seq_length // (p.expert_folds * p.context)  # (a rank's own tokens)
    row = m.hidden_size * (2 if m.compute_dtype != "float32" else 4)
    k, e = m.experts_per_token, m.num_experts
    # (under context parallelism a capacity's kept rows go as dropless ones: moe/layer.py's kept_in_sequences)
    factor = m.moe_capacity_factor if p.context == 1 else None
    buffer = moe.buffer_rows(tokens, k, e, p.expert_ranks, factor, p.expert_buffer_factor) * row
    again = _forwards_again(cfg, m.recompute == "full")
    ragged = m.moe_capacity_factor is None and p.expert_all_to_all == "ragged"
    # (the multi-token prediction modules' layers, MoE too, on the last pipeline rank)
    moe_layers = m.moe_layers // p.pipeline + (m.mtp_num_layers if p.pipeline == 1 else 0)
    return {"count": (4 + 2 * again) * moe_layers * cfg.num_micro_batches,
            "routed_bytes_each": tokens * k * row, "buffer_bytes_each": buffer,
            "exchange": "ragged-all-to-all" if ragged else "all-to-all",
            "bytes_each": min(tokens * k * row, buffer) if ragged else buffer,
            "axes": [a for a, n in (("expert", p.expert), ("tensor", p.expert_folds)) if n > 1]}


def _forwards_again(cfg, recomputed: bool) -> float:
    """The share of chunk forwards run twice: a 1F1B, interleaved or zero_bubble pipeline recomputes a chunk before
    its backward unless its forward kept the residuals, as the last chunk's does when its backward comes next (the
    schedule's recomputes, averaged over the ranks); else 1 where the layers are `recomputed`, or 0."""
    p = cfg.parallel
    if p.pipeline == 1 or p.schedule == "gpipe":
        return 1.0 if recomputed else 0.0
    from megajax.parallel.pipeline import ticks

    table = ticks.plan(p.schedule, p.pipeline, p.virtual_stages, cfg.num_micro_batches)[1]
    return float((table["r_chunk"] >= 0).sum()) / (p.pipeline * p.virtual_stages * cfg.num_micro_batches)


def expected_context_exchange(cfg, plan) -> dict:
    """What context parallelism's attention exchange moves over 'context' in one step, per device (analytic,
    compare with the program's collectives over 'context'). Per layer and micro batch, with KV = this device's
    keys and values (2 x micro batch x seq / context x kv heads / tensor x head dim in the compute dtype): the
    ring sends KV c - 1 times in the forward, c - 1 times in the backward, and the gradient buffer dK, dV (KV's
    size) c times; the all_gather exchange gathers c x KV in the forward and again in the backward and
    reduce-scatters c x KV of gradients; the a2a exchange sends the queries, keys, values (repeated to the query
    heads where theirs do not divide over tensor x context) and the output once each way, and their gradients in the
    backward; a2a+ring (a2a+all_gather) does that inside its groups of n and runs the ring (the all-gather) over
    c / n of them. A forward run again in the backward (full recomputation, or selective where the attention core
    is not a fused kernel on `platform`, kernels.auto.fused_attention) sends its c - 1 ring hops again, except the
    first, which is the backward's own first hop (the same collective on the same keys: XLA merges them), and its
    all-gather is the backward's. Under a 1F1B, interleaved or zero_bubble pipeline the forwards run again are the
    schedule's recomputes (`_forwards_again`, averaged over the ranks), whatever model.recompute says, and each
    repeats its all-to-alls and all-gathers (in another tick, nothing merges them). Exact for the H100 program
    (tests/test_context.py), under a pipeline with its branches counted as the schedule runs them."""
    from megajax.kernels import auto as kernel_choice
    from megajax.model.context import a2a_groups

    m, p = cfg.model, cfg.parallel
    c = p.context
    if c == 1:
        return {}
    kv = (2 * cfg.train.micro_batch_size * (m.seq_length // c) * (m.kv_heads // p.tensor) * m.head_dim
          * (2 if m.compute_dtype != "float32" else 4))
    layers = _busiest_rank_layers(cfg) * cfg.num_micro_batches
    comm, platform = plan.context_comm, plan.platform
    recomputed = m.recompute == "full" or (m.recompute == "selective" and not kernel_choice.fused_attention(
        m.attention_impl, m.head_dim, platform))
    again = _forwards_again(cfg, recomputed)
    # (a gather that a recomputed forward repeats is the backward's own without a pipeline: XLA merges the two; a
    # pipeline's schedule recomputes in another tick, whatever model.recompute says)
    gathers = 2 + _forwards_again(cfg, recomputed=False)
    ring = lambda kv, c: kv * (2 * (c - 1) + (c - 2 if recomputed else 0) + c)  # noqa: E731
    gathered = lambda kv, c: {"all-gather": gathers * c * kv, "reduce-scatter": c * kv}  # noqa: E731
    if comm == "ring":
        per_layer = {"collective-permute": ring(kv, c)}
    elif comm.startswith("a2a"):
        # the queries, keys, values and output each cross once in the forward, their gradients once in the backward,
        # and a recomputed core crosses again; keys and values whose heads do not divide are repeated to the queries'.
        # a2a+ring (a2a+all_gather): the same inside groups of n, then the ring (the all-gather) over c / n groups on
        # n times the tokens and 1 / n of the (moved) key-value heads
        t, n = p.tensor, plan.context_a2a
        groups = a2a_groups(m.num_heads, m.kv_heads, t * n)
        one = kv // (2 * (m.kv_heads // t))  # one head of this rank's tokens
        per_layer = {"all-to-all": one * 2 * (m.num_heads + groups) // t * (2 + again)}
        if comm == "a2a+ring":
            per_layer["collective-permute"] = ring(kv * groups // m.kv_heads, c // n)
        elif comm == "a2a+all_gather":
            per_layer.update(gathered(kv * groups // m.kv_heads, c // n))
    else:
        per_layer = gathered(kv, c)
    return {"exchange": comm, "kv_bytes_per_layer": kv, "bytes_per_step": {k: v * layers for k, v in per_layer.items()}}


def abstract_step(cfg, devices):
    """The train step's setup and abstract arguments (ShapeDtypeStructs with shardings) on `devices`:
    (config with the layout resolved, mesh, StepSetup, state, batch). Nothing is allocated."""
    import jax

    from megajax import step as step_lib
    from megajax.data.loader import abstract_batch

    setup = step_lib.setup_for(cfg, devices)
    cfg, mesh = setup.cfg, setup.mesh
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         setup.abstract_state, setup.state_shardings)
    return cfg, mesh, setup, state, abstract_batch(cfg, setup.batch_shardings)


def compile_step(cfg, devices, compiler_options: dict | None = None):
    """Lowers and compiles the train step for `cfg` on `devices` (real or compile-only), with XLA_FLAGS and
    `compiler_options` (XLA debug options by name, over XLA_FLAGS). Returns (the config with the layout
    resolved, the mesh, the compiled step, its StepSetup)."""
    import jax

    from megajax import quiet, step as step_lib

    cfg, mesh, setup, state, batch = abstract_step(cfg, devices)
    setup = step_lib.later_steps(setup)  # (with delayed FP8 scaling a run's first step runs another program)
    gpu = devices[0].platform != "cpu"  # (XLA's warnings explained: megajax/quiet.py)
    with jax.set_mesh(mesh), quiet.rewritten_stderr(quiet.explain_xla) if gpu else contextlib.nullcontext():
        compiled = step_lib.jit_train_step(setup).lower(state, batch).compile(compiler_options)
    return cfg, mesh, compiled, setup


def audit(cfg, target: str = "cpu", devices: int | None = None, dump_hlo: str | None = None) -> dict:
    import jax

    from megajax import hlo, metrics
    from megajax.parallel.pipeline import ticks

    if target == "cpu":
        devs = jax.devices()
        if devices is not None and devices != len(devs):
            raise ConfigError(f"--devices {devices} but JAX has {len(devs)} CPU devices: run through "
                             "`python -m megajax.audit` (it sets the count) or set jax_num_cpu_devices")
    else:
        if cfg.model.fp8 != "none" and target not in FP8_TARGETS:
            raise ConfigError(f"model.fp8={cfg.model.fp8}: the {target} target has no FP8 tensor cores (FP8 GEMMs need "
                              f"compute capability 8.9 or newer: {', '.join(sorted(FP8_TARGETS))}); set "
                              "model.fp8=none or use --target h100")
        devs = _gpu_devices(target, devices or 8)
    cfg, mesh, compiled, setup = compile_step(cfg, devs, TARGET_OPTIONS.get(target))
    text = compiled.as_text()
    if dump_hlo:
        Path(dump_hlo).write_text(text)
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, list):
        cost = cost[0] if cost else None
    runs = ticks.branch_runs(setup.plan, cfg.model)  # how often the schedule runs each branch of its switches
    colls = hlo.parse(text, dict(mesh.shape), None if target == "cpu" else GPUS_PER_HOST, runs)
    gemm = hlo.gemm_flops(text, runs)
    casts = hlo.fp8_casts(text)
    flops = metrics.step_flops(cfg.model, cfg.train.global_batch_size * cfg.model.seq_length,
                               pipelined=cfg.parallel.pipeline > 1, platform=mesh.devices.flat[0].platform)
    gib = 2**30
    memory = {
        "argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
        "temp_bytes": mem.temp_size_in_bytes, "alias_bytes": mem.alias_size_in_bytes,
        "peak_estimate_gib": (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
                              + mem.temp_size_in_bytes) / gib,
    }
    copies = hlo.copied_bytes(text, runs)  # (buffers XLA could not update in place)
    memory.update(copied_bytes_per_step=copies["per_step"], largest_copy_bytes=copies["largest"])
    if target != "cpu":
        capacity = _target_value(target, "device_memory_size")
        memory["device_memory_gib"] = capacity / gib
        memory["fits"] = memory["peak_estimate_gib"] * gib <= capacity
    p = cfg.parallel
    return {
        "target": target,
        "devices": len(devs),
        "layout": {"data": p.data, "pipeline": p.pipeline, "context": p.context, "tensor": p.tensor,
                   "expert": p.expert, "context_comm": p.context_comm,
                   "sequence_parallel": p.sequence_parallel, "virtual_stages": p.virtual_stages,
                   "schedule": p.schedule, "distributed_optimizer": p.shards_optimizer,
                   "sharding_strategy": p.sharding_strategy,
                   "num_distributed_optimizer_instances": p.num_distributed_optimizer_instances,
                   "micro_batches": cfg.num_micro_batches, "micro_batch_size": cfg.train.micro_batch_size},
        "memory_per_device": memory,
        "distributed_optimizer_sharded_fraction": (setup.zero_sharded_fraction() if p.shards_optimizer else None),
        "optimizer_state_bytes_per_device": setup.optimizer_bytes_per_device(),
        "parameter_bytes_per_device": setup.parameter_bytes_per_device(),
        "gradient_bytes_per_device": setup.gradient_bytes_per_device(),
        "collectives": hlo.summarize(colls),
        "xla_flops_per_device": (cost or {}).get("flops"),
        "megatron_flops_per_step": flops,
        "program_gemm_flops_per_device": gemm,
        "fp8": {"format": cfg.model.fp8, "gemms": gemm["gemms"], "fp8_gemms": gemm["fp8_gemms"],
                "fp8_flop_share": gemm["fp8"] / gemm["total"] if gemm["total"] else 0.0,
                # the fusions that cast to FP8, a step, and those that take the operand's amax in the same pass
                "casts": sum(n for _, n in casts), "casts_with_amax": sum(n for amax, n in casts if amax)},
        "megatron_hardware_flops_per_device": flops["hardware_flops"] / len(devs),
        "megatron_expected_tensor_collectives": megatron_expected(cfg),
        "expected_expert_all_to_all": expected_all_to_all(cfg),
        "expected_context_exchange": expected_context_exchange(cfg, setup.plan),
        "communication": (None if target == "cpu" else
                          communication(colls, target, cfg.model.compute_dtype, gemm["total"], cfg, setup.plan)),
    }


def lower_for(cfg, platform: str) -> dict:
    """Exports the train step for `platform` on this host's devices and counts the kernel custom calls.

    Each custom call appears once per site in the module (a kernel inside the layer scan counts once).
    """
    import jax

    from megajax import step as step_lib

    cfg, mesh, setup, state, batch = abstract_step(cfg, jax.devices())
    # for `platform`, not this host's devices: what differs by platform is left to the lowering (StepPlan.platform)
    setup = dataclasses.replace(setup, plan=dataclasses.replace(setup.plan, platform=None))
    # Kernel IR carries no compatibility guarantee: fine for an artifact that is inspected, not shipped.
    unchecked = [jax.export.DisabledSafetyCheck.custom_call(t) for t in KERNEL_CALL_TARGETS]
    with jax.set_mesh(mesh):
        exported = jax.export.export(step_lib.jit_train_step(setup), platforms=[platform],
                                     disabled_checks=unchecked)(state, batch)
    kernels: dict[str, dict] = {}
    others: dict[str, int] = {}
    for line in exported.mlir_module().splitlines():
        call = re.search(r"stablehlo\.custom_call @([\w$.]+)\(", line)
        if call is None:
            continue
        target = call.group(1)
        if target not in KERNEL_CALL_TARGETS:
            others[target] = others.get(target, 0) + 1
            continue
        entry = kernels.setdefault(target, {"count": 0, "names": {}})
        entry["count"] += 1
        name = re.search(r'\bname = "([^"]+)"', line)
        key = name.group(1) if name else "?"
        entry["names"][key] = entry["names"].get(key, 0) + 1
    return {"lowered_for": platform, "devices": mesh.size, "model": {
                "attention_impl": cfg.model.attention_impl, "norm_impl": cfg.model.norm_impl},
            "kernel_custom_calls": kernels, "other_custom_calls": others}


def compile_only_backend():
    """Before the first backend starts: the XLA flags train runs with, and the CPU as the backend (GPU targets are
    compile-only). Returns jax."""
    import os

    from megajax import quiet, xla_flags

    xla_flags.install()
    import jax

    if not os.environ.get("JAX_PLATFORMS"):
        jax.config.update("jax_platforms", "cpu")
    quiet.discover_plugins()
    return jax


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megajax.audit", description=__doc__.split("\n\n")[0])
    from megajax.config import io as config_io

    config_io.add_cli_arguments(parser)
    parser.add_argument("--target", choices=TARGETS, default="cpu",
                        help="cpu: this host's devices; a100/h100/h200: compile for those GPUs without one "
                             "(XLA's GPU compiler from the gpu-audit extra), memory and collectives as they would run")
    parser.add_argument("--devices", type=int, help="device count (default: the host's devices; 8 for GPUs)")
    parser.add_argument("--dump-hlo", metavar="FILE", help="also write the compiled HLO text here")
    parser.add_argument("--lower-for", choices=("cuda", "rocm"),
                        help="only export the train step for this platform and report its kernel custom calls")
    args = parser.parse_args(argv)
    if args.devices is not None and args.devices < 1:
        print(f"error: --devices {args.devices}: the count must be 1 or more (or leave it out: the host's devices, "
              "8 for GPUs)", file=sys.stderr)
        return 2

    jax = compile_only_backend()
    if args.target == "cpu" and args.devices:
        jax.config.update("jax_num_cpu_devices", args.devices)
    from megajax import config as config_lib
    from megajax.config import io as config_io

    try:
        cfg = config_io.load(args.config, args.set)
        if args.lower_for:
            report = lower_for(cfg, args.lower_for)
        else:
            report = audit(cfg, args.target, args.devices, args.dump_hlo)
    except config_lib.InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not args.lower_for:
        print(summary(report), file=sys.stderr)  # for a person; the JSON on stdout for scripts
    print(json.dumps(report, indent=2, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x))
    return 0


def summary(report: dict) -> str:
    """The audit in two or three lines: whether the step fits and its peak against the device, and (GPU targets)
    the communication a step, how much of it XLA left exposed, against the GEMMs' time at peak."""
    layout, mem = report["layout"], report["memory_per_device"]
    axes = " x ".join(f"{k} {layout[k]}" for k in ("data", "pipeline", "context", "tensor", "expert")
                      if layout.get(k, 1) > 1) or "one device"
    n = layout["micro_batches"]
    lines = [f"audit: {report['devices']} {report['target']} devices ({axes}), {n} micro batch{'es' if n != 1 else ''} "
             f"of {layout['micro_batch_size']}"]
    capacity = mem.get("device_memory_gib")
    fits = "fits" if mem.get("fits") else "does not fit"
    lines.append(f"memory: peak {mem['peak_estimate_gib']:.1f} GiB a device"
                 + (f" of {capacity:.1f}: {fits}" if capacity else ""))
    comm = report.get("communication")
    if comm:
        lines.append(f"communication: {_duration(comm['comm_s'])} a step, {_duration(comm['exposed_comm_s'])} of it "
                     f"exposed (not under a GEMM), against {_duration(comm['gemm_s_at_peak'])} of GEMMs at peak; "
                     "per collective in the JSON's communication.groups")
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    """A time for a person: milliseconds under a second (3 figures), else seconds with two decimals."""
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.2f} s"


if __name__ == "__main__":
    sys.exit(main())
