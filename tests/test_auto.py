"""The defaults' choices made where the step is traced: the fused kernels on GPUs and XLA's on CPU
(model.attention_impl and model.norm_impl auto), the layers unrolled on GPUs where no collective runs inside them
(model.scan_layers null), selective recomputation that leaves a fused attention core alone, and the PyTorch peers
scripts/bench_peers.py times beside megajax."""

from __future__ import annotations

import collections
import importlib.util
import itertools
import math
import os
import re

import jax
import pytest

from megajax import audit, divergence, step as step_lib
from megajax.config import ConfigError
from megajax.kernels import auto as kernel_choice
from megajax.parallel.step_plan import StepPlan

from conftest import REPO, gpu, small_config

ARCHS = {
    "gpt2": {},
    "llama": {"model.arch": "llama", "model.num_heads": 8, "model.num_kv_heads": 4},
    # multi-latent attention: head dim 24 for queries and keys, values of 16
    "mla": {"model.arch": "llama", "model.num_heads": 4, "model.multi_latent_attention": True, "model.q_lora_rank": 32,
            "model.kv_lora_rank": 24, "model.qk_head_dim": 16, "model.qk_pos_emb_head_dim": 8, "model.v_head_dim": 16},
}
BF16 = {"model.compute_dtype": "bfloat16", "model.recompute": "selective"}


def _step_jaxpr(cfg, devices):
    cfg, mesh, setup, state, batch = audit.abstract_step(cfg, devices)
    with jax.set_mesh(mesh):
        return setup, step_lib.jit_train_step(setup).trace(state, batch).jaxpr.jaxpr


def _kernels(jaxpr) -> set[str]:
    return {str(e.params["name"]) for e in divergence.eqns(jaxpr) if e.primitive.name == "pallas_call"}


def _primitives(jaxpr) -> set[str]:
    return {e.primitive.name for e in divergence.eqns(jaxpr)}


def _count(jaxpr, primitive: str, name: str | None = None) -> int:
    return sum(e.primitive.name == primitive and (name is None or str(e.params.get("name")) == name)
               for e in divergence.eqns(jaxpr))


@pytest.mark.parametrize("arch", ARCHS)
def test_auto_kernels_are_xla_on_cpu(arch):
    """On CPU devices the step runs XLA's attention and norms (no interpreted kernel), chosen while it is traced:
    no platform conditional is left in it, and selective recomputation recomputes XLA's attention scores (q k^T
    once more than without recomputation; the backward needs no second p v)."""
    _, jaxpr = _step_jaxpr(small_config(**ARCHS[arch], **BF16), jax.devices()[:1])
    assert not _kernels(jaxpr)
    assert "platform_index" not in _primitives(jaxpr)
    _, kept = _step_jaxpr(small_config(**{**ARCHS[arch], **BF16, "model.recompute": "none"}), jax.devices()[:1])
    assert _count(jaxpr, "dot_general") == _count(kept, "dot_general") + 1


@gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_auto_kernels_are_the_fused_ones_on_gpus(arch):
    """On (compile-only) GPUs the same defaults trace the flash attention and fused norm kernels, forward and
    backward, with no platform conditional, and a fused core is not recomputed by selective recomputation."""
    norm = "layer_norm" if arch == "gpt2" else "rms_norm"
    _, jaxpr = _step_jaxpr(small_config(**ARCHS[arch], **BF16), audit._gpu_devices("h100", 1))
    assert _kernels(jaxpr) == {"flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv", f"{norm}_fwd",
                               f"{norm}_bwd"}
    assert "platform_index" not in _primitives(jaxpr)
    assert _count(jaxpr, "pallas_call", "flash_attention_fwd") == 1  # one layer's body: not run again

