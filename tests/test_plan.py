"""The layout planner (`megajax plan`): its predictions against measurements (single-H100 steps within 15%, the
SC21 paper's Table 1 within 20%), its choices against the paper's layouts, the paper's takeaways in its
predictions, the search's space and speed, the CLI (table, --json, --write, fixed keys, HF config.json), and the
written preset training as it is on CPU devices."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from megajax.config import io as config_io
from megajax.model import context
from megajax.plan import checks, cost, layout as layout_lib, memory, search as search_lib
from megajax.plan.__main__ import _label as plan_label, main as plan_main
from megajax.plan.hardware import _H100_KERNELS, _H100_MATMUL, H100_ATTENTION, H100_NORM_BYTES_PER_S, H100_SQUARE_GEMM, hardware

ROOT = Path(REPO)


def test_h100_constants_are_the_measured_rows():
    """The H100's rates in hardware.py are the microbenchmarks' raw rows (benchmarks/h100/), not fitted."""
    matmul = json.loads((ROOT / _H100_MATMUL).read_text())
    square = next(r for r in matmul if r["shape"] == "square 8192")
    assert H100_SQUARE_GEMM["bfloat16"] == pytest.approx(square["bf16_tflops"] * 1e12, rel=1e-4)
    assert H100_SQUARE_GEMM["float8"] == pytest.approx(square["fp8_tflops"] * 1e12, rel=1e-4)
    kernels = json.loads((ROOT / _H100_KERNELS).read_text())
    fused = [r for r in kernels if r.get("op") == "attention" and r.get("impl") in ("pallas", "cudnn")]
    shapes = {(64, 1024): "gpt2-124m", (64, 2048): "llama-1b", (128, 2048): "gpt2-1.3b", (128, 8192): "llama-8k"}
    assert set(H100_ATTENTION) == set(shapes)
    for key, shape in shapes.items():
        assert H100_ATTENTION[key] == pytest.approx(max(r["tflops"] for r in fused if r["shape"] == shape) * 1e12,
                                                    rel=1e-4)
    norms = sorted(r["gb_per_s"] for r in kernels if r.get("op") in ("layer_norm", "rms_norm")
                   and r.get("shape") in ("gpt2-1.3b", "llama-8b"))
    assert H100_NORM_BYTES_PER_S == pytest.approx(1e9 * (norms[3] + norms[4]) / 2, rel=1e-3)
    h100 = hardware("h100")
    assert 2 * 8192**3 / h100.gemm_seconds(8192, 8192, 8192) == pytest.approx(H100_SQUARE_GEMM["bfloat16"])


def test_copies_are_counted_for_looped_layers_only():
    """The layer stacks' copies (a looped layer's saved residuals in and out, its bf16 weights out) are a term of
    megajax's looped layers: none unrolled (model.scan_layers=false, or null on one GPU) or in Megatron's run of the
    layout."""
    hw = hardware("h100")
    sets = ["train.global_batch_size=8", "train.micro_batch_size=4", "parallel.tensor=1",
            "parallel.sequence_parallel=false", "parallel.distributed_optimizer=false"]
    cfg = lambda *more: config_io.load(ROOT / "configs/llama-1b.yaml", sets + list(more)).for_devices(1)  # noqa: E731
    looped = cost.estimate(cfg("model.scan_layers=true"), hw, 8)
    layout = layout_lib.Layout(cfg(), 8)
    saved = memory.layer_activation_bytes(layout)["selective"]
    weights = cost._layer_gemm_operands(layout)[2] * layout_lib.B16
    runs = layout.m * layout.layers
    assert looped.compute_s["copies"] == pytest.approx(runs * (4 * saved + 2 * weights) / hw.hbm_bytes_per_s)
    unrolled = cost.estimate(cfg("model.scan_layers=false"), hw, 8)
    assert unrolled.compute_s["copies"] == 0
    assert looped.step_s - unrolled.step_s == pytest.approx(looped.compute_s["copies"])
    assert cost.estimate(cfg(), hw, 8, framework="megatron").compute_s["copies"] == 0
    # model.scan_layers=null unrolls on one GPU (StepPlan.unroll_layers), and loops where collectives run inside the
    # layers: tensor parallelism here
    assert cost.estimate(cfg(), hw, 8).compute_s["copies"] == 0
    tensor2 = config_io.load(ROOT / "configs/llama-1b.yaml", ["train.global_batch_size=8", "train.micro_batch_size=4"])
    assert cost.estimate(tensor2.for_devices(2), hw, 8).compute_s["copies"] > 0
    # a pipeline's first forward saves nothing: the stacks are filled by the recompute before each backward; full
    # recomputation without a pipeline rebuilds a layer's residuals inside its backward, in no stack
    piped = lambda *more: config_io.load(ROOT / "configs/llama-1b.yaml", [  # noqa: E731
        "train.global_batch_size=16", "train.micro_batch_size=4", "parallel.tensor=1", "parallel.pipeline=2",
        "parallel.sequence_parallel=false", "parallel.distributed_optimizer=false", *more]).for_devices(2)
    looped, unrolled = cost.estimate(piped(), hw, 8), cost.estimate(piped("model.scan_layers=false"), hw, 8)
    layout = layout_lib.Layout(piped(), 8)
    forward_copies = 2 * memory.layer_activation_bytes(layout)["selective"] / hw.hbm_bytes_per_s
    runs = layout.m * layout.layers
    assert looped.compute_s["recompute"] - unrolled.compute_s["recompute"] == pytest.approx(runs * forward_copies)
    full = [cost.estimate(cfg("model.recompute=full", f"model.scan_layers={s}"), hw, 8) for s in ("true", "false")]
    assert full[0].compute_s["recompute"] == pytest.approx(full[1].compute_s["recompute"])


def test_fp8_casts_and_gradient_accumulation():
    """FP8's casts cost 7 bytes per element of each GEMM input, weight and output gradient, forward and backward
    together; the micro batches' gradient sum 12 bytes per parameter and micro batch, none with one micro batch or
    in Megatron's run (fused into the weight-gradient GEMM)."""
    hw = hardware("h100")
    sets = ["train.micro_batch_size=4", "parallel.tensor=1", "parallel.sequence_parallel=false",
            "parallel.distributed_optimizer=false"]
    cfg = lambda *more: config_io.load(ROOT / "configs/llama-1b.yaml", sets + list(more)).for_devices(1)  # noqa: E731
    bf16, fp8 = (cost.estimate(cfg("train.global_batch_size=8", f"model.fp8={f}"), hw, 8) for f in ("none", "hybrid"))
    assert bf16.compute_s["fp8_casts"] == 0
    layout = layout_lib.Layout(cfg("train.global_batch_size=8", "model.fp8=hybrid"), 8)
    x, dy, w = cost._layer_gemm_operands(layout)
    runs = layout.m * layout.layers
    assert fp8.compute_s["fp8_casts"] == pytest.approx(runs * 7 * (x + dy + w) / hw.elementwise_bytes_per_s)
    params = layout_lib.local_parameters(layout)["total"]
    assert bf16.compute_s["grad_accumulation"] == pytest.approx(2 * 12 * params / hw.elementwise_bytes_per_s)
    assert cost.estimate(cfg("train.global_batch_size=4"), hw, 8).compute_s["grad_accumulation"] == 0
    megatron = cost.estimate(cfg("train.global_batch_size=8"), hw, 8, framework="megatron")
    assert megatron.compute_s["grad_accumulation"] == 0


