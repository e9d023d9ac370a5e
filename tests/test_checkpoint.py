"""Checkpoints: resume is bitwise, restore reshards onto other layouts, crashes never damage old steps."""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from megajax import checkpoint, step as step_lib, train
from megajax.config import io as config_io

from conftest import CLI_SMALL, REPO, cli_env, read_metrics, train_cli


def test_resume_after_kill_is_bitwise(tmp_path):
    """20 steps straight == 10 steps, kill -9, rerun the same command to 20 (CPU: bitwise)."""
    sets = ["train.steps=20", "checkpoint.every=5"]
    train_cli(tmp_path / "a", *sets)
    b = tmp_path / "b"
    cmd = [sys.executable, "-m", "megajax.train", "--config", "configs/tiny.yaml", "--set", *CLI_SMALL,
           f"train.output_dir={b}", *sets]
    proc = subprocess.Popen(cmd, cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline:
        if (b / "metrics.jsonl").exists() and '"step": 12,' in (b / "metrics.jsonl").read_text():
            break
        time.sleep(0.1)
    proc.kill()
    proc.wait()
    assert 12 <= len(read_metrics(b)) < 20, "the first run should have been killed part way"
    rerun = train_cli(b, *sets)
    assert "resumed from" in rerun.stdout and "step 10" in rerun.stdout
    a_loss = {s: r["loss"] for s, r in read_metrics(tmp_path / "a").items()}
    b_loss = {s: r["loss"] for s, r in read_metrics(b).items()}
    assert a_loss == b_loss


def _run(out, steps, layout):
    cfg = config_io.load("configs/tiny.yaml", [
        "model.num_layers=4", "model.hidden_size=64", "model.seq_length=64", "train.global_batch_size=16",
        "train.micro_batch_size=2", "train.log_every=1", "train.eval_every=0", "checkpoint.every=3",
        f"train.output_dir={out}", f"train.steps={steps}", *layout])
    train.run(cfg)
    return {s: r["loss"] for s, r in read_metrics(out).items()}


D8 = ["parallel.data=8"]
PAIRS = {
    "pipeline2-zero1-to-pipeline1": (["parallel.data=2", "parallel.pipeline=2", "parallel.tensor=2",
                                      "parallel.distributed_optimizer=true"], D8),
    "interleaved-sp-to-pipeline4": (["parallel.data=2", "parallel.pipeline=2", "parallel.tensor=2",
                                     "parallel.schedule=interleaved", "parallel.virtual_stages=2",
                                     "parallel.sequence_parallel=true"],
                                    ["parallel.data=1", "parallel.pipeline=4", "parallel.tensor=2"]),
    # the distributed optimizer sharded over data x context (Megatron's data-parallel group with context parallelism)
    "context2-zero1-to-data8": (["parallel.data=2", "parallel.context=2", "parallel.tensor=2",
                                 "parallel.distributed_optimizer=true"], D8),
    # onto the distributed optimizer with each weight kept as its shard between steps (overlap_param_gather)
    "tensor4-sp-to-data8-zero1-gather": (["parallel.data=2", "parallel.tensor=4", "parallel.sequence_parallel=true"],
                                         ["parallel.data=8", "parallel.distributed_optimizer=true",
                                          "parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true"]),
}


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("ref"), 9, D8)


# every pair runs with -m slow (suite time: 46 s for the tensor pair with its reference run). By default the weights
# and moments move exactly between layouts in test_fsdp_weights_move_between_layouts_and_data_sizes and
# test_uneven_pipeline_stages_move_to_even_stages_and_no_pipeline, and a resumed run continues bit for bit in
# test_resume_after_kill_is_bitwise (a pipeline with the distributed optimizer resumed without one: test_fp8.py's
# delayed-scaling checkpoint test)
@pytest.mark.slow
@pytest.mark.parametrize("pair", list(PAIRS))
def test_restore_onto_another_layout_continues_the_same_run(pair, tmp_path, reference_losses):
    first, second = PAIRS[pair]
    _run(tmp_path, 6, first)
    losses = _run(tmp_path, 9, second)
    np.testing.assert_allclose([losses[s] for s in range(1, 10)], [reference_losses[s] for s in range(1, 10)],
                               rtol=1e-4)


