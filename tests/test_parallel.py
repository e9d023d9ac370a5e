"""Gradient accumulation and dropout are layout independent (every layout against one device: test_layouts)."""

import math

import numpy as np
import pytest

from conftest import jaxpr_eqns, run_steps, shared_across_workers, small_config
from megajax.parallel import step_plan
from megajax.parallel.step_plan import StepPlan


def _overlap_plan(mode: str) -> StepPlan:
    """A step plan with only the tensor-parallel collectives decomposed as `mode` says ("ring" or "chunks")."""
    return StepPlan(tp_overlap=mode)

STEPS = 4
ARCHS = {"gpt2": {}}


@shared_across_workers
def reference(arch: str) -> tuple[float, ...]:
    return tuple(run_steps(small_config(**ARCHS[arch]), 1, STEPS))


def test_micro_batches_match_one_batch():
    """Gradient accumulation over 4 micro batches equals one big batch (one device)."""
    ref = reference("gpt2")
    got = run_steps(small_config(**{"train.micro_batch_size": 2}), 1, STEPS)
    np.testing.assert_allclose(got, ref, rtol=1e-4)


def test_dropout_is_layout_independent():
    """Dropout masks come from (seed, sample index, layer): the same on any mesh."""
    drop = {"model.dropout": 0.1, "model.attention_dropout": 0.1}
    ref = run_steps(small_config(**drop), 1, 2)
    got = run_steps(small_config(**drop, **{"parallel.data": 2, "parallel.tensor": 4,
                                            "parallel.sequence_parallel": True}), 8, 2)
    np.testing.assert_allclose(got, ref, rtol=1e-4)
    # (at initialisation the first loss moves by chance amounts either way; the step after trains on dropped
    # activations)
    assert max(abs(a - b) for a, b in zip(ref, reference("gpt2"))) > 1e-3, "dropout should change the losses"


# The overlapped gradient reduction (parallel.overlap_grad_reduce, megajax/parallel/overlap.py) over its space: one micro
# batch (nothing summed before the last) and several, each recompute mode, both architectures (tied and untied
# embeddings), dropout, tensor and sequence parallelism, MoE with the experts over 'expert'; all-reduced, or
# scattered onto the distributed optimizer's shards (over 'data' alone, over 'data' x 'expert', with 'tensor'
# manual too, and a tensor-sharded bias all-reduced and sliced); the weights kept as their shards between steps
# and gathered in the first forward (overlap_param_gather; first micro batch = last, or not). With a pipeline
# (1f1b and interleaved): each rank reduces its layers inside the schedule, all-reduced or scattered, with tensor
# and sequence parallelism, full recomputation and MoE experts over 'expert'; and gathers them from their shards in
# its warm-up (overlap_param_gather, with tensor and sequence parallelism here, with MoE in the layout matrix); and
# at p 4 with parallel.overlap_comm_ratio capping the idle ticks' runs (the rest at the schedule's end and start).
ZERO = {"parallel.distributed_optimizer": True}
GATHER = {**ZERO, "parallel.overlap_param_gather": True}
OVERLAP_CASES = {
    "gpt2-d2-m1": {"parallel.data": 2},
    "gpt2-d2t2-m2-zero": {"parallel.data": 2, "parallel.tensor": 2, "train.micro_batch_size": 2, **ZERO},
    "llama-d2t2sp-m2-full-zero-gather": {"model.arch": "llama", "parallel.data": 2, "parallel.tensor": 2,
                                         "parallel.sequence_parallel": True, "train.micro_batch_size": 2,
                                         "model.recompute": "full", **GATHER},
    "gpt2-d4-m2-selective-dropout": {"parallel.data": 4, "train.micro_batch_size": 1, "model.recompute": "selective",
                                     "model.dropout": 0.1},
    "llama-moe-d4e2-m1-zero-gather": {"model.arch": "llama", "model.num_experts": 4, "model.experts_per_token": 2,
                                      "model.moe_ffn_hidden_size": 32, "parallel.data": 4, "parallel.expert": 2,
                                      "train.micro_batch_size": 2, **GATHER},
    "gpt2-d2p2-m4": {"parallel.data": 2, "parallel.pipeline": 2, "train.micro_batch_size": 2},
    "llama-d2p2t2sp-interleaved-full-gather": {"model.arch": "llama", "model.num_layers": 4, "parallel.data": 2,
                                               "parallel.pipeline": 2, "parallel.tensor": 2,
                                               "parallel.sequence_parallel": True, "parallel.schedule": "interleaved",
                                               "parallel.virtual_stages": 2, "train.micro_batch_size": 1,
                                               "model.recompute": "full", **GATHER},
    "gpt2-d2p4-m4-gather-capped": {"model.num_layers": 8, "parallel.data": 2, "parallel.pipeline": 4,
                                   "train.micro_batch_size": 1, "parallel.overlap_comm_ratio": 4.0, **GATHER},
    "llama-moe-d4e2p2-zero": {"model.arch": "llama", "model.num_experts": 4, "model.experts_per_token": 2,
                              "model.moe_ffn_hidden_size": 32, "parallel.data": 4, "parallel.expert": 2,
                              "parallel.pipeline": 2, "train.micro_batch_size": 1, **ZERO},
}
# (the layout matrix runs 1f1b's all-reduce, MoE on a pipeline and the interleaved pipeline's gathered weights by
# default; suite time: the capped, the MoE gather and the interleaved full-recompute gather cases are slow too)
SLOW_OVERLAP = ("gpt2-d4-m2-selective-dropout", "gpt2-d2-m1", "gpt2-d2p2-m4", "llama-moe-d4e2p2-zero",
                "gpt2-d2p4-m4-gather-capped", "llama-moe-d4e2-m1-zero-gather", "llama-d2p2t2sp-interleaved-full-gather")


