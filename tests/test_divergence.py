"""megajax.divergence finds a collective that ranks of its group may reach by different paths, and only those;
megajax.hlo.unordered_collectives finds where a compiled CPU program lets a device wait in two collectives at once;
a deadlock on CPU devices ends its process in seconds and names its collectives (the tests' XLA flags)."""

import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from megajax import divergence, hlo
from megajax.parallel import sharding, step_plan

from conftest import REPO, assert_collectives_ordered, cli_env, read_metrics


def _traced(body, axes=("pipeline", "data"), shape=(2, 2)):
    mesh = jax.make_mesh(shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes))
    f = jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes), axis_names=set(axes))
    return jax.jit(f).trace(jnp.ones((4, 3))).jaxpr


def _varying(x):
    return step_plan.vary(x, ("pipeline", "data"))


def test_a_collective_under_a_predicate_that_differs_over_its_group_is_found():
    def body(x):
        on = jax.lax.axis_index("pipeline") == 0
        return jax.lax.cond(on, lambda v: _varying(jax.lax.psum(v, "pipeline")), lambda v: v, x)

    found = divergence.check(_traced(body))
    assert [(d.collective, d.axes, d.predicate_axes) for d in found] == [("psum_invariant", ("pipeline",),
                                                                          ("pipeline",))]


def test_a_predicate_the_same_over_the_group_or_the_same_collectives_in_every_branch_pass():
    def over_another_axis(x):  # (the pipeline's conditionals: a rank's role, the data ranks' reductions)
        on = jax.lax.axis_index("pipeline") == 0
        return jax.lax.cond(on, lambda v: _varying(jax.lax.psum(v, "data")), lambda v: v, x)

    def in_both_branches(x):
        on = jax.lax.axis_index("pipeline") == 0
        return jax.lax.cond(on, lambda v: _varying(jax.lax.psum(v, "pipeline")),
                            lambda v: _varying(jax.lax.psum(2 * v, "pipeline")), x)

    def after_a_reduction(x):  # a predicate from a value summed over the group is the same on all its ranks
        on = jax.lax.psum(jnp.sum(x), "pipeline") > 0
        return jax.lax.cond(on, lambda v: _varying(jax.lax.psum(v, "pipeline")), lambda v: v, x)

    for body in (over_another_axis, in_both_branches, after_a_reduction):
        guarded = []
        assert divergence.check(_traced(body), guarded) == [], body.__name__
        assert guarded, body.__name__


def test_a_data_dependent_loop_around_a_collective_is_found():
    def body(x):
        def step(carry):
            i, v = carry
            return i + 1, _varying(jax.lax.psum(v, "data"))

        n = jax.lax.axis_index("data") + 1  # each data rank loops a different number of times
        return jax.lax.while_loop(lambda c: c[0] < n, step, (jnp.zeros((), jnp.int32), x))[1]

    assert [d.collective for d in divergence.check(_traced(body))] == ["psum_invariant"]


def test_the_cpu_order_gate_adds_no_divergence():
    """CollectiveOrder's gate reads the last collective's result (data, different on every rank) but keeps the
    predicate's value: the walk proves `last < -inf` false."""
    def body(x):
        order = sharding.CollectiveOrder()
        y = order.ppermute(x, "data", [(0, 1), (1, 0)])
        on = jax.lax.axis_index("pipeline") == 0
        return order.cond(on, lambda v: _varying(jax.lax.psum(v, "data")), lambda v: v, y)

    with step_plan.use(step_plan.StepPlan(platform="cpu")):
        jaxpr = _traced(body)
    assert "_after" in str(jaxpr)
    assert divergence.check(jaxpr) == []


# Two conditionals holding a collective each, neither reading the other's result: on XLA's CPU runtime the second
# may start while the first waits (hlo.unordered_collectives); CollectiveOrder orders them.
def _two_conditionals(ordered: bool):
    def body(x):
        order = sharding.CollectiveOrder()
        run = order.cond if ordered else jax.lax.cond
        on = jax.lax.axis_index("pipeline") == 0
        y = run(on, lambda v: _varying(jax.lax.psum(jnp.tanh(v), "data")), lambda v: v, x)
        z = run(on, lambda v: v, lambda v: _varying(jax.lax.psum(jnp.sin(v), "data")), x)
        return y + z

    mesh = jax.make_mesh((2, 2), ("pipeline", "data"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("pipeline", "data")), out_specs=P(("pipeline", "data"))))
    with step_plan.use(step_plan.StepPlan(platform="cpu")):
        return f.lower(jnp.ones((4, 3))).compile().as_text()


