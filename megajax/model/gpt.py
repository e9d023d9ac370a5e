"""GPT-2 and Llama style decoder-only transformers.

The model is three stages that the trainer (and the pipeline) calls separately:
  embed:  tokens [b, s] -> residual stream [b, s, d]
  layers: [b, s, d] -> [b, s, d], a scan over stacked blocks (compile time flat in depth)
  head:   [b, s, d] -> summed token losses, vocab-parallel: the full logits are never gathered
`GPT` composes them for `init` (its parameter tree is {embed, layers, head}, and first_dense with
model.moe_first_dense_layers: those run inside embed); `embed_apply`,
`layers_apply` and `head_apply` run one stage on its slice of that tree, so a pipeline chunk is
`layers_apply` on a slice of the stacked layers.
"""

from __future__ import annotations

import chex
import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from megajax.config import ModelConfig
from megajax.model.layers import (MLP, NO_SIDE, RESIDUAL, TAP_GRADS, TAP_INPUTS, Attention, Embed, KVCache, Norm,
                                  Side, dropout, gather_sequence, layers_unrolled, param, recomputed_module)
from megajax.model.model_state import MTP_STATS
from megajax.model.moe import MoE
from megajax.model.moe.routing import attach_loss, report
from megajax.parallel import step_plan
from megajax.parallel.step_plan import constrain


class Block(nn.Module):
    """Pre-norm transformer block: x + Attn(Norm(x)), then x + MLP(Norm(x)); in an MoE model the MLP is the
    experts' unless `dense`."""

    cfg: ModelConfig
    dense: bool = False

    @nn.compact
    def __call__(self, x_bsd: jax.Array, layer: jax.Array, side: Side | None,
                 cache: KVCache | None = None, offset: jax.Array | int = 0):
        """(x [b, s, d], None), or (x, this layer's updated KV cache) when decoding with `cache`."""
        cfg = self.cfg
        side = NO_SIDE if side is None else side
        a = Attention(cfg, name="attn")(Norm(cfg, name="attn_norm")(x_bsd), layer, side, cache, offset)
        if cache is not None:
            a, cache = a
        x = constrain(x_bsd + dropout(a, cfg.dropout, side.keys, salt=2 + 4 * layer), RESIDUAL)
        h = Norm(cfg, name="mlp_norm")(x)
        m = MoE(cfg, name="mlp")(h, side.objective_scale) if cfg.num_experts and not self.dense else \
            MLP(cfg, name="mlp")(h)
        x = constrain(x + dropout(m, cfg.dropout, side.keys, salt=3 + 4 * layer), RESIDUAL)
        return x, cache


class Blocks(nn.Module):
    """Consecutive blocks run as one module (`layer_0`, `layer_1`, ...): with `period`, the layer stack's unit of
    model.moe_layer_freq blocks (Megatron's pattern: layer i is MoE when i % n == 0, so `layer_0` has experts and
    the rest are dense; unit u runs layers u n .. u n + n - 1); else the model.moe_first_dense_layers dense blocks
    before the stack (DeepSeek's first_k_dense_replace), not scanned (a few), run with the embedding
    (`embed_apply`: under a pipeline, on the first stage), their layer indices, which salt the dropout masks,
    after the stack's."""

    cfg: ModelConfig
    period: bool = True

    @nn.compact
    def __call__(self, x_bsd: jax.Array, unit: jax.Array | int, side: Side | None,
                 cache: KVCache | None = None, offset: jax.Array | int = 0):
        """As Block's (`unit`: the stack's unit index; 0 for the first dense layers); `cache` holds these
        blocks' keys and values ([n, b, t, g, k] each)."""
        cfg = self.cfg
        n = cfg.layer_period if self.period else cfg.first_dense_layers
        first = unit * n if self.period else cfg.stacked_layers  # the stack's blocks are 0 .. stacked_layers - 1
        x, new = x_bsd, []
        for j in range(n):
            x, c = Block(cfg, dense=j > 0 or not self.period, name=f"layer_{j}")(
                x, first + j, side, None if cache is None else (cache[0][j], cache[1][j]), offset)
            new.append(c)
        if cache is None:
            return x, None
        return x, tuple(jnp.stack([c[i] for c in new]) for i in range(2))


