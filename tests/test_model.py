"""Model shapes, logical axes, FLOP counting, and compile time flat in depth."""

import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megajax import metrics, model
from megajax.config import ModelConfig


@pytest.mark.parametrize("arch,kv", [("gpt2", None), ("llama", 2), ("llama", None)])
def test_shapes_and_logical_axes(arch, kv):
    cfg = ModelConfig(arch=arch, num_layers=3, hidden_size=64, num_heads=4, num_kv_heads=kv, vocab_size=300,
                      seq_length=16)
    boxed = model.init_params(cfg, jax.random.key(0))
    params, axes = nn.unbox(boxed), model.logical_axes(boxed)
    g, r, k = cfg.kv_heads, cfg.num_heads // cfg.kv_heads, cfg.head_dim
    block = params["layers"]["block"]
    assert block["attn"]["wqkv"].shape == (3, 64, g, r + 2, k)
    assert axes["layers"]["block"]["attn"]["wqkv"] == ("layers", "embed", "kv_heads", None, "head_dim")
    assert axes["layers"]["block"]["attn"]["wo"] == ("layers", "heads", "head_dim", "embed")
    assert params["embed"]["embedding"].shape == (384, 64)  # padded to a multiple of 128
    assert axes["embed"]["embedding"] == ("vocab", "embed")
    assert ("output" in params["head"]) == (arch == "llama")
    # every parameter has a name for every dimension
    jax.tree.map(lambda a, n: len(n) == a.ndim or pytest.fail(f"{n} vs {a.shape}"), params, axes,
                 is_leaf=lambda x: isinstance(x, tuple))
    logits = model.GPT(cfg).apply({"params": params}, jnp.zeros((2, 16), jnp.int32))
    assert logits.shape == (2, 16, 384) and logits.dtype == jnp.float32


def test_initial_loss_is_near_uniform():
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, vocab_size=257, seq_length=32)
    params = nn.unbox(model.init_params(cfg, jax.random.key(1)))
    tokens = jax.random.randint(jax.random.key(2), (4, 32), 0, 257)
    targets = jax.random.randint(jax.random.key(3), (4, 32), 0, 257)
    batch = {"tokens": tokens, "targets": targets, "loss_mask": jnp.ones((4, 32))}
    loss = model.loss_sum(cfg, params, batch, None) / (4 * 32)
    assert abs(float(loss) - np.log(257)) < 0.5


def test_cross_entropy_ignores_padded_vocab_and_matches_softmax():
    logits = jax.random.normal(jax.random.key(0), (2, 3, 8)) * 3
    targets = jnp.array([[0, 1, 4], [2, 3, 4]])
    got = model.cross_entropy(logits, targets, vocab_size=5)
    ref = -jnp.take_along_axis(jax.nn.log_softmax(logits[..., :5]), targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(got, ref, rtol=1e-6)


def megatron_gpt_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int, recompute: bool) -> float:
    """The closed forms from the papers (Narayanan et al., SC21, appendix; Korthikanti et al.): the oracle for
    `metrics.step_flops` on GPT-2 style models."""
    if recompute:
        return 96 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    return 72 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))


@pytest.mark.parametrize("recompute", [False, True])
def test_flops_reduce_to_the_papers_formulas(recompute):
    cfg = ModelConfig(num_layers=24, hidden_size=2048, num_heads=16, vocab_size=51200, seq_length=2048,
                      make_vocab_size_divisible_by=1, recompute="full" if recompute else "none")
    got = metrics.step_flops(cfg, tokens=512 * 2048)
    want = megatron_gpt_flops(512, 2048, 24, 2048, 51200, recompute)
    key = "hardware_flops" if recompute else "model_flops"
    assert got[key] == pytest.approx(want, rel=1e-12)
    assert got["model_flops"] == pytest.approx(megatron_gpt_flops(512, 2048, 24, 2048, 51200, False))


