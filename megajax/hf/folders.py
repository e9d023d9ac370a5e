"""Hugging Face model folders on disk: the safetensors weights (one file, or shards listed by
model.safetensors.index.json), read tensor by tensor and written in shards, and the tokenizer and generation
files that travel with them. NumPy only (safetensors' NumPy API; bfloat16 through ml_dtypes, registered by the
import below); the layouts and names are megajax/hf/weights.py's."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy, so safetensors' NumPy API reads and writes it)
import numpy as np

from megajax.hf.errors import ConversionError, read_json

# Tokenizer and generation files copied along with the weights in both directions.
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json")


class SafetensorsReader:
    """The tensors of an HF model folder: model.safetensors, or the shards that
    model.safetensors.index.json lists. Tensors are read one at a time, when asked for."""

    def __init__(self, model_dir: str | Path, arch: str):
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

    @staticmethod
    def _canonical(name: str, arch: str) -> str:
        if arch == "gpt2" and not name.startswith(("transformer.", "lm_head.")):
            return "transformer." + name
        return name

    def names(self) -> list[str]:
        return list(self._files)

    def get(self, name: str) -> np.ndarray | None:
        if name not in self._files:
            return None
        stored, file = self._files[name]
        if file not in self._handles:
            path = self.dir / file
            if not path.exists():
                raise ConversionError(f"tensor {name!r} is listed in model.safetensors.index.json in {file}, "
                                      f"but {path} does not exist")
            with self._safe(path):
                self._handles[file] = self._open(path, framework="numpy")
        with self._safe(self.dir / file):
            return self._handles[file].get_tensor(stored)

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