# the dropout case, the plain all-reduce at one micro batch and two pipelined cases with -m slow (suite time; the
# audit test compiles the all-reduce path by default)
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_OVERLAP else c
                                  for c in OVERLAP_CASES])
def test_overlapped_gradient_reduction_matches_one_device(case):
    sets = OVERLAP_CASES[case]
    n = sets.get("parallel.data", 1) * sets.get("parallel.tensor", 1) * sets.get("parallel.pipeline", 1)
    # one device: the same model and micro batch size (it splits the batch as the layout's ranks do)
    single = {k: v for k, v in sets.items() if not k.startswith("parallel.")}
    ref_norms, norms = [], []
    ref = run_steps(small_config(**single), 1, 2, grad_norms=ref_norms)
    got = run_steps(small_config(**sets, **{"parallel.overlap_grad_reduce": True}), n, 2, grad_norms=norms)
    np.testing.assert_allclose(got, ref, rtol=1e-4)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-4)


# overlap_param_gather gathers the matmul weights in the compute dtype (Megatron gathers its bf16 parameters): in bf16
# the step is the one that gathers fp32 weights and casts them where the model reads them, without a pipeline (one
# micro batch: the gathering backward is the reducing one) and inside the schedule's ticks (d2 x p4: idle ticks and
# rank 0's first forwards; -m slow, suite time: the overlapped reduction's cases gather on a pipeline by default).
@pytest.mark.parametrize("sets", [
    pytest.param({"parallel.data": 2, "parallel.tensor": 2, "parallel.sequence_parallel": True,
                  "train.micro_batch_size": 4}, id="d2t2sp-m1"),
    pytest.param({"model.num_layers": 8, "parallel.data": 2, "parallel.pipeline": 4, "train.micro_batch_size": 1},
                 id="d2p4-m4", marks=pytest.mark.slow),
])
def test_weights_gathered_in_bf16_train_as_gathered_in_fp32(sets, monkeypatch):
    import jax

    from megajax.parallel import engines

    cfg = small_config(**sets, **GATHER, **{"parallel.overlap_grad_reduce": True, "model.compute_dtype": "bfloat16"})
    n = sets["parallel.data"] * sets.get("parallel.tensor", 1) * sets.get("parallel.pipeline", 1)
    norms_low, norms = [], []
    low = run_steps(cfg, n, 2, grad_norms=norms_low)
    monkeypatch.setattr(engines, "_gather_dtypes", lambda cfg, params: jax.tree.map(lambda _: {}, params))
    whole = run_steps(cfg, n, 2, grad_norms=norms)
    np.testing.assert_allclose(low, whole, rtol=1e-6)
    np.testing.assert_allclose(norms_low, norms, rtol=1e-5)


