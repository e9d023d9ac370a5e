"""The sizes of one layout that the planner's terms read (`Layout`: one resolved config on GPUs of a node size), and
the parameters it holds on a GPU."""

from __future__ import annotations

import functools

from megajax.config import Config
from megajax.config.model import layer_forward_flops_per_token
from megajax.kernels import auto as kernel_choice
from megajax.parallel.step_plan import StepPlan

B16 = 2  # bytes of a bf16 activation


@functools.lru_cache(maxsize=None)
def parameter_counts(model) -> dict:
    """Parameters of the model: per layer's attention and dense MLP (their matmuls), the experts of one MoE layer,
    the shared experts and router, the embedding and output layer. Matmul weights only (norms and biases are
    below 0.1%)."""
    dense, _ = layer_forward_flops_per_token(model)
    h, mats = model.hidden_size, 3 if model.arch == "llama" else 2
    mlp = h * model.ffn_size * mats
    moe = model.moe_layers
    expert = h * model.moe_ffn_size * mats
    moe_active = (model.experts_per_token + model.moe_shared_experts) * expert + h * model.num_experts if moe else 0
    attention = dense / 2 - (moe * moe_active + (model.num_layers - moe) * mlp) / model.num_layers
    vocab = model.padded_vocab_size * h
    return {"attention": attention, "mlp": mlp, "dense_layers": model.num_layers - moe, "moe_layers": moe,
            "experts": model.num_experts * expert, "shared": model.moe_shared_experts * expert + h * model.num_experts,
            "embedding": vocab + (model.seq_length * h if model.arch == "gpt2" else 0),
            "output": 0 if model.tied else vocab}


class Layout:
    """The sizes of one resolved config that the planner's terms use."""

    def __init__(self, cfg: Config, gpus_per_node: int):
        m, p = cfg.model, cfg.parallel
        self.cfg, self.model, self.par, self.node = cfg, m, p, gpus_per_node
        self.plan = StepPlan.resolve(cfg, platform="gpu")  # the step's parallel decisions on the GPUs planned for
        self.t, self.c, self.pp, self.d, self.e = p.tensor, p.context, p.pipeline, p.data, p.expert
        self.r = p.num_distributed_optimizer_instances  # hybrid sharding's instances
        self.shards = p.shard_ranks  # the ranks ZeRO shards over (one instance's data x context)
        self.expert_shards = max(1, self.shards // (self.c * self.e))  # an expert weight's: data / expert of them
        self.b = cfg.train.micro_batch_size
        self.m = cfg.num_micro_batches
        self.tokens = self.b * m.seq_length // self.c  # one micro batch's tokens on this GPU's context shard
        self.layers = cfg.stage_split.busiest_rank_layers(p.pipeline)
        self.moe_share = m.moe_layers / m.num_layers if m.num_experts else 0.0
        # the experts' rows a token makes, on average: its k routed copies, times the capacity factor's headroom
        self.routed_copies = m.experts_per_token * (m.moe_capacity_factor or 1.0) if m.num_experts else 0.0
        self.sp = p.sequence_parallel and self.t > 1
        self.dtype = "float8" if m.fp8 != "none" else "bfloat16"
        # the ranks the embedding and output layer are split over (tensor, and the pipeline's with
        # StepPlan.vocab_over_pipeline)
        self.vocab_ranks = self.t * (self.pp if self.plan.vocab_over_pipeline else 1)
        self.unfused = not kernel_choice.fused_attention(m.attention_impl, m.head_dim, "gpu")


def local_parameters(L: Layout) -> dict:
    """Parameters on a GPU: its layers' matmuls over tensor (experts over expert x tensor; with a pipeline, as every
    rank holds them in one SPMD program: the largest chunk's slots in each of its chunks, and the dense first layers
    of a model with model.moe_first_dense_layers), and the
    embedding and output layer over tensor, and over the pipeline ranks with StepPlan.vocab_over_pipeline (else
    every stage holds them whole: megajax's pipeline is one SPMD program), and the multi-token prediction modules'
    layers (model.mtp_num_layers, every stage). {"dense": what the data ranks all hold,
    "experts": what data / expert of them hold, "total"}."""
    counts = parameter_counts(L.model)
    m = L.model
    if L.pp > 1:
        stacked = L.cfg.stage_split.slots * L.par.virtual_stages * m.layer_period
        moe = stacked // m.layer_period if m.num_experts else 0
        layers = stacked + m.first_dense_layers
    else:
        layers = L.layers
        moe = round(layers * L.moe_share)
    dense_layers = layers - moe
    experts = moe * counts["experts"] / (L.e * L.t)
    mtp = m.mtp_num_layers  # the multi-token prediction modules: every rank holds them, MoE where the model is
    if m.num_experts:
        experts += mtp * counts["experts"] / (L.e * L.t)
    other = ((layers * counts["attention"] + dense_layers * counts["mlp"] + moe * counts["shared"]) / L.t
             + mtp * (counts["attention"] + (counts["shared"] if m.num_experts else counts["mlp"])) / L.t
             + (counts["embedding"] + counts["output"]) / L.vocab_ranks)
    return {"dense": other, "experts": experts, "total": other + experts}


def zero_share(L: Layout, params: dict, total: float | None = None) -> float:
    """What ZeRO leaves a GPU of `total` of its local parameters (`local_parameters`' params; default: all of them;
    a part holding all the experts): the experts' over the data ranks that replicate them (L.expert_shards), the
    rest over L.shards."""
    total = params["total"] if total is None else total
    return (total - params["experts"]) / L.shards + params["experts"] / L.expert_shards