def unit_module(cfg: ModelConfig) -> type[nn.Module]:
    """What the layer stack scans: one Block, or Blocks of model.moe_layer_freq blocks in an MoE model."""
    return Blocks if cfg.layer_period > 1 else Block


def layer_unroll(cfg: ModelConfig, n: int) -> int:
    """A scan's unroll over `n` layers: 1 (a loop), or all of them when model.scan_layers is false (or null and
    the step plan in force unrolls, StepPlan.unroll_layers): XLA then keeps each layer's residuals in their own
    buffers, where a loop copies them into and out of per-layer stacks (benchmarks/2026-11-27-h100.md: 8-16% of a
    step on one H100)."""
    return max(n, 1) if layers_unrolled(cfg) else 1


def scan_layers(cfg: ModelConfig, body, carry, xs):
    """jax.lax.scan(body, carry, xs) over a stack of layers, unrolled as `layer_unroll` says."""
    return jax.lax.scan(body, carry, xs, unroll=layer_unroll(cfg, jax.tree.leaves(xs)[0].shape[0]))


class LayerStack(nn.Module):
    """`units` (`unit_module`: blocks, or groups of model.moe_layer_freq blocks) stacked on a leading 'layers' axis
    and run with a scan; layer indices count units.

    recompute="full" keeps only each unit's input for the backward (Megatron's full recomputation);
    "selective" recomputes the attention core only (inside Attention).
    """

    cfg: ModelConfig
    units: int

    @nn.compact
    def __call__(self, x_bsd: jax.Array, side: Side | None, first_layer: jax.Array | int = 0,
                 cache: KVCache | None = None, offset: jax.Array | int = 0):
        """[b, s, d] -> [b, s, d]. Decoding passes `cache` (keys and values [layers, b, t, g, k]) and the
        position `offset` of the first of the s tokens, and gets (x, updated cache) back."""
        unit = unit_module(self.cfg)
        if cache is not None:
            # The same units and parameter tree, scanned with each unit's cache slice in and out.
            n = self.cfg.layer_period
            grouped = tuple(c.reshape(self.units, n, *c.shape[1:]) for c in cache) if n > 1 else cache
            scan = nn.scan(unit, variable_axes={"params": 0}, split_rngs={"params": True},
                           in_axes=(0, nn.broadcast, 0, nn.broadcast), length=self.units,
                           metadata_params={nn.PARTITION_NAME: "layers"})
            layers = jnp.arange(self.units) + first_layer
            x, new = scan(self.cfg, name="block")(x_bsd, layers, side, grouped, offset)
            return x, tuple(c.reshape(-1, *c.shape[2:]) for c in new) if n > 1 else new
        block = recomputed_module(self.cfg, unit)
        scan = nn.scan(
            block,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(0, nn.broadcast),
            length=self.units,
            metadata_params={nn.PARTITION_NAME: "layers"},
            unroll=layer_unroll(self.cfg, self.units),
        )
        layers = jnp.arange(self.units) + first_layer  # global unit index: salts the dropout masks
        x, _ = scan(self.cfg, name="block")(x_bsd, layers, side)
        return x