def test_llama_flops_count_gqa_and_swiglu():
    mha = ModelConfig(arch="llama", num_layers=2, hidden_size=256, num_heads=8, vocab_size=1024, seq_length=64,
                      ffn_hidden_size=512)
    gqa = ModelConfig(arch="llama", num_layers=2, hidden_size=256, num_heads=8, num_kv_heads=2, vocab_size=1024,
                      seq_length=64, ffn_hidden_size=512)
    d, k = 256, 32
    saved = 3 * 2 * 64 * 2 * d * (2 * 8 * k - 2 * 2 * k)  # fewer k/v projection FLOPs, 3x for fwd+bwd
    assert metrics.step_flops(mha, 64)["model_flops"] - metrics.step_flops(gqa, 64)["model_flops"] == saved


def _compile_seconds(layers: int) -> float:
    from megajax import config as config_lib, step as step_lib
    from megajax.config import io as config_io
    from megajax.parallel import sharding
    from megajax.data.loader import batch_shapes

    cfg = config_io.override(config_lib.Config(), {
        "model.num_layers": layers, "model.hidden_size": 64, "model.num_heads": 4, "model.seq_length": 32,
        "train.global_batch_size": 4}).for_devices(1)
    mesh = sharding.make_mesh(cfg.parallel, jax.devices()[:1])
    setup = step_lib.build(cfg, mesh)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), setup.abstract_state,
                         setup.state_shardings)
    batch = {k: jax.ShapeDtypeStruct(s, d, sharding=setup.batch_shardings[k]) for k, (s, d) in batch_shapes(4, 32).items()}
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        step_lib.jit_train_step(setup).lower(state, batch).compile()
    return time.perf_counter() - start


@pytest.mark.slow  # suite time (13 s): a structural property of the layer scan
def test_scan_keeps_compile_time_flat_in_depth():
    _compile_seconds(2)  # warm up JAX's own caches
    shallow, deep = _compile_seconds(4), _compile_seconds(48)
    assert deep < 2.0 * shallow + 1.0, (shallow, deep)


def test_random_init_is_the_same_on_every_layout():
    """step_lib.init_state draws the same parameters from the seed on any mesh (so tests may start every
    layout of a model from one draw: conftest.initial_params), and its optimizer state starts at zero."""
    from megajax import step as step_lib
    from megajax.parallel.pipeline.layout import from_stages

    from conftest import initial_params, small_config

    cfg = small_config(**{"model.num_layers": 4, "parallel.data": 2, "parallel.pipeline": 2, "parallel.tensor": 2,
                          "parallel.distributed_optimizer": True, "train.micro_batch_size": 1})
    state = step_lib.init_state(step_lib.setup_for(cfg, jax.devices()))
    want = initial_params(cfg.model, cfg.train.seed)
    jax.tree.map(np.testing.assert_array_equal, from_stages(jax.device_get(state.params), cfg.stage_split),
                 want)
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(state.opt_state[1].mu))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_layer_keeps_the_same_under_an_enclosing_checkpoint(arch, capsys):
    """The activations and norms that keep only their inputs (kernels.keeps_inputs) keep only them under an
    enclosing jax.checkpoint that saves anything (ZeRO-3's layer policy, megajax.parallel.overlap): jax lets such a
    policy decide for every equation inside a nested jax.checkpoint, and kept their intermediates."""
    from jax.ad_checkpoint import print_saved_residuals

    cfg = ModelConfig(arch=arch, num_layers=2, hidden_size=64, num_heads=4, vocab_size=257, seq_length=32,
                      attention_impl="pallas", norm_impl="xla")
    block = jax.tree.map(lambda a: jnp.zeros(a.shape[1:], jnp.bfloat16),
                         model.abstract_params(cfg)["layers"]["block"])
    x = jnp.zeros((1, 32, 64), jnp.bfloat16)
    layer = lambda p, x: model.block_apply(cfg, p, x, 0, None)  # noqa: E731
    kept = []
    for f in (layer, jax.checkpoint(layer, prevent_cse=False, policy=lambda *_, **__: True)):
        print_saved_residuals(f, block, x)
        shapes = (line.split(" ")[0] for line in capsys.readouterr().out.splitlines())
        kept.append(sorted(s for s in shapes if not s.endswith("[]")))  # (scalars: the kernel's platform index)
    assert kept[0] == kept[1]
