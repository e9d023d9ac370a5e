"""The run's sections: train (steps, batch, logging), optim (AdamW, schedule, loss scaling), data and checkpoint."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

from megajax.config.base import check, resumable, short

FP16_MAX = 65504.0  # float16's largest finite value

@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 100  # optimizer steps to train
    global_batch_size: int = 8  # samples per optimizer step, over all data ranks
    micro_batch_size: int | None = None  # samples per micro batch; null: the whole per-data-rank batch
    seed: int = 0  # weights, data order and dropout
    log_every: int = resumable(10)  # steps between log lines and metrics.jsonl rows
    # also log update_norm, the optimizer update's global norm (costs a pass over the updates every step)
    log_update_norm: bool = resumable(False)
    eval_every: int = resumable(0)  # steps between evaluations on the validation split (0: none)
    eval_batches: int = resumable(4)  # global batches of the validation split per evaluation
    output_dir: str = resumable("runs/default")  # metrics.jsonl, TensorBoard events, checkpoints
    max_bad_steps: int = resumable(5)  # stop after this many non-finite steps in a row
    exit_after_minutes: float | None = resumable(None)  # save and exit cleanly after this much wall time
    # the first step (0-based) traced with jax.profiler when profile_steps > 0
    profile_start: int = resumable(0)
    # steps traced into <train.output_dir>/profile (TensorBoard / Perfetto; 0: none)
    profile_steps: int = resumable(0)
    # also log to this Weights & Biases project (pip install -e '.[wandb]')
    wandb_project: str | None = resumable(None)
    # the W&B run's name; null: the last part of train.output_dir
    wandb_exp_name: str | None = resumable(None)
    # devices that do not match the layout (a restart on fewer hosts): train on the planner's best layout for the
    # devices present, at the same global batch, instead of refusing
    elastic: bool = resumable(False)
    # report a step (or data wait, eval, checkpoint) open this long: its Python stacks and the process behind;
    # null: 10x the median recent step, at least 120 s (an eval: per eval batch; a checkpoint: at least 600 s)
    hang_report_s: float | None = resumable(None)
    # end a process whose step has been open this long (exit 86), so its launcher ends or restarts the job; null: never
    hang_exit_s: float | None = resumable(None)
    # testing the watchdog: "P@S" stalls process P before step S's batch (":SECONDS" for a while; else until killed)
    debug_stall: str = resumable("")

    def __post_init__(self):
        check(self.steps >= 1, f"train.steps must be >= 1, got {self.steps}")
        check(self.global_batch_size >= 1, f"train.global_batch_size must be >= 1, got {self.global_batch_size}")
        check(
            self.micro_batch_size is None or self.micro_batch_size >= 1,
            f"train.micro_batch_size must be >= 1, got {self.micro_batch_size}",
        )
        check(self.log_every >= 1, f"train.log_every must be >= 1, got {self.log_every}")
        check(self.eval_every >= 0, f"train.eval_every must be >= 0, got {self.eval_every}")
        check(self.max_bad_steps >= 1, f"train.max_bad_steps must be >= 1, got {self.max_bad_steps}")
        check(self.profile_start >= 0 and self.profile_steps >= 0,
              "train.profile_start and train.profile_steps must be >= 0 (profile_steps 0: no trace)")
        for key in ("hang_report_s", "hang_exit_s"):
            value = getattr(self, key)
            check(value is None or value > 0, f"train.{key} must be positive or null, got {value}")
        check(not self.debug_stall or self.stall() is not None,
              f"train.debug_stall={self.debug_stall!r}: write PROCESS@STEP or PROCESS@STEP:SECONDS (e.g. 1@5:30)")

    def stall(self) -> tuple[int, int, float] | None:
        """train.debug_stall as (process, step, seconds); None where unset or malformed."""
        m = re.fullmatch(r"(\d+)@(\d+)(?::(\d+(?:\.\d*)?))?", self.debug_stall)
        return (int(m.group(1)), int(m.group(2)), float(m.group(3) or "inf")) if m else None


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4  # peak learning rate (AdamW)
    min_lr: float = 3e-5  # learning rate at the end of the decay
    warmup_steps: int = 10  # linear warm-up from 0
    decay: Literal["cosine", "linear", "constant"] = "cosine"  # schedule after warm-up (Megatron's --lr-decay-style)
    decay_steps: int | None = None  # steps from the start to the end of the decay; null: train.steps
    weight_decay: float = 0.1  # AdamW decoupled weight decay (not on norms and biases)
    clip_grad: float = 1.0  # clip the global gradient norm to this (0: no clipping)
    beta1: float = 0.9  # Adam's first-moment decay
    beta2: float = 0.95  # Adam's second-moment decay
    eps: float = 1e-8  # Adam's epsilon
    # fp16 dynamic loss scaling (used only with model.compute_dtype=float16)
    initial_loss_scale: float = 2.0**16
    loss_scale_growth_interval: int = 1000  # finite steps before the loss scale doubles
    min_loss_scale: float = 1.0  # the loss scale never backs off below this

    def __post_init__(self):
        check(self.lr > 0, f"optim.lr must be positive, got {self.lr}")
        check(0 <= self.min_lr <= self.lr, f"optim.min_lr must be in [0, optim.lr], got {self.min_lr}")
        check(self.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        check(self.clip_grad >= 0, f"optim.clip_grad must be >= 0 (0 disables), got {self.clip_grad}")
        check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "optim.beta1 and optim.beta2 must be in [0, 1)")
        check(self.initial_loss_scale >= 1, "optim.initial_loss_scale must be >= 1")
        check(1 <= self.min_loss_scale <= self.initial_loss_scale,
              f"optim.min_loss_scale={self.min_loss_scale:g} must be between 1 and optim.initial_loss_scale="
              f"{self.initial_loss_scale:g}")
        check(self.min_loss_scale <= FP16_MAX,
              f"optim.min_loss_scale={self.min_loss_scale:g} is beyond float16's range (largest {FP16_MAX:g}): "
              "fp16 gradients scaled by it overflow whenever a gradient passes 1; lower it (default 1)")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from. Empty `paths`: the bundled corpus, tokenized on first use."""

    # [prefix], [prefixA, prefixB] (blended by size) or [w1, prefix1, w2, prefix2, ...] (Megatron's --data-path)
    paths: list[Any] = dataclasses.field(default_factory=list)
    split: str = "949,50,1"  # train, valid, test weights over each dataset's sequences
    tokenizer: str = "byte"  # byte, gpt2, or a path (tokenizer.json, SentencePiece .model, or their directory)
    # the tokenized bundled corpus; null: $XDG_CACHE_HOME/megajax or ~/.cache/megajax
    cache_dir: str | None = resumable(None)
    # sample indices; null: <data dir>/cache/megajax_indices or cache_dir/indices
    index_cache_dir: str | None = resumable(None)
    prefetch: int = resumable(2)  # batches read ahead by a background thread (0: read in the step loop)
    eod_mask_loss: bool = False  # no loss on targets that follow an end-of-document token (Megatron's flag)
    reset_attention_mask: bool = False  # packed documents: tokens attend only within their document (Megatron's flag)
    reset_position_ids: bool = False  # packed documents: positions restart at 0 in each document (Megatron's flag)

    def __post_init__(self):
        parts = self.split.split(",")
        check(
            1 <= len(parts) <= 3 and all(p.strip().replace(".", "", 1).isdigit() for p in parts),
            f"data.split={self.split!r} must be up to three comma-separated weights, like '949,50,1'",
        )
        check(sum(float(p) for p in parts) > 0, f"data.split={self.split!r} must have a positive weight")
        check(self.prefetch >= 0, f"data.prefetch must be >= 0 (0: no background reading), got {self.prefetch}")
        if all(isinstance(p, str) for p in self.paths):
            check(all(p for p in self.paths), f"data.paths={short(self.paths)} has an empty prefix")
            return
        check(
            len(self.paths) % 2 == 0
            and all(isinstance(p, str) and p for p in self.paths[1::2]),
            f"data.paths={short(self.paths)} must be prefixes [a, b] or weight/prefix pairs like [0.3, a, 0.7, b]",
        )
        for w in self.paths[::2]:
            check(isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0,
                  f"data.paths weight {short(w)} must be a positive number")

    @property
    def document_fields(self) -> tuple[str, ...]:
        """The packed documents' fields a batch carries besides its tokens (the data loader computes them, as
        Megatron-Core's GPTDataset makes its attention mask and position ids): the segment ids with
        reset_attention_mask or reset_position_ids (the multi-token prediction modules count within a document with
        either), the positions restarting at each document with the second."""
        if not (self.reset_attention_mask or self.reset_position_ids):
            return ()
        return ("segment_ids", "positions") if self.reset_position_ids else ("segment_ids",)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None  # where checkpoints go; null: <train.output_dir>/checkpoints
    every: int = 0  # steps between checkpoints (0: only at the end and on a signal)
    keep: int = 3  # checkpoints kept (older ones are deleted)
    async_: bool = True  # write in the background while training goes on (YAML and --set: checkpoint.async)
    load_from: str | None = None  # params-only start (a converted or exported checkpoint)
    resume_step: int | None = None  # resume from this step; null: the newest one that reads completely

    def __post_init__(self):
        check(self.every >= 0, f"checkpoint.every must be >= 0 (0: only at the end), got {self.every}")
        check(self.keep >= 1, f"checkpoint.keep must be >= 1, got {self.keep}")