def test_shape_mismatch_names_the_parameters(tmp_path):
    train_cli(tmp_path, "train.steps=2")
    proc = train_cli(tmp_path, "train.steps=4", "model.hidden_size=32", check=False)
    assert proc.returncode == 2
    assert "mismatched parameters" in proc.stderr and "['embed']['embedding']" in proc.stderr


def test_check_same_model_names_the_keys_that_differ():
    """A checkpoint's model is compared by resolved values and each difference named by its key: null key/value
    heads equal num_heads, and a padded vocabulary that grew with model.vocab_size is named there only."""
    import dataclasses

    from megajax.config import ConfigError, ModelConfig

    stored = ModelConfig(num_heads=4)
    checkpoint.check_same_model(stored, dataclasses.replace(stored, num_kv_heads=4, recompute="full"), "ckpt")
    with pytest.raises(ConfigError, match=r"ckpt holds a different model: model.num_kv_heads: None in the checkpoint, "
                       r"2 here\. Use the config"):
        checkpoint.check_same_model(stored, dataclasses.replace(stored, num_kv_heads=2), "ckpt")
    with pytest.raises(ConfigError, match=r"model: model.vocab_size: 257 in the checkpoint, 50257 here\. Use") as err:
        checkpoint.check_same_model(stored, dataclasses.replace(stored, vocab_size=50257), "ckpt")
    assert "make_vocab_size_divisible_by" not in str(err.value)
    with pytest.raises(ConfigError, match="model.seq_length \\(GPT-2's position embedding\\): 128 in the checkpoint"):
        checkpoint.check_same_model(stored, dataclasses.replace(stored, seq_length=256), "ckpt")


@pytest.mark.slow  # suite time (14 s: it trains a run first)
def test_inspect_lists_steps_and_arrays(tmp_path):
    # the same run checks the profiler hook and that megajax's Python logging reaches stderr on process 0
    proc = train_cli(tmp_path, "train.steps=4", "checkpoint.every=2", "train.profile_start=1", "train.profile_steps=2",
                     f"data.index_cache_dir={tmp_path / 'indices'}")
    assert glob.glob(str(tmp_path / "profile/plugins/profile/*/*.xplane.pb")) and "profiled steps 2-3" in proc.stdout
    assert "built the train indices of" in proc.stderr  # megajax.data's log.info
    report = checkpoint.inspect(str(tmp_path / "checkpoints"))
    assert report["steps"] == [2, 4] and report["consumed_samples"] == 32
    names = {a["name"] for a in report["arrays"]}
    assert any("embedding" in n for n in names) and report["total_bytes"] > 0
    out = subprocess.run([sys.executable, "-m", "megajax.checkpoint", "inspect", str(tmp_path / "checkpoints")],
                         cwd=REPO, env=cli_env(), capture_output=True, text=True)
    assert out.returncode == 0 and json.loads(out.stdout)["latest"] == 4