@gpu
def test_auto_takes_the_flash_kernels_with_dropout_and_xla_where_they_cannot():
    """Attention dropout: the flash kernels draw the entries XLA's attention drops (kernels/dropout.py), so auto runs
    them. A head dim above 256: auto runs XLA's attention and keeps the fused norms, and the train log's kernels line
    names the reason; an explicit pallas raises instead."""
    _, jaxpr = _step_jaxpr(small_config(**BF16, **{"model.attention_dropout": 0.1}), audit._gpu_devices("h100", 1))
    assert _kernels(jaxpr) == {"flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv", "layer_norm_fwd",
                               "layer_norm_bwd"}
    wide = {"model.hidden_size": 576, "model.num_heads": 2}  # head dim 288
    cfg = small_config(**BF16, **wide)
    _, jaxpr = _step_jaxpr(cfg, audit._gpu_devices("h100", 1))
    assert _kernels(jaxpr) == {"layer_norm_fwd", "layer_norm_bwd"}
    m = cfg.model
    line = kernel_choice.summary(m.attention_impl, m.norm_impl, head_dim=m.head_dim, width=m.hidden_size,
                                 platform="gpu")
    assert line == "attention xla (auto: head dim 288 > 256, the flash kernel's largest), norms pallas (auto on gpu)"
    with pytest.raises(ValueError, match="head dim 288 > 256"):
        _step_jaxpr(small_config(**BF16, **wide, **{"model.attention_impl": "pallas"}), audit._gpu_devices("h100", 1))


def test_kernel_choice_fallbacks():
    assert kernel_choice.attention_fallback(256) is None
    assert "257 > 256" in kernel_choice.attention_fallback(257)
    assert kernel_choice.norm_fallback(25600) is None and "40000" in kernel_choice.norm_fallback(40000)
    assert kernel_choice.resolve("auto", None, None) == "pallas"  # lowered later, for a GPU as far as is known
    assert kernel_choice.resolve("cudnn", "any", "cpu") == "cudnn"  # an explicit choice is never changed


# The layouts model.scan_layers=null decides over: every parallel feature that runs a collective inside the layers,
# alone, and one device or plain data parallelism without any.
FEATURES = {
    "tensor": {"parallel.tensor": 2},
    "sequence parallel": {"parallel.tensor": 2, "parallel.sequence_parallel": True},
    "pipeline": {"parallel.pipeline": 2},
    "context": {"parallel.context": 2},
    "expert": {"model.num_experts": 4, "parallel.expert": 2},
    "overlapped reduction": {"parallel.overlap_grad_reduce": True},
    "overlapped gather": {"parallel.distributed_optimizer": True, "parallel.overlap_grad_reduce": True,
                          "parallel.overlap_param_gather": True},
    "zero-2": {"parallel.data_parallel_sharding_strategy": "optim_grads"},
    "zero-3": {"parallel.data_parallel_sharding_strategy": "optim_grads_params"},
}
MICRO = {"train.micro_batch_size": 2}
QUIET = {"one device": ({}, 1), "one device, one micro batch": ({"train.micro_batch_size": 8}, 1),
         "data 2": (MICRO, 2), "data 2, distributed optimizer": ({**MICRO, "parallel.distributed_optimizer": True}, 2),
         "MoE on data 2": ({**MICRO, "model.num_experts": 4}, 2)}


def _plan(sets: dict, n: int, platform: str) -> StepPlan:
    return StepPlan.resolve(small_config(**sets).for_devices(n), platform=platform)


@pytest.mark.parametrize("platform", ["gpu", "cpu"])
def test_layers_unroll_on_gpus_where_no_collective_runs_inside_them(platform):
    """model.scan_layers=null over the layouts: unrolled on GPUs for one device and data parallelism over micro
    batches; a loop with any collective inside the layers (each feature alone, and every pair), with the
    data-parallel reduction of a single micro batch's step, and on CPU; true and false are obeyed everywhere."""
    for name, (sets, n) in QUIET.items():
        assert _plan(sets, n, platform).unroll_layers == (platform == "gpu"), name
    assert not _plan({"train.micro_batch_size": 4}, 2, platform).unroll_layers
    for (a, one), (b, other) in itertools.combinations_with_replacement(FEATURES.items(), 2):
        sets = {**one, **other}
        n = 2 * math.prod(sets.get(f"parallel.{axis}", 1) for axis in ("tensor", "pipeline", "context"))
        try:
            _plan(sets, n, platform)
        except ConfigError:  # a pair no layout takes (ZeRO-3 in a pipeline)
            continue
        assert not _plan(sets, n, platform).unroll_layers, (a, b)
        for scan in (True, False):
            assert _plan({**sets, "model.scan_layers": scan}, n, platform).unroll_layers == (not scan), (a, b)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_unrolled_layers_keep_their_recomputation(recompute):
    """Unrolled, each recomputation (jax.checkpoint) prevents CSE: in straight-line code XLA would otherwise merge
    it with the forward it repeats and keep what it was to drop (the SC21 GPT 1.7B on 32 compile-only H100s peaked
    at 172 GiB without, 88 with). In a loop it needs none, and goes without the barriers that costs."""
    def prevent_cse(scan):
        sets = {**BF16, "model.recompute": recompute, "model.attention_impl": "xla", "model.scan_layers": scan}
        jaxpr = _step_jaxpr(small_config(**sets), jax.devices()[:1])[1]
        return [e.params["prevent_cse"] for e in divergence.eqns(jaxpr) if "prevent_cse" in e.params]

    looped, unrolled = prevent_cse(True), prevent_cse(False)
    assert looped and not any(looped)
    assert unrolled and all(unrolled)


