"""The audit proves that tensor and sequence parallelism move exactly Megatron's bytes: per layer and
micro batch 2 all-reduces forward and 2 backward (or all-gather + reduce-scatter pairs with sequence
parallelism) of [b, s, d], and one gradient reduction over 'data' per step."""

import json
import subprocess
import sys

import jax
import pytest

from megajax import audit, config as config_lib, hlo

from conftest import REPO, cli_env

LAYOUT = ["parallel.data=2", "parallel.tensor=4"]


def _collectives(sets, target="cpu"):
    cfg = config_lib.load(f"{REPO}/configs/tiny.yaml", sets)
    devices = jax.devices() if target == "cpu" else audit._gpu_devices(target, 8)
    cfg, mesh, compiled, _ = audit.compile_step(cfg, devices)
    return cfg, hlo.parse(compiled.as_text(), dict(mesh.shape))


def _act_bytes(cfg):
    m = cfg.model
    return cfg.micro_batch_size(cfg.parallel.data) * m.seq_length * m.hidden_size * (
        2 if m.compute_dtype == "bfloat16" else 4)


def _in_layer_loop(colls, kind, size):
    """Executions per step of `kind` over 'tensor' moving one [b, s, d] activation, inside the layer scans."""
    return sum(c.count for c in colls if c.kind == kind and c.axes == ("tensor",) and c.bytes == size
               and c.count > 1)


def _check_data_reduction(colls):
    data = [c for c in colls if "data" in c.axes and c.kind in ("all-reduce", "reduce-scatter")]
    big = [c for c in data if c.bytes > 1024]
    assert len(big) == 1 and big[0].count == 1, "one gradient reduction over 'data' per step"


def test_tensor_parallel_all_reduces_on_cpu():
    cfg, colls = _collectives(LAYOUT)
    expect = audit.megatron_expected(cfg)["all-reduce"]
    assert expect["count"] == 4 * cfg.model.num_layers
    assert _in_layer_loop(colls, "all-reduce", _act_bytes(cfg)) == expect["count"]
    _check_data_reduction(colls)


def test_full_recompute_all_reduces_one_less_than_megatron():
    """Megatron recomputes both forward all-reduces of a layer; XLA drops the recomputed MLP output's,
    which no backward reads: 5 per layer instead of 6."""
    cfg, colls = _collectives(LAYOUT + ["model.recompute=full"])
    assert audit.megatron_expected(cfg)["all-reduce"]["count"] == 6 * cfg.model.num_layers
    assert _in_layer_loop(colls, "all-reduce", _act_bytes(cfg)) == 5 * cfg.model.num_layers


def _gpu_available():
    try:
        audit._gpu_devices("h100", 8)
        return True
    except Exception:
        return False


gpu = pytest.mark.skipif(not _gpu_available(), reason="jax-cuda12-plugin (the gpu-audit extra) is not installed")


@gpu
def test_tensor_parallel_on_h100_target():
    cfg, colls = _collectives(LAYOUT + ["model.compute_dtype=bfloat16"], target="h100")
    expect = audit.megatron_expected(cfg)["all-reduce"]
    assert _in_layer_loop(colls, "all-reduce", _act_bytes(cfg)) == expect["count"] == 16
    _check_data_reduction(colls)


@gpu
def test_sequence_parallel_on_h100_target_is_all_gather_plus_reduce_scatter():
    cfg, colls = _collectives(LAYOUT + ["model.compute_dtype=bfloat16", "parallel.sequence_parallel=true"],
                              target="h100")
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
def test_distributed_optimizer_reduce_scatters_gradients_over_data():
    _, colls = _collectives(LAYOUT + ["model.compute_dtype=bfloat16", "parallel.distributed_optimizer=true"],
                            target="h100")
    rs = [c for c in colls if c.kind == "reduce-scatter" and c.axes == ("data",)]
    ag = [c for c in colls if c.kind == "all-gather" and c.axes == ("data",)]
    assert rs and ag and all(c.count == 1 for c in rs + ag)
    assert not [c for c in colls if c.kind == "all-reduce" and c.axes == ("data",) and c.bytes > 4096]


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
