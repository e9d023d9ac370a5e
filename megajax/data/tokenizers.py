"""Tokenizers behind one small interface, all from local files (nothing is downloaded):

    byte         UTF-8 bytes 0..255 plus an end-of-document id 256 (vocabulary 257); needs no files
    gpt2         GPT-2's byte-level BPE from the vendored vocab/merges (megajax/data/vocab/, MIT), or from
                 any vocab.json + merges.txt pair (Megatron's --vocab-file/--merge-file)
    tokenizer.json   any HuggingFace `tokenizers` file (Llama 3, Mistral, GPT-NeoX, ...)
    *.model      a SentencePiece model (Llama 2, T5, ...); needs the `sentencepiece` package

`get_tokenizer(name_or_path)` picks one: "byte", "gpt2", a file, or a directory holding tokenizer.json,
tokenizer.model, or vocab.json + merges.txt. Text is encoded without special tokens (as Megatron's
tokenizers do); the end-of-document id `eod` is appended by the preprocessor when asked.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from megajax.data.indexed import DataError

VOCAB_DIR = Path(__file__).resolve().parent / "vocab"
GPT2_FILES = (VOCAB_DIR / "gpt2-vocab.json", VOCAB_DIR / "gpt2-merges.txt")
# end-of-document tokens to look for when a tokenizer.json comes without a tokenizer_config.json
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")


class Tokenizer(Protocol):
    spec: TokenizerSpec
    vocab_size: int
    eod: int

    @property
    def name(self) -> str: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> Sequence[Sequence[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """How to build a tokenizer: picklable, so preprocessing workers build their own copy."""

    kind: str  # byte, gpt2, hf, sentencepiece
    files: tuple[str, ...] = ()

    def build(self) -> Tokenizer:
        if self.kind == "byte":
            return ByteTokenizer()
        if self.kind == "gpt2":
            return HFTokenizer.gpt2(self)
        if self.kind == "hf":
            return HFTokenizer.from_json(self)
        if self.kind == "sentencepiece":
            return SentencePieceTokenizer(self)
        raise DataError(f"unknown tokenizer kind {self.kind!r}")

    @property
    def name(self) -> str:
        """A short name that changes whenever the tokenizer's files do (for cache file names)."""
        if self.kind == "byte" or (self.kind == "gpt2" and self.files == tuple(map(str, GPT2_FILES))):
            return self.kind
        digest = hashlib.sha256()
        for f in self.files:
            digest.update(Path(f).read_bytes())
        return f"{self.kind}-{digest.hexdigest()[:12]}"


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus an end-of-document id 256: needs no files, covers any text."""

    vocab_size = 257
    eod = 256
    spec = TokenizerSpec("byte")
    name = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        # arrays over the UTF-8 bytes: no Python int per token on the preprocessing hot path
        return [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def _require(module: str, extra: str | None = None):
    try:
        return __import__(module)
    except ImportError:
        hint = f" (or pip install 'megajax[{extra}]')" if extra else ""
        raise DataError(f"this tokenizer needs the `{module}` package: pip install {module}{hint}") from None


class HFTokenizer:
    """A HuggingFace `tokenizers` tokenizer: GPT-2 BPE (built from vocab/merges exactly as GPT-2's own
    encoder splits and merges) or any tokenizer.json."""

    def __init__(self, spec: TokenizerSpec, tok, eod: int):
        self.spec, self._tok, self.eod = spec, tok, eod
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    @property
    def name(self) -> str:
        return self.spec.name

    @classmethod
    def gpt2(cls, spec: TokenizerSpec) -> HFTokenizer:
        tk = _require("tokenizers")
        vocab, merges = spec.files
        for f in spec.files:
            if not os.path.isfile(f):
                raise DataError(f"{f}: GPT-2 vocab/merges file not found")
        tok = tk.Tokenizer(tk.models.BPE.from_file(vocab, merges))
        # GPT-2's regex split and byte-to-unicode map; no prefix space, no special-token matching (the
        # original encoder splits a literal "<|endoftext|>" in text into ordinary pieces, and so do we)
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        eod = tok.token_to_id("<|endoftext|>")
        if eod is None:
            raise DataError(f"{vocab}: no <|endoftext|> token: not a GPT-2 vocabulary")
        return cls(spec, tok, eod)

    @classmethod
    def from_json(cls, spec: TokenizerSpec) -> HFTokenizer:
        tk = _require("tokenizers")
        (path,) = spec.files
        try:
            tok = tk.Tokenizer.from_file(path)
        except Exception as e:  # the Rust side raises a bare Exception on malformed files
            raise DataError(f"{path}: not a HuggingFace tokenizer.json ({e})") from None
        return cls(spec, tok, _find_eod(path, tok))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _find_eod(path: str, tok) -> int:
    """The end-of-document id: tokenizer_config.json's eos_token beside the file, else a usual name."""
    config = Path(path).with_name("tokenizer_config.json")
    names = list(EOD_CANDIDATES)
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            names.insert(0, eos)
    for name in names:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    raise DataError(f"{path}: no end-of-document token: none of {', '.join(names)} is in the vocabulary; "
                    "put a tokenizer_config.json with \"eos_token\" beside it")


