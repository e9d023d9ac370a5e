"""Mixture of experts: the layer against a naive per-token reference, the auxiliary losses' gradient, the
config's checks, and training that equals one device on data, tensor (with sequence parallelism) and
pipeline layouts (fp32, 1e-4), with and without expert parallelism (tests/test_layouts.py enumerates the
expert-parallel layouts with every other parallelism)."""

import dataclasses
import functools
import itertools

import numpy as np
import pytest

from megajax import config as config_lib
from megajax.parallel import step_plan
from megajax.parallel.step_plan import StepPlan

from conftest import REPO, evaluate, gpu, run_steps, shared_across_workers, small_config

MOE = {"model.num_experts": 4, "model.experts_per_token": 2, "model.moe_ffn_hidden_size": 96,
       "model.moe_aux_loss_coef": 0.01, "model.moe_z_loss_coef": 0.001, "train.micro_batch_size": 2}
# parallel.expert_tensor=1 on d2 e2 x t2 (sequence parallel), here with a capacity of experts / k, which drops
# nothing (equals dropless routing on one device)
FOLD = {"parallel.data": 2, "parallel.expert": 2, "parallel.tensor": 2, "parallel.sequence_parallel": True,
        "parallel.expert_tensor": 1, "model.moe_capacity_factor": 2.0}


def _layer(arch, shared, capacity_factor=None, policy="probs", qwen=False):
    import flax.linen as nn
    import jax

    from megajax.config import ModelConfig
    from megajax.model import moe

    cfg = ModelConfig(arch=arch, hidden_size=32, num_heads=4, seq_length=8, num_experts=4, experts_per_token=2,
                      moe_ffn_hidden_size=48, moe_shared_experts=shared, moe_z_loss_coef=0.1,
                      moe_capacity_factor=capacity_factor, moe_token_drop_policy=policy,
                      moe_shared_expert_gate=qwen, moe_router_pre_softmax=qwen)
    x = jax.random.normal(jax.random.key(0), (2, 8, 32))
    layer = moe.MoE(cfg)
    return cfg, layer, nn.unbox(layer.init(jax.random.key(1), x)["params"]), x


@pytest.mark.parametrize("arch,shared,factor,policy,qwen", [
    ("gpt2", 0, None, "probs", False), ("llama", 0, None, "probs", False), ("llama", 1, None, "probs", False),
    ("llama", 1, None, "probs", True), ("gpt2", 0, 0.5, "probs", False), ("gpt2", 0, 0.5, "position", False),
    ("llama", 0, 1.0, "probs", False), ("llama", 0, 1.0, "position", False), ("gpt2", 0, 4.0, "probs", False)])
def test_layer_equals_every_token_through_its_experts(arch, shared, factor, policy, qwen):
    """Dropless, and with a capacity: each expert keeps c of its assignments, those with the largest routing
    weights (policy probs) or the first in token order (position); the rest contribute nothing (c = factor x
    16 tokens x 2 / 4 experts; 4.0 drops none). Qwen-MoE's routing weighs the k experts by their probabilities
    (not renormalised) and gates the shared expert by sigmoid(x . shared_gate)."""
    import jax

    from megajax.model import moe
    from megajax.model.layers import MLP

    cfg, layer, p, x = _layer(arch, shared, factor, policy, qwen)
    got = np.asarray(layer.apply({"params": p}, x)).reshape(16, 32)
    xt = np.asarray(x).reshape(16, 32)
    weights, ids, probs = moe.route(xt @ p["router"], moe.Routing(2))
    if qwen:
        weights = np.take_along_axis(np.asarray(probs), np.asarray(ids), axis=1)
    c = moe.capacity(16, 2, 4, factor) if factor else 16 * 2
    kept = set()
    for e in range(4):
        mine = [(t, j) for t in range(16) for j in range(2) if int(ids[t, j]) == e]
        if policy == "probs":
            mine.sort(key=lambda tj: -float(weights[tj]))  # (stable: ties in token order)
        kept |= set(mine[:c])
    if factor == 0.5:
        assert len(kept) < 32, "the case drops something"
    ref = np.zeros((16, 32))
    for t in range(16):
        for j in range(2):
            e = int(ids[t, j])
            if (t, j) not in kept:
                continue
            if arch == "llama":
                gate_up = np.einsum("d,dfj->fj", xt[t], p["w_gate_up"][e])
                hidden = jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]
            else:
                hidden = jax.nn.gelu(xt[t] @ p["w_in"][e] + p["b_in"][e], approximate=True)
            ref[t] += float(weights[t, j]) * np.asarray(hidden @ p["w_out"][e])
    if arch == "gpt2":
        ref += np.asarray(p["b_out"])
    if shared:
        dense = dataclasses.replace(cfg, ffn_hidden_size=48 * shared, num_experts=0)
        out = np.asarray(MLP(dense).apply({"params": p["shared"]}, x)).reshape(16, 32)
        ref += out / (1 + np.exp(-xt @ np.asarray(p["shared_gate"]))[:, None]) if qwen else out
    np.testing.assert_allclose(got, ref, atol=1e-5)
    w, _, _ = moe.route(xt @ p["router"], moe.Routing(2))
    np.testing.assert_allclose(np.sum(w, -1), 1.0, rtol=1e-6)


def test_auxiliary_losses_join_the_gradient_at_the_objective_scale():
    import jax
    import jax.numpy as jnp

    from megajax.model import moe

    cfg, layer, p, x = _layer("gpt2", 0)
    g = jax.random.normal(jax.random.key(3), (2, 8, 32))

    def attached(p):
        return jnp.sum(layer.apply({"params": p}, x, jnp.float32(0.5)) * g)

    def explicit(p):
        logits = x.reshape(16, 32) @ p["router"]
        _, ids, probs = moe.route(logits, moe.Routing(2))
        aux = cfg.moe_aux_loss_coef * moe.load_balancing_loss(probs, ids) + cfg.moe_z_loss_coef * moe.z_loss(logits)
        return jnp.sum(layer.apply({"params": p}, x) * g) + 0.5 * 16 * aux

    a, b = jax.grad(attached)(p), jax.grad(explicit)(p)
    assert float(jnp.abs(a["router"]).max()) > 0
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-7), a, b)
    # balanced routing gives a load-balancing loss of 1
    probs = jnp.full((8, 4), 0.25)
    assert float(moe.load_balancing_loss(probs, jnp.arange(16).reshape(8, 2) % 4)) == pytest.approx(1.0)


