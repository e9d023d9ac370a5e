"""The real entry point, `python -m megajax.train`, end to end."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, cli_env, read_metrics, train_cli

KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "tflops_per_device", "mfu", "consumed_samples",
        "data_wait_s"}


def test_tiny_trains_logs_and_evaluates(tmp_path):
    proc = train_cli(tmp_path, "train.steps=40", "train.log_every=5", "train.eval_every=20", "train.eval_batches=2",
                     "optim.lr=3e-3", "train.log_update_norm=true")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 8 and "eta" in lines[0] and "MFU" in lines[0] and "TFLOP/s/dev" in lines[0]
    assert "eval at step 20: loss" in proc.stdout and "ppl" in proc.stdout
    records = read_metrics(tmp_path)
    assert KEYS | {"param_norm", "update_norm"} <= set(records[5]) and records[40]["consumed_samples"] == 40 * 8
    assert 0 < records[5]["update_norm"] < records[5]["param_norm"]
    assert records[40]["loss"] < records[5]["loss"] - 1.0, "the loss goes down"
    assert all(0 < r["mfu"] < 1 for r in records.values())
    evals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line]
    assert [e["step"] for e in evals] == [20, 40] and evals[1]["eval_loss"] < evals[0]["eval_loss"]
    events = read_events(next((tmp_path / "tensorboard").glob("events.out.tfevents.*")))
    assert events[0].file_version == "brain.Event:2"
    by_step = {e.step: {v.tag: v.simple_value for v in e.summary.value} for e in events[1:] if "loss" in
               {v.tag for v in e.summary.value}}
    assert sorted(by_step) == sorted(records) and by_step[40]["loss"] == pytest.approx(records[40]["loss"], rel=1e-6)
    assert (tmp_path / "checkpoints" / "40").is_dir()


def read_events(path) -> list:
    """The Event protocol buffers of a TensorBoard event file, each record's length and data checked against
    their masked CRC-32Cs (tensorboardX's protos decode them)."""
    import struct

    from tensorboardX.proto import event_pb2

    from megajax.metrics import _masked_crc

    data, pos, out = Path(path).read_bytes(), 0, []
    while pos < len(data):
        head = data[pos:pos + 8]
        (n,), (crc_n,) = struct.unpack("<Q", head), struct.unpack("<I", data[pos + 8:pos + 12])
        record, (crc,) = data[pos + 12:pos + 12 + n], struct.unpack("<I", data[pos + 12 + n:pos + 16 + n])
        assert crc_n == _masked_crc(head) and crc == _masked_crc(record), "a damaged TFRecord frame"
        out.append(event_pb2.Event.FromString(record))
        pos += 16 + n
    return out


def test_tensorboard_events_frame_as_tensorboardx_does(tmp_path):
    """The same scalars through tensorboardX's writer (the reference TensorBoard reads) and megajax's: the same
    events, and both files' frames pass the same CRC check."""
    from tensorboardX import SummaryWriter

    from megajax.metrics import TensorBoardEvents

    ref = SummaryWriter(str(tmp_path / "ref"))
    ours = TensorBoardEvents(tmp_path / "ours")
    for step, values in ((1, {"loss": 10.5, "lr": 3e-4}), (2, {"loss": 9.25, "lr": 6e-4})):
        for k, v in values.items():
            ref.add_scalar(k, v, step)
        ours.scalars(values, step)
    ref.close()
    ours.close()

    def scalars(d):
        events = read_events(next(Path(d).glob("events.out.tfevents.*")))
        return sorted((e.step, v.tag, v.simple_value) for e in events for v in e.summary.value)

    assert scalars(tmp_path / "ours") == scalars(tmp_path / "ref")


@pytest.mark.slow  # suite time (69 s): the layout matrix runs d2 x t4 by default
def test_eight_devices_match_one_device_for_10_steps(tmp_path):
    """The documented multi-device command (docs/features/parallelism.md): data 2 x tensor 4 with sequence parallelism, tiny preset, fp32."""
    full = ["train.steps=10", "train.log_every=1", "train.eval_every=0", "checkpoint.every=0"]

    def run(out, devices, *sets):
        env = cli_env(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
        cmd = [sys.executable, "-m", "megajax.train", "--config", "configs/tiny.yaml", "--set", *full,
               f"train.output_dir={out}", *sets]
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        return read_metrics(out)

    one = run(tmp_path / "one", 1)
    eight = run(tmp_path / "eight", 8, "parallel.data=2", "parallel.tensor=4", "parallel.sequence_parallel=true")
    assert sorted(one) == sorted(eight) == list(range(1, 11))
    for step in one:
        assert eight[step]["loss"] == pytest.approx(one[step]["loss"], rel=1e-4), step


@pytest.mark.parametrize("sets, needle", [
    (["model.num_layer=3"], "unknown config key 'model.num_layer'"),
    (["parallel.tensor=3"], "not divisible by parallel.tensor=3"),
    (["parallel.data=2"], "there are 1 devices: set parallel.data=1"),
    (["data.paths=[/nonexistent/prefix]"], "/nonexistent/prefix"),
])
def test_bad_input_fails_before_compiling_with_the_fix(tmp_path, sets, needle):
    proc = train_cli(tmp_path / "run", *sets, check=False)
    assert proc.returncode == 2
    assert needle in proc.stderr and "Traceback" not in proc.stderr
    assert "compiled" not in proc.stdout
    assert not (tmp_path / "run").exists(), "nothing is written for a run that cannot start"


CUDA_NOISE = ("cudart_stub", "absl::InitializeLog", "Could not find cuda drivers")


def test_a_short_run_warns_of_warm_up_and_a_finished_run_says_so(tmp_path):
    """Without an NVIDIA driver the CUDA plugin's probes print nothing; steps that end inside the warm-up get a
    warning; rerunning a finished run trains nothing, compiles nothing and says how to go on."""
    first = train_cli(tmp_path, "train.steps=1", "optim.warmup_steps=4")
    assert "train.steps=1 ends before optim.warmup_steps=4" in first.stdout
    again = train_cli(tmp_path, "train.steps=1", "optim.warmup_steps=4")
    assert "has finished: its checkpoint is at step 1 of train.steps=1" in again.stdout
    assert "--set train.steps=2" in again.stdout and "compiled" not in again.stdout
    for proc in (first, again):
        assert not any(noise in proc.stderr + proc.stdout for noise in CUDA_NOISE), proc.stderr[:2000]


def _wandb_records(run_file) -> list:
    """The records of a W&B run file (what `wandb sync` uploads): a 7-byte header, then LevelDB log blocks of
    32 KiB whose chunks are crc (4), length (2), type (1: whole, 2: first, 3: middle, 4: last) and data."""
    from wandb.proto import wandb_internal_pb2

    raw = open(run_file, "rb").read()
    assert raw[:4] == b":W&B"
    pos, block, records, parts = 7, 32768, [], b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(raw[pos + 4:pos + 6], "little"), raw[pos + 6]
        if kind == 0:
            break
        parts += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(parts)
            records.append(rec)
            parts = b""
    return records


def test_weights_and_biases_gets_the_metrics_and_a_resume_continues_its_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the wandb extra (also in the test extra)")
    from megajax.metrics import MetricsLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    train_cli(run, "train.steps=2", "train.wandb_project=megajax-test", "train.wandb_exp_name=tiny-wandb")
    (run_file,) = run.glob("wandb/offline-run-*/run-*.wandb")
    records = _wandb_records(run_file)
    (info,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert info.project == "megajax-test" and info.display_name == "tiny-wandb"
    assert info.run_id == (run / "wandb_run_id").read_text().strip()
    config = {item.key: json.loads(item.value_json) for item in info.config.update}
    assert config["model"]["hidden_size"] == 64
    history = [{"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item} | {
        "step": r.history.step.num} for r in records if r.WhichOneof("record_type") == "history"]
    logged = read_metrics(run)
    assert [h["step"] for h in history] == [1, 2]
    assert [h["loss"] for h in history] == pytest.approx([logged[s]["loss"] for s in (1, 2)])

    # the resumed run (a new process, here a new logger on the same output_dir) logs to the same W&B run
    log = MetricsLogger(run, wandb=dict(project="megajax-test", name=None, config={}))
    log.log({"step": 3, "loss": 1.5})
    log.close()
    runs = sorted(run.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 2 and runs[0].name == runs[1].name


def test_wandb_missing_is_an_error_that_names_the_extra(monkeypatch, tmp_path):
    from megajax import metrics
    from megajax.config import ConfigError

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[wandb\]'"):
        metrics.MetricsLogger(tmp_path, wandb=dict(project="p", name=None, config={}))
