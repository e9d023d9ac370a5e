"""The planner's analytical model of one layout: memory per GPU and a predicted step time, term by term.

Time, per GPU (docs/guides/choosing-a-layout.md#the-time-model lists every constant):
- GEMMs: each layer's matmuls at their shapes on this GPU (tokens x the tensor-split widths), at the GPU's
  large-GEMM rate times the wave efficiency (`Hardware.gemm_seconds`); the backward is two GEMMs of each.
- Attention's core: fused kernels (pallas, cudnn, auto's choice on GPUs) at the measured flash rate; xla's unfused
  attention as its batched GEMMs plus the fusions that write and read the [s, s] scores.
- Memory-bound work at the fused kernels' measured bandwidth: the norms, residuals and activations (bytes read and
  written by the fusions between GEMMs, per token), the loss over the vocabulary, gradient accumulation, AdamW,
  and FP8's casts of the GEMMs' operands.
- Copies at HBM bandwidth: megajax's layers run as a loop over stacked weights, and XLA copies each residual the
  forward saves into its [layers, ...] stack and the backward's GEMM operands (residuals and bf16 weights) out of
  it (`_layer_copies_s`; benchmarks/2026-11-27-h100.md traced them at 8-16% of a step); none with the loop
  unrolled (model.scan_layers=false, or null where StepPlan.unroll_layers unrolls on GPUs).
- Collectives as bytes over the link they cross at NCCL's bus bandwidth with ring factors, minus what runs under
  compute (tensor parallelism's rings under the GEMMs with tp_comm_overlap, the data-parallel reductions under the
  backward with overlap_grad_reduce, ...), and none of that for a program whose memory is above XLA's scheduling
  limit (`memory.XLA_SLOP`): XLA then schedules it for memory.
- The pipeline: the schedule's own clock (`megajax.parallel.pipeline.schedule`) with these per-action costs.

Memory, per GPU: megajax/plan/memory.py; the layout's sizes and parameters: megajax/plan/layout.py.
"""

from __future__ import annotations

import dataclasses
import functools

from megajax.config import Config
from megajax.model import context
from megajax.parallel.pipeline import schedule
from megajax.parallel.step_plan import StepPlan
from megajax.plan import memory
from megajax.plan.hardware import Hardware
from megajax.plan.layout import B16, Layout, local_parameters, parameter_counts, zero_share

