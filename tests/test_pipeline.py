"""The pipeline executor: gradients equal plain jax.grad; memory flat in m; collectives as planned; evaluation
through the stages. (Losses and gradient norms of every schedule and layout against one device: test_layouts.)"""

import itertools
import re

import numpy as np
import pytest

from megajax import hlo
from megajax.config import io as config_io
from megajax.parallel.pipeline import ticks
from megajax.parallel.pipeline.schedule import perm_pairs
from megajax.parallel.step_plan import StepPlan

from conftest import evaluate, first_batch, jaxpr_eqns, run_steps, shared_across_workers, small_config

STEPS = 3
ARCHS = {
    "gpt2": {"model.num_layers": 8},
    "llama": {"model.num_layers": 8, "model.arch": "llama", "model.num_heads": 8, "model.num_kv_heads": 4},
}


@shared_across_workers
def reference(arch: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    norms = []
    losses = run_steps(small_config(**ARCHS[arch]), 1, STEPS, grad_norms=norms)
    return tuple(losses), tuple(norms)


def permute_bytes_per_step(cfg) -> dict:
    """What the executor should send per step over 'pipeline', per device: each tick's ppermutes of one
    [micro batch, seq / context, hidden] activation (the oracle for the compiled program's collective-permutes)."""
    par = cfg.parallel
    m = cfg.num_micro_batches
    mb = cfg.train.micro_batch_size
    tokens = mb * (cfg.model.seq_length // par.context)
    act = tokens * cfg.model.hidden_size * np.dtype(cfg.model.compute_dtype).itemsize
    if par.schedule == "gpipe":
        n = m + par.pipeline - 1  # ticks
        return {"ppermutes": 2 * n, "bytes": 2 * n * act}  # forward scan and its transpose
    p, v = par.pipeline, par.virtual_stages
    sched, _, _, segments = ticks.plan(par.schedule, p, v, m)
    n = 0
    for seg in segments:
        for j in range(seg.stop - seg.start):
            n += len(perm_pairs(p, v, seg.roles, (seg.parity + j) % 2))
    return {"ppermutes": n, "bytes": n * act}


def layout(schedule, p, v, d, t, sp, mb=1):
    return {"parallel.schedule": schedule, "parallel.pipeline": p, "parallel.virtual_stages": v,
            "parallel.data": d, "parallel.tensor": t, "parallel.sequence_parallel": sp,
            "train.micro_batch_size": mb}


def _compile(schedule, v, gbs):
    from megajax.audit import compile_step
    import jax

    cfg = config_io.load("configs/tiny.yaml", [
        "parallel.data=2", "parallel.pipeline=2", "parallel.tensor=2", "train.micro_batch_size=2",
        f"train.global_batch_size={gbs}", f"parallel.schedule={schedule}", f"parallel.virtual_stages={v}"])
    cfg, mesh, compiled, _ = compile_step(cfg, jax.devices())
    return cfg, mesh, compiled


@pytest.mark.slow  # suite time (29 s a case; the compiled ticks' copies are checked by default, below)
@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1), ("gpipe", 1)])
def test_memory_flat_in_micro_batches_and_collectives_as_planned(schedule, v, repo_root, monkeypatch):
    monkeypatch.chdir(repo_root)
    temps = {}
    for gbs in (8, 32):  # m = 2 -> 8 at micro batch 2 on 2 data ranks
        cfg, mesh, compiled = _compile(schedule, v, gbs)
        temps[cfg.num_micro_batches] = compiled.memory_analysis().temp_size_in_bytes
        colls = hlo.parse(compiled.as_text(), dict(mesh.shape))
        data = [c for c in colls if c.kind == "all-reduce" and "data" in c.axes]
        # the data-parallel gradient reduction happens once per step, never inside the tick loop
        assert data and all(c.count == 1 and not c.in_conditional for c in data)
        permute = sum(c.bytes * c.count for c in colls if c.kind == "collective-permute")
        assert permute == permute_bytes_per_step(cfg)["bytes"]
    growth = temps[8] / temps[2]
    if schedule == "gpipe":
        assert growth > 2.0, temps  # GPipe stashes every micro batch
    else:
        assert growth < 1.15, temps


