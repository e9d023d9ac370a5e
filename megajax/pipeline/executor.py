"""The pipeline executor: runs a schedule table inside one jitted train step.

Called inside the train step's shard_map, where 'data' and 'pipeline' are manual and 'tensor' is left to
GSPMD. Each rank reads its column of the table (axis_index('pipeline')) and, tick by tick in a scan, runs
what the table gives it, each action chosen with lax.switch (a real conditional: an absent action costs
nothing):
  B  backward of chunk c on micro batch i from the residuals the previous tick kept: input and weight
     gradients at once (jax.vjp's pullback, carried between ticks as its arrays); the first chunk finishes
     with the embedding's backward; the weight gradients are added to the chunk's fp32 accumulator inside
     the branch, so ticks without a backward add nothing
  F  forward of chunk c on micro batch i from its input slot (the first chunk embeds tokens into a fresh
     slot); the input stays as the stash. The last chunk runs the head's forward and backward right away
     (loss, head gradients, and the output gradient for its own backward) and, when its backward comes
     next, keeps its residuals
  R  recompute of the next backward's chunk from its stash, keeping the residuals for the next tick; it
     runs before F in the tick (F may reuse the freed slot)
  W  zero_bubble: the weight gradients of the rank's backward of the previous tick, first in the tick
     (before R or the last chunk's F replace the residuals it reads)
Sends are at the end of the tick: in the staggered lock step (schedule.py) a rank in its forward role
sends an activation to rank r + 1 while rank r + 1, in its backward role, sends a gradient to rank r, so
one ppermute of static swap pairs per tick carries both (two, one per direction, for an odd ring with
interleaving); while the pipeline fills only activations move. What arrives goes into the buffer slot the
table names (a spare trash slot takes ticks with nothing to keep).
Memory: the stash is one activation per in-flight micro batch (Megatron's full recomputation of a chunk)
plus one chunk's residuals. The embedding and head gradients and the loss are summed over 'pipeline' once
after the scan, and the caller reduces everything over 'data' once per step (with
overlap_grad_reduce, below, those alone).

zero_bubble (`_SplitChunkActions`) runs 1F1B's (or interleaved's) table with the backward split: B is the
input gradient only (and the norms' and biases' gradients), sent at once, and W the weight gradients from
each weight matmul's kept input and the output gradient B found for it (model.layers.weight_einsum's taps),
run in the rank's next tick. Ticks are grouped into segments (filling, steady, cool-down); a segment's
switches hold only the actions it runs.
parallel.overlap_grad_reduce (1F1B, interleaved): each rank reduces its weight gradients over the data ranks once
they are final (`ticks._reductions`): in runs of layers in the idle ticks after its last backward (X, after the tick's
sends), or, on a rank with none, in the backward that ends each chunk (kind FINAL), layer by layer inside its loop
(overlap.tapped_identity; the same residuals, unflattened into the pullback whose hooks reduce). The reduced
gradients go to `g_final`.
parallel.overlap_param_gather, the mirror: the layers' weights arrive as their optimizer shards, and each rank
all-gathers them into the carry's `whole` (what every action reads) before their first forward (`ticks._gathers`): in
runs of layers in the idle ticks before its first forward (G, after the tick's sends), or, on a rank with none (rank
0), in each chunk's first forward (kind GATHER), each layer's gather issued one layer ahead under the forward of the
layer before.
GPipe is the simple baseline: autodiff of a forward-only pipeline scan (memory grows with m).
"""

from __future__ import annotations

import functools

import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from megajax import model, overlap
from megajax.model import fp8
from megajax.model import layers as layers_lib
from megajax.config import Config
from megajax.data.loader import micro_batches
from megajax.pipeline import layout
from megajax.pipeline import ticks
from megajax.pipeline.ticks import ACTIONS, FIELDS, FINAL, FIRST, LAST_KEEP, MID, NONE, Segment
from megajax.pipeline.layout import local_chunks
from megajax.pipeline.schedule import perm_pairs
from megajax.sharding import vary

def _local_kinds(present: tuple[int, ...], kinds: np.ndarray) -> jax.Array:
    """Kind codes -> indices into the segment's list of branches."""
    index = np.zeros(max(2 * FINAL, max(present) + 1), np.int32)
    index[list(present)] = np.arange(len(present))
    return jnp.asarray(index[kinds])