def test_attention_rate_between_measured_sequences():
    """The fused attention's rate at a measured (head dim, sequence) is the measurement; between two measured
    sequences it runs along log2(seq); outside them it is the nearest; a head dim takes the nearest measured."""
    hw = hardware("h100")
    assert hw.attention_rate(64, 1024) == H100_ATTENTION[(64, 1024)]
    assert hw.attention_rate(128, 4096) == pytest.approx((H100_ATTENTION[(128, 2048)] + H100_ATTENTION[(128, 8192)])
                                                         / 2)
    assert hw.attention_rate(64, 512) == H100_ATTENTION[(64, 1024)]
    assert hw.attention_rate(64, 32768) == H100_ATTENTION[(64, 2048)]
    assert hw.attention_rate(96, 2048) in (H100_ATTENTION[(64, 2048)], H100_ATTENTION[(128, 2048)])
    assert hw.attention_rate(192, 8192) == H100_ATTENTION[(128, 8192)]


def test_gemm_waves_and_batching():
    """A GEMM with one tile more than a wave takes two waves; a batch of GEMMs shares its waves."""
    hw = hardware("h100")
    one_wave = hw.gemm_seconds(128 * 132, 16384, 256)  # compute-bound (at k = 4096 its operands' reading is longer)
    assert hw.gemm_seconds(128 * 133, 16384, 256) == pytest.approx(2 * one_wave, rel=0.02)
    # 32 tiles each: one GEMM fills a quarter of a wave, a batch of four the same one wave
    assert hw.gemm_seconds(1024, 16384, 1024, batch=4) == pytest.approx(hw.gemm_seconds(1024, 16384, 1024), rel=0.02)


def test_single_h100_steps_within_15_percent():
    """Every single-H100 train step of the newest GPU session (checks.STEPS: xla, Pallas and cuDNN attention,
    recompute modes, FP8) predicted within 15%."""
    rows = checks.h100_steps()
    assert len(rows) == 9
    bad = [(r["label"], round(r["error"], 3)) for r in rows if abs(r["error"]) > 0.15]
    assert not bad, bad


def test_paper_table1_within_the_a100_error():
    """Each of the paper's ten Table 1 runs (A100s, the paper's layout, micro batch and interleaving, Megatron's
    default dropout) predicted within the A100's stated error of its measured TFLOP/s per GPU, some fast and some
    slow (the A100's GEMM rate is fitted to these runs: hardware.A100_GEMM_CALIBRATION)."""
    rows = checks.table1()
    assert len(rows) == 10
    assert {r["error"] > 0 for r in rows} == {True, False}, rows
    bad = [(r["config"], round(r["error"], 3)) for r in rows if abs(r["error"]) > checks.ERROR["a100"]]
    assert not bad, bad


def test_the_a100_gemm_rate_is_the_fit_to_table1():
    """hardware.A100_GEMM_CALIBRATION is the factor that centres the Table 1 predictions (geometric-mean error
    zero), fitted again here."""
    from megajax.plan.hardware import A100_GEMM_CALIBRATION

    assert checks.a100_calibration() == pytest.approx(A100_GEMM_CALIBRATION, abs=0.002)


# The Table 1 rows where the planner, in the paper's feature space and at the paper's data-parallel size, picks
# another (tensor, pipeline) and predicts more than 5% over the paper's: without sequence parallelism or overlap
# (Megatron of 2021), tensor 8's six all-reduces per layer and micro batch, and its replicated norms and residuals,
# cost more than pipeline stages kept inside the node (NVLink sends, an interleaved bubble below 4%). Table 1 grows
# tensor parallelism first by the paper's own rule; these layouts were never measured.
DIFFERS = {"configs/paper/gpt-18b.yaml", "configs/paper/gpt-39b.yaml"}


def test_planner_choice_against_the_paper():
    """In the paper's feature space the planner picks the paper's (t, p), or a layout predicted within 5% of the
    paper's; in the rows of DIFFERS (docs/guides/choosing-a-layout.md says why) a smaller tensor size, more than
    5% ahead."""
    for c in checks.choices():
        gain = c["speedup_over_paper"] - 1
        assert gain >= -0.003, c  # the paper's layout is in the space: never predicted slower (ties: 0.2%)
        if c["config"] in DIFFERS:
            t, p = c["chosen"]
            assert (t, p) != c["paper"] and gain > 0.05 and t < c["paper"][0], c
        else:
            assert c["chosen"] == c["paper"] or gain <= 0.05, c


def test_paper_sweeps_hold_in_the_predictions():
    """The paper's section 5.4-5.5 sweeps on 64 A100s, as the model predicts them: (t, p) = (8, 8) is the best of
    t x p = 64 (Fig. 13), throughput falls as the pipeline (Fig. 14) or the tensor size (Fig. 15) takes GPUs from
    data parallelism, and micro batch 2 is the best for the 91B model (Fig. 16, within 1%)."""
    figs = checks.figures()
    for batch in (32, 128):
        rows = [r for r in figs["13"]["rows"] if r["batch"] == batch]
        assert max(rows, key=lambda r: r["tflops_per_gpu"])["tensor"] == 8
    for fig, key in (("14", "pipeline"), ("15", "tensor")):
        for batch in {r["batch"] for r in figs[fig]["rows"]}:
            rates = [r["tflops_per_gpu"] for r in sorted(figs[fig]["rows"], key=lambda r: r[key]) if r["batch"] == batch]
            assert all(a > b for a, b in zip(rates, rates[1:])), (fig, batch, rates)
    for batch in (128, 512):
        rows = {r["micro_batch_size"]: r["tflops_per_gpu"] for r in figs["16"]["rows"] if r["batch"] == batch}
        assert rows[2] >= 0.99 * max(rows.values()) and rows[2] > rows[4] > rows[8], rows