def _tick_conds(schedule: str, v: int, extra: tuple = ()) -> list:
    """The conditionals of the pipeline's ticks in the traced train step of the tiny preset on 2 stages: (the
    last name of each one's scope, the cond equation)."""
    import jax

    from megajax import audit, step as step_lib

    cfg = config_io.load("configs/tiny.yaml", [
        "parallel.data=1", "parallel.pipeline=2", "parallel.tensor=1", "train.micro_batch_size=1",
        "train.global_batch_size=4", f"parallel.schedule={schedule}", f"parallel.virtual_stages={v}", *extra])
    cfg, mesh, setup, state, batch = audit.abstract_step(cfg, jax.devices()[:2 * cfg.parallel.data])
    with jax.set_mesh(mesh):
        jaxpr = step_lib.jit_train_step(setup).trace(state, batch).jaxpr.jaxpr
    named = ((str(e.source_info.name_stack).split("/")[-1], e) for e in jaxpr_eqns(jaxpr))
    return [(name, e) for name, e in named if e.primitive.name == "cond" and name.startswith("pipeline_s")]


def _recompute_switches(schedule: str, v: int) -> list:
    """The recompute switches (lax.switch under a tick's `_r` scope) of the traced train step: (operands,
    results) counts."""
    return [(len(e.invars), len(e.outvars)) for name, e in _tick_conds(schedule, v) if name.endswith("_r")]


def test_the_recompute_does_not_hold_the_residuals_it_replaces():
    """A tick's recompute makes the residuals only the next tick's backward reads, after this tick's backward
    has read the old ones: its switch does not take them (a tick with nothing to recompute returns zeros), so
    XLA can reuse their buffer, one chunk's residuals less at the peak on GPUs
    (benchmarks/2026-11-27-compile-only-pipeline-residuals.md). zero_bubble's W reads them a tick later: its
    switch passes them on."""
    plain, split = _recompute_switches("1f1b", 1), _recompute_switches("zero_bubble", 1)
    assert plain and len(plain) == len(split)
    for (plain_in, out), (split_in, split_out) in zip(plain, split):
        assert out == split_out  # the residuals and the last chunk's output (LAST_KEEP's forward runs here)
        assert split_in == plain_in + out - 1


def _two_way_conds(schedule: str, v: int, extra: tuple = ()) -> list:
    """The two-way conditionals of the pipeline's ticks (name scopes pipeline_s*_b<i>, the backward's groups; _e1,
    the embedding's backward; _h1, the head; _g<i>, an idle tick's gather of i layers): (name scope, branches'
    jaxprs)."""
    return [(name, [b.jaxpr for b in e.params["branches"]]) for name, e in _tick_conds(schedule, v, extra)
            if re.fullmatch(r"pipeline_s\d+t\d_[behg]\d", name)]


@pytest.mark.parametrize("schedule,v,extra,groups", [
    ("1f1b", 1, (), {"b1", "e1", "h1"}), ("interleaved", 2, (), {"b1", "e1", "h1"}),
    ("zero_bubble", 1, (), {"b1", "e1", "h1"}),
    ("1f1b", 1, ("parallel.data=2", "train.global_batch_size=8", "parallel.distributed_optimizer=true",
                 "parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true"),
     {"b1", "b2", "e1", "h1", "g1"})])
