"""Every layout the config accepts trains and equals one device.

The space: every (data, pipeline, tensor) with data x pipeline x tensor in {1, 2, 4, 6, 8} devices (data = 1
included), sequence parallelism on and off (t > 1), what the data ranks shard (d > 1: nothing, the optimizer state
(the distributed optimizer, ZeRO-1), also the gradients (ZeRO-2; with a pipeline, on every schedule but GPipe) and
without a pipeline also the weights (ZeRO-3)), GPT-2,
Llama with grouped-query attention and DeepSeek-V3's kind (multi-latent attention, sigmoid group-limited routing),
every schedule (p > 1), and the model dense or mixture-of-experts (8
dropless experts, top 2) with every expert-parallel size dividing data, and with sequence parallelism the
collective matmuls of parallel.tp_comm_overlap (rings; chunks on a pipeline) on and off,
and with data > 1 the gradient reduction overlapped with the backward (parallel.overlap_grad_reduce: without a
pipeline, or inside the schedule with 1f1b and interleaved) on and off, and with the distributed optimizer the
weights gathered under the forward too (parallel.overlap_param_gather), and dropout on the residual branches and
the attention probabilities (a hash of each element's position: the same entries dropped on every layout) or none.
`test_the_space_is_accepted` checks the whole space against the config (cheap); `test_layout_matches_one_device`
trains each layout for two steps and compares the losses and gradient norms with one device (fp32, relative 1e-4).
The default run covers every (d, p, t) triple once but a few whose every feature another default case has
(SLOW_TRIPLES), with the features rotated so that each appears on and off (data = 1 with tensor > 1 with and
without sequence parallelism, and with a pipeline, among them); `-m slow` runs the rest.
"""

from __future__ import annotations

import itertools
import pathlib

import numpy as np
import pytest

from megajax.config import ConfigError, pipeline_split

from conftest import run_steps, shared_across_workers, small_config

STEPS = 2
DEVICE_COUNTS = (1, 2, 4, 6, 8)
# One model for every layout: 24 layers split into 1, 2, 3, 4, 6 or 8 stages (and 2 interleaved chunks
# per rank up to p = 6); heads, kv heads (48 over 24: grouped-query attention), the MLP, the padded
# vocabulary (384) and the sequence (24, for sequence parallelism) divide by every tensor size (1-8);
# 24 sequences divide over every data size.
SIZE = {"model.num_layers": 24, "model.hidden_size": 96, "model.seq_length": 24, "model.ffn_hidden_size": 384}
ARCHS = {
    "gpt2": {**SIZE, "model.num_heads": 24},
    "llama": {**SIZE, "model.num_heads": 48, "model.num_kv_heads": 24, "model.arch": "llama"},
    # DeepSeek-V3's kind: multi-latent attention, and in an MoE model a dense first layer (MOE_EXTRA), then sigmoid
    # routing within the best of 2 groups, scaled weights and a shared expert
    "deepseek": {**SIZE, "model.num_heads": 24, "model.arch": "llama", "model.multi_latent_attention": True,
                 "model.q_lora_rank": 32, "model.kv_lora_rank": 16, "model.qk_head_dim": 4,
                 "model.qk_pos_emb_head_dim": 4, "model.v_head_dim": 4, "model.moe_router_score_function": "sigmoid",
                 "model.moe_router_num_groups": 2, "model.moe_router_group_topk": 1,
                 "model.moe_router_topk_scaling_factor": 2.5, "model.moe_shared_experts": 1},
}
BATCH = 24
MOE = {"model.num_experts": 8, "model.experts_per_token": 2, "model.moe_ffn_hidden_size": 48}
MOE_MICRO_BATCH = 3
# DeepSeek's MoE model has a dense first layer before the 24 the pipeline splits
MOE_EXTRA = {"deepseek": {"model.num_layers": 25, "model.moe_first_dense_layers": 1}}
DROPOUT = {"model.dropout": 0.1, "model.attention_dropout": 0.1}


def triples() -> list[tuple[int, int, int]]:
    """Every (data, pipeline, tensor) with a product in DEVICE_COUNTS."""
    return [(d, p, t) for n in DEVICE_COUNTS for d in range(1, n + 1) for p in range(1, n + 1)
            for t in range(1, n + 1) if d * p * t == n]


def schedules(p: int) -> list[tuple[str, int]]:
    if p == 1:
        return [("1f1b", 1)]
    out = [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1)]
    if 24 % (2 * p) == 0:
        out += [("interleaved", 2), ("zero_bubble", 2)]
    return out


def experts(d: int) -> list[int]:
    """The model kinds at data size d: 0 (dense), else the expert-parallel size of an MoE model."""
    return [0] + [e for e in range(1, d + 1) if d % e == 0 and MOE["model.num_experts"] % e == 0]


def folds(ep: int, t: int, sp: bool) -> tuple[int, ...]:
    """parallel.expert_tensor=1 (whole experts over 'expert' x 'tensor'): 0 off, and where it applies (an MoE model
    with sequence parallelism whose experts divide over ep x t ranks) 1 dropless, 2 with capacity buffers."""
    return (0, 1, 2) if ep and sp and MOE["model.num_experts"] % (ep * t) == 0 else (0,)


def exchanges(ep: int, fold: int, ring: bool) -> tuple[bool, ...]:
    """parallel.expert_all_to_all=ragged (the routed rows alone, not padded blocks): off, and on where dropless rows
    cross devices (expert parallelism or folded experts, without capacity buffers) and the collective matmuls are
    off (they move the attention's and dense MLP's activations, not the experts' rows)."""
    return (False, True) if (ep > 1 or fold == 1) and fold != 2 and not ring else (False,)


# Folded experts, dropless or with capacity buffers: a factor of experts / k gives every expert room for every
# token (no drops), so the layout still equals the dropless reference.
FOLD = {1: {"parallel.expert_tensor": 1},
        2: {"parallel.expert_tensor": 1,
            "model.moe_capacity_factor": MOE["model.num_experts"] / MOE["model.experts_per_token"]}}