def test_unordered_collectives_are_found_and_ordered():
    assert [op.split(".")[0] for _, op, _ in hlo.unordered_collectives(_two_conditionals(False))] == ["conditional"]
    assert_collectives_ordered(_two_conditionals(True))


_DEADLOCK = """
import jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P

def step():
    mesh = jax.make_mesh((2,), ("pipeline",), axis_types=(jax.sharding.AxisType.Auto,))
    def body(x):  # only pipeline rank 0 enters the sum
        on = jax.lax.axis_index("pipeline") == 0
        return jax.lax.cond(on, lambda v: jax.lax.pcast(jax.lax.psum(v, "pipeline"), "pipeline", to="varying"),
                            lambda v: v, x)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("pipeline"), out_specs=P("pipeline")))
    f(jnp.ones(4)).block_until_ready()
"""


def _deadlock_env() -> dict:
    env = cli_env()  # the suite's XLA flags (conftest.WATCHDOG), with a shorter timeout to keep the test short
    env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=2 --xla_cpu_collective_call_terminate_timeout_seconds=5"
    return env


def test_a_deadlock_ends_in_seconds_naming_its_collective():
    """Ranks that wait in different collectives end the process within the collective timeout, XLA's message naming
    the collective still waiting and its devices."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _DEADLOCK + "step()"], cwd=REPO, env=_deadlock_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and time.monotonic() - start < 60
    assert "Termination timeout for `all reduce" in proc.stderr and "global_devices=[0, 1]" in proc.stderr


@pytest.mark.slow  # suite time (18 s; a deadlock ending in seconds, named, runs by default)
def test_a_deadlocked_test_fails_naming_its_layout(tmp_path):
    """Under pytest-xdist, as the suite runs, a test that deadlocks fails within the timeout and pytest names it,
    with its layout in the test's id (XLA's message goes to the worker's captured output, which pytest drops)."""
    (tmp_path / "test_deadlock.py").write_text(
        _DEADLOCK + '\n\nimport pytest\n\n\n@pytest.mark.parametrize("layout", ["the-layout-d1p2"])\n'
        'def test_step(layout):\n    step()\n')
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "1", "-p", "no:cacheprovider", "-o",
                           "addopts=", "test_deadlock.py"], cwd=tmp_path, env=_deadlock_env(),
                          capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and time.monotonic() - start < 90, out[-3000:]
    assert "crashed while running 'test_deadlock.py::test_step[the-layout-d1p2]'" in out, out[-3000:]


# The layout that hung on CPU devices before its pipeline ticks were ordered (CollectiveOrder), as a user ran it:
# the tiny preset with 8 layers, the interleaved schedule, tensor 2 and sequence parallelism on 4 devices, and
# the same at 8 devices with data 2, ZeRO-2 and the overlapped reduction. Each run is a fresh process (the hang
# came or not with each process's first step) that must train and equal one device.
HUNG = ["model.compute_dtype=float32", "model.num_layers=8", "train.global_batch_size=16", "train.micro_batch_size=2",
        "train.steps=2", "train.eval_every=0", "train.log_every=1", "checkpoint.every=0"]
HUNG_LAYOUTS = {
    "d1p2t2-sp-interleaved": (4, ["parallel.pipeline=2", "parallel.virtual_stages=2", "parallel.schedule=interleaved",
                                  "parallel.tensor=2", "parallel.sequence_parallel=true"]),
    "d2p2t2-sp-zero2-overlap-interleaved": (8, [
        "parallel.data=2", "parallel.pipeline=2", "parallel.virtual_stages=2", "parallel.schedule=interleaved",
        "parallel.tensor=2", "parallel.sequence_parallel=true", "parallel.data_parallel_sharding_strategy=optim_grads",
        "parallel.overlap_grad_reduce=true"]),
}
RUNS = 20


def _tiny_run(out_dir, devices: int, sets: list[str]) -> list[float]:
    env = cli_env()
    env["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={devices}"
    cmd = [sys.executable, "-m", "megajax.train", "--config", "configs/tiny.yaml", "--set",
           f"train.output_dir={out_dir}", *HUNG, *sets]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(sets)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return [rec["loss"] for _, rec in sorted(read_metrics(out_dir).items())]


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(HUNG_LAYOUTS))
def test_the_layout_that_hung_trains_in_every_run(layout, tmp_path):
    """RUNS fresh processes of `python -m megajax.train` on the layout, each equal to one device (fp32, 1e-4)."""
    reference = _tiny_run(tmp_path / "one", 1, [])
    devices, sets = HUNG_LAYOUTS[layout]
    for i in range(RUNS):
        np.testing.assert_allclose(_tiny_run(tmp_path / f"run{i}", devices, sets), reference, rtol=1e-4,
                                   err_msg=f"run {i}")