def test_the_ticks_update_their_accumulators_in_place(schedule, v, extra, groups):
    """`executor.backward`: each group of backward kinds (adding to the accumulators; FINAL, reducing) runs under
    its own two-way conditional whose first branch makes zeros, whatever chunk position it runs, and what it adds
    goes to the layers' accumulators after it: no layer accumulator is a conditional's operand passed through
    (XLA's GPU compiler copied them: `test_the_compiled_ticks_copy_no_layer_gradients`). The first chunk's embedding
    backward runs under another, the head (`executor._tick`) under a third, each passing the shared weights'
    gradients through in its first branch; an idle tick's gather the same, one two-way conditional per layer count.
    The forward's switch takes neither the residuals nor g_shared: it returns the activation to send, the stash and
    the last chunk's output alone (benchmarks/2026-11-27-compile-only-pipeline-forward-in-place.md)."""
    conds = _two_way_conds(schedule, v, extra)
    assert {name.split("_")[-1] for name, _ in conds} == groups
    for name, branches in conds:
        assert len(branches) == 2, name
        # (the head's makes its zero loss and output gradient, the backward's its zeros; nothing else computes)
        assert not branches[0].eqns or name.endswith(("_h1", "_b1", "_b2")), name
        assert {e.primitive.name for e in branches[0].eqns} <= {"broadcast_in_dim", "pvary"}, name
        made = {v for e in branches[0].eqns for v in e.outvars}
        assert set(branches[0].outvars) <= set(branches[0].invars) | made, name
        if re.search(r"_b\d$", name):  # (zero_bubble's B passes on the taps' gradients it keeps for W)
            passed = [v for v in branches[0].outvars if v in set(branches[0].invars)]
            assert bool(passed) == (schedule == "zero_bubble"), name
    forwards = [e for name, e in _tick_conds(schedule, v, extra) if name.endswith("_f")]
    assert forwards
    if "g1" not in groups:  # (a forward that gathers also returns the gathered weights)
        assert all(len(e.outvars) <= 3 for e in forwards)  # (JAX forwards an output all branches pass)


def _accumulator_copies(schedule: str, v: int, extra: tuple = ()) -> tuple[list, list]:
    """(the copies of a rank's layer-gradient accumulators, f32 [v, Lc, ...] per weight, in the train step of the
    tiny preset on 2 stages compiled for 2 compile-only H100s, as (shape, pipeline switch) pairs; those shapes)."""
    import jax

    from megajax import audit

    cfg = config_io.load("configs/tiny.yaml", [
        "parallel.data=1", "parallel.pipeline=2", "parallel.tensor=1", "train.micro_batch_size=1",
        "train.global_batch_size=4", f"parallel.schedule={schedule}", f"parallel.virtual_stages={v}", *extra])
    cfg, _, compiled, setup = audit.compile_step(cfg, audit._gpu_devices("h100", 2 * cfg.parallel.data))
    staged = jax.tree.leaves(setup.abstract_state.params["layers"])  # [v, p, Lc, ...]
    shapes = {(a.shape[0], *a.shape[2:]) for a in staged if a.ndim > 3}
    copied = [(re.match(r"f32\[([\d,]*)\]", shape), scope) for scope, shape, _ in hlo.copies(compiled.as_text())]
    return [(m.group(1), scope) for m, scope in copied
            if m and tuple(int(d) for d in m.group(1).split(",") if d) in shapes], shapes


@pytest.mark.parametrize("schedule,v,extra", [
    ("interleaved", 2, ()),
    pytest.param("1f1b", 1, (), marks=pytest.mark.slow),
    pytest.param("zero_bubble", 1, (), marks=pytest.mark.slow),
    pytest.param("1f1b", 1, ("parallel.data=2", "train.global_batch_size=8", "parallel.distributed_optimizer=true",
                             "parallel.overlap_grad_reduce=true"), marks=pytest.mark.slow)])
def test_the_compiled_ticks_copy_no_layer_gradients(schedule, v, extra, repo_root, monkeypatch):
    """XLA's GPU program of a pipelined step copies none of a rank's fp32 layer-gradient accumulators: each tick's
    backward hands what it adds out of its conditional, and the tick adds it to the loop's carry in place
    (`executor.backward`). With the accumulators as the conditional's operands, passed through in one branch and
    updated in the other, XLA copied every one of them in one branch or the other, in every tick
    (benchmarks/2026-12-06-compile-only-accumulators-outside-conditionals.md). With the overlapped reduction, an
    idle tick's reduction into the reduced shards (X, one switch over its layer counts) still passes them through,
    and XLA copies them there: X runs in few ticks, and adding its shards after a conditional in every tick would
    move more than the copy."""
    monkeypatch.chdir(repo_root)
    copies, shapes = _accumulator_copies(schedule, v, extra)
    assert shapes and not [(shape, scope) for shape, scope in copies if not scope.endswith("_x")], copies


