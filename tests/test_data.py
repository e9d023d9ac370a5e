"""The data pipeline: indexed-dataset format, GPT sampling indices against a slow replica of Megatron's
loop, blending, the index cache, bad-input errors, and batches that do not depend on the layout."""

import math
import os
import struct

import numpy as np
import pytest

from megajax.config import io as config_io
from megajax.data import blended, gpt_dataset
from megajax.data.datasets import build_datasets, split_matrix, split_range
from megajax.data.index_cache import IndexCache
from megajax.data.indexed import DTYPE_CODES, DataError, IndexedDataset, IndexedDatasetWriter

from conftest import small_config


def write_docs(prefix, docs, dtype=np.uint16):
    with IndexedDatasetWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(np.asarray(d))
    return str(prefix)


def random_docs(rng, n, max_len=40, vocab=250, empty_every=0):
    docs = [rng.integers(0, vocab, rng.integers(1, max_len)) for _ in range(n)]
    if empty_every:
        for i in range(0, n, empty_every):
            docs[i] = np.zeros(0, np.int64)
    return docs


# ---------------------------------------------------------------------------------------------------
# Format


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_round_trip_every_dtype(tmp_path, code):
    dtype = DTYPE_CODES[code]
    rng = np.random.default_rng(code)
    hi = 100 if dtype.kind == "f" else min(np.iinfo(dtype).max, 10**6)
    lo = 0 if dtype.kind != "i" else max(np.iinfo(dtype).min, -(10**6))
    docs = [rng.integers(lo, hi, n).astype(dtype) for n in (5, 1, 0, 17, 3)]
    prefix = write_docs(tmp_path / "rt", docs, dtype)
    ds = IndexedDataset(prefix)
    assert ds.dtype == dtype and len(ds) == 4 and ds.num_documents == 5
    assert open(prefix + ".idx", "rb").read()[17] == code
    assert ds.sequence_lengths.tolist() == [5, 1, 17, 3]
    assert ds.document_indices.tolist() == [0, 1, 2, 2, 3, 4]  # the empty document has no sequence
    assert ds.sequence_pointers.tolist() == [0, 5 * dtype.itemsize, 6 * dtype.itemsize, 23 * dtype.itemsize]
    for got, want in zip([ds[i] for i in range(len(ds))], [d for d in docs if len(d)]):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(ds.get(2, 3, 4), docs[3][3:7])
    assert [len(x) for x in ds[1:3]] == [1, 17]


def test_idx_bytes_field_by_field(tmp_path):
    """A hand-built .idx byte string: Megatron's layout, field by field."""
    with IndexedDatasetWriter(tmp_path / "hand", np.uint16) as w:
        w.add_document([1, 2, 3])
        w.add_document([])  # empty: a document entry, no sequence
        w.add_item([4, 5])
        w.add_item([6])
        w.end_document()  # one document of two sequences
    expected = (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)  # version
        + struct.pack("<B", 8)  # dtype code: uint16
        + struct.pack("<Q", 3)  # sequences
        + struct.pack("<Q", 4)  # document index entries (3 documents + 1)
        + struct.pack("<3i", 3, 2, 1)  # sequence lengths, int32
        + struct.pack("<3q", 0, 6, 10)  # byte offsets, int64
        + struct.pack("<4q", 0, 1, 1, 3)  # document index, int64
    )
    assert (tmp_path / "hand.idx").read_bytes() == expected
    assert (tmp_path / "hand.bin").read_bytes() == struct.pack("<6H", 1, 2, 3, 4, 5, 6)
    assert not [p for p in os.listdir(tmp_path) if "tmp" in p], "temporary files left behind"
    # and the reader takes hand-made bytes too
    (tmp_path / "copy.idx").write_bytes(expected)
    (tmp_path / "copy.bin").write_bytes(struct.pack("<6H", 1, 2, 3, 4, 5, 6))
    ds = IndexedDataset(tmp_path / "copy")
    assert [ds[i].tolist() for i in range(3)] == [[1, 2, 3], [4, 5], [6]]
    assert ds.document_indices.tolist() == [0, 1, 1, 3]


