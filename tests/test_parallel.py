"""Gradient accumulation and dropout are layout independent (every layout against one device: test_layouts)."""

import functools

import numpy as np
import pytest

from conftest import run_steps, small_config

STEPS = 4
ARCHS = {"gpt2": {}}


@functools.lru_cache(maxsize=None)
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
    assert abs(ref[0] - reference("gpt2")[0]) > 1e-4, "dropout should change the loss"


# The overlapped gradient reduction (parallel.overlap_grad_reduce, megajax/overlap.py) over its space: one micro
# batch (nothing summed before the last) and several, each recompute mode, both architectures (tied and untied
# embeddings), dropout, tensor and sequence parallelism, MoE with the experts over 'expert'; all-reduced, or
# scattered onto the distributed optimizer's shards (over 'data' alone, over 'data' x 'expert', with 'tensor'
# manual too, and a tensor-sharded bias all-reduced and sliced); the weights kept as their shards between steps
# and gathered in the first forward (overlap_param_gather; first micro batch = last, or not).
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
}


# the dropout case and the plain all-reduce at one micro batch with -m slow (suite time; the audit test compiles
# the all-reduce path by default)
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in ("gpt2-d4-m2-selective-dropout",
                                                                                   "gpt2-d2-m1") else c
                                  for c in OVERLAP_CASES])
def test_overlapped_gradient_reduction_matches_one_device(case):
    sets = OVERLAP_CASES[case]
    n = sets.get("parallel.data", 1) * sets.get("parallel.tensor", 1)
    # one device: the same model and micro batch size (it splits the batch as the layout's ranks do)
    single = {k: v for k, v in sets.items() if not k.startswith("parallel.")}
    ref_norms, norms = [], []
    ref = run_steps(small_config(**single), 1, 2, grad_norms=ref_norms)
    got = run_steps(small_config(**sets, **{"parallel.overlap_grad_reduce": True}), n, 2, grad_norms=norms)
    np.testing.assert_allclose(got, ref, rtol=1e-4)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-4)
