"""Pallas kernels against their jnp references (interpret mode on CPU), in the model, and lowered for GPUs.

Error metric: max |kernel - reference| / max |reference| over each output and gradient. fp32 must be
within 1e-5, bf16/fp16 within 2e-2 (the reference rounds the probabilities to the input dtype as the
kernels do, so the gap is accumulation order, not precision).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import run_steps, shared_across_workers, small_config
from megajax import kernels
from megajax.kernels import flash_attention as fa
from megajax.kernels import fused_norm
from megajax.kernels.dropout import AttentionDropout, kept_features, seeds

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-2}
SMALL = fa.BlockSizes(16, 16, 16, 16, 16, 16)  # many blocks even at s = 64: exercises the causal skipping


def quick_jit(fn):
    """jit compiled at XLA's lowest CPU optimization level: interpret-mode kernels are large programs that
    run in milliseconds, so compile time is the test time, and -O0 halves it."""
    def call(*args):
        return jax.jit(fn).lower(*args).compile({"xla_backend_optimization_level": 0})(*args)

    return call


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def attention_case(b, s, h, g, d, dtype, seed, segments):
    keys = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(keys[0], (b, s, h, d), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (b, s, g, d), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (b, s, g, d), jnp.float32).astype(dtype)
    do = jax.random.normal(keys[3], (b, s, h, d), jnp.float32).astype(dtype)
    seg = None
    if segments:  # packed documents: sorted ids, so every segment is a contiguous run
        seg = jnp.sort(jax.random.randint(keys[4], (b, s), 0, 3), axis=1)
    return q, k, v, do, seg


def value_and_grads(f, q, k, v, do):
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(do))


# (batch, seq, heads, kv heads, head dim, causal, segments, dtype, blocks): GQA ratios 1, 2 and 4; sequences
# that are and are not multiples of the block; head dims that are and are not powers of 2.
def random_cases(seed: int, n: int) -> list[tuple]:
    """Shapes drawn from a fixed seed (reproducible), beside the hand-picked corners below."""
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(n):
        g, ratio = int(rng.choice([1, 2])), int(rng.choice([1, 2, 4]))
        cases.append((int(rng.integers(1, 3)), int(rng.integers(17, 81)), g * ratio, g,
                      int(rng.choice([8, 16, 24, 32, 48, 64])), bool(rng.integers(2)), bool(rng.integers(2)),
                      [jnp.float32, jnp.bfloat16][i % 2], SMALL if rng.integers(2) else None))
    return cases


ATTENTION_CASES = random_cases(seed=5, n=2) + [
    (1, 64, 4, 2, 32, True, True, jnp.float32, SMALL),
    (1, 48, 4, 1, 24, False, True, jnp.float32, SMALL),
    (2, 37, 4, 4, 16, False, False, jnp.float32, SMALL),
    (1, 50, 8, 2, 64, True, False, jnp.float32, SMALL),
    (1, 64, 4, 2, 32, True, True, jnp.bfloat16, SMALL),
    (2, 40, 4, 1, 16, False, False, jnp.bfloat16, None),
    (1, 32, 2, 1, 32, True, False, jnp.float16, SMALL),
]


@pytest.mark.parametrize("b,s,h,g,d,causal,segments,dtype,blocks", ATTENTION_CASES,
                         ids=lambda x: getattr(x, "__name__", None) if isinstance(x, type) else None)
def test_flash_attention_matches_reference(b, s, h, g, d, causal, segments, dtype, blocks):
    q, k, v, do, seg = attention_case(b, s, h, g, d, dtype, seed=s * d + h, segments=segments)
    assert_kernel_matches_reference(q, k, v, do, seg, causal, blocks)


# Attention dropout: the kernels drop the entries the reference drops (a hash of heads and positions), so they
# agree as without it, forward and backward: GQA, segments, a ragged length, causal or not, fp32 and bf16.
DROPOUT_CASES = [(1, 64, 4, 2, 32, True, True, jnp.float32, SMALL), (2, 37, 4, 4, 16, False, False, jnp.float32, SMALL),
                 (1, 50, 8, 2, 64, True, False, jnp.bfloat16, None)]


@pytest.mark.parametrize("b,s,h,g,d,causal,segments,dtype,blocks", DROPOUT_CASES,
                         ids=lambda x: getattr(x, "__name__", None) if isinstance(x, type) else None)
def test_flash_attention_drops_what_the_reference_drops(b, s, h, g, d, causal, segments, dtype, blocks):
    q, k, v, do, seg = attention_case(b, s, h, g, d, dtype, seed=s + d, segments=segments)
    drop = AttentionDropout.of(jax.random.split(jax.random.key(s), b), 3, 0.3, h)
    assert_kernel_matches_reference(q, k, v, do, seg, causal, blocks, drop)
    kept = quick_jit(functools.partial(kernels.attention_reference, causal=causal, segment_ids=seg))(q, k, v)
    assert rel_err(kept, quick_jit(functools.partial(kernels.attention_reference, causal=causal, segment_ids=seg,
                                                     probs_dropout=drop))(q, k, v)) > 0.1  # it drops


def test_dropout_masks_keep_the_rate_and_follow_positions_not_arrays():
    """The hashed masks keep 1 - rate of the elements with no pattern across neighbours, and a piece of a mask drawn
    at the piece's positions is the whole mask's piece (what lets a context rank, a kernel tile or a ring block draw
    its own); samples and sites differ."""
    keys = jax.random.split(jax.random.key(0), 4)
    whole = kept_features(seeds(keys, 3), jnp.arange(512), 256, 0.1)
    assert abs(float(whole.mean()) - 0.9) < 2e-3
    x = np.asarray(whole, np.float32)
    assert abs(np.corrcoef(x[:, :, 1:].ravel(), x[:, :, :-1].ravel())[0, 1]) < 0.01
    assert abs(np.corrcoef(x[:, 1:].ravel(), x[:, :-1].ravel())[0, 1]) < 0.01
    piece = kept_features(seeds(keys, 3), jnp.arange(96, 160), 256, 0.1)
    np.testing.assert_array_equal(piece, whole[:, 96:160])
    assert float(jnp.mean(whole[0] == whole[1])) < 0.85 and float(jnp.mean(
        whole == kept_features(seeds(keys, 4), jnp.arange(512), 256, 0.1))) < 0.85
    drop = AttentionDropout.of(keys, 5, 0.25, 8)
    probs = drop.row_words(jnp.arange(64))
    block = drop.with_heads(jnp.arange(2, 6, dtype=jnp.int32)).row_words(jnp.arange(16, 48))
    np.testing.assert_array_equal(block, probs[:, 2:6, 16:48])


def assert_kernel_matches_reference(q, k, v, do, seg, causal: bool, blocks, drop=None):
    """The flash kernel's output and its gradients against the reference's, within TOL of q's dtype."""
    kernel = functools.partial(fa.flash_attention, causal=causal, segment_ids=seg, block_sizes=blocks,
                               probs_dropout=drop)
    reference = functools.partial(kernels.attention_reference, causal=causal, segment_ids=seg, probs_dropout=drop)
    got = quick_jit(lambda *a: value_and_grads(kernel, *a))(q, k, v, do)
    want = quick_jit(lambda *a: value_and_grads(reference, *a))(q, k, v, do)
    for name, x, y in zip(["out", "dq", "dk", "dv"], got, want):
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert rel_err(x, y) < TOL[q.dtype.type], f"{name}: {rel_err(x, y):.3g}"