def splits(arch: str, p: int, v: int, ep: int) -> tuple[dict, ...]:
    """The pipeline splits: even ({}), and uneven where the model's layers allow (config.pipeline_split): the first
    stage lighter by v layers with parallel.decoder_first_pipeline_num_layers (and the last stage's layers where the
    middle stages must be even too), and Megatron's accounting of the embedding and the loss as a layer each."""
    if p == 1:
        return ({},)
    layers = (MOE_EXTRA.get(arch, {}) if ep else {}).get("model.num_layers", SIZE["model.num_layers"])
    dense = layers - SIZE["model.num_layers"]
    stage = SIZE["model.num_layers"] // p + dense
    keys = ("parallel.decoder_first_pipeline_num_layers", "parallel.decoder_last_pipeline_num_layers")
    candidates = [dict(zip(keys, pair)) for less in (v, 2 * v) for pair in (
        (stage - less, None), (stage - less, stage - less), (stage - less, layers - (p - 1) * stage + less))]
    candidates += [{"parallel.account_for_embedding_in_pipeline_split": True,
                    "parallel.account_for_loss_in_pipeline_split": True},
                   {"parallel.account_for_loss_in_pipeline_split": True}]
    out, first_last = [{}], False
    for extra in candidates:
        first, last = extra.get(keys[0]), extra.get(keys[1])
        if (first_last and keys[0] in extra) or (last is not None and last < 1):
            continue
        try:
            split = pipeline_split(layers, p, v, first, last, extra.get(
                "parallel.account_for_embedding_in_pipeline_split", False),
                extra.get("parallel.account_for_loss_in_pipeline_split", False), dense)
        except ConfigError:
            continue
        if not split.even:
            out.append({k: val for k, val in extra.items() if val is not None})
            first_last = first_last or keys[0] in extra
    return tuple(out[:3])


STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")  # zero = the index: ZeRO-0 to ZeRO-3


def zeros(d: int, p: int, schedule: str) -> tuple[int, ...]:
    """The ZeRO levels (STRATEGIES' indices) at data size d: ZeRO-2 and ZeRO-3 without a pipeline and on the schedules
    that reduce inside their backwards (all but GPipe)."""
    if d == 1:
        return (0,)
    return (0, 1, 2, 3) if p == 1 or schedule != "gpipe" else (0, 1)


def instances(d: int, ep: int, zero: int) -> tuple[int, ...]:
    """Hybrid sharding's instances (parallel.num_distributed_optimizer_instances): 1, and 2 where something is
    sharded (ZeRO-1 to 3) and the data ranks split into two instances of two or more ranks each (whose experts,
    with expert parallelism, divide them)."""
    return (1, 2) if zero and d % (2 * max(ep, 1)) == 0 and d > 2 else (1,)


