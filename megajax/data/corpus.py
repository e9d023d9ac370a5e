"""The bundled corpus: the King James Bible (public domain; 1,189 chapters, 4.2 MB of English text),
one document per chapter, tokenized on first use into a cached Megatron indexed dataset."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path

from megajax.data.indexed import IndexedDatasetWriter, token_dtype
from megajax.data.tokenizers import Tokenizer

CORPUS_FILE = Path(__file__).resolve().parent.parent / "corpus" / "kjv.jsonl.gz"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megajax"


def documents() -> Iterator[str]:
    with gzip.open(CORPUS_FILE, "rt", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def bundled_prefix(tokenizer: Tokenizer, cache_dir: str | os.PathLike | None = None) -> str:
    """Path prefix of the tokenized bundled corpus, building it on first use (a second or two)."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    prefix = cache / f"kjv_{tokenizer.name}_text_document"
    if not (Path(str(prefix) + ".bin").exists() and Path(str(prefix) + ".idx").exists()):
        with IndexedDatasetWriter(prefix, token_dtype(tokenizer.vocab_size)) as writer:
            for text in documents():
                writer.add_document(tokenizer.encode(text) + [tokenizer.eod])
    return str(prefix)
