"""Tokens for training and eval: documents -> token streams -> per-peer shards of fixed-size windows.

A trainer does:

    corpus = load_corpus(cfg.data)                    # tokenizer + train stream + eval stream
    train = TrainBatches(corpus, cfg.data, shard_index(cfg.data, run_id, peer_name))
    x = train.batch(step)                             # LongTensor [batch_size, seq_len], a function of step
    evals = corpus.eval_batches(cfg.data)             # the same fixed eval batches on every peer

Public names:
- `build_tokenizer(cfg)`: `ByteTokenizer` ("bytes", 256 symbols) or `HFTokenizer` (AutoTokenizer wrapper);
  both have `vocab_size`, `sep_id`, `encode(text) -> list[int]` and `decode(ids) -> str`.
- `read_documents(cfg)`: the `(key, text)` documents of the configured source, in a deterministic order.
- `is_eval_document(key, cfg)`: the stable hash test that holds a document out for eval.
- `load_corpus(cfg)` -> `Corpus`: train/eval token streams (each document followed by `sep_id`), cached per process.
- `window_shards(n_windows, cfg)`: the shard of every train window (window k = tokens [k*L, (k+1)*L)).
- `shard_index(cfg, run_id, peer_name)`: this peer's shard, `cfg.shard` or a stable hash of the peer.
- `TrainBatches(corpus, cfg, shard)`: the shard's windows, reshuffled each epoch; `batch(step)`.

Every hash here is blake2b over the parts' text (never Python's salted `hash()`), so all peers, processes
and restarts agree. Sources: "embedded" is the `*.py` source of the running Python's standard library
(test suites and bundled apps left out; no download); "hf" is `datasets.load_dataset` on a hub name or a
local .txt/.json/.jsonl/.parquet file or folder (a .txt file gives one document per line).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.config import DataConfig
from swarm.errors import UsageError

_EXCLUDED_DIRS = {"test", "tests", "idle_test", "idlelib", "turtledemo", "lib2to3", "ensurepip",
                  "site-packages", "dist-packages", "config-3", "__pycache__"}
_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def stable_hash(*parts: object) -> int:
    """A 64-bit hash of `parts` (by their str) that is the same in every process and on every machine."""
    text = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


# ----------------------------------------------------------------------------------------- tokenizers
class ByteTokenizer:
    """UTF-8 bytes as tokens: 256 symbols, nothing to download. Byte 0 separates documents."""

    vocab_size, sep_id, name = 256, 0, "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `transformers` tokenizer (local path or hub name); `hf` is the wrapped object."""

    def __init__(self, name: str):
        from transformers import AutoTokenizer
        try:
            if name.startswith(("/", ".", "~")) and not os.path.exists(os.path.expanduser(name)):
                raise FileNotFoundError("no such file or directory")
            self.hf = AutoTokenizer.from_pretrained(os.path.expanduser(name))
        except Exception as e:  # noqa: BLE001 - any failure to load is the user's path/name
            raise UsageError(f"cannot load tokenizer {name}: {_first_line(e)}") from None
        self.hf.model_max_length = 1 << 62  # we cut windows ourselves: silence "sequence too long"
        self.name = name
        self.vocab_size = len(self.hf)
        ids = [self.hf.eos_token_id, self.hf.sep_token_id, self.hf.pad_token_id]
        self.sep_id = next((i for i in ids if i is not None), 0)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.hf(texts, add_special_tokens=False)["input_ids"] if texts else []

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids)


Tokenizer = ByteTokenizer | HFTokenizer


def build_tokenizer(cfg: DataConfig) -> Tokenizer:
    """`ByteTokenizer` for `cfg.tokenizer == "bytes"`, otherwise `AutoTokenizer.from_pretrained(cfg.tokenizer)`."""
    return ByteTokenizer() if cfg.tokenizer == "bytes" else HFTokenizer(cfg.tokenizer)


# ------------------------------------------------------------------------------------------ documents
def _first_line(e: BaseException) -> str:
    return (str(e).strip() or type(e).__name__).splitlines()[0]


