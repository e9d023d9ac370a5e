"""The configuration tree: frozen dataclasses whose checks name the fix, one module per concern.

| module | what |
|---|---|
| base.py | the errors that name the fix (`ConfigError`), `check`, the field helpers (`resumable`, `defines_model`) |
| model.py | the model section (`ModelConfig`) |
| parallel.py | the parallel section (`ParallelConfig`): the mesh, the pipeline, experts, ZeRO, overlap |
| run.py | the train, optim, data and checkpoint sections |
| io.py | YAML presets, `--set` overrides, old keys and `--help` |
| this file | the root (`Config`): the checks that need two sections, resolving for the devices, and field metadata |

Every section checks itself in `__post_init__`; `Config.__post_init__` checks what needs two sections
(heads vs tensor parallelism, layers vs pipeline stages, batch vs data parallelism). Checks that need the
device count run in `Config.for_devices`, which returns the resolved config every step is built from. The pipeline's
split of the layers lives beside the pipeline (megajax/parallel/pipeline/split.py).

A section's keys are flat (`model.moe_router_topk_scaling_factor`, not `model.moe.router...`), as Megatron's
arguments and Hugging Face's model configs spell them, and grouped by concern: each class's CONCERNS names its groups
(the model's architecture, precision and kernels, FP8, RoPE, multi-latent attention, experts and multi-token
prediction; the parallel section's mesh, tensor, experts, context, pipeline and data-parallel keys), which the
fields follow in order and `--help` and docs/reference/config.md print as titles.

A key's meaning is the comment on its line (`--help` and docs/reference/config.md print it). Two facts about a
key are field metadata, read by `may_change_on_resume` and `model_defining_fields` at the end of this file:
whether it may change when a run resumes without the run becoming another one, and whether it defines the model
a checkpoint holds.
"""

from __future__ import annotations

import dataclasses
import functools
import typing

from megajax.config.base import MODEL, RESUME, ConfigError, InputError, check, divisors, resumable
from megajax.config.model import ModelConfig
from megajax.config.parallel import HIERARCHICAL, ParallelConfig, context_a2a_sizes
from megajax.config.run import FP16_MAX, CheckpointConfig, DataConfig, OptimConfig, TrainConfig
from megajax.parallel.pipeline.split import StageSplit, pipeline_split

__all__ = ["FP16_MAX", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "InputError", "KEY_ALIASES",
           "ModelConfig", "OptimConfig", "ParallelConfig", "SPELLED", "SectionFields", "StageSplit", "TrainConfig",
           "may_change_on_resume", "model_defining_fields", "pipeline_split", "section_fields"]

