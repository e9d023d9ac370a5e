"""8 fake CPU devices (a 2x2x2 mesh) for every test; set before JAX starts."""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import pytest  # noqa: E402

from megajax import config as config_lib  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_config(**overrides) -> config_lib.Config:
    """A 2-layer model small enough to compile and step in seconds on CPU."""
    base = {
        "model.num_layers": 2, "model.hidden_size": 64, "model.num_heads": 4, "model.vocab_size": 257,
        "model.seq_length": 32, "train.global_batch_size": 8, "train.steps": 4, "optim.warmup_steps": 1,
        "optim.lr": 1e-3,
    }
    base.update(overrides)
    return config_lib.override(config_lib.Config(), base)


def run_steps(cfg: config_lib.Config, num_devices: int, steps: int, *, return_state: bool = False):
    """Trains `steps` steps on the first `num_devices` devices in this process; returns the losses."""
    from megajax import sharding, train
    from megajax.data.loader import build_datasets, global_batch

    cfg = cfg.for_devices(num_devices)
    mesh = sharding.make_mesh(cfg.parallel, jax.devices()[:num_devices])
    setup = train.build(cfg, mesh)
    state = train.init_state(setup)
    data = build_datasets(cfg, {"train": steps * cfg.train.global_batch_size})["train"]
    step_fn = train.jit_train_step(setup)
    losses = []
    with jax.set_mesh(mesh):
        for i in range(steps):
            batch = global_batch(data, i * cfg.train.global_batch_size, cfg.train.global_batch_size,
                                 setup.batch_shardings)
            state, stats = step_fn(state, batch)
            losses.append(float(stats["loss"]))
    return (losses, state, setup) if return_state else losses


@pytest.fixture(scope="session")
def repo_root() -> str:
    return REPO
