"""Data pipeline benchmark: preprocessing throughput and GPT index build time on synthetic data.

    python scripts/bench_data.py                        # 1M documents, byte and gpt2, all cores
    python scripts/bench_data.py --docs 100000 --tokenizers gpt2 --workers 1 2

Preprocessing: JSON lines of 1-4 random KJV verses per document (about 340 bytes), tokenized by
`python -m megajax.data.preprocess` in a child process (so its peak memory, and its workers', is
measured alone). Index build: an indexed dataset of 1M documents with web-like lengths (lognormal, mean
~600 tokens; the .bin is a sparse file) and Megatron's GPT indices for 2048-token samples over ~3 epochs,
built cold, then loaded from the cache; blending indices for 1M samples of two datasets; and the rate at
which shuffled samples are read from the first preprocessed output. Prints a JSON report and a Markdown table.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from megajax.data import blended, gpt_dataset  # noqa: E402
from megajax.data.index_cache import IndexCache  # noqa: E402
from megajax.data.indexed import MAGIC, IndexedDataset  # noqa: E402


def synthetic_jsonl(path: Path, docs: int, seed: int = 0) -> int:
    with gzip.open(REPO / "megajax" / "corpus" / "kjv.jsonl.gz", "rt") as f:
        verses = [v for line in f for v in json.loads(line)["text"].split("\n") if v.strip()]
    rng = random.Random(seed)
    with open(path, "w") as out:
        for _ in range(docs):
            out.write(json.dumps({"text": " ".join(rng.choice(verses) for _ in range(rng.randint(1, 4)))}) + "\n")
    return path.stat().st_size


def preprocess_run(src: Path, tokenizer: str, workers: int, out: Path) -> dict:
    """Runs the CLI in a child that reports its own and its workers' peak RSS."""
    child = (
        "import json, resource, sys; from megajax.data.preprocess import main; "
        "code = main(sys.argv[1:]); "
        "r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
        "c = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss; "
        "print('RSS', json.dumps({'main_mb': r / 1024, 'worker_mb': c / 1024})); sys.exit(code)"
    )
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", child, "--input", str(src), "--output-prefix", str(out),
                          "--tokenizer", tokenizer, "--workers", str(workers), "--append-eod", "--log-interval", "0"],
                         cwd=REPO, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    rss = json.loads(res.stdout.split("RSS ", 1)[1])
    ds = IndexedDataset(f"{out}_text_document")
    mb = src.stat().st_size / 1e6
    return {"tokenizer": tokenizer, "workers": workers, "documents": ds.num_documents, "tokens": ds.num_tokens,
            "input_mb": round(mb, 1), "seconds": round(wall, 2), "mb_per_s": round(mb / wall, 2),
            "tokens_per_s": round(ds.num_tokens / wall), **{k: round(v) for k, v in rss.items()}}


def synthetic_indexed(prefix: Path, docs: int, seed: int = 0) -> IndexedDataset:
    """1M documents with lognormal lengths; the .bin is sparse (the indices only need the lengths)."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(6.0, 1.0, docs), 1, 100_000).astype(np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64) * 2])
    with open(f"{prefix}.idx", "wb") as f:
        f.write(MAGIC + struct.pack("<QBQQ", 1, 8, docs, docs + 1))
        f.write(lengths.tobytes() + pointers.tobytes() + np.arange(docs + 1, dtype=np.int64).tobytes())
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(int(lengths.sum(dtype=np.int64)) * 2)
    return IndexedDataset(prefix)


def index_bench(folder: Path, docs: int, seq: int) -> dict:
    ds = synthetic_indexed(folder / "syn", docs)
    per_epoch = (ds.num_tokens - 1) // seq
    samples = 3 * per_epoch
    t0 = time.perf_counter()
    gpt = gpt_dataset.GPTDataset(ds, (0, docs), seq, samples, seed=1234)
    cold = time.perf_counter() - t0
    cache = IndexCache([folder / "cache"])
    gpt_dataset.GPTDataset(ds, (0, docs), seq, samples, seed=1234, cache=cache)
    t0 = time.perf_counter()
    gpt_dataset.GPTDataset(ds, (0, docs), seq, samples, seed=1234, cache=cache)
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    blended.build_blending_indices([0.3, 0.7], 1_000_000)
    blend = time.perf_counter() - t0
    return {"documents": docs, "tokens": ds.num_tokens, "seq_length": seq, "samples": len(gpt),
            "epochs": int(len(gpt.document_index) // docs), "index_build_s": round(cold, 2),
            "index_cache_load_s": round(warm, 3), "blend_1m_samples_s": round(blend, 2)}


def read_bench(prefix: str, seq: int, n: int = 5000) -> dict:
    """Shuffled samples per second from a real (just written, so page-cached) dataset."""
    ds = IndexedDataset(prefix)
    gpt = gpt_dataset.GPTDataset(ds, (0, len(ds)), seq, None, seed=0)
    t0 = time.perf_counter()
    for i in range(min(n, len(gpt))):
        gpt[i]
    dt = time.perf_counter() - t0
    return {"samples_per_s": round(min(n, len(gpt)) / dt), "tokens_per_s": round(min(n, len(gpt)) * (seq + 1) / dt)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=1_000_000)
    p.add_argument("--tokenizers", nargs="+", default=["byte", "gpt2"])
    p.add_argument("--workers", type=int, nargs="+", default=[os.cpu_count() or 1])
    p.add_argument("--seq-length", type=int, default=2048)
    args = p.parse_args()
    report = {"cpus": os.cpu_count(), "load_avg_at_start": round(os.getloadavg()[0], 2), "preprocess": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        src = folder / "synthetic.jsonl"
        synthetic_jsonl(src, args.docs)
        for tok in args.tokenizers:
            for w in args.workers:
                report["preprocess"].append(preprocess_run(src, tok, w, folder / f"out_{tok}_{w}"))
                print(json.dumps(report["preprocess"][-1]), file=sys.stderr)
        report["index"] = index_bench(folder, args.docs, args.seq_length)
        first = report["preprocess"][0]
        report["read"] = read_bench(str(folder / f"out_{first['tokenizer']}_{first['workers']}_text_document"),
                                    args.seq_length)
    print(json.dumps(report, indent=1))
    print("\n| tokenizer | workers | MB/s | tokens/s | peak RSS main / worker (MB) |\n|---|---|---|---|---|")
    for r in report["preprocess"]:
        print(f"| {r['tokenizer']} | {r['workers']} | {r['mb_per_s']} | {r['tokens_per_s']:,} | "
              f"{r['main_mb']} / {r['worker_mb']} |")
    ix = report["index"]
    print(f"\nGPT indices for {ix['documents']:,} documents ({ix['tokens']:,} tokens), {ix['samples']:,} samples "
          f"of {ix['seq_length']} over {ix['epochs']} epochs: built in {ix['index_build_s']} s, loaded from the "
          f"cache in {ix['index_cache_load_s']} s; blending indices for 1M samples: {ix['blend_1m_samples_s']} s; "
          f"shuffled samples read: {report['read']['samples_per_s']:,}/s ({report['read']['tokens_per_s']:,} tokens/s)")


if __name__ == "__main__":
    main()
