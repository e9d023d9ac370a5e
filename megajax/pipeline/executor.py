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
from megajax.data.loader import micro_batches
from megajax.pipeline import schedule as schedule_lib
from megajax.pipeline.layout import local_chunks
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
    mb = cfg.train.micro_batch_size
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
    layers = vary(local_chunks(params["layers"]))  # [v, Lc, ...]
    shared = _shared(params)
    mbs = vary(micro_batches(batch, m))
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
    acts = _ChunkActions(cfg, layers, shared, mbs, seed_scale)
    return ([acts.f_none, acts.f_first, acts.f_mid, acts.f_last],
            [acts.b_none, acts.b_first, acts.b_mid, acts.b_last])


class _ChunkActions:
    """What one rank can do with one (local chunk, micro batch) in a tick: the chunk's forward and its
    backward, each in four variants by where the chunk sits in the model (see `_branches`)."""

    def __init__(self, cfg: Config, layers, shared, mbs, seed_scale):
        self.cfg, self.mcfg = cfg, cfg.model
        self.layers, self.shared, self.mbs, self.seed_scale = layers, shared, mbs, seed_scale
        self.lc = jax.tree.leaves(layers)[0].shape[1]
        self.zero_dw = jax.tree.map(lambda x: jnp.zeros(x.shape[1:], jnp.float32), layers)
        self.zero_dsh = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), shared)

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
        return mb, model.dropout_keys(self.mcfg, self.cfg.train.seed, mb["sample_ids"])

    # -- the chunk's layers, forward and backward ----------------------------------------------------------

    def forward(self, w, x, keys, first_layer):
        """The chunk's layers in order: (output, stash [lc + 1, mb, s, d])."""
        def body(x, wl):
            w_l, l = wl
            return model.block_apply(self.mcfg, w_l, x, l, keys).astype(x.dtype), x

        y, inputs = jax.lax.scan(body, x, (w["block"], first_layer + jnp.arange(self.lc)))
        return y, jnp.concatenate([inputs, y[None]], axis=0)

    def backward(self, w, stash, g, keys, first_layer):
        """Layer by layer from the last: recompute from the stashed input, then its vjp.
        Returns (gradient at the chunk input, stacked parameter gradients)."""
        def body(g, wxl):
            w_l, x_l, l = wxl
            _, vjp = jax.vjp(lambda w, x: model.block_apply(self.mcfg, w, x, l, keys), w_l, x_l)
            dw, dx = vjp(g.astype(x_l.dtype))
            return dx, jax.tree.map(lambda d: d.astype(jnp.float32), dw)

        g_in, dw = jax.lax.scan(body, g, (w["block"], stash[:self.lc], first_layer + jnp.arange(self.lc)),
                                reverse=True)
        return g_in, {"block": dw}

    # -- branch outputs: every branch returns the same types (absent parts are zeros) ----------------------

    def fwd_out(self, x, send=None, stash=None, loss=None):
        return vary((jnp.zeros_like(x) if send is None else send.astype(x.dtype),
                     jnp.zeros((self.lc + 1, *x.shape), x.dtype) if stash is None else stash,
                     jnp.zeros((), jnp.float32) if loss is None else loss))

    def bwd_out(self, g, send=None, dw=None, dsh=None):
        return vary((jnp.zeros_like(g) if send is None else send.astype(g.dtype),
                     self.zero_dw if dw is None else dw,
                     self.zero_dsh if dsh is None else jax.tree.map(lambda d: d.astype(jnp.float32), dsh)))

    # -- the branches --------------------------------------------------------------------------------------

    def f_none(self, x, row):
        return self.fwd_out(x)

    def f_first(self, x, row):
        (w, first), (mb, keys) = self.chunk(row, "f_"), self.micro(row, "f_")
        x0 = model.embed_apply(self.mcfg, self.shared, mb["tokens"], keys).astype(x.dtype)
        y, stash = self.forward(w, x0, keys, first)
        return self.fwd_out(x, y, stash)

    def f_mid(self, x, row):
        (w, first), (_, keys) = self.chunk(row, "f_"), self.micro(row, "f_")
        y, stash = self.forward(w, x, keys, first)
        return self.fwd_out(x, y, stash)

    def f_last(self, x, row):
        (w, first), (mb, keys) = self.chunk(row, "f_"), self.micro(row, "f_")
        y, stash = self.forward(w, x, keys, first)
        loss = model.head_apply(self.mcfg, self.shared, y, mb["targets"], mb["loss_mask"])
        return self.fwd_out(x, stash=stash, loss=loss)

    def b_none(self, stash, g, row):
        return self.bwd_out(g)

    def b_first(self, stash, g, row):
        (w, first), (mb, keys) = self.chunk(row, "b_"), self.micro(row, "b_")
        g_in, dw = self.backward(w, stash, g, keys, first)
        _, vjp = jax.vjp(lambda sh: model.embed_apply(self.mcfg, sh, mb["tokens"], keys), self.shared)
        (dsh,) = vjp(g_in.astype(stash.dtype))
        return self.bwd_out(g, dw=dw, dsh=dsh)

    def b_mid(self, stash, g, row):
        (w, first), (_, keys) = self.chunk(row, "b_"), self.micro(row, "b_")
        g_in, dw = self.backward(w, stash, g, keys, first)
        return self.bwd_out(g, g_in, dw)

    def b_last(self, stash, g, row):
        (w, first), (mb, keys) = self.chunk(row, "b_"), self.micro(row, "b_")
        _, vjp = jax.vjp(lambda sh, y: model.head_apply(self.mcfg, sh, y, mb["targets"], mb["loss_mask"]),
                         self.shared, stash[self.lc])
        dsh, g_out = vjp(self.seed_scale)
        g_in, dw = self.backward(w, stash, g_out, keys, first)
        return self.bwd_out(g, g_in, dw, dsh)


