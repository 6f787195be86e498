"""Data module: tokenizers, document split, disjoint shards, step-determined batches, local datasets."""

import json
import multiprocessing
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from pathlib import Path

import numpy as np
import pytest
import torch

from bench.data import train_bpe
from swarm.data import batches as data
from swarm.data import embedded
from swarm.errors import SwarmError, UsageError
from swarm.run.configfile import load_config


def data_cfg(**values):
    return load_config(None, {"data": values}).data


def write_lines(folder, n=120, name="part.txt"):
    """A .txt dataset folder: one distinct document per line."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"document {i:04d} says the quick brown fox jumps over {i * 7 % 13} lazy dogs" for i in range(n)]
    (folder / name).write_text("\n".join(lines) + "\n")
    return lines


def build_local_tokenizer(path, texts):
    """A small BPE tokenizer trained here and saved as a PreTrainedTokenizerFast (no download)."""
    return train_bpe(texts, path, 300)


@pytest.mark.timeout(60)
def test_byte_tokenizer_round_trip():
    tok = data.build_tokenizer(data_cfg())
    text = "héllo, wörld → 🐍\n\tdef f(): pass"
    ids = tok.encode(text)
    assert tok.vocab_size == 256 and all(0 <= i < 256 for i in ids)
    assert ids == list(text.encode("utf-8")) and tok.decode(ids) == text


@pytest.mark.timeout(60)
def test_embedded_split_and_shards_are_disjoint():
    cfg = data_cfg(num_shards=4, seq_len=64, batch_size=4, max_documents=150)
    corpus = data.load_corpus(cfg)
    assert len(corpus.train_keys) + len(corpus.eval_keys) == 150
    assert not set(corpus.train_keys) & set(corpus.eval_keys) and corpus.eval_keys
    assert all(data.is_eval_document(k, cfg) for k in corpus.eval_keys)
    assert not any(data.is_eval_document(k, cfg) for k in corpus.train_keys)
    assert corpus.train_keys == sorted(corpus.train_keys)  # deterministic order: sorted relative paths

    shards = [data.TrainBatches(corpus, cfg, s) for s in range(cfg.num_shards)]
    sets = [set(s.windows.tolist()) for s in shards]
    for i in range(len(sets)):
        for j in range(i + 1, len(sets)):
            assert not sets[i] & sets[j]
    assert set().union(*sets) == set(range(corpus.num_windows(cfg.seq_len)))
    for tb, ids in zip(shards, sets):
        for step in (0, 1, 17):
            assert set(tb.window_ids(step)) <= ids
        batch = tb.batch(3)
        expected = torch.stack([torch.from_numpy(corpus.train[k * 64:(k + 1) * 64].astype("int64"))
                                for k in tb.window_ids(3)])
        assert batch.dtype == torch.int64 and batch.shape == (4, 64) and torch.equal(batch, expected)


@pytest.mark.timeout(60)
def test_batch_depends_on_step_only():
    cfg = data_cfg(num_shards=8, seq_len=32, batch_size=3, max_documents=40)
    a = data.TrainBatches(data.load_corpus(cfg, cache=False), cfg, 5)
    b = data.TrainBatches(data.load_corpus(cfg, cache=False), cfg, 5)
    n = len(a)
    steps_per_epoch = n // cfg.batch_size
    probe = [0, 1, 7, steps_per_epoch, steps_per_epoch + 1, 3 * steps_per_epoch + 2]
    for step in reversed(probe):  # out of order, as a resumed run would ask
        assert torch.equal(a.batch(step), b.batch(step))
    assert not torch.equal(a.batch(0), a.batch(1))
    # every window is seen once per epoch; epochs are shuffled differently
    first = [w for s in range(n) for w in a.window_ids(s)][:n]
    second = [w for s in range(n, 2 * n) for w in a.window_ids(s)][:n]
    assert sorted(first) == sorted(a.windows.tolist())
    assert a.epoch_of(n) == cfg.batch_size and first != second
    assert not torch.equal(a.batch(0), data.TrainBatches(a.tokens.flatten(), cfg, 6).batch(0))


@pytest.mark.timeout(60)
def test_too_few_windows_is_a_usage_error():
    cfg = data_cfg(num_shards=64, seq_len=128, batch_size=64, max_documents=3)
    with pytest.raises(UsageError, match="fewer than one batch"):
        data.TrainBatches(data.load_corpus(cfg), cfg, 0)


@pytest.mark.timeout(60)
def test_eval_batches_fixed_and_held_out(tmp_path):
    lines = write_lines(tmp_path / "txt", n=200)
    cfg = data_cfg(source="hf", dataset=str(tmp_path / "txt"), num_shards=2, seq_len=16, batch_size=4,
                   eval_fraction=0.2, eval_batches=3)
    corpus = data.load_corpus(cfg, cache=False)
    evals = corpus.eval_batches(cfg)
    again = data.load_corpus(cfg, cache=False).eval_batches(cfg)
    assert len(evals) == 3 and all(torch.equal(x, y) for x, y in zip(evals, again))
    assert all(x.shape == (4, 16) and x.dtype == torch.int64 for x in evals)
    train_text = corpus.tokenizer.decode(corpus.train.tolist())
    eval_lines = [lines[int(k)] for k in corpus.eval_keys]
    assert 20 < len(eval_lines) < 70
    assert not any(line in train_text for line in eval_lines)
    assert all(lines[int(k)] in train_text for k in corpus.train_keys)


@pytest.mark.timeout(60)
def test_local_txt_and_jsonl_with_bytes_and_local_tokenizer(tmp_path):
    lines = write_lines(tmp_path / "txt", n=150)
    jsonl = tmp_path / "jsonl"
    jsonl.mkdir()
    (jsonl / "rows.jsonl").write_text("".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(lines)))
    tok_path = build_local_tokenizer(tmp_path / "tok", lines)

    for dataset, field in [(tmp_path / "txt", "text"), (jsonl, "body"), (jsonl / "rows.jsonl", "body")]:
        for tokenizer in ["bytes", tok_path]:
            cfg = data_cfg(source="hf", dataset=str(dataset), text_field=field, tokenizer=tokenizer,
                           num_shards=2, seq_len=16, batch_size=2, max_documents=120)
            corpus = data.load_corpus(cfg, cache=False)
            tok = corpus.tokenizer
            assert len(corpus.train_keys) + len(corpus.eval_keys) == 120
            assert int(corpus.train.max()) < tok.vocab_size and int(corpus.train.min()) >= 0
            assert corpus.train.tolist()[: len(tok.encode(lines[0])) + 1] == tok.encode(lines[0]) + [tok.sep_id]
            batch = data.TrainBatches(corpus, cfg, 1).batch(4)
            assert batch.shape == (2, 16) and corpus.eval_batches(cfg)
            if tokenizer != "bytes":
                assert tok.vocab_size <= 300 and tok.sep_id == tok.hf.eos_token_id
                assert tok.decode(tok.encode(lines[3])) == lines[3]


@pytest.mark.timeout(60)
def test_unreadable_dataset_raises_usage_error(tmp_path):
    bad_json = tmp_path / "broken.jsonl"
    bad_json.write_text('{"text": "fine"}\n{not json at all\n')
    odd = tmp_path / "data.bin"
    odd.write_bytes(b"\x00\x01")
    for path in [tmp_path / "missing", tmp_path / "missing.jsonl", bad_json, odd]:
        cfg = data_cfg(source="hf", dataset=str(path))
        with pytest.raises(UsageError) as err:
            data.load_corpus(cfg, cache=False)
        message = str(err.value)
        assert message.startswith(f"cannot read dataset {path}: ") and "\n" not in message
    cfg = data_cfg(source="hf", dataset=str(tmp_path / "jsonl-ok"), text_field="nope")
    (tmp_path / "jsonl-ok").mkdir()
    (tmp_path / "jsonl-ok" / "a.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n')
    with pytest.raises(UsageError, match="nope"):
        data.load_corpus(cfg, cache=False)


@pytest.mark.timeout(60)
def test_shard_index_stable_and_in_range():
    cfg = data_cfg(num_shards=7, seed=3)
    ids = [data.shard_index(cfg, "run-a", f"peer-{i}") for i in range(200)]
    assert ids == [data.shard_index(cfg, "run-a", f"peer-{i}") for i in range(200)]
    assert all(0 <= s < 7 for s in ids) and len(set(ids)) == 7
    assert ids != [data.shard_index(cfg, "run-b", f"peer-{i}") for i in range(200)]
    # stable across processes and machines: pinned values of the blake2b-based hash
    assert data.stable_hash("shard", "run-a", "peer-0", 3) == 6526269930229717581
    assert ids[:5] == [4, 6, 5, 4, 0]
    assert data.shard_index(data_cfg(num_shards=7, seed=3, shard=5), "run-a", "peer-0") == 5


@pytest.mark.timeout(60)
def test_a_prepared_corpus_is_tokenized_once_and_memory_mapped(tmp_path):
    lines = write_lines(tmp_path / "txt", n=200)
    cfg = data_cfg(source="hf", dataset=str(tmp_path / "txt"), num_shards=2, seq_len=16, batch_size=4,
                   cache_dir=str(tmp_path / "cache"))
    calls = []
    corpus = data.load_corpus(cfg, cache=False, progress=lambda docs, tokens, text: calls.append((docs, tokens, text)))
    folder = corpus.prepared.folder
    assert folder.parent == tmp_path / "cache" and calls[-1][0] == 200
    assert isinstance(corpus.train, np.memmap) and corpus.train.dtype == np.uint16
    assert sorted(p.name for p in folder.iterdir()) == ["eval.bin", "eval_keys.txt", "meta.json", "train.bin",
                                                        "train_keys.txt", "verified.json"]
    stamp = (folder / "train.bin").stat().st_mtime_ns
    again = data.load_corpus(cfg, cache=False, verify=True, progress=lambda *a: pytest.fail("tokenized again"))
    assert (folder / "train.bin").stat().st_mtime_ns == stamp and np.array_equal(again.train, corpus.train)
    assert corpus.tokenizer.decode(corpus.train[: len(lines[0].encode()) + 1].tolist()) == lines[0] + "\0"
    # another setting is another corpus; a changed input file is too
    assert data.load_corpus(data_cfg(**{**cfg.__dict__, "eval_fraction": 0.3})).prepared.folder != folder
    write_lines(tmp_path / "txt", n=201)
    assert data.load_corpus(cfg, cache=False).prepared.folder != folder


@pytest.mark.timeout(60)
def test_the_size_of_the_input_is_known_where_it_can_be(tmp_path):
    """What a prepare's time left is measured against (swarm/run/progress.py PrepareProgress)."""
    write_lines(tmp_path / "txt", n=50)
    size = (tmp_path / "txt" / "part.txt").stat().st_size
    assert data.input_bytes(data_cfg(source="hf", dataset=str(tmp_path / "txt"))) == size
    assert data.input_bytes(data_cfg(source="hf", dataset=str(tmp_path / "txt" / "part.txt"))) == size
    assert data.input_bytes(data_cfg(source="hf", dataset=str(tmp_path / "txt"), max_documents=10)) is None
    assert data.input_bytes(data_cfg(source="hf", dataset="someone/hub-dataset")) is None
    (tmp_path / "pq").mkdir()
    (tmp_path / "pq" / "rows.parquet").write_bytes(b"PAR1")
    assert data.input_bytes(data_cfg(source="hf", dataset=str(tmp_path / "pq"))) is None  # compressed
    assert data.input_bytes(data_cfg()) == embedded.TEXT_BYTES  # the embedded corpus's text
    calls = []
    cfg = data_cfg(source="hf", dataset=str(tmp_path / "txt"), cache_dir=str(tmp_path / "cache"))
    data.load_corpus(cfg, cache=False, progress=lambda *a: calls.append(a))
    assert calls[-1][0] == 50 and calls[-1][2] == size - 50  # every character but the newlines