@pytest.mark.parametrize("sets,fix", [
    ({"model.num_experts": 4, "model.experts_per_token": 5}, "experts_per_token"),
    ({"model.num_experts": 4, "model.moe_capacity_factor": -1.0}, "moe_capacity_factor"),
    ({"model.num_experts": 4, "model.num_layers": 3, "model.moe_layer_freq": 2}, "choose a frequency from"),
    ({"model.num_experts": 4, "model.num_layers": 4, "model.moe_layer_freq": 2, "parallel.pipeline": 2,
      "parallel.virtual_stages": 2, "parallel.schedule": "interleaved", "train.micro_batch_size": 2},
     "a pipeline chunk holds whole groups"),
    ({"model.num_experts": 4, "parallel.data": 2, "parallel.expert": 4}, "choose parallel.expert from"),
    ({"model.num_experts": 6, "parallel.data": 4, "parallel.expert": 4}, "not divisible by parallel.expert"),
    ({"parallel.data": 2, "parallel.expert": 2}, "needs an MoE model"),
    ({"model.num_experts": 4, "model.moe_capacity_factor": 1.0, "parallel.tensor": 2, "parallel.expert_tensor": 1},
     "set parallel.sequence_parallel=true"),
    ({"model.num_experts": 4, "parallel.tensor": 2, "parallel.expert_tensor": 3}, "must be null"),
    ({**FOLD, "model.num_experts": 6, "parallel.data": 2, "parallel.expert": 2}, "not divisible by parallel.expert x"),
    ({**FOLD, "parallel.expert": 1, "model.num_experts": 0}, "spreads the experts over the tensor ranks"),
    ({"model.num_experts": 4, "parallel.data": 2, "parallel.expert": 2, "model.moe_capacity_factor": 1.0,
      "parallel.expert_all_to_all": "ragged"}, "set parallel.expert_all_to_all=padded"),
    ({"model.num_experts": 4, "parallel.data": 2, "parallel.expert_all_to_all": "ragged"},
     "parallel.expert > 1 or parallel.expert_tensor=1"),
    ({"parallel.expert_all_to_all": "sparse"}, "expert_all_to_all"),
    ({"model.num_experts": 8, "model.moe_router_num_groups": 4}, "needs both"),
    ({"model.num_experts": 8, "model.moe_router_num_groups": 3, "model.moe_router_group_topk": 1}, "must divide"),
    ({"model.num_experts": 8, "model.experts_per_token": 4, "model.moe_router_num_groups": 4,
      "model.moe_router_group_topk": 1}, "must hold"),
    ({"model.num_experts": 8, "model.experts_per_token": 3, "model.moe_router_num_groups": 4,
      "model.moe_router_group_topk": 2}, "must be a multiple of"),
    ({"model.num_experts": 4, "model.moe_router_score_function": "sigmoid", "model.moe_router_pre_softmax": True},
     "unset one of them"),
    ({"model.num_experts": 4, "model.moe_router_topk_scaling_factor": 0.0}, "must be positive or null"),
    ({"model.num_experts": 4, "parallel.data": 2, "parallel.expert": 2, "parallel.expert_buffer_factor": 1.0},
     "set parallel.expert_all_to_all=ragged"),
    ({"model.num_experts": 4, "parallel.data": 2, "parallel.expert": 2, "parallel.expert_all_to_all": "ragged",
      "parallel.expert_buffer_factor": 0.0}, "must be positive or null"),
])
def test_bad_moe_configs_name_the_fix(sets, fix):
    with pytest.raises(config_lib.ConfigError, match=fix):
        small_config(**sets)


@pytest.mark.parametrize("factor,grouped,ragged", [  # with a capacity: -m slow (suite time)
    pytest.param(0.5, False, False, marks=pytest.mark.slow), (None, False, False), (None, True, False),
    (None, False, True)])
