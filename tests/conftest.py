"""8 fake CPU devices (a 2x2x2 mesh), fast CPU compiles and megajax's XLA flags for every test; set before JAX
starts.

Tests compile the same programs many times (the one-device references, the init of a model, every CLI run
of the small preset), so the session shares JAX's persistent compilation cache, in a fresh directory per
session (what a fresh clone gets: nothing carried over from earlier runs); subprocesses inherit it.
"""

import functools
import os
import tempfile

from megajax import xla_flags  # noqa: E402  (imports no jax)

# Tests compile far more than they run: LLVM at -O0 builds the CPU programs about a third faster (three layout and
# pipeline tests: 74 s -> 47 s), computing the same things; the CLI subprocesses get it too (`cli_env`).
FAST_COMPILE = "--xla_backend_optimization_level=0"
# A deadlock (ranks waiting in different collectives) ends its process after this many seconds instead of XLA's 40,
# with XLA's message naming each collective still waiting and its devices (after 5 s, who has not arrived);
# pytest-xdist then names the test, whose id names the layout. A CPU step's collectives wait for the slowest device
# by well under a second in these tests. The CLI subprocesses get it too (`cli_env`).
WATCHDOG = ("--xla_cpu_collective_call_terminate_timeout_seconds=20 "
            "--xla_cpu_collective_call_warn_stuck_timeout_seconds=5")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 " + WATCHDOG
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + FAST_COMPILE
xla_flags.install()  # the GPU flags train and audit run with: the compile-only GPU tests see them too
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="megajax-test-jit-cache-"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

from megajax import quiet  # noqa: E402

quiet.import_jax()  # without the CUDA-driver probe lines where there is no NVIDIA driver
import jax  # noqa: E402
import pytest  # noqa: E402

from megajax import config as config_lib  # noqa: E402
from megajax.config import io as config_io

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gpu_available() -> bool:
    from megajax import audit

    try:
        audit._gpu_devices("h100", 8)
        return True
    except Exception:
        return False


# compile-only H100s need the gpu-audit extra (jax-cuda12-plugin); without it the GPU-target tests skip
gpu = pytest.mark.skipif(not _gpu_available(), reason="jax-cuda12-plugin (the gpu-audit extra) is not installed")


def small_config(**overrides) -> config_lib.Config:
    """A 2-layer model small enough to compile and step in seconds on CPU."""
    base = {
        "model.num_layers": 2, "model.hidden_size": 64, "model.num_heads": 4, "model.vocab_size": 257,
        "model.seq_length": 32, "train.global_batch_size": 8, "train.steps": 4, "optim.warmup_steps": 1,
        "optim.lr": 1e-3,
    }
    base.update(overrides)
    return config_io.override(config_lib.Config(), base)


