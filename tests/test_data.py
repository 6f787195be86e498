"""Data module: tokenizers, document split, disjoint shards, step-determined batches, local datasets."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch

from swarm import data
from swarm.configfile import load_config
from swarm.errors import UsageError


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
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>", "<unk>"],
                                                          show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(path)
    return str(path)


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
        expected = torch.stack([corpus.train[k * 64:(k + 1) * 64] for k in tb.window_ids(3)]).long()
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