def test_evaluation_runs_through_the_pipeline_without_gathering_layers():
    ref, _ = evaluate(small_config(**ARCHS["gpt2"]), 1)
    got, colls = evaluate(small_config(**ARCHS["gpt2"], **layout("interleaved", 2, 2, 2, 2, True, mb=2)), 8)
    assert got == pytest.approx(ref, rel=1e-5)
    assert not [c for c in colls if c.kind == "all-gather" and "pipeline" in c.axes]
    assert [c for c in colls if c.kind == "collective-permute"], "activations move between stages"


def _grads(cfg, n):
    import jax

    from megajax.parallel import engines, step_plan
    from megajax.parallel.pipeline.layout import from_stages

    setup, state, batch = first_batch(cfg, n)
    cfg, mesh = setup.cfg, setup.mesh
    with jax.set_mesh(mesh):
        @jax.jit
        def grads(params, batch):
            with step_plan.use(setup.plan):
                return engines.compute_grads(setup, params, batch, jax.numpy.float32(1.0))[1]

        g = jax.device_get(grads(setup.variables(state), batch))
    return from_stages(g, cfg.stage_split) if cfg.parallel.pipeline > 1 else g


@pytest.mark.parametrize("schedule,v", [pytest.param("1f1b", 1, marks=pytest.mark.slow), ("zero_bubble", 2),
                                        # (test_layouts' default run trains 7 1F1B layouts, interleaved layouts and
                                        # zero_bubble layouts with v = 1 against one device)
                                        pytest.param("interleaved", 2, marks=pytest.mark.slow),
                                        pytest.param("zero_bubble", 1, marks=pytest.mark.slow)])
