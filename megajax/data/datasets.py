"""From `data.*` config to the train/valid/test sample sources, as Megatron's
BlendedMegatronDatasetBuilder does it:

  * each prefix is opened and checked (files, format, non-empty, every token id < model.vocab_size)
  * data.split ("949,50,1") cuts every dataset's sequences into train/valid/test ranges
  * one prefix: a GPTDataset per split, of the requested sample count
  * several: a GPTDataset per (prefix, split) asking for ceil(ceil(n * w) * 1.005) samples, blended by a
    BlendedDataset of sum(ceil(n * w)) samples; unweighted prefixes are weighted by their token counts

Everything that can be wrong with the data fails here, before anything compiles.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from megajax.config import Config
from megajax.data.blended import BlendedDataset, normalize
from megajax.data.corpus import bundled_prefix, default_cache_dir
from megajax.data.gpt_dataset import GPTDataset
from megajax.data.index_cache import IndexCache, describe, digest
from megajax.data.indexed import DataError, IndexedDataset, require_pair, strip_suffix
from megajax.data.tokenizers import eod_of, resolve

SPLITS = ("train", "valid", "test")
SURPLUS = 0.005  # Megatron's mid_level_dataset_surplus: extra samples built per blended dataset


@dataclasses.dataclass
class Split:
    """One split's samples and how to turn them into batches. `split[i]` -> int64 [seq_length + 1]."""

    name: str
    dataset: GPTDataset | BlendedDataset
    seq_length: int
    vocab_size: int
    eod_mask_id: int | None = None  # zero the loss where the input token is this id (data.eod_mask_loss)
    documents: tuple[str, ...] = ()  # the packed documents' fields its batches carry (DataConfig.document_fields)
    document_eod: int | None = None  # the end-of-document token that separates them

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.dataset[i]


def documents(tokens: np.ndarray, eod: int, positions: bool) -> dict[str, np.ndarray]:
    """The packed documents of token rows [b, s]: their segment ids (a token after an end-of-document token starts
    a new document; the end token belongs to the one it ends) and, with `positions`, positions that restart at 0
    in each document. int32 [b, s] each."""
    ends = (np.asarray(tokens) == eod).astype(np.int32)
    segments = np.cumsum(ends, axis=1, dtype=np.int32) - ends
    out = {"segment_ids": segments}
    if positions:
        index = np.broadcast_to(np.arange(segments.shape[1], dtype=np.int32), segments.shape)
        starts = np.where(np.diff(segments, axis=1, prepend=-1) != 0, index, 0)
        out["positions"] = (index - np.maximum.accumulate(starts, axis=1)).astype(np.int32)
    return out


def parse_blend(paths: Sequence) -> tuple[list[str], list[float] | None]:
    """[a] / [a, b] / [0.3, a, 0.7, b] -> (prefixes, weights or None); '.bin'/'.idx' suffixes dropped."""
    if all(isinstance(p, str) for p in paths):
        return [strip_suffix(p) for p in paths], None
    return [strip_suffix(p) for p in paths[1::2]], [float(w) for w in paths[::2]]


def split_matrix(split: str) -> list[tuple[float, float] | None]:
    """'949,50,1' -> [(0, .949), (.949, .999), (.999, 1.0)]; a zero-weight split is None (Megatron's
    parse_and_normalize_split + convert_split_vector_to_split_matrix)."""
    weights = [float(s) for s in split.split(",")]
    weights = normalize(weights + [0.0] * (3 - len(weights)))
    bounds = [0.0]
    for w in weights:
        bounds.append(bounds[-1] + w)
    return [(a, b) if b > a else None for a, b in zip(bounds[:-1], bounds[1:])]


def split_range(bookend: tuple[float, float], num_sequences: int) -> tuple[int, int]:
    return int(round(bookend[0] * num_sequences)), int(round(bookend[1] * num_sequences))


def index_cache(cfg: Config, prefix: str) -> IndexCache:
    """data.index_cache_dir if set; else beside the data, falling back to data.cache_dir/indices."""
    if cfg.data.index_cache_dir:
        return IndexCache([cfg.data.index_cache_dir])
    fallback = Path(cfg.data.cache_dir) if cfg.data.cache_dir else default_cache_dir()
    return IndexCache([Path(prefix).resolve().parent / "cache" / "megajax_indices", fallback / "indices"])