# YAML keys that are Python keywords map onto attribute names with a trailing underscore.
KEY_ALIASES = {"async": "async_"}
SPELLED = {attr: key for key, attr in KEY_ALIASES.items()}  # attribute name -> its key where the two differ


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = ModelConfig()
    parallel: ParallelConfig = resumable(ParallelConfig())
    train: TrainConfig = TrainConfig()
    optim: OptimConfig = OptimConfig()
    data: DataConfig = DataConfig()
    checkpoint: CheckpointConfig = resumable(CheckpointConfig())

    def __post_init__(self):
        m, p = self.model, self.parallel
        self._check_tensor()
        chunks = p.pipeline * p.virtual_stages
        check(
            chunks <= m.num_layers,
            f"parallel.pipeline * parallel.virtual_stages = {chunks} is more than model.num_layers={m.num_layers}: "
            "every pipeline chunk needs at least one layer",
        )
        self.stage_split  # noqa: B018 - raises ConfigError naming the fix when the layers do not split
        self._check_experts()
        check(not self.data.reset_attention_mask or m.attention_impl != "cudnn",
              "data.reset_attention_mask needs segment masks, which model.attention_impl=cudnn does not take here: "
              "use model.attention_impl=pallas or xla")
        if p.context > 1:
            self._check_context()
        if p.data is not None:
            self._check_batch(p.data)

    def _check_tensor(self) -> None:
        """What the tensor (and with vocab_over_pipeline, pipeline) ranks split divides by them."""
        m, p = self.model, self.parallel
        check(
            m.num_heads % p.tensor == 0,
            f"model.num_heads={m.num_heads} is not divisible by parallel.tensor={p.tensor}: "
            f"choose parallel.tensor from {divisors(m.num_heads)}",
        )
        check(
            m.kv_heads % p.tensor == 0,
            f"model.num_kv_heads={m.kv_heads} is not divisible by parallel.tensor={p.tensor}: "
            f"choose parallel.tensor from {divisors(m.kv_heads)} or raise model.num_kv_heads",
        )
        check(
            m.ffn_size % p.tensor == 0,
            f"the MLP width {m.ffn_size} is not divisible by parallel.tensor={p.tensor}: set model.ffn_hidden_size",
        )
        check(
            not m.num_experts or p.folded_experts or m.moe_ffn_size % p.tensor == 0,
            f"each expert's width {m.moe_ffn_size} is split over parallel.tensor={p.tensor} and does not divide by "
            f"it: set model.moe_ffn_hidden_size to a multiple of {p.tensor} (or parallel.expert_tensor=1: whole "
            "experts)",
        )
        # The shared experts are one dense MLP split over 'tensor' even when the routed experts stay whole
        # (parallel.expert_tensor=1), where the expert width alone is not checked above.
        shared = m.moe_shared_experts * m.moe_ffn_size if m.num_experts else 0
        check(
            shared % p.tensor == 0,
            f"the shared experts' MLP width {shared} (model.moe_shared_experts={m.moe_shared_experts} x the expert "
            f"width {m.moe_ffn_size}) is split over parallel.tensor={p.tensor} and does not divide by it: set "
            f"model.moe_ffn_hidden_size to a multiple of {p.tensor} (or change model.moe_shared_experts)",
        )
        check(
            m.padded_vocab_size % p.tensor == 0,
            f"the padded vocabulary {m.padded_vocab_size} is not divisible by parallel.tensor={p.tensor}: "
            f"set model.make_vocab_size_divisible_by to a multiple of {p.tensor}",
        )
        check(
            not p.vocab_over_pipeline or m.padded_vocab_size % (p.pipeline * p.tensor) == 0,
            f"parallel.vocab_over_pipeline=true splits the padded vocabulary {m.padded_vocab_size} over parallel."
            f"pipeline x parallel.tensor = {p.pipeline * p.tensor} ranks, which does not divide it: set "
            f"model.make_vocab_size_divisible_by to a multiple of {p.pipeline * p.tensor} (or "
            f"parallel.vocab_over_pipeline=null)",
        )
        check(
            not p.sequence_parallel or m.seq_length % p.tensor == 0,
            f"sequence parallelism shards model.seq_length={m.seq_length} over parallel.tensor={p.tensor}: "
            "make the sequence length a multiple of the tensor size",
        )

    def _check_experts(self) -> None:
        """The experts' ranks, and the ragged exchange's needs."""
        m, p = self.model, self.parallel
        if p.expert > 1:
            check(m.num_experts > 0, f"parallel.expert={p.expert} needs an MoE model: set model.num_experts "
                  "(a multiple of parallel.expert) or parallel.expert=1")
            check(
                m.num_experts % p.expert == 0,
                f"model.num_experts={m.num_experts} is not divisible by parallel.expert={p.expert}: choose "
                f"parallel.expert from {divisors(m.num_experts)}",
            )
        if p.folded_experts:
            check(m.num_experts > 0, "parallel.expert_tensor=1 spreads the experts over the tensor ranks: it needs "
                  "an MoE model (model.num_experts), or set parallel.expert_tensor=null")
            ranks = p.expert * p.tensor
            check(m.num_experts % ranks == 0,
                  f"model.num_experts={m.num_experts} is not divisible by parallel.expert x parallel.tensor = "
                  f"{ranks}, the ranks parallel.expert_tensor=1 spreads whole experts over: change the experts or "
                  "the layout, or set parallel.expert_tensor=null")
        if p.expert_all_to_all == "ragged":
            check(m.num_experts > 0 and m.moe_capacity_factor is None and (p.expert > 1 or p.folded_experts),
                  "parallel.expert_all_to_all=ragged sends dropless experts' rows by exact counts over the expert "
                  "ranks: it needs model.num_experts, model.moe_capacity_factor=null (capacity buffers are fixed-size "
                  "already) and parallel.expert > 1 or parallel.expert_tensor=1; else set "
                  "parallel.expert_all_to_all=padded")

    def _check_context(self) -> None:
        m, p = self.model, self.parallel
        c = p.context
        check(
            m.seq_length % (2 * c) == 0,
            f"parallel.context={c} splits each sequence into 2 x {c} chunks (rank i holds chunks i and {2 * c - 1} - i, "
            f"which balances the causal attention work): model.seq_length={m.seq_length} must be a multiple of "
            f"{2 * c}",
        )
        check(
            not p.sequence_parallel or m.seq_length % (c * p.tensor) == 0,
            f"sequence parallelism shards each context rank's {m.seq_length} / {c} tokens over parallel.tensor="
            f"{p.tensor}: make model.seq_length a multiple of {c * p.tensor}",
        )
        check(p.context_comm != "ring" or p.pipeline == 1,
              "parallel.context_comm=ring is not supported with a pipeline (the ring's collective-permutes would run "
              "inside the schedule's per-rank branches, where XLA's permute waits for every device): set "
              "parallel.context_comm=all_gather or auto")
        check(p.context_comm != "a2a+ring" or p.pipeline == 1,
              "parallel.context_comm=a2a+ring is not supported with a pipeline (its ring's collective-permutes would "
              "run inside the schedule's per-rank branches, where XLA's permute waits for every device): set "
              "parallel.context_comm=a2a+all_gather (the same groups, an all-gather across them), a2a or all_gather")
        hierarchical = p.context_comm in HIERARCHICAL
        check(p.context_a2a_size is None or hierarchical,
              f"parallel.context_a2a_size={p.context_a2a_size} sizes the all-to-all groups of "
              "parallel.context_comm=a2a+ring or a2a+all_gather: set one of those (or parallel.context_a2a_size=null)")
        if hierarchical:
            n = self.context_a2a_size
            check(1 < n < c and c % n == 0,
                  f"parallel.context_a2a_size={n} must divide parallel.context={c} and lie between 1 and it (all of "
                  f"it is parallel.context_comm=a2a, 1 is {p.context_comm.removeprefix('a2a+')})")
            check(m.num_heads % (p.tensor * n) == 0,
                  f"parallel.context_comm={p.context_comm} gives each rank of an all-to-all group num_heads / (tensor "
                  f"x context_a2a_size) heads: model.num_heads={m.num_heads} must divide by {p.tensor * n} (set "
                  f"parallel.context_a2a_size to a divisor of {c} that it does)")
        check(m.attention_impl != "cudnn" or p.context_comm == "a2a",
              "model.attention_impl=cudnn takes parallel.context > 1 only with parallel.context_comm=a2a (the ring "
              "and the all-gather need each block's log-sum-exp, which cuDNN's call does not give): set "
              "parallel.context_comm=a2a, or model.attention_impl=pallas or xla")
        check(p.context_comm != "a2a" or m.num_heads % (p.tensor * c) == 0,
              f"parallel.context_comm=a2a gives each context rank num_heads / (tensor x context) heads of the whole "
              f"sequence: model.num_heads={m.num_heads} must divide by parallel.tensor x parallel.context = "
              f"{p.tensor * c} (or use parallel.context_comm=ring or all_gather)")

    def _check_batch(self, data: int) -> None:
        t, p = self.train, self.parallel
        mb = self._micro_batch_size(data)
        check(
            t.global_batch_size % (data * mb) == 0,
            f"train.global_batch_size={t.global_batch_size} is not divisible by data parallel size {data} x "
            f"train.micro_batch_size={mb}: make the global batch a multiple of {data * mb}",
        )
        m = t.global_batch_size // (data * mb)
        if p.virtual_stages > 1 and p.pipeline > 1:
            check(
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
    def context_a2a_size(self) -> int | None:
        """parallel.context_a2a_size resolved (context_comm a2a+ring or a2a+all_gather; else None): null takes the
        largest divisor of parallel.context below it that keeps tensor x it within a node and splits the heads, or 2."""
        m, p = self.model, self.parallel
        if p.context_comm not in HIERARCHICAL:
            return None
        if p.context_a2a_size is not None:
            return p.context_a2a_size
        return max(context_a2a_sizes(p.context, p.tensor, m.num_heads), default=2)

    @property
    def num_micro_batches(self) -> int:
        """Micro batches per step on each data rank: global batch / (data x micro batch). Needs `resolved`."""
        check(self.resolved, "Config.num_micro_batches needs parallel.data and train.micro_batch_size: call "
              "Config.for_devices(num_devices) first, which fills them from the device count")
        return self.train.global_batch_size // (self.parallel.data * self.train.micro_batch_size)

    def for_devices(self, num_devices: int) -> Config:
        """The resolved config for `num_devices`: fills parallel.data from the device count (and
        train.micro_batch_size from the data size) and checks that the layout fits the devices."""
        p = self.parallel
        mp = p.pipeline * p.context * p.tensor
        if p.data is None:
            check(
                num_devices % mp == 0,
                f"{num_devices} devices cannot be split into pipeline={p.pipeline} x context={p.context} x "
                f"tensor={p.tensor} groups: choose parallel.pipeline * parallel.context * parallel.tensor dividing "
                f"{num_devices}",
            )
            # dataclasses.replace runs every __post_init__ again (the batch checks need parallel.data)
            parallel = dataclasses.replace(p, data=num_devices // mp)
            return dataclasses.replace(self, parallel=parallel).for_devices(num_devices)
        check(
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
    section = section_fields(type(obj))
    return {key: _to_dict(getattr(obj, name)) if name in section.sections else getattr(obj, name)
            for name, key in section.keys}


@dataclasses.dataclass(frozen=True)
class SectionFields:
    """What building or writing a config section reads of its class: `typing.get_type_hints`, (attribute, key) per
    field, the attribute names, and those that are sections themselves."""

    hints: dict
    keys: tuple[tuple[str, str], ...]
    names: frozenset
    sections: frozenset


@functools.lru_cache(maxsize=None)
def section_fields(cls) -> SectionFields:
    """`SectionFields` of a config section class, computed once: evaluating the annotations is most of building a
    config, and one is built for every layout the planner or the layout matrix enumerates."""
    hints, names = typing.get_type_hints(cls), tuple(f.name for f in dataclasses.fields(cls))
    return SectionFields(hints, tuple((n, SPELLED.get(n, n)) for n in names), frozenset(names),
                         frozenset(n for n in names if dataclasses.is_dataclass(hints[n])))


def may_change_on_resume(key: str) -> bool:
    """Whether a run resumed with `key` ('train.log_every', as YAML spells it) changed goes on as an uninterrupted
    one would: the key or its section was declared with `resumable`. Any other key, an unknown one
    too, makes the resumed run differ (train.config_changes flags it; train.steps is decided there)."""
    section, _, name = key.partition(".")
    sections = {f.name: f for f in dataclasses.fields(Config)}
    if section not in sections:
        return False
    if sections[section].metadata.get(RESUME):
        return True
    fields = {f.name: f for f in dataclasses.fields(type(sections[section].default))}
    field = fields.get(KEY_ALIASES.get(name, name))
    return field is not None and bool(field.metadata.get(RESUME))


def model_defining_fields() -> dict[str, str]:
    """ModelConfig field -> the value compared to tell two models apart (the field itself, or the resolved value
    named in `defines_model`): parameters written for other values belong to another model. With model.arch=gpt2,
    model.seq_length is one too (the learned position table; checkpoint.check_same_model)."""
    return {f.name: f.metadata[MODEL] or f.name for f in dataclasses.fields(ModelConfig) if MODEL in f.metadata}
