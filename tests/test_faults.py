"""Non-finite steps are skipped, never trained on; fp16 dynamic loss scaling backs off and grows."""

import jax
import jax.numpy as jnp
import numpy as np

from megajax import train
from megajax.data.loader import build_datasets, global_batch

from conftest import read_metrics, small_config, train_cli


def _setup(cfg, steps=8):
    setup = train.setup_for(cfg, jax.devices()[:1])
    cfg, mesh = setup.cfg, setup.mesh
    data = build_datasets(cfg, {"train": steps * cfg.train.global_batch_size})["train"]
    return cfg, mesh, setup, data


def test_non_finite_step_leaves_weights_and_optimizer_untouched():
    cfg, mesh, setup, data = _setup(small_config(**{"optim.warmup_steps": 4}))
    state = train.init_state(setup)
    step_fn = train.jit_train_step(setup)
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
    state = train.init_state(setup)
    step_fn = train.jit_train_step(setup)
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
