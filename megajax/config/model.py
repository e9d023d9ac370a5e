"""The model's architecture: GPT-2, Llama, multi-latent attention (DeepSeek) and mixture-of-experts keys, with
the checks that need only them. Checks against the layout (heads vs tensor parallelism, layers vs pipeline
stages) are megajax.config.Config's. Fields made with `defines_model` tie a checkpoint to its model."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, Literal

from megajax.config.base import check, defines_model, divisors, resumable


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture. `arch` picks the family defaults; every field can still be set by hand."""

    # The keys by concern: each title, and the field it starts at (megajax/config/base.py `concerns`; --help and
    # docs/reference/config.md print the titles)
    CONCERNS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("architecture", "arch"), ("precision, kernels and recomputation", "compute_dtype"), ("FP8", "fp8"),
        ("positions (RoPE)", "rope_theta"), ("multi-latent attention", "multi_latent_attention"),
        ("mixture of experts", "num_experts"), ("multi-token prediction", "mtp_num_layers"))

    # gpt2: LayerNorm, GELU, learned positions; llama: RMSNorm, SwiGLU, RoPE
    arch: Literal["gpt2", "llama"] = defines_model("gpt2")
    num_layers: int = defines_model(2)  # transformer blocks
    hidden_size: int = defines_model(128)  # model width
    num_heads: int = defines_model(4)  # attention heads
    # key/value heads (grouped-query attention); null: num_heads
    num_kv_heads: int | None = defines_model(None, "kv_heads")
    # MLP width; null: 4h (gpt2) or 2/3 * 4h rounded up to 256 (llama)
    ffn_hidden_size: int | None = defines_model(None, "ffn_size")
    vocab_size: int = defines_model(257)  # tokens the model embeds; the byte tokenizer (data.tokenizer=byte) needs 257
    # Megatron pads the vocabulary to a multiple of this
    make_vocab_size_divisible_by: int = defines_model(128, "padded_vocab_size")
    seq_length: int = 128  # tokens per training sample
    norm_eps: float = defines_model(1e-5)  # LayerNorm / RMSNorm epsilon
    # output layer = embedding table; null: tied for gpt2, not for llama
    tie_embeddings: bool | None = defines_model(None, "tied")
    add_qkv_bias: bool = False  # llama: biases on the Q, K and V projections (Qwen; gpt2 always has them)
    init_std: float = 0.02  # standard deviation of the weights' normal init
    dropout: float = 0.0  # on the embeddings and each block's residual branches
    attention_dropout: float = 0.0  # on the attention probabilities

    compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # matmuls and activations
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # the stored (master) weights
    # activation recomputation in the backward. selective: the attention core's (unfused: its [s, s] scores; a
    # fused kernel's core keeps none and is not recomputed); full: each layer's from its input
    recompute: Literal["none", "selective", "full"] = resumable("none")
    # auto: the fused Pallas kernels on GPUs (XLA's where they cannot run a case; the log says), XLA's on CPU;
    # pallas: megajax's flash attention; cudnn: cuDNN's (jax.nn.dot_product_attention); xla: the jnp reference
    attention_impl: Literal["auto", "xla", "pallas", "cudnn"] = resumable("auto")
    norm_impl: Literal["auto", "xla", "pallas"] = resumable("auto")  # auto or pallas: the fused norms
    # false: the layers' loop unrolled in the compiled program (the same weights, stacked): no copies of the
    # residuals into and out of per-layer stacks, for a longer compile. null: unrolled where the step runs on GPUs
    # and has no collectives inside its layers for XLA to move (StepPlan.unroll_layers), a loop elsewhere
    scan_layers: bool | None = resumable(None)

    fp8: Literal["none", "hybrid", "e4m3"] = "none"  # FP8 linear layers: hybrid = e4m3 forward, e5m2 gradients
    # FP8 scales: each tensor's own (current), from an amax history (delayed), or per 1 x fp8_block tile of the
    # activations and gradients and fp8_block x fp8_block block of the weights (blockwise: DeepSeek-V3's, e4m3 only)
    fp8_recipe: Literal["current", "delayed", "blockwise"] = "current"
    fp8_block: int = 128  # blockwise: the tile and block width
    fp8_amax_history: int = 16  # delayed scaling: steps of amax history (the scale uses their max)
    fp8_margin: int = 0  # FP8 scales are divided by 2^margin (headroom against growing values)

    rope_theta: float = defines_model(10000.0)  # RoPE base (llama)
    rope_scaling: Literal["none", "llama3", "yarn"] = "none"  # llama3: Llama 3.1's frequency scaling; yarn: YaRN's
    rope_scaling_factor: float = 8.0  # llama3 scaling: low frequencies are divided by this
    rope_low_freq_factor: float = 1.0  # llama3 scaling: wavelengths above original / this are scaled fully
    rope_high_freq_factor: float = 4.0  # llama3 scaling: wavelengths below original / this are kept
    rope_original_max_positions: int = 8192  # llama3 scaling: the context length the model was trained at
    rope_yarn_beta_fast: float = 32.0  # yarn: dimensions rotating more than this often over the original are kept
    rope_yarn_beta_slow: float = 1.0  # yarn: those rotating less often than this are interpolated fully
    rope_yarn_mscale: float = 0.0  # yarn: the RoPE amplitude ratio's numerator mscale (0: sqrt of the plain ratio)
    rope_yarn_mscale_all_dim: float = 0.0  # yarn: its denominator; with MLA also the softmax scale's (DeepSeek)

    # Multi-latent attention (DeepSeek-V2/V3; Megatron's --multi-latent-attention), llama only: keys and values
    # from one compressed latent of kv_lora_rank per token, queries through a q_lora_rank one (null: a plain
    # projection), each head's query and key = a qk_head_dim part without position and a qk_pos_emb_head_dim part
    # with RoPE (the key's shared by all heads), values of v_head_dim.
    multi_latent_attention: bool = defines_model(False)
    q_lora_rank: int | None = None  # the query's latent width; null: queries projected from the residual directly
    kv_lora_rank: int = 512  # the keys' and values' latent width
    qk_head_dim: int = 128  # each head's query/key dimensions without RoPE
    qk_pos_emb_head_dim: int = 64  # each head's query/key dimensions with RoPE (the key's shared by the heads)
    v_head_dim: int = 128  # each head's value dimensions

    # Mixture of experts (Mixtral / DeepSeek style): 0 experts = the dense MLP
    num_experts: int = defines_model(0)  # experts per MoE layer (0: the dense MLP)
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
    # 1: every layer is MoE; n: layers 0, n, 2n, .. are MoE, the rest dense (Megatron's)
    moe_layer_freq: int = defines_model(1, "layer_period")
    # DeepSeek's first_k_dense_replace: the first k layers dense, the pattern after
    moe_first_dense_layers: int = defines_model(0, "first_dense_layers")
    moe_router_bias_update_rate: float = 0.0  # DeepSeek-V3's auxiliary-loss-free balancing (0: off)
    # sigmoid: DeepSeek-V3's expert scores
    moe_router_score_function: Literal["softmax", "sigmoid"] = defines_model("softmax")
    moe_router_num_groups: int | None = None  # group-limited routing (DeepSeek): experts in this many groups
    moe_router_group_topk: int | None = None  # group-limited routing: each token's experts from its best groups
    moe_router_topk_scaling_factor: float | None = None  # the k weights times this (DeepSeek's routed_scaling_factor)

    # Multi-token prediction (DeepSeek-V3; Megatron's --mtp-num-layers): this many modules after the layers, module
    # k predicting the token k + 1 ahead from module k - 1's output and the embedding of the token k ahead, each
    # one transformer block sharing the embedding and output layer; 0: none
    mtp_num_layers: int = defines_model(0)
    # the modules' loss joins the gradient at this weight over their mean (lambda / D); the logged loss is the
    # main one's, the modules' is logged as mtp_loss
    mtp_loss_scaling_factor: float = 0.1

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_length"):
            check(getattr(self, name) > 0, f"model.{name} must be positive, got {getattr(self, name)}")
        check(self.mtp_num_layers >= 0, f"model.mtp_num_layers must be >= 0 (0: no multi-token prediction), got "
              f"{self.mtp_num_layers}")
        check(self.mtp_num_layers < self.seq_length, f"model.mtp_num_layers={self.mtp_num_layers} predicts further "
              f"ahead than the sequence (model.seq_length={self.seq_length}): lower it")
        check(self.mtp_loss_scaling_factor >= 0, "model.mtp_loss_scaling_factor must be >= 0")
        check(
            self.hidden_size % self.num_heads == 0,
            f"model.hidden_size={self.hidden_size} is not divisible by model.num_heads={self.num_heads}: "
            "pick a head count that divides the hidden size",
        )
        check(
            self.kv_heads > 0 and self.num_heads % self.kv_heads == 0,
            f"model.num_heads={self.num_heads} must be a multiple of model.num_kv_heads={self.kv_heads}",
        )
        for name in ("dropout", "attention_dropout"):
            check(0.0 <= getattr(self, name) < 1.0, f"model.{name} must be in [0, 1), got {getattr(self, name)}")
        check(self.attention_impl != "cudnn" or self.attention_dropout == 0,
              "model.attention_dropout needs megajax's own dropout mask (the same entries on every layout), which "
              "model.attention_impl=cudnn does not take: use model.attention_impl=auto, pallas or xla, or set "
              "model.attention_dropout=0")
        check(self.make_vocab_size_divisible_by > 0, "model.make_vocab_size_divisible_by must be positive")
        if self.num_experts:
            check(self.num_experts > 0, f"model.num_experts must be >= 0 (0: dense), got {self.num_experts}")
            check(
                1 <= self.experts_per_token <= self.num_experts,
                f"model.experts_per_token={self.experts_per_token} must be between 1 and model.num_experts="
                f"{self.num_experts}: lower model.experts_per_token or add experts",
            )
            check(self.moe_capacity_factor is None or self.moe_capacity_factor > 0,
                  f"model.moe_capacity_factor must be positive or null (dropless), got {self.moe_capacity_factor}")
            check(self.moe_layer_freq >= 1, f"model.moe_layer_freq must be >= 1, got {self.moe_layer_freq}")
            check(0 <= self.moe_first_dense_layers < self.num_layers,
                  f"model.moe_first_dense_layers={self.moe_first_dense_layers} must be >= 0 and leave MoE layers: "
                  f"below model.num_layers={self.num_layers}")
            check(self.stacked_layers % self.moe_layer_freq == 0,
                  f"the {self.stacked_layers} layers after the model.moe_first_dense_layers are not a multiple of "
                  f"model.moe_layer_freq={self.moe_layer_freq}: they repeat in groups of one MoE layer and "
                  f"moe_layer_freq - 1 dense ones; choose a frequency from {divisors(self.stacked_layers)}")
            check(self.moe_shared_experts >= 0, "model.moe_shared_experts must be >= 0")
            check(not self.moe_shared_expert_gate or self.moe_shared_experts > 0,
                  "model.moe_shared_expert_gate gates the shared experts: set model.moe_shared_experts >= 1")
            check(self.moe_aux_loss_coef >= 0 and self.moe_z_loss_coef >= 0, "MoE loss coefficients must be >= 0")
            check(self.moe_router_bias_update_rate >= 0, "model.moe_router_bias_update_rate must be >= 0 (0: off)")
            self._check_group_routing()
            check(not (self.moe_router_pre_softmax and self.moe_router_score_function == "sigmoid"),
                  "model.moe_router_pre_softmax takes the top k of a softmax: with "
                  "model.moe_router_score_function=sigmoid the k scores are always normalised, unset one of them")
            check(self.moe_router_topk_scaling_factor is None or self.moe_router_topk_scaling_factor > 0,
                  "model.moe_router_topk_scaling_factor must be positive or null")
        if self.multi_latent_attention:
            self._check_latent_attention()
        check(self.param_dtype != "float16", "model.param_dtype=float16 is not supported: keep float32 master "
              "weights and set model.compute_dtype=float16")
        check(self.fp8_amax_history >= 1 and self.fp8_margin >= 0,
              "model.fp8_amax_history must be >= 1 and model.fp8_margin >= 0")
        if self.fp8 != "none" and self.fp8_recipe == "blockwise":
            self._check_blockwise()
        if self.rope_scaling != "none":
            check(self.arch == "llama", f"model.rope_scaling={self.rope_scaling} needs RoPE: set model.arch=llama")
            check(self.rope_scaling_factor >= 1 and self.rope_original_max_positions > 0
                  and self.rope_high_freq_factor > self.rope_low_freq_factor > 0,
                  "model.rope_scaling=llama3 needs rope_scaling_factor >= 1, rope_original_max_positions > 0 and "
                  "rope_high_freq_factor > rope_low_freq_factor > 0 (Llama 3.1: 8, 8192, 4 and 1)")
            check(self.rope_scaling != "yarn" or self.rope_yarn_beta_fast > self.rope_yarn_beta_slow > 0,
                  "model.rope_scaling=yarn needs rope_yarn_beta_fast > rope_yarn_beta_slow > 0 (YaRN: 32 and 1)")

    def _check_blockwise(self) -> None:
        block = self.fp8_block
        check(self.fp8 == "e4m3", "model.fp8_recipe=blockwise scales every operand finely enough for e4m3 (DeepSeek-V3's "
              "and Megatron's recipe has no e5m2 gradients): set model.fp8=e4m3")
        check(block >= 16 and block & (block - 1) == 0,
              f"model.fp8_block={block} must be a power of two >= 16 (a Triton tile; DeepSeek-V3: 128)")

    def _check_group_routing(self) -> None:
        groups, best = self.moe_router_num_groups, self.moe_router_group_topk
        check((groups is None) == (best is None), "group-limited routing needs both model.moe_router_num_groups "
              "and model.moe_router_group_topk (DeepSeek-V3: 8 and 4), or neither")
        if groups is None:
            return
        check(groups >= 1 and self.num_experts % groups == 0,
              f"model.moe_router_num_groups={groups} must divide model.num_experts={self.num_experts}: choose from "
              f"{divisors(self.num_experts)}")
        check(1 <= best <= groups and best * (self.num_experts // groups) >= self.experts_per_token,
              f"model.moe_router_group_topk={best} groups of {self.num_experts // groups} experts must hold "
              f"model.experts_per_token={self.experts_per_token} experts, with 1 <= group_topk <= {groups}")
        check(self.experts_per_token % best == 0,
              f"group-limited routing scores a group by its top experts_per_token / group_topk experts: "
              f"model.experts_per_token={self.experts_per_token} must be a multiple of "
              f"model.moe_router_group_topk={best}")

    def _check_latent_attention(self) -> None:
        check(self.arch == "llama", "model.multi_latent_attention needs RoPE and RMSNorm: set model.arch=llama")
        check(self.num_kv_heads is None, "multi-latent attention gives every head its own keys and values: "
              "unset model.num_kv_heads")
        check(not self.add_qkv_bias, "multi-latent attention has no Q, K, V biases: set model.add_qkv_bias=false")
        check(self.qk_pos_emb_head_dim % 2 == 0 and self.qk_pos_emb_head_dim > 0,
              f"model.qk_pos_emb_head_dim={self.qk_pos_emb_head_dim} must be positive and even (RoPE rotates pairs)")
        for name in ("kv_lora_rank", "qk_head_dim", "v_head_dim"):
            check(getattr(self, name) > 0, f"model.{name} must be positive, got {getattr(self, name)}")
        check(self.q_lora_rank is None or self.q_lora_rank > 0, "model.q_lora_rank must be positive or null")
        check(self.v_head_dim <= self.qk_head_dim + self.qk_pos_emb_head_dim,
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


def layer_forward_flops_per_token(cfg: ModelConfig) -> tuple[float, float]:
    """(matmul FLOPs of one layer's forward per token without the attention core, the core's FLOPs), averaged over
    the layers.

    An MoE layer counts its active MLP: the k routed experts and the shared ones, plus the router; with
    model.moe_layer_freq n, one layer in n is MoE and the others count the dense MLP."""
    d, h, g, k, s = cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.seq_length
    qkv = 2 * d * (h * k + 2 * g * k)
    v = cfg.value_dim
    out = 2 * h * v * d
    if cfg.multi_latent_attention:  # the latent projections (k = qk_head_dim + qk_pos_emb_head_dim here)
        c, r, n = cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim, cfg.qk_head_dim
        q = 2 * d * h * k if cfg.q_lora_rank is None else 2 * cfg.q_lora_rank * (d + h * k)
        qkv = q + 2 * d * (c + r) + 2 * c * h * (n + v)
    mats = 3 if cfg.arch == "llama" else 2
    mlp = 2 * d * cfg.ffn_size * mats
    if cfg.num_experts:
        active = (cfg.experts_per_token + cfg.moe_shared_experts) * cfg.moe_ffn_size
        moe = 2 * d * active * mats + 2 * d * cfg.num_experts
        mlp = (cfg.moe_layers * moe + (cfg.num_layers - cfg.moe_layers) * mlp) / cfg.num_layers
    core = 2 * s * h * (k + v)  # q k^T and probs v over the full (uncausal) square, as Megatron counts
    return qkv + out + mlp, core
