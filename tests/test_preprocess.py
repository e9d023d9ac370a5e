"""Preprocessing and tokenizers: the CLI end to end, every tokenizer kind built offline in the test,
GPT-2 ids checked against a plain re-implementation of GPT-2's BPE, and clear errors on bad input."""

import gzip
import io
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from megajax.data.indexed import DataError, IndexedDataset
from megajax.data.preprocess import preprocess
from megajax.data.tokenizers import GPT2_FILES, get_tokenizer, resolve

from conftest import REPO

TEXTS = [
    "In the beginning God created the heaven and the earth.",
    "",  # empty: a document entry, no sequence
    "And God said, Let there be light: and there was light. 1234 don't  stop\n\n",
    "héllo wörld: ünïcode and emoji 🙂 survive a round trip",
    "<|endoftext|> written in the text is just text",
]


def write_jsonl(path, texts, key="text", gz=False, extra=None):
    opener = gzip.open if gz else open
    with opener(path, "wt", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({key: t, "id": i, **(extra or {})}) + "\n")
            if i == 1:
                f.write("\n")  # blank lines are not documents
    return str(path)


def cli(*args):
    return subprocess.run([sys.executable, "-m", "megajax.data.preprocess", *args], cwd=REPO,
                          capture_output=True, text=True)


def check_output(prefix, tok, texts, append_eod=True):
    ds = IndexedDataset(prefix)
    nonempty = [t for t in texts if t]
    assert ds.num_documents == len(texts) and len(ds) == len(nonempty)
    for seq, text in zip((ds[i] for i in range(len(ds))), nonempty):
        ids = tok.encode(text) + ([tok.eod] if append_eod else [])
        assert seq.tolist() == ids
        assert tok.decode(seq[:-1] if append_eod else seq) == text
    return ds


def test_cli_end_to_end_gz_workers_two_keys(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl.gz", TEXTS, gz=True, extra={"title": "Genesis"})
    out = cli("--input", src, "--output-prefix", str(tmp_path / "out" / "c"), "--tokenizer", "byte",
              "--json-keys", "text", "title", "--append-eod", "--workers", "2", "--log-interval", "1")
    assert out.returncode == 0, out.stderr
    assert "wrote" in out.stdout and f"{len(TEXTS)} documents" in out.stdout and "tokens/s" in out.stdout
    assert "processed" in out.stderr and "MB/s" in out.stderr
    tok = get_tokenizer("byte")
    check_output(tmp_path / "out" / "c_text_document", tok, TEXTS)
    check_output(tmp_path / "out" / "c_title_document", tok, ["Genesis"] * len(TEXTS))
    assert IndexedDataset(tmp_path / "out" / "c_text_document").dtype == np.uint16


def bytes_to_unicode():
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, map(chr, chars)))


def gpt2_reference(text):
    """GPT-2's encoder for ASCII text: the regex split, the byte map, lowest-rank-first merges."""
    encoder = json.loads(GPT2_FILES[0].read_text())
    merges = [tuple(line.split()) for line in GPT2_FILES[1].read_text().splitlines()[1:] if line]
    ranks = {m: i for i, m in enumerate(merges)}
    byte_map = bytes_to_unicode()
    split = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")
    ids = []
    for piece in split.findall(text):
        word = [byte_map[b] for b in piece.encode()]
        while len(word) > 1:
            best = min(zip(word, word[1:]), key=lambda p: ranks.get(p, float("inf")))
            if best not in ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        ids += [encoder[w] for w in word]
    return ids


def test_gpt2_matches_the_reference_bpe(tmp_path):
    tok = get_tokenizer("gpt2")
    assert (tok.vocab_size, tok.eod) == (50257, 50256)
    assert tok.encode("Hello world") == [15496, 995]
    with gzip.open(f"{REPO}/megajax/corpus/kjv.jsonl.gz", "rt") as f:
        chapters = [json.loads(next(f))["text"] for _ in range(3)]
    for text in chapters + [t for t in TEXTS if t.isascii()]:
        assert tok.encode(text) == gpt2_reference(text)
    src = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    report = preprocess([src], str(tmp_path / "g"), resolve("gpt2"), append_eod=True, progress=None)
    assert report.documents == len(TEXTS) and report.tokens == sum(len(tok.encode(t)) + 1 for t in TEXTS if t)
    ds = check_output(tmp_path / "g_text_document", tok, TEXTS)
    assert ds.dtype == np.uint16


