"""Non-finite steps are skipped, never trained on; fp16 dynamic loss scaling backs off and grows."""

import jax
import jax.numpy as jnp
import numpy as np

from megajax import step as step_lib, train
from megajax.data.loader import build_datasets, global_batch

from conftest import read_metrics, small_config, train_cli


def _setup(cfg, steps=8):
    setup = step_lib.setup_for(cfg, jax.devices()[:1])
    cfg, mesh = setup.cfg, setup.mesh
    data = build_datasets(cfg, {"train": steps * cfg.train.global_batch_size})["train"]
    return cfg, mesh, setup, data


def test_non_finite_step_leaves_weights_and_optimizer_untouched():
    cfg, mesh, setup, data = _setup(small_config(**{"optim.warmup_steps": 4}))
    state = step_lib.init_state(setup)
    step_fn = step_lib.jit_train_step(setup)
    with jax.set_mesh(mesh):
        batch = global_batch(data, 0, cfg.train.global_batch_size, setup.batch_shardings)
        bad = {**batch, "loss_mask": batch["loss_mask"].at[0, 0].set(jnp.nan)}
        before = jax.device_get((state.params, state.opt_state))
        state, stats = step_fn(state, bad)
        assert not bool(stats["finite"]) and int(stats["bad_steps"]) == 1
        after = jax.device_get((state.params, state.opt_state))
        jax.tree.map(np.testing.assert_array_equal, before, after)
        # The logged learning rate is the one applied: the skipped step does not advance optax's schedule.
        _, good = step_fn(state, batch)
    lr = cfg.optim.lr / cfg.optim.warmup_steps  # warm-up step 0
    assert float(stats["lr"]) == float(good["lr"]) == np.float32(lr)


def test_fp16_loss_scale_backs_off_then_trains():
    cfg, mesh, setup, data = _setup(small_config(**{"model.compute_dtype": "float16",
                                                    "optim.initial_loss_scale": 2.0**40,
                                                    "optim.loss_scale_growth_interval": 3}), steps=30)
    state = step_lib.init_state(setup)
    step_fn = step_lib.jit_train_step(setup)
    scales, losses, finite = [], [], []
    with jax.set_mesh(mesh):
        for i in range(30):
            batch = global_batch(data, i * cfg.train.global_batch_size, cfg.train.global_batch_size,
                                 setup.batch_shardings)
            state, stats = step_fn(state, batch)
            scales.append(float(stats["loss_scale"]))
            losses.append(float(stats["loss"]))
            finite.append(bool(stats["finite"]))
    assert not finite[0] and scales[1] == scales[0] / 2, "2^40 overflows fp16 gradients: skip and halve"
    first_ok = finite.index(True)
    assert scales[first_ok] < 2.0**40 and int(state.bad_steps) == 0
    assert max(scales[first_ok:]) > scales[first_ok], "the scale grows again after good steps"
    ok_losses = [l for l, f in zip(losses, finite) if f]
    assert ok_losses[-1] < ok_losses[0]


def test_cli_stops_after_max_bad_steps_with_a_checkpoint(tmp_path):
    proc = train_cli(tmp_path, "train.steps=30", "optim.lr=1e30", "optim.warmup_steps=1", "train.max_bad_steps=3",
                     check=False)
    assert proc.returncode == 1
    assert "non-finite steps in a row (train.max_bad_steps=3)" in proc.stderr
    assert "skipped (weights unchanged" in proc.stdout
    assert (tmp_path / "checkpoints").exists() and any(p.name.isdigit() for p in (tmp_path / "checkpoints").iterdir())
    assert len(read_metrics(tmp_path)) < 30


def test_fp16_overflow_at_the_smallest_loss_scale_counts_as_a_bad_step():
    """An overflow with no loss scale left to back off to is a bad step (train.max_bad_steps stops the run),
    where an overflow above it is routine (skipped, scale halved, not counted)."""
    cfg, mesh, setup, data = _setup(small_config(**{"model.compute_dtype": "float16",
                                                    "optim.initial_loss_scale": 2.0**40}), steps=2)
    object.__setattr__(cfg.optim, "min_loss_scale", 2.0**40)  # a floor fp16 cannot hold (the config refuses it)
    state = step_lib.init_state(setup)
    with jax.set_mesh(mesh):
        batch = global_batch(data, 0, cfg.train.global_batch_size, setup.batch_shardings)
        state, stats = step_lib.jit_train_step(setup)(state, batch)
    assert not bool(stats["finite"]) and int(stats["bad_steps"]) == 1 and float(state.loss_scale) == 2.0**40


def test_fp16_loss_scale_beyond_float16_is_refused():
    import pytest

    from megajax.config import ConfigError

    with pytest.raises(ConfigError, match="beyond float16's range"):
        small_config(**{"model.compute_dtype": "float16", "optim.initial_loss_scale": 1e6,
                        "optim.min_loss_scale": 1e6})
    with pytest.raises(ConfigError, match="must be between 1 and optim.initial_loss_scale"):
        small_config(**{"optim.min_loss_scale": 1e3, "optim.initial_loss_scale": 1e2})


def test_health_log_names_the_loss_scale():
    """The log says what the loss scale is after an overflow, and why a step at the floor is bad."""
    lines = []

    class Log:
        def info(self, text):
            lines.append(text)

    cfg = small_config(**{"model.compute_dtype": "float16", "optim.min_loss_scale": 4.0,
                          "optim.initial_loss_scale": 64.0})
    train._check_health(cfg, 0, {"finite": False, "bad_steps": 0, "loss_scale": 64.0}, Log())
    train._check_health(cfg, 1, {"finite": False, "bad_steps": 1, "loss_scale": 4.0}, Log())
    assert lines[0] == "step 1: gradient overflow at loss scale 64: skipped, loss scale now 32"
    assert "smallest loss scale 4 (optim.min_loss_scale)" in lines[1] and "1 in a row" in lines[1]


def test_a_second_run_on_the_same_directory_is_refused_while_the_first_runs(tmp_path):
    """Two launches on one output directory: the second exits 2 naming the first (host, pid), writes nothing, and
    the first trains on; once it is gone (even killed -9) the directory is free again."""
    import os
    import signal
    import subprocess
    import sys

    from conftest import CLI_SMALL, REPO, cli_env

    cmd = [sys.executable, "-m", "megajax.train", "--config", "configs/tiny.yaml", "--set", *CLI_SMALL,
           f"train.output_dir={tmp_path}", "train.steps=100000"]
    first = subprocess.Popen(cmd, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in first.stdout:
            if line.startswith("step 2/"):
                break
        rows = (tmp_path / "metrics.jsonl").read_text()
        second = train_cli(tmp_path, "train.steps=4", check=False)
        assert second.returncode == 2, second.stderr[-2000:]
        last = second.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ") and "in use by another run" in last and f"pid {first.pid}" in last
        assert not list(tmp_path.glob("checkpoints/*")) and (tmp_path / "metrics.jsonl").read_text().startswith(rows)
        assert first.poll() is None, "the first run trains on"
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    from megajax import runlock

    with runlock.hold(tmp_path):  # the kernel dropped the dead run's lock
        assert f"pid {os.getpid()}" in (tmp_path / runlock.LOCK_FILE).read_text()