def open_checked(prefix: str, vocab_size: int, cache: IndexCache) -> IndexedDataset:
    """Opens a dataset and checks that it can train a model of `vocab_size` (a full pass over the
    tokens the first time; the result is cached, keyed by the files' index digest, size and mtime)."""
    ds = IndexedDataset(prefix)
    if len(ds) == 0 or ds.num_tokens == 0:
        raise DataError(f"{ds.idx_path}: the dataset is empty ({len(ds)} sequences, {ds.num_tokens} tokens)")
    if ds.dtype.kind not in "iu":
        raise DataError(f"{ds.idx_path}: dtype {ds.dtype} holds no token ids (expected an integer dtype)")
    stat = os.stat(ds.bin_path)
    description = {"class": "TokenRange", "lengths": digest(ds.sequence_lengths), "bin_size": stat.st_size,
                   "bin_mtime_ns": stat.st_mtime_ns, "dtype": ds.dtype.str}
    stem = f"{describe(description)}-TokenRange"
    cached = cache.load(stem, description, ["range"])
    if cached is None:
        cached = {"range": np.asarray(ds.token_range(), np.int64)}
        cache.save(stem, description, cached)
    lo, hi = (int(x) for x in cached["range"])
    if lo < 0:
        raise DataError(f"{ds.bin_path}: negative token id {lo}: the file is corrupt or not token data")
    if hi >= vocab_size:
        raise DataError(f"{ds.bin_path}: token id {hi} >= model.vocab_size={vocab_size}: the file is damaged, or "
                        "it was tokenized with another tokenizer than the model's (preprocess it again with "
                        "data.tokenizer's); only if that tokenizer really has more tokens, raise model.vocab_size "
                        "to its vocabulary size")
    return ds


def check_paths(cfg: Config) -> None:
    """Raises DataError naming the first file of data.paths that is missing (each prefix needs its .bin and .idx),
    before a run writes anything."""
    for prefix in parse_blend(cfg.data.paths)[0]:
        require_pair(prefix)


def build_datasets(cfg: Config, num_samples: dict[str, int]) -> dict[str, Split]:
    """The splits named in `num_samples` ({"train": n, "valid": m}) that data.split gives data to.

    The train split must exist; a requested valid/test split with zero weight is left out.
    """
    prefixes, weights = parse_blend(cfg.data.paths)
    if not prefixes:
        prefixes = [bundled_prefix(resolve(cfg.data.tokenizer), cfg.data.cache_dir)]
    caches = [index_cache(cfg, p) for p in prefixes]
    indexed = [open_checked(p, cfg.model.vocab_size, c) for p, c in zip(prefixes, caches)]
    matrix = split_matrix(cfg.data.split)
    if "train" in num_samples and matrix[0] is None:
        raise DataError(f"data.split={cfg.data.split!r} gives the train split no data")
    eod = eod_of(cfg.data.tokenizer) if cfg.data.eod_mask_loss else None
    out = {}
    for i, name in enumerate(SPLITS):
        if name not in num_samples or matrix[i] is None:
            continue
        n = num_samples[name]
        ranges = [split_range(matrix[i], len(ds)) for ds in indexed]
        if len(indexed) == 1 and weights is None:
            dataset = GPTDataset(indexed[0], ranges[0], cfg.model.seq_length, n, cfg.train.seed, name, caches[0])
        else:
            dataset = _blend(cfg, indexed, ranges, weights, n, name, caches)
        fields = cfg.data.document_fields
        out[name] = Split(name, dataset, cfg.model.seq_length, cfg.model.vocab_size, eod, fields,
                          eod_of(cfg.data.tokenizer) if fields else None)
    return out


def _blend(cfg: Config, indexed: list[IndexedDataset], ranges: list[tuple[int, int]],
           weights: list[float] | None, size: int, name: str, caches: list[IndexCache]) -> BlendedDataset:
    if weights is None:  # Megatron weighs unweighted prefixes by their size; tokens are the fair measure
        weights = [float(ds.sequence_lengths[lo:hi].sum(dtype=np.int64)) for ds, (lo, hi) in zip(indexed, ranges)]
        if min(weights) <= 0:
            empty = indexed[int(np.argmin(weights))]
            raise DataError(f"{empty.idx_path}: the {name} split of this dataset has no tokens")
    weights = normalize(weights)
    targets = [math.ceil(size * w) for w in weights]
    mids = [GPTDataset(ds, r, cfg.model.seq_length, math.ceil(t * (1 + SURPLUS)), cfg.train.seed, name, c)
            for ds, r, t, c in zip(indexed, ranges, targets, caches)]
    return BlendedDataset(mids, weights, sum(targets), name, caches[0])