def test_takeaway_tensor_parallelism_leaves_the_node():
    """At a fixed GPU count, the best predicted step grows as tensor parallelism goes past the 8 GPUs of a node."""
    for config, gpus in (("configs/paper/gpt-145b.yaml", 1536), ("configs/paper/gpt-1t.yaml", 3072)):
        by_t = checks.takeaways(config, gpus)["tensor"]
        steps = [by_t[t] for t in (8, 16, 32) if t in by_t]
        assert len(steps) == 3 and steps[0] < steps[1] < steps[2], by_t


def test_takeaway_pipeline_past_what_memory_needs():
    """At tensor 8, pipeline stages beyond the fewest that fit make the predicted step slower."""
    by_p = checks.takeaways("configs/paper/gpt-1t.yaml", 3072)["pipeline"]
    fewest = min(by_p)
    more = [p for p in sorted(by_p) if p >= 2 * fewest]
    steps = [by_p[p] for p in [fewest, *more]]
    assert len(steps) >= 3 and all(a < b for a, b in zip(steps[1:], steps[2:])), by_p
    assert by_p[max(by_p)] > by_p[fewest]


def test_search_space_enumerated():
    """The search holds every tensor size that divides the heads (up to 4 nodes), every pipeline size that splits
    the layers (evenly, by Megatron's accounting, or with a first and last stage), interleaving, micro batches,
    recompute modes, ZeRO-1 and FSDP, the overlaps; fixed keys stay fixed."""
    base = config_io.load(ROOT / "configs/llama3.1-405b.yaml")
    rows = search_lib.layouts(base, 1024, 8, {})
    seen = lambda key: {r[key] for r in rows}  # noqa: E731
    assert seen("parallel.tensor") == {1, 2, 4, 8}  # (8 key-value heads)
    assert {16, 8, 2}.issubset(seen("parallel.pipeline"))
    assert seen("model.recompute") == {"none", "selective", "full"}
    assert seen("parallel.data_parallel_sharding_strategy") >= {"optim", "optim_grads_params"}
    assert seen("parallel.schedule") == {"1f1b", "interleaved", "zero_bubble"}
    assert {True, False} <= seen("parallel.tp_comm_overlap")
    # the split backward on 1F1B's table and the interleaved ones, uneven stages included; it reduces in B and W,
    # not in the overlapped reduction's ticks
    zb = [r for r in rows if r["parallel.schedule"] == "zero_bubble"]
    assert {r["parallel.virtual_stages"] for r in zb} == {r["parallel.virtual_stages"] for r in rows
                                                           if r["parallel.pipeline"] > 1}
    assert any(r["parallel.decoder_first_pipeline_num_layers"] for r in zb)
    assert not any(r["parallel.overlap_grad_reduce"] for r in zb)
    p16 = [r for r in rows if r["parallel.pipeline"] == 16]
    assert all(r["parallel.account_for_embedding_in_pipeline_split"] or
               r["parallel.decoder_first_pipeline_num_layers"] for r in p16)  # 126 layers: no even split
    fixed = search_lib.layouts(base, 1024, 8, {"parallel.tensor": 8, "parallel.pipeline": 16})
    assert {(r["parallel.tensor"], r["parallel.pipeline"]) for r in fixed} == {(8, 16)}
    # hybrid sharding: one instance a node where the data ranks span nodes (tensor 1 x pipeline 1: 128 of 8)
    flat = [r for r in rows if (r["parallel.tensor"], r["parallel.pipeline"]) == (1, 1)]
    assert {r["parallel.num_distributed_optimizer_instances"] for r in flat} == {1, 128}
    assert {r["parallel.num_distributed_optimizer_instances"] for r in rows if r["parallel.tensor"] == 8} == {1}
    # context parallelism (8192-token sequences) by its auto exchange or the all-to-alls
    # (hierarchical: all-to-alls in groups of a node's context ranks, 8 / tensor of them at most, a ring across
    # them without a pipeline, an all-gather with one)
    cp = [r for r in rows if r["parallel.context"] > 1]
    assert {r["parallel.context_comm"] for r in cp} == {"auto", "a2a", "a2a+ring", "a2a+all_gather"}
    assert {r["parallel.context_comm"] for r in cp if r["parallel.pipeline"] > 1} == {"auto", "a2a", "a2a+all_gather"}
    assert {r["parallel.context_comm"] for r in cp if r["parallel.pipeline"] == 1} == {"auto", "a2a", "a2a+ring"}
    hierarchical = [r for r in cp if r["parallel.context_comm"].startswith("a2a+")]
    assert all(1 < r["parallel.context_a2a_size"] < r["parallel.context"] and
               r["parallel.context_a2a_size"] * r["parallel.tensor"] <= 8 for r in hierarchical)
    assert all(r["parallel.context_a2a_size"] is None for r in rows
               if not r["parallel.context_comm"].startswith("a2a+"))
    assert {r["parallel.context_comm"] for r in rows if r["parallel.context"] == 1} == {"auto"}


def test_all_to_all_attention_is_counted_exposed():
    """The a2a exchange moves (c - 1) / c of the queries, keys, values and output each way and nothing hides it
    (attention waits for it); the ring's c - 1 hops of the keys and values hide under attention."""
    hw = hardware("h100")
    base = config_io.load(ROOT / "configs/llama3.2-1b-long.yaml")
    step = lambda comm: cost.estimate(search_lib.configure(base, {  # noqa: E731
        "parallel.context": 4, "parallel.data": 2, "parallel.tensor": 1, "parallel.sequence_parallel": False,
        "parallel.tp_comm_overlap": False, "parallel.context_comm": comm}, 8), hw, 8)
    ring, a2a = step("ring"), step("a2a")
    m = base.model
    layout = layout_lib.Layout(search_lib.configure(base, {"parallel.context": 4, "parallel.data": 2, "parallel.tensor": 1,
                                                      "parallel.sequence_parallel": False,
                                                      "parallel.tp_comm_overlap": False,
                                                      "parallel.context_comm": "a2a"}, 8), 8)
    moved = layout.tokens * m.head_dim * 2 * 2 * (m.num_heads + m.kv_heads) * 3 / 4
    assert cost._context_comm_s(hw, layout) == pytest.approx((moved / hw.nvlink_bus_bytes_per_s, 0))
    assert a2a.exposed_s["context"] > 0 and a2a.exposed_s["context"] != ring.exposed_s["context"]


