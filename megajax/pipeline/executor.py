"""The pipeline executor: runs a schedule table inside one jitted train step.

Called inside the train step's shard_map, where 'data' and 'pipeline' are manual and 'tensor' is left to
GSPMD. Each rank reads its column of the table (axis_index('pipeline')) and, tick by tick in a scan:
  - runs its forward, then its backward, each chosen with lax.switch (a real conditional: an absent
    action costs nothing):
      forward  of local chunk c on micro batch i (the first chunk embeds tokens, the last adds the loss)
      backward of chunk c on micro batch i: layer by layer from the last, recomputed from its stashed
               input, then its jax.vjp (the last chunk first backpropagates the loss, the first
               finishes with the embedding)
  - sends its output activation to rank r + 1 and its input gradient to rank r - 1 (ppermute), and
    writes what arrives into the buffer slot the table names (a spare trash slot takes empty ticks)
Only each layer's input is stashed (Megatron's full recomputation), for at most the in-flight micro
batches, so activation memory is bounded by the schedule's depth, not by the number of micro batches. Gradients accumulate per local chunk in
fp32; the embedding and head gradients and the loss are summed over 'pipeline' once after the scan, and
the caller reduces everything over 'data' once per step.

Ticks are grouped into segments (warm-up, steady, cool-down) by which sends they need: a segment with no
forward (or backward) sends has no ppermute in that direction, and its switch holds only the actions it
runs. GPipe is the simple baseline: autodiff of a forward-only pipeline scan (memory grows with m).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from megajax import model
from megajax.config import Config
from megajax.pipeline import schedule as schedule_lib
from megajax.sharding import vary

# what an action does depends on where its chunk sits in the model: 0 none, 1 first, 2 middle, 3 last chunk
NONE, FIRST, MID, LAST = range(4)


def _position(global_chunk: np.ndarray, chunks: int) -> np.ndarray:
    out = np.full(global_chunk.shape, NONE, np.int32)
    out[global_chunk == 0] = FIRST
    out[(global_chunk > 0) & (global_chunk < chunks - 1)] = MID
    out[global_chunk == chunks - 1] = LAST
    return out


@functools.lru_cache(maxsize=64)
def plan(name: str, p: int, v: int, m: int):
    """The schedule, the forward and backward kinds per (tick, rank), and the tick segments
    [(start, stop, forward sends?, backward sends?, forward kinds present, backward kinds present)]."""
    s = schedule_lib.build(name, p, v, m)
    chunks = p * v
    fg, bg = s.global_chunk(s.f_chunk), s.global_chunk(s.b_chunk)
    f_kind, b_kind = _position(fg, chunks), _position(bg, chunks)
    fsend = np.any((fg >= 0) & (fg < chunks - 1), axis=1)
    bsend = np.any(bg > 0, axis=1)
    # At most three segments, so the tick body is compiled a bounded number of times whatever m is:
    # warm-up (before the first gradient send), steady, cool-down (after the last activation send).
    warm_end = int(np.argmax(bsend)) if bsend.any() else s.ticks
    cool_start = int(s.ticks - np.argmax(fsend[::-1])) if fsend.any() else 0
    bounds = sorted({0, min(warm_end, cool_start), max(warm_end, cool_start), s.ticks})
    segments = []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        present_f = tuple(sorted(set(f_kind[start:stop].ravel().tolist()) | {NONE}))
        present_b = tuple(sorted(set(b_kind[start:stop].ravel().tolist()) | {NONE}))
        segments.append((start, stop, bool(fsend[start:stop].any()), bool(bsend[start:stop].any()),
                         present_f, present_b))
    return s, f_kind, b_kind, segments


def permute_bytes_per_step(cfg: Config) -> dict:
    """What the executor sends per step over 'pipeline', per device: segment ticks x directions x one
    [micro batch, seq, hidden] activation (for the audit to check against the compiled program)."""
    par = cfg.parallel
    m = cfg.num_micro_batches
    mb = cfg.micro_batch_size(par.data)
    act = mb * cfg.model.seq_length * cfg.model.hidden_size * jnp.dtype(cfg.model.compute_dtype).itemsize
    if par.schedule == "gpipe":
        ticks = m + par.pipeline - 1
        return {"ppermutes": 2 * ticks, "bytes": 2 * ticks * act}  # forward scan and its transpose
    segments = plan(par.schedule, par.pipeline, par.virtual_stages, m)[3]
    n = sum((stop - start) * (int(f) + int(b)) for start, stop, f, b, _, _ in segments)
    return {"ppermutes": n, "bytes": n * act}


def _perm(p: int, v: int, step: int) -> list[tuple[int, int]]:
    """Ring neighbours; without interleaving the wrap-around pair carries nothing and is left out."""
    pairs = [(i, (i + step) % p) for i in range(p)]
    if v == 1:
        pairs = [(a, b) for a, b in pairs if (b - a) == step]
    return pairs


def _local_kinds(present: tuple[int, ...], kinds: np.ndarray) -> jax.Array:
    """Kind codes -> indices into the segment's list of branches."""
    index = np.zeros(4, np.int32)
    index[list(present)] = np.arange(len(present))
    return jnp.asarray(index[kinds])


