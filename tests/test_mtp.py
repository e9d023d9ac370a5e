"""Multi-token prediction (model.mtp_num_layers, DeepSeek-V3's): the modules' loss against a reference written from
the V3 report, its inputs from whole sequences, and the layouts that run it equal one device."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megajax import model
from megajax.config import ConfigError
from megajax.model import gpt, model_state

from conftest import run_steps, shared_across_workers, small_config

MTP = {"model.arch": "llama", "model.num_layers": 2, "model.mtp_num_layers": 2, "model.mtp_loss_scaling_factor": 0.3}


def _rms_norm(x, scale, eps):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _reference_objective(cfg, params, tokens_all, mask):
    """DeepSeek-V3's objective (report section 2.2): the main cross entropy over the T predicted tokens plus
    lambda / D x sum over depths k of L^k = -1/T sum_{i = 2 + k}^{T + 1} log P^k_i[t_i], where module k's
    h'^k_i = M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)] (Hugging Face's eh_proj order), h^k = TRM_k(h'^k),
    P^k_{i+k+1} = OutHead(h^k_i), and h^0 the main model's last layer's output. Returns (objective, the modules'
    token mean loss). tokens_all: [b, T + 1]; mask: [b, T], the main loss's."""
    m = cfg
    tokens, targets = tokens_all[:, :-1], tokens_all[:, 1:]
    b, T = tokens.shape
    n = jnp.sum(mask)
    h = model.layers_apply(m, params["layers"], model.embed_apply(m, params, tokens, None), None)
    main = model.head_apply(m, params, h, targets, mask) / n
    output = params["head"]["output"]
    modules, total, count = 0.0, 0.0, 0.0
    for k in range(1, m.mtp_num_layers + 1):
        p = params[f"mtp_{k}"]
        ahead = jnp.pad(tokens_all[:, k:], ((0, 0), (0, k - 1)))[:, :T]  # t_{i+k} at position i
        e = model.embed_tokens(m, params, ahead, None)
        joined = jnp.concatenate([_rms_norm(e, p["enorm"]["scale"], m.norm_eps),
                                  _rms_norm(h, p["hnorm"]["scale"], m.norm_eps)], axis=-1)
        h = gpt.Block(m).apply({"params": p["block"]}, joined @ p["eh_proj"], m.num_layers + k - 1, None)[0]
        logits = _rms_norm(h, p["final_norm"]["scale"], m.norm_eps) @ output
        logp = jax.nn.log_softmax(logits[..., :m.vocab_size], axis=-1)
        predicted = jnp.pad(tokens_all[:, k + 1:], ((0, 0), (0, k)))[:, :T]  # t_{i+k+1}
        counted = jnp.pad(mask[:, k:], ((0, 0), (0, k)))  # the main loss's mask at that token; none past the end
        nll = -jnp.take_along_axis(logp, predicted[..., None], axis=-1)[..., 0] * counted
        modules, total, count = modules + jnp.sum(nll) / n, total + jnp.sum(nll), count + jnp.sum(counted)
    return main + m.mtp_loss_scaling_factor / m.mtp_num_layers * modules, total / count


def test_the_modules_loss_and_gradient_match_the_v3_report():
    cfg = small_config(**MTP).model
    params = nn.unbox(model.init_params(cfg, jax.random.key(1)))
    rng = np.random.default_rng(0)
    tokens_all = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, cfg.seq_length + 1)), jnp.int32)
    mask = jnp.asarray(rng.random((2, cfg.seq_length)) > 0.2, jnp.float32)
    batch = model.mtp_batch({"tokens": tokens_all[:, :-1], "targets": tokens_all[:, 1:], "loss_mask": mask,
                             "sample_ids": jnp.arange(2)}, cfg.mtp_num_layers)
    seed = 1 / jnp.sum(mask)

    def ours(p):
        return model.loss_sum(cfg, p, batch, model.side_inputs(cfg, 0, batch, objective_scale=seed)) * seed

    grads = jax.jit(jax.grad(ours))(params)
    reference = jax.jit(jax.value_and_grad(lambda p: _reference_objective(cfg, p, tokens_all, mask), has_aux=True))
    (_, want_mtp), want_grads = reference(params)
    main = model.loss_sum(cfg, params, batch, None) * seed  # the value stays the main loss's
    np.testing.assert_allclose(float(jax.jit(ours)(params)), float(main), rtol=1e-6)
    np.testing.assert_allclose(float(model_state.mtp_stats(grads)["mtp_loss"]), float(want_mtp), rtol=1e-5)
    weights, _ = model_state.split(grads)
    for path, g in jax.tree_util.tree_flatten_with_path(weights)[0]:
        ref = want_grads
        for key in path:
            ref = ref[key.key]
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref), rtol=1e-5, atol=1e-7, err_msg=str(path))
    assert float(jnp.abs(grads["mtp_2"]["eh_proj"]).sum()) > 0  # the second depth is trained too