def test_pipeline_gradients_equal_plain_gradients(schedule, v):
    import jax

    ref = _grads(small_config(**ARCHS["llama"]), 1)
    got = _grads(small_config(**ARCHS["llama"], **layout(schedule, 2, v, 2, 2, True, mb=2)), 8)
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(ref))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * scale), got, ref)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_each_rank_reduces_and_gathers_its_layers_once_and_the_audit_counts_branches_as_run(schedule):
    """parallel.overlap_grad_reduce and overlap_param_gather on a pipeline, over the schedule space (p 2-8, v 1-3,
    m p-3p, 1-4 layers a chunk): each rank reduces each of its layers exactly once, after the layer's last
    backward: in idle ticks after its last backward (the x action, runs of layers that tile its v x Lc layers) or,
    with no idle tick after it, in the last backward of each chunk (FINAL); rank p - 1 always waits in the
    cool-down, rank 0 never does. The gathers mirror that: each layer once, before its first forward, in idle
    warm-up ticks (the g action) or each chunk's first forward (GATHER, never the last chunk's); rank p - 1 waits
    in the warm-up, rank 0 never does. With caps (parallel.overlap_comm_ratio), an idle tick takes at most that
    many layers and the rest go to the schedule's last tick (first for gathers). And `branch_runs` (how often the
    audit counts each branch of each switch) sums to one run per visit and runs the reductions and gathers as the
    plan has them."""
    from megajax.parallel.pipeline import ticks

    def tiled(first, count, ts, r):
        return sorted(np.concatenate([np.arange(first[t, r], first[t, r] + count[t, r]) for t in ts]))

    for p in range(2, 9):
        for v in ((1,) if schedule == "1f1b" else (2, 3)):
            for m in sorted({p, p + 1, 2 * p, 3 * p}):
                for lc, caps in itertools.product((1, 4), ((None, None), (1, 0))):
                    s, table, kinds, segments = ticks.plan(schedule, p, v, m, lc, lc, caps)
                    final = (kinds["b"] & ticks.FINAL) > 0
                    gather = (kinds["f"] & ticks.GATHER) > 0
                    busy = np.stack([kinds[a] > 0 for a in ("f", "r", "b", "w")]).any(0)
                    for r in range(p):
                        last = np.flatnonzero(table["b_chunk"][:, r] >= 0)[-1]
                        start = np.flatnonzero(table["f_chunk"][:, r] >= 0)[0]
                        xs, gs = np.flatnonzero(kinds["x"][:, r]), np.flatnonzero(kinds["g"][:, r])
                        if final[:, r].any():
                            assert not xs.size and final[:, r].sum() == v
                            for c in range(v):
                                assert final[np.flatnonzero(table["b_chunk"][:, r] == c)[-1], r]
                        else:
                            assert xs.size and xs.min() > last and not busy[xs, r].any()
                            assert tiled(table["x_first"], kinds["x"], xs, r) == list(range(v * lc))
                            if caps[0] is not None:  # at most cap a tick, the rest at the schedule's end
                                end = np.flatnonzero(busy.any(1))[-1]  # (rank 0's last backward)
                                assert (xs[kinds["x"][xs, r] > caps[0]] == end).all()
                        if gather[:, r].any():
                            assert not gs.size and gather[:, r].sum() == v
                            for c in range(v):
                                assert gather[np.flatnonzero(table["f_chunk"][:, r] == c)[0], r]
                            assert not np.isin(kinds["f"][gather[:, r], r] & ~ticks.GATHER,
                                               (ticks.LAST, ticks.LAST_KEEP)).any()
                        else:
                            assert gs.size and gs.max() < start and not busy[gs, r].any()
                            assert tiled(table["g_first"], kinds["g"], gs, r) == list(range(v * lc))
                            if caps[1] is not None:  # at most cap a tick, the rest at the schedule's start
                                assert (gs[kinds["g"][gs, r] > caps[1]] == 0).all()
                    assert final[:, 0].any() and not final[:, p - 1].any()
                    assert gather[:, 0].any() and not gather[:, p - 1].any()
                cfg = small_config(**{"model.num_layers": p * v * 4, "parallel.pipeline": p,
                                      "parallel.virtual_stages": v, "parallel.schedule": schedule,
                                      "parallel.data": 2, "parallel.overlap_grad_reduce": True,
                                      "parallel.distributed_optimizer": True, "parallel.overlap_param_gather": True,
                                      "train.global_batch_size": 2 * m, "train.micro_batch_size": 1})
                _, _, kinds, segments = ticks.plan(schedule, p, v, m, 4, 4)
                runs = ticks.branch_runs(StepPlan.resolve(cfg), cfg.model)
                assert all(abs(sum(f) - 1) < 1e-9 for f in runs.values())
                finals = layers = gathers = gathered = 0.0
                for i, seg in enumerate(segments):
                    step = 2 if seg.roles else 1
                    for t in range(step):
                        visits = len(range(seg.start + t, seg.stop, step))
                        scope = ticks.scope(i, t)
                        groups = (None, *ticks.backward_groups(seg.b))  # (the backward's: none, then each group)
                        finals += visits * sum(f for k, f in zip(groups, runs[f"{scope}_b"]) if k)
                        layers += visits * sum(k * f for k, f in zip(seg.x, runs[f"{scope}_x"]))
                        gathers += visits * sum(f for k, f in zip(seg.f, runs[f"{scope}_f"]) if k & ticks.GATHER)
                        gathered += visits * sum(k * f for k, f in zip(seg.g, runs[f"{scope}_g"]))
                ranks_final = ((kinds["b"] & ticks.FINAL) > 0).any(0).sum()
                ranks_gather = ((kinds["f"] & ticks.GATHER) > 0).any(0).sum()
                assert abs(finals - v * ranks_final / p) < 1e-9
                assert abs(gathers - v * ranks_gather / p) < 1e-9
                assert abs(gathered - v * 4 * (p - ranks_gather) / p) < 1e-9
                assert abs(layers - v * 4 * (p - ranks_final) / p) < 1e-9