def pipeline_grads(cfg: Config, params: dict, batch: dict, seed_scale: jax.Array, reductions=None):
    """(summed token loss over the local batch, gradients of seed_scale * summed loss) on this data
    rank, summed over 'pipeline' where parameters are shared. params: stacked layers in the staged
    layout [v, 1 (this rank), L/(p v), ...]; the rest replicated. batch: the local rows [m * mb, ...].
    reductions (parallel.overlap_grad_reduce): per stacked-layer weight, its `overlap.Reduction`: each rank
    reduces its layers' gradients over the data ranks inside the schedule (in idle ticks after its last
    backward, or in each chunk's last backward; a reduce-scatter leaves the optimizer shard), so the layers'
    gradients come back reduced. A reduction with `gather` (parallel.overlap_param_gather): the weight arrives as
    its optimizer shard and the schedule gathers it before the rank's first forward of its chunk."""
    par = cfg.parallel
    m = cfg.num_micro_batches
    if par.schedule == "gpipe":
        return _gpipe_grads(cfg, params, batch, seed_scale)
    p, v = par.pipeline, par.virtual_stages
    layers = vary(local_chunks(params["layers"]))  # [v, Lc, ...] (a gathered weight: its optimizer shard)
    lc = jax.tree.leaves(layers)[0].shape[1]
    gathering = reductions is not None and any(r.gather for r in jax.tree.leaves(reductions))
    sched, table, kinds, segments = ticks.plan(par.schedule, p, v, m, 0 if reductions is None else lc,
                                               lc if gathering else 0, ticks.tick_caps(cfg))
    shared = _shared(params)
    mbs = vary(micro_batches(batch, m))
    act_shape = (batch["tokens"].shape[0] // m, batch["tokens"].shape[1], cfg.model.hidden_size)
    act_dtype = jnp.dtype(cfg.model.compute_dtype)
    if sched.split_backward:
        assert reductions is None, "zero_bubble reduces its gradients after the schedule"
        acts = _SplitChunkActions(cfg, layers, shared, mbs, vary(seed_scale), act_shape, act_dtype)
    else:
        acts = _ChunkActions(cfg, layers, shared, mbs, vary(seed_scale), act_shape, act_dtype,
                             None if reductions is None else reductions["block"])
        if gathering:  # the whole weights, gathered into the carry's `whole` as the plan says
            layers = acts.whole_zeros()
            acts.layers = layers
    carry = vary({
        "act": jnp.zeros((sched.act_slots, *act_shape), act_dtype),  # chunk inputs: stashes and arrivals
        "grad": jnp.zeros((sched.grad_slots, *act_shape), act_dtype),
        "res": acts.zero_res(),
        "g_layers": jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), layers),
        "g_shared": jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), shared),
        "loss": jnp.zeros((), jnp.float32),
    })
    if sched.split_backward:
        carry["dys"] = vary(acts.zero_dys())
    if reductions is not None:
        carry["g_final"] = acts.zero_final()
    if gathering:
        carry["whole"] = layers
    rank = jax.lax.axis_index("pipeline")
    for i, seg in enumerate(segments):
        xs = {k: jnp.asarray(table[k][seg.start:seg.stop]) for k in FIELDS}
        for key in ACTIONS:
            xs[key + "_kind"] = _local_kinds(getattr(seg, key), kinds[key][seg.start:seg.stop])
        tick = functools.partial(_tick, acts, seg, p, v, rank)
        if seg.roles:  # pairs of ticks, so that each one's ppermute pairs are static
            xs = jax.tree.map(lambda x: x.reshape(-1, 2, *x.shape[1:]), xs)

            def pair(carry, row2, tick=tick, parity=seg.parity, i=i):
                carry = tick(carry, jax.tree.map(lambda x: x[0], row2), parity, ticks.scope(i, 0))
                return tick(carry, jax.tree.map(lambda x: x[1], row2), 1 - parity, ticks.scope(i, 1)), None

            carry, _ = jax.lax.scan(pair, carry, xs)
        else:
            carry, _ = jax.lax.scan(lambda carry, row, tick=tick, i=i: (tick(carry, row, None, ticks.scope(i, 0)),
                                                                        None), carry, xs)
    grads = {k: jax.lax.psum(g, "pipeline") for k, g in carry["g_shared"].items()}
    if reductions is None:
        grads["layers"] = jax.tree.map(lambda g: g[:, None], carry["g_layers"])
    else:
        grads["layers"] = {"block": jax.tree.map(lambda f: f[:, None], carry["g_final"])}
    return jax.lax.psum(carry["loss"], "pipeline"), grads