@pytest.mark.timeout(90)
def test_the_token_files_are_the_same_whatever_the_number_of_workers(tmp_path):
    """Several processes tokenize batches of documents and the parent writes them in the documents' order: the
    token files (and so the corpus's hash) are those one process writes, document by document."""
    lines = write_lines(tmp_path / "txt", n=1300)  # three batches of documents (swarm/data/tokens.py BATCH_DOCUMENTS)
    tok_path = build_local_tokenizer(tmp_path / "tok", lines)
    for tokenizer in ["bytes", tok_path]:
        hashes = set()
        for workers in [1, 2, 3]:
            cfg = data_cfg(source="hf", dataset=str(tmp_path / "txt"), tokenizer=tokenizer, prepare_workers=workers,
                           cache_dir=str(tmp_path / f"cache-{workers}"))
            corpus = data.load_corpus(cfg, cache=False)
            hashes.add(corpus.prepared.meta["sha256"])
        tok = corpus.tokenizer
        train = [int(k) for k in corpus.train_keys]
        assert len(train) + len(corpus.eval_keys) == 1300 and train == sorted(train)
        assert corpus.train.tolist() == [t for i in train for t in tok.encode(lines[i]) + [tok.sep_id]]
        assert len(hashes) == 1, tokenizer

    def interrupted(documents, tokens, text):
        raise KeyboardInterrupt

    cfg = data_cfg(source="hf", dataset=str(tmp_path / "txt"), tokenizer=tok_path, prepare_workers=2,
                   cache_dir=str(tmp_path / "cache-interrupted"))
    with pytest.raises(KeyboardInterrupt):
        data.load_corpus(cfg, cache=False, progress=interrupted)
    assert not multiprocessing.active_children()  # the workers went with the prepare


