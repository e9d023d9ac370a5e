"""Measuring like the paper: FLOPs per step, TFLOP/s per device, MFU, tokens/s; stdout, JSONL, TensorBoard.

FLOPs are counted from the architecture (GQA, SwiGLU, padded vocabulary). For GPT-2 style models they
reduce to the papers' formulas:
  model FLOPs     72 B s L h^2 (1 + s/(6h) + V/(12 L h))   (Korthikanti et al.: no recomputation; for MFU)
  hardware FLOPs  96 B s L h^2 (1 + s/(6h) + V/(16 L h))   (Narayanan et al., full recomputation)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import struct
import time
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from megajax.config import ConfigError, ModelConfig
from megajax.config.model import layer_forward_flops_per_token
from megajax.kernels import auto as kernel_choice

# dense peak FLOP/s per GPU by compute dtype (float32 matmuls run as TF32 on these GPUs)
PEAK_FLOPS = {
    "A100": {"bfloat16": 312e12, "float16": 312e12, "float32": 156e12},
    "H100": {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 494.7e12},
    "H200": {"bfloat16": 989.4e12, "float16": 989.4e12, "float32": 494.7e12},
}


def step_flops(cfg: ModelConfig, tokens: int, pipelined: bool = False, platform: str | None = "cpu"
               ) -> dict[str, float]:
    """Model FLOPs (3x forward: for MFU) and hardware FLOPs (with recomputation: for TFLOP/s) of a step on
    `platform` ("cpu", "gpu", None: read as a GPU).

    The pipeline executor always recomputes each layer's forward before its backward (it stashes only
    layer inputs), so a pipelined step counts as full recomputation, plus the attention core once more
    with model.recompute=selective where the core is not a fused kernel (kernels.auto.fused_attention).
    """
    dense, core = layer_forward_flops_per_token(cfg)
    # the multi-token prediction modules (model.mtp_num_layers): a layer, eh_proj [2d, d] and the logits each
    mtp = cfg.mtp_num_layers
    layers = cfg.num_layers + mtp
    layer_fwd = layers * (dense + core) + mtp * 2 * 2 * cfg.hidden_size ** 2
    logits_fwd = (1 + mtp) * 2 * cfg.hidden_size * cfg.padded_vocab_size
    model = 3 * (layer_fwd + logits_fwd) * tokens
    hardware = model
    if cfg.recompute == "full" or pipelined:
        hardware += layer_fwd * tokens
    if cfg.recompute == "selective" and not kernel_choice.fused_attention(
            cfg.attention_impl, cfg.head_dim, platform):
        hardware += layers * core * tokens
    return {"model_flops": float(model), "hardware_flops": float(hardware)}


def step_rates(flops: dict[str, float], tokens: int, step_s: float, devices: int, peak: float) -> dict[str, float]:
    """A step's throughput: tokens/s, hardware TFLOP/s per device and MFU (model FLOPs over the peak)."""
    return {"tokens_per_s": tokens / step_s,
            "tflops_per_device": flops["hardware_flops"] / step_s / devices / 1e12,
            "mfu": flops["model_flops"] / step_s / devices / peak}


def measure_cpu_peak(seconds: float = 0.1, n: int = 1024) -> float:
    """FLOP/s of fp32 n x n matmuls on this host's CPU, one per local device at once (fake CPU devices
    share the cores, so the machine's rate is what they split), measured once, for a tenth of a second (every CPU
    run pays it at start; a CPU MFU is a rough guide)."""
    devices = jax.local_devices()
    mesh = jax.sharding.Mesh(devices, ("d",))
    a = jax.device_put(np.ones((len(devices), n, n), np.float32),
                       jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
    mm = jax.jit(lambda x: jnp.einsum("bij,bjk->bik", x, x))
    mm(a).block_until_ready()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        mm(a).block_until_ready()
        count += 1
    return 2 * n**3 * len(devices) * count / (time.perf_counter() - start)


def device_peak(compute_dtype: str) -> tuple[float, str]:
    """(peak FLOP/s per device, where the number comes from)."""
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", "") or ""
    for name, table in PEAK_FLOPS.items():
        if name in kind.upper():
            return table[compute_dtype], f"{name} {compute_dtype} datasheet"
    if dev.platform == "cpu":
        local = max(1, len(jax.local_devices()))
        return measure_cpu_peak() / local, f"measured fp32 matmul on this CPU / {local} devices"
    return math.nan, f"unknown device {kind!r}"


def setup_logging(process_index: int) -> None:
    """Python logging for the `megajax` loggers (megajax.data's index building, cache warnings), set once per
    process: process 0 at INFO, the others at WARNING, one line per record on stderr. Where the user (or a test
    harness) has put handlers on the root or `megajax` logger, the records go there instead."""
    import logging

    logger = logging.getLogger("megajax")
    logger.setLevel(logging.INFO if process_index == 0 else logging.WARNING)
    if not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)