def _tick(acts: _ChunkActions, seg: Segment, p: int, v: int, rank, carry: dict, row: dict, parity, scope: str):
    """One tick of one rank: W (zero_bubble), B, then R (it reads its stash before a forward may reuse the
    slot), then F, then the sends (see the module docstring), then X and G (an idle tick's data-parallel reduction
    or weight gather); each switch under the name scope_<action>."""
    row = {k: jnp.clip(val[rank], 0, None) for k, val in row.items()}
    named = lambda key: jax.named_scope(f"{scope}_{key}")  # noqa: E731
    if "whole" in carry:  # the weights gathered so far (parallel.overlap_param_gather): what the actions read
        acts.layers = carry["whole"]
    # Only the slices an action reads go into a switch; the accumulators go through the backward's and the
    # forward's switches so that only the branches with something to add touch them.
    split = "dys" in carry
    if split:  # the weight gradients of the last backward, before R or F replace its residuals
        with named("w"):
            carry["g_layers"] = jax.lax.switch(row["w_kind"], [acts.weight_branch(k) for k in seg.w], carry["res"],
                                               carry["dys"], carry["g_layers"], row)
    b_args = (carry["res"], carry["grad"][row["b_grad_slot"]], carry["g_layers"], carry["g_shared"])
    extra = "dys" if split else "g_final" if "g_final" in carry else None
    with named("b"):
        b_out = jax.lax.switch(row["b_kind"], [acts.backward_branch(k) for k in seg.b], *b_args,
                               *((carry[extra],) if extra else ()), row)
    send_grad, carry["g_layers"], carry["g_shared"] = b_out[:3]
    if extra:
        carry[extra] = b_out[3]
    # The recompute reads its stash before the forward may reuse the slot; the residuals go through both
    # switches (replaced by the one that makes them, untouched otherwise).
    with named("r"):
        carry["res"] = jax.lax.switch(row["r_kind"], [acts.recompute_branch(k) for k in seg.r],
                                      carry["act"][row["r_slot"]], carry["res"], row)
    gathering = any(k & ticks.GATHER for k in seg.f)  # (a forward that gathers its chunk's weights)
    with named("f"):
        send_act, stash, loss, g_self, carry["res"], carry["g_shared"], *whole = jax.lax.switch(
            row["f_kind"], [acts.forward_branch(k) for k in seg.f], carry["act"][row["f_slot"]], carry["res"],
            carry["g_shared"], *((carry["whole"],) if gathering else ()), row)
    if gathering:
        carry["whole"] = whole[0]
    carry["act"] = carry["act"].at[row["f_slot"]].set(stash)  # (the trash slot when no forward)
    carry["grad"] = carry["grad"].at[row["f_grad_slot"]].set(g_self)
    carry["loss"] = carry["loss"] + loss
    perms = perm_pairs(p, v, parity is not None, parity or 0)  # none: p = 2 without a ring, after a swap
    if perms and parity is None:
        carry["act"] = carry["act"].at[row["recv_act"]].set(jax.lax.ppermute(send_act, "pipeline", perms[0]))
    elif perms and len(perms) == 1:
        forward_role = (rank + parity) % 2 == 0
        recv = jax.lax.ppermute(jnp.where(forward_role, send_act, send_grad), "pipeline", perms[0])
        carry["act"] = carry["act"].at[row["recv_act"]].set(recv)
        carry["grad"] = carry["grad"].at[row["recv_grad"]].set(recv)
    elif perms:
        carry["act"] = carry["act"].at[row["recv_act"]].set(jax.lax.ppermute(send_act, "pipeline", perms[0]))
        carry["grad"] = carry["grad"].at[row["recv_grad"]].set(jax.lax.ppermute(send_grad, "pipeline", perms[1]))
    if "g_final" in carry:  # an idle tick's data-parallel reduction, after the sends (nothing waits for it)
        with named("x"):
            carry["g_final"] = jax.lax.switch(row["x_kind"], [acts.reduce_branch(k) for k in seg.x],
                                              carry["g_layers"], carry["g_final"], row)
    if "whole" in carry and seg.g != (NONE,):  # an idle tick's gather, after the sends (like X)
        with named("g"):
            carry["whole"] = jax.lax.switch(row["g_kind"], [acts.gather_branch(k) for k in seg.g], carry["whole"],
                                            row)
    return carry


