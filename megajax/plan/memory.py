"""The planner's memory model of one layout, per GPU: fp32 weights, gradients and AdamW moments as the data ranks
shard them, the activations the schedule keeps (what megajax's layer keeps for each recompute mode,
`layer_activation_bytes`), the logits, a reserve for workspaces XLA's estimate leaves out, and the limit above which
XLA's GPU compiler schedules the program for memory (`scheduling_limit`)."""

from __future__ import annotations

from megajax.config import Config
from megajax.parallel.pipeline import schedule
from megajax.plan.hardware import GIB, Hardware
from megajax.plan.layout import B16, Layout, parameter_counts, zero_share

RESERVE_BYTES = 3 * GIB  # cuBLAS / NCCL workspaces and fragmentation, outside XLA's memory analysis

# XLA's GPU compiler schedules a program for memory, not for overlap, once it needs more than a limit
# (xla/service/gpu/gpu_hlo_schedule.cc, GetSchedulerMemoryLimit): 80% of the device's memory less the program's
# inputs and outputs (the donated fp32 weights and AdamW moments), times xla_gpu_memory_limit_slop_factor (95 by
# default); the inputs and outputs come on top. On an H100 with 11.2 GiB of them that is 60.67 GiB, the figure of
# XLA's "Can't reduce memory use below 60.67GiB by rematerialization"
# (benchmarks/2026-11-26-compile-only-fsdp-after-keeps-inputs.md). Above it the latency-hiding scheduler hid
# nothing in two of the three programs compiled there (0%; the third, ZeRO-1's overlapped reduce, 54%): the model
# counts no overlap above it.
XLA_DEVICE_SHARE, XLA_SLOP = 0.80, 0.95


def layer_activation_bytes(L: Layout) -> dict:
    """Bytes one layer's backward keeps for one micro batch on this GPU, as megajax's layer saves them (counted
    from its code: tests/test_plan.py checks the count against JAX's saved residuals, and
    benchmarks/2026-11-26-compile-only-activation-memory.md against XLA's H100 program):
    {"none": without recomputation, "selective": attention's core recomputed, "full": the layer's input}.

    Per token, bf16 unless said: each norm's input (sequence parallelism splits it over t); each column-parallel
    matmul's input, the norms' outputs (gathered whole with sequence parallelism, except that the collective
    matmuls of tp_comm_overlap keep the local shard and gather again in the backward); attention's queries, keys,
    values and output, and the fused kernels' log-sum-exp (fp32 a head); the unfused (xla) attention's scores,
    11 bytes each (the causal mask, two fp32 copies, the bf16 probabilities), which selective recomputation drops;
    the MLP's input to its activation and its output (SwiGLU: gate and up, 3 x ffn; GeLU 2 x ffn: the activations
    keep only their input, megajax.model.layers.gelu); a mask byte for each of the two residual dropouts. MoE
    layers keep the same for each routed copy of a token (k x capacity factor) and the routing's buffers (counted
    at expert 1 and tensor 1; the exchanges of expert parallelism and their receiving buffers are not: counting
    them moved the planner's compiles for DeepSeek-V3 onto a slower layout, see docs/features/planner.md).
    Multi-latent attention's latent projections are not counted (a few percent)."""
    m, t, T = L.model, L.t, L.tokens
    h = m.hidden_size
    r = 1 / t if L.sp else 1.0  # the residual stream's share on this GPU
    gemm_in = 1 / t if L.sp and L.par.tp_comm_overlap else 1.0
    per_token = 2 * B16 * h * r + 2 * B16 * h * gemm_in
    heads, kv = m.num_heads / t, m.kv_heads / t
    per_token += B16 * (heads * (m.head_dim + m.value_dim) + kv * (m.head_dim + m.value_dim))
    core = 11 * heads * m.seq_length if L.unfused else 4 * heads  # the scores, or the log-sum-exp
    per_token += 2 * h * r if m.dropout else 0.0
    mlp = (3 if m.arch == "llama" else 2) * B16
    dense = mlp * m.ffn_size / t
    if m.num_experts:
        k, factor, copies = m.experts_per_token, m.moe_capacity_factor, L.routed_copies
        split = 1 if L.par.folded_experts else t
        # the experts' rows (with a capacity: the dispatched buffer and its copy), their MLPs, the shared experts';
        # the routed copies sorted by expert and unsorted ([tokens x k, hidden], bf16 each), the router's fp32 input
        # and probabilities
        moe = (copies * (B16 * h * (2 if factor else 1) + mlp * m.moe_ffn_size / split)
               + mlp * m.moe_shared_experts * m.moe_ffn_size / t + 2 * B16 * k * h
               + 4 * h + 4 * m.num_experts)
        per_token += L.moe_share * moe + (1 - L.moe_share) * dense
    else:
        per_token += dense
    none = T * (per_token + core)
    selective = T * (per_token + (0.0 if L.unfused else core))
    return {"none": none, "selective": selective, "full": T * B16 * h * r}