def test_writer_merges_and_streams(tmp_path, monkeypatch):
    from megajax.data import indexed

    monkeypatch.setattr(indexed, "_SPOOL", 3)  # spool the index to disk every 3 entries: same bytes
    rng = np.random.default_rng(0)
    a = write_docs(tmp_path / "a", random_docs(rng, 30, empty_every=7))
    b = write_docs(tmp_path / "b", random_docs(rng, 20))
    with IndexedDatasetWriter(tmp_path / "ab", np.uint16) as w:
        w.add_index(a)
        w.add_index(b)
    da, db, dab = IndexedDataset(a), IndexedDataset(b), IndexedDataset(tmp_path / "ab")
    assert len(dab) == len(da) + len(db) and dab.num_documents == da.num_documents + db.num_documents
    assert dab.document_indices.tolist() == da.document_indices.tolist() + (len(da) + db.document_indices[1:]).tolist()
    for i in range(len(db)):
        np.testing.assert_array_equal(dab[len(da) + i], db[i])
    # the batch path writes the same bytes as document by document
    docs = random_docs(rng, 50, empty_every=5)
    one = write_docs(tmp_path / "one", docs)
    with IndexedDatasetWriter(tmp_path / "many", np.uint16) as w:
        w.add_documents(np.concatenate(docs), [len(d) for d in docs])
    for ext in (".bin", ".idx"):
        assert open(one + ext, "rb").read() == (tmp_path / f"many{ext}").read_bytes()


def _corrupt_cases():
    def truncate(n):
        return lambda idx, b: idx.write_bytes(idx.read_bytes()[:n])

    def patch(offset, data):
        def f(idx, b):
            raw = bytearray(idx.read_bytes())
            raw[offset: offset + len(data)] = data
            idx.write_bytes(bytes(raw))
        return f

    return {
        "missing idx": (lambda idx, b: idx.unlink(), "idx", "file not found"),
        "missing bin": (lambda idx, b: b.unlink(), "bin", "file not found"),
        "wrong magic": (patch(0, b"NOTMEGA"), "idx", "wrong magic"),
        "empty idx": (truncate(0), "idx", "wrong magic"),
        "short header": (truncate(20), "idx", "truncated header"),
        "version": (patch(9, struct.pack("<Q", 2)), "idx", "version 2 is not supported"),
        "dtype code": (patch(17, b"\x09"), "idx", "unknown dtype code 9"),
        "truncated idx": (truncate(60), "idx", "truncated"),
        "doc index": (patch(34 + 12 * 3 + 8 * 2, struct.pack("<q", 7)), "idx", "corrupt document index"),
        "pointers": (patch(34 + 12 + 8, struct.pack("<q", 3)), "idx", "corrupt index: sequence 1"),
        "truncated bin": (lambda idx, b: b.write_bytes(b.read_bytes()[:-2]), "bin", "truncated"),
        "longer bin": (lambda idx, b: b.write_bytes(b.read_bytes() + b"\0\0"), "bin", "longer than its index"),
    }


