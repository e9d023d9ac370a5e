"""`python -m megajax.data.preprocess --input corpus.jsonl --output-prefix out/corpus --tokenizer gpt2`

Tokenizes JSON-lines text into Megatron indexed datasets, as Megatron-LM's tools/preprocess_data.py does:
one `{output_prefix}_{key}_document.bin/.idx` per JSON key, one document per line, `--append-eod` adding
the tokenizer's end-of-document id after each non-empty document. The output is byte for byte what
Megatron writes for the same token ids.

It streams: lines are read (plain or .gz), sent in batches to worker processes and written in input order
as they come back, with a bounded number of batches in flight, so memory does not grow with the input.
Progress and throughput go to stderr; the final report (documents, tokens, MB/s, tokens/s) to stdout.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import TextIO

import numpy as np

from megajax.data.indexed import DataError, IndexedDatasetWriter, token_dtype
from megajax.data.tokenizers import Tokenizer, TokenizerSpec, resolve

BATCH_DOCS = 256  # documents per task sent to a worker: large enough to amortise pickling


@dataclasses.dataclass
class Report:
    """What a preprocessing run wrote."""

    prefixes: list[str]
    documents: int
    sequences: int
    tokens: int
    input_bytes: int
    seconds: float

    @property
    def mb_per_s(self) -> float:
        return self.input_bytes / 1e6 / max(self.seconds, 1e-9)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


@dataclasses.dataclass(frozen=True)
class _Job:
    spec: TokenizerSpec
    keys: tuple[str, ...]
    append_eod: bool
    dtype: str  # the output files' token dtype


_worker: dict = {}  # per worker process: the job and its tokenizer (built once, in the initializer)


def _init_worker(job: _Job) -> None:
    # Workers already run in parallel: a thread pool inside each tokenizer would only oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker["job"], _worker["tok"] = job, job.spec.build()


def _documents(obj, key: str, where: str) -> list[str]:
    if not isinstance(obj, dict) or key not in obj:
        raise DataError(f"{where}: no {key!r} key in this JSON line (use --json-keys to pick the text field)")
    value = obj[key]
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value  # pre-split sentences: one sequence each (Megatron's --split-sentences output)
    raise DataError(f"{where}: {key!r} must be a string or a list of strings, got {type(value).__name__}")


def encode_batch(path: str, first_line: int, lines: Sequence[bytes]) -> tuple[dict, int]:
    """JSON lines -> per key (flat tokens [T] in the output dtype, sequence lengths [S], sequences per
    document [D]), and the bytes read.

    Sentences that encode to nothing are dropped and the end-of-document id is added to a document's last
    sequence only when it has tokens: Megatron's rules, so the files match its preprocessor's. Tokens come
    back in the file's dtype (uint16 for most vocabularies), a quarter of the bytes int64 would send.
    """
    job: _Job = _worker["job"]
    tok: Tokenizer = _worker["tok"]
    dtype = np.dtype(job.dtype)
    eod = np.asarray([tok.eod], dtype)
    objs = []
    for i, line in enumerate(lines):
        try:
            objs.append(json.loads(line))
        except ValueError as e:
            raise DataError(f"{path}:{first_line + i}: not valid JSON ({e})") from None
    out = {}
    for key in job.keys:
        pieces = [_documents(o, key, f"{path}:{first_line + i}") for i, o in enumerate(objs)]
        ids = tok.encode_batch([s for p in pieces for s in p])
        parts, lengths, per_doc, k = [], [], [], 0
        for p in pieces:
            doc = [x for x in ids[k: k + len(p)] if len(x)]
            k += len(p)
            parts += doc
            lengths += [len(x) for x in doc]
            if doc and job.append_eod:
                parts.append(eod)
                lengths[-1] += 1
            per_doc.append(len(doc))
        flat = np.concatenate([np.asarray(x, dtype) for x in parts]) if parts else np.zeros(0, dtype)
        out[key] = (flat, np.asarray(lengths, np.int64), np.asarray(per_doc, np.int64))
    return out, sum(len(line) for line in lines)


def _batches(paths: Sequence[str], size: int) -> Iterator[tuple[str, int, list[bytes]]]:
    """(path, line number of the first line, raw lines) in input order; blank lines are skipped."""
    for path in paths:
        if not os.path.isfile(path):
            raise DataError(f"{path}: input file not found")
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rb") as f:
            batch, first = [], 1
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                if not batch:
                    first = n
                batch.append(line)
                if len(batch) == size:
                    yield path, first, batch
                    batch = []
            if batch:
                yield path, first, batch


def _encoded(paths: Sequence[str], job: _Job, workers: int) -> Iterator[tuple[dict, int]]:
    """Encoded batches in input order; with workers > 1, a pool with a bounded number in flight."""
    if workers <= 1:
        _init_worker(job)
        for batch in _batches(paths, BATCH_DOCS):
            yield encode_batch(*batch)
        return
    # spawn, not fork: the caller may be a multi-threaded process (JAX), where fork is unsafe
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers, initializer=_init_worker, initargs=(job,)) as pool:
        pending: collections.deque = collections.deque()
        for batch in _batches(paths, BATCH_DOCS):
            pending.append(pool.apply_async(encode_batch, batch))
            if len(pending) >= 4 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class _Progress:
    def __init__(self, stream: TextIO | None, every: int):
        self.stream, self.every, self.start = stream, every, time.perf_counter()
        self.docs = self.tokens = self.bytes = 0
        self._next = every

    def update(self, docs: int, tokens: int, nbytes: int) -> None:
        self.docs, self.tokens, self.bytes = self.docs + docs, self.tokens + tokens, self.bytes + nbytes
        if self.stream is not None and self.every and self.docs >= self._next:
            self._next = (self.docs // self.every + 1) * self.every
            dt = max(time.perf_counter() - self.start, 1e-9)
            print(f"processed {self.docs:,} documents, {self.tokens:,} tokens | {self.bytes / 1e6 / dt:.2f} MB/s"
                  f" | {self.tokens / dt:,.0f} tokens/s | {dt:.1f} s", file=self.stream, flush=True)


def preprocess(inputs: Sequence[str], output_prefix: str, tokenizer: TokenizerSpec,
               json_keys: Sequence[str] = ("text",), append_eod: bool = False, workers: int = 1,
               log_interval: int = 10_000, progress: TextIO | None = sys.stderr,
               output_names: dict[str, str] | None = None) -> Report:
    """Tokenizes `inputs` (JSON lines, plain or .gz) into `{output_prefix}_{key}_document.bin/.idx`.

    `output_names` maps a key to an explicit output prefix instead (the bundled corpus uses it).
    """
    tok = tokenizer.build()
    dtype = token_dtype(tok.vocab_size)
    names = output_names or {k: f"{output_prefix}_{k}_document" for k in json_keys}
    writers = {k: IndexedDatasetWriter(names[k], dtype) for k in json_keys}
    meter = _Progress(progress, log_interval)
    try:
        for out, nbytes in _encoded(list(inputs), _Job(tokenizer, tuple(json_keys), append_eod, dtype.str), workers):
            for key, (flat, lengths, per_doc) in out.items():
                writers[key].add_documents(flat, lengths, per_doc)
            first = out[json_keys[0]]
            meter.update(len(first[2]), sum(int(v[0].size) for v in out.values()), nbytes)
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    for w in writers.values():
        w.close()
    w0 = writers[json_keys[0]]
    return Report([w.prefix for w in writers.values()], w0.num_documents,
                  sum(w.num_sequences for w in writers.values()), sum(w.num_tokens for w in writers.values()),
                  meter.bytes, time.perf_counter() - meter.start)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megajax.data.preprocess", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="JSON-lines files (.jsonl or .jsonl.gz), in order")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx")
    p.add_argument("--tokenizer", default="gpt2",
                   help="byte, gpt2, or a path: tokenizer.json, a SentencePiece .model, or a directory "
                        "holding one (default: gpt2, the vendored GPT-2 BPE)")
    p.add_argument("--vocab-file", help="GPT-2 style vocab.json (with --merge-file; overrides --tokenizer)")
    p.add_argument("--merge-file", help="GPT-2 style merges.txt")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSON fields to tokenize (default: text)")
    p.add_argument("--append-eod", action="store_true", help="end every non-empty document with the eod id")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes (default: all cores)")
    p.add_argument("--log-interval", type=int, default=10_000, help="print progress every N documents (0: never)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.workers < 1:
            raise DataError(f"--workers must be >= 1, got {args.workers}")
        spec = resolve(args.tokenizer, args.vocab_file, args.merge_file)
        report = preprocess(args.input, args.output_prefix, spec, args.json_keys, args.append_eod,
                            args.workers, args.log_interval)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for prefix in report.prefixes:
        print(f"wrote {prefix}.bin/.idx")
    print(f"{report.documents:,} documents, {report.sequences:,} sequences, {report.tokens:,} tokens from "
          f"{report.input_bytes / 1e6:.2f} MB in {report.seconds:.2f} s: {report.mb_per_s:.2f} MB/s, "
          f"{report.tokens_per_s:,.0f} tokens/s ({args.workers} workers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