@pytest.fixture
def hf_tokenizer_dir(tmp_path):
    tk = pytest.importorskip("tokenizers", reason="the tokenizers package builds the test tokenizer.json")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "</s>"], show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 20, trainer)
    folder = tmp_path / "hf"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return folder


def test_cli_with_a_tokenizer_json(tmp_path, hf_tokenizer_dir):
    src = write_jsonl(tmp_path / "in.jsonl", TEXTS)
    out = cli("--input", src, "--output-prefix", str(tmp_path / "h"), "--tokenizer", str(hf_tokenizer_dir),
              "--append-eod", "--workers", "2")
    assert out.returncode == 0, out.stderr
    tok = get_tokenizer(str(hf_tokenizer_dir / "tokenizer.json"))
    assert tok.eod == 1 and 256 < tok.vocab_size <= 400 and tok.name.startswith("hf-")
    check_output(tmp_path / "h_text_document", tok, TEXTS)


def test_sentencepiece_model(tmp_path):
    spm = pytest.importorskip("sentencepiece", reason="SentencePiece models need the sentencepiece package")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter([t for t in TEXTS if t] * 30), model_writer=model,
                                   vocab_size=320, character_coverage=1.0, byte_fallback=True, minloglevel=2,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False)
    path = tmp_path / "sp.model"
    path.write_bytes(model.getvalue())
    tok = get_tokenizer(str(path))
    assert tok.eod == 2 and tok.vocab_size == 320
    src = write_jsonl(tmp_path / "in.jsonl", TEXTS[:3])
    preprocess([src], str(tmp_path / "s"), resolve(str(path)), append_eod=True, progress=None)
    check_output(tmp_path / "s_text_document", tok, TEXTS[:3])


def test_gpt2_from_a_vocab_merges_pair(tmp_path):
    folder = tmp_path / "bpe"
    folder.mkdir()
    (folder / "vocab.json").write_bytes(GPT2_FILES[0].read_bytes())
    (folder / "merges.txt").write_bytes(GPT2_FILES[1].read_bytes())
    assert resolve(str(folder)).kind == "gpt2"
    assert resolve(str(folder / "vocab.json")).files[1].endswith("merges.txt")
    assert get_tokenizer("x", vocab_file=str(folder / "vocab.json"),
                         merge_file=str(folder / "merges.txt")).encode("Hello world") == [15496, 995]


def test_sentence_lists_are_sequences(tmp_path):
    """A list of strings (Megatron's sentence-split output) is one document of several sequences."""
    src = tmp_path / "s.jsonl"
    src.write_text(json.dumps({"text": ["In the", "", "beginning"]}) + "\n" + json.dumps({"text": "x"}) + "\n")
    preprocess([str(src)], str(tmp_path / "o"), resolve("byte"), append_eod=True, progress=None)
    ds = IndexedDataset(tmp_path / "o_text_document")
    assert ds.sequence_lengths.tolist() == [6, 10, 2] and ds.document_indices.tolist() == [0, 2, 3]


@pytest.mark.parametrize("content, needle", [
    ('{"text": "a"}\n{"text": oops}\n', "bad.jsonl:2: not valid JSON"),
    ('{"text": "a"}\n{"body": "b"}\n', "bad.jsonl:2: no 'text' key"),
    ('{"text": 3}\n', "bad.jsonl:1: 'text' must be a string"),
])
def test_bad_input_lines_name_file_and_line(tmp_path, content, needle):
    (tmp_path / "bad.jsonl").write_text(content)
    with pytest.raises(DataError, match=re.escape(needle)):
        preprocess([str(tmp_path / "bad.jsonl")], str(tmp_path / "o"), resolve("byte"), progress=None)
    assert not list(tmp_path.glob("o_*")), "a failed run leaves no output behind"


def test_cli_errors_exit_2(tmp_path):
    out = cli("--input", str(tmp_path / "missing.jsonl"), "--output-prefix", str(tmp_path / "o"),
              "--tokenizer", "byte", "--workers", "1")
    assert out.returncode == 2 and out.stderr.startswith("error: ") and "missing.jsonl: input file not found" in out.stderr
    with pytest.raises(DataError, match="unknown tokenizer 'nonesuch'"):
        resolve("nonesuch")