class SentencePieceTokenizer:
    """A SentencePiece model; the end-of-document id is the model's </s> (eos)."""

    def __init__(self, spec: TokenizerSpec):
        spm = _require("sentencepiece", "data")
        (path,) = spec.files
        self.spec = spec
        try:
            self._sp = spm.SentencePieceProcessor(model_file=path)
        except (RuntimeError, OSError) as e:
            raise DataError(f"{path}: not a SentencePiece model ({e})") from None
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise DataError(f"{path}: the SentencePiece model has no eos piece to end documents with")

    @property
    def name(self) -> str:
        return self.spec.name

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


def resolve(name: str, vocab_file: str | None = None, merge_file: str | None = None) -> TokenizerSpec:
    """A tokenizer name or path -> its spec. Raises DataError naming what was looked for."""
    if vocab_file or merge_file:
        if not (vocab_file and merge_file):
            raise DataError("a GPT-2 BPE tokenizer needs both a vocab file and a merge file")
        return TokenizerSpec("gpt2", (str(vocab_file), str(merge_file)))
    if name == "byte":
        return TokenizerSpec("byte")
    if name == "gpt2":
        return TokenizerSpec("gpt2", tuple(map(str, GPT2_FILES)))
    path = Path(name).expanduser()
    if path.is_dir():
        return _resolve_dir(path)
    if path.is_file():
        return _resolve_file(path)
    raise DataError(f"unknown tokenizer {name!r}: use byte, gpt2, or the path of a tokenizer.json, a "
                    "SentencePiece .model, or a directory holding one (or vocab.json + merges.txt)")


def _resolve_dir(path: Path) -> TokenizerSpec:
    if (path / "tokenizer.json").is_file():
        return TokenizerSpec("hf", (str(path / "tokenizer.json"),))
    if (path / "tokenizer.model").is_file():
        return TokenizerSpec("sentencepiece", (str(path / "tokenizer.model"),))
    for vocab, merges in (("vocab.json", "merges.txt"), ("gpt2-vocab.json", "gpt2-merges.txt"),
                          ("encoder.json", "vocab.bpe")):
        if (path / vocab).is_file() and (path / merges).is_file():
            return TokenizerSpec("gpt2", (str(path / vocab), str(path / merges)))
    raise DataError(f"{path}: no tokenizer.json, tokenizer.model or vocab.json + merges.txt in this directory")


def _resolve_file(path: Path) -> TokenizerSpec:
    if path.suffix == ".model":
        return TokenizerSpec("sentencepiece", (str(path),))
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as e:
            raise DataError(f"{path}: not valid JSON ({e})") from None
        if isinstance(data, dict) and isinstance(data.get("model"), dict):  # a vocab.json may hold "model" too
            return TokenizerSpec("hf", (str(path),))
        for merges in ("merges.txt", "vocab.bpe", "gpt2-merges.txt"):
            if path.with_name(merges).is_file():
                return TokenizerSpec("gpt2", (str(path), str(path.with_name(merges))))
        raise DataError(f"{path}: a GPT-2 vocabulary needs its merges file beside it (merges.txt)")
    raise DataError(f"{path}: not a tokenizer file (expected tokenizer.json, a .model or a vocab .json)")


def get_tokenizer(name: str, vocab_file: str | None = None, merge_file: str | None = None) -> Tokenizer:
    """A tokenizer by name ("byte", "gpt2") or path (see the module docstring)."""
    return resolve(name, vocab_file, merge_file).build()


@functools.lru_cache(maxsize=8)
def eod_of(name: str) -> int:
    """The end-of-document id of data.tokenizer `name` (built once per name and process): what the loss mask
    (data.eod_mask_loss) and the packed documents' boundaries (data.reset_*) read."""
    return get_tokenizer(name).eod
