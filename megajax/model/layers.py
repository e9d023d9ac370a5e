"""Transformer layers with Megatron tensor parallelism expressed as logical sharding.

Dimension letters: b batch, s sequence, d model, h heads, g kv heads, k head dim, f MLP, v vocabulary.

Every parameter carries logical axis names (see megajax.parallel.step_plan): QKV and the MLP input are
column-parallel (their output dim is 'heads'/'mlp', sharded over 'tensor'), the attention output and MLP
output are row-parallel (their input dim is sharded), so each layer costs two all-reduces forward and two
backward. With sequence parallelism the residual stream is sharded over the sequence ('seq' -> 'tensor'):
each all-reduce becomes an all-gather before the column-parallel matmul and a reduce-scatter after the
row-parallel one, the same bytes, while norms and dropout work on 1/t of the activations.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from megajax import kernels
from megajax.config import ModelConfig
from megajax.kernels import auto as kernel_choice
from megajax.kernels.dropout import AttentionDropout, kept_features, seeds
from megajax.model import collective_matmul, context, fp8, fp8_blockwise
from megajax.model.recipe import recipe
from megajax.parallel import step_plan
from megajax.parallel.step_plan import constrain

@flax.struct.dataclass
class Side:
    """What a micro batch brings besides its tokens (`gpt.side_inputs`): one dropout key per sample [b] (None
    without dropout), the packed documents' segment ids [b, s] (None: every sample is one document) and the
    tokens' positions [b, s] (None: 0 .. s - 1, or this context rank's `context.positions`), and the scalar
    cotangent seed of the loss being differentiated (the train step's seed_scale: MoE layers add their
    auxiliary losses' gradients at that scale; None: a forward that is not differentiated, or no MoE)."""

    keys: jax.Array | None = None
    segment_ids: jax.Array | None = None
    positions: jax.Array | None = None
    objective_scale: jax.Array | None = None


NO_SIDE = Side()

RESIDUAL = ("batch", "seq", "embed")  # the residual stream: sequence-sharded with sequence parallelism
GATHERED = ("batch", None, "embed")  # input of a column-parallel matmul: the whole sequence


@jax.custom_vjp
def gather_sequence(x_bsd: jax.Array) -> jax.Array:
    """The input of a column-parallel matmul, constrained to GATHERED (with sequence parallelism, the
    all-gather), whose cotangent is constrained to RESIDUAL: the matmul's partial input-gradient is
    reduce-scattered straight back onto the sequence shards (Megatron's gather_from_sequence_parallel_region).

    A plain constraint transposes to itself, asking for that gradient all-reduced over the whole sequence,
    which XLA turns into a reduce-scatter only when every user of the all-reduce slices it. In fp32,
    LayerNorm's bias gradient (the sum of the cotangent over b and s) read the whole all-reduced buffer (in
    bf16 the cast back to fp32 sits in between and is sliced), so every gpt2 layer all-reduced two [b, s, d]
    activations in the backward, and the head one more.

    The barrier keeps the all-gather on the compute-dtype value: without it XLA's GPU compiler (pure
    tensor parallelism, bf16) gathered the norm's fp32 output and cast after, twice the bytes.
    """
    return constrain(jax.lax.optimization_barrier(constrain(x_bsd, RESIDUAL)), GATHERED)


def _gather_sequence_fwd(x_bsd):
    return gather_sequence(x_bsd), None


def _gather_sequence_bwd(_, ct_bsd):
    return (constrain(ct_bsd, RESIDUAL),)


gather_sequence.defvjp(_gather_sequence_fwd, _gather_sequence_bwd)


# The zero-bubble pipeline splits a layer's backward into the input gradient and the weight gradients (Qi
# et al., ICLR 2024). Every weight matmul records its input (collection TAP_INPUTS) and adds a zero "tap"
# (collection TAP_GRADS) whose gradient is the matmul's output gradient; the input gradient is then the
# derivative with respect to the layer input and the taps, and each weight's gradient one matmul of the two
# (`weight_grad`). Both hooks do nothing unless a caller passes those collections.
TAP_INPUTS, TAP_GRADS = "tap_inputs", "tap_grads"
WEIGHT_EINSUMS = {"wqkv": "bsd,dgjk->bsgjk", "wo": "bshk,hkd->bsd", "w_gate_up": "bsd,dtf->bstf",
                  "w_in": "bsd,df->bsf", "w_out": "bsf,fd->bsd",
                  # multi-latent attention: the down-projections to the latents (r letters) and back up to heads
                  "wq": "bsd,dhk->bshk", "wq_down": "bsd,dr->bsr", "wq_up": "bsr,rhk->bshk",
                  "wkv_down": "bsd,dr->bsr", "wkv_up": "bsr,rhk->bshk"}
# their logical axis names, and the column-parallel ones (their input the residual stream; the rest row-parallel,
# but for the latent projections, which are neither: `latent_matmul`)
WEIGHT_NAMES = {"wqkv": ("embed", "kv_heads", None, "head_dim"), "wo": ("heads", "head_dim", "embed"),
                "w_gate_up": ("embed", None, "mlp"), "w_in": ("embed", "mlp"), "w_out": ("mlp", "embed"),
                "wq": ("embed", "heads", "head_dim"), "wq_down": ("embed", None), "wq_up": (None, "heads", "head_dim"),
                "wkv_down": ("embed", None), "wkv_up": (None, "heads", "head_dim")}
COLUMN_PARALLEL = frozenset({"wqkv", "w_gate_up", "w_in", "wq"})
LATENT = frozenset({"wq_down", "wq_up", "wkv_down", "wkv_up"})


def weight_einsum(module: nn.Module, name: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """einsum(WEIGHT_EINSUMS[name], x, w) for the parameter `name` of `module`, with the zero-bubble hooks; in
    FP8 with model.fp8 (megajax/model/fp8.py)."""
    module.sow(TAP_INPUTS, name, x, init_fn=lambda: None, reduce_fn=lambda _, new: new)
    spec = WEIGHT_EINSUMS[name]
    fmt, meta = _fp8_of(module, name)
    if fmt is None:
        y = jnp.einsum(spec, x, w)
    elif fmt[0] == "blockwise":
        y = fp8_blockwise.block_einsum(spec, fmt[1], WEIGHT_NAMES[name], x, w)
    else:
        y = fp8.einsum(spec, *fmt, x, w, meta)
    return module.perturb(name, y, collection=TAP_GRADS)


def _fp8_of(module: nn.Module, name: str) -> tuple[tuple | None, jax.Array | None]:
    """(`fp8_format(cfg)`, the delayed-scaling state of weight `name` or None)."""
    cfg = module.cfg
    return fp8_format(cfg), (fp8_state(module, name) if fp8.delays(cfg) else None)


def fp8_format(cfg: ModelConfig) -> tuple | None:
    """How the linear layers multiply: None (the compute dtype), (model.fp8, model.fp8_margin) with per-tensor
    scales, or ("blockwise", model.fp8_block)."""
    if cfg.fp8 == "none":
        return None
    return ("blockwise", cfg.fp8_block) if cfg.fp8_recipe == "blockwise" else (cfg.fp8, cfg.fp8_margin)


def column_matmul(module: nn.Module, name: str, x_bsd: jax.Array, w: jax.Array) -> jax.Array:
    """A column-parallel matmul on the residual stream x [b, s, d] (sequence-sharded with sequence parallelism):
    gather_sequence then `weight_einsum`, or with parallel.tp_comm_overlap the gather as a ring under the GEMMs
    (megajax/model/collective_matmul.py)."""
    if collective_matmul.active():
        return _collective_matmul(module, name, collective_matmul.gather_matmul, x_bsd, w)
    return weight_einsum(module, name, gather_sequence(x_bsd), w)


def row_matmul(module: nn.Module, name: str, h: jax.Array, w: jax.Array) -> jax.Array:
    """A row-parallel matmul back onto the residual stream: `weight_einsum`, its partial sums reduced (scattered
    over the sequence with sequence parallelism), or with parallel.tp_comm_overlap the scatter as a ring."""
    if collective_matmul.active():
        return _collective_matmul(module, name, collective_matmul.matmul_scatter, h, w)
    return constrain(weight_einsum(module, name, h, w), RESIDUAL)


def _collective_matmul(module: nn.Module, name: str, matmul, x: jax.Array, w: jax.Array) -> jax.Array:
    """`matmul` (collective_matmul.gather_matmul or matmul_scatter) of weight `name`, with the zero-bubble hooks as
    `weight_einsum`: given taps (the split backward's B), its backward leaves the weight gradient to `weight_grad`
    (W), which gathers under its GEMMs as the fused backward does."""
    module.sow(TAP_INPUTS, name, x, init_fn=lambda: None, reduce_fn=lambda _, new: new)
    split = module.has_variable(TAP_GRADS, name)
    y = matmul(WEIGHT_EINSUMS[name], x, w, WEIGHT_NAMES[name], *_fp8_of(module, name), not split)
    return module.perturb(name, y, collection=TAP_GRADS)


def fp8_state(module: nn.Module, name: str, experts: int = 0) -> jax.Array:
    """The delayed-scaling state of weight `name` (megajax/model/fp8.py): a variable of the params collection
    rather than module.param, so it draws nothing from the init RNG (the weights' init is the same without).
    experts: one history per expert, [experts, ...] sharded as the experts are."""
    shape, names = ((experts, 3 * fp8.BINS), ("expert", None)) if experts else ((3 * fp8.BINS,), (None,))
    return nn.unbox(module.variable("params", fp8.META_PREFIX + name, lambda: nn.LogicallyPartitioned(
        jnp.zeros(shape, jnp.float32), names)).value)


def weight_grad(name: str, cfg: ModelConfig, x: jax.Array, dy: jax.Array, w: jax.Array,
                meta: jax.Array | None = None) -> jax.Array:
    """The gradient of parameter `name` (w's shape and dtype) from its matmul's input x and output gradient dy,
    computed in x's dtype (or in FP8 with model.fp8; `meta`: its delayed-scaling state) as the fused backward
    does: with parallel.tp_comm_overlap (`_collective_matmul`) its gathers under the GEMMs too."""
    fmt = fp8_format(cfg)
    if collective_matmul.active() and name not in LATENT:
        return collective_matmul.weight_grad(WEIGHT_EINSUMS[name], name in COLUMN_PARALLEL, x, dy, w,
                                             WEIGHT_NAMES[name], fmt, meta)
    if fmt is not None and fmt[0] == "blockwise":
        dw = fp8_blockwise.block_weight_grad(WEIGHT_EINSUMS[name], fmt[1], WEIGHT_NAMES[name], x, dy, w)
        return dw.astype(w.dtype)
    if fmt is not None:
        return fp8.weight_grad(WEIGHT_EINSUMS[name], *fmt, x, dy, meta).astype(w.dtype)
    return jax.vjp(lambda w: jnp.einsum(WEIGHT_EINSUMS[name], x, w.astype(x.dtype)), w)[1](dy)[0]


def param(module: nn.Module, name: str, shape, names, std: float | None, dtype):
    """A parameter with logical axis names; std=None means ones (norm scales), 0 means zeros (biases)."""
    if std is None:
        init = nn.initializers.ones
    elif std == 0:
        init = nn.initializers.zeros
    else:
        init = nn.initializers.normal(std)
    return module.param(name, nn.with_logical_partitioning(init, names), shape, dtype)


def dropout(x: jax.Array, rate: float, keys: jax.Array | None, salt: int | jax.Array) -> jax.Array:
    """Dropout on x [b, s, d] whose mask is a hash of (sample key, salt, token position, feature)
    (kernels/dropout.py), never of the mesh, the micro batch split or the context split: a context rank draws the
    mask of its own tokens (at their global `context.positions`).

    keys: [b] typed PRNG keys, one per sample (derived from the seed and the global sample index), or None
    for no dropout. salt separates the sites (layer and position in the layer).
    """
    if rate == 0.0 or keys is None:
        return x
    keep = kept_features(seeds(keys, salt), context.positions(x.shape[1]), x.shape[2], rate)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def layers_unrolled(cfg: ModelConfig) -> bool:
    """Whether the step's loops over layers are unrolled: model.scan_layers false, or null where the step plan in
    force unrolls them (StepPlan.unroll_layers). A recomputation (jax.checkpoint) inside them then needs
    prevent_cse: in straight-line code XLA would merge the recomputation with the forward it repeats and keep
    what it was to drop (a loop's iterations keep the two apart, so there it costs nothing to leave it off)."""
    return step_plan.in_force().unroll_layers if cfg.scan_layers is None else not cfg.scan_layers


# Recomputation (model.recompute) is chosen here for every caller: the model's layer stack (gpt.LayerStack), the
# layer loops of the overlapped reductions and ZeRO-3 (parallel/overlap.py), GPipe's chunks, and attention's core.
# A pipeline's 1F1B and interleaved schedules recompute each chunk in their own R action instead.
KEEP_INPUTS = jax.checkpoint_policies.nothing_saveable  # full recomputation: a layer keeps only its inputs


def recomputed(cfg: ModelConfig, layer, keep=None):
    """A layer function (x, ...) -> y as its backward needs it: under model.recompute=full, a jax.checkpoint that
    keeps only its inputs (Megatron's full recomputation); with `keep` (a checkpoint policy: what the backward keeps)
    under that policy where the recomputation is not full; else `layer` itself."""
    if cfg.recompute != "full" and keep is None:
        return layer
    policy = KEEP_INPUTS if cfg.recompute == "full" else keep
    return jax.checkpoint(layer, prevent_cse=layers_unrolled(cfg), policy=policy)


def recomputed_module(cfg: ModelConfig, unit: type[nn.Module]) -> type[nn.Module]:
    """`recomputed` for a Flax module class (the layer stack's scanned unit)."""
    if cfg.recompute != "full":
        return unit
    return nn.remat(unit, prevent_cse=layers_unrolled(cfg), policy=KEEP_INPUTS)


def recomputed_core(cfg: ModelConfig, core, fused: bool):
    """Attention's core (softmax(qk^T) v) under Megatron's selective recomputation: keep q, k, v and recompute
    the core in the backward. A fused kernel keeps no scores (its output and log-sum-exp only): nothing to drop,
    so nothing recomputed."""
    if cfg.recompute == "selective" and not fused:
        return jax.checkpoint(core, prevent_cse=layers_unrolled(cfg))
    return core


class Norm(nn.Module):
    """LayerNorm (gpt2) or RMSNorm (llama), computed in fp32 and returned in the compute dtype."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_bsd: jax.Array) -> jax.Array:
        cfg = self.cfg
        d = x_bsd.shape[-1]
        pdt, cdt = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.compute_dtype)
        scale = param(self, "scale", (d,), ("embed",), None, pdt)
        # out_dtype: the fused kernel writes the compute dtype directly instead of an fp32 copy to cast.
        if recipe(cfg).norm == "rms_norm":
            y = kernels.rms_norm(x_bsd, scale, cfg.norm_eps, impl=cfg.norm_impl, out_dtype=cdt)
        else:
            bias = param(self, "bias", (d,), ("embed",), 0, pdt)
            y = kernels.layer_norm(x_bsd, scale, bias, cfg.norm_eps, impl=cfg.norm_impl, out_dtype=cdt)
        return y


class Embed(nn.Module):
    """Vocab-parallel token embedding (+ learned positions for gpt2); with tied embeddings the Head reads
    its table as the output layer."""

    cfg: ModelConfig

    def setup(self):
        cfg = self.cfg
        pdt = jnp.dtype(cfg.param_dtype)
        self.embedding = param(self, "embedding", (cfg.padded_vocab_size, cfg.hidden_size), ("vocab", "embed"),
                                cfg.init_std, pdt)
        if recipe(cfg).learned_positions:
            self.position_embedding = param(self, "position_embedding", (cfg.seq_length, cfg.hidden_size),
                                             (None, "embed"), cfg.init_std, pdt)

    def __call__(self, tokens_bs: jax.Array, side: Side | None, offset: jax.Array | int = 0,
                 lookup=None) -> jax.Array:
        """tokens [b, s] at positions offset .. offset + s - 1 (or side.positions) -> [b, s, d]. lookup(table,
        tokens): the token rows of a table that holds a slice of the vocabulary (the pipeline's, when its ranks
        share the vocabulary: megajax/parallel/pipeline/vocab.py); None: jnp.take."""
        side = NO_SIDE if side is None else side
        cfg = self.cfg
        cdt = jnp.dtype(cfg.compute_dtype)
        # With the table sharded over 'vocab', XLA looks up locally with out-of-range ids masked and
        # all-reduces over 'tensor': Megatron's VocabParallelEmbedding.
        x = (lookup or functools.partial(jnp.take, axis=0))(self.embedding.astype(cdt), tokens_bs)
        if recipe(cfg).learned_positions:
            at = token_positions(side, tokens_bs.shape[1], offset)
            x = x + jnp.take(self.position_embedding, at, axis=0).astype(cdt)
        x = dropout(x, cfg.dropout, side.keys, salt=0)
        return constrain(x, RESIDUAL)


def rope_inv_freq(cfg: ModelConfig, head_dim: int) -> jax.Array:
    """RoPE's inverse frequencies [head_dim / 2], with Llama 3.1's scaling when model.rope_scaling=llama3: the
    low frequencies (wavelengths above original / low_freq_factor) are divided by the factor, the high ones
    (below original / high_freq_factor) are kept, and those between are interpolated (as Hugging Face's
    rope_type 'llama3')."""
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if cfg.rope_scaling == "none":
        return inv_freq
    if cfg.rope_scaling == "yarn":
        return yarn_inv_freq(cfg, inv_freq, head_dim)
    factor, low, high = cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    original = cfg.rope_original_max_positions
    wavelen = 2 * jnp.pi / inv_freq
    scaled = jnp.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    between = (wavelen >= original / high) & (wavelen <= original / low)
    return jnp.where(between, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def token_positions(side: Side, s: int, offset: jax.Array | int = 0) -> jax.Array:
    """The positions of s tokens: side.positions [b, s] (packed documents with data.reset_position_ids), else
    offset + this context rank's positions [s] (0 .. s - 1 without context parallelism)."""
    if side.positions is not None:
        return side.positions
    return context.positions(s) + offset


def yarn_inv_freq(cfg: ModelConfig, inv_freq: jax.Array, head_dim: int) -> jax.Array:
    """YaRN's inverse frequencies (Peng et al., 2023, as Hugging Face's rope_type 'yarn'): the dimensions that turn
    more than beta_fast times over the original context keep their frequency, those turning fewer than beta_slow
    times are divided by the factor, and a linear ramp blends the ones between."""
    def turning_dim(turns):  # the dimension that turns `turns` times over the original context
        return head_dim * math.log(cfg.rope_original_max_positions / (turns * 2 * math.pi)) / (2 * math.log(
            cfg.rope_theta))

    low = max(math.floor(turning_dim(cfg.rope_yarn_beta_fast)), 0)
    high = min(math.ceil(turning_dim(cfg.rope_yarn_beta_slow)), head_dim - 1)
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / max(high - low, 0.001), 0, 1)
    return inv_freq / cfg.rope_scaling_factor * ramp + inv_freq * (1 - ramp)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_amplitude(cfg: ModelConfig) -> float:
    """What YaRN multiplies the rotated dimensions by (its attention temperature, on q and k both): mscale(factor,
    mscale) / mscale(factor, mscale_all_dim) where both are set (DeepSeek's), else mscale(factor); 1 otherwise."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    factor, mscale, all_dim = cfg.rope_scaling_factor, cfg.rope_yarn_mscale, cfg.rope_yarn_mscale_all_dim
    if mscale and all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim)
    return _yarn_mscale(factor)


def softmax_scale(cfg: ModelConfig, qk_dim: int) -> float | None:
    """The attention softmax scale: None (1 / sqrt(qk_dim), the kernels' default), but with multi-latent attention
    and YaRN's mscale_all_dim that times mscale(factor, mscale_all_dim)^2 (DeepSeek-V2/V3's)."""
    if recipe(cfg).qkv == "latent" and cfg.rope_scaling == "yarn" and cfg.rope_yarn_mscale_all_dim:
        return _yarn_mscale(cfg.rope_scaling_factor, cfg.rope_yarn_mscale_all_dim) ** 2 / math.sqrt(qk_dim)
    return None


def rotary(cfg: ModelConfig, side: Side, s: int, offset: jax.Array | int, width: int):
    """`rope` of `width` dimensions at these s tokens' positions (`token_positions`), with the config's frequencies
    and amplitude: x [b, s, heads, width] -> the same, rotated."""
    inv_freq, at, amplitude = rope_inv_freq(cfg, width), token_positions(side, s, offset), rope_amplitude(cfg)
    return lambda x: rope(x, inv_freq, at, amplitude)


def rope(x_bshk: jax.Array, inv_freq: jax.Array, positions: jax.Array, amplitude: float = 1.0) -> jax.Array:
    """Rotary position embedding, "rotate half" convention (as Hugging Face's Llama), at positions [s] or
    [b, s] (`token_positions`); `amplitude` scales the result (`rope_amplitude`)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [(b,) s, k/2]
    angles = angles if angles.ndim == 3 else angles[None]
    cos = amplitude * jnp.concatenate([jnp.cos(angles)] * 2, -1)[:, :, None, :]
    sin = amplitude * jnp.concatenate([jnp.sin(angles)] * 2, -1)[:, :, None, :]
    xf = x_bshk.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * cos + rotated * sin).astype(x_bshk.dtype)


KVCache = tuple[jax.Array, jax.Array]  # one layer's keys and values, each [b, t, g, k]


def cached_attention(q_bshk: jax.Array, k_bsgk: jax.Array, v_bsgk: jax.Array, cache: KVCache,
                     offset: jax.Array | int, scale: float | None = None) -> tuple[jax.Array, KVCache]:
    """Attention of s new positions (starting at `offset`) over a KV cache of t >= offset + s positions.

    Writes the new keys and values into the cache at [offset, offset + s), then each query attends to
    the cache positions up to its own (later slots are still empty). Returns ([b, s, h, k], new cache).
    Always XLA's attention, whatever model.attention_impl says: a decode step reads the whole cache for one
    query per sequence, which is bandwidth-bound, and the flash kernels are built for long queries.
    """
    k_cache, v_cache = cache
    k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k_bsgk.astype(k_cache.dtype), offset, axis=1)
    v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v_bsgk.astype(v_cache.dtype), offset, axis=1)
    s, t = q_bshk.shape[1], k_cache.shape[1]
    visible_st = jnp.arange(t)[None, :] <= offset + jnp.arange(s)[:, None]
    # XLA's fused attention takes the grouped-query layout as is (query head i reads kv head i // r).
    o = jax.nn.dot_product_attention(q_bshk, k_cache.astype(q_bshk.dtype), v_cache.astype(q_bshk.dtype),
                                     mask=visible_st[None, None], scale=scale, implementation="xla")
    return o, (k_cache, v_cache)