class Head(nn.Module):
    """Final norm and output layer (the embedding when tied): fp32 logits sharded over the vocabulary.
    `head_apply` adds the vocab-parallel cross entropy."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_bsd: jax.Array, tied_table_vd: jax.Array | None = None) -> jax.Array:
        """Returns fp32 logits [b, s, v_padded], sharded over v. tied_table: the embedding, if tied."""
        cfg = self.cfg
        x = Norm(cfg, name="final_norm")(x_bsd)
        weight = tied_table_vd
        if not cfg.tied:
            weight = self.param("output", nn.with_logical_partitioning(nn.initializers.normal(cfg.init_std),
                                                                       ("embed", "vocab")),
                                (cfg.hidden_size, cfg.padded_vocab_size), jnp.dtype(cfg.param_dtype))
        return output_logits(cfg, x, weight)


def output_logits(cfg: ModelConfig, normed_bsd: jax.Array, weight: jax.Array) -> jax.Array:
    """fp32 logits [b, s, v_padded], sharded over v, of the normed hidden states: the output layer's
    ([d, v]), or the embedding table's ([v, d]) when tied."""
    x = gather_sequence(normed_bsd)
    w = weight.astype(jnp.dtype(cfg.compute_dtype))
    logits = jnp.einsum("bsd,vd->bsv" if cfg.tied else "bsd,dv->bsv", x, w)
    return constrain(logits.astype(jnp.float32), ("batch", None, "vocab"))


class MultiTokenPrediction(nn.Module):
    """DeepSeek-V3's multi-token prediction module `depth` (k of model.mtp_num_layers): from the previous depth's
    hidden states h_i (the main model's last layer's output at depth 1) and the embedding of token t_{i+k}, one
    transformer block over W [RMSNorm(Emb(t_{i+k})); RMSNorm(h_i)] (the order of Hugging Face's eh_proj and
    Megatron's); its logits, of t_{i+k+1}, are the shared output layer's after the module's own final norm.
    Returns (the block's output, for the next depth; its normed output, for the logits)."""

    cfg: ModelConfig
    depth: int

    @nn.compact
    def __call__(self, h_bsd: jax.Array, e_bsd: jax.Array, side: Side | None) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        both = jnp.concatenate([Norm(cfg, name="enorm")(e_bsd), Norm(cfg, name="hnorm")(h_bsd)], axis=-1)
        w = self.param("eh_proj", nn.with_logical_partitioning(nn.initializers.normal(cfg.init_std),
                                                               (None, "embed")),
                       (2 * cfg.hidden_size, cfg.hidden_size), jnp.dtype(cfg.param_dtype))
        x = constrain(jnp.einsum("bsk,kd->bsd", both, w.astype(jnp.dtype(cfg.compute_dtype))), RESIDUAL)
        # (its layer index, which salts its dropout, follows the model's: Hugging Face's layer 61 of DeepSeek-V3)
        x, _ = recomputed_module(cfg, Block)(cfg, name="block")(x, cfg.num_layers + self.depth - 1, side)
        param(self, MTP_STATS, (2,), (None,), 0, jnp.float32)  # (`head_loss` reports through it)
        return x, Norm(cfg, name="final_norm")(x)


def cross_entropy(logits_bsv: jax.Array, targets_bs: jax.Array, vocab_size: int, shard=None) -> jax.Array:
    """Per-token loss [b, s] from vocab-sharded logits, without gathering them (Megatron's
    vocab-parallel cross entropy: a max, a sum of exponentials and the target logit, each reduced over
    the vocab shards). Padded vocabulary entries are masked out of the softmax.

    The mask is applied only where the vocabulary is padded. The target logit is picked by a compare over every
    vocabulary entry, which XLA's GPU compiler fuses into the softmax's passes; on a CPU that pass costs as much as
    a layer's matmul, so there, without tensor parallelism (the step plan's: a gather along a sharded vocabulary
    would make GSPMD gather the logits), it is gathered instead. (On the H100 target the gather's backward held
    0.76 GiB more for gpt2-124m.)

    shard: (the index of the first vocabulary entry of these logits, (pmax, psum)) where the logits are one rank's
    slice of the vocabulary and the reductions over the slices are collectives (the pipeline's ranks sharing the
    vocabulary: megajax/parallel/pipeline/vocab.py); None: the logits cover it all."""
    ids = jax.lax.broadcasted_iota(jnp.int32, logits_bsv.shape, 2)
    if shard is not None:
        first, (pmax, psum) = shard
        ids = ids + first
        logits = jnp.where(ids < vocab_size, logits_bsv, -jnp.inf)
        top = pmax(jax.lax.stop_gradient(jnp.max(logits, axis=-1)))
        lse = top + jnp.log(psum(jnp.sum(jnp.exp(logits - top[..., None]), axis=-1)))
        return lse - psum(jnp.sum(jnp.where(ids == targets_bs[..., None], logits, 0.0), axis=-1))
    logits = logits_bsv if logits_bsv.shape[-1] == vocab_size else jnp.where(ids < vocab_size, logits_bsv, -jnp.inf)
    lse = jax.nn.logsumexp(logits, axis=-1)

    def picked(logits, targets):
        return jnp.sum(jnp.where(ids == targets[..., None], logits, 0.0), axis=-1)

    def gathered(logits, targets):
        return jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]

    if step_plan.in_force().tensor > 1:
        return lse - picked(logits, targets_bs)
    return lse - step_plan.platform_dependent(logits, targets_bs, cpu=gathered, default=picked)


