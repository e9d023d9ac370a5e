"""Runs that last weeks: the goodput ledger, the watchdog that names the process behind, the same samples in the
same order across layouts, and a restart on fewer processes that picks its own layout (real processes on CPU
devices: kill -9, SIGSTOP, a stall)."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from megajax import goodput, step as step_lib, train, watchdog
from megajax.config import ConfigError
from megajax.config import io as config_io
from megajax.data.loader import build_datasets, global_batch
from megajax.plan import elastic

from conftest import CLI_SMALL, REPO, cli_env, read_metrics, small_config, train_cli


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def test_ledger_counts_every_second_once_and_the_account_spans_attempts(tmp_path, capsys):
    clock = Clock()
    first = goodput.Ledger(start=990.0, clock=clock)  # 10 s of start-up before the first switch
    first.attach(tmp_path, attempt=990_000, process=0, processes=2)
    for kind, seconds in [("compile", 5), ("data", 1), ("step", 20), ("checkpoint", 2), ("step", 10)]:
        first.switch(kind)
        clock.t += seconds
    first.completed(7)
    first.write()  # then kill -9: nothing more is written
    assert sum(first.totals().values()) == pytest.approx(clock.t - 990.0)
    assert first.metrics()["goodput"] == pytest.approx(30 / 48)

    clock.t += 12  # the restart's wait
    second = goodput.Ledger(start=clock.t, clock=clock)
    second.attach(tmp_path, attempt=int(clock.t * 1000), process=0, processes=1)
    assert second.redo_until == 7, "steps up to the last one written were trained before"
    second.resumed_at(4)
    clock.t += 3
    for step in range(5, 10):  # 5-7 again (recomputed), 8-9 new
        second.training(step)
        clock.t += 2
        second.completed(step)
    second.switch("other")
    second.write()
    acct = goodput.account(tmp_path)
    assert [r["first_step"] for r in acct["attempts"]] == [None, 4]
    assert acct["total"]["down"] == pytest.approx(12)
    assert acct["total"]["recomputed"] == pytest.approx(6) and acct["total"]["step"] == pytest.approx(34)
    assert acct["accounted_s"] == pytest.approx(acct["wall_s"]) == pytest.approx(clock.t - 990.0)
    assert goodput.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "over 2 attempt(s)" in out and f"goodput (training steps / wall time) {34 / (clock.t - 990):.1%}" in out
    assert goodput.main([str(tmp_path / "nothing")]) == 2


def test_a_written_ledger_adds_up_to_its_own_span_on_a_moving_clock(tmp_path):
    """The record's seconds and its `written` come from one clock reading: on a clock that moves at every read, the
    seconds still add up to written - start exactly (two readings left them apart by the time between them)."""
    class Ticking(Clock):
        def __call__(self):
            self.t += 0.125
            return self.t

    ledger = goodput.Ledger(start=1000.0, clock=Ticking())
    ledger.attach(tmp_path, attempt=1, process=0)
    for kind in ("compile", "step", "checkpoint"):
        ledger.switch(kind)
    ledger.write()
    (record,) = goodput.read_ledgers(tmp_path)
    assert sum(record["seconds"].values()) == record["written"] - record["start"]
    acct = goodput.account(tmp_path)
    assert acct["accounted_s"] == acct["wall_s"]


def _beat(process, step, kind, t, attempt=1, open_s=30.0):
    return {"process": process, "attempt": attempt, "pid": 100 + process, "host": "h", "time": t, "kind": kind,
            "open_s": open_s, "step": step, "first_step": 0}


def test_behind_names_the_stopped_process_then_the_one_furthest_back():
    stopped = [_beat(0, 5, "step", 100.0), _beat(1, 4, "data", 60.0), _beat(2, 5, "step", 100.0)]
    assert watchdog.behind(stopped).startswith("behind: process 1 (last heard 40 s before the others")
    slow_data = [_beat(0, 5, "step", 100.0), _beat(1, 4, "data", 99.5), _beat(2, 5, "step", 99.8)]
    line = watchdog.behind(slow_data)
    assert line.startswith("behind: process 1 in the batch of step 5") and "process 0" in line
    same_step = [_beat(0, 4, "step", 100.0), _beat(1, 4, "data", 100.0)]
    assert watchdog.behind(same_step).startswith("behind: process 1 in the batch of step 5")
    together = [_beat(0, 4, "checkpoint", 100.0), _beat(1, 4, "checkpoint", 100.0)]
    assert watchdog.behind(together).startswith("no process is behind the others: all 2 are in checkpoint after step 4")
    old_attempt = [_beat(0, 9, "step", 100.0, attempt=2), _beat(1, 3, "step", 20.0, attempt=1)]
    assert watchdog.behind(old_attempt).startswith("no process is behind"), "a lost process's old file is ignored"


def test_watchdog_command_reads_a_progress_dir(tmp_path, capsys):
    (tmp_path / "process-0.json").write_text(json.dumps(_beat(0, 5, "step", 100.0)))
    (tmp_path / "process-1.json").write_text(json.dumps(_beat(1, 4, "data", 99.0)))
    assert watchdog.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("behind: process 1 in the batch of step 5")
    assert watchdog.main([str(tmp_path / "nothing")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_watchdog_reports_a_stall_once_with_the_stacks(tmp_path, capfd):
    ledger = goodput.Ledger(start=time.time())
    lines = []
    dog = watchdog.Watchdog(ledger, tmp_path, process=0, report_s=0.5, log=lines.append)
    ledger.completed(3)
    ledger.training(4)
    time.sleep(0.6)
    for _ in range(3):
        dog.check(dog.beat())
    assert len([line for line in lines if "has been in step 4" in line]) == 1, lines
    assert "Python stacks" in lines[0] and lines[1].startswith("watchdog: no process is behind the others: all 1")
    assert "test_watchdog_reports_a_stall_once_with_the_stacks" in capfd.readouterr().err, "this thread's stack"
    assert json.loads((tmp_path / "process-0.json").read_text())["kind"] == "step"
    ledger.switch("compile")  # compiling (or starting) is never a stall
    time.sleep(0.6)
    dog.reported = None
    dog.check(dog.beat())
    assert len(lines) == 2


def test_elastic_takes_the_planners_layout_for_the_devices_left():
    cfg = config_io.load("configs/tiny.yaml", ["parallel.data=2", "parallel.tensor=4", "train.micro_batch_size=2"])
    assert elastic.fits(cfg, 8) and not elastic.fits(cfg, 4)
    new, line = elastic.refit(cfg, 4, 4, "cpu")
    p = new.parallel
    assert p.data * p.pipeline * p.context * p.tensor == 4 and elastic.fits(new, 4)
    assert new.train.global_batch_size == cfg.train.global_batch_size and new.model == cfg.model
    assert line.startswith("train.elastic: 4 devices where the layout (data=2 pipeline=1 context=1 tensor=4)")
    assert "planned as H100s" in line and elastic.target_for("NVIDIA H200")[0] == "h200"


def test_debug_stall_key_is_checked():
    assert small_config(**{"train.debug_stall": "1@5:2.5"}).train.stall() == (1, 5, 2.5)
    assert small_config(**{"train.debug_stall": "0@3"}).train.stall() == (0, 3, float("inf"))
    with pytest.raises(ConfigError, match="PROCESS@STEP"):
        small_config(**{"train.debug_stall": "process 1"})


# Every layout of 8 devices the batch can be split over (data x pipeline x context x tensor, micro batches): the
# global batch of each step holds the same samples, row for row (the loader reads by samples consumed, never by
# rank). A resumed run on any of them therefore sees the uninterrupted run's batches.
ORDER_LAYOUTS = [
    {}, {"parallel.data": 2, "parallel.tensor": 4, "parallel.sequence_parallel": True},
    {"parallel.data": 4, "parallel.pipeline": 2, "train.micro_batch_size": 1},
    {"parallel.data": 2, "parallel.context": 2, "parallel.tensor": 2},
    {"parallel.data": 1, "parallel.pipeline": 4, "parallel.tensor": 2, "model.num_layers": 4,
     "train.micro_batch_size": 2},
    {"parallel.data": 8, "train.micro_batch_size": 1},
    {"parallel.data": 8, "parallel.expert": 2, "model.num_experts": 4, "train.micro_batch_size": 1},
    {"parallel.data": 4, "parallel.tensor": 2, "parallel.data_parallel_sharding_strategy": "optim_grads_params"},
]


def test_every_layout_reads_the_same_samples_for_each_step():
    seen = []
    for layout in ORDER_LAYOUTS:
        setup = step_lib.setup_for(small_config(**{"parallel.data": None, **layout}))
        split = build_datasets(setup.cfg, {"train": 3 * 8})["train"]
        batches = [jax.device_get(global_batch(split, 8 * k, 8, setup.batch_shardings)) for k in range(3)]
        seen.append(batches)
    for layout, batches in zip(ORDER_LAYOUTS[1:], seen[1:]):
        for k, (got, want) in enumerate(zip(batches, seen[0])):
            np.testing.assert_array_equal(got["sample_ids"], np.arange(8 * k, 8 * k + 8), err_msg=str(layout))
            for name in ("tokens", "targets", "loss_mask"):
                np.testing.assert_array_equal(got[name], want[name], err_msg=f"{layout} {name}")


def test_a_resumed_run_keeps_its_indices_and_carries_samples_over_a_new_global_batch():
    lines = []
    log = type("Log", (), {"info": lambda self, line: lines.append(line)})()
    cfg = small_config(**{"train.steps": 10})
    meta = {"step": 4, "config": {"train": {"steps": 20, "global_batch_size": 8}}}
    assert train._train_samples(cfg, meta, 32, log) == 160 and not lines, "built for what the checkpoint's run asked"
    wider = small_config(**{"train.steps": 10, "train.global_batch_size": 16})
    assert train._train_samples(wider, meta, 32, log) == 160  # 32 + 6 x 16 = 128 needed
    assert lines[0].startswith("train.global_batch_size changed from 8 to 16: the run goes on at sample 32")
    longer = small_config(**{"train.steps": 40})
    assert train._train_samples(longer, meta, 32, log) == 32 + 36 * 8
    assert lines[-1].startswith("note: the run now needs 320 training samples, more than the 160")
    assert train._train_samples(cfg, {}, 0, log) == 80


# decay_steps fixed: the runs below stop at different train.steps, and the schedule must not change with it
HOPS = [["parallel.data=8"],
        ["parallel.data=2", "parallel.tensor=4", "parallel.sequence_parallel=true"],
        ["parallel.data=4", "parallel.pipeline=2", "train.micro_batch_size=1"],
        ["parallel.data=2", "parallel.context=2", "parallel.tensor=2"],
        ["parallel.data=4", "parallel.tensor=2", "train.micro_batch_size=1"]]


@pytest.mark.slow  # five resumes, each a compile (about 90 s)
def test_resumed_on_other_layouts_the_run_sees_the_same_samples_in_the_same_order(tmp_path):
    """Data, tensor (with SP), pipeline, context and micro batch size changed at every resume: the losses are the
    uninterrupted run's (fp32)."""
    common = ["checkpoint.every=2", "optim.decay_steps=10"]
    ref = read_metrics(train_cli(tmp_path / "ref", "train.steps=10", *common, *HOPS[0], devices=8) and tmp_path / "ref")
    for i, hop in enumerate(HOPS):
        train_cli(tmp_path / "run", f"train.steps={2 * (i + 1)}", *common, *hop, devices=8)
    got = read_metrics(tmp_path / "run")
    assert sorted(got) == list(range(1, 11))
    for step in range(1, 11):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5), step