# Bytes the fusions between GEMMs read and write per element, forward (the backward: twice that). Per element of
# the residual stream [tokens, hidden]: first norm (read, write), bias + residual add (read 2, write), second norm,
# second residual add = 10 reads and writes of 2 bytes. Per element of the MLP's hidden activation: the activation
# function reads its input(s) and writes its output (gelu 2, swiglu 3 tensors). GEMMs read their operands inside
# their own time.
RESIDUAL_BYTES = 10 * B16
# The unfused (xla) attention's [s, s] scores, bytes per element, as XLA's H100 program of gpt2-124m's step moves
# them (benchmarks/2026-11-27-planner.md counts each fusion): forward, the QK^T GEMM writes fp32 scores (4), the
# softmax's max and sum read them (4 + 4), the normalization reads them and writes bf16 probabilities (4 + 2);
# backward without recomputation, the dP GEMM writes bf16 (2) and the softmax's backward reads and writes 11.
# Selective recomputation runs the QK^T GEMM and both reductions again (12), and its backward transposes and
# converts the recomputed scores on the way (28 with dP). (The saved probabilities' stack copies under
# recompute=none are the copies term's.) Megatron-LM (the paper's runs, fp16): baddbmm writes the scores (2), its
# fused scale-mask-softmax reads them and writes the probabilities (2 + 2); backward, the probabilities'
# gradient written (2) and the fused softmax backward reading probabilities and gradient and writing dS (6).
SCORES_BYTES_FWD, SCORES_BYTES_BWD = 18, 13
SCORES_BYTES_RECOMPUTE, SCORES_BYTES_BWD_RECOMPUTED = 12, 28
MEGATRON_SCORES_BYTES = (6, 8)
# Dropout (model.attention_dropout, on the unfused attention's probabilities; model.dropout, on each block's two
# residual branches), per element: forward, the input read and the output written in bf16 and a mask byte (5),
# backward the gradient read and written and the mask read (5); on a residual branch the dropout rides in the
# bias-and-residual-add fusion, adding its mask byte each way. (The random bits' generation is not counted, nor
# the flash kernels' dropout, a hash per probability inside the tile: not measured on a GPU.)
DROPOUT_BYTES, RESIDUAL_DROPOUT_BYTES = 5, 2
# The share of ZeRO-2/3's per-micro-batch gathers and reduce-scatters that XLA's scheduled program hides under
# GEMMs at best (benchmarks/2026-11-26-compile-only-fsdp.md: 89% and 82%, Llama 3 8B on 8 H100s): what stays
# exposed is each forward's first gather and the embedding's and output layer's, which nothing runs under.
FSDP_HIDDEN = 0.85
LOGIT_BYTES = 10  # the loss: fp32 logits read twice (log-softmax, its backward), a bf16 gradient written
# FP8 (model.fp8): per element of each GEMM input x and weight w, the amax read (2) and the cast (read 2, write 1)
# in the forward and the FP8 copy transposed for a backward GEMM (read 1, write 1); per element of each output
# gradient dy, its amax, cast and transpose likewise (megajax.model.fp8: dx = dy_q w_q, dw = x_q^T dy_q).
FP8_CAST_BYTES_FWD, FP8_CAST_BYTES_BWD = 5, 2
FP8_GRAD_BYTES = 7
# Summing the micro batches' gradients: each micro batch's fp32 weight gradient is added to the accumulator (read
# both, write one), not fused into the weight-gradient GEMM (benchmarks/2026-11-27-h100.md: one add fusion per layer
# and micro batch). Megatron fuses it (gradient_accumulation_fusion): `estimate(..., framework="megatron")`.
GRAD_ACCUMULATION_BYTES = 12
ADAMW_BYTES = 28 + 8  # read weight, gradient, two moments, write three (fp32); the gradient norm's read and scale


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One layout's prediction. Times in seconds per step, memory in bytes per GPU."""

    step_s: float
    compute_s: dict  # gemm, attention, memory_bound, optimizer: the busiest GPU's own work
    bubble_s: float
    bubble_fraction: float
    exposed_s: dict  # per kind: tensor, context, pipeline, data, expert
    memory: dict  # weights, gradients, optimizer, activations, logits, reserve, total
    hardware_flops: float  # per GPU per step (with recomputation)
    model_flops: float
    scheduled_for_memory: bool = False  # above XLA's scheduling limit: counted without overlap
    vocab_over_pipeline: bool = False  # the plan's: the embedding and output layer split over the pipeline ranks


def _ring(n: int) -> float:
    """A ring all-gather's (or reduce-scatter's) bytes on the wire per byte of the whole buffer."""
    return (n - 1) / n if n > 1 else 0.0