def split_backward_bytes(L: Layout, chunk: int) -> float:
    """Bytes the zero-bubble schedule keeps between a chunk's B and its W beyond what another schedule keeps: each
    weight matmul's output gradient (zero_bubble.SplitChunkActions' `dys`) for one chunk (of `chunk` layers) and
    micro batch, bf16: the column-parallel outputs (queries, keys and values; the MLP's up projections) split over
    tensor, the row-parallel ones (attention's output, the MLP's down projection) whole. The experts' matmuls are
    not split (their gradients come with B)."""
    m, t = L.model, L.t
    attention = (m.num_heads * m.head_dim + 2 * m.kv_heads * m.head_dim) / t + m.hidden_size
    mlp = (2 if m.arch == "llama" else 1) * m.ffn_size / t + m.hidden_size
    per_token = attention + (1 - L.moe_share) * mlp
    return B16 * per_token * L.tokens * chunk


def per_gpu(hw: Hardware, L: Layout, params: dict, in_flight: int) -> dict:
    """Bytes per GPU: fp32 weights (ZeRO-3 and overlap_param_gather: sharded) and the bf16 copy the backward
    keeps (ZeRO-3: of the shards; none under full recomputation: each layer casts its weights again; a pipeline
    that gathers its weights in the schedule, ZeRO-3's too: every layer of the rank, gathered), fp32
    gradients (ZeRO-2/3: the layers' sharded; with overlap_grad_reduce and several micro batches one more copy),
    AdamW's two fp32 moments (sharded with the distributed optimizer), the activations
    (`layer_activation_bytes`; the zero-bubble schedule's output gradients, `split_backward_bytes`), the logits,
    the reserve; and XLA's scheduling limit for this program."""
    par, m = L.par, L.model
    n = params["total"]
    shard = lambda x: zero_share(L, params, x)  # noqa: E731  (an expert's over the data ranks that replicate it)
    acts = layer_activation_bytes(L)
    stash, kept_per_layer = acts["full"], acts[m.recompute]
    working = acts["none"] if m.recompute == "full" else 0.0  # the one layer full recomputation rebuilds
    chunk = L.layers // L.par.virtual_stages
    # the layers whose bf16 weights the backward keeps: all of them, or (a pipeline recomputes chunk by chunk) one
    # chunk's; under full recomputation none (a layer's cast is rebuilt with it)
    counts = parameter_counts(m)
    ends = (counts["embedding"] + counts["output"]) / L.vocab_ranks  # the embedding's and output layer's weights here
    per_layer = (n - ends) / max(L.layers, 1)
    cast_layers = 0 if m.recompute == "full" else (chunk if L.pp > 1 else L.layers)
    if par.shards_params and L.pp == 1:  # the bf16 casts of the layers' shards, which each layer's backward gathers
        cast = 0.0 if m.recompute == "full" else B16 * shard(n - ends)
    else:
        cast = B16 * (n - per_layer * (L.layers - cast_layers))
    if L.pp > 1 and L.plan.gather_in_forward:
        # a pipeline that gathers its weights inside the schedule (overlap_param_gather) holds every layer of the
        # rank gathered in bf16 from its first forward to the step's end (the executor's carry "whole"); with
        # one chunk a rank the backward keeps that one, with more each chunk's backward keeps its slice besides
        cast += B16 * per_layer * (L.layers - (cast_layers if L.par.virtual_stages == 1 else 0))
    # fp32 weights: ZeRO-3 keeps every one as its shard; overlap_param_gather the distributed optimizer's shard
    # (on a pipeline, of the layers only), gathered in the first forward (megajax.step.StepSetup.gathered_params)
    if par.shards_params or (par.overlap_param_gather and par.shards_optimizer and L.pp == 1):
        weights = 4 * shard(n) + cast
    elif par.overlap_param_gather and par.shards_optimizer:
        weights = 4 * (shard(n - ends) + ends) + cast
    else:
        weights = 4 * n + cast
    # ZeRO-2/3 reduce-scatter the layers' gradients into their shards; the embedding's and output layer's stay
    # whole but where StepPlan.shard_ends (StepSetup.gradient_bytes_per_device)
    whole = 0.0 if L.plan.shard_ends else ends
    grads = 4 * (shard(n - whole) + whole if par.shards_grads else n) * (
        2 if par.overlap_grad_reduce and L.m > 1 else 1)
    optimizer = 8 * (shard(n) if par.shards_optimizer else n)
    if L.pp > 1:  # chunk inputs in flight; the chunk being recomputed holds its layers' residuals for its backward
        kept = in_flight * stash + chunk * kept_per_layer + working
        kept += split_backward_bytes(L, chunk) if L.plan.schedule == "zero_bubble" else 0.0
    else:
        kept = (L.layers + m.mtp_num_layers) * kept_per_layer + working  # (and the prediction modules' layers)
    # the logits' loss, and each multi-token prediction module's beside it until the backward
    logits = L.tokens * (m.padded_vocab_size // L.vocab_ranks) * 10 * (1 + m.mtp_num_layers)
    out = {"weights": weights, "gradients": grads, "optimizer": optimizer, "activations": kept, "logits": logits,
           "reserve": RESERVE_BYTES}
    out["total"] = sum(out.values())
    out["capacity"] = hw.memory_bytes
    out["scheduling_limit"] = scheduling_limit(weights - cast + optimizer, hw.memory_bytes)  # (the step's inputs)
    return out


def scheduling_limit(inputs: float, capacity: float) -> float:
    """XLA's scheduling limit in bytes (`XLA_SLOP`) for a program whose inputs and outputs (aliased ones once)
    take `inputs` bytes of a GPU's `capacity`."""
    return inputs + XLA_SLOP * (XLA_DEVICE_SHARE * capacity - inputs)


def scheduled_for_memory(memory: dict) -> bool:
    """Whether XLA's GPU compiler would schedule this program for memory (`XLA_SLOP`): what it allocates, less
    the reserve that XLA's own count leaves out, above its scheduling limit."""
    return memory["total"] - memory["reserve"] > memory["scheduling_limit"]


def in_flight(cfg: Config) -> int:
    """Micro batches whose chunk inputs the first pipeline rank keeps at once: p for 1F1B, Megatron's
    (v - 1) p + 2 (p - 1) + 1 chunks for interleaved (capped at m v)."""
    p, v, m = cfg.parallel.pipeline, cfg.parallel.virtual_stages, cfg.num_micro_batches
    if p == 1:
        return 1
    if cfg.parallel.schedule == "interleaved" or v > 1:
        return schedule.interleaved_depth(p, v, m, 0)
    return min(m, p)