class GPT(nn.Module):
    """The whole model: used to initialise parameters and for plain forward passes."""

    cfg: ModelConfig

    def setup(self):
        self.embed = Embed(self.cfg)
        if self.cfg.first_dense_layers:
            self.first_dense = Blocks(self.cfg, period=False)
        self.layers = LayerStack(self.cfg, self.cfg.stacked_layers // self.cfg.layer_period)
        self.head = Head(self.cfg)
        self.mtp = [MultiTokenPrediction(self.cfg, k, name=f"mtp_{k}") for k in range(1, self.cfg.mtp_num_layers + 1)]

    def __call__(self, tokens_bs: jax.Array, side: Side | None = None) -> jax.Array:
        """tokens [b, s] -> fp32 logits [b, s, v_padded] (the main model's; the multi-token prediction modules
        run only to be initialised)."""
        x = self.embed(tokens_bs, side)
        if self.cfg.first_dense_layers:
            x = self.first_dense(x, 0, side)[0]
        x = self.layers(x, side)
        if self.is_initializing():  # (the modules' parameters; their loss is `head_loss`'s)
            h = x
            for module in self.mtp:
                h = module(h, self.embed(tokens_bs, side), side)[0]
        return self.head(x, self.embed.embedding if self.cfg.tied else None)


def init_params(cfg: ModelConfig, rng: jax.Array) -> dict:
    """Boxed (nn.LogicallyPartitioned) parameters; use nn.unbox for arrays and `logical_axes` for names."""
    tokens = jnp.zeros((1, cfg.seq_length), jnp.int32)
    return GPT(cfg).init(rng, tokens, mutable=["params"])["params"]


def abstract_params(cfg: ModelConfig) -> dict:
    """The parameter tree as jax.ShapeDtypeStructs (canonical layout, layers stacked on a leading axis);
    nothing is allocated."""
    return jax.eval_shape(lambda: nn.unbox(init_params(cfg, jax.random.key(0))))


def logical_axes(boxed_params) -> dict:
    """The tree of logical axis-name tuples for a boxed parameter tree."""
    return jax.tree.map(lambda b: tuple(b.names), boxed_params,
                        is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


def embed_apply(cfg: ModelConfig, params: dict, tokens_bs: jax.Array, side: Side | None, lookup=None) -> jax.Array:
    """The model's first part: the embedding, and the first dense layers of a model with
    model.moe_first_dense_layers: [b, s] -> [b, s, d]. lookup: as `embed_tokens`'s (a pipeline whose ranks each
    hold a slice of the vocabulary gives the rows they looked up; `cfg` is that slice's)."""
    return first_dense_apply(cfg, params, embed_tokens(cfg, params, tokens_bs, side, lookup), side)


def embed_tokens(cfg: ModelConfig, params: dict, tokens_bs: jax.Array, side: Side | None, lookup=None) -> jax.Array:
    """The embedding alone: [b, s] -> [b, s, d]; lookup: `layers.Embed`'s (a table holding a slice of the
    vocabulary)."""
    return Embed(cfg).apply({"params": params["embed"]}, tokens_bs, side, lookup=lookup)


def first_dense_apply(cfg: ModelConfig, params: dict, x_bsd: jax.Array, side: Side | None) -> jax.Array:
    """The first dense layers of a model with model.moe_first_dense_layers (else x as it is)."""
    if not cfg.first_dense_layers:
        return x_bsd
    return Blocks(cfg, period=False).apply({"params": params["first_dense"]}, x_bsd, 0, side)[0]


def layers_apply(cfg: ModelConfig, stack_params: dict, x_bsd: jax.Array, side: Side | None,
                 first_layer: jax.Array | int = 0) -> jax.Array:
    """Runs the units stacked in `stack_params` ({"block": leaves with a leading unit axis}); `first_layer` is the
    global index of the first unit."""
    n = jax.tree.leaves(stack_params)[0].shape[0]
    return LayerStack(cfg, n).apply({"params": stack_params}, x_bsd, side, first_layer)


def block_apply(cfg: ModelConfig, layer_params: dict, x_bsd: jax.Array, layer: jax.Array | int,
                side: Side | None) -> jax.Array:
    """One unit (a block, or model.moe_layer_freq of them; its parameters sliced from the stack) at global unit
    index `layer`: [b, s, d] -> [b, s, d]. The pipeline runs units one at a time with it, to stash each unit's input
    and recompute unit by unit in the backward."""
    return unit_module(cfg)(cfg).apply({"params": layer_params}, x_bsd, layer, side)[0]


def block_apply_split(cfg: ModelConfig, layer_params: dict, taps: dict, x_bsd: jax.Array, layer: jax.Array | int,
                      side: Side | None) -> tuple[jax.Array, dict]:
    """`block_apply` with the zero-bubble hooks (layers.TAP_GRADS): taps are zeros shaped like each weight
    matmul's output (`block_tap_shapes`), whose gradients are those outputs' gradients. Returns (y, each
    weight matmul's input, a tree shaped like taps)."""
    (y, _), state = unit_module(cfg)(cfg).apply({"params": layer_params, TAP_GRADS: taps}, x_bsd, layer, side,
                                                mutable=[TAP_INPUTS])
    return y, state[TAP_INPUTS]


def block_tap_shapes(cfg: ModelConfig, layer_params: dict, x_bsd: jax.Array, side: Side | None) -> dict:
    """The taps of one unit as jax.ShapeDtypeStructs (nothing is computed)."""
    def taps(params, x, side):
        return unit_module(cfg)(cfg).apply({"params": params}, x, 0, side, mutable=[TAP_GRADS])[1][TAP_GRADS]

    return jax.eval_shape(taps, layer_params, x_bsd, side)


def head_apply(cfg: ModelConfig, params: dict, x_bsd: jax.Array, targets_bs: jax.Array,
               mask_bs: jax.Array, shard=None) -> jax.Array:
    """Sum of the masked token losses (fp32 scalar). shard: (`cross_entropy`'s shard, the whole vocabulary's size)
    where the output layer (or the tied embedding) in `params` holds a slice of the vocabulary (and `cfg` is that
    slice's)."""
    table = params["embed"]["embedding"] if cfg.tied else None
    logits = Head(cfg).apply({"params": params["head"]}, x_bsd, table)
    return jnp.sum(cross_entropy(logits, targets_bs, *_vocabulary(cfg, shard)) * mask_bs)


def _vocabulary(cfg: ModelConfig, shard) -> tuple:
    """`head_apply`'s shard as `cross_entropy` takes it: (the whole vocabulary's size, the slice's shard or None)."""
    return (cfg.vocab_size, None) if shard is None else (shard[2], shard[:2])


def dropout_keys(cfg: ModelConfig, seed: int, sample_ids: jax.Array) -> jax.Array | None:
    """One dropout key per sample from (seed, global sample index), so masks never depend on the layout
    or the micro batch split; None when the model has no dropout."""
    if cfg.dropout == 0 and cfg.attention_dropout == 0:
        return None
    root = jax.random.fold_in(jax.random.key(seed), 0x5EED)
    return jax.vmap(lambda i: jax.random.fold_in(root, i))(sample_ids)


def side_inputs(cfg: ModelConfig, seed: int, mb: dict, dropout: bool = True,
                objective_scale: jax.Array | None = None) -> Side:
    """A micro batch's `Side`: dropout keys (with `dropout` and a model that has dropout), the segment ids and
    positions of packed documents where the batch carries them (`documents`), and the cotangent seed of the loss
    being differentiated (`objective_scale`: the MoE layers' auxiliary losses join the gradient at that scale)."""
    return Side(keys=dropout_keys(cfg, seed, mb["sample_ids"]) if dropout else None,
                segment_ids=mb.get("segment_ids"), positions=mb.get("positions"),
                objective_scale=objective_scale if cfg.num_experts or cfg.mtp_num_layers else None)


def forward_loss(cfg: ModelConfig, params: dict, batch: dict, side: Side | None, layers) -> jax.Array:
    """The model's one assembly: the summed token loss of one micro batch, `embed_apply` -> `layers` ->
    `head_loss`. `layers` (x_bsd -> x_bsd) runs the stack as its caller needs: the plain scan (`loss_sum`), or the
    overlapped reductions' and ZeRO-3's loops with their gathers and reductions (parallel/overlap.py). A pipeline
    calls the same two parts on its ranks (Megatron's pre_process / post_process stages): `embed_apply` on its first
    chunk, `head_loss` on its last (parallel/pipeline/chunks.py, gpipe.py; vocab.py gives them a vocabulary slice),
    with the layers' chunks between."""
    chex.assert_rank(batch["tokens"], 2)  # [b, s]: checked once, when the step is traced
    chex.assert_equal_shape([batch["tokens"], batch["targets"], batch["loss_mask"]])
    x = embed_apply(cfg, params, batch["tokens"], side)
    return head_loss(cfg, params, layers(x), batch, side)


def head_loss(cfg: ModelConfig, params: dict, x_bsd: jax.Array, batch: dict, side: Side | None,
              shard=None, ranks=None) -> jax.Array:
    """The model's last part: the summed token loss of the last layer's output x (`head_apply`; shard: its
    vocabulary slice's), to which, in a loss being differentiated (side.objective_scale), the multi-token
    prediction modules' summed loss joins the gradient at model.mtp_loss_scaling_factor / model.mtp_num_layers
    (`attach_loss`: the value returned stays the main loss's, and the modules' loss and token count leave through
    their `MTP_STATS` channel). ranks, with a shard: the lock step of the ranks that share the vocabulary
    (megajax/parallel/pipeline/vocab.py's `Ranks`): each module's tokens are looked up in every rank's slice
    (ranks.lookup), its block runs on the rank that owns x and shares its normed output for every rank's slice of
    the logits (ranks.owned), and its loss counts on that rank alone (ranks.once)."""
    loss = head_apply(cfg, params, x_bsd, batch["targets"], batch["loss_mask"], shard)
    if not cfg.mtp_num_layers or side is None or side.objective_scale is None:
        return loss
    assert (shard is None) == (ranks is None), "a vocabulary slice's modules run in its ranks' lock step"
    weight = params["embed"]["embedding"] if cfg.tied else params["head"]["output"]
    h, total = x_bsd, jnp.zeros((), jnp.float32)
    for k in range(1, cfg.mtp_num_layers + 1):
        mine = params[f"mtp_{k}"]
        e = embed_tokens(cfg, params, batch[f"mtp_tokens_{k}"], side, None if ranks is None else ranks.lookup)

        def block(h, e, mine=mine, k=k):
            return MultiTokenPrediction(cfg, k).apply({"params": mine}, h, e, side)

        h, normed = block(h, e) if ranks is None else ranks.owned(block, h, e)
        losses = cross_entropy(output_logits(cfg, normed, weight), batch[f"mtp_targets_{k}"], *_vocabulary(cfg, shard))
        mask = batch[f"mtp_mask_{k}"]
        counted = jnp.stack([jnp.sum(losses * mask), jnp.sum(mask)])
        counted = counted if ranks is None else ranks.once(counted)
        total = total + counted[0]
        loss = report(loss, mine[MTP_STATS], counted)
    return attach_loss(loss, total, side.objective_scale * cfg.mtp_loss_scaling_factor / cfg.mtp_num_layers)


def mtp_batch(batch: dict, depths: int) -> dict:
    """The batch with each multi-token prediction module's inputs, from whole sequences (before context
    parallelism splits them): module k reads token t_{i+k} at position i (mtp_tokens_k, the targets k - 1 ahead)
    and predicts t_{i+k+1} (mtp_targets_k), counted where the main loss counts that token (mtp_mask_k) and, with
    packed documents' segment ids, where it is in position i's document; the last k positions predict nothing."""
    targets, mask = batch["targets"], batch["loss_mask"]
    out = dict(batch)

    def ahead(x, k):  # x[:, i + k], zeros past the end
        return jnp.pad(x[:, k:], ((0, 0), (0, k)))

    for k in range(1, depths + 1):
        out[f"mtp_tokens_{k}"] = ahead(targets, k - 1)
        out[f"mtp_targets_{k}"] = ahead(targets, k)
        counted = ahead(mask, k)
        if "segment_ids" in batch:
            counted = counted * (ahead(batch["segment_ids"], k) == batch["segment_ids"]).astype(mask.dtype)
        out[f"mtp_mask_{k}"] = counted
    return out


def loss_sum(cfg: ModelConfig, params: dict, batch: dict, side: Side | None) -> jax.Array:
    """The summed token loss of one micro batch: embed -> layers -> head."""
    return forward_loss(cfg, params, batch, side, lambda x: layers_apply(cfg, params["layers"], x, side))


# ----------------------------------------------------------------------------------------------------
# Decoding with a KV cache: the same parameter tree and layer code, one call per prefill or decode step.


@flax.struct.dataclass
class DecodeState:
    """Keys and values of every layer for a batch of sequences, and how many positions are filled."""

    k: jax.Array  # [layers, b, t, g, k]
    v: jax.Array  # [layers, b, t, g, k]
    length: jax.Array  # int32 scalar: positions 0 .. length - 1 are filled


def init_decode_state(cfg: ModelConfig, batch: int, max_length: int) -> DecodeState:
    """An empty cache for `batch` sequences of up to `max_length` tokens, in the compute dtype."""
    shape = (cfg.num_layers, batch, max_length, cfg.kv_heads, cfg.head_dim)
    zeros = jnp.zeros(shape, jnp.dtype(cfg.compute_dtype))
    return DecodeState(k=zeros, v=zeros, length=jnp.zeros((), jnp.int32))


def decode_apply(cfg: ModelConfig, params: dict, tokens_bs: jax.Array,
                 state: DecodeState) -> tuple[jax.Array, DecodeState]:
    """Feeds s new tokens [b, s] (the prompt, or one sampled token) at positions state.length ..;
    returns the fp32 logits of the last one [b, v_padded] and the cache with the s positions added."""
    offset = state.length
    x = Embed(cfg).apply({"params": params["embed"]}, tokens_bs, None, offset)
    f = cfg.first_dense_layers  # the cache holds their layers first, then the stack's
    if f:
        x, first = Blocks(cfg, period=False).apply({"params": params["first_dense"]}, x, 0, None,
                                                   (state.k[:f], state.v[:f]), offset)
    x, (k, v) = LayerStack(cfg, cfg.stacked_layers // cfg.layer_period).apply(
        {"params": params["layers"]}, x, None, 0, (state.k[f:], state.v[f:]), offset)
    if f:
        k, v = jnp.concatenate([first[0], k]), jnp.concatenate([first[1], v])
    table = params["embed"]["embedding"] if cfg.tied else None
    logits = Head(cfg).apply({"params": params["head"]}, x[:, -1:], table)[:, 0]
    return logits, DecodeState(k=k, v=v, length=offset + tokens_bs.shape[1])