def test_folded_experts_route_and_drop_per_sequence_shard(factor, grouped, ragged):
    """parallel.expert_tensor=1: each tensor rank routes its own sequence shard, so with a capacity every shard
    drops on its own tokens (Megatron's per-rank dropping). On t 2 with sequence parallelism (GSPMD, experts
    whole on each rank, exchanged over 'tensor') the layer equals one device's layer run on each half of the
    sequence, and its statistics count both halves' assignments and drops. Dropless (with jax.lax.ragged_dot or
    the Pallas grouped GEMM, interpreted) routing is per token, so it also equals one device on the whole
    sequence, with the rows sent in padded blocks or by exact counts (`ragged`: XLA's ragged all-to-all, emulated
    on CPU)."""
    import jax
    import jax.numpy as jnp

    from megajax.parallel import sharding
    from megajax.config import ParallelConfig
    from megajax.model import moe

    cfg, layer, p, x = _layer("llama", 0, factor)
    halves = [layer.apply({"params": p}, x[:, h * 4:(h + 1) * 4]) for h in range(2)]
    folded = moe.MoE(dataclasses.replace(cfg, moe_grouped_gemm=grouped))

    def stats_of(layer, q, x):
        return jax.grad(lambda q: jnp.sum(layer.apply({"params": q}, x) ** 2))(q)[moe.STATS]

    mesh = sharding.make_mesh(ParallelConfig(data=1, tensor=2, sequence_parallel=True), jax.devices()[:2])
    specs = {k: step_plan.param_spec(n, folded_experts=True) for k, n in {
        "router": ("embed", None), "w_gate_up": ("expert", "embed", "mlp", None),
        "w_out": ("expert", "mlp", "embed"), moe.STATS: (None,)}.items()}
    assert specs["w_gate_up"] == jax.sharding.PartitionSpec(("expert", "tensor"), None, None, None)
    q = {k: jax.device_put(v, jax.sharding.NamedSharding(mesh, specs[k])) for k, v in p.items()}
    plan = StepPlan(tensor=2, sequence_parallel=True, moe_folds=2, moe_ragged=ragged)
    with jax.set_mesh(mesh), step_plan.use(plan):
        assert moe.folds() == 2
        got = jax.jit(lambda q, x: folded.apply({"params": q}, x))(q, x)
        stats = jax.jit(functools.partial(stats_of, folded))(q, x)
        grads = jax.jit(jax.grad(lambda q, x: jnp.sum(folded.apply({"params": q}, x) ** 2)))(q, x)
    np.testing.assert_allclose(got, np.concatenate(halves, axis=1), rtol=1e-5, atol=1e-6)
    want = sum(np.asarray(stats_of(layer, p, x[:, h * 4:(h + 1) * 4])) for h in range(2))
    np.testing.assert_allclose(stats[:4], want[:4])  # assignments per expert
    np.testing.assert_allclose(stats[-1], want[-1])  # drops
    whole = stats_of(layer, p, x)  # one device, one group
    want_grads = jax.grad(lambda q, x: jnp.sum(layer.apply({"params": q}, x) ** 2))(p, x)
    if factor is None:  # dropless: the same tokens through the same experts as on one device
        assert stats[-1] == 0
        np.testing.assert_allclose(got, layer.apply({"params": p}, x), rtol=1e-5, atol=1e-6)
        for name in ("router", "w_gate_up", "w_out"):
            np.testing.assert_allclose(grads[name], want_grads[name], rtol=1e-4, atol=1e-6)
    else:  # the capacity over all 16 tokens drops differently
        assert stats[-1] > 0, "the case drops something"
        assert whole[-1] != stats[-1] or not np.allclose(layer.apply({"params": p}, x), got)


@gpu
def test_each_ragged_exchange_s_buffer_is_made_after_the_rows_it_sends():
    """In the compiled H100 program's schedule (the order of its instructions), every ragged all-to-all's receiving
    buffer is made after the rows it sends, not early: one zeros shared by every exchange became a copy an exchange,
    which XLA made at the step's start and held (3.3 GiB of the DeepSeek-V3 preset's peak)."""
    import re

    from megajax import audit
    from megajax.config import io as config_io

    cfg = config_io.load(f"{REPO}/configs/tiny-moe.yaml", [
        "parallel.data=4", "parallel.expert=4", "parallel.tensor=2", "parallel.expert_all_to_all=ragged",
        "model.moe_capacity_factor=null", "model.compute_dtype=bfloat16", "train.micro_batch_size=2"])
    text = audit.compile_step(cfg, audit._gpu_devices("h100", 8))[2].as_text()
    lines = text.splitlines()
    where = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*(?:ROOT )?(%[\w.\-]+) = ", line))}
    exchanges = [line.split(" ragged-all-to-all-start(")[1].split(", ")[:2] for line in lines
                 if " ragged-all-to-all-start(" in line]
    assert len(exchanges) >= 4  # (dispatch and combine, forward and backward, in the layers' loop or unrolled)
    assert all(where[out] > where[rows] for rows, out in exchanges), exchanges


