"""The embedding and the output layer spread over the pipeline ranks (StepPlan.vocab_over_pipeline).

Without it every pipeline rank holds the whole (tensor-sharded) embedding and output layer, though only the first
stage embeds and only the last computes the logits: at a 128k vocabulary that is 1-2 B parameters, with their
gradients, on every rank. With it, rank r of p holds rows [r V/p, (r + 1) V/p) of the (padded) vocabulary, split
further over 'tensor' as before (step_plan.VOCAB_OVER_PIPELINE), and the ranks run both ends in lock step, each on
its slice, in the ticks the schedule's table says the first chunk embeds or the last chunk's output reaches the head
(the same table on every rank, so every rank takes the same branch and joins every collective):

- embedding: each rank looks up the tokens its slice holds (zeros for the others) and one psum over 'pipeline'
  gives the rows; the first rank adds the positions and runs its chunk. Its backward: the first rank's input
  gradient of the rows, shared by a psum, is scattered by each rank into its slice's gradient.
- head: the last rank's output, shared by a psum, goes through the final norm and each rank's slice of the output
  layer; Megatron's vocab-parallel cross entropy reduces the max, the exponentials' sum and the target logit over
  'pipeline' (and 'tensor', by GSPMD) as well. The loss is the last rank's; the gradient of the output comes back
  summed over the ranks by autodiff (the psum's transpose), and each rank keeps its slice's weight gradient.
- multi-token prediction modules (`Ranks`): each module's tokens looked up as the embedding's, its block on the
  last rank alone, its normed output shared by a psum for every rank's slice of its logits.

Cost: per micro batch four all-reduces over 'pipeline' of one activation ([mb, s, d]) and three of [mb, s]
scalars; the head's matmuls are split p ways (the last stage no longer does them alone). The final norm and the
positions stay whole on every rank (their gradients are summed over 'pipeline' as before).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from megajax import model
from megajax.parallel import sharding, step_plan
from megajax.parallel.pipeline import ticks
from megajax.parallel.step_plan import vary, zeros_varying_like

SLICED = (("embed", "embedding"), ("head", "output"))  # the weights a rank holds a slice of (the rest stay whole)


def is_sliced(path) -> bool:
    """Whether the shared weight at `path` (a tree path into {embed, head, first_dense, ...}) is one rank's slice."""
    keys = tuple(getattr(k, "key", None) for k in path)
    return keys[:2] in SLICED


def sum_shared(g_shared: dict, sliced: bool) -> dict:
    """The shared weights' gradients, summed over 'pipeline' but for the slices (each rank's own)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, g: g if sliced and is_sliced(path) else jax.lax.psum(g, "pipeline"), g_shared)


def _psum(x: jax.Array) -> jax.Array:
    """psum over 'pipeline', in fp32 on CPU (XLA's CPU compiler aborted on a bf16 one; GPUs sum in x's dtype)."""
    def in_fp32(x):
        return jax.lax.psum(x.astype(jnp.float32), "pipeline").astype(x.dtype)

    return step_plan.platform_dependent(x, cpu=in_fp32, default=lambda x: jax.lax.psum(x, "pipeline"))


def _marked(x: jax.Array) -> jax.Array:
    """x (the same on every pipeline rank) marked as varying over the manual axes, on CPU through fp32: autodiff
    transposes the mark into a psum of x's gradient, which then sums in fp32 (`_psum`)."""
    def in_fp32(x):
        return vary(x.astype(jnp.float32)).astype(x.dtype)

    return step_plan.platform_dependent(x, cpu=in_fp32, default=vary)


def broadcast(x: jax.Array, source: int) -> jax.Array:
    """x of rank `source`, on every pipeline rank (a psum of it and zeros)."""
    rank = jax.lax.axis_index("pipeline")
    return _psum(jnp.where(rank == source, x, jnp.zeros_like(x)))


