"""The pipeline executor: runs a schedule table inside one jitted train step.

Called inside the train step's shard_map, where 'data' and 'pipeline' are manual and 'tensor' is left to
GSPMD. Each rank reads its column of the table (axis_index('pipeline')) and, tick by tick in a scan:
  - runs the action with lax.switch (a real conditional, so an idle tick costs nothing):
      forward  of local chunk c on micro batch i (the first chunk embeds tokens, the last adds the loss)
      backward of chunk c on micro batch i: jax.vjp of the chunk recomputed from its stashed input
               (the first chunk recomputes from tokens, the last seeds the vjp with the loss scale)
  - sends its output activation to rank r + 1 and its input gradient to rank r - 1 (ppermute), and
    writes what arrives into the buffer slot the table names (a spare trash slot takes empty ticks)
Only chunk inputs are stashed, for at most the in-flight micro batches, so activation memory is bounded
by the schedule's depth, not by the number of micro batches. Gradients accumulate per local chunk in
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
from megajax.pipeline.schedule import BWD, FWD, IDLE

MANUAL = ("data", "pipeline")
# expanded action kinds: what a branch does depends on where its chunk sits in the model
K_IDLE, K_F_FIRST, K_F_MID, K_F_LAST, K_B_FIRST, K_B_MID, K_B_LAST = range(7)


def vary(tree):
    """Marks values as varying over the manual axes (switch branches and scan carries must agree)."""
    def one(x):
        have = jax.typeof(x).manual_axis_type.varying
        need = tuple(a for a in MANUAL if a not in have)
        return jax.lax.pcast(x, need, to="varying") if need else x

    return jax.tree.map(one, tree)


@functools.lru_cache(maxsize=64)
def plan(name: str, p: int, v: int, m: int):
    """The schedule, its expanded kinds and its segments [(start, stop, fwd_send, bwd_send, kinds)]."""
    s = schedule_lib.build(name, p, v, m)
    g = s.global_chunk()
    last = p * v - 1
    kinds = np.full(s.kind.shape, K_IDLE, np.int32)
    kinds[(s.kind == FWD) & (g == 0)] = K_F_FIRST
    kinds[(s.kind == FWD) & (g > 0) & (g < last)] = K_F_MID
    kinds[(s.kind == FWD) & (g == last)] = K_F_LAST
    kinds[(s.kind == BWD) & (g == 0)] = K_B_FIRST
    kinds[(s.kind == BWD) & (g > 0) & (g < last)] = K_B_MID
    kinds[(s.kind == BWD) & (g == last)] = K_B_LAST
    fsend = np.any((s.kind == FWD) & (g < last), axis=1)
    bsend = np.any((s.kind == BWD) & (g > 0), axis=1)
    # At most three segments, so the tick body is compiled a bounded number of times whatever m is:
    # warm-up (before the first gradient send), steady, cool-down (after the last activation send).
    warm_end = int(np.argmax(bsend)) if bsend.any() else s.ticks
    cool_start = int(s.ticks - np.argmax(fsend[::-1])) if fsend.any() else 0
    bounds = sorted({0, min(warm_end, cool_start), max(warm_end, cool_start), s.ticks})
    segments = []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        present = tuple(sorted(set(kinds[start:stop].ravel().tolist()) | {K_IDLE}))
        segments.append((start, stop, bool(fsend[start:stop].any()), bool(bsend[start:stop].any()), present))
    return s, kinds, segments


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
    _, _, segments = plan(par.schedule, par.pipeline, par.virtual_stages, m)
    n = sum((stop - start) * (int(f) + int(b)) for start, stop, f, b, _ in segments)
    return {"ppermutes": n, "bytes": n * act}


def _perm(p: int, v: int, step: int) -> list[tuple[int, int]]:
    """Ring neighbours; without interleaving the wrap-around pair carries nothing and is left out."""
    pairs = [(i, (i + step) % p) for i in range(p)]
    if v == 1:
        pairs = [(a, b) for a, b in pairs if (b - a) == step]
    return pairs


def pipeline_grads(cfg: Config, params: dict, batch: dict, seed_scale: jax.Array):
    """(summed token loss over the local batch, gradients of seed_scale * summed loss) on this data
    rank, summed over 'pipeline' where parameters are shared. params: stacked layers in the staged
    layout [v, 1 (this rank), L/(p v), ...]; the rest replicated. batch: the local rows [m * mb, ...]."""
    par = cfg.parallel
    m = cfg.num_micro_batches
    if par.schedule == "gpipe":
        return _gpipe_grads(cfg, params, batch, seed_scale)
    sched, kinds, segments = plan(par.schedule, par.pipeline, par.virtual_stages, m)
    layers = vary(jax.tree.map(lambda x: x[:, 0], params["layers"]))  # [v, Lc, ...]
    shared = vary({k: val for k, val in params.items() if k != "layers"})
    mbs = vary(jax.tree.map(lambda x: x.reshape(m, x.shape[0] // m, *x.shape[1:]), batch))
    mb_rows = batch["tokens"].shape[0] // m
    act_dtype = jnp.dtype(cfg.model.compute_dtype)
    act_shape = (mb_rows, cfg.model.seq_length, cfg.model.hidden_size)
    carry = vary({
        "act": jnp.zeros((sched.act_slots, *act_shape), act_dtype),
        "grad": jnp.zeros((sched.grad_slots, *act_shape), act_dtype),
        "g_layers": jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), layers),
        "g_shared": jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), shared),
        "loss": jnp.zeros((), jnp.float32),
    })
    branches = _branches(cfg, layers, shared, mbs, vary(seed_scale))
    rank = jax.lax.axis_index("pipeline")
    table = {"kind": kinds, "chunk": sched.chunk, "micro": sched.micro, "act_slot": sched.act_slot,
             "grad_slot": sched.grad_slot, "recv_act": sched.recv_act, "recv_grad": sched.recv_grad}
    for start, stop, fsend, bsend, present in segments:
        local_kind = np.full(7, 0, np.int32)
        local_kind[list(present)] = np.arange(len(present))
        xs = {k: jnp.asarray(v[start:stop]) for k, v in table.items()}
        xs["kind"] = jnp.asarray(local_kind[kinds[start:stop]])
        seg_branches = [branches[k] for k in present]

        def tick(carry, row, seg_branches=seg_branches, fsend=fsend, bsend=bsend):
            row = {k: jnp.clip(val[rank], 0, None) for k, val in row.items()}
            carry, send_act, send_grad = jax.lax.switch(row["kind"], seg_branches, carry, row)
            if fsend:
                recv = jax.lax.ppermute(send_act, "pipeline", _perm(par.pipeline, par.virtual_stages, 1))
                carry["act"] = carry["act"].at[row["recv_act"]].set(recv)
            if bsend:
                recv = jax.lax.ppermute(send_grad, "pipeline", _perm(par.pipeline, par.virtual_stages, -1))
                carry["grad"] = carry["grad"].at[row["recv_grad"]].set(recv)
            return carry, None

        carry, _ = jax.lax.scan(tick, carry, xs)
    grads = {k: jax.lax.psum(g, "pipeline") for k, g in carry["g_shared"].items()}
    grads["layers"] = jax.tree.map(lambda g: g[:, None], carry["g_layers"])
    return jax.lax.psum(carry["loss"], "pipeline"), grads


def _branches(cfg: Config, layers, shared, mbs, seed_scale):
    """The seven tick actions, each (carry, row) -> (carry, activation to send, gradient to send)."""
    mcfg = cfg.model
    lc = jax.tree.leaves(layers)[0].shape[1]
    p = cfg.parallel.pipeline

    def chunk(row):
        params = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, row["chunk"], keepdims=False), layers)
        first_layer = (row["chunk"] * p + jax.lax.axis_index("pipeline")) * lc
        return params, first_layer

    def micro(row):
        mb = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, row["micro"], keepdims=False), mbs)
        return mb, model.dropout_keys(cfg.model, cfg.train.seed, mb["sample_ids"])

    def stack(w, x, keys, first_layer):
        return model.layers_apply(mcfg, w, x, keys, first_layer)

    def add_layer_grads(carry, row, dw):
        carry["g_layers"] = jax.tree.map(lambda acc, d: acc.at[row["chunk"]].add(d.astype(acc.dtype)),
                                         carry["g_layers"], dw)
        return carry

    def add_shared_grads(carry, dsh):
        carry["g_shared"] = jax.tree.map(lambda acc, d: acc + d.astype(acc.dtype), carry["g_shared"], dsh)
        return carry

    def out(carry, send_act=None, send_grad=None):
        zeros = jnp.zeros_like(carry["act"][0])
        return vary((carry, zeros if send_act is None else send_act.astype(zeros.dtype),
                     zeros if send_grad is None else send_grad.astype(zeros.dtype)))

    def idle(carry, row):
        return out(carry)

    def f_first(carry, row):
        (w, first), (mb, keys) = chunk(row), micro(row)
        return out(carry, send_act=stack(w, model.embed_apply(mcfg, shared, mb["tokens"], keys), keys, first))

    def f_mid(carry, row):
        (w, first), (_, keys) = chunk(row), micro(row)
        return out(carry, send_act=stack(w, carry["act"][row["act_slot"]], keys, first))

    def f_last(carry, row):
        (w, first), (mb, keys) = chunk(row), micro(row)
        y = stack(w, carry["act"][row["act_slot"]], keys, first)
        carry["loss"] = carry["loss"] + model.head_apply(mcfg, shared, y, mb["targets"], mb["loss_mask"])
        return out(carry)

    def b_first(carry, row):
        (w, first), (mb, keys) = chunk(row), micro(row)
        _, vjp = jax.vjp(lambda w, sh: stack(w, model.embed_apply(mcfg, sh, mb["tokens"], keys), keys, first),
                         w, shared)
        dw, dsh = vjp(carry["grad"][row["grad_slot"]])
        return out(add_shared_grads(add_layer_grads(carry, row, dw), dsh))

    def b_mid(carry, row):
        (w, first), (_, keys) = chunk(row), micro(row)
        _, vjp = jax.vjp(lambda w, x: stack(w, x, keys, first), w, carry["act"][row["act_slot"]])
        dw, dx = vjp(carry["grad"][row["grad_slot"]])
        return out(add_layer_grads(carry, row, dw), send_grad=dx)

    def b_last(carry, row):
        (w, first), (mb, keys) = chunk(row), micro(row)

        def loss(w, sh, x):
            return model.head_apply(mcfg, sh, stack(w, x, keys, first), mb["targets"], mb["loss_mask"])

        _, vjp = jax.vjp(loss, w, shared, carry["act"][row["act_slot"]])
        dw, dsh, dx = vjp(seed_scale)
        return out(add_shared_grads(add_layer_grads(carry, row, dw), dsh), send_grad=dx)

    return [idle, f_first, f_mid, f_last, b_first, b_mid, b_last]


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