def group_bandwidth(hw: Hardware, size: int, stride: int, gpus_per_node: int) -> float:
    """Bus bandwidth of a collective over `size` ranks `stride` apart (the mesh is data x pipeline x context x
    tensor, tensor innermost): NVLink when the group fits in a node, else the NICs of the group's members in one
    node, at most NVLink."""
    if size <= 1:
        return float("inf")
    if size * stride <= gpus_per_node:
        return hw.nvlink_bus_bytes_per_s
    per_node = max(1, gpus_per_node // stride)
    return min(hw.nvlink_bus_bytes_per_s, per_node * hw.network_bytes_per_s)


def all_to_all_bandwidth(hw: Hardware, size: int, stride: int, gpus_per_node: int) -> float:
    """The rate of an all-to-all over `size` ranks `stride` apart: NVLink inside a node; once the group spans
    nodes every GPU sends its own rows through its own NIC (no ring to share the NICs)."""
    return hw.nvlink_bus_bytes_per_s if size * stride <= gpus_per_node else hw.network_bytes_per_s


def _attention_widths(m) -> tuple[float, int]:
    """(the QKV projection's output width, the output projection's input width) of a layer, whole."""
    out_width = m.num_heads * m.value_dim
    return max(parameter_counts(m)["attention"] / m.hidden_size - out_width, 0), out_width


def _layer_gemm_s(hw: Hardware, L: Layout) -> float:
    """One layer's forward GEMMs for one micro batch (the MoE share of layers with their experts)."""
    m, t, T, dt = L.model, L.t, L.tokens, L.dtype
    h, mats = m.hidden_size, 3 if m.arch == "llama" else 2
    qkv_width, out_width = _attention_widths(m)
    s = hw.gemm_seconds(T, h, qkv_width // t, dt) + hw.gemm_seconds(T, out_width // t, h, dt)
    dense_mlp = (hw.gemm_seconds(T, h, (mats - 1) * m.ffn_size // t, dt)
                 + hw.gemm_seconds(T, m.ffn_size // t, h, dt))
    if not m.num_experts:
        return s + dense_mlp
    f, E = m.moe_ffn_size, m.num_experts
    ranks = L.par.expert_ranks  # ranks the experts are spread over
    split = 1 if L.par.folded_experts else t  # each expert's width split by tensor parallelism
    per_expert = max(1, int(T * L.routed_copies * L.e / E))  # tokens an expert receives from the pooled ranks
    local = E / ranks
    experts = (hw.gemm_seconds(per_expert, h, (mats - 1) * f // split, dt, local)
               + hw.gemm_seconds(per_expert, f // split, h, dt, local))
    shared = m.moe_shared_experts * f
    if shared:
        experts += hw.gemm_seconds(T, h, (mats - 1) * shared // t, dt) + hw.gemm_seconds(T, shared // t, h, dt)
    experts += hw.gemm_seconds(T, h, E, "bfloat16")  # the router
    return s + L.moe_share * experts + (1 - L.moe_share) * dense_mlp


def _attention_s(hw: Hardware, L: Layout, framework: str = "megajax") -> tuple[float, float, float]:
    """(forward, backward, selective recompute) of one layer's attention core for one micro batch. Causal: a
    fused kernel skips the masked half (forward 2 b s^2 h (k + v) / 2 FLOPs, backward 2.5 forwards); megajax does
    not recompute it (it keeps no scores), Megatron's selective recomputation reruns its forward. The unfused one
    computes the whole square: QK^T and PV forward, four GEMMs backward, and its fusions over the scores
    (SCORES_BYTES_*); recomputed, its two GEMMs and the softmax's reductions run again."""
    m = L.model
    heads = m.num_heads // L.t
    rows, keys = L.tokens, m.seq_length  # this context shard's queries against every key
    if not L.unfused:
        flops = 2 * rows * keys * heads * (m.head_dim + m.value_dim) / 2
        total = 3.5 * flops / hw.attention_rate(m.head_dim, m.seq_length // L.c)
        return total / 3.5, total * 2.5 / 3.5, total / 3.5 if framework == "megatron" else 0.0
    qk = hw.gemm_seconds(m.seq_length // L.c, m.head_dim, keys, "bfloat16", heads * L.b)
    pv = hw.gemm_seconds(m.seq_length // L.c, keys, m.value_dim, "bfloat16", heads * L.b)
    scores = rows * keys * heads / hw.elementwise_bytes_per_s  # seconds per byte of each score
    drop = DROPOUT_BYTES if m.attention_dropout else 0
    if framework == "megatron":
        fwd, bwd = MEGATRON_SCORES_BYTES
        return qk + pv + scores * (fwd + drop), 2 * (qk + pv) + scores * (bwd + drop), qk + pv + scores * drop
    recomputed = m.recompute == "selective"
    bwd = SCORES_BYTES_BWD_RECOMPUTED if recomputed else SCORES_BYTES_BWD
    return (qk + pv + scores * (SCORES_BYTES_FWD + drop), 2 * (qk + pv) + scores * (bwd + drop),
            qk + pv + scores * (SCORES_BYTES_RECOMPUTE + drop))


def _layer_memory_bound_s(hw: Hardware, L: Layout) -> float:
    """One layer's forward fusions for one micro batch (the backward: twice)."""
    m = L.model
    mats = 3 if m.arch == "llama" else 2
    ffn = (1 - L.moe_share) * m.ffn_size + L.moe_share * (m.experts_per_token + m.moe_shared_experts) * (
        m.moe_ffn_size if m.num_experts else 0)
    residual = L.tokens * m.hidden_size / (L.t if L.sp else 1) * (
        RESIDUAL_BYTES + (RESIDUAL_DROPOUT_BYTES if m.dropout else 0))
    hidden = L.tokens * ffn / L.t * mats * B16
    return (residual + hidden) / hw.elementwise_bytes_per_s


def _layer_gemm_operands(L: Layout) -> tuple[float, float, float]:
    """(input elements, output elements, weight elements) of one layer's GEMMs for one micro batch on this GPU;
    MoE layers (their share) with each routed copy of a token and the shared experts."""
    m, t, T = L.model, L.t, L.tokens
    h, mats = m.hidden_size, 3 if m.arch == "llama" else 2
    counts = parameter_counts(m)
    qkv_width, out_width = _attention_widths(m)
    inputs, outputs = T * (h + out_width / t), T * (qkv_width / t + h)
    mlp_in = lambda f, split: T * (h + f / split)  # noqa: E731 - one MLP's GEMM inputs and outputs
    mlp_out = lambda f, split: T * ((mats - 1) * f / split + h)  # noqa: E731
    dense = (mlp_in(m.ffn_size, t), mlp_out(m.ffn_size, t), counts["mlp"] / t)
    if m.num_experts:
        copies = L.routed_copies
        split = 1 if L.par.folded_experts else t
        shared = m.moe_shared_experts * m.moe_ffn_size
        moe = (copies * mlp_in(m.moe_ffn_size, split) + mlp_in(shared, t),
               copies * mlp_out(m.moe_ffn_size, split) + mlp_out(shared, t),
               counts["experts"] / (L.e * L.t) + counts["shared"] / t)
        dense = tuple(L.moe_share * a + (1 - L.moe_share) * b for a, b in zip(moe, dense))
    return inputs + dense[0], outputs + dense[1], counts["attention"] / t + dense[2]


def _layer_fp8_s(hw: Hardware, L: Layout, operands: tuple[float, float, float]) -> tuple[float, float]:
    """(forward, backward) of one layer's FP8 operand casts for one micro batch (0 without model.fp8), from its
    GEMMs' `operands` (`_layer_gemm_operands`)."""
    if L.dtype != "float8":
        return 0.0, 0.0
    x, dy, w = operands
    rate = hw.elementwise_bytes_per_s
    return (FP8_CAST_BYTES_FWD * (x + w) / rate,
            (FP8_CAST_BYTES_BWD * (x + w) + FP8_GRAD_BYTES * dy) / rate)


def _layer_copies_s(hw: Hardware, L: Layout, saved: float, weights: float) -> tuple[float, float]:
    """(forward, backward) of one layer's copies for one micro batch, at HBM bandwidth (each copy reads and
    writes its bytes): the forward copies the `saved` residual bytes into the layer stacks, the backward copies
    them out again with the layer's bf16 `weights` (elements; its GEMMs' operands; XLA's H100 program of llama-1b
    copies about 3/4 of the saved bytes out, the rest its fusions read in place: counted whole)."""
    weight_bytes = weights * (1 if L.dtype == "float8" else B16)
    return 2 * saved / hw.hbm_bytes_per_s, 2 * (saved + weight_bytes) / hw.hbm_bytes_per_s


def _head_s(hw: Hardware, L: Layout) -> float:
    """The output layer and the loss for one micro batch, forward and backward (vocabulary split over tensor; with
    the vocabulary over the pipeline, over its ranks too, which then share the last stage's output and send its
    gradient back, and the first stage's rows: four all-reduces of [tokens, hidden] over the pipeline ranks)."""
    m = L.model
    vocab = m.padded_vocab_size // L.vocab_ranks
    gemm = 3 * hw.gemm_seconds(L.tokens, m.hidden_size, vocab)  # (bf16: model.fp8 covers the layers' matmuls)
    out = gemm + L.tokens * vocab * LOGIT_BYTES / hw.elementwise_bytes_per_s
    if L.plan.vocab_over_pipeline:
        nbytes = L.tokens * m.hidden_size * B16
        out += 4 * _collective_s(nbytes, 2 * _ring(L.pp), group_bandwidth(hw, L.pp, L.t * L.c, L.node))
    return out


def _collective_s(nbytes: float, ring: float, bandwidth: float) -> float:
    return nbytes * ring / bandwidth if bandwidth != float("inf") else 0.0


def _tensor_comm_s(hw: Hardware, L: Layout) -> float:
    """One layer's tensor-parallel traffic for one micro batch, forward (the backward moves the same): two
    all-reduces of [tokens, hidden] (with sequence parallelism an all-gather and a reduce-scatter each, the same
    bytes) in a ring of t."""
    if L.t == 1:
        return 0.0
    nbytes = L.tokens * L.model.hidden_size * B16
    bw = group_bandwidth(hw, L.t, 1, L.node)
    return 2 * _collective_s(nbytes, 2 * _ring(L.t), bw)


def _context_comm_s(hw: Hardware, L: Layout) -> tuple[float, float]:
    """One layer's context-parallel exchange for one micro batch, forward, as (all-to-alls, ring): the ring passes
    this shard's keys and values c - 1 times (the backward: about twice that); the a2a exchange sends (c - 1) / c of
    the queries, keys, values (repeated to the query heads where theirs do not divide over tensor x context) and
    output, and as much in the backward; a2a+ring does that inside groups of n adjacent ranks and passes the
    group's keys and values for 1 / n of the heads around a ring of c / n, n x t GPUs apart (a2a+all_gather
    gathers them over the same ranks: the same bytes)."""
    if L.c == 1:
        return 0.0, 0.0
    m = L.model
    n = L.plan.context_a2a
    ring, a2a = L.c // n, 0.0
    heads = m.kv_heads
    if n > 1:
        heads = context.a2a_groups(m.num_heads, m.kv_heads, L.t * n)
        moved = L.tokens * m.head_dim * B16 * 2 * (m.num_heads + heads) / L.t
        a2a = moved * (n - 1) / n / all_to_all_bandwidth(hw, n, L.t, L.node)
    kv = 2 * L.tokens * (heads // L.t) * m.head_dim * B16
    return a2a, (ring - 1) * kv / group_bandwidth(hw, ring, L.t * n, L.node)


def _pipeline_send_s(hw: Hardware, L: Layout) -> float:
    """One micro batch's activation (or gradient) sent to the next stage: [tokens, hidden] (split over tensor
    with sequence parallelism; else each tensor rank sends the whole over its own link) between stages t x c GPUs
    apart. In the lock step a tick waits for its slowest send: over the network once the stages span nodes."""
    if L.pp == 1:
        return 0.0
    nbytes = L.tokens * L.model.hidden_size * B16 / (L.t if L.sp else 1)
    stride = L.t * L.c
    bw = hw.nvlink_bus_bytes_per_s if stride * L.pp <= L.node else hw.network_bytes_per_s
    return nbytes / bw


def _data_comm_s(hw: Hardware, L: Layout, params: dict) -> tuple[float, float, float]:
    """(reduction per step, gather per step, per micro batch) data-parallel traffic: the fp32 gradients' reduction
    (an all-reduce, or the distributed optimizer's reduce-scatter and weight all-gather: the same bytes) once a
    step; ZeRO-2 and 3 reduce every micro batch and ZeRO-3 gathers the weights (bf16) before each forward and
    backward. With hybrid sharding (L.r instances) the scatters and gathers run inside an instance and the
    instances all-reduce their gradient shards once a step."""
    par = L.par
    ranks = L.shards
    stride = L.pp * L.c * L.t if L.d > 1 else L.t  # (context ranks, tensor apart, reduce with the data ranks)
    bw = group_bandwidth(hw, ranks, stride, L.node)
    inner_e = L.expert_shards  # an expert weight's data ranks in one instance
    bw_e = group_bandwidth(hw, inner_e, stride * L.e, L.node)
    grads = _collective_s(4 * params["dense"], 2 * _ring(ranks), bw) + _collective_s(
        4 * params["experts"], 2 * _ring(inner_e), bw_e)
    across = 0.0
    if L.r > 1:  # every instance's shards all-reduced over the instances, the data ranks of one instance apart
        bw_r = group_bandwidth(hw, L.r, stride * L.d // L.r, L.node)
        across = _collective_s(4 * zero_share(L, params), 2 * _ring(L.r), bw_r)
    if par.shards_grads:
        # ZeRO-3 gathers the bf16 weights for every forward and backward; under a pipeline once a step, in the
        # schedule's ticks (kept whole for the step), as ZeRO-2 and ZeRO-1 gather their fp32 shards' bf16 casts
        again = par.shards_params and L.pp == 1
        # (an expert's weights over its data ranks, expert apart: across nodes on fewer NICs)
        gathers = (_collective_s(2 * 2 * params["dense"], _ring(ranks), bw)
                   + _collective_s(2 * 2 * params["experts"], _ring(inner_e), bw_e))
        per_micro = grads / 2 + (gathers if again else 0.0)
        return (0.0 if again else grads / 2) + across, 0.0, per_micro
    # the distributed optimizer: half of it the weights' all-gather after the update
    gather = grads / 2 if par.shards_optimizer else 0.0
    return grads - gather + across, gather, 0.0


def _expert_comm_s(hw: Hardware, L: Layout) -> float:
    """One MoE layer's all-to-alls for one micro batch, forward (dispatch and combine of tokens x k rows; the
    backward moves the same), over the ranks that hold the experts."""
    m = L.model
    if not m.num_experts:
        return 0.0
    ranks = L.par.expert_ranks
    if ranks == 1:
        return 0.0
    tokens = L.tokens // L.par.expert_folds
    nbytes = tokens * L.routed_copies * m.hidden_size * B16
    stride = 1 if L.par.folded_experts else L.pp * L.c * L.t
    return 2 * _collective_s(nbytes, _ring(ranks), all_to_all_bandwidth(hw, ranks, stride, L.node))


def _overlapped(comm: float, under: float, on: bool, first_step: float = 0.0) -> float:
    """What of `comm` stays exposed: all of it, or with the overlap on what `under` (the compute it runs beneath)
    cannot hide, and at least `first_step` (a ring's first step, which nothing precedes)."""
    return max(comm - under, first_step) if on else comm


def estimate(cfg: Config, hw: Hardware, gpus_per_node: int, simulate: bool = True,
             framework: str = "megajax") -> Estimate:
    """The prediction for a resolved config (`Config.for_devices`). `simulate`: the pipeline's bubble from the
    schedule's clock (`megajax.parallel.pipeline.schedule`), else from the paper's formula (the search's first pass).
    framework="megatron" predicts Megatron-LM's run of the layout (the SC21 paper's): no layer-stack copies, and
    the gradient accumulation fused into the weight-gradient GEMM."""
    from megajax import metrics

    L = Layout(cfg, gpus_per_node)
    m, par = L.model, L.par
    gemm_f = _layer_gemm_s(hw, L)
    attn_f, attn_b, attn_r = _attention_s(hw, L, framework)
    mem_f = _layer_memory_bound_s(hw, L)
    operands = _layer_gemm_operands(L)
    fp8_f, fp8_b = _layer_fp8_s(hw, L, operands)
    saved = memory.layer_activation_bytes(L)[m.recompute]
    # unrolled layers keep their residuals in place
    stacked = framework == "megajax" and not L.plan.unroll_layers
    copy_f, copy_b = _layer_copies_s(hw, L, saved, operands[2]) if stacked else (0.0, 0.0)
    a2a = _expert_comm_s(hw, L) * L.moe_share
    params = local_parameters(L)
    mem = memory.per_gpu(hw, L, params, memory.in_flight(cfg))
    packed = memory.scheduled_for_memory(mem)  # then XLA hides nothing
    tp_f, tp_b, cp_f, cp_b = _layer_comm_exposed_s(hw, L, gemm_f, attn_f, attn_b, packed)
    fwd = gemm_f + attn_f + mem_f + fp8_f + copy_f + tp_f + cp_f + a2a
    bwd = 2 * gemm_f + attn_b + 2 * mem_f + fp8_b + copy_b + tp_b + cp_b + a2a
    if L.pp > 1:  # the executor recomputes every chunk's forward before its backward (it stashes chunk inputs):
        # the recompute saves the residuals into the chunk's stacks, the first forward saves nothing
        again = fwd + (attn_r if m.recompute == "selective" else 0.0)
        fwd -= copy_f
    else:  # full recomputation rebuilds a layer's residuals inside its backward, not into a stack
        again = {"full": fwd - copy_f, "selective": attn_r, "none": 0.0}[m.recompute]
    # the head, and each multi-token prediction module's layer and head after it (on the last stage)
    head = _head_s(hw, L) * (1 + m.mtp_num_layers) + m.mtp_num_layers * (fwd + again + bwd)
    send = _pipeline_send_s(hw, L)
    layers = L.layers
    if L.pp == 1:
        compute_mb = layers * (fwd + again + bwd) + head
        step_compute, bubble = L.m * compute_mb, 0.0
    else:
        step_compute, bubble = _pipeline(L.plan, fwd, again, bwd, head, send, simulate)
    reduce_s, gather_s, per_micro = _data_comm_s(hw, L, params)
    idle = bubble / 2 if L.pp > 1 else 0.0  # the cool-down's (warm-up's) idle ticks on the busiest rank
    fsdp = per_micro if packed else max(per_micro - layers * (fwd + bwd), (1 - FSDP_HIDDEN) * per_micro)
    # (ZeRO-2/3's reduction a step is hybrid sharding's all-reduce of the shards after the micro batches: exposed)
    hides = par.overlap_grad_reduce and not par.shards_grads and not packed
    data = (_overlapped(reduce_s, idle + layers * bwd, hides)
            + _overlapped(gather_s, idle + layers * fwd, par.overlap_param_gather and not packed) + L.m * fsdp)
    optimizer, accumulate = _optimizer_s(hw, L, params, framework)
    step = step_compute + data + optimizer + accumulate
    micro = step_compute - bubble  # the busiest GPU's own work
    per_layer_exposed = L.m * layers
    reruns_forward = L.pp > 1 or m.recompute == "full"  # with its collectives
    exposed = {"tensor": per_layer_exposed * (tp_f + tp_b + (tp_f if reruns_forward else 0.0)),
               "context": per_layer_exposed * (cp_f + cp_b), "expert": per_layer_exposed * 2 * a2a,
               "pipeline": 2 * send * (L.m * par.virtual_stages + L.pp - 1) if L.pp > 1 else 0.0,
               "data": data}
    tokens = cfg.train.global_batch_size * m.seq_length
    flops = metrics.step_flops(m, tokens, pipelined=L.pp > 1, platform="gpu")
    gpus = L.d * L.pp * L.c * L.t
    runs = L.m * layers  # (layer, micro batch) pairs on the busiest GPU
    return Estimate(
        step_s=step, bubble_s=bubble, bubble_fraction=bubble / max(micro, 1e-30), exposed_s=exposed,
        compute_s={"gemm": runs * 3 * gemm_f, "attention": runs * (attn_f + attn_b),
                   "memory_bound": runs * 3 * mem_f, "fp8_casts": runs * (fp8_f + fp8_b),
                   "copies": runs * (copy_f + copy_b), "recompute": runs * again, "head": L.m * head,
                   "grad_accumulation": accumulate, "optimizer": optimizer, "schedule": step_compute},
        memory=mem, hardware_flops=flops["hardware_flops"] / gpus,
        model_flops=flops["model_flops"] / gpus, scheduled_for_memory=packed,
        vocab_over_pipeline=L.plan.vocab_over_pipeline)


def _layer_comm_exposed_s(hw: Hardware, L: Layout, gemm_f: float, attn_f: float, attn_b: float,
                          packed: bool) -> tuple[float, float, float, float]:
    """One layer's exposed tensor and context communication for one micro batch: (tensor forward, backward,
    context forward, backward). `packed`: XLA schedules the program for memory and hides nothing."""
    tp, (a2a, cp) = _tensor_comm_s(hw, L), _context_comm_s(hw, L)
    overlap_tp = L.par.tp_comm_overlap and L.sp and not packed
    if overlap_tp and L.t > L.node:  # the ring's ppermutes: a hop between nodes has one NIC, not all of them
        tp *= group_bandwidth(hw, L.t, 1, L.node) / hw.network_bytes_per_s
    first = tp / L.t if L.t > 1 else 0.0
    tp_f, tp_b = _overlapped(tp, gemm_f, overlap_tp, first), _overlapped(tp, 2 * gemm_f, overlap_tp, first)
    # (attention waits for its all-to-alls, counted whole: a2a's head parts hide some of them, 15-40% of the
    # exposed time at 32k on compile-only H100s, less than a part's share; a ring's hops run under its blocks; the
    # all-gather exchange's head parts each gather under the part before, the first part's waits; a2a+all_gather's
    # gathers run whole, with nothing under them in the compiled H100 programs)
    comm = L.plan.context_comm
    if packed or comm == "a2a+all_gather":
        return tp_f, tp_b, a2a + cp, a2a + 2 * cp
    first = cp / context.head_parts(L.model.kv_heads, L.t) if comm == "all_gather" else 0.0
    return tp_f, tp_b, a2a + first + max(cp - first - attn_f, 0.0), a2a + first + max(2 * cp - first - attn_b, 0.0)


def _optimizer_s(hw: Hardware, L: Layout, params: dict, framework: str) -> tuple[float, float]:
    """(AdamW's update of this GPU's share of its local parameters `params`, the micro batches' gradient
    accumulation: none in Megatron's fused accumulation)."""
    n_local = params["total"]
    updated = zero_share(L, params) if L.par.shards_optimizer else n_local
    optimizer = (ADAMW_BYTES * updated + 6 * n_local) / hw.elementwise_bytes_per_s
    accumulated = zero_share(L, params) if L.par.shards_grads else n_local  # ZeRO-2/3 accumulate their shard
    accumulate = (L.m * GRAD_ACCUMULATION_BYTES * accumulated / hw.elementwise_bytes_per_s
                  if L.m > 1 and framework == "megajax" else 0.0)
    return optimizer, accumulate


def _pipeline(plan: StepPlan, fwd: float, again: float, bwd: float, head: float, send: float,
              simulate: bool) -> tuple[float, float]:
    """(the busiest rank's schedule time, its bubble) in seconds: per layer f, r, b and the head (its forward and
    backward, run in the last chunk's forward) on the schedule's clock, each chunk's send added to its forward and
    backward."""
    p, v, m = plan.pipeline, plan.virtual_stages, plan.micro_batches
    split = plan.stage_split.layers
    chunk = sum(split) / (p * v)
    f, r, b = fwd + send / chunk, again, bwd + send / chunk
    ideal = m * v * chunk * (f + r + b) + m * head
    if not simulate:
        name = "zero_bubble" if plan.schedule == "zero_bubble" else "1f1b"
        bubble = schedule.formula(name, p, v, m) * ideal
        return ideal + bubble, bubble
    costs = schedule.Costs(f=1.0, r=r / f, b=b / f, w=b / (2 * f), layers=tuple(split), head=head / (f + b))
    s = _built(plan.schedule, p, v, m)
    unit = f * sum(split) / p  # one forward of an average stage
    total = s.step_time(costs) * unit
    return total, total - s.ideal(costs) * unit


@functools.lru_cache(maxsize=256)
def _built(name: str, p: int, v: int, m: int):
    return schedule.build(name, p, v, m)