def _shared(params: dict) -> dict:
    """The parameters every stage may use (embedding and head), marked varying over the manual axes."""
    return vary({k: val for k, val in params.items() if k != "layers"})


def _gpipe_grads(cfg: Config, params: dict, batch: dict, seed_scale: jax.Array):
    """GPipe: every forward (`_forward_rounds`), then autodiff runs the backward, stashing every tick's
    residuals (memory grows with m: the simple baseline)."""
    mbs = vary(micro_batches(batch, cfg.num_micro_batches))

    def loss_fn(layers, shared):
        loss = _forward_rounds(cfg, local_chunks(layers), shared, mbs, train=True)
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


def _forward_rounds(cfg: Config, layers, shared, mbs, train: bool) -> jax.Array:
    """The forward pipeline: for each local chunk i in turn (a "round"), the micro batches flow GPipe-style
    through the p ranks, one tick per hop; rank 0 keeps what comes back around the ring from rank p - 1 as
    the input of the next round. Returns this rank's part of the summed token loss (rank p - 1 holds it).
    layers: this rank's chunks [v, Lc, ...]; mbs: micro batches [m, mb, ...]; train: dropout on."""
    par, mcfg = cfg.parallel, cfg.model
    p, v, m = par.pipeline, par.virtual_stages, cfg.num_micro_batches
    rank = jax.lax.axis_index("pipeline")
    lc = jax.tree.leaves(layers)[0].shape[1]
    shape = (mbs["tokens"].shape[1], mcfg.seq_length, mcfg.hidden_size)
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
            keys = model.dropout_keys(mcfg, cfg.train.seed, mb["sample_ids"]) if train else None
            if i == 0:
                first = lambda: vary(model.embed_apply(mcfg, shared, mb["tokens"], keys).astype(dtype))  # noqa: E731
            else:
                first = lambda: jax.lax.dynamic_index_in_dim(returned, jnp.clip(k, 0, m - 1), keepdims=False)  # noqa: E731
            x = jax.lax.cond(rank == 0, first, lambda: x_in)
            y = jax.lax.cond(active, lambda: model.layers_apply(mcfg, w, x, keys, (i * p + rank) * lc).astype(dtype),
                             lambda: x)
            if i == v - 1:
                loss = loss + jax.lax.cond(active & (rank == p - 1),
                                           lambda: vary(model.head_apply(mcfg, shared, y, mb["targets"],
                                                                         mb["loss_mask"])),
                                           lambda: vary(jnp.zeros((), jnp.float32)))
            recv = jax.lax.ppermute(y, "pipeline", _perm(p, v, 1))
            if returned is not None:  # the micro batch rank p - 1 just finished reaches rank 0 around the ring
                back = t - (p - 1)
                keep = (rank == 0) & (back >= 0) & (back < m)
                returned = jnp.where(keep, returned.at[jnp.clip(back, 0, m - 1)].set(recv), returned)
            return (recv, returned, loss), None

        init = (vary(jnp.zeros(shape, dtype)), returned, loss)
        (_, returned, loss), _ = jax.lax.scan(tick, init, jnp.arange(m + p - 1))
    return loss