@pytest.mark.timeout(60)
def test_an_interrupted_prepare_is_started_over_and_a_damaged_corpus_is_refused(tmp_path):
    write_lines(tmp_path / "txt", n=120)
    cfg = data_cfg(source="hf", dataset=str(tmp_path / "txt"), cache_dir=str(tmp_path / "cache"))

    def interrupted(documents, tokens, text):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        data.load_corpus(cfg, cache=False, progress=interrupted)
    partial = [p.name for p in (tmp_path / "cache").iterdir() if p.name.endswith(".partial")]
    assert len(partial) == 1  # what was interrupted is not taken for a corpus ...
    folder = data.load_corpus(cfg, cache=False).prepared.folder  # ... and is started over
    assert not (tmp_path / "cache" / partial[0]).exists() and (folder / "meta.json").exists()

    data_bytes = (folder / "train.bin").read_bytes()
    (folder / "train.bin").write_bytes(data_bytes[:-2])
    with pytest.raises(SwarmError, match=rf"prepared corpus {folder} is unreadable: train.bin holds \d+ bytes"):
        data.load_corpus(cfg, cache=False)
    (folder / "train.bin").write_bytes(data_bytes[:-2] + b"zz")  # the same size, other tokens: written to since
    with pytest.raises(SwarmError, match=rf"prepared corpus {folder} fails its hash"):  # hashed before training
        data.load_corpus(cfg, cache=False)
    stamp = (folder / "verified.json").read_text()
    os.utime(folder / "train.bin", ns=tuple(json.loads(stamp)["train"][1:] * 2))  # the time it was hashed at
    data.load_corpus(cfg, cache=False)  # an unchanged stamp: opened without reading a token ...
    with pytest.raises(SwarmError, match=rf"prepared corpus {folder} fails its hash"):
        data.load_corpus(cfg, cache=False, verify=True)  # ... `swarm data prepare` re-hashes whatever the stamp
    (folder / "train.bin").write_bytes(data_bytes)
    data.load_corpus(cfg, cache=False)  # restored: hashed again, and noted as verified
    assert (folder / "verified.json").read_text() != stamp


