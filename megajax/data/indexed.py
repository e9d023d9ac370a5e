"""Megatron's indexed dataset (`prefix.bin` + `prefix.idx`), read with numpy memmap, and its writer.

The .idx layout (little-endian), byte for byte as Megatron-LM's MMapIndexedDataset writes it:
    magic      b"MMIDIDX\\x00\\x00"   9 bytes
    version    u64 = 1
    dtype      u8 code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    N          u64 number of sequences
    D          u64 number of entries in the document index (documents + 1)
    lengths    int32[N]  tokens per sequence
    pointers   int64[N]  byte offset of each sequence in .bin
    doc_index  int64[D]  sequence index where each document starts (first 0, last N)
The .bin holds the concatenated token ids of every sequence in that dtype.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
_HEADER = len(MAGIC) + 8 + 1 + 8 + 8


class DataError(ValueError):
    """A data file that cannot be used; the message names the file and the problem."""


def token_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 when the vocabulary fits, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


class IndexedDataset:
    """Read-only view of prefix.bin/.idx: `ds[i]` is sequence i as a NumPy array (no copy)."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        idx_path, bin_path = self.prefix + ".idx", self.prefix + ".bin"
        for path in (idx_path, bin_path):
            if not os.path.exists(path):
                raise DataError(f"{path}: file not found (expected the pair {self.prefix}.bin/.idx)")
        self._read_index(idx_path)
        bin_size = os.path.getsize(bin_path)
        itemsize = self.dtype.itemsize
        if len(self.sequence_lengths):
            last = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * itemsize
            if last > bin_size:
                raise DataError(f"{bin_path}: truncated: the index needs {last} bytes, the file has {bin_size}")
        if bin_size % itemsize:
            raise DataError(f"{bin_path}: size {bin_size} is not a multiple of the {self.dtype} token size")
        self._bin = np.memmap(bin_path, dtype=self.dtype, mode="r") if bin_size else np.zeros(0, self.dtype)

    def _read_index(self, path: str) -> None:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            header = f.read(_HEADER)
        if len(header) < _HEADER:
            raise DataError(f"{path}: truncated header ({size} bytes); not a Megatron .idx file")
        if header[: len(MAGIC)] != MAGIC:
            raise DataError(f"{path}: wrong magic {header[:len(MAGIC)]!r}, expected {MAGIC!r}: not a Megatron .idx file")
        version, code, n, d = struct.unpack("<QBQQ", header[len(MAGIC):])
        if version != VERSION:
            raise DataError(f"{path}: index version {version} is not supported (only version {VERSION})")
        if code not in DTYPE_CODES:
            raise DataError(f"{path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
        need = _HEADER + 4 * n + 8 * n + 8 * d
        if size < need:
            raise DataError(f"{path}: truncated: {n} sequences and {d} document entries need {need} bytes, "
                            f"the file has {size}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        buf = np.memmap(path, dtype=np.uint8, mode="r")
        off = _HEADER
        self.sequence_lengths = np.frombuffer(buf, np.int32, n, off)
        off += 4 * n
        self.sequence_pointers = np.frombuffer(buf, np.int64, n, off)
        off += 8 * n
        self.document_indices = np.frombuffer(buf, np.int64, d, off)
        if d == 0 or self.document_indices[0] != 0 or self.document_indices[-1] != n:
            raise DataError(f"{path}: corrupt document index (must start at 0 and end at {n})")
        if n and (self.sequence_lengths.min() < 0 or np.any(np.diff(self.document_indices) < 0)):
            raise DataError(f"{path}: corrupt index (negative lengths or unsorted document index)")

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i."""
        n = int(self.sequence_lengths[i])
        length = n - offset if length is None else length
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        return self._bin[start: start + length]

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))


class IndexedDatasetWriter:
    """Builds prefix.bin/.idx incrementally: `add(tokens)` per sequence, `end_document()`, `close()`.

    Files are written under temporary names and renamed at close, so a crash never leaves a half-written
    dataset under the final name.
    """

    def __init__(self, prefix: str | os.PathLike, dtype=np.uint16):
        self.prefix = str(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF:
            raise DataError(f"{self.prefix}: token dtype {self.dtype} has no Megatron dtype code")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = f"{self.prefix}.bin.tmp{os.getpid()}"
        self._bin = open(self._bin_tmp, "wb")
        self._lengths: list[int] = []
        self._doc_index = [0]

    def add(self, tokens) -> None:
        arr = np.asarray(tokens)
        if arr.size and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            lo, hi = int(arr.min()), int(arr.max())
            if lo < info.min or hi > info.max:
                raise DataError(f"{self.prefix}: token ids in [{lo}, {hi}] do not fit {self.dtype}")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes())
        self._lengths.append(int(arr.size))

    def end_document(self) -> None:
        self._doc_index.append(len(self._lengths))

    def add_document(self, tokens) -> None:
        self.add(tokens)
        self.end_document()

    def close(self) -> None:
        if self._doc_index[-1] != len(self._lengths):
            self.end_document()
        self._bin.close()
        lengths = np.asarray(self._lengths, np.int32)
        pointers = np.zeros(len(lengths), np.int64)
        if len(lengths):
            pointers[1:] = np.cumsum(lengths[:-1], dtype=np.int64) * self.dtype.itemsize
        tmp_idx = f"{self.prefix}.idx.tmp{os.getpid()}"
        with open(tmp_idx, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<QBQQ", VERSION, CODE_OF[self.dtype], len(lengths), len(self._doc_index)))
            f.write(lengths.tobytes())
            f.write(pointers.tobytes())
            f.write(np.asarray(self._doc_index, np.int64).tobytes())
        os.replace(self._bin_tmp, self.prefix + ".bin")
        os.replace(tmp_idx, self.prefix + ".idx")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.close()
        else:
            self._bin.close()
            os.remove(self._bin_tmp)