def _cut_largest(ckpt, step):
    path = max(glob.glob(str(ckpt / str(step) / "state" / "ocdbt.process_0" / "d" / "*")), key=os.path.getsize)
    os.truncate(path, os.path.getsize(path) // 2)


@pytest.mark.slow  # suite time (35 s; a crash mid-save and the bad-streak rotation run by default)
def test_a_damaged_checkpoint_is_set_aside_and_the_run_resumes_from_the_newest_readable_one(tmp_path):
    """Step 6 with an array file cut in half (TensorStore cannot read it) and step 4 with bytes flipped inside
    one (it reads, but not as written: the checksum saved with it differs): the rerun names each in one line,
    moves it aside untouched and resumes from step 2; naming an unreadable step with checkpoint.resume_step is
    an error that says so; a step damaged a second time goes aside beside the first; a rollback
    (checkpoint.resume_step) moves the abandoned timeline's later steps aside as <step>.abandoned."""
    train_cli(tmp_path, "train.steps=6", "checkpoint.every=2", "checkpoint.async=false")
    ckpt = tmp_path / "checkpoints"

    def largest(step):
        return max(glob.glob(str(ckpt / str(step) / "state" / "ocdbt.process_0" / "d" / "*")), key=os.path.getsize)

    cut = largest(6)
    os.truncate(cut, os.path.getsize(cut) // 2)
    flipped, middle = largest(4), os.path.getsize(largest(4)) // 2
    with open(flipped, "r+b") as f:
        f.seek(middle)
        data = f.read(64)
        f.seek(middle)
        f.write(bytes(b ^ 0xFF for b in data))
    damaged = {p: open(p, "rb").read() for p in (cut, flipped)}
    proc = train_cli(tmp_path, "train.steps=8", "checkpoint.every=2", "checkpoint.async=false",
                     "checkpoint.resume_step=6", check=False)
    assert proc.returncode == 2 and "checkpoint step 6" in proc.stderr and "cannot be read" in proc.stderr
    assert len(proc.stderr.strip().splitlines()[-1]) < 400  # one line, no TensorStore traceback
    proc = train_cli(tmp_path, "train.steps=8", "checkpoint.every=2", "checkpoint.async=false")
    out = proc.stdout
    assert "checkpoint step 6 cannot be read (array " in out and "checkpoint step 4 cannot be read (array " in out
    assert "resumed from" in out and "step 2 (16 samples consumed" in out
    for path, data in damaged.items():  # set aside as they were
        moved = path.replace(f"{os.sep}6{os.sep}", f"{os.sep}6.unreadable{os.sep}").replace(
            f"{os.sep}4{os.sep}", f"{os.sep}4.unreadable{os.sep}")
        assert open(moved, "rb").read() == data
    assert read_metrics(tmp_path)[8]["loss"] < 10  # trained on from step 2: finite, sane
    # the same step damaged again (the rerun wrote a new step 6): set aside beside the first, never over it
    _cut_largest(ckpt, 8)
    _cut_largest(ckpt, 6)
    proc = train_cli(tmp_path, "train.steps=8", "checkpoint.every=2", "checkpoint.async=false")
    assert "checkpoint step 6 cannot be read" in proc.stdout and "step 4 (32 samples consumed" in proc.stdout
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == [  # checkpoint.keep=3
        "4", "4.unreadable", "6", "6.unreadable", "6.unreadable.2", "8", "8.unreadable"]
    # a rollback: the abandoned timeline's later steps move aside (said in the log) and the new one writes its own
    old8 = checkpoint.read_meta(checkpoint.manager(str(ckpt), read_only=True), 8)["checksums"]
    proc = train_cli(tmp_path, "train.steps=8", "checkpoint.every=2", "checkpoint.async=false",
                     "checkpoint.resume_step=4", "optim.lr=1e-4")
    assert "later steps [6, 8] of the timeline it leaves moved aside" in proc.stdout
    assert "already in" not in proc.stdout, "the new timeline's saves are written, not skipped"
    names = sorted(p.name for p in ckpt.iterdir() if not p.name.startswith("."))
    assert {"6", "6.abandoned", "8", "8.abandoned", "6.unreadable.2", "8.unreadable"} <= set(names), names
    assert checkpoint.read_meta(checkpoint.manager(str(ckpt), read_only=True), 8)["checksums"] != old8


def test_a_crash_mid_save_never_damages_earlier_steps(tmp_path):
    """An unfinished save (what kill -9 leaves behind) is ignored; the newest complete step is used."""
    train_cli(tmp_path, "train.steps=4", "checkpoint.every=2")
    ckpt = tmp_path / "checkpoints"
    partial = ckpt / "6.orbax-checkpoint-tmp-1234"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "garbage").write_bytes(os.urandom(100))
    proc = train_cli(tmp_path, "train.steps=6", "checkpoint.every=2")
    assert "resumed from" in proc.stdout and "step 4" in proc.stdout
    assert checkpoint.inspect(str(ckpt))["latest"] == 6


@pytest.mark.slow  # suite time (the default run stays under 15 minutes)
def test_kill_during_async_saves_then_resume(tmp_path):
    """kill -9 while checkpoints are written every step: the restart finds a complete step and finishes."""
    sets = ["train.steps=40", "checkpoint.every=1", "checkpoint.keep=2"]
    cmd = [sys.executable, "-m", "megajax.train", "--config", "configs/tiny.yaml", "--set", *CLI_SMALL,
           f"train.output_dir={tmp_path}", *sets]
    proc = subprocess.Popen(cmd, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    for line in proc.stdout:
        if "checkpoint at step 6" in line:
            break
    proc.kill()
    proc.wait()
    rerun = train_cli(tmp_path, *sets)
    assert "resumed from" in rerun.stdout
    assert checkpoint.inspect(str(tmp_path / "checkpoints"))["latest"] == 40


# (one handler for both: suite time)
@pytest.mark.parametrize("how", ["SIGTERM", pytest.param("SIGINT", marks=pytest.mark.slow)])
def test_signal_saves_and_exits_zero(tmp_path, how):
    cmd = [sys.executable, "-m", "megajax.train", "--config", "configs/tiny.yaml", "--set", *CLI_SMALL,
           f"train.output_dir={tmp_path}", "train.steps=100000"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    for line in proc.stdout:
        if line.startswith("step 3/"):
            proc.send_signal(getattr(signal, how))
            break
    rest = proc.stdout.read()
    assert proc.wait(timeout=120) == 0, rest
    assert "stopping after step" in rest and how in rest
    latest = checkpoint.inspect(str(tmp_path / "checkpoints"))["latest"]
    assert 3 <= latest < 100


@pytest.mark.slow  # suite time (7 s; the signal's save and exit run by default)
def test_exit_after_minutes(tmp_path):
    proc = train_cli(tmp_path, "train.steps=100000", "train.exit_after_minutes=0.0001")
    assert "train.exit_after_minutes" in proc.stdout
    assert checkpoint.inspect(str(tmp_path / "checkpoints"))["latest"] >= 1


# (suite time: test_fsdp_weights_move_between_layouts_and_data_sizes restores padded state across data sizes)
@pytest.mark.slow
def test_distributed_optimizer_state_moves_between_data_sizes(tmp_path):
    """The distributed optimizer pads each parameter's state to a multiple of the data size (64 -> 66 at
    data 3): a checkpoint written at data 3 x tensor 2 restores exactly onto data 4 x tensor 2 (other
    padding) and onto one device without the distributed optimizer (none)."""
    import jax

    from megajax import optim
    from conftest import run_steps, small_config

    cfg = small_config(**{"parallel.data": 3, "parallel.tensor": 2, "parallel.distributed_optimizer": True,
                          "train.global_batch_size": 12})
    _, state, setup = run_steps(cfg, 6, 2, return_state=True)
    assert setup.zero_sharded_fraction() == 1.0
    mgr = checkpoint.manager(str(tmp_path), use_async=False)
    checkpoint.save(mgr, 2, state, setup.cfg, 24)
    mgr.wait_until_finished()

    def unpadded(st, params):
        mu = st.opt_state[1].mu
        return jax.device_get((st.params, jax.tree.map(lambda m, p: optim.zero_unpad(m, p.shape), mu, params)))

    want = unpadded(state, state.params)
    for n, layout in ((8, {"parallel.data": 4, "parallel.tensor": 2, "parallel.distributed_optimizer": True}),
                      (1, {"parallel.data": 1})):
        target = step_lib.setup_for(small_config(**layout, **{"train.global_batch_size": 12}), jax.devices()[:n])
        fields, _ = checkpoint.restore(mgr, 2, target.abstract_state, target.state_shardings, target.cfg)
        got = step_lib.TrainState(**fields)
        assert jax.tree.map(lambda a: a.shape, got.opt_state) == jax.tree.map(lambda a: a.shape,
                                                                                target.abstract_state.opt_state)
        jax.tree.map(np.testing.assert_array_equal, unpadded(got, got.params), want)
    mgr.close()


def test_a_bad_streak_never_rotates_the_last_good_checkpoint_out(tmp_path):
    """Saving every step with checkpoint.keep=2 while the run diverges: the skipped steps' weights are the last
    good ones, so no checkpoint is written during the streak and the last good steps stay."""
    proc = train_cli(tmp_path, "train.steps=30", "checkpoint.every=1", "checkpoint.keep=2", "checkpoint.async=false",
                     "optim.lr=1e30", "optim.warmup_steps=1", "train.max_bad_steps=4", check=False)
    assert proc.returncode == 1
    kept = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    rows = read_metrics(tmp_path)
    good = max(step for step, row in rows.items() if np.isfinite(row["loss"]) and row["grad_norm"] < 1e30)
    assert kept and max(kept) <= good + 1, (kept, good)
    assert "not written: the last" in proc.stdout


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB tmpfs (as root; skipped elsewhere): a real filesystem that fills up."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.mark.slow  # suite time (20 s a case; a crash mid-save runs by default)
@pytest.mark.parametrize("async_", ["true", "false"])
def test_a_full_disk_ends_the_run_in_one_line_and_loses_nothing(small_disk, async_):
    """The disk fills up during a save: the run exits 1 with one line naming the directory and the cause, the
    earlier checkpoint reads, and with more room the rerun cleans the failed save's temporary directory and
    resumes from it."""
    out = small_disk / "run"
    proc = train_cli(out, "train.steps=40", "checkpoint.every=2", "checkpoint.keep=10", f"checkpoint.async={async_}",
                     check=False)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert err[-1].startswith("error: ") and "could not be written to" in err[-1], err[-1]  # a checkpoint or a log
    assert "No space left on device" in err[-1]
    assert len([line for line in err if "Traceback" in line]) == 0, proc.stderr[-3000:]
    saved = checkpoint.manager(str(out / "checkpoints"), read_only=True).all_steps()
    assert saved, "the steps saved before the disk filled are there"
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    again = train_cli(out, f"train.steps={max(saved) + 2}", "checkpoint.every=2", "checkpoint.keep=10")
    assert f"resumed from {out / 'checkpoints'} step {max(saved)}" in again.stdout
    assert not [p for p in (out / "checkpoints").iterdir() if "tmp" in p.name]
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)  # a read-only filesystem
    refused = train_cli(out, f"train.steps={max(saved) + 4}", check=False)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1].startswith(f"error: {out}: the run "
                                                                                          "cannot write there")


BEFORE_MODEL_STATE = os.path.join(REPO, "tests", "data", "checkpoint-before-model-state")


def test_a_checkpoint_from_before_the_model_state_split_resumes(tmp_path):
    """A checkpoint written when the FP8 counters, the MoE statistics and the routing bias lived in params (with
    optimizer moments of their own) resumes on another layout: they are read into the model state, and steps 3
    and 4 give the losses the run that wrote it logged. Exporting its params gives the state back beside them."""
    import shutil

    shutil.copytree(os.path.join(BEFORE_MODEL_STATE, "checkpoints"), tmp_path / "checkpoints")
    sets = ["model.arch=llama", "model.num_layers=2", "model.hidden_size=32", "model.num_heads=2",
            "model.seq_length=32", "model.num_experts=4", "model.experts_per_token=2", "model.moe_ffn_hidden_size=32",
            "model.moe_router_bias_update_rate=0.01", "model.fp8=hybrid", "model.fp8_recipe=delayed",
            "train.global_batch_size=4", "train.micro_batch_size=1", "optim.warmup_steps=1", "checkpoint.async=false",
            "checkpoint.every=2", "train.steps=4"]
    proc = train_cli(tmp_path, *sets)  # one device: data 1, no distributed optimizer
    assert "resumed from" in proc.stdout
    with open(os.path.join(BEFORE_MODEL_STATE, "metrics.jsonl")) as f:
        want = {r["step"]: r for r in map(json.loads, f)}
    got = read_metrics(tmp_path)
    assert sorted(got) == [3, 4]
    for s in (3, 4):
        for key in ("loss", "grad_norm", "moe_aux_loss", "moe_load_imbalance"):
            np.testing.assert_allclose(got[s][key], want[s][key], rtol=1e-5, err_msg=f"step {s} {key}")
    exported = checkpoint.load_params(os.path.join(BEFORE_MODEL_STATE, "checkpoints"))
    moe_vars = exported["layers"]["block"]["mlp"]
    assert {"router_bias", "moe_stats", "fp8_w_gate_up", "w_gate_up"} <= moe_vars.keys()
    assert np.any(moe_vars["router_bias"]) and np.max(moe_vars["fp8_w_gate_up"]) == 16


def test_fsdp_weights_move_between_layouts_and_data_sizes(tmp_path):
    """ZeRO-3 keeps each weight as its shard, zero-padded as the distributed optimizer pads (64 -> 66 at data 3):
    its checkpoint restores exactly onto ZeRO-3 at data 4 (other padding), hybrid sharding (two instances of two data
    ranks), ZeRO-1, a pipeline and one device; a
    one-device checkpoint restores onto ZeRO-3; and the params export of a ZeRO-3 checkpoint holds the model's own
    shapes."""
    import jax

    from megajax import optim
    from megajax.parallel.pipeline.layout import from_stages
    from conftest import run_steps, small_config

    fsdp = {"parallel.data_parallel_sharding_strategy": "optim_grads_params", "train.global_batch_size": 12}
    _, state, setup = run_steps(small_config(**{"parallel.data": 3, "parallel.tensor": 2, **fsdp}), 6, 2,
                                return_state=True)
    assert any(a.shape != b.shape for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(setup.param_shapes)))
    mgr = checkpoint.manager(str(tmp_path / "fsdp"), use_async=False)
    checkpoint.save(mgr, 2, state, setup.cfg, 24)
    mgr.wait_until_finished()

    def own(st, target):  # (weights, Adam's first moment) without any padding, in the canonical layout
        mu = st.opt_state[1].mu
        pairs = jax.device_get(jax.tree.map(lambda p, m, a: (optim.zero_unpad(p, a.shape),
                                                             optim.zero_unpad(m, a.shape)),
                                            st.params, mu, target.param_shapes))
        if target.plan.pipelined:
            pairs = from_stages(pairs, target.cfg.stage_split)
        return pairs

    want = own(state, setup)
    one = None
    for n, layout in ((8, {"parallel.data": 4, "parallel.tensor": 2, **fsdp}),
                      (8, {"parallel.data": 4, "parallel.tensor": 2, "parallel.num_distributed_optimizer_instances": 2,
                           **fsdp}),
                      (4, {"parallel.data": 4, "parallel.distributed_optimizer": True, "train.global_batch_size": 12}),
                      (8, {"parallel.data": 2, "parallel.pipeline": 2, "parallel.tensor": 2,
                           "parallel.distributed_optimizer": True, "train.global_batch_size": 12}),
                      (1, {"parallel.data": 1, "train.global_batch_size": 12})):
        target = step_lib.setup_for(small_config(**layout), jax.devices()[:n])
        fields, _ = checkpoint.restore(mgr, 2, target.abstract_state, target.state_shardings, target.cfg)
        got = step_lib.TrainState(**fields)
        assert jax.tree.map(lambda a: a.shape, got.params) == jax.tree.map(lambda a: a.shape,
                                                                            target.abstract_state.params)
        jax.tree.map(np.testing.assert_array_equal, own(got, target), want)
        one = (got, target) if n == 1 else one
    exported = checkpoint.load_params(str(tmp_path / "fsdp"))
    jax.tree.map(lambda a, w: np.testing.assert_array_equal(a, w[0]), exported["layers"], want["layers"],
                 is_leaf=lambda x: isinstance(x, tuple))
    mgr.close()
    # and back: one device's checkpoint onto ZeRO-3 at data 3
    mgr = checkpoint.manager(str(tmp_path / "one"), use_async=False)
    checkpoint.save(mgr, 2, one[0], one[1].cfg, 24)
    mgr.wait_until_finished()
    fields, _ = checkpoint.restore(mgr, 2, setup.abstract_state, setup.state_shardings, setup.cfg)
    jax.tree.map(np.testing.assert_array_equal, own(step_lib.TrainState(**fields), setup), want)
    mgr.close()