@pytest.mark.timeout(60)
def test_data_leases_are_computed_in_pieces_and_partition_every_window():
    cfg = data_cfg(num_shards=7, seed=3)
    n = (1 << 20) + 12345  # more than one piece
    shards = [data.shard_windows(n, cfg, s) for s in range(7)]
    every = np.concatenate(shards)
    assert len(every) == n and np.array_equal(np.sort(every), np.arange(n))
    assert all(abs(len(s) - n / 7) < 5 * (n / 7) ** 0.5 for s in shards)  # balanced within 5 sigma
    assert np.array_equal(shards[2][:50], data.shard_windows(50 * 7 * 4, cfg, 2)[:50])  # window k's shard is k's


@pytest.mark.timeout(60)
def test_a_txt_file_is_read_without_datasets_into_the_records_datasets_gives(tmp_path):
    """One document per line after universal-newline translation, empty lines counted but skipped: the records of
    `datasets`' text builder, so a corpus's keys (and hash) do not depend on which reader read it."""
    import datasets

    text = "first line\r\nsecond\n\n  \nthird\rfourth é\u2028 same line\nlast, no newline"
    (tmp_path / "a.txt").write_bytes(text.encode())
    cfg = data_cfg(source="hf", dataset=str(tmp_path / "a.txt"))
    ds = datasets.load_dataset("text", data_files=str(tmp_path / "a.txt"), split="train", streaming=True)
    expected = [(str(i), r["text"]) for i, r in enumerate(ds) if r["text"].strip()]
    assert list(data.iter_documents(cfg)) == expected and [k for k, _ in expected] == ["0", "1", "4", "5", "6"]