def _embedded_documents() -> Iterator[tuple[str, str]]:
    """The standard library's `*.py` files, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _EXCLUDED_DIRS and not d.startswith((".", "config-"))]
        rel = Path(folder).relative_to(root)
        found += [(rel / f).as_posix() for f in files if f.endswith(".py")]
    for key in sorted(found):
        yield key, (root / key).read_bytes().decode("utf-8", errors="replace")


def _is_local(name: str) -> bool:
    return os.path.exists(name) or name.startswith(("/", ".", "~")) or Path(name).suffix in _BUILDERS


def _hf_documents(cfg: DataConfig) -> Iterator[tuple[str, str]]:
    """Records of `cfg.dataset` (hub or local), keyed by their index; empty texts are skipped."""
    name = str(cfg.dataset)
    try:
        import datasets
        if _is_local(name):
            path = Path(name).expanduser()
            if not path.exists():
                raise FileNotFoundError("no such file or directory")
            if path.is_dir():
                ds = datasets.load_dataset(str(path), split=cfg.split, streaming=cfg.streaming)
            elif path.suffix in _BUILDERS:
                ds = datasets.load_dataset(_BUILDERS[path.suffix], data_files=str(path), split="train",
                                           streaming=cfg.streaming)
            else:
                raise ValueError(f"unsupported file type {path.suffix!r} (use .txt, .json, .jsonl or .parquet)")
        else:
            ds = datasets.load_dataset(name, cfg.dataset_config, split=cfg.split, streaming=cfg.streaming)
        for i, record in enumerate(ds):
            if cfg.text_field not in record:
                raise ValueError(f"records have no field {cfg.text_field!r} (fields: {sorted(record)})")
            text = record[cfg.text_field]
            if isinstance(text, str) and text.strip():
                yield str(i), text
    except Exception as e:  # noqa: BLE001 - missing, unreadable or malformed data: one line naming it
        raise UsageError(f"cannot read dataset {name}: {_first_line(e)}") from None


def read_documents(cfg: DataConfig) -> list[tuple[str, str]]:
    """`(key, text)` documents of `cfg.source` in a deterministic order, at most `cfg.max_documents`."""
    docs = _embedded_documents() if cfg.source == "embedded" else _hf_documents(cfg)
    out = []
    for doc in docs:
        if cfg.max_documents is not None and len(out) >= cfg.max_documents:
            break
        out.append(doc)
    return out


def _eval_score(key: str, cfg: DataConfig) -> float:
    return stable_hash("eval", key, cfg.seed) / 2.0**64


def is_eval_document(key: str, cfg: DataConfig) -> bool:
    """True when the document `key` is held out for eval (a stable hash of key and seed < eval_fraction)."""
    return _eval_score(key, cfg) < cfg.eval_fraction


# --------------------------------------------------------------------------------------------- corpus
def _token_stream(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    """The documents' tokens, each followed by `tokenizer.sep_id`, as one int32 tensor."""
    if isinstance(tokenizer, ByteTokenizer):
        joined = b"".join(t.encode("utf-8") + b"\0" for t in texts)
        return torch.frombuffer(bytearray(joined), dtype=torch.uint8).to(torch.int32)
    ids = tokenizer.encode_batch(texts)
    flat = [t for doc in ids for t in (*doc, tokenizer.sep_id)]
    return torch.tensor(flat, dtype=torch.int32)


@dataclass
class Corpus:
    """A tokenizer and two token streams built from disjoint documents (`*_keys` name them)."""

    tokenizer: Tokenizer
    train: torch.Tensor  # 1-D int32: train documents' tokens, each followed by tokenizer.sep_id
    eval: torch.Tensor  # 1-D int32: the same for the held-out documents
    train_keys: list[str]
    eval_keys: list[str]

    def num_windows(self, seq_len: int) -> int:
        """How many whole windows of `seq_len` tokens the train stream holds."""
        return len(self.train) // seq_len

    def eval_batches(self, cfg: DataConfig) -> list[torch.Tensor]:
        """Up to `cfg.eval_batches` fixed LongTensor batches [<=batch_size, seq_len] of eval windows."""
        n = len(self.eval) // cfg.seq_len
        if n == 0:
            raise UsageError(f"the eval documents hold {len(self.eval)} tokens, fewer than data.seq_len "
                             f"{cfg.seq_len}: raise data.eval_fraction or use more data")
        gen = torch.Generator().manual_seed(stable_hash("eval-windows", cfg.seed) >> 1)
        picked = torch.randperm(n, generator=gen)[: cfg.eval_batches * cfg.batch_size]
        windows = self.eval[: n * cfg.seq_len].view(n, cfg.seq_len)[picked].long()
        return list(windows.split(cfg.batch_size))


_CACHE: dict[tuple, Corpus] = {}