@pytest.mark.slow  # suite time (27 s; test_fsdp_weights_move_between_layouts_and_data_sizes runs by default)
def test_uneven_pipeline_stages_move_to_even_stages_and_no_pipeline(tmp_path):
    """A checkpoint of uneven stages (Megatron's accounting of the embedding and the loss: 6 layers in 2 stages of 2
    chunks hold 1, 2, 2, 1; the embedding and output layer split over the pipeline ranks) restores onto another
    uneven split, an even one (with the embedding and output layer split, and whole on every rank) and no pipeline
    with the same weights and Adam moments; the empty slots stay zero through training; the params export holds the
    model's layers; and a checkpoint of no pipeline restores onto the uneven split."""
    import jax

    from megajax.parallel.pipeline.layout import from_stages
    from conftest import run_steps, small_config

    model = {"model.num_layers": 6, "model.arch": "llama", "model.num_heads": 8, "model.num_kv_heads": 4,
             "train.global_batch_size": 8}
    uneven = {**model, "parallel.data": 2, "parallel.pipeline": 2, "parallel.tensor": 2, "train.micro_batch_size": 2,
              "parallel.schedule": "zero_bubble", "parallel.virtual_stages": 2,
              "parallel.account_for_embedding_in_pipeline_split": True,
              "parallel.account_for_loss_in_pipeline_split": True, "parallel.vocab_over_pipeline": True}
    _, state, setup = run_steps(small_config(**uneven), 8, 2, return_state=True)
    assert setup.cfg.stage_split.units == (1, 2, 2, 1)
    for leaf in jax.tree.leaves((state.params["layers"], state.opt_state[1].mu["layers"])):
        empty = np.asarray(jax.device_get(leaf))[[0, 1], [0, 1], -1]  # [v, p, S]: chunks 0 and 3's last slots
        assert not empty.any(), "an empty slot's weight or moment moved"
    mgr = checkpoint.manager(str(tmp_path / "uneven"), use_async=False)
    checkpoint.save(mgr, 2, state, setup.cfg, 16)
    mgr.wait_until_finished()

    def own(st, target):  # (weights, Adam's first moment) in the canonical layout
        pairs = jax.device_get(jax.tree.map(lambda p, m: (p, m), st.params, st.opt_state[1].mu))
        return from_stages(pairs, target.cfg.stage_split) if target.plan.pipelined else pairs

    want = own(state, setup)
    pipeline = {**model, "parallel.pipeline": 2, "parallel.tensor": 2, "train.micro_batch_size": 2}
    assert setup.plan.vocab_over_pipeline
    for n, layout in ((8, {**pipeline, "parallel.data": 2, "parallel.vocab_over_pipeline": True}),
                      (8, {**pipeline, "parallel.data": 2, "parallel.vocab_over_pipeline": False}),
                      (6, {**pipeline, "parallel.pipeline": 3, "parallel.tensor": 2, "parallel.data": 1,
                           "parallel.decoder_first_pipeline_num_layers": 2,
                           "parallel.decoder_last_pipeline_num_layers": 1}),
                      (1, {**model, "parallel.data": 1})):
        target = step_lib.setup_for(small_config(**layout), jax.devices()[:n])
        fields, _ = checkpoint.restore(mgr, 2, target.abstract_state, target.state_shardings, target.cfg)
        jax.tree.map(np.testing.assert_array_equal, own(step_lib.TrainState(**fields), target), want)
    exported = checkpoint.load_params(str(tmp_path / "uneven"))
    jax.tree.map(lambda a, w: np.testing.assert_array_equal(a, w[0]), exported["layers"], want["layers"],
                 is_leaf=lambda x: isinstance(x, tuple))
    mgr.close()
    # and back: one device's state onto the uneven split
    one = step_lib.setup_for(small_config(**{**model, "parallel.data": 1}), jax.devices()[:1])
    mgr = checkpoint.manager(str(tmp_path / "one"), use_async=False)
    checkpoint.save(mgr, 2, step_lib.TrainState(**checkpoint.restore(
        checkpoint.manager(str(tmp_path / "uneven"), read_only=True), 2, one.abstract_state, one.state_shardings,
        one.cfg)[0]), one.cfg, 16)
    mgr.wait_until_finished()
    fields, _ = checkpoint.restore(mgr, 2, setup.abstract_state, setup.state_shardings, setup.cfg)
    jax.tree.map(np.testing.assert_array_equal, own(step_lib.TrainState(**fields), setup), want)
    mgr.close()