README = Path(__file__).resolve().parents[1] / "README.md"
TINY_CORPUS_SHA256 = "24423be94117bc5f80f50784fad74a882aa99556a5dfe1df31686314d17cdf6a"  # the README quotes it


@pytest.mark.timeout(120)
def test_the_embedded_corpus_is_the_pinned_bytes_whatever_python_runs(tmp_path):
    """The embedded corpus is a snapshot shipped in the package, not the running interpreter's library: the
    bytes the README names, and the prepared corpus of configs/tiny.yaml (what `make swarm` trains on) has the
    hash the README names, on any machine and under any Python. Read under another Python's library, the corpus
    used to differ and a peer on it was refused as another run."""
    readme = README.read_text()
    assert embedded.SHA256 in readme and TINY_CORPUS_SHA256 in readme
    keys = [key for key, _ in embedded.documents()]
    assert len(keys) == 576 and keys == sorted(keys) and "os.py" in keys
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml", {})
    cfg.data.cache_dir = str(tmp_path / "cache")
    assert data.load_corpus(cfg.data).prepared.meta["sha256"] == TINY_CORPUS_SHA256


@pytest.mark.timeout(60)
def test_an_altered_embedded_corpus_is_refused_naming_it(tmp_path, monkeypatch):
    import lzma

    altered = tmp_path / "corpus.jsonl.xz"
    altered.write_bytes(lzma.compress(b'["os.py", "import sys"]\n'))
    monkeypatch.setattr(embedded, "ARCHIVE", altered)
    with pytest.raises(SwarmError, match=f"the embedded corpus {altered} has sha256 .* not the pinned"):
        list(embedded.documents())
    altered.write_bytes(b"not xz")
    with pytest.raises(SwarmError, match=f"the embedded corpus {altered} does not read"):
        list(embedded.documents())
