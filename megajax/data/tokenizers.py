"""Tokenizers behind one small interface: `encode(text) -> list[int]`, `decode(ids) -> str`, `vocab_size`,
`eod` (the end-of-document id appended between documents)."""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eod: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus an end-of-document id 256: needs no files, covers any text."""

    name = "byte"
    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def get_tokenizer(name: str) -> Tokenizer:
    """A tokenizer by name ("byte") or path."""
    if name == "byte":
        return ByteTokenizer()
    raise ValueError(f"unknown tokenizer {name!r}: use data.tokenizer=byte")
