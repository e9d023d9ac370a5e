"""The configuration tree: frozen dataclasses whose checks name the fix.

Every section checks itself in `__post_init__`; `Config.__post_init__` checks what needs two sections
(heads vs tensor parallelism, layers vs pipeline stages, batch vs data parallelism). Checks that need the
device count run in `Config.for_devices`, which returns the resolved config every step is built from. Every
error names the fix.

A key's meaning is the comment on its line (`--help` and docs/reference/config.md print it). Two facts about a
key are field metadata, read by `may_change_on_resume` and `model_defining_fields` at the end of this file:
whether it may change when a run resumes without the run becoming another one, and whether it defines the model
a checkpoint holds. The model's section is megajax/model_config.py, the errors and field helpers
megajax/config_base.py; YAML presets, `--set` overrides and `--help` are megajax/config_io.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

# InputError, ConfigError and ModelConfig are imported from here as the tree's own names.
from megajax.config_base import (_MODEL, _RESUME, ConfigError, InputError, _check, _divisors,  # noqa: F401
                                 _may_change_on_resume, _short)
from megajax.model_config import ModelConfig

FP16_MAX = 65504.0  # float16's largest finite value


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The mesh (data, pipeline, context, tensor) and how it is used. data=None takes every device left over.

    expert: the expert-parallel size (Megatron's --expert-model-parallel-size). It divides the data ranks:
    the mesh's data axis is split into 'data' (outer, data / expert) x 'expert' (inner); the dense weights
    stay data-parallel over both, the experts are sharded over 'expert' and data-parallel over 'data'.

    context: the context-parallel size (Megatron's --context-parallel-size). Every sequence is split over the
    'context' ranks for every layer (rank i holds chunks i and 2c - 1 - i of 2c) and attention passes keys and
    values around them in a ring (megajax/model/context.py)."""

    data: int | None = None  # data-parallel size (null: every device left over)
    pipeline: int = 1  # pipeline stages
    tensor: int = 1  # tensor-parallel size (Megatron's column/row-parallel layers)
    expert: int = 1  # expert-parallel size; divides data
    # The experts' tensor-parallel size (Megatron's --expert-tensor-parallel-size): null = parallel.tensor, each
    # expert's width split over 'tensor' as the dense MLP's. 1 = every expert whole on one device, the experts
    # spread over 'expert' x 'tensor' (Megatron's MoE parallel folding): each tensor rank routes its own sequence
    # shard and one all-to-all over 'expert' x 'tensor' sends the rows (megajax/model/moe/exchange.py). Needs
    # sequence_parallel.
    expert_tensor: int | None = None
    # How the dropless experts' rows cross the expert ranks: padded = fixed-size blocks of the most a rank can get
    # (all-to-all, every platform; at e / expert < k that is expert x min(k, e / expert) / k times the routed rows),
    # ragged = the routed rows alone (XLA's ragged all-to-all, as Megatron's all-to-all by split sizes; GPU only,
    # emulated by fixed-size all-to-alls on CPU). The receiving buffers are the padded size unless
    # expert_buffer_factor (below) makes them smaller.
    expert_all_to_all: Literal["padded", "ragged"] = "padded"
    # With expert_all_to_all=ragged: each expert rank receives at most this times one rank's routed rows (the mean
    # it receives; MaxText's ragged_buffer_factor), not the most it can get, and the rows that do not fit are
    # dropped (the higher source ranks' last rows first; moe_dropped_fraction counts them). null: dropless.
    expert_buffer_factor: float | None = None
    context: int = 1  # context-parallel size: every sequence split over this many ranks, attention by a ring
    # How attention's keys and values cross the context ranks (Megatron's --cp-comm-type): ring = ppermute one hop
    # per step under the previous block's compute (p2p); all_gather = every rank's at once, the gradients
    # reduce-scattered. auto: ring without a pipeline, all_gather with one (a collective-permute inside the
    # pipeline's per-rank branches waits for every device of the mesh and deadlocks).
    context_comm: Literal["auto", "ring", "all_gather"] = "auto"
    sequence_parallel: bool = False  # shard the activations outside attention and the MLP over tensor
    virtual_stages: int = 1  # model chunks per pipeline stage (the interleaved or zero_bubble schedule)
    schedule: Literal["gpipe", "1f1b", "interleaved", "zero_bubble"] = "1f1b"  # the pipeline schedule
    # Uneven pipeline stages (Megatron's --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers):
    # the transformer layers on the first and the last pipeline stage (model.moe_first_dense_layers count, on the
    # first), the rest split evenly over the stages between; with virtual_stages each stage's layers split evenly
    # over its chunks. null: as many as the other stages. docs/features/pipeline-schedules.md.
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None  # the layers on the last stage (null: as the others)
    # Megatron's --account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split: the embedding
    # (on the first chunk) and the output layer with the loss (on the last) each count as one layer in an even
    # split, so those chunks hold one transformer layer fewer (Llama 3.1 405B: 126 layers + 2 over 16 stages).
    # Not with the two keys above.
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False  # the output layer and the loss count as a layer
    distributed_optimizer: bool = False  # shard the optimizer state over the data ranks (ZeRO-1)
    # How far the data-parallel ranks (x context) shard the training state (Megatron's
    # --data-parallel-sharding-strategy; docs/features/fsdp.md): no_shard = every rank holds it all; optim = the
    # optimizer state (ZeRO-1: distributed_optimizer=true); optim_grads = also the gradients, reduce-scattered
    # layer by layer in every micro batch's backward (ZeRO-2); optim_grads_params = also the weights, each layer's
    # all-gathered before its forward and again for its backward (ZeRO-3, fully sharded data parallelism). Set, it
    # decides (distributed_optimizer is then not read); null: optim with distributed_optimizer=true, else no_shard.
    data_parallel_sharding_strategy: Literal["no_shard", "optim", "optim_grads", "optim_grads_params"] | None = None
    # Reduce the data-parallel gradients layer by layer under the last micro batch's backward (Megatron's
    # --overlap-grad-reduce). megajax/parallel/overlap.py: an all-reduce per layer, or with the distributed optimizer a
    # reduce-scatter. Off by default: with several micro batches it holds one to three times the gradients' bytes
    # more (docs/features/communication-overlap.md). With a pipeline (1f1b, interleaved): in each rank's idle cool-down
    # ticks, or rank 0's last backwards (across nodes set overlap_comm_ratio, below).
    overlap_grad_reduce: bool = False
    # Keep the weights as their optimizer shards between steps and all-gather them under the next forward
    # (Megatron's --overlap-param-gather). Needs distributed_optimizer and overlap_grad_reduce: the next step's
    # first forward gathers each layer one layer ahead, under the compute of the layer before, instead of the
    # update gathering every weight where nothing overlaps it. With a pipeline (1f1b, interleaved): the layers'
    # weights, in each rank's idle warm-up ticks, or rank 0's first forwards (the embedding and head stay whole).
    overlap_param_gather: bool = False
    # Under a pipeline: one layer's data-parallel reduce-scatter (or gather) time over its forward of one micro
    # batch, as `python -m megajax.audit --target <gpu>` reports it (communication.in_schedule.comm_ratio: 0.86
    # inside an H100 node for gpt2-1.3b, 17.9 across InfiniBand for the paper's 145B). It caps the layers an idle
    # tick reduces or gathers so that each run fits under the tick the other ranks compute; the rest go to the
    # schedule's last (first) tick, where they cost what reducing after (gathering before) the schedule costs.
    # 0: no cap.
    overlap_comm_ratio: float = 0.0
    # Sequence parallelism's all-gather and reduce-scatter as rings of ppermutes under the matmuls they feed
    # (Megatron's --tp-comm-overlap; megajax/model/collective_matmul.py); with a pipeline as chunked all-gathers
    # and reduce-scatters (a ppermute inside the schedule's per-rank branches deadlocks). Needs sequence_parallel.
    tp_comm_overlap: bool = False

    def __post_init__(self):
        for name in ("pipeline", "tensor", "virtual_stages", "expert", "context"):
            _check(getattr(self, name) >= 1, f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        _check(self.data is None or self.data >= 1, f"parallel.data must be >= 1 (or null), got {self.data}")
        _check(self.expert_buffer_factor is None or self.expert_buffer_factor > 0,
               f"parallel.expert_buffer_factor must be positive or null (dropless), got {self.expert_buffer_factor}")
        _check(self.expert_buffer_factor is None or self.expert_all_to_all == "ragged",
               "parallel.expert_buffer_factor sizes the ragged exchange's receiving buffer: set "
               "parallel.expert_all_to_all=ragged (or parallel.expert_buffer_factor=null)")
        _check(self.overlap_comm_ratio >= 0, f"parallel.overlap_comm_ratio must be >= 0 (0: no cap), got "
               f"{self.overlap_comm_ratio}")
        _check(
            not self.sequence_parallel or self.tensor > 1,
            "parallel.sequence_parallel=true needs parallel.tensor > 1 (it shards over the tensor axis)",
        )
        _check(self.expert_tensor in (None, 1, self.tensor),
               f"parallel.expert_tensor={self.expert_tensor} must be null (= parallel.tensor), 1 (whole experts, "
               f"spread over parallel.expert x parallel.tensor ranks) or parallel.tensor={self.tensor}")
        _check(not self.folded_experts or self.sequence_parallel,
               "parallel.expert_tensor=1 routes each tensor rank's sequence shard: set "
               "parallel.sequence_parallel=true (or parallel.expert_tensor=null)")
        if self.data is not None and self.data % self.expert:
            raise ConfigError(
                f"parallel.expert={self.expert} must divide parallel.data={self.data} (expert parallelism splits "
                f"the data-parallel ranks): choose parallel.expert from {_divisors(self.data)}")
        _check(
            not self.overlap_grad_reduce or self.pipeline == 1 or self.schedule in ("1f1b", "interleaved"),
            f"parallel.overlap_grad_reduce=true reduces the gradients inside the schedule, in idle ticks or in each "
            f"chunk's last backward, which the {self.schedule} schedule does not run as one step (GPipe "
            f"differentiates its whole forward, zero_bubble splits off the weight gradients and fills the idle "
            f"ticks with them): use parallel.schedule=1f1b or interleaved, or set "
            f"parallel.overlap_grad_reduce=false",
        )
        _check(
            not self.overlap_param_gather or (self.shards_optimizer and self.overlap_grad_reduce)
            or self.shards_grads,
            "parallel.overlap_param_gather=true gathers the distributed optimizer's shards in the step that reduces "
            "the gradients under the backward: set parallel.distributed_optimizer=true and "
            "parallel.overlap_grad_reduce=true (or parallel.overlap_param_gather=false)",
        )
        _check(
            not self.shards_params or self.pipeline == 1,
            f"parallel.data_parallel_sharding_strategy=optim_grads_params (ZeRO-3) gathers each layer's weights in "
            f"every forward and backward, which no pipeline schedule runs yet: with parallel.pipeline="
            f"{self.pipeline} use optim_grads (ZeRO-2, with parallel.schedule=1f1b or interleaved), or "
            f"parallel.pipeline=1",
        )
        _check(
            not self.shards_grads or self.pipeline == 1 or self.schedule in ("1f1b", "interleaved"),
            f"parallel.data_parallel_sharding_strategy={self.data_parallel_sharding_strategy} reduce-scatters the "
            f"gradients in every backward of a chunk, which the {self.schedule} schedule does not run as one step "
            f"(GPipe differentiates its whole forward, zero_bubble splits off the weight gradients): use "
            f"parallel.schedule=1f1b or interleaved",
        )
        _check(
            not self.tp_comm_overlap or self.sequence_parallel,
            "parallel.tp_comm_overlap=true overlaps sequence parallelism's all-gather and reduce-scatter with the "
            "matmuls: set parallel.sequence_parallel=true (with parallel.tensor > 1)",
        )
        for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
            value = getattr(self, name)
            _check(value is None or (value >= 0 and self.pipeline > 1),
                   f"parallel.{name}={value} sets the layers of a pipeline stage: it needs parallel.pipeline > 1 "
                   "and a value >= 0 (or null: as many as the other stages)")
        _check(not (self.account_for_embedding_in_pipeline_split or self.account_for_loss_in_pipeline_split)
               or self.pipeline > 1, "parallel.account_for_*_in_pipeline_split splits a pipeline: it needs "
               "parallel.pipeline > 1")
        _check(not ((self.account_for_embedding_in_pipeline_split or self.account_for_loss_in_pipeline_split) and
                    (self.decoder_first_pipeline_num_layers is not None
                     or self.decoder_last_pipeline_num_layers is not None)),
               "parallel.account_for_*_in_pipeline_split and parallel.decoder_first/last_pipeline_num_layers both "
               "decide the stages' layers (as in Megatron): set one or the other")
        _check(
            self.virtual_stages == 1 or self.schedule in ("interleaved", "zero_bubble"),
            f"parallel.virtual_stages={self.virtual_stages} needs parallel.schedule=interleaved (or zero_bubble)",
        )
        _check(
            self.pipeline > 1 or (self.schedule in ("1f1b", "gpipe") and self.virtual_stages == 1),
            f"parallel.schedule={self.schedule} with parallel.virtual_stages={self.virtual_stages} schedules pipeline "
            f"stages, but parallel.pipeline=1: set parallel.pipeline > 1 (e.g. parallel.pipeline=2), or drop "
            f"parallel.schedule and parallel.virtual_stages",
        )


    @property
    def sharding_strategy(self) -> str:
        """data_parallel_sharding_strategy resolved: what the data ranks shard (no_shard, optim, optim_grads or
        optim_grads_params)."""
        if self.data_parallel_sharding_strategy is not None:
            return self.data_parallel_sharding_strategy
        return "optim" if self.distributed_optimizer else "no_shard"

    @property
    def shards_optimizer(self) -> bool:
        """The distributed optimizer: the optimizer state sharded over the data ranks (every strategy but
        no_shard)."""
        return self.sharding_strategy != "no_shard"

    @property
    def shards_grads(self) -> bool:
        """ZeRO-2 and ZeRO-3: the gradients reduce-scattered in every micro batch's backward."""
        return self.sharding_strategy in ("optim_grads", "optim_grads_params")

    @property
    def shards_params(self) -> bool:
        """ZeRO-3 (fully sharded data parallelism): the weights kept as their shards, gathered layer by layer."""
        return self.sharding_strategy == "optim_grads_params"

    @property
    def folded_experts(self) -> bool:
        """Whole experts spread over 'expert' x 'tensor' (parallel.expert_tensor=1 with parallel.tensor > 1)."""
        return self.expert_tensor == 1 and self.tensor > 1


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 100  # optimizer steps to train
    global_batch_size: int = 8  # samples per optimizer step, over all data ranks
    micro_batch_size: int | None = None  # samples per micro batch; null: the whole per-data-rank batch
    seed: int = 0  # weights, data order and dropout
    log_every: int = _may_change_on_resume(10)  # steps between log lines and metrics.jsonl rows
    # also log update_norm, the optimizer update's global norm (costs a pass over the updates every step)
    log_update_norm: bool = _may_change_on_resume(False)
    eval_every: int = _may_change_on_resume(0)  # steps between evaluations on the validation split (0: none)
    eval_batches: int = _may_change_on_resume(4)  # global batches of the validation split per evaluation
    output_dir: str = _may_change_on_resume("runs/default")  # metrics.jsonl, TensorBoard events, checkpoints
    max_bad_steps: int = _may_change_on_resume(5)  # stop after this many non-finite steps in a row
    exit_after_minutes: float | None = _may_change_on_resume(None)  # save and exit cleanly after this much wall time
    # the first step (0-based) traced with jax.profiler when profile_steps > 0
    profile_start: int = _may_change_on_resume(0)
    # steps traced into <train.output_dir>/profile (TensorBoard / Perfetto; 0: none)
    profile_steps: int = _may_change_on_resume(0)
    # also log to this Weights & Biases project (pip install -e '.[wandb]')
    wandb_project: str | None = _may_change_on_resume(None)
    # the W&B run's name; null: the last part of train.output_dir
    wandb_exp_name: str | None = _may_change_on_resume(None)

    def __post_init__(self):
        _check(self.steps >= 1, f"train.steps must be >= 1, got {self.steps}")
        _check(self.global_batch_size >= 1, f"train.global_batch_size must be >= 1, got {self.global_batch_size}")
        _check(
            self.micro_batch_size is None or self.micro_batch_size >= 1,
            f"train.micro_batch_size must be >= 1, got {self.micro_batch_size}",
        )
        _check(self.log_every >= 1, f"train.log_every must be >= 1, got {self.log_every}")
        _check(self.eval_every >= 0, f"train.eval_every must be >= 0, got {self.eval_every}")
        _check(self.max_bad_steps >= 1, f"train.max_bad_steps must be >= 1, got {self.max_bad_steps}")
        _check(self.profile_start >= 0 and self.profile_steps >= 0,
               "train.profile_start and train.profile_steps must be >= 0 (profile_steps 0: no trace)")


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
        _check(self.lr > 0, f"optim.lr must be positive, got {self.lr}")
        _check(0 <= self.min_lr <= self.lr, f"optim.min_lr must be in [0, optim.lr], got {self.min_lr}")
        _check(self.warmup_steps >= 0, f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        _check(self.clip_grad >= 0, f"optim.clip_grad must be >= 0 (0 disables), got {self.clip_grad}")
        _check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "optim.beta1 and optim.beta2 must be in [0, 1)")
        _check(self.initial_loss_scale >= 1, "optim.initial_loss_scale must be >= 1")
        _check(1 <= self.min_loss_scale <= self.initial_loss_scale,
               f"optim.min_loss_scale={self.min_loss_scale:g} must be between 1 and optim.initial_loss_scale="
               f"{self.initial_loss_scale:g}")
        _check(self.min_loss_scale <= FP16_MAX,
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
    cache_dir: str | None = _may_change_on_resume(None)
    # sample indices; null: <data dir>/cache/megajax_indices or cache_dir/indices
    index_cache_dir: str | None = _may_change_on_resume(None)
    prefetch: int = _may_change_on_resume(2)  # batches read ahead by a background thread (0: read in the step loop)
    eod_mask_loss: bool = False  # no loss on targets that follow an end-of-document token (Megatron's flag)
    reset_attention_mask: bool = False  # packed documents: tokens attend only within their document (Megatron's flag)
    reset_position_ids: bool = False  # packed documents: positions restart at 0 in each document (Megatron's flag)

    def __post_init__(self):
        parts = self.split.split(",")
        _check(
            1 <= len(parts) <= 3 and all(p.strip().replace(".", "", 1).isdigit() for p in parts),
            f"data.split={self.split!r} must be up to three comma-separated weights, like '949,50,1'",
        )
        _check(sum(float(p) for p in parts) > 0, f"data.split={self.split!r} must have a positive weight")
        _check(self.prefetch >= 0, f"data.prefetch must be >= 0 (0: no background reading), got {self.prefetch}")
        if all(isinstance(p, str) for p in self.paths):
            _check(all(p for p in self.paths), f"data.paths={_short(self.paths)} has an empty prefix")
            return
        _check(
            len(self.paths) % 2 == 0
            and all(isinstance(p, str) and p for p in self.paths[1::2]),
            f"data.paths={_short(self.paths)} must be prefixes [a, b] or weight/prefix pairs like [0.3, a, 0.7, b]",
        )
        for w in self.paths[::2]:
            _check(isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0,
                   f"data.paths weight {_short(w)} must be a positive number")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None  # where checkpoints go; null: <train.output_dir>/checkpoints
    every: int = 0  # steps between checkpoints (0: only at the end and on a signal)
    keep: int = 3  # checkpoints kept (older ones are deleted)
    async_: bool = True  # write in the background while training goes on (YAML and --set: checkpoint.async)
    load_from: str | None = None  # params-only start (a converted or exported checkpoint)
    resume_step: int | None = None  # resume from this step; null: the newest one that reads completely

    def __post_init__(self):
        _check(self.every >= 0, f"checkpoint.every must be >= 0 (0: only at the end), got {self.every}")
        _check(self.keep >= 1, f"checkpoint.keep must be >= 1, got {self.keep}")


# YAML keys that are Python keywords map onto attribute names with a trailing underscore.
_KEY_ALIASES = {"async": "async_"}


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """How the pipeline splits the model: per global chunk c (= local chunk x p + rank; layout.py), its
    transformer layers (`layers`: model.moe_first_dense_layers counted on chunk 0) and its units of the scanned
    stack (`units`: layers / model.moe_layer_freq, dense first layers not counted). Every chunk has `slots`
    places for units in the staged layout; a chunk with fewer leaves the rest empty (skipped, zero weights)."""

    layers: tuple[int, ...]
    units: tuple[int, ...]

    @property
    def slots(self) -> int:
        return max(self.units)

    @property
    def even(self) -> bool:
        return len(set(self.units)) == 1

    @property
    def starts(self) -> tuple[int, ...]:
        """The stack index of each chunk's first unit."""
        return tuple(sum(self.units[:c]) for c in range(len(self.units)))

    def busiest_rank_layers(self, p: int) -> int:
        """The transformer layers of the pipeline rank (of p) that holds the most: its chunks are r, r + p, ..."""
        return max(sum(self.layers[r::p]) for r in range(p))


def pipeline_split(num_layers: int, p: int, v: int = 1, first: int | None = None, last: int | None = None,
                   embedding: bool = False, loss: bool = False, first_dense: int = 0, period: int = 1) -> StageSplit:
    """The layers of each of the p x v pipeline chunks, as Megatron's get_num_layers_to_build splits them: the first
    and the last stage `first` / `last` layers when given, the stages between the rest evenly; or, with `embedding`
    / `loss`, the embedding and the loss counted as a layer each on the first / last chunk; else the scanned stack
    (the layers after `first_dense`) evenly over the chunks, the dense first layers on chunk 0. A stage's layers
    split evenly over its v chunks. Raises ConfigError naming the fix."""
    chunks = p * v
    stack = num_layers - first_dense
    keys = ("parallel.decoder_first_pipeline_num_layers", "parallel.decoder_last_pipeline_num_layers")
    if first is not None or last is not None:
        ends = [n for n in (first, last) if n is not None]
        middle = p - len(ends)
        rest = num_layers - sum(ends)
        _check(rest >= 0 and (rest % middle == 0 if middle else rest == 0),
               f"{' and '.join(f'{k}={n}' for k, n in zip(keys, (first, last)) if n is not None)} leave {rest} of "
               f"model.num_layers={num_layers} layers for the other {middle} stage(s) of parallel.pipeline={p}, "
               f"which do not split evenly: choose them so that the rest divides by "
               f"{middle or 'nothing (no stage left)'}")
        per = rest // middle if middle else 0
        stages = [first if first is not None else per] + [per] * (p - 2) + [last if last is not None else per]
        for name, n in ((keys[0], stages[0]), (keys[1], stages[-1]), ("each middle stage", per)):
            _check(n % v == 0, f"{name} holds {n} layers, which parallel.virtual_stages={v} chunks do not split "
                   f"evenly: choose a multiple of {v}")
        layers = [stages[c % p] // v for c in range(chunks)]
    elif embedding or loss:
        total = num_layers + embedding + loss
        _check(total % chunks == 0,
               f"model.num_layers={num_layers} plus the embedding and loss counted as layers "
               f"(parallel.account_for_*_in_pipeline_split) is {total}, not divisible by parallel.pipeline x "
               f"parallel.virtual_stages = {chunks}: choose a pipeline that divides {total}, or drop the accounting")
        layers = [total // chunks] * chunks
        layers[0] -= embedding
        layers[-1] -= loss
    else:
        what = (f"model.num_layers={num_layers}" if stack == num_layers else
                f"the {stack} layers after model.moe_first_dense_layers={first_dense}")
        _check(stack % chunks == 0,
               f"{what} is not divisible by parallel.pipeline * parallel.virtual_stages = {chunks}: choose layers "
               f"that split evenly into {chunks} chunks, or split unevenly with {keys[0]} and {keys[1]} "
               "(docs/features/pipeline-schedules.md)")
        layers = [stack // chunks] * chunks
        layers[0] += first_dense
    _check(min(layers) >= 1, f"the pipeline split gives a chunk no layer ({list(layers)} per chunk): every chunk "
           "needs at least one layer; change parallel.decoder_first/last_pipeline_num_layers or the pipeline")
    _check(layers[0] >= first_dense,
           f"the first pipeline chunk holds {layers[0]} layers, fewer than model.moe_first_dense_layers="
           f"{first_dense}, which run with the embedding on it: give the first stage at least {first_dense * v}")
    stacked = [n - (first_dense if c == 0 else 0) for c, n in enumerate(layers)]
    bad = [c for c, n in enumerate(stacked) if n % period]
    _check(not bad, f"a pipeline chunk holds whole groups of model.moe_layer_freq={period} layers (one MoE layer, "
           f"then dense ones), but chunk {bad[0] if bad else 0} would hold {stacked[bad[0]] if bad else 0} layers of "
           f"the stack: change the layers, the frequency or the pipeline so that every chunk holds a multiple of "
           f"{period} (after the dense first layers)")
    return StageSplit(tuple(layers), tuple(n // period for n in stacked))


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = ModelConfig()
    parallel: ParallelConfig = _may_change_on_resume(ParallelConfig())
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    checkpoint: CheckpointConfig = _may_change_on_resume(CheckpointConfig())

    def __post_init__(self):
        m, p = self.model, self.parallel
        _check(
            m.num_heads % p.tensor == 0,
            f"model.num_heads={m.num_heads} is not divisible by parallel.tensor={p.tensor}: "
            f"choose parallel.tensor from {_divisors(m.num_heads)}",
        )
        _check(
            m.kv_heads % p.tensor == 0,
            f"model.num_kv_heads={m.kv_heads} is not divisible by parallel.tensor={p.tensor}: "
            f"choose parallel.tensor from {_divisors(m.kv_heads)} or raise model.num_kv_heads",
        )
        _check(
            m.ffn_size % p.tensor == 0,
            f"the MLP width {m.ffn_size} is not divisible by parallel.tensor={p.tensor}: set model.ffn_hidden_size",
        )
        _check(
            not m.num_experts or p.folded_experts or m.moe_ffn_size % p.tensor == 0,
            f"each expert's width {m.moe_ffn_size} is split over parallel.tensor={p.tensor} and does not divide by "
            f"it: set model.moe_ffn_hidden_size to a multiple of {p.tensor} (or parallel.expert_tensor=1: whole "
            "experts)",
        )
        # The shared experts are one dense MLP split over 'tensor' even when the routed experts stay whole
        # (parallel.expert_tensor=1), where the expert width alone is not checked above.
        shared = m.moe_shared_experts * m.moe_ffn_size if m.num_experts else 0
        _check(
            shared % p.tensor == 0,
            f"the shared experts' MLP width {shared} (model.moe_shared_experts={m.moe_shared_experts} x the expert "
            f"width {m.moe_ffn_size}) is split over parallel.tensor={p.tensor} and does not divide by it: set "
            f"model.moe_ffn_hidden_size to a multiple of {p.tensor} (or change model.moe_shared_experts)",
        )
        _check(
            m.padded_vocab_size % p.tensor == 0,
            f"the padded vocabulary {m.padded_vocab_size} is not divisible by parallel.tensor={p.tensor}: "
            f"set model.make_vocab_size_divisible_by to a multiple of {p.tensor}",
        )
        _check(
            not p.sequence_parallel or m.seq_length % p.tensor == 0,
            f"sequence parallelism shards model.seq_length={m.seq_length} over parallel.tensor={p.tensor}: "
            "make the sequence length a multiple of the tensor size",
        )
        chunks = p.pipeline * p.virtual_stages
        _check(
            chunks <= m.num_layers,
            f"parallel.pipeline * parallel.virtual_stages = {chunks} is more than model.num_layers={m.num_layers}: "
            "every pipeline chunk needs at least one layer",
        )
        self.stage_split  # noqa: B018 - raises ConfigError naming the fix when the layers do not split
        if p.expert > 1:
            _check(m.num_experts > 0, f"parallel.expert={p.expert} needs an MoE model: set model.num_experts "
                   "(a multiple of parallel.expert) or parallel.expert=1")
            _check(
                m.num_experts % p.expert == 0,
                f"model.num_experts={m.num_experts} is not divisible by parallel.expert={p.expert}: choose "
                f"parallel.expert from {_divisors(m.num_experts)}",
            )
        if p.folded_experts:
            _check(m.num_experts > 0, "parallel.expert_tensor=1 spreads the experts over the tensor ranks: it needs "
                   "an MoE model (model.num_experts), or set parallel.expert_tensor=null")
            ranks = p.expert * p.tensor
            _check(m.num_experts % ranks == 0,
                   f"model.num_experts={m.num_experts} is not divisible by parallel.expert x parallel.tensor = "
                   f"{ranks}, the ranks parallel.expert_tensor=1 spreads whole experts over: change the experts or "
                   "the layout, or set parallel.expert_tensor=null")
        if p.expert_all_to_all == "ragged":
            _check(m.num_experts > 0 and m.moe_capacity_factor is None and (p.expert > 1 or p.folded_experts),
                   "parallel.expert_all_to_all=ragged sends dropless experts' rows by exact counts over the expert "
                   "ranks: it needs model.num_experts, model.moe_capacity_factor=null (capacity buffers are fixed-size "
                   "already) and parallel.expert > 1 or parallel.expert_tensor=1; else set "
                   "parallel.expert_all_to_all=padded")
        _check(not self.data.reset_attention_mask or m.attention_impl != "cudnn",
               "data.reset_attention_mask needs segment masks, which model.attention_impl=cudnn does not take here: "
               "use model.attention_impl=pallas or xla")
        if p.context > 1:
            self._check_context()
        if p.data is not None:
            self._check_batch(p.data)

    def _check_context(self) -> None:
        m, p = self.model, self.parallel
        c = p.context
        _check(
            m.seq_length % (2 * c) == 0,
            f"parallel.context={c} splits each sequence into 2 x {c} chunks (rank i holds chunks i and {2 * c - 1} - i, "
            f"which balances the causal attention work): model.seq_length={m.seq_length} must be a multiple of "
            f"{2 * c}",
        )
        _check(
            not p.sequence_parallel or m.seq_length % (c * p.tensor) == 0,
            f"sequence parallelism shards each context rank's {m.seq_length} / {c} tokens over parallel.tensor="
            f"{p.tensor}: make model.seq_length a multiple of {c * p.tensor}",
        )
        _check(m.attention_dropout == 0, "model.attention_dropout is not supported with parallel.context > 1 (the "
               "ring attention has no dropout): set model.attention_dropout=0 or parallel.context=1")
        _check(m.num_experts == 0, "mixture of experts is not supported with parallel.context > 1 yet: set "
               "parallel.context=1 or model.num_experts=0")
        _check(p.context_comm != "ring" or p.pipeline == 1,
               "parallel.context_comm=ring is not supported with a pipeline (the ring's collective-permutes would run "
               "inside the schedule's per-rank branches, where XLA's permute waits for every device): set "
               "parallel.context_comm=all_gather or auto")
        _check(m.attention_impl != "cudnn", "model.attention_impl=cudnn is not supported with parallel.context > 1 "
               "(the ring needs each block's log-sum-exp): use model.attention_impl=pallas or xla")

    def _check_batch(self, data: int) -> None:
        t, p = self.train, self.parallel
        mb = self._micro_batch_size(data)
        _check(
            t.global_batch_size % (data * mb) == 0,
            f"train.global_batch_size={t.global_batch_size} is not divisible by data parallel size {data} x "
            f"train.micro_batch_size={mb}: make the global batch a multiple of {data * mb}",
        )
        m = t.global_batch_size // (data * mb)
        if p.virtual_stages > 1 and p.pipeline > 1:
            _check(
                m >= p.pipeline,
                f"the {p.schedule} schedule with parallel.virtual_stages={p.virtual_stages} needs at least "
                f"parallel.pipeline={p.pipeline} micro batches, got {m} "
                f"(= global batch {t.global_batch_size} / (data {data} x micro batch {mb})): raise "
                f"train.global_batch_size or lower train.micro_batch_size",
            )

    def _micro_batch_size(self, data: int) -> int:
        if self.train.micro_batch_size is not None:
            return self.train.micro_batch_size
        return max(1, self.train.global_batch_size // data)

    @property
    def drops_tokens(self) -> bool:
        """Whether the MoE layers can drop assignments: a capacity factor, or a ragged exchange's receiving buffer
        smaller than the most a rank can get (parallel.expert_buffer_factor)."""
        return self.model.moe_capacity_factor is not None or self.parallel.expert_buffer_factor is not None

    @property
    def resolved(self) -> bool:
        """Whether the layout is complete: parallel.data and train.micro_batch_size set (by hand, or filled from
        the device count by `Config.for_devices`, which every entry point calls before building a step)."""
        return self.parallel.data is not None and self.train.micro_batch_size is not None

    @property
    def stage_split(self) -> StageSplit:
        """The layers of each pipeline chunk (`pipeline_split` of the model and parallel.decoder_*/account_* keys)."""
        m, p = self.model, self.parallel
        return pipeline_split(m.num_layers, p.pipeline, p.virtual_stages, p.decoder_first_pipeline_num_layers,
                              p.decoder_last_pipeline_num_layers, p.account_for_embedding_in_pipeline_split,
                              p.account_for_loss_in_pipeline_split, m.first_dense_layers, m.layer_period)

    @property
    def num_micro_batches(self) -> int:
        """Micro batches per step on each data rank: global batch / (data x micro batch). Needs `resolved`."""
        _check(self.resolved, "Config.num_micro_batches needs parallel.data and train.micro_batch_size: call "
               "Config.for_devices(num_devices) first, which fills them from the device count")
        return self.train.global_batch_size // (self.parallel.data * self.train.micro_batch_size)

    def for_devices(self, num_devices: int) -> Config:
        """The resolved config for `num_devices`: fills parallel.data from the device count (and
        train.micro_batch_size from the data size) and checks that the layout fits the devices."""
        p = self.parallel
        mp = p.pipeline * p.context * p.tensor
        if p.data is None:
            _check(
                num_devices % mp == 0,
                f"{num_devices} devices cannot be split into pipeline={p.pipeline} x context={p.context} x "
                f"tensor={p.tensor} groups: choose parallel.pipeline * parallel.context * parallel.tensor dividing "
                f"{num_devices}",
            )
            # dataclasses.replace runs every __post_init__ again (the batch checks need parallel.data)
            parallel = dataclasses.replace(p, data=num_devices // mp)
            return dataclasses.replace(self, parallel=parallel).for_devices(num_devices)
        _check(
            p.data * mp == num_devices,
            f"parallel.data * parallel.pipeline * parallel.context * parallel.tensor = {p.data} x {p.pipeline} x "
            f"{p.context} x {p.tensor} = {p.data * mp}, but there are {num_devices} devices: set "
            f"parallel.data={num_devices // mp} or parallel.data=null (use every device)" if num_devices % mp == 0 else
            f"parallel.data * parallel.pipeline * parallel.context * parallel.tensor = {p.data * mp} does not match "
            f"the {num_devices} devices: choose sizes whose product is {num_devices}",
        )
        if self.train.micro_batch_size is None:  # one micro batch per data rank
            train = dataclasses.replace(self.train, micro_batch_size=self._micro_batch_size(p.data))
            return dataclasses.replace(self, train=train)
        return self

    def to_dict(self) -> dict:
        return _to_dict(self)


def _to_dict(obj) -> dict:
    out = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        key = {a: k for k, a in _KEY_ALIASES.items()}.get(f.name, f.name)
        out[key] = _to_dict(v) if dataclasses.is_dataclass(v) else v
    return out


def may_change_on_resume(key: str) -> bool:
    """Whether a run resumed with `key` ('train.log_every', as YAML spells it) changed goes on as an uninterrupted
    one would: the key or its section was declared with `_may_change_on_resume`. Any other key, an unknown one
    too, makes the resumed run differ (train.config_changes flags it; train.steps is decided there)."""
    section, _, name = key.partition(".")
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if section not in sections:
        return False
    if sections[section].metadata.get(_RESUME):
        return True
    fields = {f.name: f for f in dataclasses.fields(type(sections[section].default))}
    field = fields.get(_KEY_ALIASES.get(name, name))
    return field is not None and bool(field.metadata.get(_RESUME))


def model_defining_fields() -> dict[str, str]:
    """ModelConfig field -> the value compared to tell two models apart (the field itself, or the resolved value
    named in `_defines_model`): parameters written for other values belong to another model. With model.arch=gpt2,
    model.seq_length is one too (the learned position table; checkpoint.check_same_model)."""
    return {f.name: f.metadata[_MODEL] or f.name for f in dataclasses.fields(ModelConfig) if _MODEL in f.metadata}