def test_hierarchical_context_keeps_the_all_to_alls_in_a_node():
    """Context 16 over two nodes: a2a+ring's all-to-alls run inside each node's 8 ranks on NVLink, and its ring of
    2 passes a node's keys and values (8 times the tokens, 1 / 8 of the heads) once across the network, under the
    attention blocks; the flat all-to-all sends every GPU's off-node rows through its own NIC, exposed."""
    hw = hardware("h100")
    base = config_io.load(ROOT / "configs/llama3.2-1b-long.yaml", ["model.seq_length=131072"])
    sets = {"parallel.context": 16, "parallel.data": 1, "parallel.tensor": 1, "parallel.sequence_parallel": False,
            "parallel.tp_comm_overlap": False, "train.global_batch_size": 4}
    layout = lambda comm: layout_lib.Layout(search_lib.configure(  # noqa: E731
        base, {**sets, "parallel.context_comm": comm}, 16), 8)
    both = layout("a2a+ring")
    assert both.plan.context_a2a == 8  # (null: the largest group a node holds)
    m = base.model
    moved = both.tokens * m.head_dim * 2 * 2 * (m.num_heads + m.kv_heads) * 7 / 8
    kv = 2 * both.tokens * m.kv_heads * m.head_dim * 2
    assert cost._context_comm_s(hw, both) == pytest.approx((moved / hw.nvlink_bus_bytes_per_s,
                                                            kv / hw.network_bytes_per_s))
    step = lambda comm: cost.estimate(search_lib.configure(  # noqa: E731
        base, {**sets, "parallel.context_comm": comm}, 16), hw, 8).exposed_s["context"]
    # (the flat all-to-all's 15 / 16 of the bytes leave half of them through each GPU's NIC; at this length the
    # plain ring hides under attention too)
    assert step("a2a+ring") < step("a2a") / 5


def test_context_under_a_pipeline_the_all_gathers_exposure():
    """With a pipeline (no ring: its permutes in the schedule's branches), context 16 over two nodes: the flat
    all-gather gathers its head parts each under the part before, so only the first part's gather (1 / 4 of the
    bytes: 8 key-value heads) waits; a2a+all_gather keeps its all-to-alls in the node and gathers the other node's
    keys and values for 1 / 8 of the heads (the ring's bytes) whole, nothing under them (the compiled H100
    programs: benchmarks/2026-12-07-compile-only-context-all-gather-by-head-parts.md)."""
    hw = hardware("h100")
    base = config_io.load(ROOT / "configs/llama3.2-1b-long.yaml", ["model.seq_length=131072"])
    sets = {"parallel.context": 16, "parallel.data": 1, "parallel.pipeline": 2, "parallel.tensor": 1,
            "parallel.sequence_parallel": False, "parallel.tp_comm_overlap": False, "train.global_batch_size": 8}
    configure = lambda comm: search_lib.configure(base, {**sets, "parallel.context_comm": comm}, 32)  # noqa: E731
    exposed = lambda comm: cost.estimate(configure(comm), hw, 8).exposed_s["context"]  # noqa: E731
    m = base.model
    flat, both = (layout_lib.Layout(configure(comm), 8) for comm in ("all_gather", "a2a+all_gather"))
    layers = sum(flat.plan.stage_split.layers) // flat.pp * flat.m
    assert both.plan.context_a2a == 8 and context.head_parts(m.kv_heads, 1) == 4
    kv = 2 * both.tokens * m.kv_heads * m.head_dim * 2
    a2a, cross = cost._context_comm_s(hw, both)
    assert cross == pytest.approx(kv / hw.network_bytes_per_s)
    assert exposed("a2a+all_gather") >= layers * (2 * a2a + 3 * cross) * 0.99
    first = cost._context_comm_s(hw, flat)[1] / 4
    assert exposed("all_gather") == pytest.approx(layers * 2 * first, rel=0.01)
    assert exposed("all_gather") < exposed("a2a+all_gather") < exposed("a2a")


def test_hybrid_sharding_trades_memory_for_the_network():
    """FSDP over 32 H100s (4 nodes), tensor 2: one instance a node shards over its 4 data ranks, not 16 (4 times the
    optimizer state a GPU); its gathers and scatters run on NVLink, where the flat rings cross nodes on the 4 NICs
    of a node's data ranks (half the rate), and the instances all-reduce the gradient shards once a step, after
    the micro batches (exposed)."""
    base = config_io.load(ROOT / "configs/llama3-8b.yaml", [
        "parallel.tensor=2", "parallel.data=16", "parallel.tp_comm_overlap=false", "parallel.overlap_grad_reduce=false",
        "parallel.overlap_param_gather=false", "model.num_layers=16", "train.global_batch_size=128",
        "parallel.data_parallel_sharding_strategy=optim_grads_params"])
    hw = hardware("h100")
    cfgs = [search_lib.configure(base, {"parallel.num_distributed_optimizer_instances": r}, 32) for r in (1, 4)]
    flat, hybrid = (cost.estimate(c, hw, 8) for c in cfgs)
    assert hybrid.memory["optimizer"] == pytest.approx(4 * flat.memory["optimizer"])
    (step_flat, _, micro_flat), (step_hybrid, _, micro_hybrid) = (
        cost._data_comm_s(hw, layout, layout_lib.local_parameters(layout)) for layout in (layout_lib.Layout(c, 8) for c in cfgs))
    assert micro_hybrid < micro_flat / 2  # NVLink, not 4 NICs
    assert step_flat == 0 < step_hybrid
    assert hybrid.exposed_s["data"] >= step_hybrid  # (the instances' all-reduce, after the micro batches)