@gpu
def test_layers_are_unrolled_in_the_gpu_program_and_looped_with_tensor_parallelism():
    """The traced step on compile-only GPUs: every scan over layers unrolled on one GPU and on data 2; a loop with
    tensor parallelism."""
    def scans(sets, n):
        setup, jaxpr = _step_jaxpr(small_config(**{"model.num_layers": 4, **sets}), audit._gpu_devices("h100", n))
        return [(e.params["length"], e.params["unroll"]) for e in divergence.eqns(jaxpr)
                if e.primitive.name == "scan" and e.params["length"] >= 4]

    for sets, n in (({}, 1), (MICRO, 2)):
        got = scans(sets, n)
        assert got and all(unroll == length for length, unroll in got), got
    got = scans({"parallel.tensor": 2}, 2)
    assert got and all(unroll == 1 for _, unroll in got), got


@gpu
def test_the_h100_program_has_the_fused_kernels_and_no_layer_stack_copies():
    """XLA's compiled H100 program of the defaults on one GPU (4 layers, selective recomputation): the Triton flash
    attention and norm kernels, each layer's attention forward run once, and no loop over layers, so no copies
    into or out of [layers, ...] stacks, which the loop (model.scan_layers=true) has."""
    def program(*extra):
        cfg = small_config(**{"model.arch": "llama", "model.num_layers": 4, **BF16, **dict(extra)})
        _, _, compiled, _ = audit.compile_step(cfg, audit._gpu_devices("h100", 1))
        return compiled.as_text()

    text = program()
    kernels = collections.Counter(re.findall(r'name = \\?"((?:flash_attention|rms_norm)_[a-z]+)', text))
    assert set(kernels) == {"flash_attention_fwd", "flash_attention_dq", "flash_attention_dkv", "rms_norm_fwd",
                            "rms_norm_bwd"}, kernels
    assert kernels["flash_attention_fwd"] == 4
    assert "while(" not in text and "dynamic_slice_fusion" not in text
    looped = program(("model.scan_layers", True))
    assert "while(" in looped and "dynamic_slice_fusion" in looped


def _bench_peers():
    spec = importlib.util.spec_from_file_location("bench_peers", os.path.join(REPO, "scripts", "bench_peers.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("sets", [{}, {"model.arch": "llama", "model.num_heads": 8, "model.num_kv_heads": 2},
                                  {"model.arch": "llama", "model.tie_embeddings": True, "model.num_layers": 3}],
                         ids=["gpt2", "llama-gqa", "llama-tied"])
def test_the_pytorch_peers_have_megajaxs_shape(sets):
    """scripts/bench_peers.py's peers (nanoGPT's GPT, Hugging Face's Llama) built at megajax's shape have its
    parameters, count for count (the script refuses a run where they differ)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from megajax import model

    peers = _bench_peers()
    cfg = small_config(**sets).for_devices(1)
    ours = sum(math.prod(a.shape) for a in jax.tree.leaves(
        jax.eval_shape(lambda: model.init_params(cfg.model, jax.random.key(0)))))
    peer = peers.PEERS[cfg.model.arch][1](peers.shape(cfg))
    assert sum(p.numel() for p in peer.parameters()) == ours


@pytest.mark.slow
def test_bench_peers_times_both_sides_on_cpu(tmp_path):
    """The script as a user runs it (on CPU, the peer eager): a row for each side and the summary."""
    import json
    import subprocess
    import sys

    out = tmp_path / "peers.jsonl"
    subprocess.run([sys.executable, os.path.join(REPO, "scripts", "bench_peers.py"), "--device", "cpu",
                    "--no-compile", "--steps", "2", "--warmup", "1", "--jsonl", str(out), "--set",
                    "model.arch=llama", "train.global_batch_size=4"], check=True, cwd=REPO)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r.get("side") for r in rows] == ["megajax", "peer", None]
    assert rows[0]["params"] == rows[1]["params"] and rows[2]["speedup"] > 0
