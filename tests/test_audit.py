"""The audit proves that tensor and sequence parallelism move exactly Megatron's bytes: per layer and
micro batch 2 all-reduces forward and 2 backward (or all-gather + reduce-scatter pairs with sequence
parallelism) of [b, s, d], and one gradient reduction over 'data' per step."""

import json
import math
import os
import subprocess
import sys

import jax
import pytest
from jax.sharding import PartitionSpec as P

from megajax import audit, hlo, metrics
from megajax.config import io as config_io
from megajax.model.layers import WEIGHT_EINSUMS
from megajax.parallel.pipeline import ticks

from conftest import REPO, cli_env, gpu

LAYOUT = ["parallel.data=2", "parallel.tensor=4"]


def _collectives(sets, target="cpu", n=8, options=None):
    cfg = config_io.load(f"{REPO}/configs/tiny.yaml", sets)
    devices = jax.devices()[:n] if target == "cpu" else audit._gpu_devices(target, n)
    cfg, mesh, compiled, setup = audit.compile_step(cfg, devices, options)
    colls = hlo.parse(compiled.as_text(), dict(mesh.shape), None if target == "cpu" else audit.GPUS_PER_HOST)
    _collectives.grad_bytes = sum(  # one device's share of the (f32) gradients
        math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
        for a, s in zip(jax.tree.leaves(setup.abstract_state.params), jax.tree.leaves(setup.state_shardings.params)))
    return cfg, colls


def _act_bytes(cfg):
    m = cfg.model
    return cfg.train.micro_batch_size * m.seq_length * m.hidden_size * (
        2 if m.compute_dtype == "bfloat16" else 4)


def _in_layer_loop(colls, kind, size):
    """Executions per step of `kind` over 'tensor' moving one [b, s, d] activation, inside the layer scans."""
    return sum(c.count for c in colls if c.kind == kind and c.axes == ("tensor",) and c.bytes == size
               and c.count > 1)


def _check_data_reduction(colls):
    """Each gradient is reduced over 'data' once per step (layer by layer, or in one buffer), whatever the
    micro batches: the reduced bytes are the gradients' (+ a few scalars: the loss, MoE statistics)."""
    data = [c for c in colls if "data" in c.axes and c.kind in ("all-reduce", "reduce-scatter")]
    reduced = sum(c.bytes * c.count for c in data)
    assert _collectives.grad_bytes <= reduced <= _collectives.grad_bytes + 1024, "one gradient reduction per step"


def test_tensor_parallel_all_reduces_on_cpu():
    cfg, colls = _collectives(LAYOUT)
    expect = audit.megatron_expected(cfg)["all-reduce"]
    assert expect["count"] == 4 * cfg.model.num_layers
    assert _in_layer_loop(colls, "all-reduce", _act_bytes(cfg)) == expect["count"]
    _check_data_reduction(colls)


# DeepSeek's multi-latent attention at small sizes: query latent 32, key-value latent 24, 16 + 8 query/key dims
MLA = ["model.arch=llama", "model.num_heads=8", "model.multi_latent_attention=true", "model.q_lora_rank=32",
       "model.kv_lora_rank=24", "model.qk_head_dim=16", "model.qk_pos_emb_head_dim=8", "model.v_head_dim=16"]


@pytest.mark.parametrize("model", ["gpt2", "mla"])
def test_program_gemm_flops_equal_megatrons_formula_on_cpu(model):
    """The GEMM FLOPs read from the compiled program (2 x output x contracted size over every dot, times loop
    trip counts) equal Megatron's analytic hardware FLOPs per device for a dense step; and for multi-latent
    attention the latent projections' (values as wide as the query heads: nothing padded; sequence parallel, which
    splits the down-projections over the tensor ranks: without it every tensor rank computes them whole, as
    Megatron's duplicated ones)."""
    from megajax import metrics

    sets = LAYOUT + (MLA + ["model.v_head_dim=24", "parallel.sequence_parallel=true"] if model == "mla" else [])
    cfg = config_io.load(f"{REPO}/configs/tiny.yaml", sets)
    cfg, _, compiled, _ = audit.compile_step(cfg, jax.devices()[:8])
    got = hlo.gemm_flops(compiled.as_text())
    want = metrics.step_flops(cfg.model, cfg.train.global_batch_size * cfg.model.seq_length)["hardware_flops"] / 8
    assert got["in_conditional"] == 0
    assert got["total"] == pytest.approx(want, rel=1e-3)


def test_full_recompute_all_reduces_one_less_than_megatron():
    """Megatron recomputes both forward all-reduces of a layer; XLA drops the recomputed MLP output's,
    which no backward reads: 5 per layer instead of 6."""
    cfg, colls = _collectives(LAYOUT + ["model.recompute=full"])
    assert audit.megatron_expected(cfg)["all-reduce"]["count"] == 6 * cfg.model.num_layers
    assert _in_layer_loop(colls, "all-reduce", _act_bytes(cfg)) == 5 * cfg.model.num_layers


@gpu
@pytest.mark.slow  # suite time (8 s; the sequence-parallel pattern test runs by default)
def test_tensor_parallel_on_h100_target():
    cfg, colls = _collectives(LAYOUT + ["model.compute_dtype=bfloat16"], target="h100",
                              options={"xla_gpu_enable_pipelined_all_reduce": False})  # see the test below
    expect = audit.megatron_expected(cfg)["all-reduce"]
    assert _in_layer_loop(colls, "all-reduce", _act_bytes(cfg)) == expect["count"] == 16
    _check_data_reduction(colls)


@gpu
@pytest.mark.slow  # suite time (7 s; as above)
def test_sequence_parallel_on_h100_target_is_all_gather_plus_reduce_scatter():
    cfg, colls = _collectives(LAYOUT + ["model.compute_dtype=bfloat16", "parallel.sequence_parallel=true"],
                              target="h100", options={"xla_gpu_enable_pipelined_all_reduce": False})
    expect = audit.megatron_expected(cfg)
    size = _act_bytes(cfg)
    assert _in_layer_loop(colls, "all-gather", size) == expect["all-gather"]["count"] == 16
    assert _in_layer_loop(colls, "reduce-scatter", size) == expect["reduce-scatter"]["count"] == 16
    assert _in_layer_loop(colls, "all-reduce", size) == 0
    ring = {k: sum(hlo.wire_bytes(c) * c.count for c in colls if c.kind == k and c.bytes == size and c.count > 1)
            for k in ("all-gather", "reduce-scatter")}
    # the same bytes on the wire as the 16 all-reduces they replace
    assert ring["all-gather"] + ring["reduce-scatter"] == pytest.approx(16 * 2 * 3 / 4 * size)