# (head dim of queries and keys, of values): multi-latent attention's 192 (read as 128 + 64) with values of 128,
# scaled down to 48 (32 + 16) and 32; a split head dim with values as wide; values narrower in one part.
NARROW_VALUE_CASES = [(48, 32, jnp.float32, SMALL), (80, 80, jnp.bfloat16, None), (192, 128, jnp.float32, SMALL),
                      (64, 16, jnp.float32, None)]


@pytest.mark.parametrize("d,dv,dtype,blocks", NARROW_VALUE_CASES)
def test_flash_attention_splits_head_dims_and_takes_narrower_values(d, dv, dtype, blocks):
    """Queries and keys whose head dim is read in two power-of-2 parts, and values narrower than them (the output
    as wide as the values): equal to the reference, every gradient too, with GQA, segments and a ragged length."""
    q, k, _, _, seg = attention_case(1, 40, 4, 2, d, dtype, seed=d + dv, segments=True)
    _, _, v, do, _ = attention_case(1, 40, 4, 2, dv, dtype, seed=d - dv, segments=False)
    assert_kernel_matches_reference(q, k, v, do, seg, True, blocks)


def test_head_parts_cover_every_head_dim_with_power_of_2_tiles():
    """Every head dim up to the largest: at most two contiguous power-of-2 parts of at least 16, covering it, never
    wider than the power of 2 above it (what the kernels padded to before), and exact where two parts can be."""
    for d in range(1, fa.MAX_HEAD_DIM + 1):
        parts = fa.head_parts(d)
        width = fa.head_width(d)
        assert 1 <= len(parts) <= 2 and parts[0][0] == 0, d
        assert all(n >= fa.MIN_BLOCK and n & (n - 1) == 0 for _, n in parts), d
        assert all(o2 == o1 + n1 for (o1, n1), (o2, _) in zip(parts, parts[1:])), d
        assert d <= width <= max(fa.MIN_BLOCK, 1 << (d - 1).bit_length()), d
        assert fa.head_parts(width) == parts, d  # the padded arrays are read in the same parts
    assert fa.head_parts(192) == ((0, 128), (128, 64)) and fa.head_width(100) == 128


