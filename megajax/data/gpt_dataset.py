"""Megatron's GPT dataset: fixed-length samples cut across document boundaries, in a seeded order.

Three index arrays, with the semantics of megatron/core/datasets/gpt_dataset.py and helpers.cpp:
  document index  the split's sequences repeated for as many epochs as the requested samples need, shuffled
                  with RandomState(seed); when the last epoch would be less than 80% used it is shuffled
                  separately, so the partial epoch is a uniform draw of its own
  sample index    [num_samples + 1, 2]: (position in the document index, token offset) where sample i
                  starts; sample i is tokens [i * seq_length, (i + 1) * seq_length] of the concatenated
                  stream (seq_length + 1 tokens: inputs and shifted targets), so consecutive samples share
                  one token and every token of every epoch is used once as a target
  shuffle index   a permutation of the samples (the separate last epoch's samples shuffled separately)
Megatron builds the sample index with a C++ loop; here it is a vectorised searchsorted over the cumulative
document lengths, equal entry for entry (tests/test_data.py checks it against a slow replica of the loop).
The indices are cached on disk (index_cache.py), keyed by a hash of everything they depend on.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from megajax.data.index_cache import IndexCache, describe, digest
from megajax.data.indexed import DataError, IndexedDataset

log = logging.getLogger("megajax.data")
_CHUNK = 1 << 22
FORMAT = 1  # bump when the index construction changes, so old caches miss


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    """int32 [num_epochs * len(documents)]: the documents of every epoch, shuffled (Megatron's order of
    RandomState draws: all but the last epoch first, then the last, when separated)."""
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(documents.astype(np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate([first, last])


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int, num_epochs: int,
                       tokens_per_epoch: int) -> np.ndarray:
    """[num_samples + 1, 2] (document-index position, offset) of every sample start; num_samples is
    (num_epochs * tokens_per_epoch - 1) // seq_length (the last partial sample dropped).

    Equal to helpers.cpp's build_sample_idx: a start that falls on a document boundary points at the
    first token of the next non-empty document, except entry 0, which is always (0, 0).
    """
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    big = max(len(document_index), int(sizes.max(initial=0))) > np.iinfo(np.int32).max
    out = np.empty((num_samples + 1, 2), np.int64 if big else np.int32)
    doc_sizes = np.asarray(sizes)[document_index].astype(np.int64)
    ends = np.cumsum(doc_sizes)
    for lo in range(0, num_samples + 1, _CHUNK):
        pos = np.arange(lo, min(lo + _CHUNK, num_samples + 1), dtype=np.int64) * seq_length
        doc = np.searchsorted(ends, pos, side="right")  # skips empty documents, as the C++ loop does
        out[lo: lo + len(pos), 0] = doc
        out[lo: lo + len(pos), 1] = pos - (ends[doc] - doc_sizes[doc])
    out[0] = 0
    return out


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """A permutation of [0, num_samples) followed by one of [num_samples, total_size)."""
    dtype = np.int64 if total_size >= np.iinfo(np.uint32).max - 1 else np.uint32
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate([first, last])


def num_epochs_for(tokens_per_epoch: int, num_samples: int | None, seq_length: int) -> int:
    """Epochs needed for num_samples samples of seq_length + 1 tokens (1 when num_samples is None)."""
    if num_samples is None:
        return 1
    requested = num_samples * seq_length + 1
    return max(1, -(-requested // tokens_per_epoch))


class GPTDataset:
    """Samples of seq_length + 1 tokens from the sequences [lo, hi) of an IndexedDataset.

    `ds[i]` -> int64 [seq_length + 1] (inputs are [:-1], targets [1:]); `len(ds)` >= num_samples (all
    samples of the epochs built). num_samples None builds exactly one epoch.
    """

    def __init__(self, indexed: IndexedDataset, sequence_range: tuple[int, int], seq_length: int,
                 num_samples: int | None, seed: int, name: str = "train", cache: IndexCache | None = None):
        self.indexed, self.seq_length, self.name = indexed, seq_length, name
        self.num_samples, self.seed = num_samples, seed
        lo, hi = sequence_range
        if not 0 <= lo <= hi <= len(indexed):
            raise DataError(f"{indexed.prefix}: sequence range [{lo}, {hi}) outside the {len(indexed)} sequences")
        self.documents = np.arange(lo, hi, dtype=np.int32)
        self.tokens_per_epoch = int(indexed.sequence_lengths[lo:hi].sum(dtype=np.int64))
        if self.tokens_per_epoch <= seq_length:
            raise DataError(f"{indexed.prefix}: the {name} split has {hi - lo} sequences and "
                            f"{self.tokens_per_epoch} tokens, fewer than one sample of {seq_length + 1}: "
                            "use more data, a shorter model.seq_length, or change data.split")
        self.description = {
            "class": "GPTDataset", "format": FORMAT, "lengths": digest(indexed.sequence_lengths[lo:hi]),
            "range": [lo, hi], "seq_length": seq_length, "num_samples": num_samples, "seed": seed,
            "split": name,
        }
        stem = f"{describe(self.description)}-GPTDataset-{name}"
        names = ("document_index", "sample_index", "shuffle_index")
        arrays = cache.load(stem, self.description, names) if cache else None
        if arrays is None:
            t0 = time.perf_counter()
            arrays = dict(zip(names, self._build()))
            log.info("built the %s indices of %s (%d samples) in %.2f s", name, indexed.prefix,
                     len(arrays["shuffle_index"]), time.perf_counter() - t0)
            if cache:
                cache.save(stem, self.description, arrays)
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        self._check_indices()

    def _build(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        seq, tpe, n = self.seq_length, self.tokens_per_epoch, self.num_samples
        num_epochs = num_epochs_for(tpe, n, seq)
        separate_final_epoch = False
        if num_epochs > 1:
            sans_final = ((num_epochs - 1) * tpe - 1) // seq
            per_epoch = (tpe - 1) // seq
            separate_final_epoch = n - sans_final < int(0.80 * per_epoch)
        rng = np.random.RandomState(self.seed)
        document_index = build_document_index(self.documents, num_epochs, rng, separate_final_epoch)
        sample_index = build_sample_index(self.indexed.sequence_lengths, document_index, seq, num_epochs, tpe)
        total = len(sample_index) - 1
        shuffled = ((num_epochs - 1) * tpe - 1) // seq if separate_final_epoch else total
        return document_index, sample_index, build_shuffle_index(shuffled, total, rng)

    def _check_indices(self) -> None:
        if self.num_samples is not None and len(self) < self.num_samples:
            raise DataError(f"{self.indexed.prefix}: the {self.name} index has {len(self)} samples, "
                            f"fewer than the {self.num_samples} requested")

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, idx: int) -> np.ndarray:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range: the {self.name} split of {self.indexed.prefix} has "
                             f"{len(self)} samples")
        i = int(self.shuffle_index[idx])
        (doc_beg, off_beg), (doc_end, off_end) = self.sample_index[i], self.sample_index[i + 1]
        doc_beg, off_beg, doc_end, off_end = int(doc_beg), int(off_beg), int(doc_end), int(off_end)
        get, docs = self.indexed.get, self.document_index
        if doc_beg == doc_end:
            return get(int(docs[doc_beg]), off_beg, off_end - off_beg + 1).astype(np.int64)
        parts = [get(int(docs[doc_beg]), off_beg)]
        parts += [get(int(docs[j])) for j in range(doc_beg + 1, doc_end)]
        parts.append(get(int(docs[doc_end]), 0, off_end + 1))
        return np.concatenate(parts).astype(np.int64)