class _ChunkActions:
    """What one rank can do with one (local chunk, micro batch) in a tick: the branches of the forward,
    recompute and backward switches, by where the chunk sits in the model (NONE / FIRST / MID / LAST)."""

    def __init__(self, cfg: Config, layers, shared, mbs, seed_scale, act_shape, act_dtype, reductions=None):
        self.cfg, self.mcfg = cfg, cfg.model
        self.layers, self.shared, self.mbs, self.seed_scale = layers, shared, mbs, seed_scale
        self.act_shape, self.act_dtype = act_shape, act_dtype
        self.lc = jax.tree.leaves(layers)[0].shape[1]
        # parallel.overlap_grad_reduce: per weight ({"block": ...}'s leaves), its overlap.Reduction for one layer,
        # and for a run of layers [n, ...] (from the staged [v, p, Lc, ...] weight's)
        staged = len(layout.STAGED)
        self.reductions = None if reductions is None else jax.tree.map(lambda r: r.per_layer(staged), reductions)
        self.run_reductions = None if reductions is None else jax.tree.map(lambda r: r.per_layer(staged - 1),
                                                                           reductions)
        self.shards = layers  # parallel.overlap_param_gather: where the gathers read (self.layers: the whole weights)
        self._res_tree = None
        self._res_tree_final = None  # the same residuals, unflattened into the backward that reduces
        self._res_avals = None

    # -- what an action reads: the chunk's weights and the micro batch ------------------------------------

    def chunk(self, row, prefix):
        """(this local chunk's stacked weights, the global index of its first layer)."""
        p = self.cfg.parallel.pipeline
        first_layer = (row[prefix + "chunk"] * p + jax.lax.axis_index("pipeline")) * self.lc
        if jax.tree.leaves(self.layers)[0].shape[0] == 1:  # one chunk per rank: a static slice, no copy
            return jax.tree.map(lambda x: x[0], self.layers), first_layer
        params = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, row[prefix + "chunk"], keepdims=False),
                              self.layers)
        return params, first_layer

    def micro(self, row, prefix):
        mb = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, row[prefix + "micro"], keepdims=False),
                          self.mbs)
        return mb, model.side_inputs(self.mcfg, self.cfg.train.seed, mb, objective_scale=self.seed_scale)

    # -- the chunk's layers, forward with its residuals -----------------------------------------------------

    def _layers(self, w, x, side, first_layer):
        def body(x, wl):
            w_l, l = wl
            return model.block_apply(self.mcfg, w_l, x, l, side).astype(x.dtype), None

        return jax.lax.scan(body, x, (w["block"], first_layer + jnp.arange(self.lc)))[0]

    def _hooked_layers(self, w, x, sinks, side, first_layer, reduce):
        """(chunk output, taps): `_layers` with each layer's weights behind overlap.tapped_identity."""
        def body(x, wl):
            w_l, l, s_l = wl
            hooked = jax.tree.map(lambda r, w, s: overlap.tapped_identity(r, reduce)(w, s), self.reductions, w_l, s_l)
            w_l = jax.tree.map(lambda r, h: h[0], self.reductions, hooked)
            taps = jax.tree.map(lambda r, h: h[1], self.reductions, hooked)
            return model.block_apply(self.mcfg, w_l, x, l, side).astype(x.dtype), taps

        return jax.lax.scan(body, x, (w["block"], first_layer + jnp.arange(self.lc), sinks))

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
            shape[r.zero.dim + 2] = r.zero.size  # (r: one layer's; x: [v, Lc, ...])
            return vary(jnp.zeros(shape, r.gather_dtype or x.dtype))

        return {"block": jax.tree.map(whole, self.reductions, self.shards["block"])}

    def _gathered(self, shards):
        """One layer's whole weights from their shards (`overlap.Reduction.gathered`)."""
        return jax.tree.map(lambda r, w: vary(r.gathered(w)), self.reductions, shards)

    def _gathering_layers(self, shards, x, side, first_layer):
        """(`_layers`' output, the chunk's whole weights [Lc, ...]) from the chunk's optimizer shards: each
        layer's all-gather issued one layer ahead, under the compute of the layer before."""
        at = lambda tree, idx: jax.tree.map(lambda a: a[idx], tree)  # noqa: E731
        block = lambda x, w, l: model.block_apply(self.mcfg, w, x, l, side).astype(x.dtype)  # noqa: E731

        def body(carry, inputs):
            x, w = carry
            ahead, l = inputs
            return (block(x, w, l), self._gathered(ahead)), w

        (x, w_last), ws = jax.lax.scan(body, (x, self._gathered(at(shards, 0))),
                                       (at(shards, slice(1, None)), first_layer + jnp.arange(self.lc - 1)))
        x = block(x, w_last, first_layer + self.lc - 1)
        return x, jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), ws, w_last)

    def zero_final(self):
        """g_final: per weight, its reduced gradients [v, Lc, ...]: replicated over the data ranks (all-reduced;
        the carry g_layers, which sums the micro batches, varies over them) or the optimizer shards."""
        v = jax.tree.leaves(self.layers)[0].shape[0]
        return self._sinks(jax.tree.map(lambda x: x[0], self.layers), lead=(v,))

    def linearize(self, w, x, side, first, reduce=False):
        """(chunk output, what its backward needs: jax.vjp's pullback; with reductions, in (output, taps)
        giving (weights, input, sinks), the backward that reduces with `reduce`)."""
        if self.reductions is None:
            return jax.vjp(lambda w, x: self._layers(w, x, side, first), w, x)
        (y, _), pullback = jax.vjp(lambda w, x, s: self._hooked_layers(w, x, s, side, first, reduce), w, x,
                                   self._sinks(w))
        return y, pullback

    def forward_keeping(self, row, prefix, x):
        """(chunk output, its residuals as a list of arrays): `linearize`'s, flattened so that the scan can
        carry them to the backward's tick."""
        (w, first), (_, side) = self.chunk(row, prefix), self.micro(row, prefix)
        y, residuals = self.linearize(w, x, side, first)
        leaves, tree = jax.tree.flatten(residuals)
        avals = [(leaf.shape, leaf.dtype) for leaf in leaves]
        if self._res_avals is None:
            self._res_avals = avals
        elif avals != self._res_avals:
            raise AssertionError("the chunk's residuals differ between the forward and the recompute")
        self._res_tree = tree  # the backward unflattens with the latest trace's (the same function)
        if self.reductions is not None and self._res_tree_final is None:
            def final_leaves():
                leaves, self._res_tree_final = jax.tree.flatten(self.linearize(w, x, side, first, reduce=True)[1])
                return leaves

            if [(a.shape, a.dtype) for a in jax.eval_shape(final_leaves)] != avals:
                raise AssertionError("the reducing backward's residuals differ from the chunk's")
        return y, leaves

    def zero_res(self) -> list:
        """Zeros shaped like the residuals (traced once, abstractly, to learn them)."""
        if self._res_avals is None:
            row = {k: jnp.zeros((), jnp.int32) for k in ("f_chunk", "f_micro")}
            jax.eval_shape(lambda x: self.forward_keeping(row, "f_", vary(x))[1],
                           jax.ShapeDtypeStruct(self.act_shape, self.act_dtype))
        return [jnp.zeros(shape, dtype) for shape, dtype in self._res_avals]

    # -- the branches --------------------------------------------------------------------------------------

    def forward_branch(self, kind):
        """(x, res, g_shared[, whole], row) -> (activation to send, the slot's new content, loss, output gradient
        of the last chunk, residuals (the last chunk's own, else res unchanged), g_shared[, whole]); whole with
        a GATHER kind in the segment: a GATHER kind (the chunk's first forward) gathers the chunk's weights into
        it, layer by layer (the others pass it on)."""
        def run(x, res, g_shared, *rest):
            *whole, row = rest
            zeros = jnp.zeros(self.act_shape, self.act_dtype)
            loss, g_self = jnp.zeros((), jnp.float32), zeros
            if kind == NONE:
                return (*vary((zeros, x, loss, g_self, res, g_shared)), *whole)
            (w, first), (mb, side) = self.chunk(row, "f_"), self.micro(row, "f_")
            position = kind & ~ticks.GATHER
            if position == FIRST:
                x = model.embed_apply(self.mcfg, self.shared, mb["tokens"], side).astype(x.dtype)
            if kind & ticks.GATHER:
                assert position in (FIRST, MID), "a rank with the last chunk gathers in idle ticks"
                c = row["f_chunk"]
                y, gathered = self._gathering_layers(jax.tree.map(lambda a: a[c], self.shards["block"]), x, side,
                                                     first)
                whole = [{"block": jax.tree.map(lambda r, f, g: f.at[c].set(g) if r.gather else f, self.reductions,
                                                whole[0]["block"], gathered)}]
                return (*vary((y.astype(x.dtype), x, loss, g_self, res, g_shared)), *whole)
            if position in (FIRST, MID):
                return (*vary((self._layers(w, x, side, first).astype(x.dtype), x, loss, g_self, res, g_shared)),
                        *whole)
            if kind == LAST_KEEP:
                y, res = self.forward_keeping(row, "f_", x)
            else:  # its backward comes later, after a recompute
                y = self._layers(w, x, side, first).astype(x.dtype)
            loss, g_y, g_shared = self.head(y, mb, g_shared)
            return (*vary((zeros, x, loss, g_y.astype(x.dtype), res, g_shared)), *whole)

        return run

    def head(self, y, mb, g_shared):
        """(loss, its gradient in y, g_shared plus the head's gradients) of the micro batch's last chunk output."""
        loss, pullback = jax.vjp(lambda sh, y: model.head_apply(self.mcfg, sh, y, mb["targets"], mb["loss_mask"]),
                                 self.shared, y)
        dsh, g_y = pullback(self.seed_scale)
        return loss, g_y, jax.tree.map(lambda a, d: a + d.astype(jnp.float32), g_shared, dsh)

    def recompute_branch(self, kind):
        """(stash, res, row) -> the residuals of the chunk's forward from its stashed input (res unchanged
        when there is no recompute)."""
        def run(x, res, row):
            if kind == NONE:
                return vary(res)
            return vary(self.forward_keeping(row, "r_", x)[1])

        return run

    def backward_branch(self, kind):
        """(residuals, g, g_layers, g_shared[, g_final], row) -> (gradient to send, g_layers, g_shared[,
        g_final]); g_final with reductions: a FINAL kind (the chunk's last backward) reduces the chunk's
        gradients into it (the others add theirs to g_layers)."""
        def run(res, g, g_layers, g_shared, *rest):
            *g_final, row = rest
            if kind == NONE:
                return (*vary((jnp.zeros_like(g), g_layers, g_shared)), *g_final)
            c = row["b_chunk"]
            if self.reductions is None:
                dw, dx = jax.tree.unflatten(self._res_tree, res)(g)
                g_layers = jax.tree.map(lambda acc, d: acc.at[c].add(d.astype(jnp.float32)), g_layers, dw)
            else:
                g_final, = g_final
                pullback = jax.tree.unflatten(self._res_tree_final if kind & FINAL else self._res_tree, res)
                acc = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, c, keepdims=False), g_layers["block"])
                if not kind & FINAL:  # (the earlier micro batches' sum is read only by the reducing backward)
                    acc = jax.tree.map(jnp.zeros_like, acc)
                dw, dx, reduced = pullback((g, acc))
                if kind & FINAL:
                    g_final = jax.tree.map(lambda f, d: f.at[c].set(d), g_final, reduced)
                else:
                    g_layers = jax.tree.map(lambda a, d: a.at[c].add(d.astype(jnp.float32)), g_layers, dw)
                g_final = (g_final,)
            send = jnp.zeros_like(g)
            if (kind & ~FINAL) == FIRST:  # the embedding's backward ends the pipeline: nothing to send
                g_shared = self.embedding_backward(dx.astype(g.dtype), row, g_shared)
            else:
                send = dx.astype(g.dtype)
            return (*vary((send, g_layers, g_shared)), *g_final)  # (g_final as the reductions leave it)

        return run

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
        """(whole, row) -> whole with the k layers from row["g_first"] (counted over the rank's chunks,
        chunk-major) all-gathered from their optimizer shards (the g action: an idle tick before the rank's first
        forward)."""
        def run(whole, row):
            if k == NONE:
                return whole
            first = row["g_first"]

            def one(r, shard, f):
                if not r.gather:
                    return f
                flat = lambda a: a.reshape(-1, *a.shape[2:])  # noqa: E731  [v Lc, ...]
                got = r.gathered(jax.lax.dynamic_slice_in_dim(flat(shard), first, k))
                return jax.lax.dynamic_update_slice_in_dim(flat(f), vary(got), first, 0).reshape(f.shape)

            return {"block": jax.tree.map(one, self.run_reductions, self.shards["block"], whole["block"])}

        return run

    def embedding_backward(self, dx, row, g_shared):
        """g_shared plus the embedding's gradients from the first chunk's input gradient dx."""
        mb, side = self.micro(row, "b_")
        _, vjp = jax.vjp(lambda sh: model.embed_apply(self.mcfg, sh, mb["tokens"], side), self.shared)
        (dsh,) = vjp(dx)
        return jax.tree.map(lambda a, d: a + d.astype(jnp.float32), g_shared, dsh)


