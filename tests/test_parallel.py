"""Gradient accumulation and dropout are layout independent (every layout against one device: test_layouts)."""

import functools

import numpy as np

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
