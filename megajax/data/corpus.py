"""The bundled corpus: the King James Bible (public domain; 1,189 chapters, 4.2 MB of English text), one
document per chapter, tokenized on first use into a cached Megatron indexed dataset by the same
preprocessor as any other corpus (`python -m megajax.data.preprocess ... --append-eod`)."""

from __future__ import annotations

import os
from pathlib import Path

from megajax.data.indexed import exists
from megajax.data.tokenizers import TokenizerSpec

CORPUS_FILE = Path(__file__).resolve().parent.parent / "corpus" / "kjv.jsonl.gz"


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/megajax, or ~/.cache/megajax."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megajax"


def bundled_prefix(tokenizer: TokenizerSpec, cache_dir: str | os.PathLike | None = None) -> str:
    """Path prefix of the bundled corpus tokenized with `tokenizer`, building it on first use (about a
    second with the byte or GPT-2 tokenizer). The name carries the tokenizer's fingerprint, so another
    tokenizer (or changed tokenizer files) gets its own copy."""
    from megajax.data.preprocess import preprocess

    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    prefix = str(cache / f"kjv_{tokenizer.name}_text_document")
    if not exists(prefix):
        # one process: the caller may hold JAX threads, and the corpus is small
        preprocess([str(CORPUS_FILE)], prefix, tokenizer, append_eod=True, workers=1, progress=None,
                   output_names={"text": prefix})
    return prefix