def test_inputs_shift_within_whole_sequences_and_documents():
    targets = jnp.arange(1, 9)[None]  # t_2 .. t_9 of tokens t_1 .. t_8
    segments = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 1]])
    out = model.mtp_batch({"tokens": targets - 1, "targets": targets, "loss_mask": jnp.ones((1, 8)),
                           "segment_ids": segments}, 2)
    assert out["mtp_tokens_1"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]  # t_{i+1}: the main targets
    assert out["mtp_targets_1"].tolist() == [[2, 3, 4, 5, 6, 7, 8, 0]]
    assert out["mtp_mask_1"].tolist() == [[1, 1, 0, 1, 1, 1, 1, 0]]  # t_{i+2} in another document, or none
    assert out["mtp_tokens_2"].tolist() == [[2, 3, 4, 5, 6, 7, 8, 0]]
    assert out["mtp_targets_2"].tolist() == [[3, 4, 5, 6, 7, 8, 0, 0]]
    assert out["mtp_mask_2"].tolist() == [[1, 0, 0, 1, 1, 1, 0, 0]]


def test_the_config_names_the_fix():
    with pytest.raises(ConfigError, match="mtp_num_layers must be >= 0"):
        small_config(**{"model.mtp_num_layers": -1})
    # null splits the tables over the pipeline ranks by its bytes rule, the modules on or off
    from megajax.parallel.step_plan import StepPlan
    cfg = small_config(**{**MTP, "parallel.pipeline": 2, "model.vocab_size": 50000}).for_devices(2)
    assert StepPlan.resolve(cfg).vocab_over_pipeline


def _train(sets: dict, n: int, steps: int = 2) -> list[tuple[float, float, float]]:
    """(loss, gradient norm, mtp_loss) of each of `steps` steps on `n` devices."""
    stats = []
    run_steps(small_config(**sets), n, steps, stats=stats)
    return [(s["loss"], s["grad_norm"], s["mtp_loss"]) for s in stats]


BASE = {**MTP, "model.num_layers": 4, "model.mtp_num_layers": 1}
MOE = {"model.num_experts": 4, "model.experts_per_token": 2, "model.moe_ffn_hidden_size": 64,
       "train.micro_batch_size": 2}
