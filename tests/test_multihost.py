"""Several processes on 127.0.0.1 (scripts/launch_local.sh, CPU collectives): same losses as one process,
checkpoints move between process counts, and a dead process never leaves the others hanging."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import CLI_SMALL, REPO, cli_env, read_metrics, train_cli

# decay_steps fixed: the runs below stop at different train.steps, and the schedule must not change with it
LAYOUT = ["parallel.data=2", "parallel.tensor=4", "parallel.sequence_parallel=true", "checkpoint.every=2",
          "optim.decay_steps=8"]


def launch(out_dir, *sets, n=2, d=4, timeout=300):
    cmd = ["bash", "scripts/launch_local.sh", "-n", str(n), "-d", str(d), "--", sys.executable, "-m",
           "megajax.train", "--config", "configs/tiny.yaml", "--set", *CLI_SMALL, f"train.output_dir={out_dir}",
           *sets]
    proc = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


@pytest.mark.parametrize("back_to_two", [False, pytest.param(True, marks=pytest.mark.slow)])  # suite time
def test_processes_match_one_process_and_checkpoints_move_between_them(tmp_path, back_to_two):
    steps = 8 if back_to_two else 6
    ref = read_metrics(train_cli(tmp_path / "ref", f"train.steps={steps}", *LAYOUT, devices=8) and tmp_path / "ref")
    run = tmp_path / "run"
    two = launch(run, "train.steps=4", *LAYOUT)  # 2 processes x 4 devices, steps 1-4
    assert "[0] step 4/4" in two.stdout and "[1] step" not in two.stdout, "only process 0 logs"
    one = train_cli(run, "train.steps=6", *LAYOUT, devices=8)  # 1 process x 8 devices resumes at 4
    assert "resumed from" in one.stdout and "step 4" in one.stdout
    if back_to_two:
        again = launch(run, "train.steps=8", *LAYOUT)  # and back to 2 processes at 6
        assert "[0] resumed from" in again.stdout
    got = read_metrics(run)
    assert sorted(got) == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        assert got[step]["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5), step


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.mark.parametrize("victim", [pytest.param(1, marks=pytest.mark.slow), 0])  # the coordinator by default
def test_a_dead_process_stops_the_others(tmp_path, victim):
    """Without a launcher: kill -9 one process; the other exits with an error within the heartbeat timeout."""
    port = _free_port()
    procs = []
    for i in range(2):
        env = cli_env(MEGAJAX_COORDINATOR=f"127.0.0.1:{port}", MEGAJAX_NUM_PROCESSES="2",
                      MEGAJAX_PROCESS_ID=str(i), MEGAJAX_CPU_DEVICES="2", MEGAJAX_HEARTBEAT_TIMEOUT_S="10")
        cmd = [sys.executable, "-m", "megajax.train", "--config", "configs/tiny.yaml", "--set", *CLI_SMALL,
               f"train.output_dir={tmp_path}", "train.steps=100000", "parallel.data=4"]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL,
                                      stderr=subprocess.STDOUT, text=True))
    for line in procs[0].stdout:
        if line.startswith("step 3/"):
            break
    procs[victim].kill()
    start = time.time()
    survivor = procs[1 - victim]
    try:
        code = survivor.wait(timeout=120)
    finally:
        for p in procs:
            p.kill()
    assert code != 0
    assert time.time() - start < 60, "the survivor notices within the heartbeat timeout (10 s here)"


@pytest.mark.slow  # suite time (19 s; a dead process stopping the others runs by default)
def test_launcher_kills_the_rest_when_one_fails(tmp_path):
    cmd = ["bash", "scripts/launch_local.sh", "-n", "2", "-d", "2", "--", sys.executable, "-m", "megajax.train",
           "--config", "configs/tiny.yaml", "--set", *CLI_SMALL, f"train.output_dir={tmp_path}",
           "train.steps=100000", "parallel.data=4"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=cli_env(MEGAJAX_LAUNCH_GRACE="3"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    for line in proc.stdout:
        if line.startswith("[0] step 3/"):
            break
    out = subprocess.run(["pgrep", "-f", f"output_dir={tmp_path}"], capture_output=True, text=True).stdout.split()
    victims = [int(pid) for pid in out if int(pid) != proc.pid]
    assert victims
    os.kill(max(victims), signal.SIGKILL)
    start = time.time()
    try:
        rest = proc.stdout.read()
        code = proc.wait(timeout=60)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    assert code == 128 + signal.SIGKILL and time.time() - start < 30, (code, rest[-2000:])
    assert "exited with 137: stopping the others" in rest
    left = subprocess.run(["pgrep", "-f", f"output_dir={tmp_path}"], capture_output=True, text=True).stdout.split()
    assert not [pid for pid in left if int(pid) != os.getpid()], "no process left behind"


@pytest.mark.slow  # suite time (17 s; test_checkpoint's signal save runs by default)
def test_sigterm_to_the_launcher_saves_one_checkpoint_and_keeps_the_output(tmp_path):
    """SIGTERM to scripts/launch_local.sh (as SLURM or a terminal sends it): passed on to both processes, which
    agree on a step, save one checkpoint and exit 0; the launcher waits for them, keeps their output, exits 0."""
    cmd = ["bash", "scripts/launch_local.sh", "-n", "2", "-d", "2", "--", sys.executable, "-m", "megajax.train",
           "--config", "configs/tiny.yaml", "--set", *CLI_SMALL, f"train.output_dir={tmp_path}",
           "train.steps=100000", "parallel.data=4", "train.log_every=2"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("[0] step 4/"):
                proc.send_signal(signal.SIGTERM)
                break
        rest = proc.stdout.read()
        code = proc.wait(timeout=120)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    assert code == 0, rest[-3000:]
    assert "[launcher] SIGTERM: passing it on" in rest and "[0] stopping after step" in rest
    step = int(rest.split("[0] stopping after step ")[1].split()[0])
    assert sorted(os.listdir(tmp_path / "checkpoints")) == [str(step)]


@pytest.mark.slow  # two processes until a signal (about 30 s)
def test_sigterm_to_one_process_stops_every_process_at_the_same_step(tmp_path):
    """SIGTERM to process 1 alone: the processes agree at the next log step, save one checkpoint together and
    both exit 0 (decided per process, process 0 would train on while 1 waits in the save)."""
    port = _free_port()
    procs = []
    for i in range(2):
        env = cli_env(MEGAJAX_COORDINATOR=f"127.0.0.1:{port}", MEGAJAX_NUM_PROCESSES="2",
                      MEGAJAX_PROCESS_ID=str(i), MEGAJAX_CPU_DEVICES="2")
        cmd = [sys.executable, "-m", "megajax.train", "--config", "configs/tiny.yaml", "--set", *CLI_SMALL,
               f"train.output_dir={tmp_path}", "train.steps=100000", "parallel.data=4", "train.log_every=2"]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL,
                                      stderr=subprocess.STDOUT, text=True))
    out = []
    try:
        for line in procs[0].stdout:
            out.append(line)
            if line.startswith("step 4/"):
                procs[1].send_signal(signal.SIGTERM)
                break
        out += procs[0].stdout.readlines()
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    text = "".join(out)
    assert codes == [0, 0], text[-3000:]
    stopped = [line for line in out if line.startswith("stopping after step")]
    assert len(stopped) == 1 and "a stop request on another process" in stopped[0], text[-3000:]
    step = int(stopped[0].split()[3])
    assert step % 2 == 0 and sorted(os.listdir(tmp_path / "checkpoints")) == [str(step)]


@pytest.mark.parametrize("env, want", [
    ({"SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_NODEID": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}, None),
    ({"SLURM_STEP_TASKS_PER_NODE": "1(x4)", "SLURM_NODEID": "3", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}, [0, 1, 2, 3]),
    ({"SLURM_TASKS_PER_NODE": "2,1", "SLURM_NODEID": "1", "SLURM_GPUS_ON_NODE": "8"}, list(range(8))),
    ({"SLURM_TASKS_PER_NODE": "2,1", "SLURM_NODEID": "0", "SLURM_GPUS_ON_NODE": "8"}, None),
])
def test_slurm_one_task_per_node_uses_every_gpu_of_the_node(env, want):
    """JAX binds a SLURM task to the GPU of SLURM_LOCALID; with one task per node that would be GPU 0 alone."""
    from megajax.distributed import slurm_local_device_ids

    assert slurm_local_device_ids(env) == want