@pytest.mark.parametrize("case", list(_corrupt_cases()))
def test_corrupt_files_get_one_clear_error(tmp_path, case):
    damage, which, needle = _corrupt_cases()[case]
    prefix = write_docs(tmp_path / "c", [[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    idx, b = tmp_path / "c.idx", tmp_path / "c.bin"
    damage(idx, b)
    with pytest.raises(DataError) as e:
        IndexedDataset(prefix)
    assert str(idx if which == "idx" else b) in str(e.value) and needle in str(e.value), str(e.value)


# ---------------------------------------------------------------------------------------------------
# GPT indices against a slow replica of Megatron's C++ loop


def reference_sample_index(sizes, doc_index, seq, num_epochs, tokens_per_epoch):
    """helpers.cpp build_sample_idx, one token run at a time (drop_last_partial_sequence, extra token)."""
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq
    out, d, off = [(0, 0)], 0, 0
    while len(out) <= num_samples:
        need = seq + 1
        while need:
            avail = int(sizes[doc_index[d]]) - off
            if avail >= need:
                off, need = off + need - 1, 0  # the last token is shared with the next sample
            else:
                need, d, off = need - avail, d + 1, 0
        out.append((d, off))
    return np.asarray(out)


def reference_indices(sizes, lo, hi, seq, num_samples, seed):
    """Megatron's GPTDataset._build_document_sample_shuffle_indices, written out plainly."""
    docs = list(range(lo, hi))
    tpe = int(sum(sizes[lo:hi]))
    epochs = 1
    while epochs * tpe < num_samples * seq + 1:
        epochs += 1
    separate = False
    if epochs > 1:
        sans = ((epochs - 1) * tpe - 1) // seq
        separate = num_samples - sans < int(0.8 * ((tpe - 1) // seq))
    rng = np.random.RandomState(seed)
    if separate:
        first, last = docs * (epochs - 1), list(docs)
        rng.shuffle(first)
        rng.shuffle(last)
        doc_index = first + last
    else:
        doc_index = docs * epochs
        rng.shuffle(doc_index)
    samples = reference_sample_index(sizes, doc_index, seq, epochs, tpe)
    total = len(samples) - 1
    shuffled = ((epochs - 1) * tpe - 1) // seq if separate else total
    a, b = list(range(shuffled)), list(range(shuffled, total))
    rng.shuffle(a)
    rng.shuffle(b)
    return np.asarray(doc_index), samples, np.asarray(a + b), epochs, separate


@pytest.mark.parametrize("seq, num_samples, empty_every", [
    (8, 50, 0), (16, 400, 3), (5, 1000, 0), (64, 30, 2), (7, 73, 4),
])
def test_indices_match_megatron_loop(tmp_path, seq, num_samples, empty_every):
    rng = np.random.default_rng(seq)
    docs = random_docs(rng, 60, max_len=30, empty_every=empty_every)
    if empty_every:
        docs[0] = np.zeros(0, np.int64)  # an empty first document (sample 0 still starts at (0, 0))
    ds = IndexedDataset(write_docs(tmp_path / "g", docs))
    lo, hi = 3, len(ds) - 2
    gpt = gpt_dataset.GPTDataset(ds, (lo, hi), seq, num_samples, seed=1234)
    doc_index, samples, shuffle, epochs, separate = reference_indices(ds.sequence_lengths, lo, hi, seq,
                                                                      num_samples, 1234)
    np.testing.assert_array_equal(gpt.document_index, doc_index)
    np.testing.assert_array_equal(gpt.sample_index, samples)
    np.testing.assert_array_equal(gpt.shuffle_index, shuffle)
    assert gpt.document_index.dtype == np.int32 and gpt.sample_index.dtype == np.int32
    assert gpt.shuffle_index.dtype == np.uint32
    # every token of every epoch is a target exactly once: sample s is stream[s * seq : (s + 1) * seq + 1]
    stream = np.concatenate([ds[int(d)] for d in doc_index]).astype(np.int64)
    assert sorted(gpt.shuffle_index.tolist()) == list(range(len(gpt)))
    for idx in range(len(gpt)):
        s = int(gpt.shuffle_index[idx])
        np.testing.assert_array_equal(gpt[idx], stream[s * seq: (s + 1) * seq + 1])
    assert len(gpt) * seq + 1 <= len(stream) < (len(gpt) + 1) * seq + 1


def test_separate_final_epoch():
    """Just over 2 epochs: the third epoch's documents and samples are shuffled on their own."""
    sizes = np.full(100, 10, np.int32)
    seq, per_epoch = 9, (1000 - 1) // 9
    doc_index, samples, shuffle, epochs, separate = reference_indices(sizes, 0, 100, seq, 2 * per_epoch + 5, 0)
    assert epochs == 3 and separate
    sans = (2 * 1000 - 1) // seq
    assert sorted(shuffle[sans:]) == list(range(sans, len(samples) - 1))
    assert sorted(doc_index[200:]) == list(range(100))


def test_split_matrix_is_megatrons():
    assert split_matrix("949,50,1") == [(0.0, 0.949), (0.949, 0.999), (0.999, 1.0)]
    assert split_matrix("99,1") == [(0.0, 0.99), (0.99, 1.0), None]
    assert split_matrix("1,0,1") == [(0.0, 0.5), None, (0.5, 1.0)]
    assert [split_range(b, 1189) for b in split_matrix("949,50,1")] == [(0, 1128), (1128, 1188), (1188, 1189)]


# ---------------------------------------------------------------------------------------------------
# The index cache


def test_index_cache_hit_miss_and_corruption(tmp_path, caplog):
    rng = np.random.default_rng(0)
    ds = IndexedDataset(write_docs(tmp_path / "c", random_docs(rng, 80)))
    cache = IndexCache([tmp_path / "idx"])
    a = gpt_dataset.GPTDataset(ds, (0, 80), 16, 300, seed=3, cache=cache)
    files = sorted(os.listdir(tmp_path / "idx"))
    assert len(files) == 4 and not [f for f in files if f.endswith(".tmp")]
    b = gpt_dataset.GPTDataset(ds, (0, 80), 16, 300, seed=3, cache=cache)
    assert isinstance(b.sample_index, np.memmap), "the second build should load the cache"
    np.testing.assert_array_equal(a.shuffle_index, b.shuffle_index)
    # another seed is another entry
    gpt_dataset.GPTDataset(ds, (0, 80), 16, 300, seed=4, cache=cache)
    assert len(os.listdir(tmp_path / "idx")) == 8
    # flip one byte of a cached array: detected, rebuilt, never trusted
    victim = tmp_path / "idx" / [f for f in files if f.endswith("sample_index.npy")][0]
    raw = bytearray(victim.read_bytes())
    raw[-3] ^= 0xFF
    victim.write_bytes(bytes(raw))
    c = gpt_dataset.GPTDataset(ds, (0, 80), 16, 300, seed=3, cache=cache)
    assert "unusable" in caplog.text
    np.testing.assert_array_equal(c.sample_index, a.sample_index)
    victim.write_bytes(b"garbage")
    np.testing.assert_array_equal(gpt_dataset.GPTDataset(ds, (0, 80), 16, 300, seed=3, cache=cache).sample_index,
                                  a.sample_index)


def test_index_cache_falls_back_when_the_data_dir_is_not_writable(tmp_path):
    rng = np.random.default_rng(0)
    ds = IndexedDataset(write_docs(tmp_path / "c", random_docs(rng, 40)))
    (tmp_path / "blocked").write_text("a file where a directory would go")
    cache = IndexCache([tmp_path / "blocked" / "indices", tmp_path / "fallback"])
    gpt_dataset.GPTDataset(ds, (0, 40), 8, 50, seed=0, cache=cache)
    assert len(os.listdir(tmp_path / "fallback")) == 4
    again = gpt_dataset.GPTDataset(ds, (0, 40), 8, 50, seed=0, cache=cache)
    assert isinstance(again.shuffle_index, np.memmap)


# ---------------------------------------------------------------------------------------------------
# Blending


def reference_blend(weights, size):
    counts = np.zeros(len(weights))
    picks = []
    for i in range(size):
        err = np.asarray(weights) * max(i, 1) - counts
        d = int(np.argmax(err))  # first maximum on ties, as the C++ loop
        picks.append(d)
        counts[d] += 1
    return np.asarray(picks)


@pytest.mark.parametrize("weights", [[0.3, 0.7], [1, 1, 1], [0.5, 0.25, 0.125, 0.125], [0.01, 0.99]])
def test_blending_indices_track_weights(weights):
    w = blended.normalize(weights)
    index, sample = blended.build_blending_indices(w, 2000)
    np.testing.assert_array_equal(index, reference_blend(w, 2000))
    for n in (10, 100, 777, 2000):
        counts = np.bincount(index[:n], minlength=len(w))
        assert np.all(np.abs(counts - np.asarray(w) * n) <= 1.0 + 1e-9), (n, counts)
    for d in range(len(w)):
        assert sample[index == d].tolist() == list(range(int((index == d).sum())))


def test_blended_datasets_from_config(tmp_path):
    rng = np.random.default_rng(1)
    a = write_docs(tmp_path / "a", random_docs(rng, 300, vocab=100))
    b = write_docs(tmp_path / "b", [d + 100 for d in random_docs(rng, 200, vocab=100)])
    cfg = small_config(**{"data.paths": [0.3, a, 0.7, b + ".bin"], "data.index_cache_dir": str(tmp_path / "ix")})
    out = build_datasets(cfg, {"train": 640, "valid": 64})
    train = out["train"].dataset
    assert len(train) == math.ceil(640 * 0.3) + math.ceil(640 * 0.7)
    for n in (64, 640):
        counts = train.counts(n)
        assert abs(counts[0] - 0.3 * n) <= 1 and abs(counts[1] - 0.7 * n) <= 1
    # each blended sample really comes from its dataset (token ranges differ)
    for i in range(100):
        from_b = int(train.dataset_index[i]) == 1
        assert (out["train"][i].min() >= 100) == from_b
    assert set(out) == {"train", "valid"} and len(out["valid"]) >= 64
    # unweighted prefixes blend by tokens
    cfg = small_config(**{"data.paths": [a, b], "data.index_cache_dir": str(tmp_path / "ix")})
    tokens = [IndexedDataset(p).num_tokens for p in (a, b)]
    counts = build_datasets(cfg, {"train": 500})["train"].dataset.counts(500)
    assert abs(counts[0] / 500 - tokens[0] / sum(tokens)) < 0.01


# ---------------------------------------------------------------------------------------------------
# Bad input before training


def test_token_ids_past_the_vocabulary(tmp_path):
    prefix = write_docs(tmp_path / "v", [[1, 2, 300, 4] * 20])
    cfg = small_config(**{"data.paths": [prefix], "data.index_cache_dir": str(tmp_path / "ix")})
    with pytest.raises(DataError, match=r"v\.bin: token id 300 >= model.vocab_size=257: the file is damaged, or it was tokenized with another"):
        build_datasets(cfg, {"train": 8})
    cfg = config_io.override(cfg, {"model.vocab_size": 301})
    assert len(build_datasets(cfg, {"train": 8})["train"]) >= 8


@pytest.mark.parametrize("docs, split, needle", [
    ([], "949,50,1", "the dataset is empty"),
    ([[1, 2]], "949,50,1", "fewer than one sample"),
    ([[1] * 100] * 10, "0,1,0", "gives the train split no data"),
])
def test_empty_data(tmp_path, docs, split, needle):
    prefix = write_docs(tmp_path / "e", docs)
    cfg = small_config(**{"data.paths": [prefix], "data.split": split, "data.index_cache_dir": str(tmp_path)})
    with pytest.raises(DataError, match=needle):
        build_datasets(cfg, {"train": 8})


def test_train_entry_point_exits_2_on_bad_data(tmp_path, capsys):
    from megajax import train

    code = train.main(["--set", f"data.paths=[{tmp_path}/nothing]", "model.vocab_size=257",
                       f"train.output_dir={tmp_path}/run"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and f"{tmp_path}/nothing.idx: file not found" in err


def test_config_paths_validation():
    from megajax.config import ConfigError

    assert config_io.load(None, ["data.paths=[a,b]"]).data.paths == ["a", "b"]
    for bad in ("data.paths=[0.3,a,b]", "data.paths=[a,0.5]", "data.paths=[-1,a]", "data.prefetch=-1"):
        with pytest.raises(ConfigError):
            config_io.load(None, [bad])


@pytest.mark.parametrize("name, data", [("tokenizer.json", b'{"version": "1.0", "model": '),
                                        ("tokenizer.json", b"\x00\xff" * 64),
                                        ("tokenizer.model", bytes(range(256)) * 2)])
def test_a_damaged_tokenizer_file_is_one_line_naming_it(tmp_path, name, data):
    """A tokenizer.json that is not JSON, or a SentencePiece model that does not parse: a DataError (exit 2 from
    every entry point) naming the file, one bounded line."""
    from megajax.data.tokenizers import get_tokenizer

    (tmp_path / name).write_bytes(data)
    with pytest.raises(DataError) as err:
        get_tokenizer(str(tmp_path / name))
    text = str(err.value)
    assert text.startswith(str(tmp_path / name)) and "\n" not in text and len(text) < 500, text
