"""Context parallelism: the layout of the chunks, ring attention against the whole-sequence reference, every
context layout against one device, and the errors of bad layouts.

The space: context 2, 4 and 8 with every (data, pipeline, tensor) that fills 8 devices or fewer, sequence
parallelism on and off, each schedule under a pipeline, both exchanges (ring, all_gather) and both attention
implementations. `test_the_context_space_is_accepted` checks all of it against the config (cheap); the ring
attention is checked as a function for c 2 and 4, both exchanges, both implementations, with grouped-query
attention and packed-document segment ids; the default run trains a handful of layouts against one device
(fp32, relative 1e-4) and -m slow the rest.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from conftest import run_steps, small_config
from megajax import config as config_lib
from megajax import kernels, model
from megajax.data import datasets
from megajax.kernels.dropout import AttentionDropout
from megajax.model import context
from megajax.parallel import step_plan
from megajax.parallel.step_plan import StepPlan

STEPS = 2
SIZE = {"model.num_layers": 4, "model.hidden_size": 64, "model.seq_length": 32, "train.global_batch_size": 8}
ARCHS = {"gpt2": {"model.num_heads": 4},
         "llama": {"model.arch": "llama", "model.num_heads": 4, "model.num_kv_heads": 2},
         # DeepSeek's multi-latent attention (values narrower than the keys, unpadded around the ring) with YaRN and
         # its softmax scale
         "deepseek": {"model.arch": "llama", "model.num_heads": 4, "model.multi_latent_attention": True,
                      "model.q_lora_rank": 16, "model.kv_lora_rank": 16, "model.qk_head_dim": 8,
                      "model.qk_pos_emb_head_dim": 8, "model.v_head_dim": 8, "model.rope_scaling": "yarn",
                      "model.rope_scaling_factor": 4.0, "model.rope_original_max_positions": 16,
                      "model.rope_yarn_mscale": 1.0, "model.rope_yarn_mscale_all_dim": 0.8}}
# with DeepSeek's routed experts (dropless), the load-balancing loss and the auxiliary-loss-free bias
ARCHS["deepseek-moe"] = {**ARCHS["deepseek"], "model.num_experts": 4, "model.experts_per_token": 2,
                         "model.moe_router_bias_update_rate": 0.01}


# folded experts with a capacity under context 2 x tensor 2 (0.5: many assignments dropped; no balancing loss, which
# each micro batch balances on its own)
FOLDED_CAPACITY = {"parallel.context": 2, "parallel.tensor": 2, "parallel.sequence_parallel": True,
                   "parallel.expert_tensor": 1, "model.moe_capacity_factor": 0.5, "model.moe_aux_loss_coef": 0.0,
                   "train.micro_batch_size": 4}


def _chunk_ids(rank: int, c: int) -> tuple[int, int]:
    """The two sequence chunks (of 2c) context rank `rank` holds (context.split's layout)."""
    return rank, 2 * c - 1 - rank


def test_chunks_balance_the_causal_work():
    """Rank i holds chunks i and 2c - 1 - i; every rank's queries see the same number of (query, key) pairs."""
    for c in (2, 4, 8):
        s = 2 * c * 3
        h = s // (2 * c)
        held = sorted(ch for i in range(c) for ch in _chunk_ids(i, c))
        assert held == list(range(2 * c))
        work = [sum(sum(q + 1 for q in range(ch * h, (ch + 1) * h)) for ch in _chunk_ids(i, c))
                for i in range(c)]
        assert len(set(work)) == 1, work


def _mesh(c: int):
    """'context' and a 1-device 'tensor' left automatic, as in the train step (the kernels open their own
    region over the automatic axes)."""
    return jax.make_mesh((c, 1), ("context", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:c])


def _ring(c: int, impl: str, drop=None):
    """context.attention (the step plan's exchange) over a 'context' mesh of c devices, taking and returning whole
    sequences in token order."""
    def local(q, k, v, seg):
        q, k, v, seg = (context.split(x) for x in (q, k, v, seg))
        o = context.attention(q, k, v, segment_ids=seg, impl=impl, probs_dropout=drop)
        # back to token order: every rank's rows scattered into a whole sequence, summed over the ranks
        full = jnp.zeros((o.shape[0], o.shape[1] * c, *o.shape[2:]), o.dtype)
        h = o.shape[1] // 2
        i = jax.lax.axis_index("context")
        full = jax.lax.dynamic_update_slice_in_dim(full, o[:, :h], i * h, 1)
        full = jax.lax.dynamic_update_slice_in_dim(full, o[:, h:], (2 * c - 1 - i) * h, 1)
        return jax.lax.psum(full, "context")

    return jax.shard_map(local, mesh=_mesh(c), in_specs=P(), out_specs=P(), axis_names={"context"})


@pytest.mark.parametrize("c,impl,exchange", [pytest.param(2, "xla", "ring", marks=pytest.mark.slow), (4, "xla", "ring"),
                                             pytest.param(4, "xla", "all_gather", marks=pytest.mark.slow),
                                             pytest.param(2, "pallas", "ring", marks=pytest.mark.slow),
                                             (4, "pallas", "all_gather"), (4, "xla", "a2a"),
                                             pytest.param(2, "pallas", "a2a", marks=pytest.mark.slow),
                                             (4, "xla", "a2a+ring"), (8, "pallas", "a2a+ring"),
                                             pytest.param(8, "xla", "a2a+ring", marks=pytest.mark.slow),
                                             (4, "xla", "a2a+all_gather"),
                                             pytest.param(8, "pallas", "a2a+all_gather", marks=pytest.mark.slow)])
def test_ring_attention_equals_whole_sequence_attention(c, impl, exchange):
    _exchange_equals_whole_sequence_attention(c, impl, exchange)


@pytest.mark.parametrize("c,impl", [(2, "xla"), pytest.param(4, "pallas", marks=pytest.mark.slow)])
def test_the_all_to_all_by_head_parts_equals_whole_sequence_attention(c, impl):
    """8 key-value heads over 2 (4) context ranks: the all-to-all exchange in 4 (2) head parts."""
    _exchange_equals_whole_sequence_attention(c, impl, "a2a", heads=8, groups=8)


@pytest.mark.parametrize("c,impl,exchange,heads", [
    (4, "xla", "ring", 4), (4, "xla", "all_gather", 8), (2, "xla", "a2a", 8), (2, "pallas", "ring", 4),
    *(pytest.param(*case, marks=pytest.mark.slow) for case in [  # (suite time)
        (4, "xla", "a2a", 4), (4, "xla", "a2a+ring", 4), (4, "xla", "a2a+all_gather", 4),
        (4, "pallas", "all_gather", 8), (8, "pallas", "a2a+ring", 8)])])
def test_attention_dropout_under_context_drops_what_one_device_drops(c, impl, exchange, heads):
    """The dropped probabilities are a hash of their heads and positions (kernels/dropout.py), so every exchange
    drops one device's: the ring's blocks, the all-gather's head parts (8 heads: 2 parts), the all-to-all's
    heads (8 over 2 ranks: 4 parts; 4 over 4: the key-value heads repeated), the hierarchical groups."""
    _exchange_equals_whole_sequence_attention(c, impl, exchange, heads=heads, groups=heads // 2, dropout=0.25)


def _exchange_equals_whole_sequence_attention(c: int, impl: str, exchange: str, heads: int = 4, groups: int = 2,
                                              dropout: float = 0.0):
    b, s, h, g, d = 2, 8 * c, heads, groups, 8
    keys = jax.random.split(jax.random.key(c), 5)
    q = jax.random.normal(keys[0], (b, s, h, d))
    k, v = (jax.random.normal(key, (b, s, g, d)) for key in keys[1:3])
    do = jax.random.normal(keys[3], (b, s, h, d))
    seg = jnp.sort(jax.random.randint(keys[4], (b, s), 0, 3), axis=1)  # packed documents
    drop = None
    if dropout:
        drop = AttentionDropout.of(jax.random.split(jax.random.key(7), b), 5, dropout, h)
    ring = _ring(c, impl, drop)

    def reference(q, k, v, seg):
        return kernels.attention_reference(q, k, v, causal=True, segment_ids=seg, probs_dropout=drop)

    def value_and_grads(fn, q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)
        return (out, *vjp(do))

    # as in the train step: jitted, under the mesh the kernels' region reads and a step plan with 'context' manual
    # (a2a: 2 key-value heads over 4 context ranks, repeated to the 4 query heads; a2a+ring: all-to-alls in groups
    # of 2, a ring of c / 2 across them, or at c = 8 with the Pallas blocks groups of 4 and a ring of 2, the keys
    # and values repeated; a2a+all_gather: the same groups, an all-gather across them)
    n = c if exchange == "a2a" else (4 if impl == "pallas" else 2) if exchange.startswith("a2a+") else 1
    plan = StepPlan(context=c, manual=("context",), context_comm=exchange, context_a2a=n)
    with jax.set_mesh(_mesh(c)), step_plan.use(plan):
        got = jax.jit(lambda *a: value_and_grads(ring, *a))(q, k, v, do)
    want = value_and_grads(reference, q, k, v, do)
    for name, a, w in zip(("o", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(a, w, rtol=0, atol=2e-5 * float(jnp.max(jnp.abs(w))), err_msg=name)


def test_a_ring_hop_is_one_ppermute():
    """The keys and values go around the ring as one array, and so do their gradients: XLA's GPU scheduler keeps
    two collectives in flight (xla_flags), so a backward step's hops must be two to run under its block (four, the
    keys, values and the two gradients apart, left two waiting: at 128k on context 8, 66.8 ms of the hops exposed
    against 9.5; XLA's combiner joins them only when small). c = 4: the forward's 3 hops; the backward's 3 of the
    keys and values and 4 of their gradients (the last home)."""
    c, b, s, h, d = 4, 1, 32, 4, 8
    q, k, v = (jnp.ones((b, s, h, d)) for _ in range(3))

    def local(q, k, v):
        q, k, v = (context.split(x) for x in (q, k, v))
        out, vjp = jax.vjp(lambda q, k, v: context.attention(q, k, v, impl="xla"), q, k, v)
        return vjp(out)

    plan = StepPlan(context=c, manual=("context",), context_comm="ring")
    fn = jax.shard_map(local, mesh=_mesh(c), in_specs=P(), out_specs=P("context"), axis_names={"context"})
    with jax.set_mesh(_mesh(c)), step_plan.use(plan):
        assert str(jax.make_jaxpr(fn)(q, k, v)).count(" ppermute[") == 3 + 3 + 4


def test_documents_give_segments_and_positions():
    """Megatron's reset_attention_mask / reset_position_ids: the end-of-document token belongs to the document
    it ends; the next token starts a new one at position 0."""
    eod = 9
    tokens = np.array([[5, eod, 7, 8, eod, 3, eod, eod]])
    out = datasets.documents(tokens, eod, positions=True)
    np.testing.assert_array_equal(out["segment_ids"], [[0, 0, 1, 1, 1, 2, 2, 3]])
    np.testing.assert_array_equal(out["positions"], [[0, 1, 0, 1, 2, 0, 1, 0]])
    assert "positions" not in datasets.documents(tokens, eod, positions=False)


@pytest.mark.parametrize("arch", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_a_packed_document_does_not_see_the_one_before(arch):
    """With segment ids and reset positions, the logits of the second document do not change when the first one
    does (and they do without the segments)."""
    cfg = small_config(**{**SIZE, **ARCHS[arch], "model.seq_length": 16}).model
    params = model.init_params(cfg, jax.random.key(0))
    eod = 256
    tokens = jnp.array([[1, 2, 3, 4, 5, eod, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]])
    other = tokens.at[:, :5].set(jnp.array([40, 41, 42, 43, 44]))

    def logits(tokens, packed):
        fields = datasets.documents(tokens, eod, positions=True) if packed else {}
        side = model.Side(segment_ids=fields.get("segment_ids"), positions=fields.get("positions"))
        return model.GPT(cfg).apply({"params": params}, tokens, side)[:, 6:]

    np.testing.assert_allclose(logits(tokens, True), logits(other, True), rtol=0, atol=1e-5)
    assert float(jnp.max(jnp.abs(logits(tokens, False) - logits(other, False)))) > 1e-3


def context_space() -> list[dict]:
    out = []
    for c, d, p, t in itertools.product((2, 4, 8), (1, 2, 4), (1, 2), (1, 2)):
        if c * d * p * t > 8:
            continue
        for arch, sp, comm, schedule in itertools.product(
                ARCHS, (False, True) if t > 1 else (False,),
                ("auto", "ring", "all_gather", "a2a", "a2a+ring", "a2a+all_gather") if p == 1
                else ("auto", "all_gather", "a2a", "a2a+all_gather"),
                ("1f1b", "interleaved", "zero_bubble", "gpipe") if p > 1 else ("1f1b",)):
            hierarchical = comm.startswith("a2a+")
            groups = c if comm == "a2a" else 2 if hierarchical else 1
            if ARCHS[arch]["model.num_heads"] % (groups * t) or (hierarchical and c == 2):
                continue  # (the heads split over tensor x the all-to-all group; a2a+ needs 2 groups or more)
            out.append({"arch": arch, "n": c * d * p * t, "sets": {
                **SIZE, **ARCHS[arch], "model.seq_length": 64, "parallel.context": c, "parallel.data": d,
                "parallel.pipeline": p, "parallel.tensor": t, "parallel.sequence_parallel": sp,
                "parallel.context_comm": comm, "parallel.schedule": schedule,
                "parallel.context_a2a_size": 2 if hierarchical else None,
                "parallel.virtual_stages": 2 if schedule == "interleaved" else 1,
                "train.micro_batch_size": 8 // (d * p) if p > 1 else 8 // d}})
    return out


def test_the_context_space_is_accepted():
    space = context_space()
    assert len(space) > 100
    for case in space:
        cfg = small_config(**case["sets"]).for_devices(case["n"])
        assert cfg.parallel.context * cfg.parallel.data * cfg.parallel.pipeline * cfg.parallel.tensor == case["n"]


@pytest.mark.parametrize("sets,fix", [
    ({"parallel.context": 3, "model.seq_length": 32}, "multiple of 6"),
    ({"parallel.context": 2, "model.seq_length": 30}, "multiple of 4"),
    ({"parallel.context": 2, "parallel.tensor": 4, "parallel.sequence_parallel": True, "model.seq_length": 12},
     "multiple of 8"),
    ({"parallel.context": 2, "parallel.pipeline": 2, "parallel.context_comm": "ring"}, "context_comm=all_gather"),
    ({"parallel.context": 2, "model.attention_impl": "cudnn"}, "pallas or xla"),
    ({"parallel.context": 4, "parallel.tensor": 2, "parallel.context_comm": "a2a"}, "must divide by parallel.tensor"),
    ({"parallel.context": 4, "parallel.pipeline": 2, "parallel.context_comm": "a2a+ring"},
     "context_comm=a2a\\+all_gather \\(the same groups"),
    ({"parallel.context": 4, "parallel.context_a2a_size": 2}, "a2a\\+ring or a2a\\+all_gather: set one of those"),
    ({"parallel.context": 4, "parallel.context_comm": "a2a+all_gather", "parallel.context_a2a_size": 4},
     "1 is all_gather"),
    ({"parallel.context": 4, "parallel.context_comm": "a2a+ring", "parallel.context_a2a_size": 4}, "1 is ring"),
    ({"parallel.context": 8, "parallel.context_comm": "a2a+ring", "parallel.context_a2a_size": 3}, "must divide"),
    ({"parallel.context": 8, "parallel.context_comm": "a2a+ring", "parallel.context_a2a_size": 8, "model.num_heads": 8,
      "model.seq_length": 64}, "lie between 1 and it"),
    ({"parallel.context": 4, "parallel.tensor": 2, "parallel.context_comm": "a2a+ring", "parallel.context_a2a_size": 2,
      "model.num_heads": 2}, "a divisor of 4 that it does"),
    ({"parallel.context": 4, "parallel.context_comm": "a2a+ring", "model.attention_impl": "cudnn"}, "pallas or xla"),
    ({"data.reset_attention_mask": True, "model.attention_impl": "cudnn"}, "pallas or xla"),
])
def test_bad_context_layouts_name_the_fix(sets, fix):
    with pytest.raises(config_lib.ConfigError, match=fix.replace(".", r"\.")):
        small_config(**sets)


def test_context_times_the_other_axes_must_fill_the_devices():
    cfg = small_config(**{"parallel.context": 2, "parallel.data": 2, "parallel.tensor": 1})
    with pytest.raises(config_lib.ConfigError, match=r"2 x 1 x 2 x 1 = 4, but there are 8 devices"):
        cfg.for_devices(8)
    assert small_config(**{"parallel.context": 2, "parallel.tensor": 2}).for_devices(8).parallel.data == 2


LAYOUTS = {
    # name: (arch, devices, sets); the default run, then -m slow
    # Pallas kernels with segment ids inside the step's manual region (this crashed JAX's cond partial evaluation
    # until launch.pallas_call stripped integer operands for both platform branches)
    "gpt2-d2c2-packed-documents-pallas": ("gpt2", 4, {
        "parallel.data": 2, "parallel.context": 2, "model.seq_length": 64, "model.attention_impl": "pallas",
        "data.reset_attention_mask": True, "data.reset_position_ids": True}),
    # the balancing loss at weight 1: each rank's chunk alone would balance it otherwise than one device (0.8%)
    "deepseek-moe-c2-balance": ("deepseek-moe", 2, {"parallel.context": 2, "model.moe_aux_loss_coef": 1.0}),
    # a capacity: the assignments one device keeps, decided on the whole sequences (by weight here; 0.5 drops many)
    "deepseek-moe-c2-capacity-probs": ("deepseek-moe", 2, {"parallel.context": 2, "model.moe_capacity_factor": 0.5,
                                                           "model.moe_token_drop_policy": "probs"}),
    # experts, context and a pipeline: the balancing loss, summed over 'context', is invariant there, and so are
    # residuals the schedule carries to the backward (ChunkActions.zero_res)
    # (two micro batches: at four, 34 s here against 22)
    "deepseek-moe-p2c2-1f1b": ("deepseek-moe", 4, {"parallel.pipeline": 2, "parallel.context": 2,
                                                   "train.micro_batch_size": 4}),
    # attention dropout: the entries one device drops, by their heads' and positions' hash, over the all-to-all's
    # heads and tensor ranks (-m slow: the ring's blocks, Pallas ones with packed documents)
    "llama-c2t2-a2a-sp-dropout": ("llama", 4, {"parallel.context": 2, "parallel.tensor": 2,
                                               "parallel.context_comm": "a2a", "parallel.sequence_parallel": True,
                                               "model.dropout": 0.1, "model.attention_dropout": 0.1}),
    "llama-d2c2t2-sp-selective": ("llama", 8, {"parallel.data": 2, "parallel.context": 2, "parallel.tensor": 2,
                                               "parallel.sequence_parallel": True, "model.recompute": "selective"}),
    # the distributed optimizer sharded over context alone (data = 1)
    "llama-p2c2-1f1b-zero1": ("llama", 4, {"parallel.pipeline": 2, "parallel.context": 2,
                                           "parallel.distributed_optimizer": True, "train.micro_batch_size": 2}),
    # all-to-all attention: grouped-query keys and values repeated to the heads (2 over 4 ranks), packed documents
    # (-m slow: with tensor and sequence parallelism and the Pallas kernels, on pipelines, with ZeRO-3)
    "llama-c4-a2a-packed-documents": ("llama", 4, {"parallel.context": 4, "parallel.context_comm": "a2a",
                                                   "model.seq_length": 128, "data.reset_attention_mask": True,
                                                   "data.reset_position_ids": True}),
    # hierarchical: all-to-alls in groups of 2 adjacent ranks, a ring of 2 across them, packed documents (-m slow:
    # with tensor and sequence parallelism and the Pallas blocks, ZeRO-3 with MLA, groups of 4 with recomputation)
    "gpt2-c4-a2a+ring-packed-documents": ("gpt2", 4, {"parallel.context": 4, "parallel.context_comm": "a2a+ring",
                                                      "model.seq_length": 64, "data.reset_attention_mask": True}),
    # the hierarchical form under a pipeline: all-to-alls in groups of 2, an all-gather across the 2 groups (-m
    # slow: interleaved with the Pallas blocks and packed documents, DeepSeek's MoE on zero_bubble with ZeRO-3)
    "gpt2-p2c4-a2a+all_gather-1f1b": ("gpt2", 8, {"parallel.pipeline": 2, "parallel.context": 4,
                                                  "parallel.context_comm": "a2a+all_gather", "model.seq_length": 64,
                                                  "train.micro_batch_size": 2}),
}
SLOW_LAYOUTS = {
    "llama-p2c4-a2a+all_gather-interleaved-pallas-packed-documents": ("llama", 8, {
        "parallel.pipeline": 2, "parallel.context": 4, "parallel.context_comm": "a2a+all_gather",
        "parallel.schedule": "interleaved", "parallel.virtual_stages": 2, "model.attention_impl": "pallas",
        "model.seq_length": 64, "train.micro_batch_size": 2, "data.reset_attention_mask": True,
        "data.reset_position_ids": True}),
    "deepseek-moe-p2c4-a2a+all_gather-zero_bubble-zero3": ("deepseek-moe", 8, {
        "parallel.pipeline": 2, "parallel.context": 4, "parallel.context_comm": "a2a+all_gather",
        "parallel.schedule": "zero_bubble", "parallel.data_parallel_sharding_strategy": "optim_grads_params",
        "model.seq_length": 64, "train.micro_batch_size": 2}),
    "gpt2-c4-a2a+all_gather-groups-of-2": ("gpt2", 4, {"parallel.context": 4,
                                                       "parallel.context_comm": "a2a+all_gather",
                                                       "model.seq_length": 64}),
    # (suite time, 10 s: dropout under context parallelism; packed documents run by default)
    "llama-c4-packed-documents-dropout-pallas": ("llama", 4, {
        "parallel.context": 4, "model.seq_length": 128, "model.dropout": 0.1, "model.attention_dropout": 0.1,
        "model.attention_impl": "pallas", "data.reset_attention_mask": True, "data.reset_position_ids": True}),
    "llama-c4t2-a2a+ring-sp-pallas": ("llama", 8, {
        "parallel.context": 4, "parallel.tensor": 2, "parallel.context_comm": "a2a+ring",
        "parallel.sequence_parallel": True, "model.attention_impl": "pallas"}),
    "deepseek-d2c4-a2a+ring-zero3": ("deepseek", 8, {
        "parallel.data": 2, "parallel.context": 4, "parallel.context_comm": "a2a+ring",
        "parallel.data_parallel_sharding_strategy": "optim_grads_params"}),
    "gpt2-c8-a2a+ring-groups-of-4-full-recompute": ("gpt2", 8, {
        "parallel.context": 8, "parallel.context_comm": "a2a+ring", "parallel.context_a2a_size": 4,
        "model.seq_length": 64, "model.recompute": "full"}),
    "gpt2-c2t2-a2a-sp-pallas": ("gpt2", 4, {"parallel.context": 2, "parallel.tensor": 2, "parallel.context_comm": "a2a",
                                            "parallel.sequence_parallel": True, "model.attention_impl": "pallas"}),
    "deepseek-p2c2-a2a-interleaved-zero1": ("deepseek", 8, {
        "parallel.data": 2, "parallel.pipeline": 2, "parallel.context": 2, "parallel.context_comm": "a2a",
        "parallel.schedule": "interleaved", "parallel.virtual_stages": 2, "parallel.distributed_optimizer": True,
        "train.micro_batch_size": 1}),
    "llama-d2c2t2-a2a-zero3": ("llama", 8, {"parallel.data": 2, "parallel.context": 2, "parallel.tensor": 2,
                                            "parallel.context_comm": "a2a",
                                            "parallel.data_parallel_sharding_strategy": "optim_grads_params"}),
    "gpt2-p2c2-a2a-1f1b-full-recompute": ("gpt2", 4, {"parallel.pipeline": 2, "parallel.context": 2,
                                                      "parallel.context_comm": "a2a", "model.recompute": "full",
                                                      "train.micro_batch_size": 2}),
    "llama-d2p2c2-interleaved-zero1": ("llama", 8, {"parallel.data": 2, "parallel.pipeline": 2, "parallel.context": 2,
                                                    "parallel.schedule": "interleaved", "parallel.virtual_stages": 2,
                                                    "parallel.distributed_optimizer": True,
                                                    "train.micro_batch_size": 1}),
    "gpt2-c2": ("gpt2", 2, {"parallel.context": 2}),
    "deepseek-d2c2t2-sp": ("deepseek", 8, {"parallel.data": 2, "parallel.context": 2, "parallel.tensor": 2,
                                          "parallel.sequence_parallel": True}),
    "deepseek-c2-pallas": ("deepseek", 2, {"parallel.context": 2, "model.attention_impl": "pallas"}),
    "gpt2-p2c2t2-1f1b": ("gpt2", 8, {"parallel.pipeline": 2, "parallel.context": 2, "parallel.tensor": 2,
                                     "train.micro_batch_size": 2}),
    "llama-c4-dropout": ("llama", 4, {"parallel.context": 4, "model.dropout": 0.1, "model.attention_dropout": 0.1}),
    # both dropouts on a pipeline: the keys travel with the micro batches through the schedule's ticks
    "gpt2-p2c2-1f1b-dropout": ("gpt2", 4, {"parallel.pipeline": 2, "parallel.context": 2, "model.dropout": 0.1,
                                           "model.attention_dropout": 0.1, "train.micro_batch_size": 2}),
    "gpt2-c8": ("gpt2", 8, {"parallel.context": 8, "model.seq_length": 64}),
    "llama-c4-all_gather": ("llama", 4, {"parallel.context": 4, "parallel.context_comm": "all_gather"}),
    "llama-c2-pallas": ("llama", 2, {"parallel.context": 2, "model.attention_impl": "pallas"}),
    "gpt2-c4-pallas-sp": ("gpt2", 8, {"parallel.context": 4, "parallel.tensor": 2, "parallel.sequence_parallel": True,
                                      "model.attention_impl": "pallas"}),
    "gpt2-d4c2-zero1": ("gpt2", 8, {"parallel.data": 4, "parallel.context": 2, "parallel.distributed_optimizer": True}),
    "llama-p2c4-zero_bubble": ("llama", 8, {"parallel.pipeline": 2, "parallel.context": 4,
                                            "parallel.schedule": "zero_bubble", "train.micro_batch_size": 2}),
    "gpt2-p2c2t2-gpipe-sp": ("gpt2", 8, {"parallel.pipeline": 2, "parallel.context": 2, "parallel.tensor": 2,
                                         "parallel.sequence_parallel": True, "parallel.schedule": "gpipe",
                                         "train.micro_batch_size": 2}),
    "llama-c2-full-recompute": ("llama", 2, {"parallel.context": 2, "model.recompute": "full"}),
    "llama-p2c2-packed-documents": ("llama", 4, {"parallel.pipeline": 2, "parallel.context": 2, "model.seq_length": 128,
                                                 "train.micro_batch_size": 2, "data.reset_attention_mask": True}),
    "gpt2-c2-overlap-zero1": ("gpt2", 8, {"parallel.data": 4, "parallel.context": 2,
                                          "parallel.distributed_optimizer": True, "parallel.overlap_grad_reduce": True,
                                          "parallel.overlap_param_gather": True}),
    "gpt2-d2p2c2-1f1b-overlap": ("gpt2", 8, {"parallel.data": 2, "parallel.pipeline": 2, "parallel.context": 2,
                                             "parallel.overlap_grad_reduce": True, "train.micro_batch_size": 2}),
    "deepseek-moe-d4e2c2-a2a-ragged": ("deepseek-moe", 8, {
        "parallel.data": 4, "parallel.expert": 2, "parallel.context": 2, "parallel.context_comm": "a2a",
        "parallel.expert_all_to_all": "ragged"}),
    # (with data ranks, no balancing loss: each rank balances its own micro batch, as in Megatron, 2e-4 off one
    # device here at the default weight; the default run's p2c2 case has it)
    "deepseek-moe-d2e2p2c2-interleaved-a2a-ragged": ("deepseek-moe", 8, {
        "parallel.data": 2, "parallel.expert": 2, "parallel.pipeline": 2, "parallel.context": 2,
        "parallel.context_comm": "a2a", "parallel.expert_all_to_all": "ragged", "parallel.schedule": "interleaved",
        "parallel.virtual_stages": 2, "train.micro_batch_size": 1, "model.moe_aux_loss_coef": 0.0}),
    "deepseek-moe-d2e2p2c2-capacity-1f1b-a2a": ("deepseek-moe", 8, {
        "parallel.data": 2, "parallel.expert": 2, "parallel.pipeline": 2, "parallel.context": 2,
        "parallel.context_comm": "a2a", "model.moe_capacity_factor": 0.5, "train.micro_batch_size": 1,
        "model.moe_aux_loss_coef": 0.0}),
    # folded experts with a capacity: the drops decided on the whole sequences too, with the all-to-all exchange, on
    # a pipeline, and over expert 2 x tensor 2 with data
    "deepseek-moe-c2t2-sp-foldcap-a2a": ("deepseek-moe", 4, {**FOLDED_CAPACITY, "parallel.context_comm": "a2a"}),
    "deepseek-moe-p2c2t2-sp-foldcap-1f1b": ("deepseek-moe", 8, {**FOLDED_CAPACITY, "parallel.pipeline": 2}),
    # ... and on the other schedules: the ids' gathers inside their ticks' branches
    "deepseek-moe-p2c2t2-sp-foldcap-interleaved": ("deepseek-moe", 8, {
        **FOLDED_CAPACITY, "parallel.pipeline": 2, "parallel.schedule": "interleaved", "parallel.virtual_stages": 2,
        "train.micro_batch_size": 1}),
    "deepseek-moe-p2c2t2-sp-foldcap-zero_bubble": ("deepseek-moe", 8, {
        **FOLDED_CAPACITY, "parallel.pipeline": 2, "parallel.schedule": "zero_bubble", "train.micro_batch_size": 1}),
    "deepseek-moe-p2c2t2-sp-foldcap-gpipe": ("deepseek-moe", 8, {
        **FOLDED_CAPACITY, "parallel.pipeline": 2, "parallel.schedule": "gpipe", "train.micro_batch_size": 1}),
    "deepseek-moe-d2e2c2t2-sp-foldcap": ("deepseek-moe", 8, {**FOLDED_CAPACITY, "parallel.data": 2,
                                                             "parallel.expert": 2}),
    "deepseek-moe-d2p2c2-zero_bubble-zero3-full-recompute": ("deepseek-moe", 8, {
        "parallel.data": 2, "parallel.pipeline": 2, "parallel.context": 2, "parallel.schedule": "zero_bubble",
        "parallel.data_parallel_sharding_strategy": "optim_grads_params", "model.recompute": "full",
        "train.micro_batch_size": 1, "model.moe_aux_loss_coef": 0.0}),
}


def test_folded_experts_with_a_capacity_drop_under_context_what_one_device_drops():
    """Folded experts (parallel.expert_tensor=1) with a capacity under context 2 x tensor 2: every rank decides its
    drops on the whole sequences, as unfolded experts do (moe.kept_in_sequences), so the layout equals one device,
    which drops half of the assignments here (without context each tensor rank would drop within its own
    sequence shard)."""
    ref_norms, norms, ref_stats, stats = [], [], [], []
    want = run_steps(small_config(**_model_sets("deepseek-moe", FOLDED_CAPACITY)), 1, STEPS, grad_norms=ref_norms,
                     stats=ref_stats)
    got = run_steps(small_config(**{**SIZE, **ARCHS["deepseek-moe"], **FOLDED_CAPACITY}), 4, STEPS, grad_norms=norms,
                    stats=stats)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-4)
    dropped = [s["moe_dropped_fraction"] for s in stats]
    np.testing.assert_allclose(dropped, [s["moe_dropped_fraction"] for s in ref_stats], rtol=1e-5)
    assert min(dropped) > 0.1, dropped


def _model_sets(arch: str, sets: dict) -> dict:
    """The same model and data on one device (with a capacity, which drops per micro batch, its micro batches)."""
    left_out = ("parallel.",) if sets.get("model.moe_capacity_factor") else ("parallel.", "train.micro")
    return {**SIZE, **ARCHS[arch], **{k: v for k, v in sets.items() if not k.startswith(left_out)}}


@pytest.mark.parametrize("name", [*LAYOUTS, *(pytest.param(n, marks=pytest.mark.slow) for n in SLOW_LAYOUTS)])
def test_context_layout_matches_one_device(name):
    arch, n, sets = {**LAYOUTS, **SLOW_LAYOUTS}[name]
    ref_norms, norms = [], []
    want = run_steps(small_config(**_model_sets(arch, sets)), 1, STEPS, grad_norms=ref_norms)
    got = run_steps(small_config(**{**SIZE, **ARCHS[arch], **sets}), n, STEPS, grad_norms=norms)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-4)


@pytest.mark.parametrize("exchange,recompute", [
    pytest.param("ring", "none", marks=pytest.mark.slow), ("ring", "selective"),
    pytest.param("all_gather", "full", marks=pytest.mark.slow), pytest.param("a2a", "full", marks=pytest.mark.slow),
    pytest.param("a2a+ring", "selective", marks=pytest.mark.slow),  # suite time
    pytest.param("a2a+ring", "full", marks=pytest.mark.slow),
    pytest.param("a2a+all_gather", "selective", marks=pytest.mark.slow)])
def test_the_exchange_on_h100_is_the_analytic_volume_and_the_ring_runs_under_the_kernels(exchange, recompute):
    """XLA's GPU program (compile-only H100s) moves exactly the analytic bytes over 'context' (audit's
    expected_context_exchange), and every ring hop has attention compute scheduled between its start and done."""
    from megajax import audit, hlo

    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-audit extra (jax-cuda12-plugin)")
    # (sequences of 8192 tokens, heads of 64: at a few thousand tokens or fewer XLA's scheduler, pricing each hop
    # by its latency, may leave one before the block it would run under)
    cfg = small_config(**{**SIZE, **ARCHS["llama"], "model.compute_dtype": "bfloat16", "model.attention_impl": "pallas",
                          "model.seq_length": 8192, "model.hidden_size": 256,
                          "parallel.context": 4, "parallel.context_comm": exchange, "model.recompute": recompute})
    cfg, mesh, compiled, setup = audit.compile_step(cfg, audit._gpu_devices("h100", 8))
    colls = [c for c in hlo.parse(compiled.as_text(), dict(mesh.shape), audit.GPUS_PER_HOST) if c.axes == ("context",)]
    moved = {}
    for c in colls:
        moved[c.kind] = moved.get(c.kind, 0) + c.bytes * c.count
    assert moved == audit.expected_context_exchange(cfg, setup.plan)["bytes_per_step"]
    if exchange == "ring":
        assert all(c.is_async and c.flops_under > 0 for c in colls), [(c.name, c.flops_under) for c in colls]
    if exchange == "a2a+ring":  # the all-to-alls inside groups of 2 adjacent ranks, the ring's hops between groups
        hops = [c for c in colls if c.kind == "collective-permute"]
        assert hops and all(c.is_async and c.flops_under > 0 for c in hops), [(c.name, c.flops_under) for c in hops]
        assert {c.group_size for c in colls if c.kind == "all-to-all"} == {2}
    if exchange == "a2a+all_gather":  # the all-to-alls inside groups of 2, the all-gathers across the 2 groups
        assert {(c.kind, c.group_size) for c in colls} == {("all-to-all", 2), ("all-gather", 2), ("reduce-scatter", 2)}


@pytest.mark.parametrize("exchange,recompute,experts", [
    ("a2a+all_gather", "full", None), pytest.param("all_gather", "none", None, marks=pytest.mark.slow),
    pytest.param("a2a", "selective", "dropless", marks=pytest.mark.slow),
    pytest.param("all_gather", "none", "capacity", marks=pytest.mark.slow)])
def test_the_exchange_under_a_pipeline_on_h100_is_the_analytic_volume(exchange, recompute, experts):
    """Under a 1F1B pipeline of 2 (4 micro batches), the H100 program, its branches counted as the schedule runs
    them, moves the analytic bytes over 'context': the forwards the schedule recomputes (rank 0's, not the last
    chunk's, which keeps its residuals) repeat their all-to-alls and all-gathers, whatever model.recompute says.
    With experts (data 2 x expert 2, context 2), each expert all-to-all carries a context rank's tokens, as often as
    audit.expected_all_to_all says (with a capacity too: under context its kept rows go as dropless ones)."""
    from megajax import audit, hlo
    from megajax.parallel.pipeline import ticks

    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-audit extra (jax-cuda12-plugin)")
    moe = {"model.num_experts": 4, "model.experts_per_token": 2, "parallel.data": 2, "parallel.expert": 2,
           "parallel.context": 2, "model.moe_capacity_factor": 1.0 if experts == "capacity" else None,
           "model.moe_token_drop_policy": "probs"} if experts else {"parallel.context": 4}
    cfg = small_config(**{**SIZE, **ARCHS["llama"], "model.compute_dtype": "bfloat16", "model.attention_impl": "pallas",
                          "parallel.pipeline": 2, "parallel.context_comm": exchange, "model.recompute": recompute,
                          "train.micro_batch_size": 1, "model.seq_length": 64, **moe})
    cfg, mesh, compiled, setup = audit.compile_step(cfg, audit._gpu_devices("h100", 8))
    colls = hlo.parse(compiled.as_text(), dict(mesh.shape), audit.GPUS_PER_HOST,
                      branch_runs=ticks.branch_runs(setup.plan, cfg.model))
    moved = {}
    for c in colls:
        # (not the loss's and the gradients' reductions, nor the capacity's expert ids and routing weights gathered
        # over context, 4 bytes each a token and expert, in one all-gather)
        ids = cfg.train.micro_batch_size * cfg.model.seq_length * cfg.model.experts_per_token * 4 * 2
        if c.axes == ("context",) and c.kind != "all-reduce" and not (experts == "capacity" and c.bytes == ids):
            moved[c.kind] = moved.get(c.kind, 0) + c.bytes * c.count
    assert moved == audit.expected_context_exchange(cfg, setup.plan)["bytes_per_step"]
    if experts:
        want = audit.expected_all_to_all(cfg)
        rows = [c for c in colls if c.kind == "all-to-all" and c.axes == ("expert",) and c.bytes > 64]
        assert {c.bytes for c in rows} == {want["buffer_bytes_each"]}
        assert sum(c.count for c in rows) == want["count"] == (4 + 2 * 0.5) * 2 * 4