def test_attention_dispatch_and_scale():
    """impl="pallas" through the dispatch, with a non-default softmax scale."""
    q, k, v, _, _ = attention_case(1, 32, 4, 2, 16, jnp.float32, seed=3, segments=False)
    got = quick_jit(lambda *a: kernels.attention(*a, causal=True, scale=0.3, impl="pallas"))(q, k, v)
    want = kernels.attention(q, k, v, causal=True, scale=0.3, impl="xla")
    assert rel_err(got, want) < 1e-5


def test_padded_positions_do_not_leak():
    """Keys past the real sequence are masked: the answer for s = 20 equals the s = 20 reference even
    though the kernel runs at 32, and the padded tail's values cannot reach it."""
    q, k, v, _, _ = attention_case(1, 20, 2, 2, 16, jnp.float32, seed=5, segments=False)
    got = quick_jit(lambda *a: fa.flash_attention(*a, causal=False, block_sizes=SMALL))(q, k, v)
    assert rel_err(got, kernels.attention_reference(q, k, v, causal=False)) < 1e-5


@pytest.mark.parametrize("call, match", [
    (lambda: fa.flash_attention(jnp.zeros((1, 16, 2, 512)), jnp.zeros((1, 16, 2, 512)),
                                jnp.zeros((1, 16, 2, 512))), "head dim 512"),
    (lambda: fa.flash_attention(jnp.zeros((1, 16, 3, 16)), jnp.zeros((1, 16, 2, 16)),
                                jnp.zeros((1, 16, 2, 16))), "h=3 g=2"),
    (lambda: fa.flash_attention(jnp.zeros((1, 16, 2, 16)), jnp.zeros((1, 8, 2, 16)),
                                jnp.zeros((1, 8, 2, 16))), "sequence"),
    (lambda: fa.flash_attention(jnp.zeros((1, 16, 2, 16)), jnp.zeros((1, 16, 2, 16), jnp.bfloat16),
                                jnp.zeros((1, 16, 2, 16))), "k.dtype"),
    (lambda: fa.BlockSizes(block_q=48), "block_q=48"),
    (lambda: fused_norm.rms_norm_pallas(jnp.zeros((2, 8)), jnp.zeros((4,))), "scale.shape"),
    (lambda: fused_norm.rms_norm_pallas(jnp.zeros((2, 40000)), jnp.zeros((40000,))), "d=40000"),
])
def test_unsupported_shapes_fail_clearly(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_block_table_covers_head_dims():
    assert fa.default_block_sizes(24, jnp.bfloat16) == fa.BLOCK_TABLE[(64, 2)]
    assert fa.default_block_sizes(128, jnp.float32) == fa.BLOCK_TABLE[(128, 4)]
    assert fa.BLOCK_TABLE[(64, 2)].fit(40).block_q == 64  # clipped to the sequence rounded up to 2^k


# ----------------------------------------------------------------------------------------------------
# Norms


def norm_case(shape, dtype, seed):
    keys = jax.random.split(jax.random.key(seed), 4)
    d = shape[-1]
    x = (3 * jax.random.normal(keys[0], shape) + 1).astype(dtype)  # a mean and scale to normalize away
    scale = 1 + 0.1 * jax.random.normal(keys[1], (d,))
    bias = 0.1 * jax.random.normal(keys[2], (d,))
    dy = jax.random.normal(keys[3], shape)
    return x, scale, bias, dy


@pytest.mark.parametrize("arch", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("shape,dtype", [
    ((2, 8, 64), jnp.float32),  # power-of-2 width, 16 rows
    ((3, 5, 24), jnp.float32),  # 15 rows (odd: one row per program) and a masked 24 -> 32 tail
    ((2, 16, 96), jnp.bfloat16),
    ((7, 33), jnp.float32),  # 2D input
], ids=str)
def test_norm_matches_reference(arch, shape, dtype):
    x, scale, bias, dy = norm_case(shape, dtype, seed=len(shape) + shape[-1])
    if arch == "layer_norm":
        params = (scale, bias)
        kernel, reference = fused_norm.layer_norm_pallas, kernels.layer_norm_reference
    else:
        params = (scale,)
        kernel, reference = fused_norm.rms_norm_pallas, kernels.rms_norm_reference
    got = quick_jit(lambda x, *p: value_and_grads_norm(kernel, x, p, dy))(x, *params)
    want = quick_jit(lambda x, *p: value_and_grads_norm(reference, x, p, dy))(x, *params)
    tol = TOL[dtype]
    for name, a, b in zip(["y", "dx", "dscale", "dbias"], got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert rel_err(a, b) < tol, f"{name}: {rel_err(a, b):.3g}"


def value_and_grads_norm(f, x, params, dy):
    y, vjp = jax.vjp(lambda x, *p: f(x, *p, 1e-5), x, *params)
    return (y, *vjp(dy.astype(y.dtype)))


def test_norm_out_dtype_is_written_directly():
    x, scale, bias, _ = norm_case((4, 16, 64), jnp.bfloat16, seed=0)
    got = quick_jit(lambda *a: kernels.layer_norm(*a, 1e-5, impl="pallas", out_dtype=jnp.bfloat16))(x, scale, bias)
    want = kernels.layer_norm(x, scale, bias, 1e-5, impl="xla", out_dtype=jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    assert rel_err(got, want) < 1e-2  # one bf16 rounding of the same fp32 value, up to ties


@pytest.mark.parametrize("n,d", [(16384, 768), (8192, 4096), (15, 24), (4096, 25600), (6, 64)])
def test_norm_tiling_divides_rows(n, d):
    blocks = fused_norm.NormBlocks.for_shape(n, d)
    assert n % (blocks.block_rows * blocks.row_tiles) == 0
    assert blocks.block_rows & (blocks.block_rows - 1) == 0 and 4 <= blocks.num_warps <= 16


# ----------------------------------------------------------------------------------------------------
# In the model: impl="pallas" trains as impl="xla" does, on one device and sharded (the kernels run per
# shard inside a nested shard_map: heads over 'tensor', the norms' sequence shards with sequence parallel).

PALLAS = {"model.attention_impl": "pallas", "model.norm_impl": "pallas"}
# GPT-2 (LayerNorm with bias) with grouped-query attention, 2 query heads per kv head, head dim 8 (padded
# to 16 inside the kernel): one small model that exercises every kernel path.
GQA = {"model.num_heads": 8, "model.num_kv_heads": 4}
LLAMA = {"model.arch": "llama", **GQA}
SHARDED = {"parallel.data": 2, "parallel.tensor": 4, "parallel.sequence_parallel": True}
STEPS = 3


@shared_across_workers
def xla_losses(arch: str) -> tuple[float, ...]:
    return tuple(run_steps(small_config(**(LLAMA if arch == "llama" else GQA)), 1, STEPS))


def test_model_pallas_trains_as_xla_single_device():
    got = run_steps(small_config(**GQA, **PALLAS), 1, STEPS)
    ref = xla_losses("gpt2")
    assert ref[-1] < ref[0]
    np.testing.assert_allclose(got, ref, rtol=1e-5)


def test_model_pallas_sharded_d2_t4_sequence_parallel():
    """8 devices, data 2 x tensor 4 with sequence parallelism, against the single-device xla run."""
    got = run_steps(small_config(**GQA, **PALLAS, **SHARDED), 8, STEPS)
    np.testing.assert_allclose(got, xla_losses("gpt2"), rtol=1e-5)


def test_model_pallas_attention_dropout_sharded_trains_as_xla():
    """Attention dropout inside the flash kernels, run shard by shard (heads over 'tensor', batch over 'data', the
    dropout's row words split as the heads): the losses of XLA's attention on one device, which drops the same
    entries."""
    drop = {"model.dropout": 0.1, "model.attention_dropout": 0.1}
    got = run_steps(small_config(**GQA, **PALLAS, **SHARDED, **drop), 8, STEPS)
    want = run_steps(small_config(**GQA, **drop), 1, STEPS)
    assert abs(want[0] - xla_losses("gpt2")[0]) > 1e-4, "dropout should change the loss"
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_model_pallas_multi_latent_attention_trains_as_xla():
    """Multi-latent attention through the flash kernel: queries and keys 32 + 16 wide (two parts), values 32, the
    values passed unpadded; the losses equal XLA's attention's on one device."""
    mla = {"model.arch": "llama", "model.num_heads": 4, "model.multi_latent_attention": True, "model.q_lora_rank": 32,
           "model.kv_lora_rank": 24, "model.qk_head_dim": 32, "model.qk_pos_emb_head_dim": 16, "model.v_head_dim": 32}
    got = run_steps(small_config(**mla, **PALLAS), 1, STEPS)
    want = run_steps(small_config(**mla), 1, STEPS)
    assert want[-1] < want[0]
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.slow  # ~40 s: two more train-step compiles; RMSNorm's model path is otherwise unit-tested
def test_model_pallas_llama_sharded():
    got = run_steps(small_config(**LLAMA, **PALLAS, **SHARDED), 8, STEPS)
    np.testing.assert_allclose(got, xla_losses("llama"), rtol=1e-5)


# cuDNN's attention runs shard by shard like the Pallas kernels (megajax/kernels/cudnn_attention.py). cuDNN needs an
# NVIDIA GPU, so here the jnp reference stands in for the cuDNN call: what is tested is the partitioning and the
# custom_vjp around it (the backward's vjp on each shard). The H100 program's cuDNN calls: test_audit.

@pytest.fixture
def cudnn_as_reference(monkeypatch):
    from megajax.kernels import cudnn_attention

    def call(self, q, k, v):
        assert k.shape == v.shape, "jax.nn.dot_product_attention: the value array must have the key array's shape"
        return kernels.attention_reference(q, k, v, causal=self.causal, scale=self.scale)

    monkeypatch.setattr(cudnn_attention.CudnnCore, "__call__", call)


CUDNN_LAYOUTS = {
    "d2t4-sp": SHARDED,
    "d2p2t2": {"parallel.data": 2, "parallel.pipeline": 2, "parallel.tensor": 2, "train.micro_batch_size": 2},
    "d2c2t2-a2a-sp-zero3": {"parallel.data": 2, "parallel.context": 2, "parallel.tensor": 2,
                            "parallel.context_comm": "a2a", "parallel.sequence_parallel": True,
                            "parallel.data_parallel_sharding_strategy": "optim_grads_params"},
}


@pytest.mark.parametrize("layout", [k if k == "d2t4-sp" else pytest.param(k, marks=pytest.mark.slow)
                                    for k in CUDNN_LAYOUTS])
def test_cudnn_attention_sharded_trains_as_xla(cudnn_as_reference, layout):
    """The cuDNN path under a mesh (the reference in cuDNN's place) against one device's xla run: heads over
    'tensor', batch over 'data', inside a pipeline's schedule, and over all-to-all context parallelism's heads."""
    cfg = small_config(**{**GQA, "model.attention_impl": "cudnn", **CUDNN_LAYOUTS[layout]})
    np.testing.assert_allclose(run_steps(cfg, 8, STEPS), xla_losses("gpt2"), rtol=1e-5)


def test_cudnn_takes_values_narrower_than_the_keys(cudnn_as_reference):
    """Multi-latent attention's values (narrower than the keys, which JAX's cuDNN call does not take) are padded
    to the keys' width for the call and its output cut back: the output and gradients equal the reference's on
    the narrow values."""
    q, k, _, _, _ = attention_case(1, 32, 4, 2, 24, jnp.float32, seed=7, segments=False)
    _, _, v, do, _ = attention_case(1, 32, 4, 2, 16, jnp.float32, seed=8, segments=False)
    cudnn = functools.partial(kernels.attention, causal=True, impl="cudnn")
    got = value_and_grads(cudnn, q, k, v, do)
    want = value_and_grads(functools.partial(kernels.attention_reference, causal=True), q, k, v, do)
    for name, x, y in zip(["out", "dq", "dk", "dv"], got, want):
        assert x.shape == y.shape and rel_err(x, y) < 1e-5, name


def test_cudnn_core_gradients_match_reference(cudnn_as_reference):
    """sharded_core's value and gradients, under a data x tensor mesh and on one device, against the reference."""
    from megajax.kernels.cudnn_attention import cudnn_attention

    q, k, v = (jax.random.normal(jax.random.key(i), (4, 16, h, 8)) for i, h in enumerate((8, 4, 4)))

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))

    want = jax.value_and_grad(loss(lambda *a: kernels.attention_reference(*a, scale=0.3)), argnums=(0, 1, 2))(q, k, v)
    got_one = jax.value_and_grad(loss(lambda *a: cudnn_attention(*a, scale=0.3)), argnums=(0, 1, 2))(q, k, v)
    mesh = jax.make_mesh((2, 4), ("data", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        got_mesh = jax.jit(jax.value_and_grad(loss(lambda *a: cudnn_attention(*a, scale=0.3)),
                                              argnums=(0, 1, 2)))(q, k, v)
    for got in (got_one, got_mesh):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)


@pytest.mark.parametrize("rows,k,n,sizes,dtype", [
    (40, 24, 40, (5, 0, 17, 10, 0, 8), "float32"),  # empty groups, widths not multiples of the blocks
    pytest.param(64, 32, 64, (64, 0, 0, 0), "float32", marks=pytest.mark.slow),  # one group takes every row
    (33, 16, 16, (1, 2, 3, 4), "float32"),  # rows past the groups (an exchange's padding): zeros
    pytest.param(96, 64, 48, (30, 30, 36), "bfloat16", marks=pytest.mark.slow),
])
def test_grouped_matmul_matches_ragged_dot(rows, k, n, sizes, dtype):
    """The Pallas grouped GEMM (interpreted) against jax.lax.ragged_dot: output and both gradients."""
    from megajax.kernels.grouped_matmul import Blocks, grouped_matmul

    dt = jnp.dtype(dtype)
    x = jax.random.normal(jax.random.key(0), (rows, k), dt)
    w = jax.random.normal(jax.random.key(1), (len(sizes), k, n), dt)
    s = jnp.array(sizes, jnp.int32)
    g = jax.random.normal(jax.random.key(2), (rows, n), dt)
    blocks = Blocks(m=16, n=16, k=16)

    def run(f):
        y, vjp = jax.vjp(f, x, w)
        return (y, *vjp(g))

    got = run(lambda x, w: grouped_matmul(x, w, s, blocks=blocks))
    ref = run(lambda x, w: jax.lax.ragged_dot(x, w, s))
    tol = dict(rtol=2e-2, atol=2e-1) if dtype == "bfloat16" else dict(rtol=1e-5, atol=1e-4)
    for a, b in zip(got, ref):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)
    if sum(sizes) < rows:
        assert not np.asarray(got[0])[sum(sizes):].any()


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_fp8_grouped_gemm_matches_fp8_ragged_dot(fmt):
    """model.fp8 with model.moe_grouped_gemm: the three FP8 products (forward e4m3 x e4m3; the input and weight
    gradients with the gradient in e5m2 (hybrid: multiplied in bf16, which holds both formats exactly) or e4m3)
    as the Pallas grouped GEMM (interpreted) equal them as jax.lax.ragged_dot: output and both gradients, with
    empty groups and padding rows."""
    from megajax.model import fp8

    rows, k, n, sizes = 40, 24, 40, (5, 0, 17, 10, 0, 7)
    x = jax.random.normal(jax.random.key(0), (rows, k), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (len(sizes), k, n), jnp.bfloat16)
    g = jax.random.normal(jax.random.key(2), (rows, n), jnp.bfloat16)
    s = jnp.array(sizes, jnp.int32)

    def run(grouped):
        y, vjp = jax.vjp(lambda x, w: fp8.ragged_dot(fmt, 0, x, w, s, None, grouped), x, w)
        return (y, *vjp(g))

    got = run(((None, "embed"), ("expert", "embed", "mlp"), (None, "mlp")))
    for a, b in zip(got, run(None)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-6)
    assert not np.asarray(got[0], np.float32)[sum(sizes):].any()


# ----------------------------------------------------------------------------------------------------
# Lowered for GPUs on this CPU-only machine.


@pytest.mark.parametrize("arch,norm", [("gpt2", "layer_norm"), ("llama", "rms_norm")])
def test_train_step_exports_for_cuda_with_kernels(arch, norm):
    """jax.export(platforms=["cuda"]) of the whole train step holds the Triton kernels, not their CPU
    interpreter: a kernel that would not lower for the GPU fails here."""
    from megajax import audit

    cfg = small_config(**PALLAS, **(LLAMA if arch == "llama" else GQA), **SHARDED)
    report = audit.lower_for(cfg, "cuda")
    names = report["kernel_custom_calls"]["__gpu$xla.gpu.triton"]["names"]
    assert set(names) == {"flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv", f"{norm}_fwd",
                          f"{norm}_bwd"}


@pytest.mark.parametrize("fmt", ["none", "hybrid"])
def test_moe_grouped_gemm_exports_for_cuda(fmt):
    """A dropless MoE with model.moe_grouped_gemm on d4 x e2 x t2: the exported step holds the grouped GEMM's
    Triton kernels (forward, and the input and weight gradients), with FP8 operands too."""
    from megajax import audit

    cfg = small_config(**{"model.num_experts": 4, "model.experts_per_token": 2, "model.moe_grouped_gemm": True,
                          "parallel.data": 4, "parallel.expert": 2, "parallel.tensor": 2, "model.fp8": fmt,
                          "model.compute_dtype": "bfloat16"})
    names = audit.lower_for(cfg, "cuda")["kernel_custom_calls"]["__gpu$xla.gpu.triton"]["names"]
    # with the attention and norm kernels model.attention_impl and model.norm_impl's auto chooses for a GPU
    assert set(names) == {"grouped_matmul", "grouped_matmul_weight_grad", "flash_attention_fwd", "flash_attention_dq",
                          "flash_attention_dkv", "layer_norm_fwd", "layer_norm_bwd"}


def gpu_mesh(target: str):
    from pathlib import Path

    from jax.experimental import topologies

    import megajax

    desc = (Path(megajax.__file__).parent / "targets" / f"{target}.txtpb").read_text()
    try:
        topo = topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=desc)
    except Exception as e:  # noqa: BLE001 - any failure means no GPU compiler here
        pytest.skip(f"no compile-only GPU target (needs the gpu-audit extra, jax-cuda12-plugin): {e}")
    return topologies.make_mesh(topo, (1,), ("x",))


@pytest.mark.parametrize("target", ["h100", pytest.param("a100", marks=pytest.mark.slow)])  # suite time
def test_kernels_compile_for_gpus(target):
    """XLA's GPU compiler (compile-only devices) compiles every BLOCK_TABLE entry's three attention kernels, without
    and with attention dropout (the bf16 256 entry at multi-latent attention's 192-wide queries and keys, read in
    two parts, and 128-wide values) and both norms at Llama-sized widths to PTX: tiles that overflow shared memory
    fail here."""
    mesh = gpu_mesh(target)
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def sds(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=spec)

    table = list(fa.BLOCK_TABLE.items())

    def step(attention_inputs, norm_inputs, seeds):
        out = []
        for ((d, nbytes), blocks), (q, k, v, seg) in zip(table, attention_inputs):
            for drop in (None, AttentionDropout(seeds, jnp.arange(4, dtype=jnp.int32), 0.1)):
                f = functools.partial(fa.flash_attention, causal=True, segment_ids=seg, block_sizes=blocks,
                                      probs_dropout=drop)
                o, vjp = jax.vjp(f, q, k, v)
                out.append(vjp(o))
        for x in norm_inputs:
            w = jnp.ones(x.shape[-1])
            out.append(jax.grad(lambda x, w: fused_norm.layer_norm_pallas(x, w, w, out_dtype=x.dtype).sum(),
                                argnums=(0, 1))(x, w))
            out.append(jax.grad(lambda x, w: fused_norm.rms_norm_pallas(x, w, out_dtype=x.dtype).sum(),
                                argnums=(0, 1))(x, w))
        return out

    attention_inputs = []
    for d, nbytes in fa.BLOCK_TABLE:
        dtype = jnp.float32 if nbytes == 4 else jnp.bfloat16
        dv = 128 if (d, nbytes) == (256, 2) else d  # multi-latent attention's shape: 192 (128 + 64) and values of 128
        d = 192 if (d, nbytes) == (256, 2) else d
        attention_inputs.append((sds((1, 256, 4, d), dtype), sds((1, 256, 2, d), dtype),
                                 sds((1, 256, 2, dv), dtype), sds((1, 256), jnp.int32)))
    norm_inputs = [sds((512, 768), jnp.bfloat16), sds((64, 8192), jnp.float32)]
    compiled = jax.jit(step).lower(attention_inputs, norm_inputs, sds((1, 2), jnp.uint32)).compile()
    assert compiled.as_text().count("__gpu$xla.gpu.triton") >= 6 * len(fa.BLOCK_TABLE) + 8