def _local(table_rows: int, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(each token's row in this rank's slice, clipped; whether the slice holds it)."""
    local = tokens - jax.lax.axis_index("pipeline") * table_rows
    inside = (local >= 0) & (local < table_rows)
    return jnp.clip(local, 0, table_rows - 1), inside


def lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """The token rows [b, s, d] from every rank's slice of the table (psum over 'pipeline')."""
    at, inside = _local(table.shape[0], tokens)
    rows = jnp.where(inside[..., None], jnp.take(table, at, axis=0), jnp.zeros((), table.dtype))
    return _psum(rows)


def lookup_grad(table: jax.Array, tokens: jax.Array, d_rows: jax.Array) -> jax.Array:
    """The gradient of this rank's slice of the table from the rows' gradient d_rows (the same on every rank): the
    transpose of `lookup`, written out so that no forward psum is traced."""
    at, inside = _local(table.shape[0], tokens)
    d = jnp.where(inside[..., None], d_rows.astype(jnp.float32), 0.0)
    return jnp.zeros(table.shape, jnp.float32).at[at.reshape(-1)].add(d.reshape(-1, d.shape[-1]))


def rows(mcfg, shared: dict, tokens: jax.Array) -> jax.Array:
    """`lookup` of this rank's slice of the embedding, in the compute dtype."""
    return _marked(lookup(shared["embed"]["embedding"].astype(jnp.dtype(mcfg.compute_dtype)), tokens))


def slice_config(mcfg):
    """The model config of one rank's slice of the vocabulary: its embedding and output layer [V / p, ...] (flax
    checks a module's parameters against the shapes its config gives). The cross entropy masks the padded rows by
    the whole vocabulary's size (`head_loss`)."""
    rows = mcfg.padded_vocab_size // step_plan.in_force().pipeline
    return dataclasses.replace(mcfg, vocab_size=rows, make_vocab_size_divisible_by=1)


def embed_apply(mcfg, shared: dict, token_rows: jax.Array, tokens: jax.Array, side) -> jax.Array:
    """The first chunk's input from the looked-up rows (`rows`): model.embed_apply on this rank's slice, the rows
    given (the positions, dropout and first dense layers are the first rank's alone)."""
    return model.embed_apply(slice_config(mcfg), shared, tokens, side, lookup=lambda table, tokens: token_rows)


class Ranks:
    """The multi-token prediction modules in the lock step (model.head_loss's `ranks`): the last rank owns the
    hidden states. Every rank looks up a module's tokens in its slice (`lookup`, a psum); the module's block runs
    on the last rank alone (`owned`: under a conditional on the rank, whose collectives, over 'tensor', 'data' or
    'expert', join ranks of the same pipeline rank), which shares its normed output with every rank (a psum) for
    its slice of the logits; and its loss counts on the last rank alone (`once`), so that its gradient seeds
    there and the psums' transposes carry it to every rank's slice."""

    @staticmethod
    def lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
        return _marked(lookup(table, tokens))

    @staticmethod
    def owned(block, h: jax.Array, e: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(the block's hidden states on the last rank, zeros elsewhere; its normed output on every rank)."""
        last = step_plan.in_force().pipeline - 1
        run = lambda args: vary(block(*args))  # noqa: E731
        skip = lambda args: zeros_varying_like(jax.eval_shape(run, args))  # noqa: E731
        with jax.named_scope(ticks.LAST_RANK):  # (the audit weighs it by that one rank of p)
            h, normed = sharding.cond(jax.lax.axis_index("pipeline") == last, run, skip, vary((h, e)))
        return h, broadcast(normed, last)

    @staticmethod
    def once(x: jax.Array) -> jax.Array:
        rank = jax.lax.axis_index("pipeline")
        return jnp.where(rank == step_plan.in_force().pipeline - 1, x, jnp.zeros_like(x))


def head_loss(mcfg, shared: dict, y: jax.Array, mb: dict, side=None) -> jax.Array:
    """The last rank's summed token loss of output y (every rank's the same y: `broadcast`), each rank's logits
    those of its slice of the vocabulary; zero on the other ranks, so that the loss is counted once and its
    gradient seeds the last rank's alone (summed back to every rank through the psums). side: the micro batch's,
    for the multi-token prediction modules (`Ranks`)."""
    rank = jax.lax.axis_index("pipeline")
    mine = slice_config(mcfg)
    y = _marked(y)  # (y's gradient, the transpose of the mark, is summed over the ranks' slices)
    reduce = (lambda x: jax.lax.pmax(x, "pipeline"), lambda x: jax.lax.psum(x, "pipeline"))
    loss = model.head_loss(mine, shared, y, mb, side, shard=(rank * mine.vocab_size, reduce, mcfg.vocab_size),
                           ranks=Ranks)
    return Ranks.once(loss)
