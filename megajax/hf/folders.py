"""Hugging Face model folders on disk: the safetensors weights (one file, or shards listed by
model.safetensors.index.json), read tensor by tensor and written in shards, and the tokenizer and generation
files that travel with them. NumPy only (safetensors' NumPy API; bfloat16 through ml_dtypes, registered by the
import below); the layouts and names are megajax/hf/weights.py's.

FP8 weights with block scales (DeepSeek-V3's released folders: e4m3 weights, each beside a `<name>_scale_inv`
of one fp32 factor per weight_block_size block, config.json's quantization_config) are read dequantized, in fp32:
weight x its block's factor. safetensors' NumPy API cannot read FP8 (NumPy has no such dtype), so those tensors
are read from the file's bytes as ml_dtypes' float8."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any

import ml_dtypes  # (also registers bfloat16 with NumPy, so safetensors' NumPy API reads and writes it)
import numpy as np

from megajax.hf.errors import ConversionError, read_json

# FP8 weights: safetensors' dtype names, and each weight's block scales beside it (DeepSeek-V3's folders).
FP8_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
SCALE_SUFFIX = "_scale_inv"
# Tokenizer and generation files copied along with the weights in both directions.
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")


class SafetensorsReader:
    """The tensors of an HF model folder: model.safetensors, or the shards that
    model.safetensors.index.json lists. Tensors are read one at a time, when asked for."""

    def __init__(self, model_dir: str | Path, arch: str, weight_block: tuple[int, int] = (128, 128)):
        """weight_block: the rows and columns of an FP8 weight's scale block (config.json's
        quantization_config.weight_block_size)."""
        from safetensors import safe_open

        self._open = safe_open
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        single = self.dir / "model.safetensors"
        if index.exists():
            files = read_json(index).get("weight_map")
            if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
                raise ConversionError(f"{index}: no weight_map of tensor name -> file name (a damaged or hand-written "
                                      "index: save the model again with save_pretrained)")
            if any(Path(f).name != f for f in files.values()):
                raise ConversionError(f"{index}: weight_map names files outside the model folder")
        elif single.exists():
            with self._safe(single):
                with safe_open(single, framework="numpy") as f:
                    files = {name: single.name for name in f.keys()}
        else:
            raise ConversionError(f"{self.dir} has no model.safetensors or model.safetensors.index.json "
                                  "(PyTorch .bin weights are not read: save them with safe_serialization=True)")
        # Original GPT-2 checkpoints name tensors without the "transformer." prefix that
        # GPT2LMHeadModel.save_pretrained writes.
        self._files = {self._canonical(n, arch): (n, file) for n, file in files.items()}
        self._handles: dict[str, Any] = {}
        self.weight_block = tuple(weight_block)

    @staticmethod
    def _canonical(name: str, arch: str) -> str:
        if arch == "gpt2" and not name.startswith(("transformer.", "lm_head.")):
            return "transformer." + name
        return name

    def names(self) -> list[str]:
        """The tensors' names, less the FP8 weights' scales (read with their weights)."""
        return [n for n in self._files if not (n.endswith(SCALE_SUFFIX) and n[:-len(SCALE_SUFFIX)] in self._files)]

    def get(self, name: str) -> np.ndarray | None:
        if name not in self._files:
            return None
        stored, file = self._files[name]
        handle = self._handle(name, file)
        with self._safe(self.dir / file):
            if handle.get_slice(stored).get_dtype() not in FP8_DTYPES:
                return handle.get_tensor(stored)
            w = self._fp8(stored, file)
        scale = self.get(name + SCALE_SUFFIX)
        if scale is None:
            raise ConversionError(f"{self.dir}: FP8 tensor {name!r} has no block scales {name + SCALE_SUFFIX!r}: "
                                  "megajax reads FP8 weights with DeepSeek-V3's block scales only; dequantize the "
                                  "folder to bf16 first")
        return self._dequantized(name, w, scale)

    def _handle(self, name: str, file: str):
        if file not in self._handles:
            path = self.dir / file
            if not path.exists():
                raise ConversionError(f"tensor {name!r} is listed in model.safetensors.index.json in {file}, "
                                      f"but {path} does not exist")
            with self._safe(path):
                self._handles[file] = self._open(path, framework="numpy")
        return self._handles[file]

    def _fp8(self, stored: str, file: str) -> np.ndarray:
        """An FP8 tensor from the file's bytes (its header's offsets), as ml_dtypes' float8."""
        path = self.dir / file
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            entry = json.loads(f.read(size))[stored]
            start, end = entry["data_offsets"]
            f.seek(8 + size + start)
            data = f.read(end - start)
        dtype = FP8_DTYPES[entry["dtype"]]
        return np.frombuffer(data, dtype).reshape(entry["shape"])

    def _dequantized(self, name: str, w: np.ndarray, scale: np.ndarray) -> np.ndarray:
        """w [rows, cols] (FP8) x each block's factor scale [ceil(rows / br), ceil(cols / bc)], in fp32."""
        br, bc = self.weight_block
        want = tuple(-(-d // b) for d, b in zip(w.shape, (br, bc)))
        if w.ndim != 2 or tuple(scale.shape) != want:
            raise ConversionError(f"{self.dir}: FP8 tensor {name!r} of shape {tuple(w.shape)} has scales "
                                  f"{name + SCALE_SUFFIX!r} of shape {tuple(scale.shape)}, not {want} for blocks of "
                                  f"{br} x {bc} (config.json's quantization_config.weight_block_size)")
        factors = np.repeat(np.repeat(scale.astype(np.float32), br, axis=0), bc, axis=1)
        return w.astype(np.float32) * factors[:w.shape[0], :w.shape[1]]

    @staticmethod
    @contextlib.contextmanager
    def _safe(path: Path):
        """safetensors' own errors (a header claiming more bytes than the file has, offsets past the end, shapes
        that disagree with the bytes, bad JSON, an unknown dtype) as one line naming the file."""
        try:
            yield
        except ConversionError:
            raise
        except Exception as e:  # noqa: BLE001  (safetensors_rust.SafetensorError has no importable base)
            what = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise ConversionError(f"{path}: not a readable safetensors file ({what}): download or save it again") \
                from None


def parse_size(text: str) -> int:
    """'5GB', '500MB', '64KiB' or a byte count -> bytes."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(I?)B?", text.strip().upper())
    if not m:
        raise ConversionError(f"size {text!r} must look like 5GB, 500MB, 64KiB or a number of bytes")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2) or " "))


def write_safetensors(tensors: dict[str, np.ndarray], out_dir: str | Path, max_shard_bytes: int) -> list[str]:
    """Writes model.safetensors, or model-0000i-of-0000n.safetensors and the index json when the tensors
    exceed max_shard_bytes. Returns the file names written."""
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        w = tensors[name]
        if shards[-1] and size + w.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = w
        size += w.nbytes
    metadata = {"format": "pt"}  # transformers refuses safetensors files without a known format tag
    if len(shards) == 1:
        save_file(shards[0], out_dir / "model.safetensors", metadata=metadata)
        return ["model.safetensors"]
    n = len(shards)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    for file, shard in zip(names, shards):
        save_file(shard, out_dir / file, metadata=metadata)
        weight_map.update({name: file for name in shard})
    total = sum(w.nbytes for w in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names + ["model.safetensors.index.json"]