@gpu
@pytest.mark.slow  # suite time (10 s; the MLA program's FLOPs on CPU run by default)
def test_latent_attention_gathers_the_latents_on_h100():
    """Sequence-parallel multi-latent attention gathers its latents, not the residual stream: per layer the forward
    all-gathers one [b, s, q_lora + kv_lora + rope] (XLA merges the three) where standard attention gathers
    [b, s, d], and the backward reduce-scatters the same; the MLP's and the row-parallel collectives are as
    Megatron's (3 all-gathers and 3 reduce-scatters of [b, s, d] a layer instead of 4 + 4)."""
    cfg, colls = _collectives(["parallel.data=1", "parallel.tensor=4", "parallel.sequence_parallel=true",
                               "model.compute_dtype=bfloat16", "train.global_batch_size=4", "train.micro_batch_size=4",
                               *MLA], target="h100", n=4, options={"xla_gpu_enable_pipelined_all_reduce": False})
    m, layers = cfg.model, cfg.model.num_layers
    size = _act_bytes(cfg)
    latent = size // m.hidden_size * (m.q_lora_rank + m.kv_lora_rank + m.qk_pos_emb_head_dim)
    assert latent < size
    for kind in ("all-gather", "reduce-scatter"):
        assert _in_layer_loop(colls, kind, size) == 3 * layers, kind
        assert _in_layer_loop(colls, kind, latent) == layers, kind
    assert not [c for c in colls if c.kind == "all-reduce" and "tensor" in c.axes and c.bytes >= latent]


# Sequence parallelism on the GPU compiler, for every tensor size, data 1 and > 1, both dtypes, every
# recompute mode and both architectures: the default run covers each value, -m slow the product.
SP_SPACE = [(t, d, dt, rc, arch) for t, d in ((2, 1), (2, 4), (4, 1), (4, 2), (8, 1))
            for dt in ("float32", "bfloat16") for rc in ("none", "selective", "full") for arch in ("gpt2", "llama")]
SP_DEFAULT = [(4, 2, "bfloat16", "selective", "llama")]  # suite time: the rest of SP_SPACE with -m slow


@gpu
@pytest.mark.parametrize("case", SP_DEFAULT + [pytest.param(c, marks=pytest.mark.slow) for c in SP_SPACE
                                               if c not in SP_DEFAULT], ids=lambda c: "-".join(map(str, c)))