def load_corpus(cfg: DataConfig, cache: bool = True) -> Corpus:
    """Read, split and tokenize the documents of `cfg` (cached in memory per process unless `cache=False`).

    A document goes to eval when `is_eval_document`; if none (or all) do, the one with the lowest
    (highest) hash is moved so both sides are non-empty when there are at least two documents.
    """
    key = (cfg.source, cfg.dataset, cfg.dataset_config, cfg.split, cfg.text_field, cfg.tokenizer,
           cfg.max_documents, cfg.eval_fraction, cfg.seed)
    if cache and key in _CACHE:
        return _CACHE[key]
    tokenizer = build_tokenizer(cfg)
    docs = read_documents(cfg)
    if len(docs) < 2:
        raise UsageError(f"data source {cfg.dataset or cfg.source} gave {len(docs)} documents; need at least 2")
    held = [is_eval_document(k, cfg) for k, _ in docs]
    if all(held) or not any(held):
        scores = [_eval_score(k, cfg) for k, _ in docs]
        flip = scores.index(max(scores) if all(held) else min(scores))
        held[flip] = not held[flip]
    train_docs = [d for d, h in zip(docs, held) if not h]
    eval_docs = [d for d, h in zip(docs, held) if h]
    corpus = Corpus(tokenizer=tokenizer,
                    train=_token_stream(tokenizer, [t for _, t in train_docs]),
                    eval=_token_stream(tokenizer, [t for _, t in eval_docs]),
                    train_keys=[k for k, _ in train_docs], eval_keys=[k for k, _ in eval_docs])
    if cache:
        _CACHE[key] = corpus
    return corpus


# --------------------------------------------------------------------------------------------- shards
def window_shards(n_windows: int, cfg: DataConfig) -> torch.Tensor:
    """Shard of each train window k in [0, n_windows): stable_hash(k, seed) % num_shards (int64 tensor)."""
    return torch.tensor([stable_hash("window", k, cfg.seed) % cfg.num_shards for k in range(n_windows)],
                        dtype=torch.int64)


def shard_index(cfg: DataConfig, run_id: str, peer_name: str) -> int:
    """`cfg.shard` if set, else a stable hash of (run_id, peer_name, seed) modulo `cfg.num_shards`."""
    if cfg.shard is not None:
        return cfg.shard
    return stable_hash("shard", run_id, peer_name, cfg.seed) % cfg.num_shards


class TrainBatches:
    """One shard's training windows; `batch(step)` depends on `step` only, so resumed runs replay exactly.

    Sample position p = step * batch_size + i reads window `perm_e[p % n]` with epoch e = p // n, where
    `perm_e` is a permutation of the shard's n windows drawn from a generator seeded by (seed, shard, e):
    every window is seen once per epoch, and a batch may straddle two epochs.
    """

    def __init__(self, corpus: Corpus | torch.Tensor, cfg: DataConfig, shard: int):
        if not 0 <= shard < cfg.num_shards:
            raise UsageError(f"data shard {shard} is outside [0, data.num_shards={cfg.num_shards})")
        stream = corpus.train if isinstance(corpus, Corpus) else corpus
        self.cfg, self.shard = cfg, shard
        total = len(stream) // cfg.seq_len
        self.tokens = stream[: total * cfg.seq_len].view(total, cfg.seq_len)
        self.windows = torch.nonzero(window_shards(total, cfg) == shard).flatten()  # global window ids
        if len(self.windows) < cfg.batch_size:
            raise UsageError(
                f"data shard {shard} holds {len(self.windows)} windows of {cfg.seq_len} tokens, fewer than one "
                f"batch of {cfg.batch_size}: lower data.num_shards, data.batch_size or data.seq_len, or add data")
        self._perms: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:  # windows in this shard
        return len(self.windows)

    def epoch_of(self, step: int) -> int:
        """The epoch that the first sample of `batch(step)` belongs to."""
        return step * self.cfg.batch_size // len(self.windows)

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            if len(self._perms) >= 4:
                self._perms.clear()
            seed = stable_hash("epoch", self.cfg.seed, self.shard, epoch) >> 1  # fits a signed 64-bit seed
            self._perms[epoch] = torch.randperm(len(self.windows), generator=torch.Generator().manual_seed(seed))
        return self._perms[epoch]

    def window_ids(self, step: int) -> list[int]:
        """Global ids of the windows that make up `batch(step)`."""
        n, bs = len(self.windows), self.cfg.batch_size
        return [int(self.windows[self._perm(p // n)[p % n]]) for p in range(step * bs, (step + 1) * bs)]

    def batch(self, step: int) -> torch.Tensor:
        """LongTensor [batch_size, seq_len] for inner step `step` (>= 0)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self.tokens[self.window_ids(step)].long()