def split_weights(w: dict, taps: dict) -> tuple[dict, dict]:
    """A chunk's parameters {"block": ...} as (the weights of a tapped matmul, at the taps' paths; the rest),
    flat {path: [Lc, ...]}. (An MoE layer's expert weights are not tapped: their gradients come with B.)"""
    flat = flax.traverse_util.flatten_dict(w["block"])
    tapped = set(flax.traverse_util.flatten_dict(taps))
    big = {k: val for k, val in flat.items() if k in tapped}
    return big, {k: val for k, val in flat.items() if k not in big}


def zero_taps(mcfg, w: dict, x: jax.Array, side) -> dict:
    """Zeros [Lc, ...] shaped like the taps of the chunk's layers (`split_linearize`'s, and their gradients)."""
    lc = jax.tree.leaves(w)[0].shape[0]
    shapes = model.block_tap_shapes(mcfg, jax.tree.map(lambda a: a[0], w["block"]), x, side)
    return jax.tree.map(lambda t: jnp.zeros((lc, *t.shape), t.dtype), shapes)


def split_linearize(mcfg, w: dict, x: jax.Array, taps: dict, side, first):
    """The chunk's layers linearized for the split backward: (output, the pullback in (x, taps, the small
    parameters), each weight matmul's input). taps: `zero_taps`."""
    big, small = split_weights(w, taps)
    lc = jax.tree.leaves(w)[0].shape[0]

    def run(x, taps, small):
        def body(x, layer):
            w_l, l, taps_l = layer
            y, inputs = model.block_apply_split(mcfg, w_l, taps_l, x, l, side)
            return y.astype(x.dtype), inputs

        stacked = flax.traverse_util.unflatten_dict({**big, **small})
        return jax.lax.scan(body, x, (stacked, first + jnp.arange(lc), taps))

    return jax.vjp(run, x, taps, small, has_aux=True)