class MetricsLogger:
    """One line per log step on stdout, one JSON object per line in metrics.jsonl, TensorBoard scalars, and
    Weights & Biases when `wandb` (project, name, config) is given.

    Only process 0 writes; the others are silent. A resumed run logs to the same W&B run (its id is kept in
    <output_dir>/wandb_run_id).
    """

    def __init__(self, output_dir: str | os.PathLike, enabled: bool = True, wandb: dict | None = None):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if enabled:
            out = Path(output_dir)
            out.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(out / "metrics.jsonl", "a", buffering=1)
            self._tb = TensorBoardEvents(out / "tensorboard")
            if wandb is not None:
                self._wandb = _wandb_run(out, **wandb)

    def log(self, record: dict, line: str | None = None) -> None:
        if not self.enabled:
            return
        if line:
            print(line, flush=True)
        self._jsonl.write(json.dumps(record) + "\n")
        step = record.get("step", 0)
        scalars = {k: v for k, v in record.items()
                   if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
        if self._tb is not None:
            self._tb.scalars(scalars, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def info(self, message: str) -> None:
        if self.enabled:
            print(message, flush=True)

    def close(self) -> None:
        """Closes every sink, even when one fails (a full disk): the first failure is raised after the rest."""
        with contextlib.ExitStack() as sinks:
            if self._wandb is not None:
                sinks.callback(self._wandb.finish)
            if self._tb is not None:
                sinks.callback(self._tb.close)
            if self._jsonl:
                sinks.callback(self._jsonl.close)


class TensorBoardEvents:
    """TensorBoard's scalars, written as TensorBoard reads them (tensorflow/core/util/event.proto) without
    TensorFlow, tensorboardX or torch: an events.out.tfevents.* file of TFRecords (length, its masked CRC-32C, the
    record, its masked CRC-32C), each an Event protocol buffer; the first holds the file version, each later one a
    step's scalars. Written and flushed in the caller's thread, so a failed write (a full disk) raises there."""

    def __init__(self, logdir: str | os.PathLike):
        os.makedirs(logdir, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.megajax"
        self._file = open(os.path.join(logdir, name), "ab")
        self._write(_pb_field(1, 1, struct.pack("<d", time.time())) + _pb_field(3, 2, b"brain.Event:2"))

    def scalars(self, values: dict, step: int) -> None:
        # Summary.Value: tag (1, string), simple_value (2, float); Summary: value (1, repeated)
        summary = b"".join(_pb_field(1, 2, _pb_field(1, 2, k.encode()) + _pb_field(2, 5, struct.pack("<f", v)))
                           for k, v in values.items())
        # Event: wall_time (1, double), step (2, int64), summary (5)
        self._write(_pb_field(1, 1, struct.pack("<d", time.time())) + _pb_field(2, 0, int(step))
                    + _pb_field(5, 2, summary))

    def _write(self, record: bytes) -> None:
        length = struct.pack("<Q", len(record))
        self._file.write(length + struct.pack("<I", _masked_crc(length)) + record
                         + struct.pack("<I", _masked_crc(record)))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _pb_field(number: int, wire: int, value) -> bytes:
    """One protocol-buffer field: wire 0 an int (varint), 1 and 5 fixed bytes, 2 length-delimited bytes."""
    key = _varint(number << 3 | wire)
    if wire == 0:
        return key + _varint(value)
    return key + (_varint(len(value)) + value if wire == 2 else value)


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # the Castagnoli polynomial, reflected
        table.append(c)
    return table


_CRC32C = _crc32c_table()


def _masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC-32C."""
    c = 0xFFFFFFFF
    for b in data:
        c = _CRC32C[(c ^ b) & 0xFF] ^ (c >> 8)
    c ^= 0xFFFFFFFF
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def require_wandb() -> None:
    """Every process checks before training that the W&B client is there (process 0 alone would fail later)."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError("train.wandb_project is set but wandb is not installed: pip install -e '.[wandb]' "
                          "(or unset train.wandb_project)") from None


def _wandb_run(out: Path, project: str, name: str | None, config: dict):
    require_wandb()
    import wandb

    id_file = out / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id + "\n")
    return wandb.init(project=project, name=name or out.resolve().name, id=run_id, resume="allow", dir=str(out),
                      config=config)


def format_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:d}:{s:02d}"