def pipeline_grads(cfg: Config, params: dict, batch: dict, seed_scale: jax.Array):
    """(summed token loss over the local batch, gradients of seed_scale * summed loss) on this data
    rank, summed over 'pipeline' where parameters are shared. params: stacked layers in the staged
    layout [v, 1 (this rank), L/(p v), ...]; the rest replicated. batch: the local rows [m * mb, ...]."""
    par = cfg.parallel
    m = cfg.num_micro_batches
    if par.schedule == "gpipe":
        return _gpipe_grads(cfg, params, batch, seed_scale)
    sched, f_kind, b_kind, segments = plan(par.schedule, par.pipeline, par.virtual_stages, m)
    layers = vary(jax.tree.map(lambda x: x[:, 0], params["layers"]))  # [v, Lc, ...]
    shared = vary({k: val for k, val in params.items() if k != "layers"})
    mbs = vary(jax.tree.map(lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), batch))
    act_shape = (batch["tokens"].shape[0] // m, cfg.model.seq_length, cfg.model.hidden_size)
    act_dtype = jnp.dtype(cfg.model.compute_dtype)
    lc = jax.tree.leaves(layers)[0].shape[1]
    carry = vary({
        # slot i holds a (chunk, micro batch)'s stash: the input of each of its layers, then its output
        "act": jnp.zeros((sched.act_slots, lc + 1, *act_shape), act_dtype),
        "grad": jnp.zeros((sched.grad_slots, *act_shape), act_dtype),
        "g_layers": jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), layers),
        "g_shared": jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), shared),
        "loss": jnp.zeros((), jnp.float32),
    })
    fwd, bwd = _branches(cfg, layers, shared, mbs, vary(seed_scale))
    rank = jax.lax.axis_index("pipeline")
    fields = ("f_chunk", "f_micro", "f_slot", "b_chunk", "b_micro", "b_act_slot", "b_grad_slot", "recv_act",
              "recv_grad")
    for start, stop, fsend, bsend, present_f, present_b in segments:
        xs = {k: jnp.asarray(getattr(sched, k)[start:stop]) for k in fields}
        xs["f_kind"] = _local_kinds(present_f, f_kind[start:stop])
        xs["b_kind"] = _local_kinds(present_b, b_kind[start:stop])

        def tick(carry, row, fwd_branches=[fwd[k] for k in present_f], bwd_branches=[bwd[k] for k in present_b],
                 fsend=fsend, bsend=bsend):
            row = {k: jnp.clip(val[rank], 0, None) for k, val in row.items()}
            # Only the slices an action reads go into the switch, and its results come out of it: the big
            # buffers and accumulators stay outside, so no conditional copies them every tick.
            send_act, stash, loss = jax.lax.switch(row["f_kind"], fwd_branches, carry["act"][row["f_slot"], 0], row)
            carry["act"] = carry["act"].at[row["f_slot"]].set(stash)  # (the trash slot when no forward)
            send_grad, dw, dsh = jax.lax.switch(row["b_kind"], bwd_branches, carry["act"][row["b_act_slot"]],
                                                carry["grad"][row["b_grad_slot"]], row)
            carry["loss"] = carry["loss"] + loss
            c = row["b_chunk"]
            carry["g_layers"] = jax.tree.map(lambda acc, d: acc.at[c].add(d), carry["g_layers"], dw)
            carry["g_shared"] = jax.tree.map(jnp.add, carry["g_shared"], dsh)
            if fsend:
                recv = jax.lax.ppermute(send_act, "pipeline", _perm(par.pipeline, par.virtual_stages, 1))
                carry["act"] = carry["act"].at[row["recv_act"], 0].set(recv)
            if bsend:
                recv = jax.lax.ppermute(send_grad, "pipeline", _perm(par.pipeline, par.virtual_stages, -1))
                carry["grad"] = carry["grad"].at[row["recv_grad"]].set(recv)
            return carry, None

        carry, _ = jax.lax.scan(tick, carry, xs)
    grads = {k: jax.lax.psum(g, "pipeline") for k, g in carry["g_shared"].items()}
    grads["layers"] = jax.tree.map(lambda g: g[:, None], carry["g_layers"])
    return jax.lax.psum(carry["loss"], "pipeline"), grads


