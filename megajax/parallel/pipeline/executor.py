"""The pipeline executor: runs a schedule table inside one jitted train step.

Called inside the train step's shard_map, where 'data' and 'pipeline' are manual and 'tensor' is left to
GSPMD. Each rank reads its column of the table (axis_index('pipeline')) and, tick by tick in a scan, runs
what the table gives it, each action chosen with lax.switch on its kind (a real conditional: an absent action
costs nothing; the backward and the head as two-way conditionals, `backward`):
  B  backward of chunk c on micro batch i from the residuals the previous tick kept: input and weight
     gradients at once (jax.vjp's pullback, carried between ticks as its arrays); the first chunk finishes
     with the embedding's backward; the weight gradients are added to the chunk's fp32 accumulator inside
     the branch, so ticks without a backward add nothing
  F  forward of chunk c on micro batch i from its input slot (the first chunk embeds tokens into a fresh
     slot); the input stays as the stash. The last chunk's output goes to the head's forward and backward
     right away (loss, head gradients, and the output gradient for its own backward), under a two-way
     conditional of its own
  R  recompute of the next backward's chunk from its stash, keeping the residuals for the next tick; it
     runs before F in the tick (F may reuse the freed slot). When the next backward is that of the last
     chunk's forward in this tick, R's switch runs that forward instead (LAST_KEEP), keeping its residuals,
     and F only stashes its input
  W  zero_bubble: the weight gradients of the rank's backward of the previous tick, first in the tick
     (before R or the last chunk's F replace the residuals it reads)
Sends are at the end of the tick: in 1F1B's staggered lock step (schedule.py) a rank in its forward role
sends an activation to rank r + 1 while rank r + 1, in its backward role, sends a gradient to rank r, so
one ppermute of static swap pairs per tick carries both; with interleaving (v > 1) every tick sends both ways
over the ring (two ppermutes, one per direction); while the pipeline fills only activations move. What arrives
goes into the buffer slot the table names (a spare trash slot takes ticks with nothing to keep).
Memory: the stash is one activation per in-flight micro batch (Megatron's full recomputation of a chunk)
plus one chunk's residuals. The embedding and head gradients and the loss are summed over 'pipeline' once
after the scan, and the caller reduces everything over 'data' once per step (with
overlap_grad_reduce, below, those alone).

The actions are `chunks.ChunkActions`' branches (chunks.py). zero_bubble runs 1F1B's (or interleaved's) table with
the backward split into B (the input gradient, sent at once) and W (the weight gradients, in the rank's next tick),
with `zero_bubble.SplitChunkActions` (zero_bubble.py). Ticks are grouped into segments (filling, steady,
cool-down); a segment's switches hold only the actions it runs.
parallel.overlap_grad_reduce (1F1B, interleaved): each rank reduces its weight gradients over the data ranks once
they are final (`ticks._reductions`): in runs of layers in the idle ticks after its last backward (X, after the tick's
sends), or, on a rank with none, in the backward that ends each chunk (kind FINAL), layer by layer inside its loop
(overlap.tapped_identity; the same residuals, unflattened into the pullback whose hooks reduce). The reduced
gradients go to `g_final`.
ZeRO-2 (data_parallel_sharding_strategy=optim_grads): every backward is FINAL, and g_final sums the reduced shards
of the micro batches (no whole gradient is kept); under zero_bubble B reduces the small parameters' gradients and W
the weight matmuls', each in its own tick (zero_bubble.py).
parallel.overlap_param_gather, the mirror: the layers' weights arrive as their optimizer shards, and each rank
all-gathers them into the carry's `whole` (what every action reads) before their first forward (`ticks._gathers`): in
runs of layers in the idle ticks before its first forward (G, after the tick's sends), or, on a rank with none (rank
0), in each chunk's first forward (kind GATHER), each layer's gather issued one layer ahead under the forward of the
layer before.
GPipe is the simple baseline (gpipe.py): autodiff of a forward-only pipeline scan (memory grows with m).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from megajax.config import Config
from megajax.parallel import step_plan
from megajax.parallel.pipeline import ticks, vocab
from megajax.parallel.pipeline.chunks import ChunkActions, shared_params
from megajax.parallel.pipeline.gpipe import gpipe_grads
from megajax.parallel.pipeline.layout import local_chunks
from megajax.parallel.pipeline.schedule import perm_pairs
from megajax.parallel.pipeline.ticks import ACTIONS, FIELDS, FINAL, LAST_KEEP, NONE, Segment
from megajax.parallel.pipeline.zero_bubble import SplitChunkActions
from megajax.parallel.sharding import CollectiveOrder, micro_batches
from megajax.parallel.step_plan import vary, zeros_varying_like


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
    plan = step_plan.in_force()
    m = plan.micro_batches
    if plan.schedule == "gpipe":
        return gpipe_grads(cfg, params, batch, seed_scale)
    p, v = plan.pipeline, plan.virtual_stages
    layers = vary(local_chunks(params["layers"]))  # [v, Lc, ...] (a gathered weight: its optimizer shard)
    lc = jax.tree.leaves(layers)[0].shape[1]
    gathering = reductions is not None and any(r.gather for r in jax.tree.leaves(reductions))
    every = plan.shard_grads  # ZeRO-2: every backward reduce-scatters its chunk's gradients
    sched, table, kinds, segments = ticks.plan(plan.schedule, p, v, m, 0 if reductions is None else lc,
                                               lc if gathering else 0, ticks.tick_caps(plan, cfg.model), every)
    shared = shared_params(params)
    mbs = vary(micro_batches(batch, m))
    act_shape = (batch["tokens"].shape[0] // m, batch["tokens"].shape[1], cfg.model.hidden_size)
    act_dtype = jnp.dtype(cfg.model.compute_dtype)
    block = None if reductions is None else reductions["block"]
    if sched.split_backward:  # (reductions: ZeRO-2/3, whose B and W each reduce what they compute)
        assert reductions is None or every, "zero_bubble reduces in its backwards only under ZeRO-2/3"
        acts = SplitChunkActions(cfg, layers, shared, mbs, vary(seed_scale), act_shape, act_dtype, block)
    else:
        acts = ChunkActions(cfg, layers, shared, mbs, vary(seed_scale), act_shape, act_dtype, block)
    if gathering:  # the whole weights, gathered into the carry's `whole` as the plan says
        layers = acts.whole_zeros()
        acts.layers = layers
    carry = _first_carry(acts, layers, shared, sched, act_shape, act_dtype, reductions, every, gathering)
    carry = _fenced(_run_segments(acts, segments, table, kinds, p, v, carry))
    grads = vocab.sum_shared(carry["g_shared"], plan.vocab_over_pipeline)
    if reductions is None:
        grads["layers"] = jax.tree.map(lambda g: g[:, None], carry["g_layers"])
    else:
        grads["layers"] = {"block": jax.tree.map(lambda f: f[:, None], carry["g_final"])}
    return jax.lax.psum(carry["loss"], "pipeline"), grads


def _first_carry(acts, layers, shared, sched, act_shape, act_dtype, reductions, every: bool, gathering: bool) -> dict:
    """The schedule's carry before its first tick: the chunk inputs' and gradients' slots, the residuals, the
    gradient accumulators (ZeRO-2's reduced shards in g_final), the loss, and the gathered weights' `whole`."""
    carry = vary({
        "act": jnp.zeros((sched.act_slots, *act_shape), act_dtype),  # chunk inputs: stashes and arrivals
        "grad": jnp.zeros((sched.grad_slots, *act_shape), act_dtype),
        # (ZeRO-2 sums the reduced shards in g_final and keeps no whole gradient)
        "g_layers": {} if every else jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), layers),
        "g_shared": jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), shared),
        "loss": jnp.zeros((), jnp.float32),
    })
    carry["res"] = acts.zero_res()  # (each residual varying as it does: ChunkActions.zero_res)
    if sched.split_backward:
        carry["dys"] = vary(acts.zero_dys())
    if reductions is not None:
        carry["g_final"] = acts.zero_final()
    if gathering:
        carry["whole"] = layers
    if CollectiveOrder().on:  # the mark of the last tick's ordered operations (CPU runtime: CollectiveOrder)
        carry["order"] = vary(jnp.zeros((), jnp.float32))
    return carry


def _run_segments(acts, segments, table: dict, kinds: dict, p: int, v: int, carry: dict) -> dict:
    """The schedule's ticks, segment by segment, each a scan over its rows of the tick table."""
    rank = jax.lax.axis_index("pipeline")
    for i, seg in enumerate(segments):
        xs = {k: jnp.asarray(table[k][seg.start:seg.stop]) for k in FIELDS}
        for key in ACTIONS:
            xs[key + "_kind"] = _local_kinds(getattr(seg, key), kinds[key][seg.start:seg.stop])
        tick = functools.partial(_tick, acts, seg, p, v, rank)
        if seg.roles:  # pairs of ticks, so that each one's ppermute pairs are static
            xs = jax.tree.map(lambda x: x.reshape(-1, 2, *x.shape[1:]), xs)

            def pair(carry, row2, tick=tick, parity=seg.parity, i=i):
                order = CollectiveOrder(carry.get("order"))
                carry = tick(carry, jax.tree.map(lambda x: x[0], row2), parity, ticks.scope(i, 0), order)
                return _marked(tick(carry, jax.tree.map(lambda x: x[1], row2), 1 - parity, ticks.scope(i, 1), order),
                               order), None

            carry, _ = jax.lax.scan(pair, carry, xs)
        else:
            def single(carry, row, tick=tick, i=i):
                order = CollectiveOrder(carry.get("order"))
                return _marked(tick(carry, row, None, ticks.scope(i, 0), order), order), None

            carry, _ = jax.lax.scan(single, carry, xs)
    return carry


def _marked(carry: dict, order: CollectiveOrder) -> dict:
    """The carry with the tick's order mark, which the next tick's first ordered operation waits for (XLA peels
    and unrolls the loop: the ticks' operations may end up in one computation)."""
    if "order" in carry:
        carry["order"] = order.mark
    return carry


def _fenced(carry: dict) -> dict:
    """The carry without its order mark, each array behind a fence on it: whatever runs after the schedule (the
    psums over 'pipeline', the resharding of the gradients) waits for the last tick's last ordered operation (CPU
    runtime: a collective after the step's last, peeled tick would start beside it; sharding.CollectiveOrder).
    The fence reads no result of the schedule (an element of an array sharded over 'tensor' is an all-gather to
    read, which could run beside that operation)."""
    if "order" not in carry:
        return carry
    carry = dict(carry)
    fence = CollectiveOrder(carry.pop("order"))
    return jax.tree.map(fence.before_if_varying, carry)


def _code(seg: Segment, row: dict, key: str) -> jax.Array:
    """The kind code (ticks.py) of action `key` in this tick: row[key + "_kind"] indexes the segment's kinds."""
    return jnp.asarray(getattr(seg, key))[row[key + "_kind"]]


def backward(acts: ChunkActions, seg: Segment, row: dict, scope: str, order: CollectiveOrder, carry: dict,
             first_row=None) -> jax.Array:
    """B: the gradient to send after the tick's backward, whatever chunk it runs (zeros where it runs none, or runs
    the first chunk, whose input gradient goes into the embedding's backward instead); the accumulators in `carry`
    (g_layers, g_shared, g_final; zero_bubble's dys) updated. Each group of backward kinds (`ticks.backward_groups`:
    FINAL or not) runs under its own two-way conditional, named scope_b<group>, whose first branch makes zeros;
    what the group's backward adds (`ChunkActions.backward_branch`) is added to its accumulator after the
    conditional (`add_backward`: in place, the loop's carry). Then the first chunk's input gradient goes into the
    embedding's backward, under a two-way conditional of its own (scope_e1), instead of to the rank before. With
    the vocabulary over the pipeline (vocab.py) every rank then adds its slice of the table's gradient, under a
    conditional taken by every rank alike (rank 0's row, `first_row`: scope_t1); with first dense layers, whose
    backward needs the rows, every rank looks them up again first (scope_k1).

    Why the accumulators pass through no conditional: XLA's copy insertion copies a buffer that a conditional
    updates in place in one branch and passes through in the other, in one branch or the other, and holds the copy
    beside the original (the rank's fp32 layer gradients: 12 GB a tick for Llama 3.1 405B's preset;
    benchmarks/2026-12-06-compile-only-accumulators-outside-conditionals.md); the order of the branches, and what
    else the tick runs, decided which, not whether. Nor one switch over the kinds, for the same reason. Each
    conditional is in `order`."""
    code = _code(seg, row, "b")
    res, g = carry["res"], carry["grad"][row["b_grad_slot"]]
    dx = jnp.zeros_like(g)
    state = (carry["dys"],) if "dys" in carry else ()  # (zero_bubble: the taps' gradients, kept from B to W)
    for i, final in enumerate(ticks.backward_groups(seg.b), 1):
        on, branch = ticks.in_backward_group(code, final), acts.backward_branch(final)

        def run(state, branch=branch):
            return branch(res, g, carry["g_layers"], *state, row)

        def skip(state, run=run):  # (zeros as the backward's outputs are, made in the branch; the state as it is)
            return (*zeros_varying_like(jax.eval_shape(run, state)[:2]), *state)

        with jax.named_scope(f"{scope}_b{i}"):
            dx_i, added, *state = order.cond(on, run, skip, tuple(state))
        dx = dx_i if i == 1 else jnp.where(on, dx_i, dx)
        carry["g_layers"], g_final = acts.add_backward(final, carry["g_layers"], carry.get("g_final"), added, row)
        if g_final is not None:
            carry["g_final"] = g_final
    if state:
        carry["dys"] = state[0]
    first = ticks.first_backward(code)
    g_shared = carry["g_shared"]
    if any(ticks.first_backward(k) for k in seg.b) and not acts.vocab:
        with jax.named_scope(f"{scope}_e1"):
            g_shared = order.cond(first, lambda gs: vary(acts.embedding_backward(dx, row, gs)), lambda gs: gs,
                                  g_shared)
    elif any(ticks.first_backward(k) for k in seg.b):
        on = ticks.first_backward(_code(seg, first_row, "b"))  # (the same on every rank)
        token_rows = jnp.zeros_like(dx)
        if acts.mcfg.first_dense_layers:
            with jax.named_scope(f"{scope}_k1"):
                token_rows = order.cond(on, lambda: acts.looked_up(first_row, "b_"), lambda: vary(token_rows))
        with jax.named_scope(f"{scope}_e1"):
            g_shared, d_rows = order.cond(first, lambda gs: vary(acts.embedding_backward(dx, row, gs, token_rows)),
                                          lambda gs: vary((gs, jnp.zeros_like(dx))), g_shared)
        with jax.named_scope(f"{scope}_t1"):
            g_shared = order.cond(on, lambda gs: acts.table_backward(d_rows, first_row, gs), lambda gs: gs,
                                  g_shared)
    carry["g_shared"] = g_shared
    return jnp.where(first, jnp.zeros_like(dx), dx)


def _tick(acts: ChunkActions, seg: Segment, p: int, v: int, rank, carry: dict, row: dict, parity, scope: str,
          order: CollectiveOrder):
    """One tick of one rank: W (zero_bubble), B, then R (it reads its stash before a forward may reuse the
    slot), then F, then the sends (see the module docstring), then X and G (an idle tick's data-parallel reduction
    or weight gather); each switch under the name scope_<action>, each conditional and send in `order`."""
    row_of = lambda r: {k: jnp.clip(val[r], 0, None) for k, val in row.items()}  # noqa: E731  (rank r's)
    first_row, last_row = row_of(0), row_of(p - 1)  # (what every rank runs in lock step: vocab.py)
    row = row_of(rank)
    named = lambda key: jax.named_scope(f"{scope}_{key}")  # noqa: E731
    if "whole" in carry:  # the weights gathered so far (parallel.overlap_param_gather): what the actions read
        acts.layers = carry["whole"]
    # Only the slices an action reads go into a switch; the backward hands what it adds out of its conditionals,
    # and the tick adds it to the layers' accumulators (`backward`).
    split = "dys" in carry
    if split and seg.w != (NONE,):  # the weight gradients of the last backward, before R or F replace its residuals
        into = "g_final" if "g_final" in carry else "g_layers"  # (ZeRO-2/3: reduced onto their shards)
        carry[into] = acts.weight_grads(carry["res"], carry["dys"], carry[into], row, _code(seg, row, "w") != NONE,
                                        order, f"{scope}_w1")
    send_grad = backward(acts, seg, row, scope, order, carry, first_row=first_row)
    # The recompute reads its stash before the forward may reuse the slot; the last chunk's forward that keeps its
    # residuals (LAST_KEEP) runs in the same switch (never beside a recompute) and reads the forward's slot. The
    # residuals come out of that switch alone (zeros when it has nothing to keep: the backward above has read the
    # old ones; but zero_bubble's W reads them a tick later), and the forward's switch takes neither them nor the
    # head's gradients: the head runs after it, under a two-way conditional (scope_h1) whose first branch passes
    # g_shared through.
    with named("r"):
        slot = row["r_slot"]
        if LAST_KEEP in seg.r:
            slot = jnp.where(_code(seg, row, "r") == LAST_KEEP, row["f_slot"], slot)
        carry["res"], y_kept = order.switch(row["r_kind"], [acts.recompute_branch(k, split) for k in seg.r],
                                            carry["act"][slot], *((carry["res"],) if split else ()), row)
    gathering = any(k & ticks.GATHER for k in seg.f)  # (a forward that gathers its chunk's weights)
    x = carry["act"][row["f_slot"]]
    if acts.vocab and any(ticks.embeds(k) for k in seg.f):  # every rank looks up rank 0's tokens (vocab.py)
        on = ticks.embeds(_code(seg, first_row, "f"))
        with named("l1"):
            token_rows = order.cond(on, lambda: acts.looked_up(first_row, "f_"), lambda: vary(jnp.zeros_like(x)))
        x = jnp.where(on & (rank == 0), token_rows, x)
    with named("f"):
        send_act, stash, y_last, *whole = order.switch(
            row["f_kind"], [acts.forward_branch(k) for k in seg.f], x,
            *((carry["whole"],) if gathering else ()), row)
    if gathering:
        carry["whole"] = whole[0]
    g_self = _head(acts, seg, scope, order, carry, row, last_row, rank, p, y_kept, y_last, stash)
    carry["act"] = carry["act"].at[row["f_slot"]].set(stash)  # (the trash slot when no forward)
    carry["grad"] = carry["grad"].at[row["f_grad_slot"]].set(g_self)
    _send(order, carry, row, p, v, rank, parity, send_act, send_grad)
    _idle(acts, seg, scope, order, carry, row)
    return carry


def _head(acts: ChunkActions, seg: Segment, scope: str, order: CollectiveOrder, carry: dict, row: dict,
          last_row: dict, rank, p: int, y_kept, y_last, stash) -> jax.Array:
    """The head and loss after a tick's forward, where the last chunk's forward ran (under a two-way conditional,
    scope_h1); adds to carry's loss and g_shared. Returns the gradient it seeds the chunk's backward with (zeros
    where no head runs)."""
    g_self = jnp.zeros_like(stash)
    if any(ticks.runs_head(k) for k in seg.f):
        f_code = _code(seg, row, "f")
        y = jnp.where(f_code == LAST_KEEP, y_kept, y_last) if LAST_KEEP in seg.f else y_last
        # (with the vocabulary over the pipeline, every rank runs rank p - 1's head: vocab.py)
        runs, head_row = (ticks.runs_head(_code(seg, last_row, "f")), last_row) if acts.vocab else (
            ticks.runs_head(f_code), row)
        with jax.named_scope(f"{scope}_h1"):  # (zeros made in the first branch: XLA packed the 8B rows better)
            loss, g_self, carry["g_shared"] = order.cond(
                runs, lambda gs: acts.head_branch(y, gs, head_row),
                lambda gs: vary((jnp.zeros((), jnp.float32), jnp.zeros_like(y), gs)), carry["g_shared"])
        if acts.vocab:  # (y's gradient is every rank's; the last rank's backward reads it)
            g_self = jnp.where(rank == p - 1, g_self, jnp.zeros_like(g_self))
        carry["loss"] = carry["loss"] + loss
    return g_self


def _send(order: CollectiveOrder, carry: dict, row: dict, p: int, v: int, rank, parity, send_act, send_grad) -> None:
    """The tick's ppermutes over 'pipeline': activations forward and gradients back, into carry's receive slots
    (with a ring of two ranks, one ppermute whose role alternates with the parity)."""
    perms = perm_pairs(p, v, parity is not None, parity or 0)  # none: p = 2 without a ring, after a swap
    if perms and parity is None:
        carry["act"] = carry["act"].at[row["recv_act"]].set(order.ppermute(send_act, "pipeline", perms[0]))
    elif perms and len(perms) == 1:
        forward_role = (rank + parity) % 2 == 0
        recv = order.ppermute(jnp.where(forward_role, send_act, send_grad), "pipeline", perms[0])
        carry["act"] = carry["act"].at[row["recv_act"]].set(recv)
        carry["grad"] = carry["grad"].at[row["recv_grad"]].set(recv)
    elif perms:
        carry["act"] = carry["act"].at[row["recv_act"]].set(order.ppermute(send_act, "pipeline", perms[0]))
        carry["grad"] = carry["grad"].at[row["recv_grad"]].set(order.ppermute(send_grad, "pipeline", perms[1]))


def _idle(acts: ChunkActions, seg: Segment, scope: str, order: CollectiveOrder, carry: dict, row: dict) -> None:
    """An idle tick's data-parallel reduction (X) and weight gather (G), after the sends: nothing waits for them."""
    if "g_final" in carry:
        with jax.named_scope(f"{scope}_x"):
            carry["g_final"] = order.switch(row["x_kind"], [acts.reduce_branch(k) for k in seg.x],
                                            carry["g_layers"], carry["g_final"], row)
    if "whole" in carry and seg.g != (NONE,):  # an idle tick's gather, after the sends (like X)
        # (one two-way conditional per layer count, scope_g<i>, whose first branch passes `whole` through: a switch
        # over the counts made XLA copy it, as B's did its accumulators; written so, X's made some presets worse)
        code = _code(seg, row, "g")
        for i, k in enumerate(seg.g[1:], 1):
            with jax.named_scope(f"{scope}_g{i}"):
                carry["whole"] = order.cond(code == k, acts.gather_branch(k), lambda whole, row: whole,
                                            carry["whole"], row)