@pytest.mark.parametrize("factor", [0.5, 0.8, 2.0])
def test_ragged_receiving_buffer_drops_what_does_not_fit(factor):
    """parallel.expert_buffer_factor: with the ragged exchange each rank's receiving buffer holds factor x one
    rank's routed rows, and the rows past it are not sent. On t 2 folded (GSPMD, 2 ranks of 2 experts, 16 routed
    rows a rank) the layer equals a NumPy reference of the rule: a rank takes its sources' rows in source rank
    order (each source's sorted by expert, then token) up to the buffer, and a token's output sums its kept
    assignments' weighted expert outputs; the statistics count the rows left out. At 2.0 (the most a rank can
    get, 32 rows) nothing is dropped."""
    import jax
    import jax.numpy as jnp

    from megajax.parallel import sharding
    from megajax.config import ParallelConfig
    from megajax.model import moe

    cfg, layer, p, x = _layer("llama", 0)
    mesh = sharding.make_mesh(ParallelConfig(data=1, tensor=2, sequence_parallel=True), jax.devices()[:2])
    names = {"router": ("embed", None), "w_gate_up": ("expert", "embed", "mlp", None),
             "w_out": ("expert", "mlp", "embed"), moe.STATS: (None,)}
    q = {k: jax.device_put(v, jax.sharding.NamedSharding(mesh, step_plan.param_spec(names[k], folded_experts=True)))
         for k, v in p.items()}
    plan = StepPlan(tensor=2, sequence_parallel=True, moe_folds=2, moe_ragged=True, moe_buffer_factor=factor)
    with jax.set_mesh(mesh), step_plan.use(plan):
        got = jax.jit(lambda q, x: layer.apply({"params": q}, x))(q, x)
        dropped = jax.jit(jax.grad(lambda q, x: jnp.sum(layer.apply({"params": q}, x))))(q, x)[moe.STATS][-1]

    xs, k, f = np.asarray(x), cfg.experts_per_token, cfg.moe_ffn_size
    w_gu, w_out = np.asarray(p["w_gate_up"]).reshape(4, 32, -1), np.asarray(p["w_out"])
    buffer = min(32, int(np.ceil(factor * 16)))
    want, kept_total = np.zeros_like(xs), 0
    routed = []  # per source rank (sequence half): its tokens' (b, s) positions, weights and expert ids
    for src in range(2):
        pos = [(b, s) for b in range(2) for s in range(src * 4, src * 4 + 4)]
        tokens = np.stack([xs[b, s] for b, s in pos])
        weights, ids, _ = moe.route(jnp.asarray(tokens @ np.asarray(p["router"])), moe.Routing(k))
        routed.append((pos, tokens, np.asarray(weights), np.asarray(ids)))
    for dest in range(2):
        room = buffer
        for pos, tokens, weights, ids in routed:
            rows = sorted((e, t, j) for t in range(len(pos)) for j, e in enumerate(ids[t]) if e // 2 == dest)
            for e, t, j in rows[:max(0, room)]:
                gate_up = (tokens[t] @ w_gu[e]).reshape(f, 2)
                hidden = gate_up[:, 0] / (1 + np.exp(-gate_up[:, 0])) * gate_up[:, 1]
                want[pos[t]] += weights[t, j] * (hidden @ w_out[e])
                kept_total += 1
            room -= len(rows)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert float(dropped) == 2 * 8 * k - kept_total
    if factor == 2.0:
        assert kept_total == 32
        np.testing.assert_allclose(got, layer.apply({"params": p}, x), rtol=1e-5, atol=1e-6)
    else:
        assert float(dropped) > 0, "the case drops something"


@pytest.mark.parametrize("factor,folds,ragged", [(0.5, 1, False), (None, 1, False), (0.5, 2, False),
                                                (None, 2, False), (None, 2, True)])
def test_the_layer_s_derivative_scatters_rows_without_masks(factor, folds, ragged):
    """The layer writes rows to places no other row takes (the sort's inverse, the capacity buffers, the exchange's
    blocks), and says so to JAX: a scatter that may overlap differentiates by scattering an id per element and
    comparing, which kept a [rows, hidden] mask per layer for the backward (1.75 GiB a layer on DeepSeek-V3's
    experts at 4,096 tokens, expert 64) and moved the ids' bytes besides. In the gradient's jaxpr (one device, and
    folded on t 2 with the padded and the ragged exchange) every scatter is of unique indices, and every
    scatter-add but the routed copies' sum into their token (dispatch's gather, k copies a token) is too."""
    import jax
    import jax.numpy as jnp

    from megajax.config import ParallelConfig
    from megajax.parallel import sharding

    from conftest import jaxpr_eqns

    cfg, layer, p, x = _layer("llama", 0, factor)
    loss = lambda q, x: jnp.sum(layer.apply({"params": q}, x) ** 2)  # noqa: E731
    grad = jax.grad(loss, argnums=(0, 1))
    if folds == 1:
        jaxpr = jax.make_jaxpr(grad)(p, x)
    else:
        mesh = sharding.make_mesh(ParallelConfig(data=1, tensor=2, sequence_parallel=True), jax.devices()[:2])
        plan = StepPlan(tensor=2, sequence_parallel=True, moe_folds=2, moe_ragged=ragged)
        with jax.set_mesh(mesh), step_plan.use(plan):
            jaxpr = jax.make_jaxpr(grad)(p, x)
    found = [e for e in jaxpr_eqns(jaxpr.jaxpr) if e.primitive.name in ("scatter", "scatter-add")
             and jnp.issubdtype(e.outvars[0].aval.dtype, jnp.floating)]
    assert any(e.primitive.name == "scatter" for e in found)
    overlapping = [(e.primitive.name, e.outvars[0].aval.shape) for e in found if not e.params["unique_indices"]]
    tokens = x.shape[0] * x.shape[1]  # per token: the routed copies' sum (a group's tokens), the router's top k
    assert all(name == "scatter-add" and shape[-2] in (tokens, tokens // folds) for name, shape in overlapping), \
        overlapping


@shared_across_workers
def reference(arch, model_sets=()):
    """One device's losses and gradient norms for the MoE model with `model_sets` ((key, value) pairs)."""
    norms = []
    losses = run_steps(small_config(**MOE, **{"model.arch": arch}, **dict(model_sets)), 1, 2, grad_norms=norms)
    return tuple(losses), tuple(norms)


QWEN = {"model.moe_shared_experts": 1, "model.moe_shared_expert_gate": True, "model.moe_router_pre_softmax": True,
        "model.add_qkv_bias": True}  # Qwen2-MoE's routing, gated shared expert and QKV biases


@pytest.mark.parametrize("arch,layout", [
    # (suite time: MoE over data alone is in test_layouts' default run, d2 e2)
    pytest.param("gpt2", {"parallel.data": 2}, marks=pytest.mark.slow),
    # also in test_layouts' default run (llama-moe-d2e2p1t2) with the experts over 'data'
    pytest.param("llama", {"parallel.data": 2, "parallel.tensor": 2, "parallel.sequence_parallel": True},
                 marks=pytest.mark.slow),
    pytest.param("gpt2", {"parallel.data": 2, "parallel.pipeline": 2, "parallel.schedule": "1f1b"},
                 marks=pytest.mark.slow),  # (suite time: MoE on a pipeline is in test_layouts' default run)
    pytest.param("llama", {"parallel.pipeline": 2, "parallel.tensor": 2, "parallel.schedule": "zero_bubble",
                           "model.moe_shared_experts": 1}, marks=pytest.mark.slow),
    pytest.param("llama", {"parallel.data": 2, "parallel.expert": 2, "parallel.tensor": 2,
                           "parallel.sequence_parallel": True, **QWEN}, marks=pytest.mark.slow),
    pytest.param("llama", {"parallel.pipeline": 2, "parallel.tensor": 2, "parallel.schedule": "zero_bubble", **QWEN},
                 marks=pytest.mark.slow),
    pytest.param("gpt2", {"parallel.data": 2, "parallel.tensor": 2, "model.moe_capacity_factor": 1.0},
                 marks=pytest.mark.slow),
    # the Pallas grouped GEMM (interpreted here) per tensor shard, its rows from the expert-parallel exchange,
    # against ragged_dot on one device; with sequence parallelism and Qwen2-MoE's options (the case above). Suite
    # time (20 s): the default run checks the kernels in tests/test_kernels.py and the folded layer's blocks above
    pytest.param("llama", {"parallel.data": 2, "parallel.expert": 2, "parallel.tensor": 2,
                           "model.moe_grouped_gemm": True, "parallel.sequence_parallel": True, **QWEN},
                 marks=pytest.mark.slow),
    # expert parallelism with a capacity: each rank drops on its own micro batch (as without it), then the
    # capacity buffers go through the all-to-all (suite time: the d4 e2 case below covers it by default)
    pytest.param("gpt2", {"parallel.data": 2, "parallel.expert": 2, "model.moe_capacity_factor": 1.0},
                 marks=pytest.mark.slow),
    ("llama", {"parallel.data": 4, "parallel.expert": 2, "parallel.tensor": 2, "model.moe_capacity_factor": 0.5,
               "parallel.distributed_optimizer": True}),
    # whole experts over 'expert' x 'tensor' (parallel.expert_tensor=1), Qwen2-MoE's options; over 'tensor' alone
    # on a zero_bubble pipeline (the layout matrix runs a folded GPipe pipeline by default)
    pytest.param("llama", {**FOLD, **QWEN}, marks=pytest.mark.slow),
    # folded and dropless, the Pallas grouped GEMM on each rank's blocks of rows (the layout matrix runs a folded
    # dropless GPipe pipeline with ragged_dot by default)
    pytest.param("llama", {**FOLD, **QWEN, "model.moe_capacity_factor": None, "model.moe_grouped_gemm": True},
                 marks=pytest.mark.slow),
    # the same rows by the ragged exchange (emulated here), into the grouped GEMM, on a 1F1B pipeline
    pytest.param("llama", {**FOLD, **QWEN, "model.moe_capacity_factor": None, "model.moe_grouped_gemm": True,
                           "parallel.expert_all_to_all": "ragged", "parallel.data": 2, "parallel.pipeline": 2,
                           "parallel.tensor": 2, "parallel.schedule": "1f1b"},
                 marks=pytest.mark.slow),
    pytest.param("gpt2", {**FOLD, "parallel.data": 1, "parallel.expert": 1, "parallel.pipeline": 2,
                          "parallel.schedule": "zero_bubble"}, marks=pytest.mark.slow),
])
def test_moe_training_equals_one_device(arch, layout):
    n = layout.get("parallel.data", 1) * layout.get("parallel.pipeline", 1) * layout.get("parallel.tensor", 1)
    norms = []
    got = run_steps(small_config(**MOE, **{"model.arch": arch}, **layout), n, 2, grad_norms=norms)
    ref, ref_norms = reference(arch, tuple(sorted((k, v) for k, v in layout.items() if k.startswith("model.")
                                                  and k != "model.moe_grouped_gemm")))
    assert ref[1] < ref[0] + 0.5
    np.testing.assert_allclose(got, ref, rtol=1e-4)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-4)


@pytest.mark.parametrize("layout", [
    {"parallel.data": 2, "parallel.expert": 2},
    pytest.param({**FOLD, "model.moe_capacity_factor": None, "parallel.expert_all_to_all": "ragged"},
                 marks=pytest.mark.slow)])  # suite time
def test_evaluation_exchanges_rows_as_training_does(layout):
    """With expert parallelism the eval step runs in the train step's manual region: the experts' rows go by
    all-to-all over the expert ranks as in training (under GSPMD it all-reduced every expert's partial outputs over
    'expert', 34 MB a step on tiny-moe d2 e2 x t2, and folded it replicated a reshaped expert weight), and the
    loss equals one device's (dropless)."""
    ref, _ = evaluate(small_config(**MOE), 1)
    n = layout["parallel.data"] * layout.get("parallel.tensor", 1)
    got, colls = evaluate(small_config(**MOE, **layout), n)
    assert got == pytest.approx(ref, rel=1e-5)
    moved = {c.kind for c in colls if "expert" in c.axes and c.bytes > 1024}
    assert moved == {"all-to-all"}, moved  # (the ragged exchange's CPU emulation too)


def test_checkpoint_moves_between_expert_parallel_sizes(tmp_path):
    """A checkpoint written with the experts over 2 of 4 data ranks (distributed optimizer: an expert's state
    sharded over its 2 'data' ranks, a dense weight's over all 4) restores exactly with the experts over all 4,
    folded over 2 'expert' x 2 'tensor' ranks, and onto one device without expert parallelism or the distributed
    optimizer."""
    import jax

    from megajax import checkpoint, optim, step as step_lib

    sets = {**MOE, "model.arch": "llama", "train.global_batch_size": 8}
    cfg = small_config(**sets, **{"parallel.data": 4, "parallel.expert": 2, "parallel.distributed_optimizer": True})
    _, state, setup = run_steps(cfg, 4, 2, return_state=True)
    mgr = checkpoint.manager(str(tmp_path), use_async=False)
    checkpoint.save(mgr, 2, state, setup.cfg, 16)
    mgr.wait_until_finished()

    def unpadded(st):
        mu = st.opt_state[1].mu
        return jax.device_get((st.params, jax.tree.map(lambda m, p: optim.zero_unpad(m, p.shape), mu, st.params)))

    want = unpadded(state)
    for n, layout in ((4, {"parallel.data": 4, "parallel.expert": 4, "parallel.distributed_optimizer": True}),
                      (4, {**FOLD, "parallel.distributed_optimizer": True}),  # experts over 'expert' x 'tensor'
                      (1, {"parallel.data": 1})):
        target = step_lib.setup_for(small_config(**sets, **layout), jax.devices()[:n])
        fields, _ = checkpoint.restore(mgr, 2, target.abstract_state, target.state_shardings, target.cfg)
        got = step_lib.TrainState(**fields)
        jax.tree.map(np.testing.assert_array_equal, unpadded(got), want)
    mgr.close()


@pytest.mark.parametrize("factor", [None, 0.5])
def test_layer_reports_its_routing_statistics_through_the_stats_gradient(factor):
    """The gradient of the layer's zero `moe_stats` parameter is [assignments per expert, balancing loss x
    tokens, tokens, dropped assignments], whatever the output's cotangent; the forward never reads it."""
    import jax
    import jax.numpy as jnp

    from megajax.model import moe

    cfg, layer, p, x = _layer("gpt2", 0, factor)
    assert not np.any(p[moe.STATS])
    grads = jax.grad(lambda q: jnp.sum(layer.apply({"params": q}, x) ** 2))(p)
    xt = np.asarray(x).reshape(16, 32)
    _, ids, probs = moe.route(xt @ p["router"], moe.Routing(2))
    counts = np.bincount(np.asarray(ids).reshape(-1), minlength=4)
    c = moe.capacity(16, 2, 4, factor) if factor else 32
    want = [*counts, 16 * float(moe.load_balancing_loss(probs, ids)), 16, np.maximum(counts - c, 0).sum()]
    np.testing.assert_allclose(grads[moe.STATS], want, rtol=1e-5)
    if factor:
        assert want[-1] > 0


@pytest.mark.slow  # suite time (the default run stays under 15 minutes)
def test_routing_metrics_are_the_same_on_every_layout():
    """moe_aux_loss, moe_load_imbalance and moe_dropped_fraction sum over layers, micro batches and ranks as
    gradients do: one device and d 4 e 2 x p 2 (distributed optimizer) report the same; the stats parameter
    stays zero, in the model state, not in the params."""
    import jax

    from megajax.model import moe

    sets = {**MOE, "model.moe_capacity_factor": 1.0}
    runs = []
    for n, layout in ((1, {}), (8, {"parallel.data": 4, "parallel.expert": 2, "parallel.pipeline": 2,
                                     "parallel.distributed_optimizer": True})):
        _, state, setup = run_steps(small_config(**sets, **layout), n, 1, return_state=True)
        metrics, state = _one_step_stats(setup, state)
        runs.append(metrics)
        flat = jax.tree_util.tree_flatten_with_path(jax.device_get(state.model_state))[0]
        stats = [v for path, v in flat if getattr(path[-1], "key", None) == moe.STATS]
        assert stats and not any(np.any(np.asarray(v)) for v in stats)
        assert not any(getattr(path[-1], "key", None) == moe.STATS
                       for path, _ in jax.tree_util.tree_flatten_with_path(state.params)[0])
    assert runs[0].keys() == {"moe_aux_loss", "moe_load_imbalance", "moe_dropped_fraction"}
    for key in runs[0]:
        np.testing.assert_allclose(runs[1][key], runs[0][key], rtol=1e-5)
    assert runs[0]["moe_load_imbalance"] >= 1 and 0 < runs[0]["moe_dropped_fraction"] < 1
    assert runs[0]["moe_aux_loss"] == pytest.approx(1.0, abs=0.1)  # near-uniform routing at initialisation


@pytest.mark.slow  # suite time (21 s); the drop rule itself is checked against NumPy by default
def test_ragged_buffer_factor_trains_and_reports_its_drops():
    """d 2 e 2, the ragged exchange into buffers of 0.6 x a rank's routed rows: training runs (the exchange's VJP
    sends the kept rows' gradients back; the dropped ones get none), moe_dropped_fraction reports the rows left out
    (about 40% at near-uniform routing), and the loss is within what dropping 40% of the expert outputs can move."""
    sets = {**MOE, "parallel.data": 2, "parallel.expert": 2, "parallel.expert_all_to_all": "ragged",
            "parallel.expert_buffer_factor": 0.6}
    losses, state, setup = run_steps(small_config(**sets), 2, 2, return_state=True)
    metrics, _ = _one_step_stats(setup, state)
    assert 0.3 < metrics["moe_dropped_fraction"] < 0.5, metrics
    ref, _ = reference("gpt2")
    assert np.all(np.isfinite(losses)) and losses[1] < losses[0] and abs(losses[0] - ref[0]) < 0.05


def _one_step_stats(setup, state):
    import jax

    from megajax import step as step_lib
    from megajax.data.loader import build_datasets, global_batch

    data = build_datasets(setup.cfg, {"train": 16})["train"]
    with jax.set_mesh(setup.mesh):
        batch = global_batch(data, 8, 8, setup.batch_shardings)
        state, stats = step_lib.jit_train_step(setup)(state, batch)
    return {k: float(v) for k, v in stats.items() if k.startswith("moe_")}, state


@pytest.mark.slow  # suite time (the default run stays under 15 minutes)
def test_cli_logs_routing_metrics(tmp_path):
    from conftest import read_metrics, train_cli

    proc = train_cli(tmp_path, "train.steps=2", "model.num_experts=4", "model.moe_capacity_factor=1.0",
                     "parallel.data=4", "parallel.expert=2", devices=4)
    assert "aux loss" in proc.stdout and "load imbalance" in proc.stdout and "dropped fraction" in proc.stdout
    last = read_metrics(tmp_path)[2]
    assert {"moe_aux_loss", "moe_load_imbalance", "moe_dropped_fraction"} <= last.keys()


def test_router_bias_steers_the_choice_and_follows_the_load():
    """DeepSeek-V3's auxiliary-loss-free balancing: the bias picks the experts (probability + bias), the
    weights stay the probabilities renormalised, and after a step each layer's bias moves by the rate towards
    the experts with fewer assignments than the mean."""
    import jax.numpy as jnp

    from megajax.model import moe

    logits = jnp.log(jnp.array([[0.4, 0.3, 0.2, 0.1]]))
    weights, ids, _ = moe.route(logits, moe.Routing(2), jnp.array([0.0, 0.0, 0.0, 0.25]))
    assert ids.tolist() == [[0, 3]]  # 0.4 and 0.1 + 0.25 beat 0.3
    np.testing.assert_allclose(weights, [[0.8, 0.2]], rtol=1e-6)
    params = {"layers": {"mlp": {moe.ROUTER_BIAS: jnp.zeros((2, 4)), "w": jnp.ones(3)}}}
    loads = {(jax_key("layers"), jax_key("mlp")): jnp.array([[5.0, 3.0, 4.0, 4.0], [4.0, 4.0, 4.0, 4.0]])}
    got = moe.update_router_bias(params, loads, 0.1)
    np.testing.assert_allclose(got["layers"]["mlp"][moe.ROUTER_BIAS], [[-0.1, 0.1, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(got["layers"]["mlp"]["w"], 1.0)


@pytest.mark.parametrize("groups,best,k,bias", [(1, 1, 2, False), (4, 2, 4, True), (2, 1, 2, True), (4, 4, 4, False)])
def test_sigmoid_group_limited_routing_is_deepseek_v3s(groups, best, k, bias):
    """DeepSeek-V3's router, written out in NumPy as its reference code runs it: sigmoid scores, choice = score +
    correction bias, each group's merit the sum of its top k / group_topk choices, the experts chosen among the
    best groups only, weighted by their scores (no bias) normalised over the k and times the scaling factor; the
    balancing loss sees the scores normalised over the experts."""
    import jax.numpy as jnp

    from megajax.model import moe

    rng = np.random.default_rng(groups + k)
    logits = rng.normal(size=(64, 8)).astype(np.float32)
    b = rng.normal(scale=0.3, size=8).astype(np.float32) if bias else np.zeros(8, np.float32)
    how = moe.Routing(k, k > 1, "sigmoid", groups, best, 2.5)
    weights, ids, probs = moe.route(jnp.asarray(logits), how, jnp.asarray(b) if bias else None)
    scores = 1 / (1 + np.exp(-logits))
    choice = scores + b
    merit = np.sort(choice.reshape(64, groups, -1), axis=-1)[..., ::-1][..., :k // best].sum(-1)
    keep = np.argsort(-merit, axis=1, kind="stable")[:, :best]
    masked = np.full_like(choice, -np.inf)
    for t in range(64):
        for g in keep[t]:
            lo = g * (8 // groups)
            masked[t, lo:lo + 8 // groups] = choice[t, lo:lo + 8 // groups]
    want_ids = np.argsort(-masked, axis=1, kind="stable")[:, :k]
    np.testing.assert_array_equal(np.sort(ids, axis=1), np.sort(want_ids, axis=1))
    top = np.take_along_axis(scores, np.asarray(ids), axis=1)
    np.testing.assert_allclose(weights, 2.5 * top / top.sum(1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(probs, scores / scores.sum(1, keepdims=True), rtol=1e-6)
    if groups > best:  # every chosen expert lies in one of the token's best groups
        assert all(set(np.asarray(ids)[t] // (8 // groups)) <= set(keep[t]) for t in range(64))


def jax_key(name):
    import jax

    return jax.tree_util.DictKey(name)


@pytest.mark.slow  # suite time (the default run stays under 15 minutes)
def test_router_bias_training_is_the_same_on_every_layout():
    """The bias moves on the step's load summed over micro batches and ranks: one device and d 4 e 2 x p 2 with
    the distributed optimizer (the bias sharded by it, with zero gradients) end with the same losses, gradient
    norms and biases; the optimizer leaves the bias alone (it moves by exactly the rate each step)."""
    import jax

    from megajax.model import moe

    sets = {**MOE, "model.moe_router_bias_update_rate": 0.01}
    runs = []
    for n, layout in ((1, {}), (8, {"parallel.data": 4, "parallel.expert": 2, "parallel.pipeline": 2,
                                     "parallel.distributed_optimizer": True})):
        norms = []
        losses, state, setup = run_steps(small_config(**sets, **layout), n, 3, return_state=True, grad_norms=norms)
        params = jax.device_get(setup_canonical(setup, state.model_state))
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        bias = np.concatenate([v.reshape(-1, 4) for p, v in flat if getattr(p[-1], "key", None) == moe.ROUTER_BIAS])
        runs.append((losses, norms, bias))
    np.testing.assert_allclose(runs[1][0], runs[0][0], rtol=1e-5)
    np.testing.assert_allclose(runs[1][1], runs[0][1], rtol=1e-5)
    np.testing.assert_allclose(runs[1][2], runs[0][2], atol=1e-7)
    steps = np.round(runs[0][2] / 0.01)
    np.testing.assert_allclose(runs[0][2], steps * 0.01, atol=1e-6)
    assert np.all(np.abs(steps) <= 3) and np.any(steps != 0)


def setup_canonical(setup, params):
    """Params in the canonical (unstaged) layout: the pipeline stacks layers as [chunk, stage, layers]."""
    from megajax.parallel.pipeline import layout

    return layout.from_stages(params, setup.cfg.stage_split) if setup.cfg.parallel.pipeline > 1 else params


def test_flops_count_the_active_experts():
    """MFU and TFLOP/s count an MoE layer's k routed and shared experts and its router, not every expert."""
    from megajax import metrics
    from megajax.config import ModelConfig

    moe_cfg = ModelConfig(arch="llama", hidden_size=64, num_heads=4, num_experts=8, experts_per_token=2,
                          moe_ffn_hidden_size=96, moe_shared_experts=1)
    dense = ModelConfig(arch="llama", hidden_size=64, num_heads=4, ffn_hidden_size=3 * 96)
    got, core = metrics.layer_forward_flops_per_token(moe_cfg)
    want, core_dense = metrics.layer_forward_flops_per_token(dense)
    assert core == core_dense and got == want + 2 * 64 * 8


@pytest.mark.parametrize("freq", [1, 2, 3, 4, 6, 12])
def test_moe_layer_freq_space(freq):
    """model.moe_layer_freq n on 12 layers: layers 0, n, 2n, .. are MoE and the rest dense (Megatron's pattern), as
    units of n blocks; every pipeline split the config accepts holds whole units (and every other is refused with
    the fix); FLOPs count the dense layers' MLP and the MoE layers' active experts."""
    import jax

    from megajax import metrics, model

    sets = {"model.num_layers": 12, "model.num_experts": 4, "model.moe_layer_freq": freq,
            "model.moe_ffn_hidden_size": 32, "model.ffn_hidden_size": 128}
    for p, v in itertools.product((1, 2, 3, 4, 6), (1, 2)):
        layout = {"parallel.pipeline": p, "parallel.virtual_stages": v, "train.micro_batch_size": 1,
                  "parallel.schedule": "interleaved" if v > 1 else "1f1b"}
        if p * v > 12:
            continue
        if p == 1 and v > 1:  # virtual stages without a pipeline
            with pytest.raises(config_lib.ConfigError, match="but parallel.pipeline=1"):
                small_config(**sets, **layout)
        elif 12 % (p * v):
            with pytest.raises(config_lib.ConfigError, match="choose layers that split evenly"):
                small_config(**sets, **layout)
        elif (12 // freq) % (p * v):
            with pytest.raises(config_lib.ConfigError, match="a pipeline chunk holds whole groups"):
                small_config(**sets, **layout)
        else:
            small_config(**sets, **layout)
    cfg = small_config(**sets).model
    stack = model.abstract_params(cfg)["layers"]["block"]
    units = [stack] if freq == 1 else [stack[f"layer_{j}"] for j in range(freq)]
    assert [("router" in u["mlp"]) for u in units] == [True] + [False] * (freq - 1)
    assert {jax.tree.leaves(u)[0].shape[0] for u in units} == {12 // freq}
    assert cfg.moe_layers == 12 // freq
    moe_flops, core = metrics.layer_forward_flops_per_token(dataclasses.replace(cfg, moe_layer_freq=1))
    dense_flops, _ = metrics.layer_forward_flops_per_token(dataclasses.replace(cfg, num_experts=0))
    got, _ = metrics.layer_forward_flops_per_token(cfg)
    assert got == pytest.approx((moe_flops + (freq - 1) * dense_flops) / freq)


FREQ = {**MOE, "model.arch": "llama", "model.num_layers": 4, "model.moe_layer_freq": 2}


@shared_across_workers
def freq_reference():
    norms = []
    return tuple(run_steps(small_config(**FREQ), 1, 2, grad_norms=norms)), tuple(norms)


@pytest.mark.parametrize("layout", [  # all slow (suite time; the decoding test runs the period by default)
    pytest.param({"parallel.data": 2, "parallel.expert": 2, "parallel.pipeline": 2, "parallel.schedule": "1f1b"},
                 marks=pytest.mark.slow),
    pytest.param({"parallel.pipeline": 2, "parallel.tensor": 2, "parallel.schedule": "zero_bubble",
                  "parallel.sequence_parallel": True}, marks=pytest.mark.slow),
    pytest.param({"parallel.data": 2, "parallel.expert": 2, "parallel.tensor": 2, "model.recompute": "full",
                  "parallel.distributed_optimizer": True}, marks=pytest.mark.slow),
])
def test_moe_layer_freq_training_equals_one_device(layout):
    """MoE every second layer (4 layers: MoE, dense, MoE, dense) trains as on one device with experts over data,
    on a pipeline (each stage one MoE and one dense layer), with tensor and sequence parallelism and zero_bubble's
    split backward, and with full recomputation and the distributed optimizer."""
    n = layout.get("parallel.data", 1) * layout.get("parallel.pipeline", 1) * layout.get("parallel.tensor", 1)
    norms = []
    got = run_steps(small_config(**FREQ, **layout), n, 2, grad_norms=norms)
    ref, ref_norms = freq_reference()
    np.testing.assert_allclose(got, ref, rtol=1e-4)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-4)


def test_moe_layer_freq_decoding_and_checkpoint_checks():
    """With dense layers between the MoE layers the KV-cache decode gives the full forward's logits, and a
    checkpoint of another layer pattern is refused naming model.moe_layer_freq."""
    import jax
    import jax.numpy as jnp

    from megajax import checkpoint, model

    cfg = small_config(**FREQ).model
    params = jax.device_get(jax.jit(lambda k: nn_unbox(model.init_params(cfg, k)))(jax.random.key(0)))
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, cfg.vocab_size)
    full = np.asarray(model.GPT(cfg).apply({"params": params}, tokens))
    state = model.init_decode_state(cfg, 2, 8)
    for lo, hi in [(0, 5), (5, 6), (6, 7), (7, 8)]:
        logits, state = model.decode_apply(cfg, params, tokens[:, lo:hi], state)
        np.testing.assert_allclose(np.asarray(logits), full[:, hi - 1], atol=2e-5, rtol=0)
    assert state.k.shape[0] == 4 and jnp.all(state.k[3] != 0)
    with pytest.raises(config_lib.ConfigError, match="model.moe_layer_freq: 2 in the checkpoint, 1 here"):
        checkpoint.check_same_model(cfg, dataclasses.replace(cfg, moe_layer_freq=1), "ckpt")
    deepseek = dataclasses.replace(cfg, moe_layer_freq=1, moe_first_dense_layers=1,
                                   moe_router_score_function="sigmoid")
    with pytest.raises(config_lib.ConfigError, match="moe_first_dense_layers: 1 in the checkpoint, 0 here.*"
                       "moe_router_score_function: 'sigmoid' in the checkpoint, 'softmax' here"):
        checkpoint.check_same_model(deepseek, dataclasses.replace(cfg, moe_layer_freq=1), "ckpt")


def nn_unbox(tree):
    import flax.linen as nn

    return nn.unbox(tree)