def split_weight_grads(w: dict, inputs: dict, dys: dict, mcfg) -> dict:
    """W: the gradients of the chunk's tapped weights, flat {path: [Lc, ...]}, from each matmul's input and
    output gradient (one matmul per weight and layer; in FP8 with model.fp8, with the weight's delayed-scaling
    state where it has one)."""
    big, rest = split_weights(w, dys)
    x, dy = flax.traverse_util.flatten_dict(inputs), flax.traverse_util.flatten_dict(dys)

    def one(k, val):
        meta = rest.get(k[:-1] + (fp8.META_PREFIX + k[-1],))
        args = (x[k], dy[k], val) + (() if meta is None else (meta,))
        return jax.vmap(functools.partial(layers_lib.weight_grad, k[-1], mcfg))(*args)

    return {k: one(k, val) for k, val in big.items()}


class _SplitChunkActions(_ChunkActions):
    """zero_bubble's chunk actions: the backward is split at every weight matmul (model.layers.weight_einsum).
    The recompute linearizes the chunk in its input, the matmuls' output taps and the small parameters (norms,
    biases) and keeps each weight matmul's input; B computes the input gradient, the small parameters'
    gradients and the taps' gradients (each weight matmul's output gradient, kept in `dys`); W turns those and
    the kept matmul inputs into the weight gradients, one matmul per weight."""

    def zero_dys(self):
        """Zeros shaped like the chunk's taps [Lc, ...] (their gradients, kept between B and W)."""
        row = {"f_chunk": jnp.zeros((), jnp.int32), "f_micro": jnp.zeros((), jnp.int32)}
        (w, _), (_, side) = self.chunk(row, "f_"), self.micro(row, "f_")
        return zero_taps(self.mcfg, w, jnp.zeros(self.act_shape, self.act_dtype), side)

    def linearize(self, w, x, side, first):
        """(chunk output, (the pullback in (x, taps, small parameters), each weight matmul's input))."""
        # varying over the manual axes like everything else, or their gradients would be summed over them
        taps = vary(zero_taps(self.mcfg, w, x, side))
        y, pullback, inputs = split_linearize(self.mcfg, w, x, taps, side, first)
        return y, (pullback, inputs)

    def backward_branch(self, kind):
        """(residuals, g, g_layers, g_shared, dys, row) -> (gradient to send, g_layers, g_shared, dys): the
        input gradient, the small parameters' gradients and the taps' gradients (the new dys)."""
        def run(res, g, g_layers, g_shared, dys, row):
            if kind == NONE:
                return vary((jnp.zeros_like(g), g_layers, g_shared, dys))
            pullback, _ = jax.tree.unflatten(self._res_tree, res)
            dx, dys, dsmall = pullback(g)
            g_layers = self._accumulate(g_layers, dsmall, row["b_chunk"])
            if kind == FIRST:  # the embedding's backward ends the pipeline: nothing to send
                g_shared = self.embedding_backward(dx.astype(g.dtype), row, g_shared)
                return vary((jnp.zeros_like(g), g_layers, g_shared, dys))
            return vary((dx.astype(g.dtype), g_layers, g_shared, dys))

        return run

    def weight_branch(self, kind):
        """(residuals, dys, g_layers, row) -> g_layers plus the weight gradients of the last backward."""
        def run(res, dys, g_layers, row):
            if kind == NONE:
                return vary(g_layers)
            _, inputs = jax.tree.unflatten(self._res_tree, res)
            dw = split_weight_grads(self.chunk(row, "w_")[0], inputs, dys, self.mcfg)
            return vary(self._accumulate(g_layers, dw, row["w_chunk"]))

        return run

    @staticmethod
    def _accumulate(g_layers, flat_grads, c):
        """g_layers (fp32 [v, Lc, ...]) with the flat {path: [Lc, ...]} gradients added at local chunk c."""
        flat = flax.traverse_util.flatten_dict(g_layers["block"])
        for k, d in flat_grads.items():
            flat[k] = flat[k].at[c].add(d.astype(jnp.float32))
        return {"block": flax.traverse_util.unflatten_dict(flat)}