def _launch(out_dir, *sets, n=2, d=4, restarts=0, extra_env=None):
    cmd = ["bash", "scripts/launch_local.sh", "-n", str(n), "-d", str(d), "--restarts", str(restarts), "--",
           sys.executable, "-m", "megajax.train", "--config", "configs/tiny.yaml", "--set", *CLI_SMALL,
           f"train.output_dir={out_dir}", *sets]
    return subprocess.Popen(cmd, cwd=REPO, env=cli_env(**(extra_env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _pid_of(out_dir, process: int) -> int:
    for pid in subprocess.run(["pgrep", "-f", f"output_dir={out_dir}"], capture_output=True, text=True).stdout.split():
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
        if f"MEGAJAX_PROCESS_ID={process}".encode() in env and b"megajax.train" in cmdline:
            return int(pid)
    raise AssertionError(f"no process {process} of {out_dir}")


def _until(proc, text: str, out: list) -> None:
    for line in proc.stdout:
        out.append(line)
        if line.startswith(text):
            return
    raise AssertionError("".join(out)[-4000:])


def _finish(proc, out: list, timeout=300) -> int:
    try:
        out += proc.stdout.readlines()
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_stalled_process_is_named_by_the_watchdog_and_the_launcher(tmp_path):
    """train.debug_stall holds process 1 before step 4's batch: both watchdogs report (with their Python stacks)
    that process 1 is behind, end their processes past train.hang_exit_s, and the launcher names process 1."""
    proc = _launch(tmp_path, "train.steps=50", "parallel.data=4", "train.debug_stall=1@4", "train.hang_report_s=3",
                   "train.hang_exit_s=8", d=2)
    out = []
    code = _finish(proc, out, timeout=240)
    text = "".join(out)
    assert code == watchdog.HANG_EXIT, text[-4000:]
    assert "[0] watchdog: process 0 has been in step 4" in text and "Its Python stacks" in text
    assert "[0] watchdog: behind: process 1 in the batch of step 4" in text
    assert 'in _loop' in text, "the stacks name the loop's frame"
    assert "[launcher] behind: process 1 in the batch of step 4" in text


@pytest.mark.slow  # the heartbeat timeout ends the job (about 60 s)
def test_a_stopped_process_is_named_when_the_job_ends(tmp_path):
    """SIGSTOP freezes process 1 (its watchdog too): the coordination service ends process 0 after the heartbeat
    timeout, and the launcher says process 1 stopped answering."""
    proc = _launch(tmp_path, "train.steps=100000", "parallel.data=4", d=2,
                   extra_env={"MEGAJAX_HEARTBEAT_TIMEOUT_S": "15", "MEGAJAX_LAUNCH_GRACE": "3"})
    out = []
    _until(proc, "[0] step 4/", out)
    victim = _pid_of(tmp_path, 1)
    os.kill(victim, signal.SIGSTOP)
    try:
        code = _finish(proc, out, timeout=180)
    finally:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass
    text = "".join(out)
    assert code != 0
    assert "[launcher] behind: process 1 (last heard" in text and "stopped or hung outside Python" in text, text[-3000:]


TEARDOWN_S = 2.0


@pytest.mark.slow  # suite time (55 s a case): the default run has the watchdogs and the launcher name a stalled process
@pytest.mark.parametrize("second_restart", [False, True])
def test_a_lost_process_restarts_on_the_ones_left_and_the_run_goes_on(tmp_path, second_restart):
    """2 processes x 4 devices (data 2 x tensor 4); kill -9 process 1 after step 5: the launcher starts the job
    again on 1 x 4, the run takes the planner's layout for 4 devices, resumes from its newest checkpoint and its
    losses are the uninterrupted run's. With a second restart (a hang the watchdog ends), the ledger over the three
    attempts adds up to the wall time within 2% and the last process's teardown."""
    steps = 12 if second_restart else 10
    layout = ["parallel.data=2", "parallel.tensor=4", "parallel.sequence_parallel=true", "checkpoint.every=2",
              f"optim.decay_steps={steps}"]
    ref = read_metrics(train_cli(tmp_path / "ref", f"train.steps={steps}", *layout, devices=8) and tmp_path / "ref")
    run = tmp_path / "run"
    hang = ["train.debug_stall=0@9", "train.hang_exit_s=10", "train.hang_report_s=5"] if second_restart else []
    t0 = time.time()
    proc = _launch(run, f"train.steps={steps}", *layout, "train.elastic=true", *hang, restarts=2)
    out = []
    _until(proc, "[0] step 5/", out)
    os.kill(_pid_of(run, 1), signal.SIGKILL)
    code = _finish(proc, out)
    wall = time.time() - t0
    text = "".join(out)
    assert code == 0, text[-4000:]
    assert "[launcher] restart 1 of 2: a process was lost; starting 1 process(es) of 4 devices" in text
    assert "[0] train.elastic: 4 devices where the layout (data=2 pipeline=1 context=1 tensor=4)" in text
    if second_restart:
        assert "[launcher] restart 2 of 2: a process hung; starting 1 process(es)" in text
    got = read_metrics(run)
    assert sorted(got) == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5), step
    acct = goodput.account(run)
    assert len(acct["attempts"]) == (3 if second_restart else 2)
    assert [r["processes"] for r in acct["attempts"]][:2] == [2, 1]
    assert acct["total"]["down"] > 0 and acct["total"]["step"] > 0
    assert acct["accounted_s"] == pytest.approx(acct["wall_s"], rel=1e-6)
    # (the last process's interpreter teardown after its ledger's last write, which no ledger can record: 0.7 s on an
    # idle 2-core machine, up to 1.6 s with the suite beside it)
    assert acct["wall_s"] == pytest.approx(wall, abs=0.02 * wall + TEARDOWN_S), (acct["wall_s"], wall)
    last = [json.loads(line) for line in open(run / "metrics.jsonl") if '"goodput"' in line][-1]
    assert 0 < last["goodput"] < 1 and last["time_step_s"] > 0


def test_the_default_stall_threshold_follows_the_steps_and_allows_for_evaluations_and_saves(tmp_path):
    clock = Clock()
    ledger = goodput.Ledger(start=clock.t, clock=clock)
    dog = watchdog.Watchdog(ledger, tmp_path, process=0, eval_batches=20)
    assert dog.threshold("step") == watchdog.MIN_REPORT_S, "no step yet"
    for step in range(1, 6):
        ledger.training(step)
        clock.t += 30.0
    ledger.switch("data")
    assert dog.threshold("step") == 300.0 and dog.threshold("data") == 300.0
    assert dog.threshold("eval") == 6000.0 and dog.threshold("checkpoint") == watchdog.MIN_CHECKPOINT_S
    assert watchdog.Watchdog(ledger, tmp_path, process=0, report_s=5).threshold("eval") == 5