def case(arch, d, p, t, sp, zero, schedule, v, ep=0, ring=False, overlap=0, fold=0, ragged=False, split=None,
         vocab=True, replicas=1, dropout=False) -> dict:
    # p micro batches through a pipeline (the fewest every schedule takes); without one, 2 or 3 per data
    # rank, so gradient accumulation runs on every layout too. MoE: micro batches of MOE_MICRO_BATCH where the
    # layout's data and pipeline allow it (one reference for them: the balancing loss is per micro batch)
    mb = BATCH // (d * p) if p > 1 else max(1, BATCH // (2 * d))
    if ep and (BATCH // d) % MOE_MICRO_BATCH == 0 and BATCH // d // MOE_MICRO_BATCH >= p:
        mb = MOE_MICRO_BATCH
    return {"arch": arch, "moe": ep > 0, "n": d * p * t, "sets": {
        **ARCHS[arch], **(DROPOUT if dropout else {}), **(MOE if ep else {}), **(MOE_EXTRA.get(arch, {}) if ep else {}),
        **FOLD.get(fold, {}),
        **({"parallel.expert_all_to_all": "ragged"} if ragged else {}), **(split or {}),
        "train.global_batch_size": BATCH, "train.micro_batch_size": mb,
        "parallel.data": d, "parallel.pipeline": p, "parallel.tensor": t, "parallel.expert": max(ep, 1),
        "parallel.sequence_parallel": sp, "parallel.data_parallel_sharding_strategy": STRATEGIES[zero],
        "parallel.num_distributed_optimizer_instances": replicas,
        "parallel.tp_comm_overlap": ring,
        "parallel.overlap_grad_reduce": overlap > 0, "parallel.overlap_param_gather": overlap == 2,
        "parallel.schedule": schedule, "parallel.virtual_stages": v,
        # a pipeline's embedding and output layer over its ranks, or whole on every rank
        "parallel.vocab_over_pipeline": vocab if p > 1 else None}}


def overlaps(d: int, p: int, schedule: str, zero: int) -> tuple[int, ...]:
    """The overlap levels: 0 off, 1 parallel.overlap_grad_reduce (with data > 1 and a schedule that runs it), 2
    with parallel.overlap_param_gather too (with the distributed optimizer). ZeRO-2 always reduces in the backward
    (gathering or not); ZeRO-3 always gathers too."""
    if not (d > 1 and (p == 1 or schedule in ("1f1b", "interleaved"))):
        return (0,)
    return {0: (0, 1), 1: (0, 1, 2), 2: (0, 2), 3: (0,)}[zero]


def space() -> list[dict]:
    """The whole configuration space."""
    out = []
    for d, p, t in triples():
        for arch, sp, zero, (schedule, v), ep in itertools.product(
                ARCHS, (False, True) if t > 1 else (False,), range(4), schedules(p), experts(d)):
            if zero not in zeros(d, p, schedule):
                continue
            for ring, overlap, fold in itertools.product((False, True) if sp else (False,),
                                                         overlaps(d, p, schedule, zero), folds(ep, t, sp)):
                for ragged, split, vocab, r, dropout in itertools.product(
                        exchanges(ep, fold, ring), splits(arch, p, v, ep), (True, False) if p > 1 else (True,),
                        instances(d, ep, zero), (False, True)):
                    out.append(case(arch, d, p, t, sp, zero, schedule, v, ep, ring, overlap, fold, ragged, split,
                                    vocab, r, dropout))
    return out


# The MoE layouts, (d, p, t) -> expert-parallel size: without expert parallelism on a 1F1B pipeline folded over
# 'tensor' (its triple in SLOW_TRIPLES; MoE on zero_bubble compiled for 56 s, test_moe runs it with -m slow; the
# unfolded one on a 6-stage 1F1B pipeline, 61 s, runs with -m slow);
# experts over all data ranks (with tensor and sequence parallelism and ZeRO-3, folded over 'expert' x 'tensor',
# dropless) and over some of them (d 4, e 2, with an interleaved pipeline). Suite time: the experts over 2 data ranks
# alone (d 2 e 2, t 1, p 1), over 8, and with a GPipe pipeline (d 2 e 2 p 2 t 2, 71 s) run with -m slow. The rows
# cross the expert ranks by exact counts (parallel.expert_all_to_all=ragged) with tensor parallelism, on an
# interleaved pipeline, and folded over 'tensor' alone on a 1F1B pipeline (its counts' cumulative sums once
# deadlocked there).
DEFAULT_MOE = {(1, 2, 2): 1, (2, 1, 2): 2, (4, 2, 1): 2}
# and their models: Mixtral's llama MoE (suite time: DeepSeek's MoE model, its dense first layer on the first stage,
# compiled its latent attention for 35 s more on the interleaved pipeline; its pipelines run with -m slow)
DEFAULT_MOE_ARCH = {(1, 2, 2): "llama", (2, 1, 2): "llama", (4, 2, 1): "llama"}
# (sequence parallelism, its rings) where the rotation below would not give expert parallelism sequence parallelism
DEFAULT_SP = {(2, 1, 2): (True, False)}
DEFAULT_RAGGED = {(1, 2, 2), (2, 1, 2), (4, 2, 1)}
# What the data ranks shard (STRATEGIES' index); ZeRO-3 on a 1F1B pipeline (ZeRO-2 on an interleaved one: HUNG);
# without a pipeline: ZeRO-3 with experts
# over all data ranks and tensor parallelism, and with sequence parallelism's rings; ZeRO-2 gathering its weights
# once and not, with tensor parallelism; ZeRO-1 gathering and not; and nothing sharded, reduced in the backward.
DEFAULT_ZERO = {(2, 1, 1): 2, (2, 1, 2): 3, (4, 1, 1): 1, (2, 1, 3): 2, (3, 1, 2): 3, (6, 1, 1): 1, (2, 1, 4): 2,
                (4, 1, 2): 3, (8, 1, 1): 0, (3, 2, 1): 3}


# The default run's uneven pipeline stages (splits' index 1; the rest are even): one per schedule (GPipe with data
# and tensor parallelism, 1F1B, interleaved over 3 stages, zero_bubble over 4).
# Suite time: an uneven split compiles a cond around every layer slot (MoE: DeepSeek's 1F1B one took 31 s more
# than its even split), so the others, DeepSeek's MoE model with its dense first layer counted on the first stage
# among them, run with -m slow. Megatron's accounting of the embedding and the loss makes the 24 layers uneven
# nowhere (26 over 2 chunks is 12 and 12): test_checkpoint trains it.
DEFAULT_SPLIT = {(2, 2, 2): 1, (3, 2, 1): 1, (2, 3, 1): 1, (1, 4, 1): 1}
# Triples the rotation reaches whose features other default cases all have, run with -m slow (suite time, 176 s):
# tensor 2 with sequence parallelism alone, a 2-stage zero_bubble pipeline alone (zero_bubble: p 4 here, p 2 in
# test_pipeline), interleaved with tensor 3 (interleaved: p 3 uneven), 4 stages x tensor 2 with sequence
# parallelism (data 1 with a pipeline and tensor: p 2 x t 2 and t 4), ZeRO-1 on GPipe (and on d 2 x p 2 x t 2), and
# GPipe over 3 stages with the collective matmuls (GPipe with them: p 2 x t 4 and d 2 x p 2 x t 2), and 8 stages
# (the most the default run pipelines is 6; test_schedule builds and checks every schedule at p 8).
# Pipelines whose embedding and output layer stay whole on every rank (parallel.vocab_over_pipeline=false; the rest
# spread them over the ranks, DeepSeek's with its dense first layer, GPT-2's tied table, every schedule). Split, with
# the idle ticks' reductions of parallel.overlap_grad_reduce (ZeRO-0/1) d 2 x p 3 and d 2 x p 4 failed the CPU
# runtime's collective-order check (XLA moved the lock step's collectives past them): whole here, and null never
# picks that combination.
DEFAULT_WHOLE_VOCAB = {(2, 2, 2), (1, 2, 2), (2, 3, 1), (2, 4, 1)}
# Hybrid sharding (two instances of the sharded state): ZeRO-1 reduced in the backward over three data ranks an
# instance, ZeRO-3 with tensor parallelism, and ZeRO-1 gathering under the forward on an interleaved pipeline with
# experts over the two data ranks of an instance.
DEFAULT_INSTANCES = {(6, 1, 1): 2, (4, 1, 2): 2, (4, 2, 1): 2}
# Dropout (DROPOUT) on every schedule (a mask follows its layer's global index and its token's position, not the
# slot, rank or micro batch that holds them): on uneven stages, with the tables over the pipeline and whole, with
# DeepSeek's latent attention and the collective matmuls' rings (GPipe), and MoE folded over 'tensor' with ZeRO-3 and
# over the expert ranks of an interleaved pipeline. (Suite time: the rest, e.g. DeepSeek's on 1F1B, +17 s, -m slow.)
DEFAULT_DROPOUT = {(1, 4, 1), (2, 1, 2), (4, 2, 1), (1, 2, 4), (2, 4, 1)}
# Suite time (the default run within its budget, docs/development.md): tensor 6 and 6 stages alone (the other sizes'
# code paths), and MoE without expert parallelism, folded over 'tensor' on a 1F1B pipeline (48 s; test_moe's folded
# experts route per sequence shard by default, and the default run here trains folded experts without a pipeline).
SLOW_TRIPLES = {(1, 1, 2), (1, 2, 1), (1, 2, 3), (1, 4, 2), (2, 2, 1), (1, 3, 2), (1, 8, 1), (1, 1, 6), (1, 6, 1),
                (1, 2, 2)}


def default_cases() -> list[dict]:
    """One case per (d, p, t) but one device's, features rotated so that each value appears in the default run (MoE:
    DEFAULT_MOE)."""
    out = []
    for i, (d, p, t) in enumerate(triples()):
        if (d, p, t) == (1, 1, 1):  # one device: the reference's own program (suite time; -m slow runs it)
            continue
        options = [o for o in schedules(p) if o != ("zero_bubble", 2)]  # (test_pipeline runs it by default)
        schedule, v = options[i % len(options)]
        ep = DEFAULT_MOE.get((d, p, t), 0)
        sp = t > 1 and (i // 2) % 2 == 0
        sp, ring = DEFAULT_SP.get((d, p, t), (sp, sp and i % 2 == 0))
        zero = DEFAULT_ZERO.get((d, p, t), int(d > 1 and i % 3 != 1))
        levels = overlaps(d, p, schedule, zero)
        arch = DEFAULT_MOE_ARCH[(d, p, t)] if ep else tuple(ARCHS)[i % len(ARCHS)]
        options = splits(arch, p, v, ep)
        split = options[DEFAULT_SPLIT.get((d, p, t), 0)] if len(options) > 1 else {}
        out.append(case(arch, d, p, t, sp, zero, schedule, v, ep, ring=ring,
                        overlap=0 if i % 3 == 2 or len(levels) == 1 else levels[1 + (i // 7) % (len(levels) - 1)],
                        fold=folds(ep, t, sp)[:2][-1], ragged=(d, p, t) in DEFAULT_RAGGED, split=split,
                        vocab=(d, p, t) not in DEFAULT_WHOLE_VOCAB,
                        replicas=DEFAULT_INSTANCES.get((d, p, t), 1) if zero else 1,
                        dropout=(d, p, t) in DEFAULT_DROPOUT))
    return [c for c in out if triple(c) not in SLOW_TRIPLES]


def triple(c: dict) -> tuple[int, int, int]:
    s = c["sets"]
    return s["parallel.data"], s["parallel.pipeline"], s["parallel.tensor"]


def name(c: dict) -> str:
    s = c["sets"]
    d, p, t = triple(c)
    experts = f"e{s['parallel.expert']}" if c["moe"] else ""
    return (f"{c['arch']}{'-moe' if c['moe'] else ''}-d{d}{experts}p{p}t{t}"
            f"{'-sp' if s['parallel.sequence_parallel'] else ''}"
            + (f"-zero{STRATEGIES.index(s['parallel.data_parallel_sharding_strategy'])}"
               if s["parallel.data_parallel_sharding_strategy"] != "no_shard" else "") +
            f"{'-ring' if s['parallel.tp_comm_overlap'] else ''}"
            f"{'-overlap' if s['parallel.overlap_grad_reduce'] else ''}"
            f"{'-gather' if s['parallel.overlap_param_gather'] else ''}"
            f"{'-fold' if s.get('parallel.expert_tensor') == 1 else ''}"
            f"{'cap' if s.get('parallel.expert_tensor') == 1 and s.get('model.moe_capacity_factor') else ''}"
            f"{'-ragged' if s.get('parallel.expert_all_to_all') == 'ragged' else ''}"
            + "".join(f"-{tag}{s[k]}" for tag, k in (("first", "parallel.decoder_first_pipeline_num_layers"),
                                                     ("last", "parallel.decoder_last_pipeline_num_layers")) if k in s)
            + ("-embed" if s.get("parallel.account_for_embedding_in_pipeline_split") else "")
            + ("-loss" if s.get("parallel.account_for_loss_in_pipeline_split") else "")
            + ("-whole" if s.get("parallel.vocab_over_pipeline") is False else "")
            + (f"-hsdp{s['parallel.num_distributed_optimizer_instances']}"
               if s.get("parallel.num_distributed_optimizer_instances", 1) > 1 else "")
            + ("-dropout" if s.get("model.dropout") else "")
            + (f"-{s['parallel.schedule']}v{s['parallel.virtual_stages']}" if p > 1 else ""))


# The layouts that hung on CPU devices until the pipeline's ticks ran their collectives one at a time
# (sharding.CollectiveOrder): the interleaved schedule with tensor 2 and sequence parallelism, alone and with data 2,
# ZeRO-2 and the overlapped reduction (tests/test_divergence.py runs each in 20 fresh processes, -m slow). The default
# run trains the second (suite time: the first, 15 s, runs with -m slow) and checks their class in every compiled
# program (conftest.assert_collectives_ordered) and over the guard's combinations below.
HUNG = [case("gpt2", 1, 2, 2, True, 0, "interleaved", 2), case("gpt2", 2, 2, 2, True, 2, "interleaved", 2, overlap=1)]
DEFAULT = default_cases() + HUNG[1:]
_DEFAULT_NAMES = {name(c) for c in DEFAULT}
SPACE = space()
CASES = DEFAULT + [c for c in SPACE if name(c) not in _DEFAULT_NAMES]  # (the first of HUNG is in the space)


def zero_of(sets: dict) -> int:
    return STRATEGIES.index(sets["parallel.data_parallel_sharding_strategy"])


def test_the_space_is_accepted():
    """Every layout of the space passes the config's checks, and the default run covers what it must."""
    for c in SPACE:
        cfg = small_config(**c["sets"]).for_devices(c["n"])
        assert cfg.num_micro_batches * cfg.parallel.data * cfg.train.micro_batch_size == BATCH
    assert len(triples()) == 29 and len({triple(c) for c in DEFAULT}) == 28 - len(SLOW_TRIPLES)
    for k, slow in enumerate((set(), {6, 8}, {6})):  # every data size, and every pipeline and tensor size but these
        assert {triple(c)[k] for c in DEFAULT} == {x[k] for x in triples()} - slow
    assert REPRESENTATIVE <= {name(c) for c in CASES} - {name(c) for c in DEFAULT}
    data1 = [c["sets"] for c in DEFAULT if c["sets"]["parallel.data"] == 1 and c["sets"]["parallel.tensor"] > 1]
    assert {s["parallel.sequence_parallel"] for s in data1} == {False, True}
    assert any(s["parallel.pipeline"] > 1 for s in data1)
    assert {c["sets"]["parallel.sequence_parallel"] for c in DEFAULT} == {False, True}
    assert {zero_of(c["sets"]) for c in DEFAULT} == {0, 1, 2, 3}
    fsdp = [c["sets"] for c in DEFAULT if zero_of(c["sets"]) >= 2]
    assert {zero_of(s) for s in fsdp if s["parallel.tensor"] > 1} == {2, 3}, "ZeRO-2 and ZeRO-3 with tensor"
    assert any(zero_of(s) == 3 and s["parallel.sequence_parallel"] for s in fsdp), "ZeRO-3 with sequence parallelism"
    assert {s["parallel.overlap_param_gather"] for s in fsdp if zero_of(s) == 2} == {False, True}
    assert any(zero_of(c["sets"]) == 3 and c["moe"] and c["sets"]["parallel.expert"] > 1 for c in DEFAULT)
    assert any(zero_of(c["sets"]) == 2 and c["sets"]["parallel.pipeline"] > 1 for c in DEFAULT), "ZeRO-2 pipelined"
    assert any(zero_of(c["sets"]) == 3 and c["sets"]["parallel.pipeline"] > 1 for c in DEFAULT), "ZeRO-3 pipelined"
    assert {c["sets"]["parallel.schedule"] for c in SPACE if zero_of(c["sets"]) >= 2 and c["sets"]["parallel.pipeline"]
            > 1} == {"1f1b", "interleaved", "zero_bubble"}, "ZeRO-2/3 on every schedule but GPipe (-m slow)"
    sp = [c["sets"] for c in DEFAULT if c["sets"]["parallel.sequence_parallel"]]
    assert {(s["parallel.pipeline"] > 1, s["parallel.tp_comm_overlap"]) for s in sp} == {
        (False, False), (False, True), (True, False), (True, True)}, "SP with and without the collective matmuls"
    overlapped = [(s["parallel.pipeline"], s["parallel.schedule"], zero_of(s) > 0)
                  for s in (c["sets"] for c in DEFAULT) if s["parallel.overlap_grad_reduce"]]
    assert {p > 1 for p, _, _ in overlapped} == {False, True}, "the overlapped reduction with and without a pipeline"
    assert {sched for p, sched, _ in overlapped if p > 1} == {"1f1b", "interleaved"}
    assert {zero for p, _, zero in overlapped if p > 1} == {False, True}, "all-reduced and scattered on a pipeline"
    zero_overlapped = [(s["parallel.pipeline"] > 1, s["parallel.overlap_param_gather"])
                       for s in (c["sets"] for c in DEFAULT)
                       if s["parallel.overlap_grad_reduce"] and zero_of(s) == 1]
    assert set(zero_overlapped) == {(False, False), (False, True), (True, False), (True, True)}, \
        "the distributed optimizer's shards gathered under the forward and not, with and without a pipeline"
    assert {c["sets"]["parallel.schedule"] for c in DEFAULT} == {"gpipe", "1f1b", "interleaved", "zero_bubble"}
    spread = [c for c in DEFAULT if c["sets"]["parallel.vocab_over_pipeline"]]
    assert {c["sets"]["parallel.schedule"] for c in spread} == {"gpipe", "1f1b", "interleaved", "zero_bubble"}
    assert {c["arch"] for c in spread} == set(ARCHS), "the vocabulary over the pipeline, tied and with dense layers"
    assert any(c["moe"] and c["arch"] == "deepseek" and c["sets"]["parallel.vocab_over_pipeline"]
               for c in SPACE), "... with DeepSeek's dense first layer (-m slow)"
    assert any(c["sets"]["parallel.vocab_over_pipeline"] is False for c in DEFAULT), "and whole on every rank"
    hybrid = [c for c in DEFAULT if c["sets"]["parallel.num_distributed_optimizer_instances"] > 1]
    assert {zero_of(c["sets"]) for c in hybrid} == {1, 3}, "hybrid sharding of ZeRO-1 and ZeRO-3"
    assert any(c["sets"]["parallel.pipeline"] > 1 and c["moe"] for c in hybrid), "... on a pipeline, with experts"
    assert any(c["sets"]["parallel.overlap_grad_reduce"] for c in hybrid), "... reduced in the backward"
    assert {c["arch"] for c in DEFAULT} == set(ARCHS)
    dropped = [c for c in DEFAULT if c["sets"].get("model.dropout")]
    assert {c["sets"]["parallel.schedule"] for c in dropped if c["sets"]["parallel.pipeline"] > 1} == {
        "gpipe", "1f1b", "interleaved", "zero_bubble"}, "dropout on every schedule"
    assert {c["arch"] for c in dropped} == set(ARCHS) and {c["moe"] for c in dropped} == {False, True}
    assert any(not small_config(**c["sets"]).stage_split.even for c in dropped), "dropout on uneven stages"
    assert {c["sets"]["parallel.vocab_over_pipeline"] for c in dropped} == {None, False, True}
    assert any(c["sets"]["parallel.tp_comm_overlap"] for c in dropped), "dropout with the collective matmuls"
    moe = [c["sets"] for c in DEFAULT if c["moe"]]
    ep = lambda s: s["parallel.expert"]  # noqa: E731
    assert all(ep(s) > 1 for s in moe) and any(c["moe"] and c["sets"]["parallel.expert"] == 1 for c in SPACE), \
        "MoE with expert parallelism (without: -m slow, and test_moe)"
    assert any(1 < ep(s) == s["parallel.data"] for s in moe) and any(1 < ep(s) < s["parallel.data"] for s in moe)
    assert {s["parallel.sequence_parallel"] for s in moe if ep(s) > 1} == {False, True}
    # the experts' weights sharded over their data ranks by ZeRO-1 and ZeRO-3 (all-reduced without ZeRO: test_moe.py)
    assert {zero_of(s) for s in moe if ep(s) > 1} >= {1, 3}, "expert parallelism with ZeRO-1 and ZeRO-3"
    assert {s["parallel.pipeline"] > 1 for s in moe if ep(s) > 1} == {False, True}
    assert {s["parallel.data"] == ep(s) for s in moe} >= {True}
    assert any(s.get("parallel.expert_tensor") == 1 for s in moe), "folded experts"
    assert any(c["sets"].get("parallel.expert_tensor") == 1 and c["sets"]["parallel.pipeline"] > 1
               for c in SPACE), "folded experts on a pipeline (-m slow)"
    uneven = [c for c in DEFAULT if not small_config(**c["sets"]).stage_split.even]
    assert {c["sets"]["parallel.schedule"] for c in uneven} == {"gpipe", "1f1b", "interleaved", "zero_bubble"}, \
        "uneven stages on every schedule"
    assert {c["sets"]["parallel.pipeline"] for c in uneven} >= {2, 3, 4} and \
        {c["sets"]["parallel.virtual_stages"] for c in uneven} == {1, 2}
    assert any(c["moe"] and c["arch"] == "deepseek" and not small_config(**c["sets"]).stage_split.even
               for c in SPACE), "DeepSeek's dense first layer in the split (-m slow)"
    assert any(c["sets"]["parallel.data"] > 1 and c["sets"]["parallel.tensor"] > 1 for c in uneven)
    ragged = [s for s in moe if s.get("parallel.expert_all_to_all") == "ragged"]
    assert {s["parallel.pipeline"] > 1 for s in ragged} == {False, True} and any(s["parallel.tensor"] > 1
                                                                                for s in ragged), "ragged exchange"


def test_the_docs_give_the_space_s_size():
    """The docs state how many layouts the matrix holds and trains by default."""
    text_path = pathlib.Path(__file__).parents[1] / "docs" / "features" / "parallelism.md"
    text = text_path.read_text()
    moe = sum(c["moe"] for c in SPACE)
    assert f"That makes {len(SPACE):,} layouts of one 24-layer model ({moe:,} of them MoE)" in text
    assert f"trains {len(DEFAULT)} layouts, one per triple and one that once hung" in text
    assert f"holds {moe:,} MoE layouts" in (pathlib.Path(text_path).parent / "moe.md").read_text()


@shared_across_workers
def reference(arch: str, moe_micro_batch: int | None, layers: int | None = None, dropout: bool = False
              ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """One device's losses and gradient norms: dense, or MoE with the layout's micro batch size (the balancing
    loss is a function of each micro batch, so one device splits the batch as the layout does); the model's
    layers cut to `layers` where given; with DROPOUT or without."""
    sets = {**ARCHS[arch], "train.global_batch_size": BATCH, **({"model.num_layers": layers} if layers else {}),
            **(DROPOUT if dropout else {})}
    if moe_micro_batch:
        sets.update(MOE, **MOE_EXTRA.get(arch, {}), **{"train.micro_batch_size": moe_micro_batch})
    norms = []
    losses = run_steps(small_config(**sets), 1, STEPS, grad_norms=norms)
    return tuple(losses), tuple(norms)


# The slow layouts that stand for a feature no default layout trains (-m representative; docs/development.md):
# DeepSeek's MoE model on a pipeline, MoE folded over 'tensor' on a pipeline without expert parallelism, 6 stages,
# tensor 6, and the first layout that once hung.
REPRESENTATIVE = {"deepseek-moe-d4e2p2t1-zero1-overlap-gather-ragged-hsdp2-interleavedv2",
                  "llama-moe-d1e1p2t2-sp-fold-ragged-whole-1f1bv1", "llama-d1p6t1-1f1bv1", "llama-d1p1t6",
                  "gpt2-d1p2t2-sp-interleavedv2"}


def _marks(c: dict) -> list:
    return [] if c in DEFAULT else [pytest.mark.slow] + [pytest.mark.representative] * (name(c) in REPRESENTATIVE)


@pytest.mark.parametrize("c", [pytest.param(c, marks=_marks(c)) for c in CASES], ids=[name(c) for c in CASES])
def test_layout_matches_one_device(c):
    norms = []
    got = run_steps(small_config(**c["sets"]), c["n"], STEPS, grad_norms=norms)
    ref_losses, ref_norms = reference(c["arch"], c["sets"]["train.micro_batch_size"] if c["moe"] else None,
                                      None, "model.dropout" in c["sets"])
    np.testing.assert_allclose(got, ref_losses, rtol=1e-4)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-4)


# Each loop the step runs over a stack of layers (megajax.model.scan_layers): the model's LayerStack, the
# overlapped reductions' loops (reducing only, with the next layer's gather prefetched, ZeRO-3's regather), the
# pipeline's chunks (plain, hooked for the reduction inside the schedule, with prefetched gathers, zero bubble's
# split backward, interleaved, GPipe), and under full recomputation.
UNROLLED = {
    "layer stack": case("llama", 2, 1, 2, True, 1, "1f1b", 1),
    "full recompute": case("gpt2", 2, 1, 1, False, 0, "1f1b", 1),
    "reduce overlapped": case("gpt2", 2, 1, 1, False, 1, "1f1b", 1, overlap=1),
    "gathers prefetched": case("gpt2", 2, 1, 1, False, 1, "1f1b", 1, overlap=2),
    "zero-3": case("gpt2", 2, 1, 1, False, 3, "1f1b", 1),
    "pipeline": case("gpt2", 1, 2, 1, False, 0, "1f1b", 1),
    "pipeline, reduce in the schedule": case("gpt2", 2, 2, 1, False, 1, "1f1b", 1, overlap=1),
    "pipeline, gathers in the schedule": case("gpt2", 2, 2, 1, False, 1, "1f1b", 1, overlap=2),
    "zero bubble": case("gpt2", 1, 2, 1, False, 0, "zero_bubble", 1),
    "interleaved": case("gpt2", 1, 2, 1, False, 0, "interleaved", 2),
    "gpipe": case("gpt2", 1, 2, 1, False, 0, "gpipe", 1),
}
UNROLLED["full recompute"]["sets"]["model.recompute"] = "full"
UNROLLED_DEFAULT = {"layer stack"}  # the rest: -m slow (suite time; the pipeline's loops: 24 s)


def _layer_scans(sets: dict, n: int) -> list[tuple[int, int]]:
    """(length, unroll) of each scan over layers in the train step's jaxpr on `n` devices: over a chunk's layers
    (24 over pipeline x virtual stages), or one less (a loop that prefetches the next layer's gather). Loops over
    micro batches or ticks are shorter in these cases."""
    import jax

    from megajax import audit, step as step_lib
    from conftest import jaxpr_eqns

    chunk = SIZE["model.num_layers"] // (sets["parallel.pipeline"] * sets["parallel.virtual_stages"])
    cfg, mesh, setup, state, batch = audit.abstract_step(small_config(**sets), jax.devices()[:n])
    with jax.set_mesh(mesh):
        jaxpr = step_lib.jit_train_step(setup).trace(state, batch).jaxpr
    return [(e.params["length"], e.params["unroll"]) for e in jaxpr_eqns(jaxpr.jaxpr)
            if e.primitive.name == "scan" and e.params["length"] >= chunk - 1]


@pytest.mark.parametrize("what", list(UNROLLED))
def test_every_loop_over_layers_unrolls(what):
    """With model.scan_layers=false every loop over layers is unrolled in the program (jax.lax.scan's unroll
    equals its length: XLA sees each layer's residuals as their own buffers), and by default none is."""
    sets, n = UNROLLED[what]["sets"], UNROLLED[what]["n"]
    scanned = _layer_scans(sets, n)
    assert scanned and all(unroll == 1 for _, unroll in scanned), scanned
    unrolled = _layer_scans({**sets, "model.scan_layers": False}, n)
    assert sorted(length for length, _ in unrolled) == sorted(length for length, _ in scanned)
    assert all(unroll == length for length, unroll in unrolled), unrolled


# Unrolled, XLA compiles every layer of the program on its own: the model is cut to three layers a pipeline chunk
# (a loop that prefetches the next layer's gather runs over two), at least four (the default pipeline case ran for
# 109 s at the matrix's 24 layers).
def unrolled_layers(sets: dict) -> int:
    return max(4, 3 * sets["parallel.pipeline"] * sets["parallel.virtual_stages"])


@pytest.mark.parametrize("what", [w if w in UNROLLED_DEFAULT else pytest.param(w, marks=pytest.mark.slow)
                                  for w in UNROLLED])
def test_unrolled_layers_match_one_device(what):
    """model.scan_layers=false trains as one device does, through each loop over layers."""
    c = UNROLLED[what]
    norms = []
    layers = unrolled_layers(c["sets"])
    sets = {**c["sets"], "model.scan_layers": False, "model.num_layers": layers}
    got = run_steps(small_config(**sets), c["n"], STEPS, grad_norms=norms)
    ref_losses, ref_norms = reference(c["arch"], None, layers)
    np.testing.assert_allclose(got, ref_losses, rtol=1e-4)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-4)


# Every rank of a collective's group takes the same path to it (megajax.divergence), checked on the traced step of
# every combination of schedule (or none), tensor parallelism (without and with sequence parallelism), what the data
# ranks shard (ZeRO-0 to 3), the overlapped reduction and gather, and a dense or mixture-of-experts model, as the
# config accepts them; and of the layouts that add conditionals or collectives of their own: sequence parallelism's
# collective matmuls (collectives over a manual 'tensor'), context parallelism's ring, all-gather and all-to-all (a
# conditional on the context rank; with dropout too), uneven pipeline stages (a conditional on each layer slot),
# folded experts (with a capacity under context too) and the ragged exchange, the tables split over the pipeline
# or whole, multi-token prediction and hybrid sharding. Traced only, never compiled or run: a tiny model (one layer
# per pipeline chunk), 8 devices. A trace takes 1-4 s (a pipeline's per-rank branches are most of it): the default
# run traces, for each schedule, every (ZeRO, overlap) and every (tensor, sequence parallelism, MoE) it accepts,
# rotated against each other, and the layouts above (`guard_default`, 53 of the 199); -m slow traces the rest.
GUARD_SIZE = {"model.num_layers": 4, "model.hidden_size": 32, "model.num_heads": 4, "model.seq_length": 16,
              "model.ffn_hidden_size": 64, "train.global_batch_size": 8, "train.micro_batch_size": 2}
GUARD_MOE = {"model.num_experts": 4, "model.experts_per_token": 2, "model.moe_ffn_hidden_size": 16,
             "parallel.expert": 2}


def guard_case(schedule: str | None, t: int, sp: bool, zero: int, overlap: int, moe: bool, **extra) -> dict:
    p = 1 if schedule is None else 2
    sets = {**GUARD_SIZE, **(GUARD_MOE if moe else {}), "parallel.data": 2, "parallel.pipeline": p,
            "parallel.tensor": t, "parallel.sequence_parallel": sp,
            "parallel.data_parallel_sharding_strategy": STRATEGIES[zero], "parallel.overlap_grad_reduce": overlap > 0,
            "parallel.overlap_param_gather": overlap == 2, "parallel.schedule": schedule or "1f1b",
            "parallel.virtual_stages": 2 if schedule == "interleaved" else 1, "parallel.tp_comm_overlap": False,
            "parallel.expert": GUARD_MOE["parallel.expert"] if moe else 1,
            "parallel.vocab_over_pipeline": True if p > 1 else None, **extra}
    return {"n": sets["parallel.data"] * p * t * sets.get("parallel.context", 1), "sets": sets}


def guard_space() -> dict[str, dict]:
    out = {}
    for schedule, (t, sp), moe in itertools.product((None, "gpipe", "1f1b", "interleaved", "zero_bubble"),
                                                    ((1, False), (2, False), (2, True)), (False, True)):
        p = 1 if schedule is None else 2
        for zero in zeros(2, p, schedule or "1f1b"):
            for overlap in overlaps(2, p, schedule or "1f1b", zero):
                c = guard_case(schedule, t, sp, zero, overlap, moe)
                out[name({"arch": "gpt2", "moe": moe, "sets": c["sets"]})] = c
    extras = {
        "ring": guard_case(None, 2, True, 1, 1, False, **{"parallel.tp_comm_overlap": True}),
        "ring-pipeline": guard_case("1f1b", 2, True, 1, 0, False, **{"parallel.tp_comm_overlap": True}),
        "context-ring": guard_case(None, 2, True, 1, 1, False, **{"parallel.context": 2}),
        "context-all-gather-pipeline": guard_case("1f1b", 1, False, 1, 1, False, **{"parallel.context": 2}),
        "context-a2a-pipeline": guard_case("interleaved", 1, False, 1, 1, False, **{
            "parallel.context": 2, "parallel.context_comm": "a2a"}),
        # dropout under context parallelism: the ring's blocks and the all-to-all's heads draw their own entries
        "context-ring-dropout": guard_case(None, 2, True, 1, 1, False, **{"parallel.context": 2, **DROPOUT}),
        "context-a2a-pipeline-dropout": guard_case("1f1b", 1, False, 1, 1, False, **{
            "parallel.context": 2, "parallel.context_comm": "a2a", **DROPOUT}),
        # folded experts with a capacity under context on a pipeline: the expert ids gathered over 'context' inside
        # the pipeline rank's branches
        **{f"context-foldcap-{schedule}": guard_case(schedule, 2, True, 1, 0, True, **{
            "parallel.context": 2, "parallel.data": 1, "parallel.expert": 1, "parallel.expert_tensor": 1,
            "model.moe_capacity_factor": 1.0}) for schedule in ("1f1b", "interleaved", "zero_bubble")},
        "uneven-1f1b": guard_case("1f1b", 1, False, 1, 1, False, **{
            "model.num_layers": 5, "parallel.decoder_first_pipeline_num_layers": 2}),
        "uneven-interleaved-moe": guard_case("interleaved", 2, True, 1, 1, True, **{
            "model.num_layers": 6, "parallel.decoder_first_pipeline_num_layers": 2}),
        "fold-ragged": guard_case("1f1b", 2, True, 1, 0, True, **{"parallel.expert_tensor": 1,
                                                                  "parallel.expert_all_to_all": "ragged"}),
        # the embedding and output layer whole on every pipeline rank (elsewhere they are split over the ranks)
        "whole-vocab": guard_case("interleaved", 2, True, 1, 1, False, **{"parallel.vocab_over_pipeline": False}),
        # the multi-token prediction module with the tables split: its block under a conditional on the last rank,
        # with the experts' exchange and the tensor collectives inside it
        "mtp-vocab-moe": guard_case("interleaved", 2, True, 1, 0, True, **{"model.mtp_num_layers": 1}),
        "mtp-vocab-gpipe": guard_case("gpipe", 2, True, 0, 0, True, **{"model.mtp_num_layers": 1}),
        # hybrid sharding: ZeRO-3 over two instances of two data ranks, on a pipeline and not; ZeRO-1's sum over the
        # instances in the idle ticks' reductions of a pipeline
        "hybrid-pipeline-overlap": guard_case("1f1b", 1, False, 1, 1, False, **{
            "parallel.data": 4, "parallel.num_distributed_optimizer_instances": 2}),
        "hybrid": guard_case(None, 2, True, 3, 0, False, **{"parallel.data": 4,
                                                           "parallel.num_distributed_optimizer_instances": 2}),
        "hybrid-pipeline": guard_case("1f1b", 1, False, 3, 0, True, **{
            "parallel.data": 4, "parallel.num_distributed_optimizer_instances": 2}),
    }
    out.update({f"extra-{k}": c for k, c in extras.items()})
    return out


GUARD = guard_space()
# extras traced by -m slow only: folded capacity under context on the schedules past 1F1B (13 s; each has its
# one-device equality test in test_context's slow layouts)
GUARD_SLOW_EXTRAS = {"extra-context-foldcap-interleaved", "extra-context-foldcap-zero_bubble"}


def guard_default() -> set[str]:
    """Per schedule, its (ZeRO, overlap) pairs rotated against its (tensor, sequence parallelism, MoE) triples, so
    that each of either appears at least once; and the extras but GUARD_SLOW_EXTRAS."""
    by_schedule: dict = {}
    for key, c in GUARD.items():
        if key.startswith("extra-"):
            continue
        s = c["sets"]
        by_schedule.setdefault(s["parallel.pipeline"] > 1 and s["parallel.schedule"], []).append(
            ((zero_of(s), s["parallel.overlap_grad_reduce"] + s["parallel.overlap_param_gather"]),
             (s["parallel.tensor"], s["parallel.sequence_parallel"], "model.num_experts" in s), key))
    out = {k for k in GUARD if k.startswith("extra-") and k not in GUARD_SLOW_EXTRAS}
    for rows in by_schedule.values():
        pairs, triples = sorted({r[0] for r in rows}), sorted({r[1] for r in rows})
        keys = {(a, b): k for a, b, k in rows}
        out |= {keys[pairs[i % len(pairs)], triples[i % len(triples)]] for i in range(max(len(pairs), len(triples)))}
    return out


GUARD_DEFAULT = guard_default()


def _combo(sets: dict) -> tuple:
    """(schedule or False, tensor, sequence parallelism, ZeRO level, overlap level, MoE) of a guard case."""
    return (sets["parallel.pipeline"] > 1 and sets["parallel.schedule"], sets["parallel.tensor"],
            sets["parallel.sequence_parallel"], zero_of(sets),
            sets["parallel.overlap_grad_reduce"] + sets["parallel.overlap_param_gather"], "model.num_experts" in sets)


def test_the_guard_covers_the_combinations():
    """Every (schedule, tensor, sequence parallelism, ZeRO, overlap, MoE) the config accepts at data 2 is traced (the
    default run: each schedule's every ZeRO x overlap and every tensor x SP x MoE), and the config accepts each."""
    combos = {k: _combo(c["sets"]) for k, c in GUARD.items() if not k.startswith("extra-")}
    assert len(set(combos.values())) == len(combos) == len(GUARD) - len([k for k in GUARD if k.startswith("extra-")])
    assert {c[0] for c in combos.values()} == {False, "gpipe", "1f1b", "interleaved", "zero_bubble"}
    for schedule in {c[0] for c in combos.values()}:
        mine = [c for c in combos.values() if c[0] == schedule]
        chosen = [c for k, c in combos.items() if c[0] == schedule and k in GUARD_DEFAULT]
        assert {c[3:5] for c in chosen} == {c[3:5] for c in mine}
        assert {(c[1], c[2], c[5]) for c in chosen} == {(c[1], c[2], c[5]) for c in mine}
    for c in GUARD.values():
        small_config(**c["sets"]).for_devices(c["n"])  # (the config accepts it)
    text = (pathlib.Path(__file__).parents[1] / "docs" / "design" / "collectives.md").read_text()
    assert f"That is {len(GUARD)} traced steps, {len(GUARD_DEFAULT)} of them in the default suite" in text


@pytest.mark.parametrize("key", [k if k in GUARD_DEFAULT else pytest.param(k, marks=pytest.mark.slow) for k in GUARD])
def test_every_rank_takes_the_same_path_to_each_collective(key):
    import jax

    from megajax import audit, divergence, step as step_lib

    c = GUARD[key]
    cfg, mesh, setup, state, batch = audit.abstract_step(small_config(**c["sets"]), jax.devices()[:c["n"]])
    with jax.set_mesh(mesh):
        jaxpr = step_lib.jit_train_step(setup).trace(state, batch).jaxpr
    guarded = []
    assert not [str(d) for d in divergence.check(jaxpr, guarded)]
    if c["sets"]["parallel.pipeline"] > 1:  # (the walk saw the schedule's conditionals on the pipeline rank)
        assert any("pipeline" in pred for _, pred, _ in guarded), guarded
