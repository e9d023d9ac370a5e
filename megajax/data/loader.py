"""Global batches on the mesh: each process reads only the rows its devices hold.

A batch of the run is the samples [consumed, consumed + global_batch) of the split's GPT dataset, so the
tokens a step sees depend on (seed, data, consumed samples) and never on the layout or host count.
"""

from __future__ import annotations

import numpy as np
import jax
from jax.sharding import NamedSharding

from megajax.config import Config
from megajax.data.corpus import bundled_prefix
from megajax.data.gpt_dataset import GPTDataset, split_ranges
from megajax.data.indexed import DataError, IndexedDataset
from megajax.data.tokenizers import get_tokenizer

SPLITS = ("train", "valid", "test")


def open_indexed(cfg: Config) -> IndexedDataset:
    """The dataset named by data.paths (one prefix for now), or the bundled corpus."""
    paths = cfg.data.paths
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    if not paths:
        prefix = bundled_prefix(tokenizer, cfg.data.cache_dir)
    elif len(paths) == 1:
        prefix = str(paths[0])
    else:
        raise DataError("blending several data.paths is not supported yet: give one prefix")
    ds = IndexedDataset(prefix)
    if len(ds) and int(max(ds.get(i).max(initial=0) for i in range(min(len(ds), 64)))) >= cfg.model.vocab_size:
        raise DataError(f"{prefix}: token ids reach past model.vocab_size={cfg.model.vocab_size}: "
                        "set model.vocab_size to the tokenizer's vocabulary")
    return ds


def build_datasets(cfg: Config, num_samples: dict[str, int]) -> dict[str, GPTDataset]:
    indexed = open_indexed(cfg)
    ranges = split_ranges(indexed.num_documents, cfg.data.split)
    out = {}
    for name, rng in zip(SPLITS, ranges):
        if name in num_samples and rng[1] > rng[0]:
            out[name] = GPTDataset(indexed, rng, cfg.model.seq_length, num_samples[name],
                                   seed=cfg.train.seed, name=name)
    return out


def batch_shapes(global_batch: int, seq_length: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    return {
        "tokens": ((global_batch, seq_length), np.dtype(np.int32)),
        "targets": ((global_batch, seq_length), np.dtype(np.int32)),
        "loss_mask": ((global_batch, seq_length), np.dtype(np.float32)),
        "sample_ids": ((global_batch,), np.dtype(np.int32)),
    }


def host_rows(dataset: GPTDataset, first: int, rows: range) -> dict[str, np.ndarray]:
    """The batch fields for sample indices first + r, r in rows."""
    samples = np.stack([dataset[first + r] for r in rows]) if len(rows) else np.zeros((0, dataset.seq_length + 1))
    return {
        "tokens": samples[:, :-1].astype(np.int32),
        "targets": samples[:, 1:].astype(np.int32),
        "loss_mask": np.ones(samples[:, 1:].shape, np.float32),
        "sample_ids": np.asarray([first + r for r in rows], np.int32),
    }


def global_batch(dataset: GPTDataset, consumed: int, global_batch_size: int,
                 shardings: dict[str, NamedSharding]) -> dict[str, jax.Array]:
    """Samples [consumed, consumed + global_batch_size) as global arrays sharded by `shardings`.

    Only the rows held by this process's devices are read (each once, however many devices hold them).
    """
    seq = dataset.seq_length
    shapes = batch_shapes(global_batch_size, seq)
    cache: dict[tuple[int, int], dict[str, np.ndarray]] = {}

    def rows_for(index) -> dict[str, np.ndarray]:
        sl = index[0]
        start, stop, _ = sl.indices(global_batch_size)
        if (start, stop) not in cache:
            cache[(start, stop)] = host_rows(dataset, consumed, range(start, stop))
        return cache[(start, stop)]

    return {
        name: jax.make_array_from_callback(shape, shardings[name], lambda idx, n=name: rows_for(idx)[n][
            (slice(None),) + tuple(idx[1:])])
        for name, (shape, _) in shapes.items()
    }