def _branches(cfg: Config, layers, shared, mbs, seed_scale):
    """The forward and backward actions of a tick, indexed by NONE / FIRST / MID / LAST.

    forward  (x, row) -> (activation to send, stash, loss): runs the chunk's layers one by one and keeps
             each layer's input (and the chunk's output) in the stash
    backward (stash, g, row) -> (gradient to send, chunk gradients, shared-parameter gradients): walks the
             layers backwards, recomputing each from its stashed input just before its backward
    So every micro batch costs one forward, one recomputed forward and one backward, like Megatron with
    full recomputation, and only [layers + 1, mb, s, d] per in-flight micro batch is kept.
    """
    mcfg = cfg.model
    lc = jax.tree.leaves(layers)[0].shape[1]
    p = cfg.parallel.pipeline
    zero_dw = jax.tree.map(lambda x: jnp.zeros(x.shape[1:], jnp.float32), layers)
    zero_dsh = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), shared)

    def chunk(row, prefix):
        first_layer = (row[prefix + "chunk"] * p + jax.lax.axis_index("pipeline")) * lc
        if jax.tree.leaves(layers)[0].shape[0] == 1:  # one chunk per rank: a static slice, no copy
            return jax.tree.map(lambda x: x[0], layers), first_layer
        params = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, row[prefix + "chunk"], keepdims=False),
                              layers)
        return params, first_layer

    def micro(row, prefix):
        mb = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, row[prefix + "micro"], keepdims=False), mbs)
        return mb, model.dropout_keys(mcfg, cfg.train.seed, mb["sample_ids"])

    def forward(w, x, keys, first_layer):
        """The chunk's layers in order: (output, stash [lc + 1, mb, s, d])."""
        def body(x, wl):
            w_l, l = wl
            return model.block_apply(mcfg, w_l, x, l, keys).astype(x.dtype), x

        y, inputs = jax.lax.scan(body, x, (w["block"], first_layer + jnp.arange(lc)))
        return y, jnp.concatenate([inputs, y[None]], axis=0)

    def backward(w, stash, g, keys, first_layer):
        """Layer by layer from the last: recompute from the stashed input, then its vjp.
        Returns (gradient at the chunk input, stacked parameter gradients)."""
        def body(g, wxl):
            w_l, x_l, l = wxl
            _, vjp = jax.vjp(lambda w, x: model.block_apply(mcfg, w, x, l, keys), w_l, x_l)
            dw, dx = vjp(g.astype(x_l.dtype))
            return dx, jax.tree.map(lambda d: d.astype(jnp.float32), dw)

        g_in, dw = jax.lax.scan(body, g, (w["block"], stash[:lc], first_layer + jnp.arange(lc)), reverse=True)
        return g_in, {"block": dw}

    def fwd_out(x, send=None, stash=None, loss=None):
        return vary((jnp.zeros_like(x) if send is None else send.astype(x.dtype),
                     jnp.zeros((lc + 1, *x.shape), x.dtype) if stash is None else stash,
                     jnp.zeros((), jnp.float32) if loss is None else loss))

    def bwd_out(g, send=None, dw=None, dsh=None):
        return vary((jnp.zeros_like(g) if send is None else send.astype(g.dtype), zero_dw if dw is None else dw,
                     zero_dsh if dsh is None else jax.tree.map(lambda d: d.astype(jnp.float32), dsh)))

    def f_none(x, row):
        return fwd_out(x)

    def f_first(x, row):
        (w, first), (mb, keys) = chunk(row, "f_"), micro(row, "f_")
        y, stash = forward(w, model.embed_apply(mcfg, shared, mb["tokens"], keys).astype(x.dtype), keys, first)
        return fwd_out(x, y, stash)

    def f_mid(x, row):
        (w, first), (_, keys) = chunk(row, "f_"), micro(row, "f_")
        y, stash = forward(w, x, keys, first)
        return fwd_out(x, y, stash)

    def f_last(x, row):
        (w, first), (mb, keys) = chunk(row, "f_"), micro(row, "f_")
        y, stash = forward(w, x, keys, first)
        return fwd_out(x, stash=stash, loss=model.head_apply(mcfg, shared, y, mb["targets"], mb["loss_mask"]))

    def b_none(stash, g, row):
        return bwd_out(g)

    def b_first(stash, g, row):
        (w, first), (mb, keys) = chunk(row, "b_"), micro(row, "b_")
        g_in, dw = backward(w, stash, g, keys, first)
        _, vjp = jax.vjp(lambda sh: model.embed_apply(mcfg, sh, mb["tokens"], keys), shared)
        (dsh,) = vjp(g_in.astype(stash.dtype))
        return bwd_out(g, dw=dw, dsh=dsh)

    def b_mid(stash, g, row):
        (w, first), (_, keys) = chunk(row, "b_"), micro(row, "b_")
        g_in, dw = backward(w, stash, g, keys, first)
        return bwd_out(g, g_in, dw)

    def b_last(stash, g, row):
        (w, first), (mb, keys) = chunk(row, "b_"), micro(row, "b_")
        _, vjp = jax.vjp(lambda sh, y: model.head_apply(mcfg, sh, y, mb["targets"], mb["loss_mask"]),
                         shared, stash[lc])
        dsh, g_out = vjp(seed_scale)
        g_in, dw = backward(w, stash, g_out, keys, first)
        return bwd_out(g, g_in, dw, dsh)

    return [f_none, f_first, f_mid, f_last], [b_none, b_first, b_mid, b_last]