def test_a_layout_that_fits_only_with_the_tables_split_is_found():
    """Llama 3 8B on 8 H100s at data 4 x pipeline 2: null's rule keeps the embedding and output layer whole (80.7 GiB,
    too big); the search tries them split over the pipeline ranks, which fits, and says so in the settings (and the
    label). Held whole (--set parallel.vocab_over_pipeline=false), the layout stays too big."""
    base = config_io.load(ROOT / "configs/llama3-8b.yaml")
    hw = hardware("h100")
    fixed = {"parallel.data": 4, "parallel.pipeline": 2, "parallel.tensor": 1, "parallel.context": 1,
             "parallel.expert": 1, "parallel.schedule": "1f1b", "train.micro_batch_size": 1,
             "model.recompute": "selective", "parallel.data_parallel_sharding_strategy": "optim",
             "parallel.overlap_grad_reduce": False, "parallel.num_distributed_optimizer_instances": 1}
    found = search_lib.search(base, hw, 8, 8, fixed)
    (best,) = found["ranked"]
    assert best.settings["parallel.vocab_over_pipeline"] is True and best.cfg.parallel.vocab_over_pipeline is True
    assert "vp" in plan_label(best.settings).split()
    held = search_lib.search(base, hw, 8, 8, {**fixed, "parallel.vocab_over_pipeline": False})
    assert held["ranked"] == [] and held["too_big"][0].memory_gib > best.memory_gib + 8


@pytest.mark.parametrize("tables", ["split", "whole"])
def test_a_pipeline_rank_holds_the_dense_first_layers_and_its_experts_state_by_their_replicas(tables):
    """DeepSeek-V3 in DeepSeek's layout on 2048 H100s (pipeline 16, experts over 64, ZeRO-1): in one SPMD program
    every pipeline rank holds the 3 dense first layers and its chunk's 4 layer slots, and ZeRO shards an expert's
    AdamW state over the 2 data ranks that replicate it, not all 128. The model's weights and optimizer state a GPU
    against the compiled program's (benchmarks/2026-12-06-compile-only-vocab-collectives.md)."""
    sets = ["parallel.data=128", "parallel.expert=64", "parallel.pipeline=16", "parallel.tensor=1",
            "parallel.expert_tensor=null", "parallel.sequence_parallel=false", "parallel.tp_comm_overlap=false",
            "parallel.data_parallel_sharding_strategy=optim", "parallel.decoder_first_pipeline_num_layers=4",
            "parallel.decoder_last_pipeline_num_layers=1", "train.micro_batch_size=1", "model.recompute=selective",
            "train.global_batch_size=6144", f"parallel.vocab_over_pipeline={tables == 'split'}".lower()]
    cfg = config_io.load(ROOT / "configs/deepseek-v3.yaml", sets).for_devices(2048)
    est = cost.estimate(cfg, hardware("h100"), 8)
    name = "deepseek-v3-deepseek-layout-2048" + ("-whole" if tables == "whole" else "")
    compiled = json.loads((ROOT / f"benchmarks/compile-only/2026-12-06-vocab-collectives/{name}.json").read_text())
    params = layout_lib.local_parameters(layout_lib.Layout(cfg, 8))["total"]
    assert 4 * params == pytest.approx(compiled["parameter_bytes_per_device"], rel=0.04)
    assert est.memory["optimizer"] == pytest.approx(compiled["optimizer_state_bytes_per_device"], rel=0.01)


def test_plans_the_1t_model_on_3072_gpus_fast():
    """The whole search for the paper's 1T model on 3,072 A100s (the model alone) takes seconds."""
    base = config_io.load(ROOT / "configs/paper/gpt-1t.yaml")
    result = search_lib.search(base, hardware("a100"), 3072, 8, {})
    assert result["ranked"] and result["counted"]["layouts"] > 1000
    assert result["seconds"] < 60


@pytest.mark.parametrize("preset,gpus", [("tiny", 8), ("tiny-moe", 8), ("gpt2-124m", 8), ("gpt2-1.3b", 64),
                                         ("llama-1b", 8), ("llama3.2-1b", 8), ("llama3.2-1b-long", 8),
                                         ("llama3-8b", 8), ("llama3-70b", 64), ("mixtral-8x7b", 64),
                                         ("llama3.1-405b", 1024), ("deepseek-v3", 1024)])
