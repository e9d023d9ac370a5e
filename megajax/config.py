"""The configuration tree: frozen dataclasses, YAML presets and `--set a.b=c` overrides.

Every section checks itself in `__post_init__`; `Config.__post_init__` checks what needs two sections
(heads vs tensor parallelism, layers vs pipeline stages, batch vs data parallelism). Checks that need the
device count run in `Config.for_devices`, before anything is compiled. Every error names the fix.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml


class InputError(ValueError):
    """Bad input from the user (a config, a layout, a data file, a checkpoint, a flag) whose message names
    the fix. Entry points print it as one line and exit 2; any other exception is a bug and keeps its
    traceback."""


class ConfigError(InputError):
    """A configuration that cannot run; the message says what to change."""


def _short(value: Any) -> str:
    """A bounded repr for messages: a preset's hostile or huge value (YAML aliases nested many levels deep expand
    to gigabytes) must not be printed whole."""
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxdict, r.maxstring, r.maxother = 2, 4, 4, 60, 60
    return r.repr(value)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


DTYPES = ("float32", "bfloat16", "float16")
FP16_MAX = 65504.0  # float16's largest finite value


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture. `arch` picks the family defaults; every field can still be set by hand."""

    arch: Literal["gpt2", "llama"] = "gpt2"  # gpt2: LayerNorm, GELU, learned positions; llama: RMSNorm, SwiGLU, RoPE
    num_layers: int = 2  # transformer blocks
    hidden_size: int = 128  # model width
    num_heads: int = 4  # attention heads
    num_kv_heads: int | None = None  # key/value heads (grouped-query attention); null: num_heads
    ffn_hidden_size: int | None = None  # MLP width; null: 4h (gpt2) or 2/3 * 4h rounded up to 256 (llama)
    vocab_size: int = 257  # tokens the model embeds; the byte tokenizer (data.tokenizer=byte) needs 257
    make_vocab_size_divisible_by: int = 128  # Megatron pads the vocabulary to a multiple of this
    seq_length: int = 128  # tokens per training sample
    dropout: float = 0.0  # on the embeddings and each block's residual branches
    attention_dropout: float = 0.0  # on the attention probabilities
    compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # matmuls and activations
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # the stored (master) weights
    recompute: Literal["none", "selective", "full"] = "none"  # activation recomputation in the backward
    attention_impl: Literal["xla", "pallas", "cudnn"] = "xla"  # pallas: the fused flash-attention kernel
    norm_impl: Literal["xla", "pallas"] = "xla"  # pallas: the fused normalization kernel
    fp8: Literal["none", "hybrid", "e4m3"] = "none"  # FP8 linear layers: hybrid = e4m3 forward, e5m2 gradients
    fp8_recipe: Literal["current", "delayed"] = "current"  # FP8 scales: each tensor's own, or from an amax history
    fp8_amax_history: int = 16  # delayed scaling: steps of amax history (the scale uses their max)
    fp8_margin: int = 0  # FP8 scales are divided by 2^margin (headroom against growing values)
    norm_eps: float = 1e-5  # LayerNorm / RMSNorm epsilon
    rope_theta: float = 10000.0  # RoPE base (llama)
    rope_scaling: Literal["none", "llama3", "yarn"] = "none"  # llama3: Llama 3.1's frequency scaling; yarn: YaRN's
    rope_scaling_factor: float = 8.0  # llama3 scaling: low frequencies are divided by this
    rope_low_freq_factor: float = 1.0  # llama3 scaling: wavelengths above original / this are scaled fully
    rope_high_freq_factor: float = 4.0  # llama3 scaling: wavelengths below original / this are kept
    rope_original_max_positions: int = 8192  # llama3 scaling: the context length the model was trained at
    rope_yarn_beta_fast: float = 32.0  # yarn: dimensions rotating more than this often over the original are kept
    rope_yarn_beta_slow: float = 1.0  # yarn: those rotating less often than this are interpolated fully
    rope_yarn_mscale: float = 0.0  # yarn: the RoPE amplitude ratio's numerator mscale (0: sqrt of the plain ratio)
    rope_yarn_mscale_all_dim: float = 0.0  # yarn: its denominator; with MLA also the softmax scale's (DeepSeek)
    tie_embeddings: bool | None = None  # output layer = embedding table; null: tied for gpt2, not for llama
    add_qkv_bias: bool = False  # llama: biases on the Q, K and V projections (Qwen; gpt2 always has them)
    init_std: float = 0.02  # standard deviation of the weights' normal init
    # Multi-latent attention (DeepSeek-V2/V3; Megatron's --multi-latent-attention), llama only: keys and values
    # from one compressed latent of kv_lora_rank per token, queries through a q_lora_rank one (null: a plain
    # projection), each head's query and key = a qk_head_dim part without position and a qk_pos_emb_head_dim part
    # with RoPE (the key's shared by all heads), values of v_head_dim.
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None  # the query's latent width; null: queries projected from the residual directly
    kv_lora_rank: int = 512  # the keys' and values' latent width
    qk_head_dim: int = 128  # each head's query/key dimensions without RoPE
    qk_pos_emb_head_dim: int = 64  # each head's query/key dimensions with RoPE (the key's shared by the heads)
    v_head_dim: int = 128  # each head's value dimensions
    # Mixture of experts (Mixtral / DeepSeek style): 0 experts = the dense MLP
    num_experts: int = 0  # experts per MoE layer (0: the dense MLP)
    experts_per_token: int = 2  # experts each token is routed to (top-k)
    moe_ffn_hidden_size: int | None = None  # each expert's MLP width; null: ffn_hidden_size
    moe_capacity_factor: float | None = None  # tokens over factor x fair share are dropped; null: dropless
    moe_token_drop_policy: Literal["probs", "position"] = "probs"  # capacity: keep top weights or first tokens
    # Dropless expert matmuls: true = the Pallas grouped GEMM (only the routed rows multiplied; interpreted on CPU),
    # false = jax.lax.ragged_dot (XLA's GPU compiler lowers it to dense GEMMs over every expert), null = the grouped
    # GEMM where the step is compiled for a GPU and ragged_dot on CPU (picked per lowering platform).
    moe_grouped_gemm: bool | None = None
    moe_aux_loss_coef: float = 0.01  # weight of the Switch / GShard load-balancing loss
    moe_z_loss_coef: float = 0.0  # weight of the router z-loss
    moe_shared_experts: int = 0  # DeepSeek's always-on shared experts
    moe_shared_expert_gate: bool = False  # the shared experts' output times sigmoid(x w) (Qwen-MoE)
    moe_router_pre_softmax: bool = False  # top k of the softmax over all experts, not renormalised (Qwen-MoE)
    moe_layer_freq: int = 1  # 1: every layer is MoE; n: layers 0, n, 2n, .. are MoE, the rest dense (Megatron's)
    moe_first_dense_layers: int = 0  # DeepSeek's first_k_dense_replace: the first k layers dense, the pattern after
    moe_router_bias_update_rate: float = 0.0  # DeepSeek-V3's auxiliary-loss-free balancing (0: off)
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"  # sigmoid: DeepSeek-V3's expert scores
    moe_router_num_groups: int | None = None  # group-limited routing (DeepSeek): experts in this many groups
    moe_router_group_topk: int | None = None  # group-limited routing: each token's experts from its best groups
    moe_router_topk_scaling_factor: float | None = None  # the k weights times this (DeepSeek's routed_scaling_factor)

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_length"):
            _check(getattr(self, name) > 0, f"model.{name} must be positive, got {getattr(self, name)}")
        _check(
            self.hidden_size % self.num_heads == 0,
            f"model.hidden_size={self.hidden_size} is not divisible by model.num_heads={self.num_heads}: "
            "pick a head count that divides the hidden size",
        )
        _check(
            self.kv_heads > 0 and self.num_heads % self.kv_heads == 0,
            f"model.num_heads={self.num_heads} must be a multiple of model.num_kv_heads={self.kv_heads}",
        )
        for name in ("dropout", "attention_dropout"):
            _check(0.0 <= getattr(self, name) < 1.0, f"model.{name} must be in [0, 1), got {getattr(self, name)}")
        _check(self.make_vocab_size_divisible_by > 0, "model.make_vocab_size_divisible_by must be positive")
        if self.num_experts:
            _check(self.num_experts > 0, f"model.num_experts must be >= 0 (0: dense), got {self.num_experts}")
            _check(
                1 <= self.experts_per_token <= self.num_experts,
                f"model.experts_per_token={self.experts_per_token} must be between 1 and model.num_experts="
                f"{self.num_experts}: lower model.experts_per_token or add experts",
            )
            _check(self.moe_capacity_factor is None or self.moe_capacity_factor > 0,
                   f"model.moe_capacity_factor must be positive or null (dropless), got {self.moe_capacity_factor}")
            _check(self.moe_layer_freq >= 1, f"model.moe_layer_freq must be >= 1, got {self.moe_layer_freq}")
            _check(0 <= self.moe_first_dense_layers < self.num_layers,
                   f"model.moe_first_dense_layers={self.moe_first_dense_layers} must be >= 0 and leave MoE layers: "
                   f"below model.num_layers={self.num_layers}")
            _check(self.stacked_layers % self.moe_layer_freq == 0,
                   f"the {self.stacked_layers} layers after the model.moe_first_dense_layers are not a multiple of "
                   f"model.moe_layer_freq={self.moe_layer_freq}: they repeat in groups of one MoE layer and "
                   f"moe_layer_freq - 1 dense ones; choose a frequency from {_divisors(self.stacked_layers)}")
            _check(self.moe_shared_experts >= 0, "model.moe_shared_experts must be >= 0")
            _check(not self.moe_shared_expert_gate or self.moe_shared_experts > 0,
                   "model.moe_shared_expert_gate gates the shared experts: set model.moe_shared_experts >= 1")
            _check(self.moe_aux_loss_coef >= 0 and self.moe_z_loss_coef >= 0, "MoE loss coefficients must be >= 0")
            _check(self.moe_router_bias_update_rate >= 0, "model.moe_router_bias_update_rate must be >= 0 (0: off)")
            self._check_group_routing()
            _check(not (self.moe_router_pre_softmax and self.moe_router_score_function == "sigmoid"),
                   "model.moe_router_pre_softmax takes the top k of a softmax: with "
                   "model.moe_router_score_function=sigmoid the k scores are always normalised, unset one of them")
            _check(self.moe_router_topk_scaling_factor is None or self.moe_router_topk_scaling_factor > 0,
                   "model.moe_router_topk_scaling_factor must be positive or null")
        if self.multi_latent_attention:
            self._check_latent_attention()
        _check(self.param_dtype != "float16", "model.param_dtype=float16 is not supported: keep float32 master "
               "weights and set model.compute_dtype=float16")
        _check(self.fp8_amax_history >= 1 and self.fp8_margin >= 0,
               "model.fp8_amax_history must be >= 1 and model.fp8_margin >= 0")
        if self.rope_scaling != "none":
            _check(self.arch == "llama", f"model.rope_scaling={self.rope_scaling} needs RoPE: set model.arch=llama")
            _check(self.rope_scaling_factor >= 1 and self.rope_original_max_positions > 0
                   and self.rope_high_freq_factor > self.rope_low_freq_factor > 0,
                   "model.rope_scaling=llama3 needs rope_scaling_factor >= 1, rope_original_max_positions > 0 and "
                   "rope_high_freq_factor > rope_low_freq_factor > 0 (Llama 3.1: 8, 8192, 4 and 1)")
            _check(self.rope_scaling != "yarn" or self.rope_yarn_beta_fast > self.rope_yarn_beta_slow > 0,
                   "model.rope_scaling=yarn needs rope_yarn_beta_fast > rope_yarn_beta_slow > 0 (YaRN: 32 and 1)")

    def _check_group_routing(self) -> None:
        groups, best = self.moe_router_num_groups, self.moe_router_group_topk
        _check((groups is None) == (best is None), "group-limited routing needs both model.moe_router_num_groups "
               "and model.moe_router_group_topk (DeepSeek-V3: 8 and 4), or neither")
        if groups is None:
            return
        _check(groups >= 1 and self.num_experts % groups == 0,
               f"model.moe_router_num_groups={groups} must divide model.num_experts={self.num_experts}: choose from "
               f"{_divisors(self.num_experts)}")
        _check(1 <= best <= groups and best * (self.num_experts // groups) >= self.experts_per_token,
               f"model.moe_router_group_topk={best} groups of {self.num_experts // groups} experts must hold "
               f"model.experts_per_token={self.experts_per_token} experts, with 1 <= group_topk <= {groups}")
        _check(self.experts_per_token % best == 0,
               f"group-limited routing scores a group by its top experts_per_token / group_topk experts: "
               f"model.experts_per_token={self.experts_per_token} must be a multiple of "
               f"model.moe_router_group_topk={best}")

    def _check_latent_attention(self) -> None:
        _check(self.arch == "llama", "model.multi_latent_attention needs RoPE and RMSNorm: set model.arch=llama")
        _check(self.num_kv_heads is None, "multi-latent attention gives every head its own keys and values: "
               "unset model.num_kv_heads")
        _check(not self.add_qkv_bias, "multi-latent attention has no Q, K, V biases: set model.add_qkv_bias=false")
        _check(self.qk_pos_emb_head_dim % 2 == 0 and self.qk_pos_emb_head_dim > 0,
               f"model.qk_pos_emb_head_dim={self.qk_pos_emb_head_dim} must be positive and even (RoPE rotates pairs)")
        for name in ("kv_lora_rank", "qk_head_dim", "v_head_dim"):
            _check(getattr(self, name) > 0, f"model.{name} must be positive, got {getattr(self, name)}")
        _check(self.q_lora_rank is None or self.q_lora_rank > 0, "model.q_lora_rank must be positive or null")
        _check(self.v_head_dim <= self.qk_head_dim + self.qk_pos_emb_head_dim,
               f"model.v_head_dim={self.v_head_dim} is wider than a query head (qk_head_dim + qk_pos_emb_head_dim = "
               f"{self.qk_head_dim + self.qk_pos_emb_head_dim}): the values are padded to the query width, so lower "
               "it (DeepSeek-V3: 128 of 192)")

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def head_dim(self) -> int:
        """Each head's query/key width (with multi-latent attention qk_head_dim + qk_pos_emb_head_dim), also the
        width of the cached values (MLA pads its values to it)."""
        if self.multi_latent_attention:
            return self.qk_head_dim + self.qk_pos_emb_head_dim
        return self.hidden_size // self.num_heads

    @property
    def value_dim(self) -> int:
        """Each head's value (and attention output) width."""
        return self.v_head_dim if self.multi_latent_attention else self.head_dim

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.arch == "llama":
            return 256 * math.ceil(int(2 * 4 * self.hidden_size / 3) / 256)
        return 4 * self.hidden_size

    @property
    def moe_ffn_size(self) -> int:
        return self.ffn_size if self.moe_ffn_hidden_size is None else self.moe_ffn_hidden_size

    @property
    def layer_period(self) -> int:
        """Layers per scanned unit: moe_layer_freq in an MoE model (one MoE layer, then dense ones), else 1."""
        return self.moe_layer_freq if self.num_experts else 1

    @property
    def first_dense_layers(self) -> int:
        """The dense layers before the layer stack (model.moe_first_dense_layers in an MoE model, else none)."""
        return self.moe_first_dense_layers if self.num_experts else 0

    @property
    def stacked_layers(self) -> int:
        """The layers of the scanned stack (the pipeline splits these): all but the first dense ones."""
        return self.num_layers - self.first_dense_layers

    @property
    def moe_layers(self) -> int:
        """How many layers are MoE (after the first dense ones, layers 0, n, 2n, .. of the stack with
        moe_layer_freq n)."""
        return self.stacked_layers // self.moe_layer_freq if self.num_experts else 0

    @property
    def tied(self) -> bool:
        return self.arch == "gpt2" if self.tie_embeddings is None else self.tie_embeddings

    @property
    def padded_vocab_size(self) -> int:
        m = self.make_vocab_size_divisible_by
        return m * math.ceil(self.vocab_size / m)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The mesh (data, pipeline, context, tensor) and how it is used. data=None takes every device left over.

    expert: the expert-parallel size (Megatron's --expert-model-parallel-size). It divides the data ranks:
    the mesh's data axis is split into 'data' (outer, data / expert) x 'expert' (inner); the dense weights
    stay data-parallel over both, the experts are sharded over 'expert' and data-parallel over 'data'.

    context: the context-parallel size (Megatron's --context-parallel-size). Every sequence is split over the
    'context' ranks for every layer (rank i holds chunks i and 2c - 1 - i of 2c) and attention passes keys and
    values around them in a ring (megajax/model/context.py)."""

    data: int | None = None  # data-parallel size (null: every device left over)
    pipeline: int = 1  # pipeline stages
    tensor: int = 1  # tensor-parallel size (Megatron's column/row-parallel layers)
    expert: int = 1  # expert-parallel size; divides data
    # The experts' tensor-parallel size (Megatron's --expert-tensor-parallel-size): null = parallel.tensor, each
    # expert's width split over 'tensor' as the dense MLP's. 1 = every expert whole on one device, the experts
    # spread over 'expert' x 'tensor' (Megatron's MoE parallel folding): each tensor rank routes its own sequence
    # shard and one all-to-all over 'expert' x 'tensor' sends the rows (megajax/model/moe.py). Needs
    # sequence_parallel.
    expert_tensor: int | None = None
    # How the dropless experts' rows cross the expert ranks: padded = fixed-size blocks of the most a rank can get
    # (all-to-all, every platform; at e / expert < k that is expert x min(k, e / expert) / k times the routed rows),
    # ragged = the routed rows alone (XLA's ragged all-to-all, as Megatron's all-to-all by split sizes; GPU only,
    # emulated by fixed-size all-to-alls on CPU). The receiving buffers are the padded size unless
    # expert_buffer_factor (below) makes them smaller.
    expert_all_to_all: Literal["padded", "ragged"] = "padded"
    # With expert_all_to_all=ragged: each expert rank receives at most this times one rank's routed rows (the mean
    # it receives; MaxText's ragged_buffer_factor), not the most it can get, and the rows that do not fit are
    # dropped (the higher source ranks' last rows first; moe_dropped_fraction counts them). null: dropless.
    expert_buffer_factor: float | None = None
    context: int = 1  # context-parallel size: every sequence split over this many ranks, attention by a ring
    # How attention's keys and values cross the context ranks (Megatron's --cp-comm-type): ring = ppermute one hop
    # per step under the previous block's compute (p2p); all_gather = every rank's at once, the gradients
    # reduce-scattered. auto: ring without a pipeline, all_gather with one (a collective-permute inside the
    # pipeline's per-rank branches waits for every device of the mesh and deadlocks).
    context_comm: Literal["auto", "ring", "all_gather"] = "auto"
    sequence_parallel: bool = False  # shard the activations outside attention and the MLP over tensor
    virtual_stages: int = 1  # model chunks per pipeline stage (the interleaved or zero_bubble schedule)
    schedule: Literal["gpipe", "1f1b", "interleaved", "zero_bubble"] = "1f1b"  # the pipeline schedule
    distributed_optimizer: bool = False  # shard the optimizer state over the data ranks (ZeRO-1)
    # Reduce the data-parallel gradients layer by layer under the last micro batch's backward (Megatron's
    # --overlap-grad-reduce). megajax/overlap.py: an all-reduce per layer, or with the distributed optimizer a
    # reduce-scatter. Off by default: with several micro batches it holds one to three times the gradients' bytes
    # more (docs/features/communication-overlap.md). With a pipeline (1f1b, interleaved): in each rank's idle cool-down
    # ticks, or rank 0's last backwards (across nodes set overlap_comm_ratio, below).
    overlap_grad_reduce: bool = False
    # Keep the weights as their optimizer shards between steps and all-gather them under the next forward
    # (Megatron's --overlap-param-gather). Needs distributed_optimizer and overlap_grad_reduce: the next step's
    # first forward gathers each layer one layer ahead, under the compute of the layer before, instead of the
    # update gathering every weight where nothing overlaps it. With a pipeline (1f1b, interleaved): the layers'
    # weights, in each rank's idle warm-up ticks, or rank 0's first forwards (the embedding and head stay whole).
    overlap_param_gather: bool = False
    # Under a pipeline: one layer's data-parallel reduce-scatter (or gather) time over its forward of one micro
    # batch, as `python -m megajax.audit --target <gpu>` reports it (communication.in_schedule.comm_ratio: 0.86
    # inside an H100 node for gpt2-1.3b, 17.9 across InfiniBand for the paper's 145B). It caps the layers an idle
    # tick reduces or gathers so that each run fits under the tick the other ranks compute; the rest go to the
    # schedule's last (first) tick, where they cost what reducing after (gathering before) the schedule costs.
    # 0: no cap.
    overlap_comm_ratio: float = 0.0
    # Sequence parallelism's all-gather and reduce-scatter as rings of ppermutes under the matmuls they feed
    # (Megatron's --tp-comm-overlap; megajax/model/collective_matmul.py); with a pipeline as chunked all-gathers
    # and reduce-scatters (a ppermute inside the schedule's per-rank branches deadlocks). Needs sequence_parallel.
    tp_comm_overlap: bool = False

    def __post_init__(self):
        for name in ("pipeline", "tensor", "virtual_stages", "expert", "context"):
            _check(getattr(self, name) >= 1, f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        _check(self.data is None or self.data >= 1, f"parallel.data must be >= 1 (or null), got {self.data}")
        _check(self.expert_buffer_factor is None or self.expert_buffer_factor > 0,
               f"parallel.expert_buffer_factor must be positive or null (dropless), got {self.expert_buffer_factor}")
        _check(self.expert_buffer_factor is None or self.expert_all_to_all == "ragged",
               "parallel.expert_buffer_factor sizes the ragged exchange's receiving buffer: set "
               "parallel.expert_all_to_all=ragged (or parallel.expert_buffer_factor=null)")
        _check(self.overlap_comm_ratio >= 0, f"parallel.overlap_comm_ratio must be >= 0 (0: no cap), got "
               f"{self.overlap_comm_ratio}")
        _check(
            not self.sequence_parallel or self.tensor > 1,
            "parallel.sequence_parallel=true needs parallel.tensor > 1 (it shards over the tensor axis)",
        )
        _check(self.expert_tensor in (None, 1, self.tensor),
               f"parallel.expert_tensor={self.expert_tensor} must be null (= parallel.tensor), 1 (whole experts, "
               f"spread over parallel.expert x parallel.tensor ranks) or parallel.tensor={self.tensor}")
        _check(not self.folded_experts or self.sequence_parallel,
               "parallel.expert_tensor=1 routes each tensor rank's sequence shard: set "
               "parallel.sequence_parallel=true (or parallel.expert_tensor=null)")
        if self.data is not None and self.data % self.expert:
            raise ConfigError(
                f"parallel.expert={self.expert} must divide parallel.data={self.data} (expert parallelism splits "
                f"the data-parallel ranks): choose parallel.expert from {_divisors(self.data)}")
        _check(
            not self.overlap_grad_reduce or self.pipeline == 1 or self.schedule in ("1f1b", "interleaved"),
            f"parallel.overlap_grad_reduce=true reduces the gradients inside the schedule, in idle ticks or in each "
            f"chunk's last backward, which the {self.schedule} schedule does not run as one step (GPipe "
            f"differentiates its whole forward, zero_bubble splits off the weight gradients and fills the idle "
            f"ticks with them): use parallel.schedule=1f1b or interleaved, or set "
            f"parallel.overlap_grad_reduce=false",
        )
        _check(
            not self.overlap_param_gather or (self.distributed_optimizer and self.overlap_grad_reduce),
            "parallel.overlap_param_gather=true gathers the distributed optimizer's shards in the step that reduces "
            "the gradients under the backward: set parallel.distributed_optimizer=true and "
            "parallel.overlap_grad_reduce=true (or parallel.overlap_param_gather=false)",
        )
        _check(
            not self.tp_comm_overlap or self.sequence_parallel,
            "parallel.tp_comm_overlap=true overlaps sequence parallelism's all-gather and reduce-scatter with the "
            "matmuls: set parallel.sequence_parallel=true (with parallel.tensor > 1)",
        )
        _check(
            self.virtual_stages == 1 or self.schedule in ("interleaved", "zero_bubble"),
            f"parallel.virtual_stages={self.virtual_stages} needs parallel.schedule=interleaved (or zero_bubble)",
        )
        _check(
            self.pipeline > 1 or (self.schedule in ("1f1b", "gpipe") and self.virtual_stages == 1),
            f"parallel.schedule={self.schedule} with parallel.virtual_stages={self.virtual_stages} schedules pipeline "
            f"stages, but parallel.pipeline=1: set parallel.pipeline > 1 (e.g. parallel.pipeline=2), or drop "
            f"parallel.schedule and parallel.virtual_stages",
        )


    @property
    def folded_experts(self) -> bool:
        """Whole experts spread over 'expert' x 'tensor' (parallel.expert_tensor=1 with parallel.tensor > 1)."""
        return self.expert_tensor == 1 and self.tensor > 1


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 100  # optimizer steps to train
    global_batch_size: int = 8  # samples per optimizer step, over all data ranks
    micro_batch_size: int | None = None  # samples per micro batch; null: the whole per-data-rank batch
    seed: int = 0  # weights, data order and dropout
    log_every: int = 10  # steps between log lines and metrics.jsonl rows
    eval_every: int = 0  # steps between evaluations on the validation split (0: none)
    eval_batches: int = 4  # global batches of the validation split per evaluation
    output_dir: str = "runs/default"  # metrics.jsonl, TensorBoard events, checkpoints
    max_bad_steps: int = 5  # stop after this many non-finite steps in a row
    exit_after_minutes: float | None = None  # save and exit cleanly after this much wall time
    profile_start: int = 0  # the first step (0-based) traced with jax.profiler when profile_steps > 0
    profile_steps: int = 0  # steps traced into <train.output_dir>/profile (TensorBoard / Perfetto; 0: none)
    wandb_project: str | None = None  # also log to this Weights & Biases project (pip install -e '.[wandb]')
    wandb_exp_name: str | None = None  # the W&B run's name; null: the last part of train.output_dir

    def __post_init__(self):
        _check(self.steps >= 1, f"train.steps must be >= 1, got {self.steps}")
        _check(self.global_batch_size >= 1, f"train.global_batch_size must be >= 1, got {self.global_batch_size}")
        _check(
            self.micro_batch_size is None or self.micro_batch_size >= 1,
            f"train.micro_batch_size must be >= 1, got {self.micro_batch_size}",
        )
        _check(self.log_every >= 1, f"train.log_every must be >= 1, got {self.log_every}")
        _check(self.eval_every >= 0, f"train.eval_every must be >= 0, got {self.eval_every}")
        _check(self.max_bad_steps >= 1, f"train.max_bad_steps must be >= 1, got {self.max_bad_steps}")
        _check(self.profile_start >= 0 and self.profile_steps >= 0,
               "train.profile_start and train.profile_steps must be >= 0 (profile_steps 0: no trace)")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4  # peak learning rate (AdamW)
    min_lr: float = 3e-5  # learning rate at the end of the decay
    warmup_steps: int = 10  # linear warm-up from 0
    decay: Literal["cosine", "linear", "constant"] = "cosine"  # schedule after warm-up (Megatron's --lr-decay-style)
    decay_steps: int | None = None  # steps from the start to the end of the decay; null: train.steps
    weight_decay: float = 0.1  # AdamW decoupled weight decay (not on norms and biases)
    clip_grad: float = 1.0  # clip the global gradient norm to this (0: no clipping)
    beta1: float = 0.9  # Adam's first-moment decay
    beta2: float = 0.95  # Adam's second-moment decay
    eps: float = 1e-8  # Adam's epsilon
    # fp16 dynamic loss scaling (used only with model.compute_dtype=float16)
    initial_loss_scale: float = 2.0**16
    loss_scale_growth_interval: int = 1000  # finite steps before the loss scale doubles
    min_loss_scale: float = 1.0  # the loss scale never backs off below this

    def __post_init__(self):
        _check(self.lr > 0, f"optim.lr must be positive, got {self.lr}")
        _check(0 <= self.min_lr <= self.lr, f"optim.min_lr must be in [0, optim.lr], got {self.min_lr}")
        _check(self.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        _check(self.clip_grad >= 0, f"optim.clip_grad must be >= 0 (0 disables), got {self.clip_grad}")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "optim.beta1 and optim.beta2 must be in [0, 1)")
        _check(self.initial_loss_scale >= 1, "optim.initial_loss_scale must be >= 1")
        _check(1 <= self.min_loss_scale <= self.initial_loss_scale,
               f"optim.min_loss_scale={self.min_loss_scale:g} must be between 1 and optim.initial_loss_scale="
               f"{self.initial_loss_scale:g}")
        _check(self.min_loss_scale <= FP16_MAX,
               f"optim.min_loss_scale={self.min_loss_scale:g} is beyond float16's range (largest {FP16_MAX:g}): "
               "fp16 gradients scaled by it overflow whenever a gradient passes 1; lower it (default 1)")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from. Empty `paths`: the bundled corpus, tokenized on first use."""

    # [prefix], [prefixA, prefixB] (blended by size) or [w1, prefix1, w2, prefix2, ...] (Megatron's --data-path)
    paths: list[Any] = dataclasses.field(default_factory=list)
    split: str = "949,50,1"  # train, valid, test weights over each dataset's sequences
    tokenizer: str = "byte"  # byte, gpt2, or a path (tokenizer.json, SentencePiece .model, or their directory)
    cache_dir: str | None = None  # the tokenized bundled corpus; null: $XDG_CACHE_HOME/megajax or ~/.cache/megajax
    index_cache_dir: str | None = None  # sample indices; null: <data dir>/cache/megajax_indices or cache_dir/indices
    prefetch: int = 2  # batches read ahead by a background thread (0: read in the step loop)
    eod_mask_loss: bool = False  # no loss on targets that follow an end-of-document token (Megatron's flag)
    reset_attention_mask: bool = False  # packed documents: tokens attend only within their document (Megatron's flag)
    reset_position_ids: bool = False  # packed documents: positions restart at 0 in each document (Megatron's flag)

    def __post_init__(self):
        parts = self.split.split(",")
        _check(
            1 <= len(parts) <= 3 and all(p.strip().replace(".", "", 1).isdigit() for p in parts),
            f"data.split={self.split!r} must be up to three comma-separated weights, like '949,50,1'",
        )
        _check(sum(float(p) for p in parts) > 0, f"data.split={self.split!r} must have a positive weight")
        _check(self.prefetch >= 0, f"data.prefetch must be >= 0 (0: no background reading), got {self.prefetch}")
        if all(isinstance(p, str) for p in self.paths):
            _check(all(p for p in self.paths), f"data.paths={_short(self.paths)} has an empty prefix")
            return
        _check(
            len(self.paths) % 2 == 0
            and all(isinstance(p, str) and p for p in self.paths[1::2]),
            f"data.paths={_short(self.paths)} must be prefixes [a, b] or weight/prefix pairs like [0.3, a, 0.7, b]",
        )
        for w in self.paths[::2]:
            _check(isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0,
                   f"data.paths weight {_short(w)} must be a positive number")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None  # where checkpoints go; null: <train.output_dir>/checkpoints
    every: int = 0  # steps between checkpoints (0: only at the end and on a signal)
    keep: int = 3  # checkpoints kept (older ones are deleted)
    async_: bool = True  # write in the background while training goes on (YAML and --set: checkpoint.async)
    load_from: str | None = None  # params-only start (a converted or exported checkpoint)
    resume_step: int | None = None  # resume from this step; null: the newest one that reads completely

    def __post_init__(self):
        _check(self.every >= 0, f"checkpoint.every must be >= 0 (0: only at the end), got {self.every}")
        _check(self.keep >= 1, f"checkpoint.keep must be >= 1, got {self.keep}")


# YAML keys that are Python keywords map onto attribute names with a trailing underscore.
_KEY_ALIASES = {"async": "async_"}


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = ModelConfig()
    parallel: ParallelConfig = ParallelConfig()
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()

    def __post_init__(self):
        m, p = self.model, self.parallel
        _check(
            m.num_heads % p.tensor == 0,
            f"model.num_heads={m.num_heads} is not divisible by parallel.tensor={p.tensor}: "
            f"choose parallel.tensor from {_divisors(m.num_heads)}",
        )
        _check(
            m.kv_heads % p.tensor == 0,
            f"model.num_kv_heads={m.kv_heads} is not divisible by parallel.tensor={p.tensor}: "
            f"choose parallel.tensor from {_divisors(m.kv_heads)} or raise model.num_kv_heads",
        )
        _check(
            m.ffn_size % p.tensor == 0,
            f"the MLP width {m.ffn_size} is not divisible by parallel.tensor={p.tensor}: set model.ffn_hidden_size",
        )
        _check(
            not m.num_experts or p.folded_experts or m.moe_ffn_size % p.tensor == 0,
            f"each expert's width {m.moe_ffn_size} is split over parallel.tensor={p.tensor} and does not divide by "
            f"it: set model.moe_ffn_hidden_size to a multiple of {p.tensor} (or parallel.expert_tensor=1: whole "
            "experts)",
        )
        _check(
            m.padded_vocab_size % p.tensor == 0,
            f"the padded vocabulary {m.padded_vocab_size} is not divisible by parallel.tensor={p.tensor}: "
            f"set model.make_vocab_size_divisible_by to a multiple of {p.tensor}",
        )
        _check(
            not p.sequence_parallel or m.seq_length % p.tensor == 0,
            f"sequence parallelism shards model.seq_length={m.seq_length} over parallel.tensor={p.tensor}: "
            "make the sequence length a multiple of the tensor size",
        )
        chunks = p.pipeline * p.virtual_stages
        stack = m.stacked_layers
        what = (f"model.num_layers={m.num_layers}" if stack == m.num_layers else
                f"the {stack} layers after model.moe_first_dense_layers={m.moe_first_dense_layers}")
        _check(
            chunks <= stack,
            f"parallel.pipeline * parallel.virtual_stages = {chunks} is more than {what}: "
            "every pipeline chunk needs at least one layer",
        )
        _check(
            stack % chunks == 0,
            f"{what} is not divisible by parallel.pipeline * parallel.virtual_stages = "
            f"{chunks}: choose layers that split evenly into {chunks} chunks",
        )
        period = m.layer_period
        _check(
            (stack // period) % chunks == 0,
            f"model.moe_layer_freq={period} groups {what} by {period} (one MoE layer, then dense "
            f"ones) and a pipeline chunk holds whole groups, but {stack // period} groups do not split into "
            f"parallel.pipeline * parallel.virtual_stages = {chunks} chunks: change the layers, the frequency or the "
            "pipeline",
        )
        if p.expert > 1:
            _check(m.num_experts > 0, f"parallel.expert={p.expert} needs an MoE model: set model.num_experts "
                   "(a multiple of parallel.expert) or parallel.expert=1")
            _check(
                m.num_experts % p.expert == 0,
                f"model.num_experts={m.num_experts} is not divisible by parallel.expert={p.expert}: choose "
                f"parallel.expert from {_divisors(m.num_experts)}",
            )
        if p.folded_experts:
            _check(m.num_experts > 0, "parallel.expert_tensor=1 spreads the experts over the tensor ranks: it needs "
                   "an MoE model (model.num_experts), or set parallel.expert_tensor=null")
            ranks = p.expert * p.tensor
            _check(m.num_experts % ranks == 0,
                   f"model.num_experts={m.num_experts} is not divisible by parallel.expert x parallel.tensor = "
                   f"{ranks}, the ranks parallel.expert_tensor=1 spreads whole experts over: change the experts or "
                   "the layout, or set parallel.expert_tensor=null")
        if p.expert_all_to_all == "ragged":
            _check(m.num_experts > 0 and m.moe_capacity_factor is None and (p.expert > 1 or p.folded_experts),
                   "parallel.expert_all_to_all=ragged sends dropless experts' rows by exact counts over the expert "
                   "ranks: it needs model.num_experts, model.moe_capacity_factor=null (capacity buffers are fixed-size "
                   "already) and parallel.expert > 1 or parallel.expert_tensor=1; else set "
                   "parallel.expert_all_to_all=padded")
        _check(not self.data.reset_attention_mask or m.attention_impl != "cudnn",
               "data.reset_attention_mask needs segment masks, which model.attention_impl=cudnn does not take here: "
               "use model.attention_impl=pallas or xla")
        if p.context > 1:
            self._check_context()
        if p.data is not None:
            self._check_batch(p.data)

    def _check_context(self) -> None:
        m, p = self.model, self.parallel
        c = p.context
        _check(
            m.seq_length % (2 * c) == 0,
            f"parallel.context={c} splits each sequence into 2 x {c} chunks (rank i holds chunks i and {2 * c - 1} - i, "
            f"which balances the causal attention work): model.seq_length={m.seq_length} must be a multiple of "
            f"{2 * c}",
        )
        _check(
            not p.sequence_parallel or m.seq_length % (c * p.tensor) == 0,
            f"sequence parallelism shards each context rank's {m.seq_length} / {c} tokens over parallel.tensor="
            f"{p.tensor}: make model.seq_length a multiple of {c * p.tensor}",
        )
        _check(m.attention_dropout == 0, "model.attention_dropout is not supported with parallel.context > 1 (the "
               "ring attention has no dropout): set model.attention_dropout=0 or parallel.context=1")
        _check(m.num_experts == 0, "mixture of experts is not supported with parallel.context > 1 yet: set "
               "parallel.context=1 or model.num_experts=0")
        _check(p.context_comm != "ring" or p.pipeline == 1,
               "parallel.context_comm=ring is not supported with a pipeline (the ring's collective-permutes would run "
               "inside the schedule's per-rank branches, where XLA's permute waits for every device): set "
               "parallel.context_comm=all_gather or auto")
        _check(m.attention_impl != "cudnn", "model.attention_impl=cudnn is not supported with parallel.context > 1 "
               "(the ring needs each block's log-sum-exp): use model.attention_impl=pallas or xla")

    def _check_batch(self, data: int) -> None:
        t, p = self.train, self.parallel
        mb = self._micro_batch_size(data)
        _check(
            t.global_batch_size % (data * mb) == 0,
            f"train.global_batch_size={t.global_batch_size} is not divisible by data parallel size {data} x "
            f"train.micro_batch_size={mb}: make the global batch a multiple of {data * mb}",
        )
        m = t.global_batch_size // (data * mb)
        if p.virtual_stages > 1 and p.pipeline > 1:
            _check(
                m >= p.pipeline,
                f"the {p.schedule} schedule with parallel.virtual_stages={p.virtual_stages} needs at least "
                f"parallel.pipeline={p.pipeline} micro batches, got {m} "
                f"(= global batch {t.global_batch_size} / (data {data} x micro batch {mb})): raise "
                f"train.global_batch_size or lower train.micro_batch_size",
            )

    def _micro_batch_size(self, data: int) -> int:
        if self.train.micro_batch_size is not None:
            return self.train.micro_batch_size
        return max(1, self.train.global_batch_size // data)

    @property
    def drops_tokens(self) -> bool:
        """Whether the MoE layers can drop assignments: a capacity factor, or a ragged exchange's receiving buffer
        smaller than the most a rank can get (parallel.expert_buffer_factor)."""
        return self.model.moe_capacity_factor is not None or self.parallel.expert_buffer_factor is not None

    @property
    def num_micro_batches(self) -> int:
        d, mb = self.parallel.data, self.train.micro_batch_size
        assert d is not None and mb is not None, "call Config.for_devices first"
        return self.train.global_batch_size // (d * mb)

    def for_devices(self, num_devices: int) -> Config:
        """Fills parallel.data from the device count (and train.micro_batch_size from the data size) and
        checks that the layout fits the devices."""
        p = self.parallel
        mp = p.pipeline * p.context * p.tensor
        if p.data is None:
            _check(
                num_devices % mp == 0,
                f"{num_devices} devices cannot be split into pipeline={p.pipeline} x context={p.context} x "
                f"tensor={p.tensor} groups: choose parallel.pipeline * parallel.context * parallel.tensor dividing "
                f"{num_devices}",
            )
            return override(self, {"parallel.data": num_devices // mp}).for_devices(num_devices)
        _check(
            p.data * mp == num_devices,
            f"parallel.data * parallel.pipeline * parallel.context * parallel.tensor = {p.data} x {p.pipeline} x "
            f"{p.context} x {p.tensor} = {p.data * mp}, but there are {num_devices} devices: set "
            f"parallel.data={num_devices // mp} or parallel.data=null (use every device)" if num_devices % mp == 0 else
            f"parallel.data * parallel.pipeline * parallel.context * parallel.tensor = {p.data * mp} does not match "
            f"the {num_devices} devices: choose sizes whose product is {num_devices}",
        )
        if self.train.micro_batch_size is None:  # one micro batch per data rank
            return override(self, {"train.micro_batch_size": self._micro_batch_size(p.data)})
        return self

    def to_dict(self) -> dict:
        return _to_dict(self)


def _unknown_key(path: str, key: str, known: list[str], what: str) -> str:
    """'unknown config key 'parallel.tensr': did you mean 'parallel.tensor'? known keys here: ...'."""
    import difflib

    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    kind = "section" if what == "sections" else "key"
    if close and what != "sections":  # the suggestion; `--help` lists the rest
        return f"unknown config {kind} {path!r}: did you mean {path[: len(path) - len(key)] + close[0]!r}?"
    hint = f": did you mean {close[0]!r}?" if close else ""
    return f"unknown config {kind} {path!r}{hint} ({what}: {', '.join(known)})"


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _to_dict(obj) -> dict:
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        key = {a: k for k, a in _KEY_ALIASES.items()}.get(f.name, f.name)
        out[key] = _to_dict(v) if dataclasses.is_dataclass(v) else v
    return out


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Checks (and gently converts) `value` to the annotated type `tp`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {_short(value)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        _check(value in choices, f"{where}={_short(value)} is not one of {', '.join(map(str, choices))}")
        return value
    if origin is list:
        _check(isinstance(value, (list, tuple)), f"{where} must be a list, got {_short(value)}")
        return list(value)
    if tp is Any:
        return value
    if tp is bool:
        _check(isinstance(value, bool), f"{where} must be true or false, got {_short(value)}")
        return value
    if tp is int:
        _check(isinstance(value, int) and not isinstance(value, bool),
               f"{where} must be an integer, got {_short(value)}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        _check(isinstance(value, (int, float)) and not isinstance(value, bool),
               f"{where} must be a number, got {_short(value)}")
        return float(value)
    if tp is str:
        _check(isinstance(value, str), f"{where} must be a string, got {_short(value)}")
        return value
    raise ConfigError(f"{where}: unsupported type {tp}")


def _build(cls, data: dict, where: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'the config'} must be a mapping, got {_short(data)}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        name = _KEY_ALIASES.get(key, key)
        path = f"{where}.{key}" if where else key
        if name not in names:
            known = sorted({k for k, a in _KEY_ALIASES.items() if a in names} | names - set(_KEY_ALIASES.values()))
            raise ConfigError(_unknown_key(path, key, known, "sections" if not where else "keys here"))
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, path)
        else:
            kwargs[name] = _coerce(value, tp, path)
    return cls(**kwargs)


def from_dict(data: dict) -> Config:
    """Builds a Config from a nested mapping; unknown keys and wrong types raise ConfigError."""
    return _build(Config, data or {}, "")


def parse_overrides(items: list[str]) -> dict:
    """['model.num_layers=4', 'data.paths=[0.3,a,0.7,b]'] -> {'model.num_layers': 4, ...} (values as YAML)."""
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        _check(bool(sep) and bool(key), f"override {item!r} must look like section.key=value")
        try:
            out[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({e})") from None
    return out


def override(cfg: Config, flat: dict) -> Config:
    """Applies dotted-key overrides ({'model.num_layers': 4}) and re-validates everything."""
    data = cfg.to_dict()
    for key, value in flat.items():
        parts = key.split(".")
        node = data
        for i, part in enumerate(parts[:-1]):
            if not isinstance(node.get(part), dict):
                known = sorted(k for k, v in node.items() if isinstance(v, dict))
                if not known:  # a value, not a section (model.num_layers.x)
                    raise ConfigError(f"config key {'.'.join(parts[: i + 1])!r} is a value, not a section: "
                                      f"override {key!r} names a key inside it")
                raise ConfigError(_unknown_key('.'.join(parts[: i + 1]), part, known,
                                               "sections" if i == 0 else "keys here"))
            node = node[part]
        if parts[-1] not in node:
            known = sorted(node)
            raise ConfigError(_unknown_key(key, parts[-1], known, "sections" if len(parts) == 1 else "keys here"))
        node[parts[-1]] = value
    return from_dict(data)


def load(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Loads a YAML preset (or the defaults) and applies `--set` style overrides."""
    data = {}
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file {path} does not exist (presets live in configs/)")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            what = " ".join(str(getattr(e, "problem", None) or e).split())[:200]
            raise ConfigError(f"config file {path} is not valid YAML{where}: {what}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {path} cannot be read: {str(e)[:200]}") from None
    try:
        cfg = from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path is not None else str(e)) from None
    return override(cfg, parse_overrides(overrides or []))


SECTIONS = {f.name: f.type for f in dataclasses.fields(Config)}


def _field_comments(cls) -> dict[str, str]:
    """Field name -> its one line of meaning: the comment on the field's line, else the comment lines just above
    it (this file is where a key is described)."""
    import inspect
    import re

    out, above = {}, []
    for line in inspect.getsourcelines(cls)[0]:
        text = line.strip()
        if text.startswith("#"):
            above.append(text.lstrip("# ").strip())
            continue
        m = re.match(r"(\w+): [^#]+?(?:#\s*(.*))?$", text) if line.startswith("    ") and not line.startswith(" " * 5) \
            else None
        if m and m.group(1) in {f.name for f in dataclasses.fields(cls)}:
            out[m.group(1)] = m.group(2) or " ".join(above)
        above = []
    return out


def keys_help() -> list[tuple[str, str, str, str]]:
    """(key, type, default, meaning) of every config key, as `--set` spells it."""
    aliases = {v: k for k, v in _KEY_ALIASES.items()}
    rows = []
    for section in dataclasses.fields(Config):
        cls = type(section.default)
        comments = _field_comments(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
            if kind.startswith("Literal["):
                kind = "|".join(typing.get_args(typing.get_type_hints(cls)[f.name]))
            meaning = comments.get(f.name, "")
            rows.append((f"{section.name}.{aliases.get(f.name, f.name)}", kind.replace("typing.", ""),
                         yaml.safe_dump(default, default_flow_style=True).removesuffix("\n...\n").strip(),
                         meaning))
    return rows


def add_cli_arguments(parser) -> None:
    """--config and --set (repeatable, each taking one or more KEY=VALUE), and every config key listed in the
    parser's --help (type, default, meaning), for the entry points that take a config."""
    import argparse

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--config", help="YAML preset (configs/*.yaml); without it, the defaults below")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                        help="override config keys, e.g. --set model.num_layers=4 parallel.tensor=2 (repeatable)")
    import textwrap

    lines = []
    for key, kind, default, meaning in keys_help():
        lines.append(f"  {key}  ({kind}, default {default})")
        lines += textwrap.wrap(meaning, width=100, initial_indent="      ", subsequent_indent="      ")
    parser.epilog = "config keys (--set KEY=VALUE, or in the YAML preset):\n" + "\n".join(lines)