def _gpipe_grads(cfg: Config, params: dict, batch: dict, seed_scale: jax.Array):
    """GPipe: every forward, then autodiff runs the backward (stashing every tick's residuals)."""
    par, mcfg = cfg.parallel, cfg.model
    p, m = par.pipeline, cfg.num_micro_batches

    mbs = vary(jax.tree.map(lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), batch))
    rank = jax.lax.axis_index("pipeline")
    lc = jax.tree.leaves(params["layers"])[0].shape[2]

    def forward(layers, shared):
        w = jax.tree.map(lambda x: x[0, 0], layers)  # v == 1: this rank's one chunk
        first_layer = rank * lc

        def tick(carry, t):
            x_in, loss = carry
            i = jnp.clip(t - rank, 0, m - 1)
            active = (t - rank >= 0) & (t - rank < m)
            mb = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), mbs)
            keys = model.dropout_keys(cfg.model, cfg.train.seed, mb["sample_ids"])
            x = jax.lax.cond(rank == 0, lambda: vary(model.embed_apply(mcfg, shared, mb["tokens"], keys)).astype(
                x_in.dtype), lambda: x_in)
            y = jax.lax.cond(active, lambda: model.layers_apply(mcfg, w, x, keys, first_layer).astype(x_in.dtype),
                             lambda: x)
            step_loss = jax.lax.cond(active & (rank == p - 1),
                                     lambda: vary(model.head_apply(mcfg, shared, y, mb["targets"], mb["loss_mask"])),
                                     lambda: vary(jnp.zeros((), jnp.float32)))
            recv = jax.lax.ppermute(y, "pipeline", _perm(p, 1, 1))
            return (recv, loss + step_loss), None

        shape = (batch["tokens"].shape[0] // m, mcfg.seq_length, mcfg.hidden_size)
        init = vary((jnp.zeros(shape, mcfg.compute_dtype), jnp.zeros((), jnp.float32)))
        (_, loss), _ = jax.lax.scan(tick, init, jnp.arange(m + p - 1))
        return loss * seed_scale, loss

    layers = vary(params["layers"])
    shared = vary({k: val for k, val in params.items() if k != "layers"})
    (g_layers, g_shared), loss = jax.grad(forward, argnums=(0, 1), has_aux=True)(layers, shared)
    grads = {k: jax.lax.psum(g, "pipeline") for k, g in g_shared.items()}
    grads["layers"] = g_layers
    return jax.lax.psum(loss, "pipeline"), grads


def pipeline_loss(cfg: Config, params: dict, batch: dict) -> jax.Array:
    """Forward only (evaluation): the summed token loss of this data rank's rows, run through the
    pipeline without gathering the layers. For each local chunk i in turn (a "round"), the micro batches
    flow GPipe-style through the p ranks; rank 0 keeps what comes back around the ring from rank p - 1 as
    the input of the next round. Inside the train step's shard_map, like `pipeline_grads`."""
    par, mcfg = cfg.parallel, cfg.model
    p, v, m = par.pipeline, par.virtual_stages, cfg.num_micro_batches
    layers = vary(jax.tree.map(lambda x: x[:, 0], params["layers"]))  # [v, Lc, ...]
    shared = vary({k: val for k, val in params.items() if k != "layers"})
    mbs = vary(jax.tree.map(lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), batch))
    rank = jax.lax.axis_index("pipeline")
    lc = jax.tree.leaves(layers)[0].shape[1]
    shape = (batch["tokens"].shape[0] // m, mcfg.seq_length, mcfg.hidden_size)
    dtype = jnp.dtype(mcfg.compute_dtype)
    returned = vary(jnp.zeros((m, *shape), dtype))  # rank 0: the previous round's outputs
    loss = vary(jnp.zeros((), jnp.float32))
    for i in range(v):
        w = jax.tree.map(lambda x: x[i], layers)

        def tick(carry, t, w=w, i=i):
            x_in, returned, loss = carry
            k = t - rank
            active = (k >= 0) & (k < m)
            mb = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, jnp.clip(k, 0, m - 1), keepdims=False), mbs)
            if i == 0:
                first = vary(model.embed_apply(mcfg, shared, mb["tokens"], None).astype(dtype))
            else:
                first = jax.lax.dynamic_index_in_dim(returned, jnp.clip(k, 0, m - 1), keepdims=False)
            x = jnp.where(rank == 0, first, x_in)
            first_layer = (i * p + rank) * lc
            y = jax.lax.cond(active, lambda: model.layers_apply(mcfg, w, x, None, first_layer).astype(dtype),
                             lambda: x)
            if i == v - 1:
                loss = loss + jax.lax.cond(active & (rank == p - 1),
                                           lambda: vary(model.head_apply(mcfg, shared, y, mb["targets"],
                                                                         mb["loss_mask"])),
                                           lambda: vary(jnp.zeros((), jnp.float32)))
            recv = jax.lax.ppermute(y, "pipeline", _perm(p, v, 1))
            back = t - (p - 1)  # the micro batch rank p - 1 just finished reaches rank 0 around the ring
            keep = (rank == 0) & (back >= 0) & (back < m)
            returned = jnp.where(keep, returned.at[jnp.clip(back, 0, m - 1)].set(recv), returned)
            return (recv, returned, loss), None

        init = (vary(jnp.zeros(shape, dtype)), returned, loss)
        (_, returned, loss), _ = jax.lax.scan(tick, init, jnp.arange(m + p - 1))
    return jax.lax.psum(loss, "pipeline")
