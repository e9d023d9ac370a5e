"""Global batches: the same samples on every layout and after a restart, each row read once per process,
prefetching that changes nothing but the wait, and two processes each reading only their own rows."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from megajax.config import ParallelConfig
from megajax.data.indexed import IndexedDatasetWriter
from megajax.data.loader import BatchLoader, build_datasets, global_batch
from megajax.parallel import sharding

from conftest import REPO, small_config

GBS = 8
LAYOUTS = [(8, 1), (2, 4), (4, 2), (1, 8)]  # (data, tensor)


class CountingSplit:
    """A Split that counts which samples were read."""

    def __init__(self, split):
        self.split, self.reads = split, []

    def __getattr__(self, name):
        return getattr(self.split, name)

    def __len__(self):
        return len(self.split)

    def __getitem__(self, i):
        self.reads.append(i)
        return self.split[i]


@pytest.fixture(scope="module")
def train_split(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    cfg = small_config(**{"data.cache_dir": str(cache), "data.eod_mask_loss": True})
    return build_datasets(cfg, {"train": 20 * GBS})["train"]


def shardings_for(data, tensor):
    mesh = sharding.make_mesh(ParallelConfig(data=data, tensor=tensor), jax.devices())
    return {k: NamedSharding(mesh, P("data")) for k in ("tokens", "targets", "loss_mask", "sample_ids")}


def host(batch):
    return {k: np.asarray(v) for k, v in batch.items()}


def test_batches_depend_only_on_consumed_samples(train_split):
    """Every layout, with or without prefetching, from the start or resumed at k: the same batches."""
    reference = None
    for data, tensor in LAYOUTS:
        shard = shardings_for(data, tensor)
        with BatchLoader(train_split, GBS, shard, 0, 6 * GBS, prefetch=2) as loader:
            run = [host(b) for b in loader]
        assert len(run) == 6
        if reference is None:
            reference = run
            s = train_split.seq_length
            for k, batch in enumerate(run):
                samples = np.stack([train_split[k * GBS + r] for r in range(GBS)])
                np.testing.assert_array_equal(batch["tokens"], samples[:, :s])
                np.testing.assert_array_equal(batch["targets"], samples[:, 1:])
                np.testing.assert_array_equal(batch["sample_ids"], np.arange(k * GBS, (k + 1) * GBS))
                np.testing.assert_array_equal(batch["loss_mask"], (batch["tokens"] != 256).astype(np.float32))
        for a, b in zip(reference, run):
            for k in a:
                np.testing.assert_array_equal(a[k], b[k])
        with BatchLoader(train_split, GBS, shard, 3 * GBS, 6 * GBS, prefetch=0) as resumed:
            for a, b in zip(reference[3:], resumed):
                for k in a:
                    np.testing.assert_array_equal(a[k], host(b)[k])


def test_eod_mask_loss(train_split):
    """data.eod_mask_loss: no loss where the input token is the end-of-document id (Megatron's rule)."""
    first = next(i for i in range(len(train_split)) if 256 in train_split[i][:-1])
    batch = host(global_batch(train_split, first, GBS, shardings_for(8, 1)))
    at = batch["tokens"][0] == 256
    assert at.any() and (batch["loss_mask"][0][at] == 0).all() and (batch["loss_mask"][0][~at] == 1).all()


def test_each_row_is_read_once(train_split):
    """With tensor parallelism a row lives on several devices; the process still reads it once."""
    counting = CountingSplit(train_split)
    batch = global_batch(counting, 5 * GBS, GBS, shardings_for(2, 4))
    assert sorted(counting.reads) == list(range(5 * GBS, 6 * GBS))
    assert np.asarray(batch["sample_ids"]).tolist() == list(range(5 * GBS, 6 * GBS))


def test_loader_reports_errors_and_stops(train_split):
    shard = shardings_for(8, 1)
    with BatchLoader(train_split, GBS, shard, len(train_split) - GBS, None, prefetch=2) as loader:
        assert len(list(loader)) == 1  # the last full batch, then StopIteration
    broken = CountingSplit(train_split)
    broken.__class__ = type("Broken", (CountingSplit,), {"__getitem__": lambda self, i: 1 / 0})
    with BatchLoader(broken, GBS, shard, 0, 4 * GBS, prefetch=2) as loader:
        with pytest.raises(ZeroDivisionError):
            next(loader)
        with pytest.raises(ZeroDivisionError):
            next(loader)


_WORKER = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    pid, port, cache = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, pid)
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P
    from megajax import config
    from megajax.config import io as config_io
    from megajax.parallel import sharding
    from megajax.data.loader import BatchLoader, build_datasets, host_rows
    sys.path.insert(0, "tests")
    from test_data_loader import CountingSplit
    cfg = config_io.override(config.Config(), {"model.vocab_size": 257, "model.seq_length": 16,
                                            "data.cache_dir": cache})
    split = CountingSplit(build_datasets(cfg, {"train": 64})["train"])
    mesh = sharding.make_mesh(config.ParallelConfig(data=4, tensor=2), jax.devices())
    shard = {k: NamedSharding(mesh, P("data")) for k in ("tokens", "targets", "loss_mask", "sample_ids")}
    with BatchLoader(split, 8, shard, 16, 24, prefetch=1) as loader:
        batch = next(loader)
    full = host_rows(split.split, 16, range(8))
    gathered = {k: multihost_utils.process_allgather(v, tiled=True) for k, v in batch.items()}
    print(json.dumps({"reads": sorted(split.reads), "global_ok": all(
        np.array_equal(gathered[k], full[k]) for k in full)}))
