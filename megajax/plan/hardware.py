"""The GPUs the planner knows: every rate its time model uses, each from a microbenchmark or a datasheet (never
fitted to a training step), with its source. docs/guides/choosing-a-layout.md lists them in a table.

Memory size, HBM bandwidth and SM count come from the compile-only target files (megajax/targets/*.txtpb, the same
descriptions XLA compiles against); the rest is here.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

from megajax.config import ConfigError

GIB = 2**30
_ROOT = Path(__file__).resolve().parents[2]
_H100_MATMUL = "benchmarks/h100/2026-11-27/matmul.json"
_H100_KERNELS = "benchmarks/h100/2026-11-27/kernels.json"


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One GPU kind and its node. Rates are FLOP/s or bytes/s per GPU; `sources` says where each comes from."""

    name: str
    peak_flops: float  # dense bf16 datasheet peak (MFU's denominator)
    gemm_flops: dict  # {"bfloat16": ..., "float8": ...}: a large GEMM's rate (before wave quantization)
    sms: int  # streaming multiprocessors: the GEMM's wave quantization
    hbm_bytes_per_s: float  # datasheet HBM bandwidth
    elementwise_bytes_per_s: float  # what memory-bound fused kernels reach (norms, activations, the loss, AdamW)
    memory_bytes: float  # HBM capacity
    attention_flops: dict  # fused attention forward + backward FLOP/s by (head dim, sequence) measured
    nvlink_bus_bytes_per_s: float  # NCCL bus bandwidth of a collective inside a node
    network_bytes_per_s: float  # per GPU (one NIC each), per direction, across nodes
    sources: dict

    def gemm_seconds(self, m: int, k: int, n: int, dtype: str = "bfloat16", batch: float = 1.0) -> float:
        """Seconds of a batch of `batch` [m, k] x [k, n] GEMMs run as one kernel (batched or grouped): 2 m k n
        FLOPs each at the large-GEMM rate times the wave efficiency (output tiles of 128 x 256 spread over the SMs
        in whole waves: 1.1 waves of tiles take 2), at least the time to read the operands and write the results
        once."""
        if min(m, k, n) <= 0:
            return 0.0
        tiles = math.ceil(batch * math.ceil(m / 128) * math.ceil(n / 256))
        waves = math.ceil(tiles / self.sms)
        flops = 2.0 * m * k * n * batch
        compute = flops / (self.gemm_flops[dtype] * tiles / (waves * self.sms))
        size = 1 if dtype == "float8" else 2
        traffic = batch * (size * (m * k + k * n) + 2 * m * n)
        return max(compute, traffic / self.hbm_bytes_per_s)

    def attention_rate(self, head_dim: int, seq: int) -> float:
        """The fused attention kernel's forward + backward FLOP/s (causal FLOPs, backward 2.5 forwards) at the
        nearest measured head dim, between its measured sequence lengths in log2(seq) (at the nearest one outside
        them): a short sequence gives each program less work, a long one more."""
        dim = min({d for d, _ in self.attention_flops}, key=lambda d: abs(d - head_dim))
        points = sorted((math.log2(s), r) for (d, s), r in self.attention_flops.items() if d == dim)
        x = math.log2(max(seq, 1))
        if x <= points[0][0]:
            return points[0][1]
        for (x0, r0), (x1, r1) in zip(points, points[1:]):
            if x <= x1:
                return r0 + (r1 - r0) * (x - x0) / (x1 - x0)
        return points[-1][1]


def _target(name: str) -> dict:
    text = (_ROOT / "megajax" / "targets" / f"{name}.txtpb").read_text()
    return {key: float(re.search(rf"{key}:\s*([0-9.e+]+)", text).group(1))
            for key in ("memory_bandwidth", "device_memory_size", "core_count")}


# H100 SXM microbenchmarks (scripts/bench_matmul.py, scripts/bench_kernels.py, 2026-11-27); tests/test_plan.py
# checks these against the raw rows in benchmarks/h100/.
H100_SQUARE_GEMM = {"bfloat16": 812.87e12, "float8": 1288.06e12}  # matmul.json: 8192 x 8192 x 8192
H100_SQUARE_WAVES = 2048 / (16 * 132)  # that GEMM's wave efficiency: 2048 tiles in 16 waves of 132 SMs
# kernels.json: the faster of Pallas and cuDNN at gpt2-124m's, llama-1b's, gpt2-1.3b's and llama 8k's shapes
H100_ATTENTION = {(64, 1024): 176.87e12, (64, 2048): 266.44e12, (128, 2048): 334.71e12, (128, 8192): 512.42e12}
H100_NORM_BYTES_PER_S = 2115.3e9  # kernels.json: median norm fwd+bwd (XLA, Pallas) at widths 2048 and 4096
# Bekman, ml-engineering, MAMF v2 table: the best GEMM shape's bf16 TFLOP/s
A100_MAMF, H100_MAMF = 271.2e12, 794.5e12
A100_SQUARE_WAVES = 2048 / (19 * 108)  # a square 8192 GEMM on 108 SMs: 2048 tiles in 19 waves
A100_STREAM_BYTES_PER_S = 1737e9  # RRZE-HPC/gpu-benches gpu-stream/a100_80.txt, scale
# The A100's GEMM rate as a share of that best-shape estimate, fitted to the SC21 paper's ten Table 1 runs: the factor
# whose predictions of them have a geometric-mean error of zero (megajax.plan.checks.a100_calibration; a test fits it
# again). Without it every run was predicted 7.6-18.8% fast: Megatron's GEMMs on those shapes (fp16, 2021) ran
# below the best shape's rate, which nothing here has measured on an A100.
A100_GEMM_CALIBRATION = 0.846


