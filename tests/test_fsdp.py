"""Fully sharded data parallelism (parallel.data_parallel_sharding_strategy optim_grads and optim_grads_params)
beyond tests/test_layouts.py's matrix (which has ZeRO-2 and ZeRO-3 with tensor and sequence parallelism and experts):
with context parallelism (and hybrid sharding over it), FP8, full recomputation, padded shards, the zero-bubble
schedule and data 1 on a pipeline, each equal to one device; what the zero-bubble schedule keeps under ZeRO-2;
and the config's refusals."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import run_steps, shared_across_workers, small_config
from megajax.config import ConfigError

BASE = {"model.num_layers": 3, "model.hidden_size": 64, "model.num_heads": 4, "model.seq_length": 32,
        "model.ffn_hidden_size": 136, "model.arch": "llama", "train.global_batch_size": 12}
ZERO3 = {"parallel.data_parallel_sharding_strategy": "optim_grads_params"}
CASES = {
    # the weights sharded over data x context; 136 and the vocabulary padded to a multiple of 6 (and 4)
    "context2-data3": ({"parallel.data": 3, "parallel.context": 2, "train.micro_batch_size": 2}, {}),
    # hybrid sharding: two instances, each sharding over its two data ranks x two context ranks
    "hybrid-context2": ({"parallel.data": 4, "parallel.context": 2, "parallel.num_distributed_optimizer_instances": 2,
                         "train.micro_batch_size": 1}, {}),
    "fp8-delayed": ({"parallel.data": 4, "train.micro_batch_size": 1},
                    {"model.fp8": "hybrid", "model.fp8_recipe": "delayed"}),
    # no data ranks to shard over: nothing sharded, on a pipeline that would otherwise reduce in every backward
    "pipeline-data1-zero2": ({"parallel.data": 1, "parallel.pipeline": 2, "parallel.tensor": 2,
                              "parallel.data_parallel_sharding_strategy": "optim_grads", "train.micro_batch_size": 6},
                             {"model.num_layers": 4}),
    # the zero-bubble schedule, two chunks a rank: B and W reduce-scatter what they compute, the weights gathered in
    # the idle ticks before each rank's first forward
    "zero-bubble": ({"parallel.data": 2, "parallel.pipeline": 2, "parallel.schedule": "zero_bubble",
                     "parallel.virtual_stages": 2, "train.micro_batch_size": 3}, {"model.num_layers": 4}),
    "recompute-full-zero2": ({"parallel.data": 2, "parallel.tensor": 2, "parallel.sequence_parallel": True,
                              "parallel.data_parallel_sharding_strategy": "optim_grads", "train.micro_batch_size": 2},
                             {"model.recompute": "full"}),
}


@shared_across_workers
def reference(model: tuple) -> list:
    norms = []
    losses = run_steps(small_config(**{**BASE, **dict(model)}), 1, 2, grad_norms=norms)
    return [losses, norms]


# (suite time: FP8's cases run ZeRO-3's recompute-everything path, delayed scaling's 27 s; test_layouts trains hybrid
# sharding by default)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow)
                                  if n in ("recompute-full-zero2", "hybrid-context2", "fp8-delayed") else n
                                  for n in CASES])
def test_fsdp_matches_one_device(name):
    layout, model = CASES[name]
    norms = []
    cfg = small_config(**{**BASE, **ZERO3, **model, **layout})
    n = cfg.parallel.data * cfg.parallel.pipeline * cfg.parallel.context * cfg.parallel.tensor
    losses = run_steps(cfg, n, 2, grad_norms=norms)
    ref_losses, ref_norms = reference(tuple(sorted(model.items())))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-4)


def test_the_strategy_resolves_and_refuses_what_it_cannot_run():
    par = small_config().parallel
    assert par.sharding_strategy == "no_shard" and not par.shards_optimizer
    assert small_config(**{"parallel.distributed_optimizer": True}).parallel.sharding_strategy == "optim"
    zero3 = small_config(**ZERO3).parallel
    assert zero3.shards_optimizer and zero3.shards_grads and zero3.shards_params
    assert small_config(**ZERO3, **{"parallel.pipeline": 2}).parallel.shards_params  # (gathered in the ticks)
    for strategy in ("optim_grads", "optim_grads_params"):
        with pytest.raises(ConfigError, match="parallel.schedule=1f1b, interleaved or zero_bubble"):
            small_config(**{"parallel.data_parallel_sharding_strategy": strategy, "parallel.pipeline": 2,
                            "parallel.schedule": "gpipe"})
        assert small_config(**{"parallel.data_parallel_sharding_strategy": strategy, "parallel.pipeline": 2,
                               "parallel.schedule": "zero_bubble"}).parallel.shards_grads
    # hybrid sharding: instances of something sharded, dividing the data ranks, each with more than one rank
    hybrid = {**ZERO3, "parallel.data": 8, "parallel.num_distributed_optimizer_instances": 2}
    assert small_config(**hybrid).parallel.num_distributed_optimizer_instances == 2
    for sets, match in (({"parallel.data_parallel_sharding_strategy": "no_shard"}, "set parallel.data_parallel_"),
                        ({"parallel.num_distributed_optimizer_instances": 3}, r"choose it from \[1, 2, 4, 8\]"),
                        ({"parallel.num_distributed_optimizer_instances": 8}, r"choose it from \[1, 2, 4\]"),
                        ({"parallel.num_distributed_optimizer_instances": 0}, "must be >= 1")):
        with pytest.raises(ConfigError, match=match):
            small_config(**{**hybrid, **sets})
    # set, the strategy decides (a preset's distributed_optimizer=true overridden with --set ...=no_shard)
    assert not small_config(**{"parallel.distributed_optimizer": True,
                                "parallel.data_parallel_sharding_strategy": "no_shard"}).parallel.shards_optimizer


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads"])
def test_zero3_carries_the_embedding_and_head_gradients_as_shards(strategy):
    """Over the micro batches, ZeRO-3 carries the embedding's and output layer's gradients as shards (reduce-scattered
    in every micro batch, like the layers'); ZeRO-2 sums them whole and reduces them once after the last. Traced on 4
    data ranks, 3 micro batches each; the accounting the audit reports (gradient_bytes_per_device) says the same."""
    import jax

    from conftest import jaxpr_eqns
    from megajax import audit, step as step_lib

    cfg = small_config(**{**BASE, "parallel.data": 4, "train.micro_batch_size": 1,
                          "parallel.data_parallel_sharding_strategy": strategy})
    cfg, mesh, setup, state, batch = audit.abstract_step(cfg, jax.devices()[:4])
    with jax.set_mesh(mesh):
        jaxpr = step_lib.jit_train_step(setup).trace(state, batch).jaxpr
    m = cfg.model
    tables = {(m.padded_vocab_size, m.hidden_size), (m.hidden_size, m.padded_vocab_size)}  # the embedding, the head
    carried = {tuple(v.aval.shape) for e in jaxpr_eqns(jaxpr.jaxpr) if e.primitive.name == "scan"
               and e.params["length"] == cfg.num_micro_batches for v in e.outvars}
    whole = strategy == "optim_grads"
    assert (carried & tables == tables) == whole and (carried & tables == set()) != whole, carried
    ends = 2 * m.padded_vocab_size * m.hidden_size * 4  # their fp32 gradients, whole
    total = sum(x.size * 4 for x in jax.tree.leaves(state.params))
    expected = (total - ends) / 4 + ends if whole else total / 4
    assert setup.gradient_bytes_per_device() == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize("strategy", ["optim", "optim_grads"])
def test_zero2_on_the_zero_bubble_schedule_keeps_no_whole_gradient(strategy):
    """Under the zero-bubble schedule ZeRO-2's ticks carry each layer weight's gradient as its shard only (B and W
    reduce-scatter what they compute); ZeRO-1's carry the rank's whole fp32 gradients through the schedule. Traced
    on data 2 x pipeline 2."""
    import jax

    from conftest import jaxpr_eqns
    from megajax import audit, step as step_lib

    cfg = small_config(**{**BASE, "model.num_layers": 4, "parallel.data": 2, "parallel.pipeline": 2,
                          "parallel.schedule": "zero_bubble", "train.micro_batch_size": 3,
                          "parallel.data_parallel_sharding_strategy": strategy})
    cfg, mesh, setup, state, batch = audit.abstract_step(cfg, jax.devices()[:4])
    with jax.set_mesh(mesh):
        jaxpr = step_lib.jit_train_step(setup).trace(state, batch).jaxpr
    m = cfg.model
    # the MLP's down projection of the rank's chunk, [v, Lc, ffn, hidden], as a whole fp32 gradient
    whole = (1, m.num_layers // 2, m.ffn_hidden_size, m.hidden_size)
    carried = {(tuple(v.aval.shape), str(v.aval.dtype)) for e in jaxpr_eqns(jaxpr.jaxpr)
               if e.primitive.name == "scan" for v in e.outvars}
    assert ((whole, "float32") in carried) == (strategy == "optim"), sorted(carried)
