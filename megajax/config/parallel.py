"""The parallel section: the mesh (data, pipeline, context, tensor, expert) and how a step uses it (the pipeline's
schedule and split, the experts' exchange, ZeRO and the overlap of reductions and gathers). Every check names the fix;
those that need another section are Config's (megajax/config/__init__.py)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from megajax.config.base import ConfigError, check, divisors

NODE_GPUS = 8  # the GPUs of a node that share NVLink, on every target here (H100, H200, A100 HGX)
HIERARCHICAL = ("a2a+ring", "a2a+all_gather")  # the context exchanges by all-to-alls in groups, and across them


def context_a2a_sizes(context: int, tensor: int, num_heads: int, node_gpus: int = NODE_GPUS) -> list[int]:
    """The all-to-all group sizes the hierarchical context_comm (a2a+ring, a2a+all_gather) can take: the divisors of
    `context` between 1 and it whose group, with its tensor ranks, fits in a node of `node_gpus` and splits the
    heads."""
    return [n for n in divisors(context)[1:-1] if tensor * n <= node_gpus and num_heads % (tensor * n) == 0]


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """The mesh (data, pipeline, context, tensor) and how it is used. data=None takes every device left over.

    expert: the expert-parallel size (Megatron's --expert-model-parallel-size). It divides the data ranks:
    the mesh's data axis is split into 'data' (outer, data / expert) x 'expert' (inner); the dense weights
    stay data-parallel over both, the experts are sharded over 'expert' and data-parallel over 'data'.

    context: the context-parallel size (Megatron's --context-parallel-size). Every sequence is split over the
    'context' ranks for every layer (rank i holds chunks i and 2c - 1 - i of 2c) and attention reaches the other
    ranks' keys and values by all-to-alls, a ring or an all-gather (megajax/model/context.py, ring.py)."""

    # The keys by concern: each title, and the field it starts at (megajax/config/base.py `concerns`)
    CONCERNS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("the mesh", "data"), ("tensor and sequence parallelism", "sequence_parallel"), ("experts", "expert_tensor"),
        ("context parallelism", "context_comm"), ("pipeline", "virtual_stages"),
        ("data parallelism: ZeRO and overlap", "data_parallel_sharding_strategy"))

    data: int | None = None  # data-parallel size (null: every device left over)
    pipeline: int = 1  # pipeline stages
    tensor: int = 1  # tensor-parallel size (Megatron's column/row-parallel layers)
    expert: int = 1  # expert-parallel size; divides data
    context: int = 1  # context-parallel size: every sequence split over this many ranks, attention by a ring

    sequence_parallel: bool = False  # shard the activations outside attention and the MLP over tensor
    # Sequence parallelism's all-gather and reduce-scatter as rings of ppermutes under the matmuls they feed
    # (Megatron's --tp-comm-overlap; megajax/model/collective_matmul.py); with a pipeline as chunked all-gathers
    # and reduce-scatters (a ppermute inside the schedule's per-rank branches deadlocks). Needs sequence_parallel.
    tp_comm_overlap: bool = False

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

    # How attention crosses the context ranks (Megatron's --cp-comm-type): ring = the keys and values passed one hop
    # per step under the previous block's compute (p2p); all_gather = every rank's keys and values at once, the
    # gradients reduce-scattered; a2a = all-to-alls that trade the sequence split for a split of the heads (Ulysses,
    # MaxText's "ulysses"): each rank attends over the whole sequence for num_heads / context of the heads, and one
    # all-to-all each way moves the queries, keys, values and output (needs num_heads divisible by tensor x
    # context). auto: ring without a pipeline, all_gather with one (a collective-permute inside the pipeline's
    # per-rank branches waits for every device of the mesh and deadlocks).
    # a2a+ring = both, as Megatron's hierarchical a2a+p2p and MaxText's usp: all-to-alls inside groups of
    # context_a2a_size adjacent context ranks (inside a node, with tensor) and a ring across the groups (between
    # nodes), each group's tokens being two of the ring's 2 x context / context_a2a_size chunks. a2a+all_gather =
    # the same groups with an all-gather across them in place of the ring: the hierarchical form with a pipeline.
    context_comm: Literal["auto", "ring", "all_gather", "a2a", "a2a+ring", "a2a+all_gather"] = "auto"
    # The hierarchical forms' all-to-all group: this many adjacent context ranks (Megatron's
    # --hierarchical-context-parallel-sizes first entry); it divides context and is less than it. null: the largest
    # that keeps tensor x it within a node of 8 GPUs and splits model.num_heads.
    context_a2a_size: int | None = None

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
    # Under a pipeline, where the embedding and the output layer live: true = each pipeline rank holds a slice of the
    # vocabulary (vocab-parallel over pipeline x tensor), and every rank looks up the first stage's tokens and
    # computes the last stage's logits and loss on its slice in lock step (megajax/parallel/pipeline/vocab.py): no
    # rank holds what only the first or the last stage reads, and the last stage's head work is spread over the
    # ranks, for two all-reduces of a micro batch's activations over the pipeline ranks at each end; false = every
    # rank holds the whole (tensor-sharded) embedding and output layer, the first stage embeds, the last computes
    # the loss. null: true where the padded vocabulary divides over pipeline x tensor and the tables' fp32 weights
    # and gradients on a rank outweigh the activations the lock step moves a step (docs/features/
    # pipeline-schedules.md).
    vocab_over_pipeline: bool | None = None

    # How far the data-parallel ranks (x context) shard the training state (Megatron's
    # --data-parallel-sharding-strategy; docs/features/fsdp.md): no_shard = every rank holds it all; optim = the
    # optimizer state (ZeRO-1, the distributed optimizer: Megatron's --use-distributed-optimizer); optim_grads = also
    # the gradients, reduce-scattered layer by layer in every micro batch's backward (ZeRO-2); optim_grads_params =
    # also the weights, each layer's all-gathered before its forward and again for its backward (ZeRO-3, fully
    # sharded data parallelism; with a pipeline, each rank's layers are gathered once a step in its schedule's idle
    # ticks and kept for the step, as torchtitan keeps them unsharded between micro batches under pipelining; ZeRO-2
    # and 3 run on every schedule but gpipe). The old key parallel.distributed_optimizer=true still reads as optim.
    data_parallel_sharding_strategy: Literal["no_shard", "optim", "optim_grads", "optim_grads_params"] = "no_shard"
    # Hybrid sharding (Megatron's --num-distributed-optimizer-instances, torchtitan's data_parallel_replicate_degree;
    # HSDP): the data ranks split into this many instances (outer: across nodes), each of which shards what the
    # strategy above shards over its own data_ranks / instances ranks (inner: inside a node, over NVLink) and holds
    # a whole replica of it; the instances all-reduce their gradient shards once a step. 1: one instance, the
    # strategy's shards span every data rank. Needs a sharding strategy; docs/features/fsdp.md.
    num_distributed_optimizer_instances: int = 1
    # Reduce the data-parallel gradients layer by layer under the last micro batch's backward (Megatron's
    # --overlap-grad-reduce). megajax/parallel/overlap.py: an all-reduce per layer, or with the distributed optimizer a
    # reduce-scatter. Off by default: with several micro batches it holds one to three times the gradients' bytes
    # more (docs/features/communication-overlap.md). With a pipeline (1f1b, interleaved): in each rank's idle cool-down
    # ticks, or rank 0's last backwards (across nodes set overlap_comm_ratio, below).
    overlap_grad_reduce: bool = False
    # Keep the weights as their optimizer shards between steps and all-gather them under the next forward
    # (Megatron's --overlap-param-gather). Needs the distributed optimizer (data_parallel_sharding_strategy optim or
    # more) and overlap_grad_reduce: the next step's
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

    def __post_init__(self):
        self._check_mesh()
        self._check_data_parallel()
        self._check_pipeline()

    def _check_mesh(self) -> None:
        """The sizes, the experts' layout and sequence parallelism."""
        for name in ("pipeline", "tensor", "virtual_stages", "expert", "context"):
            check(getattr(self, name) >= 1, f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        check(self.data is None or self.data >= 1, f"parallel.data must be >= 1 (or null), got {self.data}")
        check(self.expert_buffer_factor is None or self.expert_buffer_factor > 0,
              f"parallel.expert_buffer_factor must be positive or null (dropless), got {self.expert_buffer_factor}")
        check(self.expert_buffer_factor is None or self.expert_all_to_all == "ragged",
              "parallel.expert_buffer_factor sizes the ragged exchange's receiving buffer: set "
              "parallel.expert_all_to_all=ragged (or parallel.expert_buffer_factor=null)")
        check(self.overlap_comm_ratio >= 0, f"parallel.overlap_comm_ratio must be >= 0 (0: no cap), got "
              f"{self.overlap_comm_ratio}")
        check(
            not self.sequence_parallel or self.tensor > 1,
            "parallel.sequence_parallel=true needs parallel.tensor > 1 (it shards over the tensor axis)",
        )
        check(self.expert_tensor in (None, 1, self.tensor),
              f"parallel.expert_tensor={self.expert_tensor} must be null (= parallel.tensor), 1 (whole experts, "
              f"spread over parallel.expert x parallel.tensor ranks) or parallel.tensor={self.tensor}")
        check(not self.folded_experts or self.sequence_parallel,
              "parallel.expert_tensor=1 routes each tensor rank's sequence shard: set "
              "parallel.sequence_parallel=true (or parallel.expert_tensor=null)")
        if self.data is not None and self.data % self.expert:
            raise ConfigError(
                f"parallel.expert={self.expert} must divide parallel.data={self.data} (expert parallelism splits "
                f"the data-parallel ranks): choose parallel.expert from {divisors(self.data)}")

    def _check_data_parallel(self) -> None:
        """The overlapped reductions and gathers, and what the data ranks shard (ZeRO), against the schedule."""
        check(
            not self.overlap_grad_reduce or self.pipeline == 1 or self.schedule in ("1f1b", "interleaved"),
            f"parallel.overlap_grad_reduce=true reduces the gradients inside the schedule, in idle ticks or in each "
            f"chunk's last backward, which the {self.schedule} schedule does not run as one step (GPipe "
            f"differentiates its whole forward, zero_bubble splits off the weight gradients and fills the idle "
            f"ticks with them): use parallel.schedule=1f1b or interleaved, or set "
            f"parallel.overlap_grad_reduce=false",
        )
        r = self.num_distributed_optimizer_instances
        check(r >= 1, f"parallel.num_distributed_optimizer_instances must be >= 1, got {r}")
        check(r == 1 or self.shards_optimizer,
              f"parallel.num_distributed_optimizer_instances={r} replicates the sharded state over instances: set "
              "parallel.data_parallel_sharding_strategy to optim, optim_grads or optim_grads_params (or "
              "num_distributed_optimizer_instances=1)")
        if self.data is not None and r > 1:
            inner = self.data // self.expert
            if inner % r:
                raise ConfigError(
                    f"parallel.num_distributed_optimizer_instances={r} must divide parallel.data / parallel.expert = "
                    f"{self.data} / {self.expert} (the instances split the data ranks that replicate every weight): "
                    f"choose it from {divisors(inner)}")
            check(self.shard_ranks > 1,
                  f"parallel.num_distributed_optimizer_instances={r} leaves one data rank an instance, with nothing "
                  f"to shard over: choose it from {[x for x in divisors(inner) if self.data // x * self.context > 1]}")
        check(
            not self.overlap_param_gather or (self.shards_optimizer and self.overlap_grad_reduce)
            or self.shards_grads,
            "parallel.overlap_param_gather=true gathers the distributed optimizer's shards in the step that reduces "
            "the gradients under the backward: set parallel.data_parallel_sharding_strategy=optim and "
            "parallel.overlap_grad_reduce=true (or parallel.overlap_param_gather=false)",
        )
        check(
            not self.shards_grads or self.pipeline == 1 or self.schedule != "gpipe",
            f"parallel.data_parallel_sharding_strategy={self.data_parallel_sharding_strategy} reduce-scatters the "
            f"gradients in every backward of a chunk, which the gpipe schedule does not run as one step (it "
            f"differentiates its whole forward): use parallel.schedule=1f1b, interleaved or zero_bubble",
        )
        check(
            not self.tp_comm_overlap or self.sequence_parallel,
            "parallel.tp_comm_overlap=true overlaps sequence parallelism's all-gather and reduce-scatter with the "
            "matmuls: set parallel.sequence_parallel=true (with parallel.tensor > 1)",
        )

    def _check_pipeline(self) -> None:
        """The pipeline's split of the layers and its schedule."""
        for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
            value = getattr(self, name)
            check(value is None or (value >= 0 and self.pipeline > 1),
                  f"parallel.{name}={value} sets the layers of a pipeline stage: it needs parallel.pipeline > 1 "
                  "and a value >= 0 (or null: as many as the other stages)")
        check(not (self.account_for_embedding_in_pipeline_split or self.account_for_loss_in_pipeline_split)
              or self.pipeline > 1, "parallel.account_for_*_in_pipeline_split splits a pipeline: it needs "
              "parallel.pipeline > 1")
        check(not ((self.account_for_embedding_in_pipeline_split or self.account_for_loss_in_pipeline_split) and
                    (self.decoder_first_pipeline_num_layers is not None
                     or self.decoder_last_pipeline_num_layers is not None)),
              "parallel.account_for_*_in_pipeline_split and parallel.decoder_first/last_pipeline_num_layers both "
              "decide the stages' layers (as in Megatron): set one or the other")
        check(not self.vocab_over_pipeline or self.pipeline > 1,
              "parallel.vocab_over_pipeline=true spreads the embedding and the output layer over the pipeline ranks: "
              "it needs parallel.pipeline > 1 (or set it to null)")
        check(
            self.virtual_stages == 1 or self.schedule in ("interleaved", "zero_bubble"),
            f"parallel.virtual_stages={self.virtual_stages} needs parallel.schedule=interleaved (or zero_bubble)",
        )
        check(
            self.pipeline > 1 or (self.schedule in ("1f1b", "gpipe") and self.virtual_stages == 1),
            f"parallel.schedule={self.schedule} with parallel.virtual_stages={self.virtual_stages} schedules pipeline "
            f"stages, but parallel.pipeline=1: set parallel.pipeline > 1 (e.g. parallel.pipeline=2), or drop "
            f"parallel.schedule and parallel.virtual_stages",
        )

    @property
    def sharding_strategy(self) -> str:
        """What the data ranks shard (no_shard, optim, optim_grads or optim_grads_params)."""
        return self.data_parallel_sharding_strategy

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
    def shard_ranks(self) -> int:
        """The ranks the sharding strategy shards over: one instance's data ranks x context (parallel.data set)."""
        return self.data // self.num_distributed_optimizer_instances * self.context

    @property
    def folded_experts(self) -> bool:
        """Whole experts spread over 'expert' x 'tensor' (parallel.expert_tensor=1 with parallel.tensor > 1)."""
        return self.expert_tensor == 1 and self.tensor > 1

    @property
    def expert_folds(self) -> int:
        """The tensor ranks whole experts are folded over (`folded_experts`: each takes a sequence shard), else 1."""
        return self.tensor if self.folded_experts else 1

    @property
    def expert_ranks(self) -> int:
        """The ranks the experts are spread over, that the exchange crosses: expert x the folds."""
        return self.expert * self.expert_folds
