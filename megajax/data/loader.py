"""Global batches on the mesh: each process reads only the rows its devices hold, ahead of time.

Batch k of a run is the samples [k * B, (k + 1) * B) of the split (B the global batch size), so what a step
sees depends only on (seed, data, consumed samples), never on the layout or the number of hosts: a run
resumed at consumed sample c on another mesh sees the batches an uninterrupted run would have. Row r of
the global batch is sample c + r; the batch sharding says which rows live on which device, and each
process reads the rows of its own devices once (however many of its devices hold a row) and builds the
global arrays with jax.make_array_from_callback. `BatchLoader` does that on a background thread, a few
batches ahead, and counts the time the step loop spends waiting for it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Sharding

from megajax.data.datasets import SPLITS, Split, build_datasets, documents  # noqa: F401  (build_datasets: public)
from megajax.data.indexed import DataError

Rows = tuple[int, int]  # [start, stop) rows of the global batch


def batch_shapes(global_batch: int, seq_length: int, packed: Sequence[str] = ()
                 ) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shapes and dtypes of a batch: tokens, targets, loss_mask [b, s]; sample_ids [b]; and `packed`, the packed
    documents' fields (DataConfig.document_fields: segment_ids, positions [b, s])."""
    return {
        "tokens": ((global_batch, seq_length), np.dtype(np.int32)),
        "targets": ((global_batch, seq_length), np.dtype(np.int32)),
        "loss_mask": ((global_batch, seq_length), np.dtype(np.float32)),
        "sample_ids": ((global_batch,), np.dtype(np.int32)),
        **{name: ((global_batch, seq_length), np.dtype(np.int32)) for name in packed},
    }


def abstract_batch(cfg, shardings: dict[str, Sharding]) -> dict[str, jax.ShapeDtypeStruct]:
    """A global batch of config `cfg` as the step takes it, abstract (shapes, dtypes, `shardings`; nothing read)."""
    shapes = batch_shapes(cfg.train.global_batch_size, cfg.model.seq_length, cfg.data.document_fields)
    return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=shardings[k]) for k, (shape, dtype) in shapes.items()}


def host_rows(split: Split, first: int, rows: range) -> dict[str, np.ndarray]:
    """The batch fields of samples first + r, r in rows: tokens, targets, loss_mask [len(rows), s], sample_ids, and
    the split's packed documents' fields."""
    seq = split.seq_length
    samples = np.stack([split[first + r] for r in rows]) if len(rows) else np.zeros((0, seq + 1), np.int64)
    if samples.size and int(samples.max()) >= split.vocab_size:
        raise DataError(f"the {split.name} samples {first + rows.start}..{first + rows.stop - 1} hold token id "
                        f"{int(samples.max())} >= model.vocab_size={split.vocab_size}")
    tokens, targets = samples[:, :-1].astype(np.int32), samples[:, 1:].astype(np.int32)
    loss_mask = np.ones(tokens.shape, np.float32)
    if split.eod_mask_id is not None:
        loss_mask[tokens == split.eod_mask_id] = 0.0  # Megatron masks where the *input* is the eod
    fields = documents(tokens, split.document_eod, "positions" in split.documents) if split.documents else {}
    return {"tokens": tokens, "targets": targets, "loss_mask": loss_mask,
            "sample_ids": np.arange(first + rows.start, first + rows.stop, dtype=np.int32), **fields}


def local_rows(shardings: dict[str, Sharding], global_batch_size: int, seq_length: int) -> list[Rows]:
    """The distinct row blocks of the global batch held by this process's devices (any field: every field is split
    by its rows alike)."""
    blocks = set()
    for name, (shape, _) in batch_shapes(global_batch_size, seq_length).items():
        for index in shardings[name].addressable_devices_indices_map(shape).values():
            start, stop, _ = index[0].indices(global_batch_size)
            blocks.add((start, stop))
    return sorted(blocks)