# parallel.tp_comm_overlap (megajax/model/collective_matmul.py): the ring and chunked matmuls against plain einsums,
# then training against one device over its space: pure tensor parallelism and with data, t 2 and 4, both
# architectures, each recompute mode, dropout, MoE (a gated shared expert through the ring MLP), context
# parallelism, the overlapped data-parallel reduction with the distributed optimizer and the gathered weights, and
# the pipeline's schedules (the chunks).
@pytest.mark.parametrize("mode", ["ring", "chunks"])
@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("spec,x_shape,w_shape,w_names,kind", [
    ("bsd,dgjk->bsgjk", (2, 8, 16), (16, 4, 3, 8), ("embed", "kv_heads", None, "head_dim"), "gather"),
    ("bsd,dtf->bstf", (2, 8, 16), (16, 2, 24), ("embed", None, "mlp"), "gather"),
    ("bshk,hkd->bsd", (2, 8, 4, 8), (4, 8, 16), ("heads", "head_dim", "embed"), "scatter"),
    ("bsf,fd->bsd", (2, 8, 24), (24, 16), ("mlp", "embed"), "scatter"),
])
def test_collective_matmuls_equal_gather_then_matmul(mode, t, spec, x_shape, w_shape, w_names, kind):
    """Output, input gradient and weight gradient of the rings, and of the chunks (8 rows: t 2 cuts each rank's
    4-row block into 2 chunks, t 4 its 2 rows into 2), equal the plain einsum's (which XLA runs with an all-gather
    before, or a reduce-scatter after), under a 2 x t (data, tensor) mesh with 'data' manual around it as in the
    train step."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from megajax.model import collective_matmul as cm

    mesh = jax.make_mesh((2, t), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:2 * t])
    x = jax.random.normal(jax.random.key(0), x_shape)
    w = jax.random.normal(jax.random.key(1), w_shape)
    g = jax.random.normal(jax.random.key(2), jnp.einsum(spec, x, w).shape)
    ring = cm.gather_matmul if kind == "gather" else cm.matmul_scatter

    def loss(f, x, w):
        def local(x, w, g):
            return jax.lax.psum(jnp.sum(f(x, jax.lax.pcast(w, ("data",), to="varying")) * g), "data")
        return jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P(), P("data")), out_specs=P(),
                             axis_names={"data"})(x, w, g)

    with jax.set_mesh(mesh), step_plan.use(_overlap_plan(mode)):
        x_in = jax.device_put(x, NamedSharding(mesh, P("data", "tensor") if kind == "gather" else P("data")))
        got = jax.jit(jax.value_and_grad(lambda x, w: loss(lambda a, b: ring(spec, a, b, w_names), x, w),
                                         argnums=(0, 1)))(x_in, w)
    want = jax.value_and_grad(lambda x, w: jnp.sum(jnp.einsum(spec, x, w) * g), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_chunked_collectives_train_in_bf16_on_cpu():
    """A pipeline with parallel.tp_comm_overlap in bf16 (the chunks' reduce-scatters in bf16) once aborted XLA's CPU
    compiler ("Invalid binary instruction opcode copy"); on CPU they sum in fp32 now. The losses equal one device's
    to bf16 precision."""
    sets = {"model.arch": "llama", "model.num_layers": 4, "model.compute_dtype": "bfloat16"}
    want = run_steps(small_config(**sets), 1, 2)
    got = run_steps(small_config(**sets, **{"parallel.pipeline": 2, "parallel.tensor": 2, "train.micro_batch_size": 2,
                                            "parallel.sequence_parallel": True, "parallel.tp_comm_overlap": True,
                                            "parallel.schedule": "gpipe"}), 4, 2)
    np.testing.assert_allclose(got, want, rtol=2e-3)


@pytest.mark.parametrize("platform,summed_in,conditional", [("cpu", "float32", False), ("gpu", "bfloat16", False),
                                                            (None, None, True)])
def test_the_chunks_reduce_scatter_is_chosen_when_the_step_is_traced(platform, summed_in, conditional):
    """The chunks' reduce-scatter sums in fp32 on CPU only, chosen by step_plan.platform_dependent from the plan's
    platform (StepPlan.platform, which step.build sets from the mesh) when the step is traced. Only without one
    (an export for another platform) is the choice left to lax.platform_dependent, whose conditional in the jaxpr
    made XLA's GPU scheduler hide 59% of a pipeline's chunked reduce-scatters under GEMMs instead of 89% (the slow
    test_audit.py::test_tp_comm_overlap_hides_the_tensor_collectives_in_a_pipeline_on_h100)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from megajax.model import collective_matmul

    mesh = jax.make_mesh((2,), ("tensor",), devices=jax.devices()[:2])
    fn = jax.shard_map(collective_matmul._reduce_scatter, mesh=mesh, in_specs=P(), out_specs=P(None, "tensor"))
    with step_plan.use(StepPlan(tensor=2, platform=platform)):
        jaxpr = jax.make_jaxpr(fn)(jnp.zeros((2, 4, 8), jnp.bfloat16))
    found = list(jaxpr_eqns(jaxpr.jaxpr))
    assert any(e.primitive.name == "cond" for e in found) == conditional
    if summed_in:
        assert [str(e.invars[0].aval.dtype) for e in found if e.primitive.name == "reduce_scatter"] == [summed_in]


@pytest.mark.parametrize("mode", ["ring", "chunks"])
@pytest.mark.parametrize("recipe", ["current", "delayed", "blockwise"])
@pytest.mark.parametrize("kind", ["gather", "scatter"])
def test_fp8_collective_matmuls_equal_the_fp8_matmul(mode, recipe, kind):
    """With model.fp8 the rings and chunks move FP8 blocks (quantized before the collectives with the whole
    tensor's amax): output, both gradients and the delayed-scaling state's gradient (the amax exponents seen)
    equal `fp8.einsum` on the gathered input, t 2 under a 2 x 2 (data, tensor) mesh. Blockwise, each ring step's
    products are blockwise on its piece (blocks in the compute dtype travel): equal to `block_einsum` where the
    pieces are whole tiles of tokens (sequence 64: blocks of 32 tokens, chunks of 16, tiles of 16)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from megajax.model import collective_matmul as cm
    from megajax.model import fp8, fp8_blockwise

    s = 64 if recipe == "blockwise" else 8
    spec, x_shape, w_shape, w_names = (("bsd,df->bsf", (2, s, 16), (16, 24), ("embed", "mlp")) if kind == "gather"
                                       else ("bsf,fd->bsd", (2, s, 24), (24, 16), ("mlp", "embed")))
    mesh = jax.make_mesh((2, 2), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4])
    x = jax.random.normal(jax.random.key(0), x_shape)
    w = jax.random.normal(jax.random.key(1), w_shape) * 0.1
    g = jax.random.normal(jax.random.key(2), jnp.einsum(spec, x, w).shape) * 1e-3
    counters = np.zeros((3, fp8.BINS), np.float32)
    counters[:, fp8.BINS // 2 + 3] = 1  # an amax history (below 2^3) for x, w and dy
    meta = jnp.asarray(counters.reshape(-1)) if recipe == "delayed" else None
    ring = cm.gather_matmul if kind == "gather" else cm.matmul_scatter

    def loss(f, x, w, meta):
        def local(x, w, g, meta):
            vary = lambda a: None if a is None else jax.lax.pcast(a, ("data",), to="varying")  # noqa: E731
            return jax.lax.psum(jnp.sum(f(x, vary(w), vary(meta)) * g), "data")
        return jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P(), P("data"), P()), out_specs=P(),
                             axis_names={"data"})(x, w, g, meta)

    def run(f, x_spec, on):
        with jax.set_mesh(mesh), step_plan.use(_overlap_plan(mode) if on else None):
            x_in = jax.device_put(x, NamedSharding(mesh, x_spec))
            return jax.jit(jax.value_and_grad(lambda x, w, m: loss(f, x, w, m), argnums=(0, 1, 2)))(x_in, w, meta)

    fmt = ("blockwise", 16) if recipe == "blockwise" else ("hybrid", 0)
    got = run(lambda a, b, m: ring(spec, a, b, w_names, fmt, m),
              P("data", "tensor") if kind == "gather" else P("data"), True)
    if recipe == "blockwise":
        want = run(lambda a, b, m: fp8_blockwise.block_einsum(spec, 16, w_names, a, b), P("data"), False)
    else:
        want = run(lambda a, b, m: fp8.einsum(spec, "hybrid", 0, a, b, m), P("data"), False)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    assert (meta is None) == (got[1][2] is None)
    exact = run(lambda a, b, m: jnp.einsum(spec, a, b), P("data"), False)
    assert not np.allclose(got[1][1], exact[1][1], rtol=1e-3)  # the products were taken in FP8


TP = {"parallel.sequence_parallel": True, "parallel.tp_comm_overlap": True}
TP_CASES = {
    "gpt2-t2-selective-dropout": {"parallel.tensor": 2, "model.recompute": "selective", "model.dropout": 0.1},
    "llama-d2t4-full": {"model.arch": "llama", "model.num_heads": 8, "model.num_kv_heads": 4, "parallel.data": 2,
                        "parallel.tensor": 4, "model.recompute": "full"},
    "llama-moe-d2e2t2-shared": {"model.arch": "llama", "model.num_experts": 4, "model.experts_per_token": 2,
                                "model.moe_ffn_hidden_size": 32, "model.moe_shared_experts": 1,
                                "model.moe_shared_expert_gate": True, "parallel.data": 2, "parallel.expert": 2,
                                "parallel.tensor": 2, "train.micro_batch_size": 2},
    "gpt2-c2t2": {"parallel.context": 2, "parallel.tensor": 2},
    "llama-d2t2-m2-overlap-zero-gather": {"model.arch": "llama", "parallel.data": 2, "parallel.tensor": 2,
                                          "train.micro_batch_size": 2, "parallel.overlap_grad_reduce": True,
                                          **GATHER},
    # in the pipeline's per-rank branches: chunked all-gathers and reduce-scatters
    "llama-d2p2t2-1f1b": {"model.arch": "llama", "parallel.data": 2, "parallel.pipeline": 2, "parallel.tensor": 2,
                          "parallel.schedule": "1f1b", "train.micro_batch_size": 2},
    "gpt2-p2t4-interleaved-full": {"model.num_layers": 4, "model.num_heads": 8, "parallel.pipeline": 2,
                                   "parallel.tensor": 4, "parallel.schedule": "interleaved",
                                   "parallel.virtual_stages": 2, "model.recompute": "full",
                                   "train.micro_batch_size": 2},
    "gpt2-d2p2t2-gpipe-selective": {"parallel.data": 2, "parallel.pipeline": 2, "parallel.tensor": 2,
                                    "parallel.schedule": "gpipe", "model.recompute": "selective",
                                    "train.micro_batch_size": 2},
    # zero bubble: B's collective matmuls leave the weight gradients to W, which gathers under its GEMMs as well
    "llama-d2p2t2-zero_bubble": {"model.arch": "llama", "model.num_layers": 4, "parallel.data": 2,
                                 "parallel.pipeline": 2, "parallel.tensor": 2, "parallel.schedule": "zero_bubble",
                                 "train.micro_batch_size": 2},
    "gpt2-p2t2-zero_bubble-v2-selective": {"model.num_layers": 4, "parallel.pipeline": 2, "parallel.tensor": 2,
                                           "parallel.schedule": "zero_bubble", "parallel.virtual_stages": 2,
                                           "model.recompute": "selective", "train.micro_batch_size": 2},
    "llama-d2p2t2-interleaved-overlap-gather": {"model.arch": "llama", "model.num_layers": 4, "parallel.data": 2,
                                                "parallel.pipeline": 2, "parallel.tensor": 2,
                                                "parallel.schedule": "interleaved", "parallel.virtual_stages": 2,
                                                "train.micro_batch_size": 2, "parallel.overlap_grad_reduce": True,
                                                **GATHER},
}


# suite time: the rest with -m slow (the layout matrix runs the ring on its sequence-parallel layouts by default, t 4
# among them)
@pytest.mark.slow  # suite time (25 s a case; test_layouts trains the collective matmuls on three layouts by default)
@pytest.mark.parametrize("case", TP_CASES)
def test_tp_comm_overlap_matches_one_device(case):
    sets = {**TP_CASES[case], **TP}
    n = math.prod(sets.get(f"parallel.{a}", 1) for a in ("data", "pipeline", "tensor", "context"))
    single = {k: v for k, v in sets.items() if not k.startswith("parallel.")}
    ref_norms, norms = [], []
    ref = run_steps(small_config(**single), 1, 2, grad_norms=ref_norms)
    got = run_steps(small_config(**sets), n, 2, grad_norms=norms)
    np.testing.assert_allclose(got, ref, rtol=1e-4)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-4)


@pytest.mark.parametrize("sets,fix", [
    ({"parallel.tensor": 2, "parallel.tp_comm_overlap": True}, "set parallel.sequence_parallel=true"),
])
def test_tp_comm_overlap_bad_configs_name_the_fix(sets, fix):
    from megajax import config as config_lib

    with pytest.raises(config_lib.ConfigError, match=fix):
        small_config(**sets)