# (name, extra settings, devices): each run with the modules equals one device's
VOCAB = {"parallel.vocab_over_pipeline": True}  # the modules' lookups, blocks and logits in the ranks' lock step
LAYOUTS = [
    ("d2-p2-1f1b", {"parallel.data": 2, "parallel.pipeline": 2}, 4),
    ("d2-p2-1f1b-vocab", {"parallel.data": 2, "parallel.pipeline": 2, **VOCAB}, 4),
    ("c2-documents", {"parallel.context": 2, "data.reset_attention_mask": True}, 2),
]
SLOW_LAYOUTS = [
    ("d2-t2-sp", {"parallel.data": 2, "parallel.tensor": 2, "parallel.sequence_parallel": True}, 4),
    ("d4-zero3", {"parallel.data": 4, "parallel.data_parallel_sharding_strategy": "optim_grads_params"}, 4),
    ("p2-interleaved", {"parallel.pipeline": 2, "parallel.schedule": "interleaved", "parallel.virtual_stages": 2,
                        "train.micro_batch_size": 2}, 2),
    ("p2-zero-bubble", {"parallel.pipeline": 2, "parallel.schedule": "zero_bubble"}, 2),
    ("p2-t2-gpipe", {"parallel.pipeline": 2, "parallel.tensor": 2, "parallel.schedule": "gpipe"}, 4),
    ("d4-zero1-overlaps", {"parallel.data": 4, "parallel.data_parallel_sharding_strategy": "optim",
                           "parallel.overlap_grad_reduce": True, "parallel.overlap_param_gather": True}, 4),
    ("d2-zero2-p2", {"parallel.data": 2, "parallel.pipeline": 2,
                     "parallel.data_parallel_sharding_strategy": "optim_grads"}, 4),
    ("t2-tp-overlap", {"parallel.tensor": 2, "parallel.sequence_parallel": True, "parallel.tp_comm_overlap": True}, 2),
    ("d2-full-recompute", {"parallel.data": 2, "model.recompute": "full"}, 2),
    ("d2-e2-moe", {"parallel.data": 2, "parallel.expert": 2, **MOE}, 2),
    ("d2-p2-moe", {"parallel.data": 2, "parallel.pipeline": 2, **MOE}, 4),
    ("p2-interleaved-vocab", {"parallel.pipeline": 2, "parallel.schedule": "interleaved", "parallel.virtual_stages": 2,
                              "train.micro_batch_size": 2, **VOCAB}, 2),
    ("p2-zero-bubble-vocab", {"parallel.pipeline": 2, "parallel.schedule": "zero_bubble", **VOCAB}, 2),
    ("p2-t2-gpipe-vocab", {"parallel.pipeline": 2, "parallel.tensor": 2, "parallel.schedule": "gpipe", **VOCAB}, 4),
    ("d2-e2-p2-moe-vocab", {"parallel.data": 2, "parallel.expert": 2, "parallel.pipeline": 2, **MOE, **VOCAB}, 4),
    ("d2-p2-t2-zero3-vocab", {"parallel.data": 2, "parallel.pipeline": 2, "parallel.tensor": 2,
                              "parallel.sequence_parallel": True, **VOCAB,
                              "parallel.data_parallel_sharding_strategy": "optim_grads_params"}, 8),
]


@pytest.mark.parametrize("name,sets,n", [*LAYOUTS, *[pytest.param(*c, marks=pytest.mark.slow) for c in SLOW_LAYOUTS]],
                         ids=[c[0] for c in LAYOUTS + SLOW_LAYOUTS])
def test_a_layout_with_the_modules_matches_one_device(name, sets, n):
    one = tuple(sorted((k, v) for k, v in sets.items() if not k.startswith("parallel.")))
    np.testing.assert_allclose(_train({**BASE, **sets}, n), _one_device(one), rtol=1e-4)


@shared_across_workers
def _one_device(settings: tuple) -> list:
    return _train({**BASE, **dict(settings)}, 1)


def test_the_run_logs_the_modules_loss():
    """The train loop's record and line carry mtp_loss beside the main loss (megajax.train)."""
    from megajax import train

    host = {"loss": 5.0, "lr": 1e-4, "grad_norm": 1.0, "param_norm": 2.0, "loss_scale": 1.0, "mtp_loss": 5.5}
    record = {"step": 2, **train._step_stats(host), "step_time_s": 1.0, "tokens_per_s": 1.0,
              "tflops_per_device": 1.0, "mfu": 0.1}
    assert record["mtp_loss"] == 5.5
    assert "loss 5.0000 | mtp loss 5.5000 |" in train._step_line(record, 4)
    assert "mtp" not in train._step_line({k: v for k, v in record.items() if k != "mtp_loss"}, 4)
