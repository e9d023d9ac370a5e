"""One rank's actions on one (local chunk, micro batch): the branches of the pipeline executor's forward,
recompute, backward, reduce and gather switches, chosen by the chunk's kind (ticks.py: NONE / FIRST / MID / LAST,
LAST_KEEP, and the flags FINAL and GATHER). executor.py runs them tick by tick; its module docstring says what
each action does and in which order.

The forward keeps the chunk's residuals (jax.vjp's pullback) as a flat list of arrays (`forward_keeping`), so
that the scan carries them to the backward's tick. With parallel.overlap_grad_reduce the layers run behind
overlap.tapped_identity, so that a chunk's last backward (FINAL) reduces its gradients into `g_final`; with
parallel.overlap_param_gather a chunk's first forward (GATHER) gathers its weights into `whole`, one layer ahead.
zero_bubble's split backward subclasses these actions (zero_bubble.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from megajax import model
from megajax.config import Config
from megajax.parallel import overlap, step_plan
from megajax.parallel.pipeline import layout
from megajax.parallel.pipeline import ticks, vocab
from megajax.parallel.pipeline.ticks import FIRST, LAST_KEEP, MID, NONE
from megajax.parallel.sharding import CollectiveOrder
from megajax.parallel.step_plan import vary


def shared_params(params: dict) -> dict:
    """The parameters every stage may use (embedding and head), marked varying over the manual axes."""
    return vary({k: val for k, val in params.items() if k != "layers"})


def unless_empty(on, run, x):
    """run(), or x where the slot holds no layer (`on` False; None: every slot holds one). An empty slot (uneven
    stages, layout.py) runs nothing: lax.cond runs one branch, on every rank of the stage alike."""
    return run() if on is None else jax.lax.cond(on, run, lambda: x)


def run_slots(mcfg, w, x, side, ids, on, recompute: bool = False):
    """A chunk's layers in turn: slot j runs layer ids[j] unless it is empty (`unless_empty`; on None: none is);
    recompute: each layer recomputed in the backward as model.recompute says (`model.recomputed`; GPipe's, where
    no schedule action recomputes)."""
    def body(x, wl):
        w_l, l, on_l = wl
        run = lambda: model.block_apply(mcfg, w_l, x, l, side).astype(x.dtype)  # noqa: E731
        if recompute:
            run = model.recomputed(mcfg, run)
        return unless_empty(on_l, run, x), None

    return model.scan_layers(mcfg, body, x, (w["block"], ids, on))[0]


class ChunkActions:
    """What one rank can do with one (local chunk, micro batch) in a tick: the branches of the forward,
    recompute and backward switches, by where the chunk sits in the model (NONE / FIRST / MID / LAST)."""

    REDUCING_PULLBACK = True  # with reductions, a FINAL backward runs a pullback whose hooks reduce (not zero_bubble)

    def __init__(self, cfg: Config, layers, shared, mbs, seed_scale, act_shape, act_dtype, reductions=None):
        self.cfg, self.mcfg = cfg, cfg.model
        self.layers, self.shared, self.mbs, self.seed_scale = layers, shared, mbs, seed_scale
        self.act_shape, self.act_dtype = act_shape, act_dtype
        self.lc = jax.tree.leaves(layers)[0].shape[1]
        plan = step_plan.in_force()
        split = plan.stage_split
        self.even = split.even  # uneven stages: a chunk's slots past its units are empty, skipped (layout.py)
        self.starts, self.units = layout.chunk_tables(split, plan.pipeline)
        # parallel.overlap_grad_reduce: per weight ({"block": ...}'s leaves), its overlap.Reduction for one layer,
        # and for a run of layers [n, ...] (from the staged [v, p, Lc, ...] weight's)
        staged = len(layout.STAGED)
        self.reductions = None if reductions is None else jax.tree.map(lambda r: r.per_layer(staged), reductions)
        self.run_reductions = None if reductions is None else jax.tree.map(lambda r: r.per_layer(staged - 1),
                                                                           reductions)
        self.vocab = plan.vocab_over_pipeline  # the embedding and head in lock step over the ranks (vocab.py)
        self.shards = layers  # parallel.overlap_param_gather: where the gathers read (self.layers: the whole weights)
        self._res_tree = None
        self._res_tree_final = None  # the same residuals, unflattened into the backward that reduces
        self._res_avals = None

    # -- what an action reads: the chunk's weights and the micro batch ------------------------------------

    def chunk(self, row, prefix):
        """(this local chunk's stacked weights, where it sits: (the global index of its first layer, how many of
        its slots hold layers)), `at` below."""
        c, rank = row[prefix + "chunk"], jax.lax.axis_index("pipeline")
        at = (jnp.asarray(self.starts)[c, rank], jnp.asarray(self.units)[c, rank])
        if jax.tree.leaves(self.layers)[0].shape[0] == 1:  # one chunk per rank: a static slice, no copy
            return jax.tree.map(lambda x: x[0], self.layers), at
        params = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, c, keepdims=False), self.layers)
        return params, at

    def slots(self, at):
        """(the global layer index of each of the chunk's slots, whether each holds a layer: None with even stages,
        where all do)."""
        first, units = at
        return first + jnp.arange(self.lc), None if self.even else jnp.arange(self.lc) < units

    def micro_batch(self, row, prefix):
        """Micro batch row[prefix + "micro"]."""
        return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, row[prefix + "micro"], keepdims=False),
                            self.mbs)

    def micro(self, row, prefix):
        """(`micro_batch`, its side inputs)."""
        mb = self.micro_batch(row, prefix)
        return mb, model.side_inputs(self.mcfg, self.cfg.train.seed, mb, objective_scale=self.seed_scale)

    # -- the chunk's layers, forward with its residuals -----------------------------------------------------

    def _layers(self, w, x, side, at):
        return run_slots(self.mcfg, w, x, side, *self.slots(at))

    def _hooked_layers(self, w, x, sinks, side, at, reduce):
        """(chunk output, taps): `_layers` with each layer's weights behind overlap.tapped_identity."""
        def body(x, wl):
            w_l, l, on, s_l = wl
            hooked = jax.tree.map(lambda r, w, s: overlap.tapped_identity(r, reduce)(w, s), self.reductions, w_l, s_l)
            w_l = jax.tree.map(lambda r, h: h[0], self.reductions, hooked)
            taps = jax.tree.map(lambda r, h: h[1], self.reductions, hooked)
            return unless_empty(on, lambda: model.block_apply(self.mcfg, w_l, x, l, side).astype(x.dtype), x), taps

        return model.scan_layers(self.mcfg, body, x, (w["block"], *self.slots(at), sinks))

    def _sinks(self, w, lead=()):
        """Per weight, fp32 zeros [*lead, Lc, ...] shaped (and varying) as its reduction leaves each layer's
        gradient."""
        def stacked(r, x):
            shape = r.sink(x[0]).shape  # (one layer's)
            return vary(jnp.zeros((*lead, x.shape[0], *shape), jnp.float32), r.result_axes())

        return jax.tree.map(stacked, self.reductions, w["block"])

    def whole_zeros(self):
        """Zeros [v, Lc, ...] shaped like the whole weights (a gathered weight's zero dim at its full size, in the
        dtype it is gathered in), the rest as they are: what the gathers fill (parallel.overlap_param_gather)."""
        def whole(r, x):
            if not r.gather:
                return x
            shape = list(x.shape)
            shape[r.zero.dim + 2] = r.length or r.zero.size  # (r: one layer's; x: [v, Lc, ...]; ZeRO-3's unpadded)
            return vary(jnp.zeros(shape, r.gather_dtype or x.dtype))

        return {"block": jax.tree.map(whole, self.reductions, self.shards["block"])}

    def _gathered(self, shards):
        """One layer's whole weights from their shards (`overlap.Reduction.gathered`)."""
        return jax.tree.map(lambda r, w: vary(r.gathered(w)), self.reductions, shards)

    def _gathering_layers(self, shards, x, side, at):
        """(`_layers`' output, the chunk's whole weights [Lc, ...]) from the chunk's optimizer shards: each
        layer's all-gather issued one layer ahead, under the compute of the layer before."""
        pick = lambda tree, idx: jax.tree.map(lambda a: a[idx], tree)  # noqa: E731

        def block(x, w, l, on):
            return unless_empty(on, lambda: model.block_apply(self.mcfg, w, x, l, side).astype(x.dtype), x)

        def body(carry, inputs):
            x, w = carry
            ahead, l, on = inputs
            # the next layer's gather starts once this layer has run (CPU runtime: an empty slot's conditional, or
            # the layer's own collectives, would otherwise wait beside it; sharding.CollectiveOrder)
            order = CollectiveOrder()
            y = order.after(block(x, w, l, on))
            return (y, self._gathered(jax.tree.map(order.before, ahead))), w

        ids, on = self.slots(at)
        (x, w_last), ws = model.scan_layers(self.mcfg, body, (x, self._gathered(pick(shards, 0))),
                                            (pick(shards, slice(1, None)), ids[:-1], None if on is None else on[:-1]))
        x = block(x, w_last, ids[-1], None if on is None else on[-1])
        return x, jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), ws, w_last)

    def zero_final(self):
        """g_final: per weight, its reduced gradients [v, Lc, ...]: replicated over the data ranks (all-reduced;
        the carry g_layers, which sums the micro batches, varies over them) or the optimizer shards."""
        v = jax.tree.leaves(self.layers)[0].shape[0]
        return self._sinks(jax.tree.map(lambda x: x[0], self.layers), lead=(v,))

    def linearize(self, w, x, side, at, reduce=False):
        """(chunk output, what its backward needs: jax.vjp's pullback; with reductions, in (output, taps)
        giving (weights, input, sinks), the backward that reduces with `reduce`)."""
        if self.reductions is None:
            return jax.vjp(lambda w, x: self._layers(w, x, side, at), w, x)
        (y, _), pullback = jax.vjp(lambda w, x, s: self._hooked_layers(w, x, s, side, at, reduce), w, x,
                                   self._sinks(w))
        return y, pullback

    def forward_keeping(self, row, prefix, x):
        """(chunk output, its residuals as a list of arrays): `linearize`'s, flattened so that the scan can
        carry them to the backward's tick."""
        (w, at), (_, side) = self.chunk(row, prefix), self.micro(row, prefix)
        y, residuals = self.linearize(w, x, side, at)
        leaves, tree = jax.tree.flatten(residuals)
        avals = [(leaf.shape, leaf.dtype, step_plan.varying_axes(leaf)) for leaf in leaves]
        if self._res_avals is None:
            self._res_avals = avals
        elif avals != self._res_avals:
            raise AssertionError("the chunk's residuals differ between the forward and the recompute")
        self._res_tree = tree  # the backward unflattens with the latest trace's (the same function)
        if self.reductions is not None and self.REDUCING_PULLBACK and self._res_tree_final is None:
            def final_leaves():
                leaves, self._res_tree_final = jax.tree.flatten(self.linearize(w, x, side, at, reduce=True)[1])
                return leaves

            if [(a.shape, a.dtype) for a in jax.eval_shape(final_leaves)] != [a[:2] for a in avals]:
                raise AssertionError("the reducing backward's residuals differ from the chunk's")
        return y, leaves

    def zero_res(self) -> list:
        """Zeros shaped like the residuals, each varying over the manual axes it does (traced once, abstractly, to
        learn them; a row read from the schedule's table varies over 'pipeline', as the executor's does). The
        residuals keep their own varying axes through the schedule's carry: the backward's transpose checks each
        cotangent against its residual's (a balancing loss summed over 'context' is invariant there)."""
        if self._res_avals is None:
            def keep(x):
                row = vary({k: jnp.zeros((), jnp.int32) for k in ("f_chunk", "f_micro")}, ("pipeline",))
                return self.forward_keeping(row, "f_", vary(x))[1]

            jax.eval_shape(keep, jax.ShapeDtypeStruct(self.act_shape, self.act_dtype))
        return [vary(jnp.zeros(shape, dtype), axes) for shape, dtype, axes in self._res_avals]

    # -- the branches --------------------------------------------------------------------------------------

    def forward_branch(self, kind):
        """(x, [whole,] row) -> (activation to send, the slot's new content, the last chunk's output[, whole]); whole
        with a GATHER kind in the segment: a GATHER kind (the chunk's first forward) gathers the chunk's weights into
        it, layer by layer (the others pass it on). The last chunk's output goes to the head (`head_branch`, under
        its own conditional); a LAST_KEEP forward runs in the tick's recompute (`recompute_branch`), which keeps
        its residuals, and here only stashes its input. The switch takes no accumulator and no residuals: XLA
        copies a buffer that a switch of more than two branches updates in some branches and passes through in
        others (benchmarks/2026-11-27-compile-only-pipeline-forward-in-place.md)."""
        def run(x, *rest):
            *whole, row = rest
            zeros = jnp.zeros(self.act_shape, self.act_dtype)
            if kind in (NONE, LAST_KEEP):
                return (*vary((zeros, x, zeros)), *whole)
            (w, at), (mb, side) = self.chunk(row, "f_"), self.micro(row, "f_")
            position = kind & ~ticks.GATHER
            if position == FIRST and self.vocab:  # x: the rows every rank looked up (executor._tick)
                x = vocab.embed_apply(self.mcfg, self.shared, x, mb["tokens"], side).astype(x.dtype)
            elif position == FIRST:
                x = model.embed_apply(self.mcfg, self.shared, mb["tokens"], side).astype(x.dtype)
            if kind & ticks.GATHER:
                assert position in (FIRST, MID), "a rank with the last chunk gathers in idle ticks"
                c = row["f_chunk"]
                y, gathered = self._gathering_layers(jax.tree.map(lambda a: a[c], self.shards["block"]), x, side,
                                                     at)
                whole = [{"block": jax.tree.map(lambda r, f, g: f.at[c].set(g) if r.gather else f, self.reductions,
                                                whole[0]["block"], gathered)}]
                return (*vary((y.astype(x.dtype), x, zeros)), *whole)
            y = self._layers(w, x, side, at).astype(x.dtype)
            if position in (FIRST, MID):
                return (*vary((y, x, zeros)), *whole)
            return (*vary((zeros, x, y)), *whole)  # LAST: its backward comes later, after a recompute

        return run

    def head_branch(self, y, g_shared, row):
        """(loss, its gradient in y, g_shared plus the head's gradients) of the last chunk's output y on micro
        batch row["f_micro"]. With the vocabulary over the pipeline (vocab.py), every rank runs it in lock step
        on the last rank's y and row, each on its slice: the loss and y's gradient are the last rank's."""
        mb, side = self.micro(row, "f_")
        if self.vocab:
            head = lambda sh, y: vocab.head_loss(self.mcfg, sh, y, mb, side)  # noqa: E731
            y = vocab.broadcast(y, step_plan.in_force().pipeline - 1)
        else:
            head = lambda sh, y: model.head_loss(self.mcfg, sh, y, mb, side)  # noqa: E731
        loss, pullback = jax.vjp(head, self.shared, y)
        dsh, g_y = pullback(self.seed_scale)
        return vary((loss, g_y.astype(y.dtype), jax.tree.map(lambda a, d: a + d.astype(jnp.float32), g_shared, dsh)))

    def recompute_branch(self, kind, passes_on: bool):
        """(stash, [res,] row) -> (the residuals the next tick's backward reads, the last chunk's output): a
        recompute (MID) runs chunk row["r_chunk"] again from its stashed input; LAST_KEEP is the forward of the
        last chunk whose backward is the next tick's (row["f_chunk"], from the forward's input slot), which keeps
        its residuals and gives its output to the head. Without either: res unchanged when `passes_on`
        (zero_bubble's W reads a backward's residuals a tick later), else zeros. Only the next tick's backward
        reads what a tick keeps, and a tick that neither recomputes nor runs the last chunk's forward is followed
        by none; not passing them on lets XLA reuse their buffer for the new ones (a chunk's residuals less at the
        peak). The two never share a tick: the next tick runs one backward."""
        def run(x, *rest):
            *res, row = rest
            zeros = jnp.zeros(self.act_shape, self.act_dtype)
            if kind == NONE:
                return res[0] if passes_on else self.zero_res(), vary(zeros)
            if kind == LAST_KEEP:
                y, res = self.forward_keeping(row, "f_", x)
                return res, vary(y.astype(self.act_dtype))
            return self.forward_keeping(row, "r_", x)[1], vary(zeros)

        return run

    def backward_branch(self, final: bool):
        """(residuals, g, g_layers, row) -> (the input gradient, what the backward adds): the backward of chunk
        row["b_chunk"], wherever it sits (`executor.backward` sends the input gradient on, or runs the embedding's
        backward with it). What it adds, `add_backward` adds to an accumulator after the conditional the backward
        runs under: the chunk's weight gradients in fp32, to g_layers; with reductions, `final` (FINAL kinds: the
        chunk's last backward) their sum with the earlier backwards' (read from g_layers) reduced over the data
        ranks, to g_final. No accumulator is a conditional's output: XLA's GPU compiler copied them (every tick's
        fp32 gradients of a rank's layers) in one branch or the other (`executor.backward`)."""
        def run(res, g, g_layers, row):
            if self.reductions is None:
                dw, dx = jax.tree.unflatten(self._res_tree, res)(g)
                return vary((dx.astype(g.dtype), jax.tree.map(lambda d: d.astype(jnp.float32), dw)))
            pullback = jax.tree.unflatten(self._res_tree_final if final else self._res_tree, res)
            if final and g_layers:
                acc = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, row["b_chunk"], keepdims=False),
                                   g_layers["block"])
            else:  # (the earlier micro batches' sum is read only by the reducing backward; ZeRO-2 keeps none)
                acc = vary(jax.tree.map(lambda w: jnp.zeros(w.shape[1:], jnp.float32), self.layers["block"]))
            dw, dx, reduced = pullback((g, acc))
            if final:  # (ZeRO-2 reduces every micro batch's; else once per chunk, what the backwards summed)
                return vary(dx.astype(g.dtype)), reduced  # (reduced as the reductions leave it)
            return vary((dx.astype(g.dtype), jax.tree.map(lambda d: d.astype(jnp.float32), dw)))

        return run

    @staticmethod
    def add_backward(final: bool, g_layers, g_final, added, row):
        """(g_layers, g_final) with what `backward_branch(final)` returned added at local chunk row["b_chunk"]."""
        c = row["b_chunk"]
        if final:
            return g_layers, jax.tree.map(lambda f, d: f.at[c].add(d), g_final, added)
        return jax.tree.map(lambda a, d: a.at[c].add(d), g_layers, added), g_final

    def reduce_branch(self, k):
        """(g_layers, g_final, row) -> g_final with the k layers from row["x_first"] (counted over the rank's
        chunks, chunk-major) reduced from g_layers (the x action: an idle tick after the rank's last backward)."""
        def run(g_layers, g_final, row):
            if k == NONE:
                return g_final
            first = row["x_first"]

            def one(r, g, f):
                flat = lambda a: a.reshape(-1, *a.shape[2:])  # noqa: E731  [v Lc, ...]
                red = r(jax.lax.dynamic_slice_in_dim(flat(g), first, k))
                red = vary(red, r.result_axes())
                return jax.lax.dynamic_update_slice_in_dim(flat(f), red, first, 0).reshape(f.shape)

            return jax.tree.map(one, self.run_reductions, g_layers["block"], g_final)

        return run

    def gather_branch(self, k):
        """(whole, row) -> whole with the k (> 0) layers from row["g_first"] (counted over the rank's chunks,
        chunk-major) all-gathered from their optimizer shards (the g action: an idle tick before the rank's first
        forward; `executor._tick` runs it under a two-way conditional that passes `whole` through otherwise)."""
        def run(whole, row):
            first = row["g_first"]

            def one(r, shard, f):
                if not r.gather:
                    return f
                flat = lambda a: a.reshape(-1, *a.shape[2:])  # noqa: E731  [v Lc, ...]
                got = r.gathered(jax.lax.dynamic_slice_in_dim(flat(shard), first, k))
                return jax.lax.dynamic_update_slice_in_dim(flat(f), vary(got), first, 0).reshape(f.shape)

            return {"block": jax.tree.map(one, self.run_reductions, self.shards["block"], whole["block"])}

        return run

    def embedding_backward(self, dx, row, g_shared, token_rows=None):
        """g_shared plus the embedding's gradients from the first chunk's input gradient dx. With the vocabulary
        over the pipeline: (g_shared plus the gradients of the positions and the first dense layers, the gradient
        of the looked-up rows `token_rows`), which every rank then scatters into its slice (`table_backward`)."""
        mb, side = self.micro(row, "b_")
        if not self.vocab:
            _, vjp = jax.vjp(lambda sh: model.embed_apply(self.mcfg, sh, mb["tokens"], side), self.shared)
            (dsh,) = vjp(dx)
            return jax.tree.map(lambda a, d: a + d.astype(jnp.float32), g_shared, dsh)
        _, vjp = jax.vjp(lambda sh, r: vocab.embed_apply(self.mcfg, sh, r, mb["tokens"], side), self.shared,
                         token_rows)
        dsh, d_rows = vjp(dx)
        return jax.tree.map(lambda a, d: a + d.astype(jnp.float32), g_shared, dsh), d_rows.astype(dx.dtype)

    def looked_up(self, row, prefix):
        """The rows of micro batch row[prefix + "micro"]'s tokens, looked up by every rank in its slice (vocab.py)."""
        tokens = self.micro_batch(row, prefix)["tokens"]
        return vocab.rows(self.mcfg, self.shared, tokens).astype(self.act_dtype)

    def table_backward(self, d_rows, row, g_shared):
        """g_shared plus this rank's slice of the embedding's gradient, from the first rank's gradient of the rows
        of micro batch row["b_micro"] (every rank's row is the first rank's: vocab.py)."""
        mb = self.micro_batch(row, "b_")
        d_rows = vocab.broadcast(d_rows, 0)
        table = self.shared["embed"]["embedding"]
        g = dict(g_shared, embed=dict(g_shared["embed"]))
        g["embed"]["embedding"] = g["embed"]["embedding"] + vocab.lookup_grad(table, mb["tokens"], d_rows)
        return vary(g)