def test_plan_answers_for_every_preset(preset, gpus, capsys):
    """`megajax plan` ranks layouts for every preset at its GPU count (the model alone)."""
    assert plan_main(["--config", f"configs/{preset}.yaml", "--target", "h100", "--gpus", str(gpus),
                      "--compile", "0", "--json", "-"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows and all(r["fits"] for r in rows[:5])
    best = rows[0]
    s = best["settings"]
    assert s["parallel.data"] * s["parallel.pipeline"] * s["parallel.tensor"] * s["parallel.context"] == gpus
    assert best["predicted_step_s"] > 0 and best["memory_gib_per_gpu"] < 80


TABLE1 = json.loads((ROOT / "benchmarks/sc21-table1.json").read_text())["rows"]
# the CLI on three of the ten rows by default (the planner's choices on all ten: test_planner_choice_against_the_paper);
# -m slow runs the rest (20 s)
TABLE1_DEFAULT = {"configs/paper/gpt-1.7b.yaml", "configs/paper/gpt-76b.yaml", "configs/paper/gpt-530b.yaml"}


@pytest.mark.parametrize("row", [pytest.param(r, marks=[] if r["config"] in TABLE1_DEFAULT else [pytest.mark.slow])
                                 for r in TABLE1], ids=[Path(r["config"]).stem for r in TABLE1])
def test_paper_models_answer_on_a100(row, capsys):
    assert plan_main(["--config", row["config"], "--target", "a100", "--gpus", str(row["gpus"]),
                      "--compile", "0", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count("best: ") == 1
    assert out.count("layout: d data, p pipeline, t tensor") == 1  # the table's legend
    assert "is not a multiple of" not in out


@pytest.mark.parametrize("flags", [["--gpus", "0"], ["--gpus", "8", "--gpus-per-node", "0"]])
def test_a_gpu_count_below_one_is_named(flags, capsys):
    assert plan_main(["--config", "configs/tiny.yaml", "--target", "h100", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the count must be 1 or more" in err[0] and flags[-2] in err[0], err


def test_an_odd_gpu_count_is_named(capsys):
    assert plan_main(["--config", "configs/llama3-8b.yaml", "--target", "h100", "--gpus", "7", "--compile", "0"]) == 0
    out = capsys.readouterr().out
    assert "note: 7 GPUs is not a multiple of 8 a node" in out
    assert "the config's own layout does not run on this many GPUs" in out  # (the preset's is for 8)


def test_the_config_s_own_layout_is_placed_against_the_best(capsys):
    """The planner says where the preset's own layout stands: its predicted step against the best's."""
    assert plan_main(["--config", "configs/llama3-8b.yaml", "--target", "h100", "--gpus", "8", "--compile", "0"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("the config's own layout"))
    assert "(d2 p1 t4 sp tpo ogr zero1, mb 1, recompute selective)" in line and "against the best" in line
    # a preset whose data size is null (what the other axes leave) is labelled with the size it takes
    assert plan_main(["--config", "configs/gpt2-1.3b.yaml", "--target", "h100", "--gpus", "64", "--compile", "0"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("the config's own layout"))
    assert "(d32 p1 t2 sp zero1, mb 4, recompute selective)" in line


def test_every_key_fixed_scores_that_layout(capsys):
    """With every layout key fixed the planner scores that one layout: the paper's 1T layout as Table 1 ran it."""
    sets = ["parallel.tensor=8", "parallel.pipeline=64", "parallel.data=6", "parallel.schedule=1f1b",
            "parallel.virtual_stages=1", "train.micro_batch_size=1", *[f"{k}={json.dumps(v)}" for k, v in
                                                                      checks.PAPER_SPACE.items()
                                                                      if k != "parallel.schedule"]]
    assert plan_main(["--config", "configs/paper/gpt-1t.yaml", "--target", "a100", "--gpus", "3072",
                      "--compile", "0", "--json", "-", "--set", *sets]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert len(rows) == 1
    paper = cost.estimate(config_io.load(ROOT / "configs/paper/gpt-1t.yaml").for_devices(3072), hardware("a100"), 8)
    assert rows[0]["predicted_step_s"] == pytest.approx(paper.step_s)
    assert rows[0]["fits"] and rows[0]["parallel"]["pipeline"] == 64


def test_json_rows_and_nothing_fits(tmp_path, capsys):
    assert plan_main(["--config", "configs/llama3-8b.yaml", "--target", "h100", "--gpus", "8", "--compile", "0",
                      "--json", str(tmp_path / "plan.json")]) == 0
    rows = json.loads((tmp_path / "plan.json").read_text())["rows"]
    need = {"settings", "parallel", "micro_batch_size", "predicted_step_s", "tflops_per_gpu", "memory_gib_per_gpu",
            "fits", "mfu", "bubble_fraction", "exposed_comm_s"}
    assert need <= set(rows[0]) and rows == sorted(rows, key=lambda r: r["rank"])
    assert "why" not in capsys.readouterr().err
    assert plan_main(["--config", "configs/llama3.1-405b.yaml", "--target", "h100", "--gpus", "8",
                      "--compile", "0"]) == 1
    err = capsys.readouterr().err
    assert "no layout" in err and "add GPUs" in err


def test_hf_config_json(tmp_path, capsys):
    """A Hugging Face config.json (the folder or the file) plans like the preset it converts to."""
    from megajax.hf.configs import hf_config_from_model

    model = config_io.load(ROOT / "configs/llama-1b.yaml").model
    (tmp_path / "config.json").write_text(json.dumps(hf_config_from_model(model)))
    for path in (tmp_path, tmp_path / "config.json"):
        assert plan_main(["--config", str(path), "--target", "h100", "--gpus", "8", "--global-batch", "64",
                          "--seq-length", "2048", "--compile", "0", "--json", "-"]) == 0
        rows = json.loads(capsys.readouterr().out)["rows"]
        assert rows[0]["fits"]


@pytest.mark.slow  # suite time (15 s; test_hf's written preset trains by default)
def test_written_preset_trains_as_it_is(tmp_path, capsys):
    """--write gives a preset with every searched key set; it loads, equals the winner, and trains on the 8 CPU
    devices as it is."""
    out = tmp_path / "planned.yaml"
    assert plan_main(["--config", "configs/tiny.yaml", "--target", "h100", "--gpus", "8", "--compile", "0",
                      "--json", "-", "--write", str(out)]) == 0
    best = json.loads(capsys.readouterr().out)["rows"][0]
    text = out.read_text()
    assert text.startswith("# Planned by: python -m megajax.plan")
    cfg = config_io.load(out)
    raw = yaml.safe_load(text)
    for key, value in best["settings"].items():
        section, name = key.split(".")
        assert raw[section][name] == value and getattr(getattr(cfg, section), name) == value
    from megajax import train

    assert train.main(["--config", str(out), "--set", "train.steps=2", f"train.output_dir={tmp_path / 'run'}",
                       "train.log_every=1"]) in (0, None)
    assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_memory_terms():
    """The analytical memory: the distributed optimizer shards AdamW over the data ranks, FSDP the weights too,
    full recomputation keeps less than none; every term is positive."""
    base = config_io.load(ROOT / "configs/llama3-8b.yaml")
    hw = hardware("h100")
    mem = lambda **kw: cost.estimate(search_lib.configure(base, {**{  # noqa: E731
        "parallel.data": 8, "parallel.tensor": 1, "parallel.sequence_parallel": False,
        "parallel.tp_comm_overlap": False}, **kw}, 8), hw, 8).memory
    shard = "parallel.data_parallel_sharding_strategy"
    zero0 = mem(**{shard: "no_shard", "parallel.overlap_grad_reduce": False, "parallel.overlap_param_gather": False})
    zero1 = mem(**{shard: "optim", "parallel.overlap_param_gather": False})
    gathered = mem(**{shard: "optim", "parallel.overlap_grad_reduce": True, "parallel.overlap_param_gather": True})
    fsdp = mem(**{"parallel.data_parallel_sharding_strategy": "optim_grads_params"})
    assert zero1["optimizer"] == pytest.approx(zero0["optimizer"] / 8)
    assert fsdp["weights"] < gathered["weights"] < zero1["weights"]  # fp32 shards; with the bf16 casts whole
    assert fsdp["weights"] < zero1["weights"] / 4
    assert fsdp["gradients"] < zero1["gradients"] / 2  # (the embedding's and output layer's stay whole)
    full = mem(**{"model.recompute": "full"})
    none = mem(**{"model.recompute": "none"})
    assert full["activations"] < none["activations"]
    assert all(v > 0 and math.isfinite(v) for v in zero1.values())


def test_the_scheduling_limit_is_xlas():
    """XLA's GPU scheduling limit, 0.95 x (0.8 x the device's memory - the program's inputs and outputs) + those
    (memory.scheduling_limit): on the 32-layer Llama 3 8B ZeRO-3 program it is the 60.67 GiB of XLA's own warning, "Can't
    reduce memory use below 60.67GiB by rematerialization" (benchmarks/2026-11-26-compile-only-fsdp-after-keeps-
    inputs.md; that program now sits at the limit, benchmarks/2026-11-29-compile-only-fsdp-embedding.md). For every
    compiled row the model's inputs (fp32 weights and AdamW moments) are XLA's, and the model
    puts the program on XLA's side of the limit: Llama 3 70B on 2 stages (67.4 GiB compiled) only since it counts
    the bf16 weights a pipeline with overlap_param_gather holds gathered (benchmarks/2026-11-27-compile-only-
    pipeline-backward-in-place.md)."""
    rows = checks.compiled_memory()
    assert len(rows) == len(checks.COMPILED)
    zero3 = next(r for r in rows if r["row"] == "llama3-8b-32layers-zero3")
    assert zero3["xla_limit_gib"] == pytest.approx(60.67, abs=0.005)
    for r in rows:
        assert r["model_limit_gib"] == pytest.approx(r["xla_limit_gib"], rel=0.002), r
        assert r["model_scheduled_for_memory"] == r["xla_scheduled_for_memory"], r


def test_above_the_scheduling_limit_nothing_is_hidden():
    """A program above XLA's scheduling limit is counted without overlap: Llama 3 8B at tensor 2 (78.8 GiB
    compiled) is as fast with tp_comm_overlap as without, and ZeRO-3's gathers are all exposed (Llama 3 70B on 64
    GPUs at micro batch 2, 72.2 GiB compiled, nothing under the GEMMs); at tensor 8 (24.8 GiB) the rings hide under
    the GEMMs."""
    hw = hardware("h100")
    config = lambda *sets: config_io.load(ROOT / "configs/llama3-8b.yaml", list(sets)).for_devices(8)  # noqa: E731
    step = lambda *sets: cost.estimate(config(*sets), hw, 8)  # noqa: E731
    packed = [step("parallel.tensor=2", "parallel.data=4", f"parallel.tp_comm_overlap={on}") for on in (True, False)]
    assert all(e.scheduled_for_memory for e in packed)
    assert packed[0].exposed_s["tensor"] == pytest.approx(packed[1].exposed_s["tensor"])
    below = [step("parallel.tensor=8", "parallel.data=1", f"parallel.tp_comm_overlap={on}") for on in (True, False)]
    assert not any(e.scheduled_for_memory for e in below)
    assert below[0].exposed_s["tensor"] < below[1].exposed_s["tensor"] / 2
    cfg = config_io.load(ROOT / "configs/llama3-70b.yaml", checks._FSDP_70B + ["train.micro_batch_size=2"]
                         ).for_devices(64)
    zero3 = cost.estimate(cfg, hw, 8)
    assert zero3.scheduled_for_memory
    layout = layout_lib.Layout(cfg, 8)
    per_micro = cost._data_comm_s(hw, layout, layout_lib.local_parameters(layout))[2]
    assert zero3.exposed_s["data"] == pytest.approx(cfg.num_micro_batches * per_micro)


# (preset, --set): the layer kinds whose kept activations the model counts: GeLU and SwiGLU MLPs, grouped-query
# attention, and MoE layers with a capacity and dropless.
LAYER_KINDS = [("gpt2-1.3b", []), ("llama3-70b", ["parallel.schedule=1f1b", "parallel.virtual_stages=1"]),
               ("mixtral-8x7b", []), ("mixtral-8x7b", ["model.moe_capacity_factor=null"])]


@pytest.mark.parametrize("preset,sets", LAYER_KINDS, ids=["gpt2", "llama", "moe-capacity", "moe-dropless"])
def test_layer_activations_are_what_the_backward_keeps(preset, sets):
    """`memory.layer_activation_bytes` against the residuals JAX keeps for one layer's backward (its vjp's saved
    values less the layer's weights), for each attention and norm kernel and each recompute mode, at one GPU.
    Nothing is computed: the layer is traced on abstract values."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from megajax.model import gpt

    for impl in ("xla", "pallas"):
        for mode in ("none", "selective"):
            # 640 tokens: no activation has a weight's size, which is how weights are told apart below
            cfg = config_io.load(ROOT / f"configs/{preset}.yaml", [
                *sets, f"model.attention_impl={impl}", f"model.norm_impl={impl}", "model.num_layers=2",
                f"model.recompute={mode}", "model.seq_length=640", "parallel.data=1", "parallel.pipeline=1",
                "parallel.tensor=1", "parallel.context=1", "parallel.expert=1", "parallel.sequence_parallel=false",
                "parallel.tp_comm_overlap=false", "train.global_batch_size=1", "train.micro_batch_size=1"]).for_devices(1)
            m = cfg.model
            layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], jnp.bfloat16),
                                 gpt.abstract_params(m)["layers"]["block"])
            x = jax.ShapeDtypeStruct((1, m.seq_length, m.hidden_size), jnp.bfloat16)
            kept = jax.eval_shape(lambda p, x: jax.vjp(lambda p, x: gpt.block_apply(m, p, x, 0, None), p, x)[1],
                                  layer, x)
            weights = {math.prod(w.shape) for w in jax.tree.leaves(layer)}
            saved = sum(math.prod(r.shape) * np.dtype(r.dtype).itemsize for r in jax.tree.leaves(kept)
                        if math.prod(r.shape) not in weights)
            counted = memory.layer_activation_bytes(layout_lib.Layout(cfg, 8))[mode]
            assert counted == pytest.approx(saved, rel=0.025), (impl, mode, counted / saved - 1)


@pytest.mark.slow
def test_compile_refines_the_best(capsys):
    """--compile: the best layouts are compiled for compile-only H100s; XLA's memory and exposed communication
    replace the model's (a layout XLA finds too big leaves the ranking)."""
    assert plan_main(["--config", "configs/gpt2-124m.yaml", "--target", "h100", "--gpus", "8", "--compile", "2",
                      "--separate", "0.5", "--json", "-"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    compiled = [r for r in rows if r["compiled"]]
    assert compiled and rows[0]["compiled"] and rows[0]["fits"]
    assert compiled[0]["memory_gib_per_gpu"] == pytest.approx(compiled[0]["compiled"]["peak_gib"])


def test_compile_loop_learns_and_survives_failures(monkeypatch, capsys):
    """The compile loop (XLA replaced by a stand-in): a layout XLA cannot compile keeps the model's row; one XLA
    finds too big leaves the ranking and scales its neighbours' activations, so that the next compile fits; the
    compiled winner's numbers are the program's."""
    import megajax.plan.__main__ as cli

    calls = []

    def fake(c, target):
        calls.append(c)
        mem = c.estimate.memory
        if len(calls) == 1:
            raise RuntimeError("INTERNAL: no tile sizes\nmore")
        if len(calls) == 2:  # twice the model's activations: too big
            return {"peak_gib": 2 * mem["capacity"] / 2**30, "fits": False, "exposed_s": 0.0}
        return {"peak_gib": mem["total"] / 2**30, "fits": True, "exposed_s": 1.5 * c.model_exposed_s}

    monkeypatch.setattr(cli, "compile_candidate", fake)
    assert cli.main(["--config", "configs/gpt2-1.3b.yaml", "--target", "h100", "--gpus", "64", "--compile", "1",
                     "--separate", "1.0"]) == 0
    out = capsys.readouterr().out
    assert "failed in XLA (RuntimeError: INTERNAL: no tile sizes)" in out and "too big" in out
    assert len(calls) == 3 and calls[2].fits and calls[1].learned_scale() > 1.5
    assert "(compiled)" in out.splitlines()[2]  # the first row of the table
    # the third compile ran on the model's memory as the too-big one corrected it
    same = calls[2].settings["model.recompute"] == calls[1].settings["model.recompute"]
    assert calls[2].activation_scale == (calls[1].learned_scale() if same else 1.0)


def test_a_slower_compile_does_not_crown_itself(monkeypatch, capsys):
    """A compiled layout that XLA's program makes clearly slower than uncompiled predictions is not listed first
    for being compiled: the faster predictions lead, and the plan says they are unsettled (the compiles stopped
    before them) and how to settle them."""
    import megajax.plan.__main__ as cli

    calls = []

    def fake(c, target):  # fits, but its program exposes a step's worth of communication more than the model
        calls.append(c)
        return {"peak_gib": c.estimate.memory["total"] / 2**30, "fits": True,
                "exposed_s": c.model_exposed_s + c.estimate.step_s}

    monkeypatch.setattr(cli, "compile_candidate", fake)
    assert cli.main(["--config", "configs/gpt2-1.3b.yaml", "--target", "h100", "--gpus", "64", "--compile", "1",
                     "--json", "-"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert len(calls) == 1 and not rows[0]["compiled"]
    k = next(i for i, r in enumerate(rows) if r["compiled"])
    assert all(r["predicted_step_s"] < rows[k]["predicted_step_s"] * 0.97 for r in rows[:k])
    assert cli.main(["--config", "configs/gpt2-1.3b.yaml", "--target", "h100", "--gpus", "64", "--compile", "1"]) == 0
    out = capsys.readouterr().out
    assert f"unsettled: rows 1-{k} are the model's alone" in out and "(the model's, not compiled)" in out


def test_the_own_layout_s_line_has_its_table_row_s_numbers(monkeypatch, capsys):
    """Where the config's own layout is a row of the table, its line gives that row's step and memory (what the
    compiles taught the model about neighbouring layouts included), not the bare model's: after a compile whose
    program exposes more than the model, the line and the row agree."""
    import megajax.plan.__main__ as cli

    def fake(c, target):  # fits, and its program exposes twice the model's communication
        return {"peak_gib": c.estimate.memory["total"] / 2**30, "fits": True, "exposed_s": 2 * c.model_exposed_s}

    monkeypatch.setattr(cli, "compile_candidate", fake)
    args = ["--config", "configs/gpt2-1.3b.yaml", "--target", "h100", "--gpus", "64", "--compile", "1", "--set",
            "parallel.pipeline=1", "parallel.tensor=2", "parallel.data_parallel_sharding_strategy=optim",
            "parallel.tp_comm_overlap=false"]
    assert cli.main(args + ["--json", "-"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    own = search_lib.own_layout(config_io.load(ROOT / "configs/gpt2-1.3b.yaml"), hardware("h100"), 64, 8)
    row = next(r for r in rows if r["settings"] == own.settings)
    assert row["predicted_step_s"] != pytest.approx(own.step_s)  # (the compile moved it)
    assert cli.main(args) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("the config's own layout"))
    assert f": {row['predicted_step_s']:.4g} s a step " in line or line.endswith("is the best"), line


def test_rank_keeps_the_simplest_of_equals():
    """Layouts the prediction cannot tell apart (the same time and memory) collapse to the simplest."""
    base = config_io.load(ROOT / "configs/gpt2-124m.yaml")
    result = search_lib.search(base, hardware("h100"), 8, 8, {"parallel.tensor": 1, "parallel.pipeline": 1,
                                                              "train.micro_batch_size": 4})
    top = result["ranked"][:20]
    keys = [(round(c.step_s, 9), round(c.memory_gib, 6), c.settings["model.recompute"],
             c.settings["parallel.data_parallel_sharding_strategy"]) for c in top]
    assert len(keys) == len(set(keys))


def test_the_uncertainty_is_the_largest_miss_on_the_measured_steps(capsys):
    """The ± beside the predictions is the model's largest miss on the steps measured on that kind of GPU, and rows
    within it of the best are marked (~) and counted instead of being ordered by the model alone."""
    for target in ("h100", "a100"):
        assert checks.ERROR[target] == math.ceil(checks.largest_miss(target) * 100) / 100, target
    assert checks.ERROR["h200"] == checks.ERROR["h100"]
    assert plan_main(["--config", "configs/llama3-8b.yaml", "--target", "h100", "--gpus", "8", "--compile", "0"]) == 0
    out = capsys.readouterr().out
    assert "predictions carry +-14%, the model's largest miss on the 9 single-H100 steps measured." in out
    assert "  2~ d" in out and "within the model's +-14%" in out
    assert plan_main(["--config", "configs/llama3-8b.yaml", "--target", "h100", "--gpus", "8", "--compile", "0",
                      "--json", "-"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["uncertainty"] == 0.14
    close = [r["within_error_of_best"] for r in result["rows"]]
    assert close[0] and 1 < sum(close) < len(close)