def read_rows(split: Split, consumed: int, blocks: list[Rows]) -> dict[Rows, dict[str, np.ndarray]]:
    """Reads each block of rows once (a row is read once even if the blocks overlap)."""
    lo, hi = min(b[0] for b in blocks), max(b[1] for b in blocks)
    covered = np.zeros(hi - lo, bool)
    for a, b in blocks:
        covered[a - lo: b - lo] = True
    if covered.all():  # the usual case: one contiguous range
        fields = host_rows(split, consumed, range(lo, hi))
        return {(a, b): {k: v[a - lo: b - lo] for k, v in fields.items()} for a, b in blocks}
    return {(a, b): host_rows(split, consumed, range(a, b)) for a, b in blocks}


def assemble(host: dict[Rows, dict[str, np.ndarray]], global_batch_size: int, seq_length: int,
             shardings: dict[str, Sharding], packed: Sequence[str] = ()) -> dict[str, jax.Array]:
    """Global arrays from this process's rows (each device gets its slice of its block)."""
    def piece(name, index):
        start, stop, _ = index[0].indices(global_batch_size)
        return host[(start, stop)][name][(slice(None),) + tuple(index[1:])]

    return {name: jax.make_array_from_callback(shape, shardings[name], lambda idx, n=name: piece(n, idx))
            for name, (shape, _) in batch_shapes(global_batch_size, seq_length, packed).items()}


def global_batch(split: Split, consumed: int, global_batch_size: int,
                 shardings: dict[str, Sharding]) -> dict[str, jax.Array]:
    """Samples [consumed, consumed + global_batch_size) as global arrays sharded by `shardings`,
    read now (BatchLoader reads ahead)."""
    seq = split.seq_length
    blocks = local_rows(shardings, global_batch_size, seq)
    return assemble(read_rows(split, consumed, blocks), global_batch_size, seq, shardings, split.documents)


class BatchLoader:
    """The global batches at consumed = start, start + B, ... (< stop), read `prefetch` batches ahead on a
    background thread (prefetch 0: read when asked). `wait_s` adds up the time `next()` blocked."""

    def __init__(self, split: Split, global_batch_size: int, shardings: dict[str, Sharding], start: int = 0,
                 stop: int | None = None, prefetch: int = 2):
        self.split, self.gbs, self.shardings = split, global_batch_size, shardings
        self.consumed = start
        limit = len(split) if stop is None else min(stop, len(split))
        self._starts = iter(range(start, limit - global_batch_size + 1, global_batch_size))
        self._blocks = local_rows(shardings, global_batch_size, split.seq_length)
        self.wait_s = 0.0
        self._queue: queue.Queue = queue.Queue(maxsize=max(prefetch, 1))
        self._stop = threading.Event()
        self._thread = None
        if prefetch > 0:
            self._thread = threading.Thread(target=self._fill, name=f"megajax-{split.name}-loader", daemon=True)
            self._thread.start()

    def _load(self, consumed: int) -> dict[str, jax.Array]:
        host = read_rows(self.split, consumed, self._blocks)
        return assemble(host, self.gbs, self.split.seq_length, self.shardings, self.split.documents)

    def _fill(self) -> None:
        try:
            for consumed in self._starts:
                item = (consumed, self._load(consumed))
                if not self._put(item):
                    return
            self._put(StopIteration())
        except BaseException as e:  # handed to the consumer, raised by next()
            self._put(e)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        t0 = time.perf_counter()
        if self._thread is None:
            consumed = next(self._starts)
            batch = self._load(consumed)
        else:
            item = self._queue.get()
            if isinstance(item, BaseException):
                self._put(item)  # later calls see it again
                raise item
            consumed, batch = item
        self.wait_s += time.perf_counter() - t0
        self.consumed = consumed + self.gbs
        return batch

    def close(self) -> None:
        """Stops the background thread (batches already read are dropped)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> BatchLoader:
        return self

    def __exit__(self, *_) -> None:
        self.close()
