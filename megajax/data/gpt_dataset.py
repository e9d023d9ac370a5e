"""Megatron's GPT dataset: fixed-length samples cut across document boundaries, in a seeded order.

Three index arrays, built as Megatron-LM builds them (megatron/core/datasets/gpt_dataset.py):
  document index  the documents of the split repeated for as many epochs as the samples need, shuffled
                  (the last epoch separately when less than 80% of it is used)
  sample index    [num_samples + 1, 2]: (position in the document index, token offset) where each sample
                  starts; sample i spans seq_len + 1 tokens and overlaps the next by one (input/target shift)
  shuffle index   a permutation of the samples (the last epoch's shuffled separately, as above)
The order depends only on the seed, the data and the requested sample count, never on the mesh.
"""

from __future__ import annotations

import numpy as np

from megajax.data.indexed import DataError, IndexedDataset


def split_ranges(num_documents: int, split: str) -> list[tuple[int, int]]:
    """Megatron's document split: '949,50,1' -> [(0, a), (a, b), (b, n)] for train, valid, test."""
    weights = [float(s) for s in split.split(",")]
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    weights = [w / total for w in weights]
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * num_documents)))
    diff = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(documents.astype(np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate([first, last])


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int,
                       num_samples: int) -> np.ndarray:
    """[num_samples + 1, 2] (document-index position, offset). Vectorised form of Megatron's C++ loop:
    sample i starts at token i * seq_length of the concatenated epoch stream."""
    doc_sizes = sizes[document_index].astype(np.int64)
    ends = np.cumsum(doc_sizes)
    starts = ends - doc_sizes
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc = np.searchsorted(ends, positions, side="right")
    if doc[-1] >= len(document_index):
        raise DataError(f"not enough tokens for {num_samples} samples of {seq_length} tokens")
    return np.stack([doc, positions - starts[doc]], axis=1).astype(np.int64)


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    first = np.arange(num_samples, dtype=np.int64)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=np.int64)
    rng.shuffle(last)
    return np.concatenate([first, last])


class GPTDataset:
    """Samples of seq_length + 1 tokens from the documents [doc_range) of an IndexedDataset.

    `ds[i]` -> int64 array [seq_length + 1]; tokens are sample[:-1] and targets sample[1:].
    """

    def __init__(self, indexed: IndexedDataset, doc_range: tuple[int, int], seq_length: int,
                 num_samples: int, seed: int, name: str = "train"):
        self.indexed, self.seq_length, self.name = indexed, seq_length, name
        lo, hi = doc_range
        documents = np.arange(lo, hi, dtype=np.int32)
        # one sequence per document (Megatron's GPT datasets): sequence i is document i
        sizes = indexed.sequence_lengths
        tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64)) if len(documents) else 0
        if tokens_per_epoch <= seq_length:
            raise DataError(f"{indexed.prefix}: the {name} split has {len(documents)} documents and "
                            f"{tokens_per_epoch} tokens, fewer than one sample of {seq_length + 1}: "
                            "use more data, a shorter model.seq_length, or change data.split")
        num_epochs = 1
        while (num_epochs * tokens_per_epoch - 1) // seq_length < num_samples:
            num_epochs += 1
        separate_final_epoch = False
        if num_epochs > 1:
            samples_sans_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
            samples_per_epoch = (tokens_per_epoch - 1) // seq_length
            separate_final_epoch = num_samples - samples_sans_final < int(0.80 * samples_per_epoch)
        rng = np.random.RandomState(seed)
        self.document_index = build_document_index(documents, num_epochs, rng, separate_final_epoch)
        total = (num_epochs * tokens_per_epoch - 1) // seq_length
        self.sample_index = build_sample_index(sizes, self.document_index, seq_length, total)
        shuffled = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length if separate_final_epoch else total
        self.shuffle_index = build_shuffle_index(shuffled, total, rng)
        self.num_samples = num_samples

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, idx: int) -> np.ndarray:
        i = int(self.shuffle_index[idx % len(self.shuffle_index)])
        (doc_beg, off_beg), (doc_end, off_end) = self.sample_index[i], self.sample_index[i + 1]
        if doc_beg == doc_end:
            return np.asarray(self.indexed.get(int(self.document_index[doc_beg]), int(off_beg),
                                               int(off_end - off_beg + 1)), np.int64)
        parts = [self.indexed.get(int(self.document_index[doc_beg]), int(off_beg))]
        for j in range(doc_beg + 1, doc_end):
            parts.append(self.indexed.get(int(self.document_index[j])))
        parts.append(self.indexed.get(int(self.document_index[doc_end]), 0, int(off_end + 1)))
        return np.concatenate(parts).astype(np.int64)