def _shared(params: dict) -> dict:
    """The parameters every stage may use (embedding and head), marked varying over the manual axes."""
    return vary({k: val for k, val in params.items() if k != "layers"})


def _gpipe_grads(cfg: Config, params: dict, batch: dict, seed_scale: jax.Array):
    """GPipe: every forward (`_forward_rounds`), then autodiff runs the backward, stashing every tick's
    residuals (memory grows with m: the simple baseline)."""
    mbs = vary(micro_batches(batch, cfg.num_micro_batches))

    def loss_fn(layers, shared):
        loss = _forward_rounds(cfg, local_chunks(layers), shared, mbs, train=True, objective_scale=seed_scale)
        return loss * seed_scale, loss

    layers = vary(params["layers"])
    shared = _shared(params)
    (g_layers, g_shared), loss = jax.grad(loss_fn, argnums=(0, 1), has_aux=True)(layers, shared)
    grads = {k: jax.lax.psum(g, "pipeline") for k, g in g_shared.items()}
    grads["layers"] = g_layers
    return jax.lax.psum(loss, "pipeline"), grads


def pipeline_loss(cfg: Config, params: dict, batch: dict) -> jax.Array:
    """Forward only (evaluation): the summed token loss of this data rank's rows, run through the
    pipeline without gathering the layers. Inside the train step's shard_map, like `pipeline_grads`."""
    layers = vary(local_chunks(params["layers"]))
    shared = _shared(params)
    loss = _forward_rounds(cfg, layers, shared, vary(micro_batches(batch, cfg.num_micro_batches)), train=False)
    return jax.lax.psum(loss, "pipeline")


