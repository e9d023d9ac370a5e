"""`python -m megajax.train --config configs/tiny.yaml [--set key=value ...]`

The training loop around the step (megajax/step.py): the run's lock, resume from the newest readable checkpoint
(or a fresh state, or checkpoint.load_from's weights), the data loader, logging and evaluation, checkpoints,
health checks that stop or roll back a run going bad, SIGTERM/SIGINT, and the CLI.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import time
from typing import Any

import jax

from megajax import config as config_lib, distributed, xla_flags
from megajax import metrics as metrics_lib
from megajax.goodput import Ledger
from megajax.config import io as config_io
from megajax.config import Config, InputError
from megajax.kernels import auto as kernel_choice
from megajax.plan import elastic
from megajax.step import (StepSetup, TrainState, compile_train_step, init_state, jit_eval_step, load_initial_params,
                          setup_for)


class _StopRequest:
    """SIGTERM/SIGINT: finish the current step, save, exit 0 (Megatron's exit-signal handler)."""

    def __init__(self):
        self.signal = None

    def install(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        self.signal = signal.Signals(signum).name


def config_changes(cfg: Config, meta: dict) -> list[tuple[str, Any, Any, bool]]:
    """(key, in the checkpoint, now, changes the run) for every config key that differs from the checkpoint's
    config; `changes the run`: the resumed run differs from an uninterrupted one (other hyperparameters, other
    batches, a schedule over other steps)."""
    def flat(tree):  # {section: {key: value}} -> {"section.key": value}
        return {f"{section}.{key}": value for section, keys in tree.items() for key, value in keys.items()}

    old, new = flat(meta.get("config", {})), flat(cfg.to_dict())
    out = []
    for key in sorted(old.keys() & new.keys()):
        if old[key] != new[key]:
            # train.steps only sets how long the run goes once the decay has its own length; without experts (whose
            # routing and balancing loss work per micro batch) the micro batch only splits the same global batch
            same = (config_lib.may_change_on_resume(key) or (key == "train.steps" and cfg.optim.decay_steps is not None)
                    or (key == "train.micro_batch_size" and not cfg.model.num_experts))
            out.append((key, old[key], new[key], not same))
    return out


def _report_config_changes(cfg: Config, meta: dict, log) -> None:
    """Says which config keys differ from the checkpoint's, flagging those that make the run differ."""
    changes = config_changes(cfg, meta)
    if not changes:
        return
    log.info(f"resuming with {len(changes)} config key(s) changed since the checkpoint:")
    for key, before, now, changes_run in changes:
        note = "  <- the run differs from an uninterrupted one" if changes_run else ""
        log.info(f"  {key}: {before!r} -> {now!r}{note}")


def run(cfg: Config, ledger: Ledger | None = None) -> dict:
    """Trains for cfg.train.steps (resuming from the newest checkpoint if there is one).

    Returns a summary: last logged metrics, eval loss, steps run in this process. The run holds its output and
    checkpoint directories (megajax.runlock): a second run on them exits naming this one. `ledger` counts the
    process's time (megajax.goodput; the command's starts when the process did, else one starts now).
    """
    from megajax import checkpoint, runlock
    from megajax.data.datasets import check_paths

    ledger = Ledger(start=time.time()) if ledger is None else ledger
    check_paths(cfg)  # before the run's directory gets anything
    refit_line = None
    if cfg.train.elastic and not elastic.fits(cfg, jax.device_count()):
        cfg, refit_line = elastic.refit(cfg, jax.device_count(), jax.local_device_count(), jax.devices()[0].device_kind)
    setup = setup_for(cfg)
    with runlock.hold(setup.cfg.train.output_dir, checkpoint.checkpoint_dir(setup.cfg)):
        try:
            summary = _run(setup, ledger, refit_line)
        except BaseException:
            ledger.switch("other")
            with contextlib.suppress(OSError):  # the run's own error is the one to report (a full disk fails both)
                ledger.write()
            raise
        ledger.switch("other")
        with _saving(setup.cfg.train.output_dir, "the run's goodput ledger"):
            ledger.write()
        return summary


def _agreed_attempt(start: float) -> int:
    """The attempt's id, the same on every process: process 0's start time in ms."""
    import numpy as np
    from jax.experimental import multihost_utils

    ms = int(start * 1000)
    mine = np.asarray([ms // 1_000_000, ms % 1_000_000], np.int32)  # int32 halves: without x64 no int64 crosses
    high, low = (int(x) for x in multihost_utils.broadcast_one_to_all(mine))
    return high * 1_000_000 + low


def _run(setup: StepSetup, ledger: Ledger, refit_line: str | None) -> dict:
    from megajax import checkpoint, watchdog
    from megajax.data.loader import BatchLoader, abstract_batch, build_datasets

    cfg, mesh = setup.cfg, setup.mesh
    gbs, steps = cfg.train.global_batch_size, cfg.train.steps
    is_main = jax.process_index() == 0
    metrics_lib.setup_logging(jax.process_index())
    p = cfg.parallel
    ledger.attach(cfg.train.output_dir, _agreed_attempt(ledger.start), jax.process_index(),
                  processes=jax.process_count(), devices=jax.device_count(),
                  layout=f"d{p.data} p{p.pipeline} c{p.context} t{p.tensor}")
    wandb = None
    if cfg.train.wandb_project:
        metrics_lib.require_wandb()
        wandb = dict(project=cfg.train.wandb_project, name=cfg.train.wandb_exp_name, config=cfg.to_dict())
    log = metrics_lib.MetricsLogger(cfg.train.output_dir, enabled=is_main, wandb=wandb)
    if refit_line:
        log.info(refit_line)

    mgr = checkpoint.manager_for(cfg)
    start, consumed, meta = 0, 0, {}
    ledger.switch("restore")
    restored = checkpoint.restore_newest_readable(mgr, setup.abstract_state, setup.state_shardings, cfg, log)
    ledger.switch("startup")
    if restored is not None:
        meta = restored[1]
        start, consumed = int(meta["step"]), int(meta["consumed_samples"])
        log.info(f"resumed from {checkpoint.checkpoint_dir(cfg)} step {start} ({consumed} samples consumed, "
                 f"written with layout {meta.get('layout')})")
        _report_config_changes(cfg, meta, log)
        ledger.resumed_at(start)
        if start >= steps:
            log.info(f"the run in {cfg.train.output_dir} has finished: its checkpoint is at step {start} of "
                     f"train.steps={steps}, so there is nothing to train. To train on, raise train.steps (--set "
                     f"train.steps={2 * start}); for a new run, set another train.output_dir")
            return {"last": {}, "eval_loss": None, "steps_run": 0, "wall_s": 0.0}
    num_eval = cfg.train.eval_batches * gbs if cfg.train.eval_every else 0
    train_samples = _train_samples(cfg, meta, consumed, log)
    datasets = build_datasets(cfg, {"train": train_samples, **({"valid": num_eval} if num_eval else {})})
    state = _first_state(setup, restored, log)
    _describe(setup, log)
    eval_fn = jit_eval_step(setup)
    peak, peak_src = metrics_lib.device_peak(cfg.model.compute_dtype)
    log.info(f"peak for MFU: {peak / 1e12:.4g} TFLOP/s per device ({peak_src})")
    # reads ahead on a background thread from here on, while the step compiles
    loader = BatchLoader(datasets["train"], gbs, setup.batch_shardings, consumed, consumed + (steps - start) * gbs,
                         cfg.data.prefetch)
    batch_spec = abstract_batch(cfg, setup.batch_shardings)
    hang = watchdog.Watchdog(ledger, watchdog.progress_dir(cfg.train.output_dir), jax.process_index(),
                             cfg.train.hang_report_s, cfg.train.hang_exit_s, eval_batches=cfg.train.eval_batches)
    with jax.set_mesh(mesh), loader, hang:
        ledger.switch("compile")
        t0 = time.perf_counter()
        compiled = compile_train_step(setup, state, batch_spec)
        two = " (two programs: the first step's and the later steps', model.fp8_recipe=delayed)"
        log.info(f"compiled the train step in {time.perf_counter() - t0:.1f} s"
                 f"{two if len(compiled.programs) > 1 else ''}")
        try:
            with _saving(cfg.train.output_dir, "the run's output"):  # metrics.jsonl, TensorBoard
                return _loop(cfg, setup, compiled, eval_fn, state, datasets, start, consumed, loader, mgr, log, peak,
                             ledger)
        finally:  # a checkpoint started in the background completes even when the loop stops on an error
            try:
                with _saving(mgr.directory):
                    mgr.wait_until_finished()
            finally:
                try:
                    with _saving(mgr.directory):
                        mgr.close()
                finally:
                    with _saving(cfg.train.output_dir, "the run's output"):  # TensorBoard's last flush
                        log.close()


def _first_state(setup: StepSetup, restored, log) -> TrainState:
    """The state the run starts from: the restored checkpoint's, a converted or exported model's parameters with a
    fresh optimizer (checkpoint.load_from), or a new one."""
    cfg = setup.cfg
    if restored is not None:
        return TrainState(**restored[0])
    if cfg.checkpoint.load_from:
        state = init_state(setup, load_initial_params(setup, cfg.checkpoint.load_from))
        log.info(f"loaded params from {cfg.checkpoint.load_from} (checkpoint.load_from; fresh optimizer state)")
        return state
    return init_state(setup)


def _describe(setup: StepSetup, log) -> None:
    """The run's first lines: the model and layout, the kernels, and warnings about the schedule and the
    distributed optimizer's reach."""
    cfg, p = setup.cfg, setup.cfg.parallel
    gbs, steps = cfg.train.global_batch_size, cfg.train.steps
    n_params = sum(math.prod(a.shape) for a in jax.tree.leaves(setup.param_shapes))
    log.info(f"megajax: {n_params / 1e6:.2f}M parameters, {jax.device_count()} devices "
             f"(data={p.data} pipeline={p.pipeline}{f' context={p.context}' if p.context > 1 else ''} "
             f"tensor={p.tensor}"
             f"{' sp' if p.sequence_parallel else ''}{_instances(p)}), {cfg.num_micro_batches} micro batches of "
             f"{cfg.train.micro_batch_size}, global batch {gbs} x {cfg.model.seq_length} tokens")
    log.info(f"kernels: {_kernels_line(cfg.model, setup.plan)}")
    if steps < cfg.optim.warmup_steps:
        share = steps / cfg.optim.warmup_steps
        log.info(f"warning: train.steps={steps} ends before optim.warmup_steps={cfg.optim.warmup_steps}: the learning "
                 f"rate rises to {cfg.optim.lr * share:.3g} ({share:.0%} of optim.lr={cfg.optim.lr:g}) and never "
                 f"reaches it (set optim.warmup_steps below train.steps for a short run)")
    if p.shards_optimizer and p.data > 1 and setup.zero_sharded_fraction() < 1:
        log.info(f"warning: the distributed optimizer shards {setup.zero_sharded_fraction():.0%} of the optimizer "
                 f"state over data={p.data}; the rest has no dimension divisible by {p.data} and stays replicated")


def _train_samples(cfg: Config, meta: dict, consumed: int, log) -> int:
    """The samples the train split's indices are built for: what the run needs, or what the checkpoint's run was
    built for where that is more, so that a resumed run keeps the order its samples came in. A changed global batch
    carries the samples consumed over: the run goes on at the next sample, whatever the batch."""
    gbs, steps = cfg.train.global_batch_size, cfg.train.steps
    start = int(meta.get("step", 0))
    need = consumed + (steps - start) * gbs
    old = meta.get("config", {}).get("train", {})
    if not old:
        return need
    old_gbs = old.get("global_batch_size", gbs)
    before = old.get("steps", steps) * old_gbs
    if old_gbs != gbs:
        log.info(f"train.global_batch_size changed from {old_gbs} to {gbs}: the run goes on at sample {consumed} "
                 f"(the samples consumed are carried over) and step {start}; each step from here takes {gbs} samples, "
                 "and the learning-rate schedule goes on counting steps")
    if need > before:
        log.info(f"note: the run now needs {need} training samples, more than the {before} its checkpoint's run built "
                 "the data indices for (train.steps x global batch); where that takes more epochs of the data, the "
                 "samples from here on come in another order than the earlier indices would have given")
    return max(need, before)


def _any_process(flag: bool) -> bool:
    """Whether `flag` holds on any process (a one-element allgather over the job's processes)."""
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray([flag], np.int32))))


def _evaluate(cfg, setup, eval_fn, state, dataset) -> float:
    from megajax.data.loader import global_batch

    gbs = cfg.train.global_batch_size
    total, count = 0.0, 0.0
    for i in range(cfg.train.eval_batches):
        batch = global_batch(dataset, i * gbs, gbs, setup.batch_shardings)
        s, c = eval_fn(state, batch)
        total, count = total + float(s), count + float(c)
    return total / max(count, 1.0)


def _instances(p) -> str:
    """The log's note of hybrid sharding's instances (none without)."""
    r = p.num_distributed_optimizer_instances
    return f" instances={r}" if r > 1 else ""


def _kernels_line(m, plan) -> str:
    """The attention and norm implementations the step runs, and its layer loop (the auto choices resolved)."""
    kernels_now = kernel_choice.summary(m.attention_impl, m.norm_impl, head_dim=m.head_dim, width=m.hidden_size,
                                        platform=plan.platform)
    how = "unrolled" if plan.unroll_layers else "a loop"
    return f"{kernels_now}; layers {how}{' (model.scan_layers auto)' if m.scan_layers is None else ''}"


def _loop(cfg, setup, step_fn, eval_fn, state, datasets, start, consumed, loader, mgr, log, peak, ledger) -> dict:
    gbs, steps, seq = cfg.train.global_batch_size, cfg.train.steps, cfg.model.seq_length
    flops = metrics_lib.step_flops(cfg.model, gbs * seq, pipelined=cfg.parallel.pipeline > 1,
                                   platform=setup.plan.platform)
    n_dev = jax.device_count()
    stop = _StopRequest()
    stop.install()
    deadline = None if cfg.train.exit_after_minutes is None else time.time() + 60 * cfg.train.exit_after_minutes
    record: dict = {}
    eval_loss_value = None
    pending = None  # (step, stats) of the previous step: read after the next one is dispatched
    wait_last = loader.wait_s  # seconds spent waiting for input, at the last log
    t_last, step_last, t_start = time.perf_counter(), start, time.perf_counter()
    step = start
    first, last = cfg.train.profile_start, cfg.train.profile_start + cfg.train.profile_steps  # traced: [first, last)
    tracing = False
    stall = cfg.train.stall()
    for step in range(start, steps):
        if first <= step < last and not tracing:
            jax.profiler.start_trace(os.path.join(cfg.train.output_dir, "profile"))
            tracing = True
        ledger.switch("data")
        if stall and stall[:2] == (jax.process_index(), step + 1):
            _stall(cfg, *stall)
        batch = next(loader)
        ledger.training(step + 1)
        state, stats = step_fn(state, batch)
        consumed += gbs
        if pending is not None:
            _check_health(cfg, *pending, log, on_fatal=lambda: _save(mgr, step + 1, state, cfg, consumed, log))
        pending = (step, stats)
        done = step + 1
        if tracing and (done == last or done == steps):
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
            tracing = False
            log.info(f"profiled steps {max(first, start) + 1}-{done}: {cfg.train.output_dir}/profile (TensorBoard's "
                     "profile tab, or Perfetto)")
        if done % cfg.train.log_every == 0 or done == steps:
            host = jax.device_get(stats)
            now = time.perf_counter()
            dt = (now - t_last) / max(done - step_last, 1)
            data_wait, wait_last = (loader.wait_s - wait_last) / max(done - step_last, 1), loader.wait_s
            t_last, step_last = now, done
            record = {"step": done, **_step_stats(host), "step_time_s": dt,
                      **metrics_lib.step_rates(flops, gbs * seq, dt, n_dev, peak), "consumed_samples": consumed,
                      "data_wait_s": data_wait, **ledger.metrics(), **_moe_stats(host)}
            log.log(record, _step_line(record, steps))
            ledger.write()
        ledger.completed(done)
        if cfg.train.eval_every and (done % cfg.train.eval_every == 0 or done == steps) and "valid" in datasets:
            ledger.switch("eval")
            eval_loss_value = _evaluate(cfg, setup, eval_fn, state, datasets["valid"])
            log.log({"step": done, "eval_loss": eval_loss_value, "eval_ppl": math.exp(min(eval_loss_value, 50))},
                    f"eval at step {done}: loss {eval_loss_value:.4f} | ppl {math.exp(min(eval_loss_value, 50)):.2f}")
        timed_out = deadline is not None and time.time() > deadline
        stopping = bool(stop.signal) or timed_out
        if jax.process_count() > 1:  # every process stops at the same step: agreed at each log step
            stopping = done % cfg.train.log_every == 0 and _any_process(stopping)
        if (cfg.checkpoint.every and done % cfg.checkpoint.every == 0) or done == steps or stopping:
            ledger.switch("checkpoint")
            log.log({"step": done, "checkpoint_blocking_s": _save(mgr, done, state, cfg, consumed, log)})
            ledger.write()
        if stopping:
            why = stop.signal or ("train.exit_after_minutes" if timed_out else "a stop request on another process")
            log.info(f"stopping after step {done} ({why}): checkpoint saved")
            break
    ledger.switch("other")
    if pending is not None:
        _check_health(cfg, *pending, log, on_fatal=lambda: _save(mgr, step + 1, state, cfg, consumed, log))
    return {"last": record, "eval_loss": eval_loss_value, "steps_run": step + 1 - start,
            "wall_s": time.perf_counter() - t_start}


def _step_stats(host: dict) -> dict:
    """A logged step's loss, learning rate, norms and loss scale, and the multi-token prediction modules' loss
    (floats)."""
    names = ("loss", "lr", "grad_norm", "param_norm", "update_norm", "loss_scale", "mtp_loss")
    return {k: float(host[k]) for k in names if k in host}


def _moe_stats(host: dict) -> dict:
    """The MoE layers' statistics of a logged step (moe_*: load balance, dropped tokens)."""
    return {k: float(v) for k, v in host.items() if k.startswith("moe_")}


def _step_line(record: dict, steps: int) -> str:
    """The log line of a logged step."""
    done = record["step"]
    eta = metrics_lib.format_eta((steps - done) * record["step_time_s"])
    moe = "".join(f" | {k[4:].replace('_', ' ')} {record[k]:.4f}" for k in record if k.startswith("moe_"))
    mtp = f" | mtp loss {record['mtp_loss']:.4f}" if "mtp_loss" in record else ""
    return (f"step {done}/{steps} | loss {record['loss']:.4f}{mtp} | lr {record['lr']:.3e} | "
            f"grad norm {record['grad_norm']:.3f}{moe} | {record['tokens_per_s']:.0f} tok/s | "
            f"{record['tflops_per_device']:.4f} TFLOP/s/dev | MFU {record['mfu']:.1%} | eta {eta}")


def _stall(cfg: Config, process: int, step: int, seconds: float) -> None:
    """train.debug_stall's pause, once a run (a marker file in the output dir: a restarted job does not stall again),
    in slices so that SIGTERM's handler still runs."""
    marker = os.path.join(cfg.train.output_dir, f"debug_stall-{process}@{step}")
    if os.path.exists(marker):
        return
    open(marker, "w").close()
    print(f"train.debug_stall: process {process} stalls before step {step}", file=sys.stderr, flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(1.0, end - time.monotonic()))


def _save(mgr, step: int, state: TrainState, cfg: Config, consumed: int, log) -> float:
    """Starts a checkpoint save; returns the seconds the loop was blocked (the async part is not counted)."""
    from megajax import checkpoint

    saved = mgr.all_steps() or []
    if step in saved:  # this timeline's own (a rollback moves the abandoned one's later steps aside)
        log.info(f"checkpoint step {step} is already in {mgr.directory}: kept as it is")
        return 0.0
    bad = int(jax.device_get(state.bad_steps))
    if bad and saved and max(saved) >= step - bad:
        # a skipped step leaves the weights as they were: a checkpoint at or after the last good step holds them,
        # and more saves would only rotate the good ones out of checkpoint.keep
        log.info(f"checkpoint at step {step} not written: the last {bad} steps were skipped as non-finite, and step "
                 f"{max(saved)} holds the same weights")
        return 0.0
    t0 = time.perf_counter()
    with _saving(mgr.directory):  # a background save's failure surfaces at the next save
        checkpoint.save(mgr, step, state, cfg, consumed)
    blocked = time.perf_counter() - t0
    log.info(f"checkpoint at step {step} -> {mgr.directory} ({blocked * 1e3:.0f} ms blocking"
             f"{', writing in the background' if cfg.checkpoint.async_ else ''})")
    return blocked


class NonFiniteError(RuntimeError):
    pass


class CheckpointSaveError(RuntimeError):
    """A checkpoint the filesystem refused (full, over quota, not writable): the run stops with one line."""


@contextlib.contextmanager
def _saving(directory, what: str = "a checkpoint"):
    """Turns a write that the filesystem refused into CheckpointSaveError (one line: what, the directory and the
    cause); any other error passes as it is."""
    from megajax import checkpoint

    try:
        yield
    except CheckpointSaveError:
        raise
    except Exception as e:  # noqa: BLE001  (Orbax and TensorStore wrap the OSError in their own types)
        cause = checkpoint.write_failure(e)
        if cause is None:
            raise
        raise CheckpointSaveError(f"{what} could not be written to {directory}: {cause}. The earlier "
                                  "checkpoints are intact and a rerun resumes from the newest; free space or set "
                                  "train.output_dir / checkpoint.dir") from None


def _check_health(cfg: Config, step: int, stats: dict, log, on_fatal=None) -> None:
    """Logs a skipped (non-finite) step; after train.max_bad_steps in a row saves the (last good) weights
    and stops with an error."""
    finite, bad, scale = jax.device_get((stats["finite"], stats["bad_steps"], stats["loss_scale"]))
    if not finite:
        scale, floor = float(scale), cfg.optim.min_loss_scale
        if int(bad) == 0:  # fp16: the loss was fine, the scaled gradient overflowed
            log.info(f"step {step + 1}: gradient overflow at loss scale {scale:g}: skipped, loss scale now "
                     f"{max(scale / 2, floor):g}")
            return
        at_floor = cfg.model.compute_dtype == "float16" and scale <= floor
        why = (f"the gradient overflowed at the smallest loss scale {scale:g} (optim.min_loss_scale)" if at_floor
               else "a non-finite loss or gradient")
        log.info(f"warning: step {step + 1} had {why}: skipped (weights unchanged; {int(bad)} in a row)")
        if int(bad) >= cfg.train.max_bad_steps:
            if on_fatal is not None:
                on_fatal()
            raise NonFiniteError(
                f"{int(bad)} non-finite steps in a row (train.max_bad_steps={cfg.train.max_bad_steps}): stopping. "
                "Lower optim.lr, check the data, or use bfloat16; the last checkpoint is intact.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megajax.train", description=__doc__.split("\n\n")[0])
    config_io.add_cli_arguments(parser)
    args = parser.parse_args(argv)
    from megajax import checkpoint

    checkpoint.quiet_write_failures()  # a refused save: one line, not Orbax's and TensorStore's tracebacks
    xla_flags.install()  # before the first backend starts
    distributed.prefer_cpu_without_gpu()
    if args.config is None:
        print("no --config: the built-in defaults (a 2-layer GPT-2 on the bundled corpus; --help lists every key, "
              "configs/tiny.yaml is the tiny preset)")
    ledger = Ledger()  # from the process's start
    try:
        cfg = config_io.load(args.config, args.set)
        distributed.initialize()
        distributed.check_backend()
        run(cfg, ledger)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (NonFiniteError, CheckpointSaveError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
