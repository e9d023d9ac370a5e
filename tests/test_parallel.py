"""Sharded equals single device: data x tensor x sequence parallel layouts, GPT and Llama."""

import functools

import numpy as np
import pytest

from conftest import run_steps, small_config

STEPS = 4
ARCHS = {
    "gpt2": {},
    "llama": {"model.arch": "llama", "model.num_heads": 8, "model.num_kv_heads": 4},
}


@functools.lru_cache(maxsize=None)
def reference(arch: str) -> tuple[float, ...]:
    return tuple(run_steps(small_config(**ARCHS[arch]), 1, STEPS))


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("layout", [
    {"parallel.data": 2, "parallel.tensor": 4, "parallel.sequence_parallel": True},
    {"parallel.data": 4, "parallel.tensor": 2},
    {"parallel.data": 8, "parallel.tensor": 1, "train.micro_batch_size": 1},
    {"parallel.data": 2, "parallel.tensor": 4, "parallel.distributed_optimizer": True,
     "train.micro_batch_size": 2},
], ids=["d2t4sp", "d4t2", "d8-m1", "d2t4-zero1-m2"])
def test_sharded_matches_single_device(arch, layout):
    ref = reference(arch)
    got = run_steps(small_config(**ARCHS[arch], **layout), 8, STEPS)
    assert ref[-1] < ref[0], "the reference run should learn"
    np.testing.assert_allclose(got, ref, rtol=1e-4)


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
