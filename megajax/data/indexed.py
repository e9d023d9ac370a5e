"""Megatron's indexed dataset (`prefix.bin` + `prefix.idx`): a memmap reader that checks the files before
trusting them, and a streaming writer whose output is byte for byte what Megatron-LM's builder writes.

The .idx layout (little-endian), as megatron/core/datasets/indexed_dataset.py writes it:
    magic      b"MMIDIDX\\x00\\x00"   9 bytes
    version    u64 = 1
    dtype      u8 code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    N          u64 number of sequences
    D          u64 number of entries in the document index (documents + 1)
    lengths    int32[N]  tokens per sequence
    pointers   int64[N]  byte offset of each sequence in .bin (exclusive prefix sum of lengths * itemsize)
    doc_index  int64[D]  sequence index where each document starts (first 0, last N)
(multimodal files append int8[N] sequence modes; they are read, the modes ignored.)
The .bin holds the concatenated token ids of every sequence in that dtype. A GPT dataset made by
preprocessing has one sequence per non-empty document; an empty document adds a document-index entry and
no sequence.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from megajax.config import InputError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32), 8: np.dtype(np.uint16),
}
CODE_OF = {v: k for k, v in DTYPE_CODES.items()}
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # 34
_CHUNK = 1 << 22  # entries per chunk when streaming index arrays (bounded memory for any dataset size)
_SPOOL = 1 << 16  # the writer's buffered lengths / document ends go to disk every this many entries


class DataError(InputError):
    """A data file or data setting that cannot be used; the message names the file and the problem."""


def token_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice (DType.optimal_dtype): uint16 when the vocabulary is below 65500, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def strip_suffix(prefix: str | os.PathLike) -> str:
    """'data/x.bin' or 'data/x.idx' -> 'data/x' (users often paste a file name for a prefix)."""
    p = str(prefix)
    return p[:-4] if p.endswith((".bin", ".idx")) else p


def exists(prefix: str | os.PathLike) -> bool:
    p = strip_suffix(prefix)
    return os.path.isfile(p + ".bin") and os.path.isfile(p + ".idx")


def require_pair(prefix: str | os.PathLike) -> None:
    """Raises DataError naming the first of prefix.idx, prefix.bin that is missing."""
    p = strip_suffix(prefix)
    for path in (p + ".idx", p + ".bin"):
        if not os.path.isfile(path):
            raise DataError(f"{path}: file not found (an indexed dataset is the pair {p}.bin/.idx; "
                            "python -m megajax.data.preprocess writes them)")


class IndexedDataset:
    """Read-only view of prefix.bin/.idx. `ds[i]` is sequence i as a NumPy array (a memmap view, no copy).

    Attributes as Megatron names them: `sequence_lengths` int32[N], `sequence_pointers` int64[N],
    `document_indices` int64[D], `dtype`. Opening checks the header, the sizes of both files and that the
    index is self-consistent, so a truncated or mismatched pair fails here with the file named.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = strip_suffix(prefix)
        self.idx_path, self.bin_path = self.prefix + ".idx", self.prefix + ".bin"
        require_pair(self.prefix)
        self._read_index(self.idx_path)
        self._check_bin()
        size = os.path.getsize(self.bin_path)
        self._bin = np.memmap(self.bin_path, dtype=self.dtype, mode="r") if size else np.zeros(0, self.dtype)

    def _read_index(self, path: str) -> None:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            header = f.read(HEADER_BYTES)
        if len(header) < len(MAGIC) or header[: len(MAGIC)] != MAGIC:
            raise DataError(f"{path}: wrong magic {header[:len(MAGIC)]!r}, expected {MAGIC!r}: "
                            "not a Megatron indexed-dataset .idx file")
        if len(header) < HEADER_BYTES:
            raise DataError(f"{path}: truncated header ({size} bytes, need {HEADER_BYTES})")
        version, code, n, d = struct.unpack("<QBQQ", header[len(MAGIC):])
        if version != VERSION:
            raise DataError(f"{path}: index version {version} is not supported (only version {VERSION})")
        if code not in DTYPE_CODES:
            raise DataError(f"{path}: unknown dtype code {code} (known: "
                            + ", ".join(f"{k} {v}" for k, v in DTYPE_CODES.items()) + ")")
        need = HEADER_BYTES + 12 * n + 8 * d
        if size < need:
            raise DataError(f"{path}: truncated: {n} sequences and {d} document entries need {need} bytes, "
                            f"the file has {size}")
        self.dtype = DTYPE_CODES[code]
        buf = np.memmap(path, dtype=np.uint8, mode="r")
        self.sequence_lengths = np.frombuffer(buf, np.int32, n, HEADER_BYTES)
        self.sequence_pointers = np.frombuffer(buf, np.int64, n, HEADER_BYTES + 4 * n)
        self.document_indices = np.frombuffer(buf, np.int64, d, HEADER_BYTES + 12 * n)
        docs = self.document_indices
        if d == 0 or docs[0] != 0 or docs[-1] != n:
            raise DataError(f"{path}: corrupt document index (it must run from 0 to the {n} sequences, "
                            f"found {docs[0] if d else 'nothing'} .. {docs[-1] if d else ''})")
        if np.any(np.diff(docs) < 0):
            raise DataError(f"{path}: corrupt document index (not sorted)")

    def _check_bin(self) -> None:
        """Lengths non-negative, pointers the prefix sums of the lengths, .bin exactly that long."""
        itemsize, n = self.dtype.itemsize, len(self.sequence_lengths)
        offset = 0
        for lo in range(0, n, _CHUNK):
            lengths = self.sequence_lengths[lo: lo + _CHUNK].astype(np.int64)
            if lengths.min() < 0:
                raise DataError(f"{self.idx_path}: corrupt index (negative sequence length)")
            ends = offset + np.cumsum(lengths) * itemsize
            starts = np.concatenate([[offset], ends[:-1]])
            bad = np.flatnonzero(self.sequence_pointers[lo: lo + _CHUNK] != starts)
            if len(bad):
                i = lo + int(bad[0])
                raise DataError(f"{self.idx_path}: corrupt index: sequence {i} starts at byte "
                                f"{int(self.sequence_pointers[i])}, the lengths put it at {int(starts[bad[0]])}")
            offset = int(ends[-1])
        size = os.path.getsize(self.bin_path)
        if size != offset:
            what = "truncated" if size < offset else "longer than its index"
            raise DataError(f"{self.bin_path}: {what}: the index describes {offset} bytes "
                            f"({offset // itemsize} {self.dtype} tokens), the file has {size} "
                            "(is this .bin from a different run than its .idx?)")

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, i: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(i, slice):
            return [self.get(j) for j in range(*i.indices(len(self)))]
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence i (Megatron's IndexedDataset.get)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"{self.prefix}: sequence {i} out of range ({n} sequences)")
        size = int(self.sequence_lengths[i])
        length = size - offset if length is None else length
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize + offset
        return self._bin[start: start + length]

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def token_range(self) -> tuple[int, int]:
        """(smallest, largest) token id in the .bin, read in chunks (a full pass over the data)."""
        lo, hi = None, None
        for start in range(0, len(self._bin), 1 << 26):
            part = self._bin[start: start + (1 << 26)]
            lo = int(part.min()) if lo is None else min(lo, int(part.min()))
            hi = int(part.max()) if hi is None else max(hi, int(part.max()))
        return (0, -1) if lo is None else (lo, hi)


class IndexedDatasetWriter:
    """Builds prefix.bin/.idx incrementally, as Megatron's IndexedDatasetBuilder does:

        with IndexedDatasetWriter("out/corpus_text_document", np.uint16) as w:
            w.add_document(tokens)             # one sequence, then end the document
            w.add_item(a); w.add_item(b); w.end_document()   # a document of two sequences
            w.add_documents(flat, lengths)    # many documents at once (the fast path)

    Memory stays flat however large the output: the index arrays are spooled to temporary files and
    assembled at `close()`. Files are written under temporary names and renamed at close, so a crash never
    leaves a half-written dataset under the final name.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype | type = np.uint16):
        self.prefix = strip_suffix(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF:
            raise DataError(f"{self.prefix}: token dtype {self.dtype} has no Megatron dtype code")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        tag = f".tmp{os.getpid()}"
        self._tmp = {k: self.prefix + f".{k}{tag}" for k in ("bin", "idx", "lengths", "docs")}
        self._bin = open(self._tmp["bin"], "wb")
        self._lengths_file = open(self._tmp["lengths"], "wb")
        self._docs_file = open(self._tmp["docs"], "wb")
        self._lengths: list[int] = []  # buffered, spooled every _SPOOL entries
        self._docs: list[int] = []
        self.num_sequences = 0
        self.num_documents = 0
        self.num_tokens = 0
        self._doc_end = 0  # sequence count at the last document end
        self._closed = False

    def _check_range(self, arr: np.ndarray) -> None:
        if arr.size and self.dtype.kind in "iu" and arr.dtype != self.dtype:
            info = np.iinfo(self.dtype)
            lo, hi = int(arr.min()), int(arr.max())
            if lo < info.min or hi > info.max:
                raise DataError(f"{self.prefix}: token ids in [{lo}, {hi}] do not fit {self.dtype}")

    def add_item(self, tokens: Sequence[int] | np.ndarray) -> None:
        """One sequence (of the current document)."""
        arr = np.asarray(tokens)
        self._check_range(arr)
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes())
        self._append_lengths([int(arr.size)])

    def end_document(self) -> None:
        self._docs.append(self.num_sequences)
        self._doc_end = self.num_sequences
        self.num_documents += 1
        if len(self._docs) >= _SPOOL:
            self._flush()

    def add_document(self, tokens: Sequence[int] | np.ndarray, lengths: Sequence[int] | None = None) -> None:
        """A whole document: `lengths` splits it into sequences (default: one sequence, none if empty)."""
        arr = np.asarray(tokens)
        if lengths is None:
            lengths = [arr.size] if arr.size else []
        if sum(lengths) != arr.size:
            raise ValueError(f"sequence lengths {list(lengths)} do not add up to the {arr.size} tokens")
        self._check_range(arr)
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes())
        self._append_lengths(lengths)
        self.end_document()

    def add_documents(self, flat: np.ndarray, sequence_lengths: np.ndarray,
                      sequences_per_document: np.ndarray | None = None) -> None:
        """Many documents at once (the preprocessor's fast path): their concatenated tokens, the length
        of every sequence, and how many sequences each document has (default: one per length, where a
        length of 0 is an empty document with no sequence, as Megatron's preprocessing writes it)."""
        flat, lengths = np.asarray(flat), np.asarray(sequence_lengths, np.int64)
        if int(lengths.sum()) != flat.size:
            raise ValueError(f"sequence lengths add up to {int(lengths.sum())}, not the {flat.size} tokens")
        if sequences_per_document is None:
            sequences_per_document = (lengths > 0).astype(np.int64)
            lengths = lengths[lengths > 0]
        counts = np.asarray(sequences_per_document, np.int64)
        if int(counts.sum()) != len(lengths):
            raise ValueError(f"{int(counts.sum())} sequences in the documents, {len(lengths)} lengths given")
        self._check_range(flat)
        self._bin.write(flat.astype(self.dtype, copy=False).tobytes())
        base = self.num_sequences
        self._append_lengths(lengths.tolist())
        self._docs.extend((base + np.cumsum(counts)).tolist())
        self._doc_end = self.num_sequences
        self.num_documents += len(counts)
        if len(self._docs) >= _SPOOL:
            self._flush()

    def add_index(self, prefix: str | os.PathLike) -> None:
        """Appends a whole existing dataset (Megatron's add_index: merging preprocessed shards)."""
        other = IndexedDataset(prefix)
        if self._doc_end != self.num_sequences:
            self.end_document()
        if other.dtype != self.dtype:
            raise DataError(f"{other.idx_path}: dtype {other.dtype} differs from this dataset's {self.dtype}")
        base = self.num_sequences
        for lo in range(0, len(other), _CHUNK):
            self._append_lengths(other.sequence_lengths[lo: lo + _CHUNK].tolist())
        for lo in range(1, len(other.document_indices), _CHUNK):
            self._docs.extend((base + other.document_indices[lo: lo + _CHUNK]).tolist())
            self._flush()
        self.num_documents += other.num_documents
        self._doc_end = self.num_sequences
        with open(other.bin_path, "rb") as f:
            shutil.copyfileobj(f, self._bin, 1 << 24)

    def _append_lengths(self, lengths: Sequence[int]) -> None:
        self._lengths.extend(lengths)
        self.num_sequences += len(lengths)
        self.num_tokens += int(sum(lengths))
        if len(self._lengths) >= _SPOOL:
            self._flush()

    def _flush(self) -> None:
        self._lengths_file.write(np.asarray(self._lengths, np.int32).tobytes())
        self._docs_file.write(np.asarray(self._docs, np.int64).tobytes())
        self._lengths, self._docs = [], []

    def close(self) -> None:
        """Writes the .idx and moves both files to their final names."""
        if self._closed:
            return
        if self._doc_end != self.num_sequences:
            self.end_document()  # trailing items belong to a last document (the reader requires it)
        self._flush()
        for f in (self._bin, self._lengths_file, self._docs_file):
            f.close()
        self._write_idx()
        os.replace(self._tmp["bin"], self.prefix + ".bin")
        os.replace(self._tmp["idx"], self.prefix + ".idx")
        for k in ("lengths", "docs"):
            os.remove(self._tmp[k])
        self._closed = True

    def _write_idx(self) -> None:
        n, d = self.num_sequences, self.num_documents + 1
        itemsize = self.dtype.itemsize
        with open(self._tmp["idx"], "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<QBQQ", VERSION, CODE_OF[self.dtype], n, d))
            lengths = np.memmap(self._tmp["lengths"], np.int32, "r") if n else np.zeros(0, np.int32)
            for lo in range(0, n, _CHUNK):
                f.write(lengths[lo: lo + _CHUNK].tobytes())
            offset = 0
            for lo in range(0, n, _CHUNK):
                ends = offset + np.cumsum(lengths[lo: lo + _CHUNK], dtype=np.int64) * itemsize
                f.write(np.concatenate([[offset], ends[:-1]]).astype(np.int64).tobytes())
                offset = int(ends[-1])
            del lengths
            f.write(np.zeros(1, np.int64).tobytes())  # the document index starts at sequence 0
            with open(self._tmp["docs"], "rb") as docs:
                shutil.copyfileobj(docs, f, 1 << 24)

    def abort(self) -> None:
        """Drops everything written so far (no files are left behind)."""
        for f in (self._bin, self._lengths_file, self._docs_file):
            f.close()
        for path in self._tmp.values():
            if os.path.exists(path):
                os.remove(path)
        self._closed = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