def _build(name: str) -> Hardware:
    t = _target(name)
    if name == "a100":
        hbm = t["memory_bandwidth"]
        # no square-8192 measurement on an A100: its best-shape rate (MAMF) times the H100's square 8192 over its
        # MAMF, at most 1 (the H100's square 8192 measured back to back reaches its MAMF: 812.9 against 794.5)
        square = A100_MAMF * min(1.0, H100_SQUARE_GEMM["bfloat16"] / H100_MAMF)
        return Hardware(
            name="A100 SXM 80GB", peak_flops=312e12,
            gemm_flops={"bfloat16": square / A100_SQUARE_WAVES * A100_GEMM_CALIBRATION},
            sms=int(t["core_count"]),
            hbm_bytes_per_s=hbm, elementwise_bytes_per_s=A100_STREAM_BYTES_PER_S,
            memory_bytes=t["device_memory_size"], attention_flops={(64, 2048): 140e12, (128, 2048): 155e12},
            nvlink_bus_bytes_per_s=234.9e9, network_bytes_per_s=24e9,
            sources={
                "peak_flops": "NVIDIA A100 datasheet (312 TFLOP/s bf16 dense)",
                "gemm_flops": "Bekman, ml-engineering, Maximum Achievable Matmul FLOPS (v2 table): A100 SXM 271.2, "
                              "H100 SXM 794.5 TFLOP/s; the A100's square 8192 at its MAMF, as the H100's reaches its own "
                              "(812.9 measured, benchmarks/h100/2026-11-27/matmul.json), times "
                              f"{A100_GEMM_CALIBRATION} fitted to the SC21 paper's Table 1 (A100_GEMM_CALIBRATION)",
                "hbm_bytes_per_s": "megajax/targets/a100.txtpb (2039 GB/s, the datasheet)",
                "elementwise_bytes_per_s": "RRZE-HPC/gpu-benches gpu-stream on an A100 80GB: scale kernel 1737 GB/s "
                                           "(no megajax kernel was measured on an A100)",
                "attention_flops": "FlashAttention-2 (Dao 2023) fig. on A100: causal fwd+bwd at s 2k, 140 (d 64), "
                                   "155 (d 128) TFLOP/s",
                "nvlink_bus_bytes_per_s": "NCCL all_reduce_perf busbw on one DGX A100, 234.9 GB/s "
                                          "(stas00/ml-engineering network/README.md)",
                "network_bytes_per_s": "NVIDIA: 192 GB/s all-reduce busbw across DGX A100s with 8 HDR NICs "
                                       "(NVIDIA/nccl#812), per NIC 24 GB/s",
            })
    if name not in ("h100", "h200"):
        raise ConfigError(f"--target {name}: the planner knows a100, h100 and h200")
    h100 = _target("h100")
    return Hardware(
        name="H100 SXM 80GB" if name == "h100" else "H200 SXM 141GB", peak_flops=989.4e12, gemm_flops={k: v / H100_SQUARE_WAVES for k, v in H100_SQUARE_GEMM.items()},
        sms=int(t["core_count"]), hbm_bytes_per_s=t["memory_bandwidth"],
        # the H200's HBM3e is faster; its fusions are assumed to reach the H100's fraction of it
        elementwise_bytes_per_s=H100_NORM_BYTES_PER_S * t["memory_bandwidth"] / h100["memory_bandwidth"],
        memory_bytes=t["device_memory_size"], attention_flops=H100_ATTENTION,
        nvlink_bus_bytes_per_s=370e9, network_bytes_per_s=47e9,
        sources={
            "peak_flops": "NVIDIA H100 SXM datasheet (989.4 TFLOP/s bf16 dense)",
            "gemm_flops": f"{_H100_MATMUL}: square 8192 GEMM, bf16 and FP8, measured (over its 97% wave efficiency)",
            "hbm_bytes_per_s": f"megajax/targets/{name}.txtpb (the datasheet)",
            "elementwise_bytes_per_s": f"{_H100_KERNELS}: median norm forward + backward at widths 2048-4096"
                                       + (", scaled by the H200's HBM" if name == "h200" else ""),
            "attention_flops": f"{_H100_KERNELS}: the faster of Pallas and cuDNN flash attention, fwd+bwd, at "
                               "s 1024 and 2048 (head dim 64), 2048 and 8192 (128)",
            "nvlink_bus_bytes_per_s": "NCCL ring busbw on 8 H100s, about 370 GB/s without NVLink SHARP "
                                      "(NVIDIA/nccl-tests#212)",
            "network_bytes_per_s": "NCCL on NDR 400 Gb/s: 46-48 GB/s per NIC (NVIDIA/nccl-tests#290)",
        })


_CACHE: dict[str, Hardware] = {}


def hardware(name: str) -> Hardware:
    """The planner's description of GPU kind `name` (a100, h100, h200)."""
    if name not in _CACHE:
        _CACHE[name] = _build(name)
    return _CACHE[name]