""")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_read_only_their_rows(tmp_path):
    """2 processes x 4 CPU devices, data=4 x tensor=2: each reads its 4 rows of the 8, and the global
    batch they build together is the single-process batch."""
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(i), port, str(tmp_path / "cache")], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert all(r["global_ok"] for r in results)
    reads = [r["reads"] for r in results]
    assert sorted(reads[0] + reads[1]) == list(range(16, 24)) and len(reads[0]) == len(reads[1]) == 4


@pytest.mark.slow
def test_resume_on_another_layout_matches_uninterrupted(tmp_path):
    """Train 4 steps on data=4 x tensor=2 (checkpoint at 2); drop the step-4 checkpoint and resume on
    data=2 x tensor=4 with sequence parallelism: steps 3 and 4 see the same batches, hence the same
    losses."""
    import shutil

    from megajax import train
    from megajax.config import io as config_io

    base = {"train.steps": 4, "train.log_every": 1, "checkpoint.every": 2, "checkpoint.async": False,
            "train.output_dir": str(tmp_path / "run"), "data.cache_dir": str(tmp_path / "cache")}
    first = small_config(**base, **{"parallel.data": 4, "parallel.tensor": 2})
    train.run(first)
    losses = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    losses = {r["step"]: r["loss"] for r in losses if "loss" in r}
    assert all("data_wait_s" in json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")
               if '"loss"' in line)
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "4")
    os.rename(tmp_path / "run" / "metrics.jsonl", tmp_path / "first.jsonl")
    second = config_io.override(first, {"parallel.data": 2, "parallel.tensor": 4,
                                         "parallel.sequence_parallel": True})
    summary = train.run(second)
    assert summary["steps_run"] == 2
    resumed = {r["step"]: r["loss"] for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "loss" in r}
    assert sorted(resumed) == [3, 4]
    np.testing.assert_allclose([resumed[3], resumed[4]], [losses[3], losses[4]], rtol=1e-4)


def test_importing_megajax_data_does_not_import_jax():
    code = "import sys, megajax.data; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_batches_from_a_user_dataset(tmp_path):
    """A prefix from data.paths goes through the same loader."""
    prefix = str(tmp_path / "u")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for i in range(40):
            w.add_document(np.arange(i, i + 50) % 250)
    cfg = small_config(**{"data.paths": [prefix], "data.split": "1"})
    split = build_datasets(cfg, {"train": 16})["train"]
    batch = host(global_batch(split, 8, GBS, shardings_for(4, 2)))
    assert batch["tokens"].shape == (GBS, 32) and (batch["targets"][:, :-1] == batch["tokens"][:, 1:]).all()
    assert os.path.isdir(tmp_path / "cache" / "megajax_indices"), "indices are cached next to the data"