def _forward_rounds(cfg: Config, layers, shared, mbs, train: bool, objective_scale=None) -> jax.Array:
    """The forward pipeline: for each local chunk i in turn (a "round"), the micro batches flow GPipe-style
    through the p ranks, one tick per hop; rank 0 keeps what comes back around the ring from rank p - 1 as
    the input of the next round. Returns this rank's part of the summed token loss (rank p - 1 holds it).
    layers: this rank's chunks [v, Lc, ...]; mbs: micro batches [m, mb, ...]; train: dropout on; objective_scale:
    the seed of the loss being differentiated (Side.objective_scale)."""
    par, mcfg = cfg.parallel, cfg.model
    p, v, m = par.pipeline, par.virtual_stages, cfg.num_micro_batches
    rank = jax.lax.axis_index("pipeline")
    lc = jax.tree.leaves(layers)[0].shape[1]
    shape = (*mbs["tokens"].shape[1:], mcfg.hidden_size)
    dtype = jnp.dtype(mcfg.compute_dtype)
    returned = vary(jnp.zeros((m, *shape), dtype)) if v > 1 else None  # rank 0: the last round's outputs
    loss = vary(jnp.zeros((), jnp.float32))
    for i in range(v):
        w = jax.tree.map(lambda x: x[i], layers)

        def tick(carry, t, w=w, i=i):
            x_in, returned, loss = carry
            k = t - rank  # the micro batch this rank works on
            active = (k >= 0) & (k < m)
            mb = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, jnp.clip(k, 0, m - 1), keepdims=False), mbs)
            side = model.side_inputs(mcfg, cfg.train.seed, mb, dropout=train, objective_scale=objective_scale)
            if i == 0:
                first = lambda: vary(model.embed_apply(mcfg, shared, mb["tokens"], side).astype(dtype))  # noqa: E731
            else:
                first = lambda: jax.lax.dynamic_index_in_dim(returned, jnp.clip(k, 0, m - 1), keepdims=False)  # noqa: E731
            x = jax.lax.cond(rank == 0, first, lambda: x_in)
            y = jax.lax.cond(active, lambda: model.layers_apply(mcfg, w, x, side, (i * p + rank) * lc).astype(dtype),
                             lambda: x)
            if i == v - 1:
                loss = loss + jax.lax.cond(active & (rank == p - 1),
                                           lambda: vary(model.head_apply(mcfg, shared, y, mb["targets"],
                                                                         mb["loss_mask"])),
                                           lambda: vary(jnp.zeros((), jnp.float32)))
            recv = jax.lax.ppermute(y, "pipeline", perm_pairs(p, v, roles=False, parity=0)[0])
            if returned is not None:  # the micro batch rank p - 1 just finished reaches rank 0 around the ring
                back = t - (p - 1)
                keep = (rank == 0) & (back >= 0) & (back < m)
                returned = jnp.where(keep, returned.at[jnp.clip(back, 0, m - 1)].set(recv), returned)
            return (recv, returned, loss), None

        init = (vary(jnp.zeros(shape, dtype)), returned, loss)
        (_, returned, loss), _ = jax.lax.scan(tick, init, jnp.arange(m + p - 1))
    return loss
