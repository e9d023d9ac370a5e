"""scripts/slurm.sbatch on a real one-node SLURM (scripts/slurm_local.sh: slurmctld, slurmd and munge on this
machine), with two CPU tasks: every way SLURM delivers SIGTERM makes both tasks save one checkpoint and the job
end COMPLETED with exit 0, and submitting the same command again resumes from it. -m slow (about a minute per
case); skipped where SLURM cannot be started (not root, no slurm-wlm and no package registry)."""

import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from conftest import CLI_SMALL, REPO, cli_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slurm():
    if os.geteuid() != 0 and not shutil.which("sbatch"):
        pytest.skip("SLURM is not installed and scripts/slurm_local.sh needs root")
    proc = subprocess.run(["bash", "scripts/slurm_local.sh"], cwd=REPO, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.skip(f"no local SLURM: {proc.stderr[-500:]}")


def _env() -> dict:
    env = cli_env()
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # the tasks' `python`
    return env


def _submit(out_dir, log, *sets) -> str:
    cmd = ["sbatch", "--parsable", "--ntasks-per-node=2", "--cpus-per-task=1", "--gpus-per-node=0",
           f"--chdir={REPO}", f"--output={log}", "scripts/slurm.sbatch", "configs/tiny.yaml", *CLI_SMALL,
           "parallel.data=2", "train.log_every=2", f"train.output_dir={out_dir}", *sets]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, check=True)
    return proc.stdout.strip().split(";")[0]


def _job(job: str) -> dict:
    text = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S+)", text))


def _wait(job: str, timeout: float = 240) -> dict:
    end = time.time() + timeout
    while time.time() < end:
        info = _job(job)
        if info.get("JobState") not in ("PENDING", "RUNNING", "COMPLETING", None):
            return info
        time.sleep(1)
    subprocess.run(["scancel", job])
    raise AssertionError(f"job {job} still running after {timeout} s")


def _wait_for_step(log, step: int, timeout: float = 180):
    end = time.time() + timeout
    while time.time() < end:
        if os.path.exists(log) and re.search(rf"step {step}/", open(log).read()):
            return
        time.sleep(0.5)
    raise AssertionError(f"no step {step} in {log}:\n{open(log).read()[-3000:] if os.path.exists(log) else ''}")


@pytest.mark.parametrize("how", [
    ["--signal=TERM"],            # the tasks only (also what --signal=TERM@300 in the script does)
    ["--signal=TERM", "--full"],  # every step and the batch shell
    ["--signal=TERM", "--batch"],  # the batch shell only (as sbatch --signal=B:TERM)
], ids=["tasks", "full", "batch"])
def test_sigterm_saves_and_the_job_completes_then_resumes(slurm, tmp_path, how):
    run, log = tmp_path / "run", str(tmp_path / "job.out")
    job = _submit(run, log, "train.steps=100000", "checkpoint.every=100000")
    _wait_for_step(log, 4)
    subprocess.run(["scancel", *how, job], check=True)
    info = _wait(job)
    text = open(log).read()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text[-3000:])
    stopped = re.search(r"stopping after step (\d+) \(SIGTERM\): checkpoint saved", text)
    assert stopped, text[-3000:]
    step = int(stopped.group(1))
    assert os.listdir(run / "checkpoints") == [str(step)]

    log2 = str(tmp_path / "job2.out")
    info = _wait(_submit(run, log2, f"train.steps={step + 2}", "checkpoint.every=100000"))
    text = open(log2).read()
    assert info["JobState"] == "COMPLETED", text[-3000:]
    assert f"step {step}" in text and "resumed from" in text and f"step {step + 2}/{step + 2}" in text, text[-3000:]


def test_a_hung_task_is_named_and_the_job_restarts(slurm, tmp_path):
    """MEGAJAX_RESTARTS=1: task 1 stalls (train.debug_stall), the watchdogs end the tasks past train.hang_exit_s,
    the batch script names the process behind from the heartbeats and runs the tasks again on the node still up;
    the run resumes from its newest checkpoint and completes."""
    run, log = tmp_path / "run", str(tmp_path / "job.out")
    cmd = ["sbatch", "--parsable", "--export=ALL,MEGAJAX_RESTARTS=1", "--ntasks-per-node=2", "--cpus-per-task=1",
           "--gpus-per-node=0", f"--chdir={REPO}", f"--output={log}", "scripts/slurm.sbatch", "configs/tiny.yaml",
           *CLI_SMALL, "parallel.data=2", f"train.output_dir={run}", "train.steps=8", "checkpoint.every=2",
           "train.debug_stall=1@5", "train.hang_report_s=3", "train.hang_exit_s=8"]
    job = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, check=True).stdout.strip()
    info = _wait(job.split(";")[0], timeout=300)
    text = open(log).read()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", (info, text[-3000:])
    # srun returns the highest status: 86 from the watchdog, or the peer's abort (134) once the coordination
    # service has seen the first one go
    assert re.search(r"slurm\.sbatch: the tasks ended with (86|134); behind: process 1 in the batch of step 5", text), \
        text[-3000:]
    assert "slurm.sbatch: restart 1 of 1 on 1 node(s)" in text and "resumed from" in text
    assert "step 8/8" in text