def shared_across_workers(fn):
    """Memoizes a test helper that returns JSON data (one-device reference losses) for the whole test session:
    per process, and with pytest-xdist across its workers, through a file per argument tuple under a directory of
    the run (the first worker to ask computes while the others wait on its lock), so no reference runs twice."""
    import fcntl
    import hashlib
    import json

    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    root = os.path.join(tempfile.gettempdir(), f"megajax-test-shared-{run}") if run else None

    def freeze(x):
        return tuple(freeze(v) for v in x) if isinstance(x, list) else x

    @functools.lru_cache(maxsize=None)
    def memo(*args):
        if root is None:
            return fn(*args)
        os.makedirs(root, exist_ok=True)
        key = hashlib.sha256(repr((fn.__module__, fn.__qualname__, args)).encode()).hexdigest()[:24]
        path = os.path.join(root, key + ".json")
        with open(path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if os.path.exists(path):
                with open(path) as f:
                    return freeze(json.load(f))
            out = fn(*args)
            with open(path + ".tmp", "w") as f:
                json.dump(out, f, default=float)  # (NumPy scalars)
            os.replace(path + ".tmp", path)
            return out

    return functools.wraps(fn)(memo)


@functools.lru_cache(maxsize=8)
def initial_params(model_cfg: config_lib.ModelConfig, seed: int):
    """The parameters step_lib.init_state draws from `seed` (canonical layout, NumPy), drawn once per model:
    layouts of one model start from these instead of each compiling its own random init (that init is
    the same on every layout: tests/test_model.py)."""
    import flax.linen as nn

    from megajax import model

    return jax.device_get(jax.jit(lambda key: nn.unbox(model.init_params(model_cfg, key)))(jax.random.key(seed)))


def run_steps(cfg: config_lib.Config, num_devices: int, steps: int, *, return_state: bool = False,
              grad_norms: list | None = None, stats: list | None = None):
    """Trains `steps` steps on the first `num_devices` devices in this process; returns the losses
    (and appends each step's gradient norm to `grad_norms`, and its statistics as floats to `stats`, if given).
    Each layout's compiled program passes `assert_collectives_ordered`."""
    from megajax import step as step_lib
    from megajax.data.loader import build_datasets, global_batch

    setup = step_lib.setup_for(cfg, jax.devices()[:num_devices])
    cfg, mesh = setup.cfg, setup.mesh
    state = step_lib.init_state(setup, initial_params(cfg.model, cfg.train.seed))
    data = build_datasets(cfg, {"train": steps * cfg.train.global_batch_size})["train"]
    losses = []
    with jax.set_mesh(mesh):
        for i in range(steps):
            batch = global_batch(data, i * cfg.train.global_batch_size, cfg.train.global_batch_size,
                                 setup.batch_shardings)
            if i == 0:  # (with delayed FP8 scaling, the first step's program and the later steps')
                step_fn = step_lib.compile_train_step(setup, state, batch)
                for program in step_fn.programs[:steps]:
                    assert_collectives_ordered(program.as_text())
            state, out = step_fn(state, batch)
            losses.append(float(out["loss"]))
            if grad_norms is not None:
                grad_norms.append(float(out["grad_norm"]))
            if stats is not None:
                stats.append({k: float(v) for k, v in out.items() if getattr(v, "ndim", None) == 0})
    return (losses, state, setup) if return_state else losses


def assert_collectives_ordered(hlo_text: str) -> None:
    """No device of the compiled CPU program can wait in two collectives at once (megajax.hlo.unordered_collectives:
    on 2 cores such waits starve each other's threads and the step hangs)."""
    from megajax import hlo

    unordered = hlo.unordered_collectives(hlo_text)
    assert not unordered, f"collectives a device may wait in at once (computation, op, next op): {unordered[:5]}"


def first_batch(cfg: config_lib.Config, num_devices: int):
    """(the step's setup on `num_devices`, a fresh train state, the first global batch of the bundled data placed
    as the step takes it)."""
    from megajax import step as step_lib
    from megajax.data.loader import build_datasets, global_batch

    setup = step_lib.setup_for(cfg, jax.devices()[:num_devices])
    state = step_lib.init_state(setup)
    data = build_datasets(setup.cfg, {"train": 16})["train"]
    with jax.set_mesh(setup.mesh):
        return setup, state, global_batch(data, 0, setup.cfg.train.global_batch_size, setup.batch_shardings)


def evaluate(cfg: config_lib.Config, num_devices: int):
    """The eval step's mean token loss on the first global batch of fresh weights, and its compiled program's
    collectives (megajax.hlo)."""
    from megajax import hlo, step as step_lib

    setup, state, batch = first_batch(cfg, num_devices)
    mesh = setup.mesh
    with jax.set_mesh(mesh):
        step = step_lib.jit_eval_step(setup)
        total, count = step(state, batch)
        text = step.lower(state, batch).compile().as_text()
    return float(total) / float(count), hlo.parse(text, dict(mesh.shape))


def jaxpr_eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs its equations hold (megajax.divergence.eqns)."""
    from megajax import divergence

    return divergence.eqns(jaxpr)


@pytest.fixture(scope="session")
def repo_root() -> str:
    return REPO


# A small model for runs of the real entry point (python -m megajax.train) in subprocesses.
CLI_SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4", "model.seq_length=64",
             "train.global_batch_size=8", "train.log_every=1", "train.eval_every=0", "optim.warmup_steps=2"]


def cli_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
    env.update({"JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}, **extra)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {FAST_COMPILE} {WATCHDOG}".strip()
    return env


def train_cli(out_dir, *sets, devices: int = 1, timeout: int = 300, check: bool = True):
    """Runs `python -m megajax.train --config configs/tiny.yaml --set ...` and returns the process."""
    import subprocess
    import sys

    env = cli_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    cmd = [sys.executable, "-m", "megajax.train", "--config", "configs/tiny.yaml", "--set", *CLI_SMALL,
           f"train.output_dir={out_dir}", *sets]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def read_metrics(out_dir) -> dict[int, dict]:
    """The logged records by step (a resumed run's lines replace the earlier ones)."""
    import json

    out = {}
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "loss" in rec:
                out[rec["step"]] = rec
    return out