class Attention(nn.Module):
    """Causal self-attention, grouped-query when num_kv_heads < num_heads, or DeepSeek's multi-latent attention
    (`latent_qkv`). Column-parallel QKV over heads, row-parallel output projection."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_bsd: jax.Array, layer, side: Side | None, cache: KVCache | None = None,
                 offset: jax.Array | int = 0):
        """x [b, s, d] -> [b, s, d] (training and full forward passes).

        With `cache` (decoding), the s positions start at `offset`, attend through `cached_attention`
        and the result is (y [b, s, d], updated cache); the parameters and projections are the same.
        """
        cfg = self.cfg
        side = NO_SIDE if side is None else side
        h, d = cfg.num_heads, cfg.hidden_size
        pdt, cdt = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.compute_dtype)
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        q, kk, v = (latent_qkv if recipe(cfg).qkv == "latent" else fused_qkv)(self, x_bsd, side, offset)
        q = constrain(q, ("batch", None, "heads", "head_dim"))
        kk = constrain(kk, ("batch", None, "kv_heads", "head_dim"))
        v = constrain(v, ("batch", None, "kv_heads", "head_dim"))

        probs_dropout = None
        if cfg.attention_dropout > 0 and side.keys is not None:
            probs_dropout = AttentionDropout.of(side.keys, 1 + 4 * layer, cfg.attention_dropout, h)
        segments = side.segment_ids  # packed documents attend within their own

        scale = softmax_scale(cfg, q.shape[-1])

        def core(q, kk, v):
            if context.size() > 1:  # the whole sequence's keys and values, by a ring, an all-gather or all-to-alls
                return context.attention(q, kk, v, segment_ids=segments, impl=cfg.attention_impl, scale=scale,
                                         probs_dropout=probs_dropout)
            return kernels.attention(q, kk, v, causal=True, segment_ids=segments, impl=cfg.attention_impl,
                                     probs_dropout=probs_dropout, scale=scale)

        fused = kernel_choice.fused_attention(cfg.attention_impl, cfg.head_dim,
                                              kernel_choice.platform())
        core = recomputed_core(cfg, core, fused)
        if cache is None:
            o = core(q, kk, v)
        else:  # decoding: the new positions attend over the cache (no dropout, nothing to recompute)
            o, cache = cached_attention(q, kk, kernels.as_wide_as_keys(v, kk), cache, offset, scale)
        o = constrain(o[..., :cfg.value_dim], ("batch", None, "heads", "head_dim"))

        wo = param(self, "wo", (h, cfg.value_dim, d), WEIGHT_NAMES["wo"], out_std, pdt)
        y = row_matmul(self, "wo", o, wo.astype(cdt))  # the all-reduce (reduce-scatter with sequence parallel)
        if recipe(cfg).bias:
            y = y + param(self, "bo", (d,), ("embed",), 0, pdt).astype(cdt)
        return y if cache is None else (y, cache)


def fused_qkv(module: nn.Module, x_bsd: jax.Array, side: Side, offset: jax.Array | int):
    """Queries [b, s, h, k], keys and values [b, s, g, k] from one fused matmul (RoPE applied for llama)."""
    cfg = module.cfg
    h, g, k, d = cfg.num_heads, cfg.kv_heads, cfg.head_dim, cfg.hidden_size
    pdt, cdt = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.compute_dtype)
    # One fused QKV matrix, grouped by kv head as Megatron lays it out: [d, g, r + 2, k] holds, for each kv head,
    # its r = h / g query heads, then its key, then its value. Sharding g over 'tensor' keeps every group on one
    # rank, and the backward has a single partial dX to all-reduce (three separate q/k/v matmuls would all-reduce
    # three). Sequence parallel: the all-gather comes first.
    r = h // g
    wqkv = param(module, "wqkv", (d, g, r + 2, k), WEIGHT_NAMES["wqkv"], cfg.init_std, pdt)
    qkv = column_matmul(module, "wqkv", x_bsd, wqkv.astype(cdt))
    if recipe(cfg).qkv_bias:
        qkv = qkv + param(module, "bqkv", (g, r + 2, k), ("kv_heads", None, "head_dim"), 0, pdt).astype(cdt)
    b, s = qkv.shape[:2]
    q = qkv[:, :, :, :r].reshape(b, s, h, k)  # query head i uses kv head i // r
    kk, v = qkv[:, :, :, r], qkv[:, :, :, r + 1]
    if recipe(cfg).rotary:
        rotate = rotary(cfg, side, s, offset, k)
        q, kk = rotate(q), rotate(kk)
    return q, kk, v


def latent_matmul(module: nn.Module, name: str, x: jax.Array, shape: tuple) -> jax.Array:
    """One of multi-latent attention's projections (`weight_einsum`): a down-projection of the residual stream
    x [b, s, d] to a latent [b, s, r] (the weight whole on every tensor rank, the output left on the residual's
    sequence shards), or an up-projection of a gathered latent to heads [b, s, h, k] (column-parallel)."""
    cfg = module.cfg
    w = param(module, name, shape, WEIGHT_NAMES[name], cfg.init_std, jnp.dtype(cfg.param_dtype))
    y = weight_einsum(module, name, x, w.astype(jnp.dtype(cfg.compute_dtype)))
    return constrain(y, RESIDUAL) if y.ndim == 3 else y


def latent_qkv(module: nn.Module, x_bsd: jax.Array, side: Side, offset: jax.Array | int):
    """Multi-latent attention's queries and keys [b, s, h, n + r] and values [b, s, h, v] (DeepSeek-V2,
    Megatron-Core's MLA; n = qk_head_dim, r = qk_pos_emb_head_dim, v = v_head_dim).

    The residual stream is projected down to a latent c_kv [b, s, kv_lora_rank] and a RoPE key part [b, s, r]
    shared by all heads, and (with q_lora_rank) to a query latent; each latent is RMS-normalised, and the heads'
    keys' first n dimensions, their values and their queries are column-parallel up-projections of them. The
    down-projections run on the residual's sequence shards (their weights are small and whole on every tensor
    rank), so sequence parallelism gathers the latents, not the residual stream: kv_lora_rank + r (+ q_lora_rank)
    wide instead of d, as Megatron's MLA does. The values stay v wide: every attention implementation takes them so
    (the flash kernel reads n + r = 192 as 128 + 64 and the values at 128; `kernels.as_wide_as_keys` pads them
    where needed)."""
    cfg = module.cfg
    h, n, r, v, d = cfg.num_heads, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.v_head_dim, cfg.hidden_size
    if cfg.q_lora_rank is None:
        w = param(module, "wq", (d, h, n + r), WEIGHT_NAMES["wq"], cfg.init_std, jnp.dtype(cfg.param_dtype))
        q = column_matmul(module, "wq", x_bsd, w.astype(jnp.dtype(cfg.compute_dtype)))
    else:
        cq = Norm(cfg, name="q_norm")(latent_matmul(module, "wq_down", x_bsd, (d, cfg.q_lora_rank)))
        q = latent_matmul(module, "wq_up", gather_sequence(cq), (cfg.q_lora_rank, h, n + r))
    ckv = latent_matmul(module, "wkv_down", x_bsd, (d, cfg.kv_lora_rank + r))
    c = Norm(cfg, name="kv_norm")(ckv[..., :cfg.kv_lora_rank])
    kv = latent_matmul(module, "wkv_up", gather_sequence(c), (cfg.kv_lora_rank, h, n + v))
    k_pe = gather_sequence(ckv[..., cfg.kv_lora_rank:])[:, :, None, :]  # [b, s, 1, r]
    b, s = q.shape[:2]
    rotate = rotary(cfg, side, s, offset, r)
    q = jnp.concatenate([q[..., :n], rotate(q[..., n:])], axis=-1)
    k_pe = jnp.broadcast_to(rotate(k_pe), (b, s, h, r))
    kk = jnp.concatenate([kv[..., :n], k_pe], axis=-1)
    return q, kk, kv[..., n:]


@kernels.keeps_inputs
def gelu(z: jax.Array) -> jax.Array:
    """The tanh-approximated GeLU (GPT-2's), keeping only `z` for its backward (autodiff would keep five
    [tokens, ffn] intermediates; Megatron's fused bias-GeLU keeps its input too)."""
    return nn.gelu(z, approximate=True)


@kernels.keeps_inputs(static_argnums=(1,))
def swiglu(gate_up: jax.Array, axis: int) -> jax.Array:
    """silu(gate) * up, gate and up side by side on `axis` of gate_up, keeping only `gate_up`."""
    gate, up = (jax.lax.index_in_dim(gate_up, i, axis, keepdims=False) for i in (0, 1))
    return nn.silu(gate) * up


class MLP(nn.Module):
    """GeLU MLP (gpt2) or SwiGLU (llama): column-parallel in, row-parallel out."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_bsd: jax.Array) -> jax.Array:
        cfg = self.cfg
        d, f = cfg.hidden_size, cfg.ffn_size
        pdt, cdt = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.compute_dtype)
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        if recipe(cfg).mlp == "swiglu":
            # gate and up fused as [d, 2, f] (one partial dX to all-reduce in the backward, as for QKV)
            w_gate_up = param(self, "w_gate_up", (d, 2, f), WEIGHT_NAMES["w_gate_up"], cfg.init_std, pdt)
            gate_up = column_matmul(self, "w_gate_up", x_bsd, w_gate_up.astype(cdt))
            hidden = swiglu(gate_up, 2)
        else:
            w_in = param(self, "w_in", (d, f), WEIGHT_NAMES["w_in"], cfg.init_std, pdt)
            b_in = param(self, "b_in", (f,), ("mlp",), 0, pdt)
            hidden = gelu(column_matmul(self, "w_in", x_bsd, w_in.astype(cdt)) + b_in.astype(cdt))
        hidden = constrain(hidden, ("batch", None, "mlp"))
        w_out = param(self, "w_out", (f, d), WEIGHT_NAMES["w_out"], out_std, pdt)
        y = row_matmul(self, "w_out", hidden, w_out.astype(cdt))
        if recipe(cfg).bias:
            y = y + param(self, "b_out", (d,), ("embed",), 0, pdt).astype(cdt)
        return y