def test_sequence_parallel_is_megatrons_pattern_on_h100(case):
    """Per layer and micro batch: an all-gather of [b, s, d] before each column-parallel matmul and a
    reduce-scatter after each row-parallel one, forward and backward (4 + 4; full recompute adds the
    forward's again, less the recomputed MLP-output reduce-scatter that no backward reads), and no
    all-reduce over 'tensor' of anything activation-sized anywhere in the step."""
    t, d, dtype, recompute, arch = case
    heads = ["model.num_heads=8"] + (["model.arch=llama", "model.num_kv_heads=8"] if arch == "llama" else [])
    # Without XLA's collective pipeliner, which peels one layer of the backward loop out of it (its collectives
    # then run once, outside the loop, and `loop_bytes` would miss them).
    cfg, colls = _collectives([f"parallel.data={d}", f"parallel.tensor={t}", "parallel.sequence_parallel=true",
                               f"model.compute_dtype={dtype}", f"model.recompute={recompute}",
                               f"train.global_batch_size={4 * d}", "train.micro_batch_size=4", *heads],
                              target="h100", n=d * t, options={"xla_gpu_enable_pipelined_all_reduce": False})
    size, layers = _act_bytes(cfg), cfg.model.num_layers
    assert cfg.num_micro_batches == 1  # so that only the layer scan runs an op more than once

    def loop_bytes(kind):
        return sum(c.bytes * c.count for c in colls if c.kind == kind and c.axes == ("tensor",) and c.count > 1)

    full = recompute == "full"
    assert loop_bytes("all-gather") == (6 if full else 4) * layers * size
    assert loop_bytes("reduce-scatter") == (5 if full else 4) * layers * size
    assert not [c for c in colls if c.kind == "all-reduce" and "tensor" in c.axes and c.bytes >= size // t]


@gpu
def test_distributed_optimizer_reduce_scatters_gradients_over_data():
    _, colls = _collectives(LAYOUT + ["model.compute_dtype=bfloat16", "parallel.distributed_optimizer=true"],
                            target="h100")
    rs = [c for c in colls if c.kind == "reduce-scatter" and c.axes == ("data",)]
    ag = [c for c in colls if c.kind == "all-gather" and c.axes == ("data",)]
    assert rs and ag and all(c.count == 1 for c in rs + ag)
    assert not [c for c in colls if c.kind == "all-reduce" and c.axes == ("data",) and c.bytes > 4096]


def test_summary_reads_as_a_person_would_say_it():
    """The audit's lines for a person: one micro batch is one, times under a second in ms and longer ones in
    seconds (not 1.22e+04 ms), memory with one decimal."""
    report = {"devices": 1024, "target": "h100", "layout": {"data": 512, "tensor": 2, "micro_batches": 1,
                                                            "micro_batch_size": 2},
              "memory_per_device": {"peak_estimate_gib": 58.0, "device_memory_gib": 79.1, "fits": True},
              "communication": {"comm_s": 12.2, "exposed_comm_s": 0.0193, "gemm_s_at_peak": 5.87}}
    assert audit.summary(report).splitlines() == [
        "audit: 1024 h100 devices (data 512 x tensor 2), 1 micro batch of 2",
        "memory: peak 58.0 GiB a device of 79.1: fits",
        "communication: 12.20 s a step, 19.3 ms of it exposed (not under a GEMM), against 5.87 s of GEMMs at peak; "
        "per collective in the JSON's communication.groups"]


def test_a_device_count_below_one_is_an_error(capsys):
    """--devices 0 once audited the default count (8 for GPUs) without a word."""
    from megajax.audit import main

    assert main(["--config", "configs/tiny.yaml", "--target", "h100", "--devices", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --devices 0: the count must be 1 or more"), err


def test_cli_prints_json_with_memory_collectives_and_flops(tmp_path):
    hlo_file = tmp_path / "step.hlo"
    out = subprocess.run([sys.executable, "-m", "megajax.audit", "--config", "configs/tiny.yaml", "--devices", "8",
                          "--set", *LAYOUT, "parallel.sequence_parallel=true", "--dump-hlo", str(hlo_file)],
                         cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["devices"] == 8 and report["layout"]["tensor"] == 4
    assert report["memory_per_device"]["temp_bytes"] > 0
    assert "all-gather over tensor" in report["collectives"]
    assert report["megatron_flops_per_step"]["model_flops"] > 0 and report["xla_flops_per_device"] > 0
    assert "all-gather" in hlo_file.read_text()
    assert "audit: 8 cpu devices (data 2 x tensor 4)" in out.stderr and "memory: peak" in out.stderr


@gpu
@pytest.mark.slow  # suite time (16 s; the H100 programs compile by default, the A100's refusal of FP8 in test_fp8)
def test_a100_programs_compile():
    """A step whose GEMMs XLA's compile-only sm_80 cannot tile as Triton fusions (gpt2-124m's bf16[8192, 768];
    "Couldn't find output tile sizes", jax 0.10.2) compiles for the A100 target with its options
    (audit.TARGET_OPTIONS: cuBLAS GEMMs), and the H100 target keeps XLA's defaults."""
    cfg = config_io.load(f"{REPO}/configs/gpt2-124m.yaml", ["model.num_layers=2", "train.global_batch_size=8",
                                                            "model.scan_layers=true", "model.attention_impl=xla",
                                                            "model.norm_impl=xla"])
    with pytest.raises(Exception, match="output tile sizes"):
        audit.compile_step(cfg, audit._gpu_devices("a100", 1))
    report = audit.audit(cfg, "a100", 1)
    assert report["memory_per_device"]["temp_bytes"] > 0 and report["program_gemm_flops_per_device"]["gemms"] > 0
    assert "h100" not in audit.TARGET_OPTIONS


def test_cli_rejects_an_impossible_layout():
    out = subprocess.run([sys.executable, "-m", "megajax.audit", "--config", "configs/tiny.yaml", "--devices", "8",
                          "--set", "parallel.tensor=3"], cwd=REPO, env=cli_env(), capture_output=True, text=True)
    assert out.returncode == 2 and "not divisible by parallel.tensor=3" in out.stderr


def test_replica_group_formats():
    mesh = {"data": 2, "pipeline": 1, "tensor": 4}
    assert hlo.parse_groups("replica_groups=[2,4]<=[8], x", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert hlo.parse_groups("replica_groups=[4,2]<=[2,4]T(1,0), x", 8) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert hlo.parse_groups("replica_groups={{0,4},{1,5}}, x", 8) == [[0, 4], [1, 5]]
    groups = hlo.parse_groups("replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], "
                              "device_ids=([2,4]T(1,0)) {'axis_0'}, use", 8)
    assert sorted(map(sorted, groups)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert mesh  # groups above are the 'tensor' groups of a (2, 1, 4) mesh


def test_a_conditional_the_last_pipeline_rank_alone_takes_weighs_one_rank_of_p():
    """The multi-token prediction modules' blocks with the tables over the pipeline run under a conditional on the
    rank (vocab.Ranks.owned, named ticks.LAST_RANK), in the forward and, differentiated, in the backward: the audit,
    which averages over the pipeline ranks, counts its branches 1 - 1/p and 1/p, not both as taken."""
    from megajax.config import ModelConfig
    from megajax.parallel.step_plan import StepPlan
    line = ('branch_computations={%skip.1, %run.2}, metadata={op_name="jit(<lambda>)/shard_map/while/body/'
            'closed_call/pipeline_s1t0_h1/cond/branch_1_fun/OPEN(pipeline_last)CLOSE/cond"}')
    runs = {ticks.LAST_RANK: [0.75, 0.25]}
    for wrapped, closed in (("jvp", ""), ("transpose(jvp", ")")):  # (as the compiled program names them)
        named = line.replace("OPEN", wrapped).replace("CLOSE", closed)
        assert hlo._callees("conditional", named, runs) == [
            ("skip.1", 0.75, "pipeline_last"), ("run.2", 0.25, "pipeline_last")]
    assert [r for _, r, _ in hlo._callees("conditional", named, {})] == [1, 1]
    plan = StepPlan(replica=1, data=1, expert=1, pipeline=4, context=1, tensor=1, manual=("pipeline",),
                    schedule="1f1b", virtual_stages=1, micro_batches=4, vocab_over_pipeline=True)
    assert ticks.branch_runs(plan, ModelConfig(num_layers=4))[ticks.LAST_RANK] == [0.75, 0.25]


def test_a_ring_across_nodes_runs_at_the_nics_of_its_members_on_a_node():
    """On 2 nodes of 4 devices (a data 4 x tensor 2 mesh, tensor innermost): a ring over 'data' has 2 members on
    each node, so NCCL's channels cross the network through 2 NICs; a ring over 'tensor' stays in its node; a
    permute over 'data' sends each device's own bytes through its own NIC."""
    mesh = jax.make_mesh((4, 2), ("data", "tensor"))

    def body(x):
        x = jax.lax.psum(x, "data") + jax.lax.psum(x, "tensor")
        x = jax.lax.all_gather(x, "data", tiled=True)[:x.shape[0]]
        return jax.lax.ppermute(x, "data", [(i, (i + 1) % 4) for i in range(4)])

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data", "tensor"), out_specs=P("data", "tensor")))
    x = jax.device_put(jax.numpy.ones((64, 64)), jax.sharding.NamedSharding(mesh, P("data", "tensor")))
    text = f.lower(x).compile().as_text()
    colls = {(c.kind, c.axes): c for c in hlo.parse(text, dict(mesh.shape), 4)}
    ring, gather = colls[("all-reduce", ("data",))], colls[("all-gather", ("data",))]
    local, permute = colls[("all-reduce", ("tensor",))], colls[("collective-permute", ("data",))]
    assert ring.crosses_nodes and ring.nics == 2 and gather.nics == 2
    assert not local.crosses_nodes and permute.crosses_nodes and permute.nics == 1
    nvlink, network = 450e9, 50e9
    assert hlo.link_seconds(ring, nvlink, network) == pytest.approx(hlo.wire_bytes(ring) / (2 * network))
    assert hlo.link_seconds(permute, nvlink, network) == pytest.approx(hlo.wire_bytes(permute) / network)
    assert hlo.link_seconds(local, nvlink, network) == pytest.approx(hlo.wire_bytes(local) / nvlink)


@gpu
# dropless by default
@pytest.mark.parametrize("factor,freq", [pytest.param(1.0, 2, marks=pytest.mark.slow), (None, 1),
                                         pytest.param(1.0, "p2", marks=pytest.mark.slow),
                                         pytest.param(1.0, "fold", marks=pytest.mark.slow),
                                         pytest.param(None, "fold", marks=pytest.mark.slow),
                                         pytest.param(None, "ragged", marks=pytest.mark.slow),
                                         pytest.param(None, "fold-ragged", marks=pytest.mark.slow)])
def test_expert_parallel_all_to_alls_on_h100_target(factor, freq):
    """Per MoE layer and micro batch: dispatch + combine all-to-all over 'expert', forward and backward, each of
    audit.expected_all_to_all's buffer; with a capacity factor of 1 that is the analytic tokens x k x hidden. With
    model.moe_layer_freq 2 only layers 0 and 2 exchange, and the program's GEMMs count their experts and the
    dense layers' MLP as the FLOPs formula does. "p2": on d 2 e 2 x p 2 (1F1B, 4 micro batches) the program, its
    branches counted as the schedule runs them, exchanges as often as expected_all_to_all says: 6 a layer and
    micro batch where a chunk is recomputed, 4 where the last chunk's forward kept its residuals. "fold": the
    experts whole over 'expert' x 'tensor' (parallel.expert_tensor=1, sequence parallel; with a capacity and
    dropless): the exchange is over both axes and carries a tensor rank's sequence shard (half the bytes), and no
    expert's partial sums are all-reduced over 'tensor'. "ragged" (parallel.expert_all_to_all=ragged, dropless):
    XLA's ragged all-to-all carries the routed rows alone, the analytic volume (a quarter of the padded blocks),
    and only the group sizes and offsets go by fixed-size all-to-alls."""
    pipe, fold, ragged = freq == "p2", "fold" in str(freq), "ragged" in str(freq)
    layout = (["parallel.data=2", "parallel.expert=2", "parallel.pipeline=2", "train.global_batch_size=8"] if pipe
              else ["parallel.data=4", "parallel.expert=4"])
    layout += ["parallel.sequence_parallel=true", "parallel.expert_tensor=1"] if fold else []
    layout += ["parallel.expert_all_to_all=ragged"] if ragged else []
    freq = 1 if isinstance(freq, str) else freq
    sets = [*layout, "parallel.tensor=2", "model.compute_dtype=bfloat16",
            "train.micro_batch_size=2" if not pipe else "train.micro_batch_size=1",
            f"model.moe_capacity_factor={'null' if factor is None else factor}", f"model.moe_layer_freq={freq}"]
    cfg = config_io.load(f"{REPO}/configs/tiny-moe.yaml", sets)
    cfg, mesh, compiled, setup = audit.compile_step(cfg, audit._gpu_devices("h100", 8))
    colls = hlo.parse(compiled.as_text(), dict(mesh.shape), branch_runs=ticks.branch_runs(setup.plan, cfg.model))
    want = audit.expected_all_to_all(cfg)
    if pipe:
        a2a = [c for c in colls if c.kind == "all-to-all" and c.bytes == want["buffer_bytes_each"]]
        # rank 0 recomputes its 4 micro batches, rank 1 (the last chunk) keeps its forwards' residuals
        assert sum(c.count for c in a2a) == pytest.approx(want["count"]) == (4 + 2 * 0.5) * 4 // 2 * 4
        return
    # the program's GEMM FLOPs against the active-parameter formula's, both without the attention core (a
    # flash-attention kernel on the GPU, which GEMM counting does not see): the capacity buffers' rounding only;
    # dropless, XLA expands ragged_dot into dense matmuls over every local expert (and the exchange pads)
    gemm = hlo.gemm_flops(compiled.as_text())["total"]
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    core = metrics.layer_forward_flops_per_token(cfg.model)[1] * 3 * cfg.model.num_layers * tokens  # (no recompute)
    assert cfg.model.recompute == "none"
    active = (metrics.step_flops(cfg.model, tokens)["hardware_flops"] - core) / 8
    assert (gemm / active == pytest.approx(1.0, abs=0.01)) if factor else (gemm / active > 2)
    if ragged:  # the rows by exact counts; fixed-size all-to-alls carry only group sizes and offsets (< 64 B)
        rows = [c for c in colls if c.kind == "ragged-all-to-all"]
        assert want["exchange"] == "ragged-all-to-all" and want["bytes_each"] == want["routed_bytes_each"]
        assert {c.bytes for c in rows} == {want["routed_bytes_each"]}, [c.bytes for c in rows]
        assert sum(c.count for c in rows) == want["count"] == 4 * 4 * 2
        assert {c.axes for c in rows} == {tuple(want["axes"])} == {("expert", "tensor") if fold else ("expert",)}
        assert max(c.bytes for c in colls if c.kind == "all-to-all") < 64
        return
    a2a = [c for c in colls if c.kind == "all-to-all"]
    assert {c.axes for c in a2a} == {tuple(want["axes"])} == {("expert", "tensor") if fold else ("expert",)}
    if fold:
        assert want["routed_bytes_each"] == 256 // 2 * 2 * 128 * 2  # tokens / t x k x hidden x bf16
        reduced = sum(c.bytes * c.count for c in colls if c.kind == "all-reduce" and c.axes == ("tensor",))
        assert reduced < 0.1 * sum(c.bytes * c.count for c in a2a)
        # nothing of the experts' rows is gathered over 'tensor' (a gather from all [el, f] biases by every
        # block's rows was: 1 MB a layer), only the sequence (< 100 KB each; the routed rows are 64 KiB a device)
        gathered = [c.bytes for c in colls if c.kind == "all-gather" and c.axes == ("tensor",)]
        assert max(gathered) < 2 * want["routed_bytes_each"], gathered
    rows = [c for c in a2a if c.bytes == want["buffer_bytes_each"]]
    # 4 per MoE layer, 4 / freq MoE layers, 2 micro batches
    assert sum(c.count for c in rows) == want["count"] == 4 * 4 // freq * 2
    if factor == 1.0:
        assert want["buffer_bytes_each"] == want["routed_bytes_each"] and len(rows) == len(a2a)
    else:  # dropless: the rows' buffers are n x min(k, e / n) / k = 4 x 2 / 2 = 4 times the routed rows (n = 4
        # ranks holding experts: e 4, or folded e 2 x t 2), and the group sizes go along once per layer forward (4
        # ranks x 2 experts x 4 bytes)
        assert want["buffer_bytes_each"] == 4 * want["routed_bytes_each"]
        sizes = [c for c in a2a if c not in rows]
        assert {c.bytes for c in sizes} == {4 * 4 * 2} and sum(c.count for c in sizes) == 4 * 2


def _moe_gemm_ratio(*sets: str) -> float:
    """Dropless tiny-moe on 8 compile-only H100s, d4 x t2, micro batch 8: the program's GEMM FLOPs (the grouped
    kernels counted at their static rows: every routed row plus up to a tile of padding per expert, an upper bound)
    over the active-parameter formula's (the dense model of the same active MLP width), both without the attention
    core (a flash-attention kernel on the GPU, which GEMM counting does not see)."""
    cfg = config_io.load(f"{REPO}/configs/tiny-moe.yaml", [
        "parallel.data=4", "parallel.tensor=2", "model.compute_dtype=bfloat16", "train.micro_batch_size=8",
        "train.global_batch_size=64", *sets])
    cfg, mesh, compiled, _ = audit.compile_step(cfg, audit._gpu_devices("h100", 8))
    gemm = hlo.gemm_flops(compiled.as_text())["total"]
    assert cfg.model.recompute == "none" and cfg.model.mtp_num_layers == 0
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    dense, _ = metrics.layer_forward_flops_per_token(cfg.model)
    logits = 2 * cfg.model.hidden_size * cfg.model.padded_vocab_size
    return gemm / (3 * (cfg.model.num_layers * dense + logits) * tokens / 8)


@gpu
def test_dropless_moe_default_multiplies_routed_rows_on_h100_target():
    """The default (model.moe_grouped_gemm=null) compiles the Pallas grouped GEMM for a GPU: within 1.3x of the
    active-parameter FLOPs, where ragged_dot's GPU lowering would multiply every row by every local expert."""
    assert 1.0 <= _moe_gemm_ratio() < 1.3


@gpu
@pytest.mark.slow  # two GPU-target compiles
def test_grouped_gemm_computes_routed_rows_on_h100_target():
    """Forced either way: the grouped GEMM within 1.2x of the formula; ragged_dot's GPU lowering computes every row
    against every local expert (> 4x)."""
    ratios = {grouped: _moe_gemm_ratio(f"model.moe_grouped_gemm={str(grouped).lower()}") for grouped in (True, False)}
    assert 1.0 <= ratios[True] < 1.2 and ratios[False] > 4, ratios


def _gpt2_1_3b_h100_communication(*sets: str) -> dict:
    """The overlap report (`audit.communication`) of gpt2-1.3b's step on 8 compile-only H100s: data 4 x tensor 2
    (with the preset's sequence parallelism), 4 micro batches of 1, and `sets`."""
    cfg = config_io.load(f"{REPO}/configs/gpt2-1.3b.yaml", [
        "parallel.data=4", "parallel.tensor=2", "train.micro_batch_size=1", "train.global_batch_size=16", *sets])
    cfg, mesh, compiled, _ = audit.compile_step(cfg, audit._gpu_devices("h100", 8))
    text = compiled.as_text()
    colls = hlo.parse(text, dict(mesh.shape), audit.GPUS_PER_HOST)
    return audit.communication(colls, "h100", cfg.model.compute_dtype, hlo.gemm_flops(text)["total"])


@gpu
@pytest.mark.parametrize("mode", ["overlap", pytest.param("zero-overlap", marks=pytest.mark.slow),
                                  pytest.param("plain", marks=pytest.mark.slow)])  # suite time: two with -m slow
def test_data_parallel_reduction_runs_under_the_backward_on_h100(mode):
    """gpt2-1.3b (24 layers), data 4 x tensor 2 with sequence parallelism, 4 micro batches of 1: with the
    reduction issued layer by layer in the last micro batch's backward (megajax/parallel/overlap.py, XLA's pipelined
    all-reduce from megajax/xla_flags.py) the GPU schedule places GEMMs under >= 80% of the data-parallel
    bytes (all but the embedding's and the first layer's); reduced once after the backward, under none. With
    the distributed optimizer the same holds for its reduce-scatter, and for its parameter all-gather when the
    weights are gathered one layer ahead in the next step's first forward (overlap_param_gather)."""
    zero = mode == "zero-overlap"
    groups = _gpt2_1_3b_h100_communication(
        f"parallel.distributed_optimizer={str(zero).lower()}", f"parallel.overlap_param_gather={str(zero).lower()}",
        f"parallel.overlap_grad_reduce={str(mode != 'plain').lower()}")["groups"]
    if zero:  # each f32 gradient scattered once, each weight gathered once (the bias of a padded dim aside): the
        # matmul weights in bf16, the rest (the embedding, norms, biases: 8% of the bytes) in f32
        for kind in ("reduce-scatter", "all-gather"):
            data = groups[f"{kind} over data"]
            assert data["overlapped_fraction"] >= 0.8 and data["exposed_s"] < 0.5 * data["comm_s"], kind
        assert 2.6e9 < groups["reduce-scatter over data"]["bytes"] < 2.7e9
        assert 0.5 < groups["all-gather over data"]["bytes"] / groups["reduce-scatter over data"]["bytes"] < 0.56
        assert groups["all-reduce over data"]["bytes"] < 1e6  # only the tensor-sharded biases
        return
    data = groups["all-reduce over data"]
    assert data["bytes"] > 2e9  # each f32 gradient once: ~0.66 B parameters per device
    if mode == "overlap":
        assert data["overlapped_fraction"] >= 0.8
        # estimated time: 40% still exposed (measured): one layer's backward GEMMs at micro batch 1 are about as
        # long as its 100 MB all-reduce on NVLink, and the scheduler puts only part of them under it
        assert data["exposed_s"] < 0.5 * data["comm_s"]
    else:
        assert data["overlapped_fraction"] < 0.05


@gpu
@pytest.mark.slow  # suite time: a GPU-target compile of gpt2-1.3b's 8 layers on a pipeline (98 s)
def test_pipelined_reduction_and_gather_run_inside_the_schedule_on_h100():
    """gpt2-1.3b cut to 8 layers, data 2 x pipeline 2 (1F1B) x tensor 2 with the preset's sequence parallelism
    and distributed optimizer, 8 micro batches, parallel.overlap_grad_reduce and overlap_param_gather: the layers'
    gradients are reduce-scattered inside the schedule's ticks (rank 1 in its idle cool-down tick, rank 0 in the
    backward branch that ends its chunk) and their weights all-gathered from the shards (rank 1 in its idle warm-up
    tick, rank 0 in its first forward; the matmul weights in bf16), each exactly once a step, as the audit counts
    the branches the schedule runs (`ticks.branch_runs`: the program's GEMM FLOPs then match Megatron's formula,
    where counting every branch as taken gave 3.3x); GEMMs run under part of rank 0's (measured 33% of the
    reductions: four layers a chunk, of which XLA peels the first and the last out of its loop)."""
    cfg = config_io.load(f"{REPO}/configs/gpt2-1.3b.yaml", [
        "model.num_layers=8", "parallel.data=2", "parallel.pipeline=2", "parallel.tensor=2",
        "train.micro_batch_size=1", "train.global_batch_size=16", "parallel.overlap_grad_reduce=true",
        "parallel.overlap_param_gather=true"])
    devices = audit._gpu_devices("h100", 8)
    cfg, mesh, compiled, setup = audit.compile_step(cfg, devices)
    text = compiled.as_text()
    runs = ticks.branch_runs(setup.plan, cfg.model)
    colls = hlo.parse(text, dict(mesh.shape), audit.GPUS_PER_HOST, runs)
    gemm = hlo.gemm_flops(text, runs)["total"]
    # Megatron's formula less the attention core (the flash kernel's, which GEMM counting does not see; a pipelined
    # step counts as fully recomputed: the core's forward twice and its backward)
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    core = metrics.layer_forward_flops_per_token(cfg.model)[1] * 4 * cfg.model.num_layers * tokens
    megatron = (metrics.step_flops(cfg.model, tokens, pipelined=True)["hardware_flops"] - core) / len(devices)
    assert 0.8 < gemm / megatron < 1.05 and hlo.gemm_flops(text)["total"] / megatron > 2
    # one device's layer weights, whole: in f32 (the gradients), and as gathered (the matmul weights in bf16)
    compute_specs = jax.tree.leaves(setup.compute_param_specs()["layers"], is_leaf=lambda x: isinstance(x, P))
    weights = jax.tree_util.tree_flatten_with_path(setup.abstract_state.params["layers"])[0]
    sizes = [math.prod(jax.sharding.NamedSharding(mesh, s).shard_shape(a.shape)) for (_, a), s in zip(weights,
                                                                                                        compute_specs)]
    layers = 4 * sum(sizes)
    gathered = sum(n * (2 if path[-1].key in WEIGHT_EINSUMS else 4) for (path, _), n in zip(weights, sizes))
    assert gathered < 0.55 * layers
    inside = audit.communication(colls, "h100", cfg.model.compute_dtype, gemm, cfg, setup.plan)["in_schedule"]
    assert abs(inside["data_parallel_bytes"] / layers - 1) < 0.01, (inside, layers)
    assert abs(inside["gather_bytes"] / gathered - 1) < 0.01, (inside, gathered)
    # rank 1 reduces in its idle tick (the last: rank 0's last backward), rank 0 in its last backward, with GEMMs
    # under part of it; the gathers mirror that in the warm-up
    for kind, where, fraction, total in (("reduce-scatter", {"b", "x"}, 0.25, layers),
                                         ("all-gather", {"f", "g"}, 0.1, gathered)):
        ours = [c for c in colls if c.in_conditional and c.kind == kind and c.axes == ("data",)]
        assert {c.scope[-1] for c in ours} == where, kind
        in_compute = [c for c in ours if c.scope[-1] in "bf"]
        assert sum(c.bytes * c.count for c in in_compute) == pytest.approx(total / 2, rel=0.01), kind
        assert sum(c.bytes * c.count for c in in_compute if c.flops_under > 0) > fraction * total / 2, kind
    # one idle tick against one 4-layer chunk's recompute and backward (forward) at peak: the run fits, and rank 0's
    # exposed part is all the delay; a layer's collective is shorter than its forward inside a node
    assert inside["idle_ticks_s"] < inside["cooldown_tick_s"]
    assert inside["cooldown_delay_s"] == pytest.approx(2 * inside["in_backward_exposed_s"])
    assert inside["warmup_idle_ticks_s"] < inside["warmup_tick_s"]
    assert inside["warmup_delay_s"] == pytest.approx(2 * inside["in_forward_exposed_s"])
    assert 0 < inside["comm_ratio"] < 1


@gpu
@pytest.mark.slow  # suite time: two GPU-target compiles of a 24-layer model on a pipeline (about a minute)
def test_tp_comm_overlap_hides_the_tensor_collectives_in_a_pipeline_on_h100():
    """gpt2-1.3b, data 2 x pipeline 2 (1F1B) x tensor 2 with sequence parallelism, 8 micro batches of 1: inside the
    schedule's branches parallel.tp_comm_overlap chunks the layers' all-gathers and reduce-scatters over 'tensor'
    (no ppermutes), and the GPU schedule puts GEMMs under >= 85% of each kind's bytes (measured 98% and 89%; as
    XLA schedules the whole collectives, 56% and 20%)."""
    sets = ["parallel.data=2", "parallel.pipeline=2", "parallel.tensor=2", "parallel.sequence_parallel=true",
            "parallel.schedule=1f1b", "train.micro_batch_size=1", "train.global_batch_size=16"]
    groups = {on: audit.audit(config_io.load(f"{REPO}/configs/gpt2-1.3b.yaml", [
        *sets, f"parallel.tp_comm_overlap={str(on).lower()}"]), "h100", 8)["communication"]["groups"]
        for on in (False, True)}
    for kind in ("all-gather", "reduce-scatter"):
        off, on = groups[False][f"{kind} over tensor"], groups[True][f"{kind} over tensor"]
        assert on["bytes"] == pytest.approx(off["bytes"], rel=0.01)  # the same data, chunked
        assert off["overlapped_fraction"] < 0.7 and on["overlapped_fraction"] >= 0.85, (kind, off, on)
    assert not any(k.startswith("collective-permute over tensor") for k in groups[True])


@gpu
@pytest.mark.slow  # suite time: two GPU-target compiles of a 24-layer model on a pipeline (about a minute)
def test_tp_comm_overlap_hides_the_tensor_collectives_under_zero_bubble_on_h100():
    """As above with the zero_bubble schedule: B's chunked matmuls leave the weight gradients to W, which gathers
    its blocks under its own GEMMs. The row-parallel matmuls' output gradients are gathered twice (B and W), so
    more all-gather bytes; measured 41% -> 77% of them and 1% -> 80% of the reduce-scatters' under GEMMs, and
    the exposed tensor time more than halved."""
    sets = ["parallel.data=2", "parallel.pipeline=2", "parallel.tensor=2", "parallel.sequence_parallel=true",
            "parallel.schedule=zero_bubble", "train.micro_batch_size=1", "train.global_batch_size=16"]
    groups = {on: audit.audit(config_io.load(f"{REPO}/configs/gpt2-1.3b.yaml", [
        *sets, f"parallel.tp_comm_overlap={str(on).lower()}"]), "h100", 8)["communication"]["groups"]
        for on in (False, True)}
    gathered = {on: g["all-gather over tensor"] for on, g in groups.items()}
    scattered = {on: g["reduce-scatter over tensor"] for on, g in groups.items()}
    assert gathered[True]["bytes"] < 1.4 * gathered[False]["bytes"]
    assert scattered[True]["bytes"] == pytest.approx(scattered[False]["bytes"], rel=0.01)
    assert gathered[True]["overlapped_fraction"] >= 0.7 > 0.5 > gathered[False]["overlapped_fraction"]
    assert scattered[True]["overlapped_fraction"] >= 0.75 > 0.1 > scattered[False]["overlapped_fraction"]
    exposed = {on: gathered[on]["exposed_s"] + scattered[on]["exposed_s"] for on in (False, True)}
    assert exposed[True] < 0.6 * exposed[False]


@gpu
@pytest.mark.slow  # suite time: two GPU-target compiles of a 24-layer model
def test_fp8_collective_matmuls_move_fp8_blocks_on_h100():
    """gpt2-1.3b as above in FP8 (hybrid, bf16 compute): with parallel.tp_comm_overlap the ring GEMMs are FP8 GEMMs
    (twice the sites, the same FP8 share of the FLOPs) and the blocks a ring gathers (x forward and again for the
    weight gradient, dy of a row-parallel matmul) travel in FP8, the partial sums in bf16: per layer and micro
    batch 14 ring steps' worth of s / t x h bytes against 20 in bf16, all of it with GEMMs under it. Without the
    rings the reduce-scatters of the partial sums are bf16 too (`fp8.dot` writes the compute dtype): 4 per layer and
    micro batch of s x h x 2 bytes (plus the head's)."""
    reports = {on: audit.audit(config_io.load(f"{REPO}/configs/gpt2-1.3b.yaml", [
        "parallel.data=4", "parallel.tensor=2", "train.micro_batch_size=1", "train.global_batch_size=16",
        "parallel.sequence_parallel=true", "model.fp8=hybrid", "model.compute_dtype=bfloat16",
        f"parallel.tp_comm_overlap={str(on).lower()}"]), "h100", 8) for on in (False, True)}
    layers, micro, s, h = 24, 4, 2048, 2048
    ring = reports[True]["communication"]["groups"]["collective-permute over tensor"]
    assert ring["bytes"] == pytest.approx(layers * micro * 14 * (s // 2) * h, rel=0.01)
    assert ring["overlapped_fraction"] >= 0.9
    scattered = reports[False]["communication"]["groups"]["reduce-scatter over tensor"]["bytes"]
    assert layers * micro * 4 * s * h * 2 <= scattered < 1.05 * layers * micro * 4 * s * h * 2
    fp8 = {on: r["fp8"] for on, r in reports.items()}
    assert fp8[True]["fp8_gemms"] == 2 * fp8[False]["fp8_gemms"] >= 40
    assert fp8[True]["fp8_flop_share"] == pytest.approx(fp8[False]["fp8_flop_share"], rel=1e-3)


@gpu
@pytest.mark.slow  # suite time: two GPU-target compiles of a 24-layer model
def test_tp_comm_overlap_hides_the_tensor_collectives_on_h100():
    """gpt2-1.3b, data 4 x tensor 2 with sequence parallelism, micro batch 1: with parallel.tp_comm_overlap the
    layers' all-gathers and reduce-scatters over 'tensor' become ring ppermutes (megajax/model/collective_matmul.py)
    with a GEMM scheduled under >= 90% of their bytes (measured 98.8%; as XLA schedules them, 65% of the
    all-gathers' bytes and 24% of the reduce-scatters'), and the estimated exposed tensor time falls by more than
    half (4.7 to 1.0 ms measured). Only the head's and the embedding's gathers stay collectives."""
    reports = {on: _gpt2_1_3b_h100_communication("parallel.sequence_parallel=true",
                                                 f"parallel.tp_comm_overlap={str(on).lower()}") for on in (False, True)}
    tensor = {on: {k: g for k, g in r["groups"].items() if k.endswith("over tensor")} for on, r in reports.items()}
    ring = tensor[True]["collective-permute over tensor"]
    assert "collective-permute over tensor" not in tensor[False]
    assert ring["overlapped_fraction"] >= 0.9
    gathered = sum(g["bytes"] for k, g in tensor[False].items() if k.split()[0] in ("all-gather", "reduce-scatter"))
    assert ring["bytes"] > 0.45 * gathered  # the same data crosses: a ring step sends what a t = 2 gather receives
    exposed = {on: sum(g["exposed_s"] for g in groups.values()) for on, groups in tensor.items()}
    assert exposed[True] < 0.5 * exposed[False]


CUDNN_LAYOUTS = {
    "d4t2-sp": ["parallel.data=4", "parallel.tensor=2", "parallel.sequence_parallel=true"],
    "d8": ["parallel.data=8"],
    "d2p2t2-interleaved": ["parallel.data=2", "parallel.pipeline=2", "parallel.tensor=2",
                           "parallel.schedule=interleaved", "parallel.virtual_stages=2", "train.micro_batch_size=2"],
    "d2c2t2-a2a-zero3": ["parallel.data=2", "parallel.context=2", "parallel.tensor=2", "parallel.context_comm=a2a",
                         "parallel.data_parallel_sharding_strategy=optim_grads_params"],
}


@gpu
@pytest.mark.parametrize("layout", [k if k == "d4t2-sp" else pytest.param(k, marks=pytest.mark.slow)
                                    for k in CUDNN_LAYOUTS])
def test_cudnn_attention_compiles_under_every_layout_on_h100(layout):
    """model.attention_impl=cudnn: the step compiles for 8 H100s with cuDNN's fused attention forward and backward
    (JAX's own partitioning of the cuDNN call fails under data 8 and tensor 2; megajax runs it shard by shard)."""
    pytest.importorskip("nvidia.cudnn", reason="needs cuDNN (nvidia-cudnn-cu12, in the gpu-audit extra)")
    cfg = config_io.load(f"{REPO}/configs/tiny.yaml", ["model.attention_impl=cudnn", "model.compute_dtype=bfloat16",
                                                       *CUDNN_LAYOUTS[layout]])
    _, _, compiled, _ = audit.compile_step(cfg, audit._gpu_devices("h100", 8))
    runs = hlo.custom_calls(compiled.as_text())
    assert runs.get("__cudnn$fmhaSoftmax", 0) >= cfg.model.num_layers
    assert runs.get("__cudnn$fmhaSoftmaxBackward", 0) >= cfg.model.num_layers
    if cfg.parallel.pipeline == 1:  # (a pipeline's ticks count every branch, and its schedule recomputes chunks)
        # one forward and one backward a layer and micro batch: the forward is not run again for the backward
        assert runs["__cudnn$fmhaSoftmax"] == runs["__cudnn$fmhaSoftmaxBackward"]


def test_xla_warnings_are_explained_as_they_are_written(capfd):
    """What the C++ side writes to file descriptor 2 during a GPU compile goes through quiet.explain_xla line by
    line: XLA's rematerialization warning gets a note on what its figures are, its sort warning (no GPU to size
    CUB's sort) one line on what it means; other lines pass as they came."""
    from megajax import quiet

    warning = (b"W1128 hlo_rematerialization.cc:3005] Can't reduce memory use below 60.67GiB (65147079554 bytes) by "
               b"rematerialization; only reduced to 65.41GiB (70232875960 bytes), down from 70.10GiB\n")
    with quiet.rewritten_stderr(quiet.explain_xla):
        os.write(2, b"an XLA line\n" + warning)
    err = capfd.readouterr().err
    assert err.startswith("an XLA line\n" + warning.decode())
    assert "note: XLA's 60.67 GiB above is its scheduling limit" in err and "needs about 65.41 GiB" in err
    sort = (b"W1207 sort_rewriter.cc:792] Missing deviceless CUB scratch size data for sort. Using fallback sort "
            b"algorithm rather than SortRewriter, which will be slower at runtime. \nTo avoid this, compile with a GPU "
            b"present, or add the deviceless CUB data for your device and CUB version to xla/backends/gpu/libraries\n")
    with quiet.rewritten_stderr(quiet.explain_xla):
        os.write(2, sort + b"after\n")
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("note: compiled without a GPU, XLA sorts") and err[1] == "after"


@gpu
@pytest.mark.slow  # (two compiles for 8 compile-only H100s: about a minute)
def test_multi_token_prediction_module_in_the_h100_program():
    """A multi-token prediction module (model.mtp_num_layers=1) is one more layer in the compiled H100 program: the
    sequence-parallel all-gathers and reduce-scatters of [b, s, d] activations over 'tensor' (counted in
    activations: XLA combines some into one collective) grow by at least the layer's 4 per micro batch, as
    audit.megatron_expected counts them, and by at most 2 more (the module's embedding lookup, its head's gather)."""
    sets = LAYOUT + ["model.compute_dtype=bfloat16", "parallel.sequence_parallel=true"]
    counts = {}
    for mtp in (0, 1):
        cfg, colls = _collectives(sets + [f"model.mtp_num_layers={mtp}"], target="h100",
                                  options={"xla_gpu_enable_pipelined_all_reduce": False})
        size = _act_bytes(cfg)
        counts[mtp] = {k: sum(c.bytes // size * c.count for c in colls if c.kind == k and c.axes == ("tensor",))
                       for k in ("all-gather", "reduce-scatter")}
        counts[mtp]["expected"] = audit.megatron_expected(cfg)["all-gather"]["count"]
    m = cfg.num_micro_batches
    assert counts[1]["expected"] - counts[0]["expected"] == 4 * m
    for kind in ("all-gather", "reduce-scatter"):
        assert 4 * m <= counts[1][kind] - counts[0][kind] <= 6 * m, counts
