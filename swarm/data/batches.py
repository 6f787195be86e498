"""Tokens for training and eval: documents -> token streams -> per-peer shards of fixed-size windows.

A trainer does:

    corpus = load_corpus(cfg.data)                    # tokenizer + train stream + eval stream
    train = TrainBatches(corpus, cfg.data, shard, identity=peer_name)  # shard: fixed or leased (swarm/data/peerdata.py)
    x = train.next_batch()                            # LongTensor [batch_size, seq_len]; train.position moves on
    evals = corpus.eval_batches(cfg.data)             # the same fixed eval batches on every peer

Public names:
- `build_tokenizer(cfg)`: `ByteTokenizer` ("bytes", 256 symbols) or `HFTokenizer` (AutoTokenizer wrapper);
  both have `vocab_size`, `sep_id`, `encode(text) -> list[int]` and `decode(ids) -> str`.
- `iter_documents(cfg)`: the `(key, text)` documents of the configured source, in a deterministic order.
- `is_eval_document(key, cfg)`: the stable hash test that holds a document out for eval.
- `load_corpus(cfg)` -> `Corpus`: train/eval token streams (each document followed by `sep_id`), memory-mapped
  from the corpus prepared once on disk (swarm/data/tokens.py, `swarm data prepare`); the text is never held whole.
- `shard_windows(n_windows, cfg, shard)`: the train windows of a shard (window k = tokens [k*L, (k+1)*L)).
- `shard_index(cfg, run_id, peer_name)`: `cfg.shard` or a stable hash of the peer: the shard of a peer whose
  lease could not be read (a swarm's peers lease theirs: swarm/data/leases.py, swarm/net/leases.py).
- `check_vocabulary(tokenizer, model_vocab, cfg)`: the model's embedding fits the tokenizer.
- `TrainBatches(corpus, cfg, shard, identity)`: the shard's windows, reshuffled each epoch in this peer's order;
  `next_batch()` reads on from its `position`, `state()` says where it is (checkpoints record it).

Every hash here is blake2b over the parts' text or splitmix64 over a window's index (never Python's salted
`hash()`), so all peers, processes and restarts agree. Sources: "embedded" is a pinned snapshot of CPython's
standard library source shipped in the package (swarm/data/embedded.py: the same bytes on every machine and Python, no
download); "hf" is `datasets.load_dataset`
on a hub name or a local .txt/.json/.jsonl/.parquet file or folder (a .txt file gives one document per line).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from swarm.config import DataConfig
from swarm.data import embedded
from swarm.data.tokens import Prepared, corpus_folder, prepare
from swarm.errors import UsageError
from swarm.run.progress import PrepareProgress

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
        """The texts' ids, by the Rust tokenizer's own batch call where there is one (threaded; twice as fast as
        going through `transformers`, measured on a BPE of 8000 tokens)."""
        if not texts:
            return []
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None:
            return self.hf(texts, add_special_tokens=False)["input_ids"]
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids)


Tokenizer = ByteTokenizer | HFTokenizer


def build_tokenizer(cfg: DataConfig) -> Tokenizer:
    """`ByteTokenizer` for `cfg.tokenizer == "bytes"`, otherwise `AutoTokenizer.from_pretrained(cfg.tokenizer)`."""
    return ByteTokenizer() if cfg.tokenizer == "bytes" else HFTokenizer(cfg.tokenizer)


# ------------------------------------------------------------------------------------------ documents
def _first_line(e: BaseException) -> str:
    return (str(e).strip() or type(e).__name__).splitlines()[0]


def input_bytes(cfg: DataConfig) -> Optional[int]:
    """The size of the text a prepare of `cfg` reads, which its time left is measured against: the embedded
    sources' bytes, or the local .txt / .json / .jsonl files'; None where it cannot be known ahead (a hub dataset,
    parquet files, which are compressed, or a cap on documents)."""
    if cfg.max_documents is not None:
        return None
    if cfg.source == "embedded":
        return embedded.TEXT_BYTES
    path = Path(str(cfg.dataset)).expanduser()
    if not is_local(str(cfg.dataset)) or not path.exists():
        return None
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.suffix in _BUILDERS]
    if not files or any(p.suffix not in (".txt", ".json", ".jsonl") for p in files):
        return None
    return sum(p.stat().st_size for p in files)


def is_local(name: str) -> bool:
    """Whether dataset (or tokenizer) `name` names local files rather than a hub name."""
    return os.path.exists(name) or name.startswith(("/", ".", "~")) or Path(name).suffix in _BUILDERS


def _txt_records(path: Path) -> Iterator[str]:
    """The lines of a .txt file, as `datasets`' text builder gives them (UTF-8, universal newlines, one record per
    "\n", the "\n" dropped), read line by line without importing `datasets` (a 4 GB file in ~1 minute here)."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            yield line[:-1] if line.endswith("\n") else line


def _hf_documents(cfg: DataConfig) -> Iterator[tuple[str, str]]:
    """Records of `cfg.dataset` (hub or local), keyed by their index; empty texts are skipped."""
    name = str(cfg.dataset)
    try:
        if is_local(name) and Path(name).expanduser().is_file() and Path(name).suffix == ".txt":
            for i, text in enumerate(_txt_records(Path(name).expanduser())):
                if text.strip():
                    yield str(i), text
            return
        import datasets
        if is_local(name):
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


def iter_documents(cfg: DataConfig) -> Iterator[tuple[str, str]]:
    """`(key, text)` documents of `cfg.source` in a deterministic order, at most `cfg.max_documents`, read as
    they are needed (a streaming dataset is never held whole)."""
    docs = embedded.documents() if cfg.source == "embedded" else _hf_documents(cfg)
    for count, doc in enumerate(docs):
        if cfg.max_documents is not None and count >= cfg.max_documents:
            return
        yield doc


def _eval_score(key: str, cfg: DataConfig) -> float:
    return stable_hash("eval", key, cfg.seed) / 2.0**64


def is_eval_document(key: str, cfg: DataConfig) -> bool:
    """True when the document `key` is held out for eval (a stable hash of key and seed < eval_fraction)."""
    return _eval_score(key, cfg) < cfg.eval_fraction


# --------------------------------------------------------------------------------------------- corpus
class Corpus:
    """A tokenizer and two token streams of disjoint documents, memory-mapped from the corpus prepared on disk
    (swarm/data/tokens.py): each document's tokens followed by `tokenizer.sep_id`, in document order."""

    def __init__(self, tokenizer: Tokenizer, prepared: Prepared):
        self.tokenizer, self.prepared = tokenizer, prepared
        self.train = prepared.tokens("train")  # 1-D numpy (uint16 or uint32), read only where used
        self.prefetch = prepared.prefetcher("train")  # reads the windows a peer will read next ahead of time
        self.eval = prepared.tokens("eval")

    @property
    def train_keys(self) -> list[str]:
        return self.prepared.keys("train")

    @property
    def eval_keys(self) -> list[str]:
        return self.prepared.keys("eval")

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
        picked = torch.randperm(n, generator=gen)[: cfg.eval_batches * cfg.batch_size].numpy()
        windows = self.eval[: n * cfg.seq_len].reshape(n, cfg.seq_len)[picked].astype(np.int64)
        return list(torch.from_numpy(windows).split(cfg.batch_size))


_CACHE: dict[Path, Corpus] = {}


def load_corpus(cfg: DataConfig, cache: bool = True, verify: bool = False,
                progress: Optional[Callable[[int, int, int], None]] = None) -> Corpus:
    """The corpus of `cfg`, prepared on disk first if it is not yet (swarm/data/tokens.py), then memory-mapped (and
    kept per process unless `cache=False`). `verify` re-hashes the token files; `progress(documents, tokens,
    text)` follows a preparation (default: `PrepareProgress`, a bar on a terminal, else a log line every 30 s).

    A document goes to eval when `is_eval_document`; if none (or all) do, the one with the lowest
    (highest) hash is moved so both sides are non-empty when there are at least two documents.
    """
    folder = corpus_folder(cfg)
    if cache and not verify and folder in _CACHE:
        return _CACHE[folder]
    tokenizer = build_tokenizer(cfg)
    shown = PrepareProgress(f"tokenizing {folder.name}", lambda: input_bytes(cfg)) if progress is None else None
    try:
        prepared = prepare(folder, cfg, tokenizer, lambda: iter_documents(cfg), lambda key: _eval_score(key, cfg),
                           verify, progress or shown)
    finally:
        if shown is not None:
            shown.close()
    if prepared.meta["vocab_size"] != tokenizer.vocab_size:
        raise UsageError(f"prepared corpus {folder} was tokenized with {prepared.meta['vocab_size']} symbols, "
                         f"data.tokenizer {cfg.tokenizer} has {tokenizer.vocab_size}")
    corpus = Corpus(tokenizer, prepared)
    if cache:
        _CACHE[folder] = corpus
    return corpus


def check_vocabulary(tokenizer: Tokenizer, model_vocab: Optional[int], cfg: DataConfig) -> None:
    """UsageError if `model.vocab_size` (None: taken from the tokenizer) has fewer rows than the tokenizer has
    symbols: a token id past the embedding would fail the first inner step (or, on a GPU, read garbage)."""
    if model_vocab is not None and model_vocab < tokenizer.vocab_size:
        raise UsageError(f"data.tokenizer {cfg.tokenizer} has {tokenizer.vocab_size} symbols, more than "
                         f"model.vocab_size {model_vocab}: raise model.vocab_size or unset it (then it is the "
                         "tokenizer's)")


# --------------------------------------------------------------------------------------------- shards
_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def shard_windows(n_windows: int, cfg: DataConfig, shard: int) -> np.ndarray:
    """The train windows k in [0, n_windows) of `shard`, in order: those whose splitmix64 hash of (k, seed)
    modulo `num_shards` is `shard`. Computed a million windows at a time: memory ~ the shard's windows."""
    base = np.uint64(stable_hash("window", cfg.seed))
    found = []
    for start in range(0, n_windows, 1 << 20):
        k = np.arange(start, min(n_windows, start + (1 << 20)), dtype=np.uint64)
        x = k * _GOLDEN + base
        x = (x ^ (x >> np.uint64(30))) * _MIX1
        x = (x ^ (x >> np.uint64(27))) * _MIX2
        x ^= x >> np.uint64(31)
        found.append(k[x % np.uint64(cfg.num_shards) == np.uint64(shard)].astype(np.int64))
    return np.concatenate(found) if found else np.zeros(0, dtype=np.int64)


def shard_index(cfg: DataConfig, run_id: str, peer_name: str) -> int:
    """`cfg.shard` if set, else a stable hash of (run_id, peer_name, seed) modulo `cfg.num_shards`."""
    if cfg.shard is not None:
        return cfg.shard
    return stable_hash("shard", run_id, peer_name, cfg.seed) % cfg.num_shards


PREFETCH_WINDOWS = 256  # windows a peer reads ahead of its position at least (swarm/data/tokens.py Prefetcher)


class TrainBatches:
    """One shard's training windows in this peer's order, and how far the peer has read them (`position`).

    Sample position p reads window `perm_e[p % n]` with epoch e = p // n, where `perm_e` is a permutation of
    the shard's n windows drawn from a generator seeded by (seed, shard, e, identity): every window is seen once
    per epoch, a batch may straddle two epochs, and two peers that share a shard (more peers than shards, or
    two leases racing) still draw different batch sequences when their identities differ. `identity` is the
    peer's name (stable across its restarts; its checkpoint records it, swarm/train/trainer_state.py); "" gives the
    order of (seed, shard, e) alone. `next_batch()` reads on from `position` (samples drawn so far) and is
    what a trainer calls; `batch(step)` is the batch at position step * batch_size, a pure function of step.
    """

    def __init__(self, corpus: Corpus | np.ndarray | torch.Tensor, cfg: DataConfig, shard: int, identity: str = "",
                 position: int = 0):
        if not 0 <= shard < cfg.num_shards:
            raise UsageError(f"data shard {shard} is outside [0, data.num_shards={cfg.num_shards})")
        stream = corpus.train if isinstance(corpus, Corpus) else np.asarray(corpus)
        self.cfg, self.shard, self.identity, self.position = cfg, shard, identity, position
        self._prefetch = corpus.prefetch if isinstance(corpus, Corpus) else None
        self._ahead = position  # samples up to which the windows were read ahead
        total = len(stream) // cfg.seq_len
        self.tokens = stream[: total * cfg.seq_len].reshape(total, cfg.seq_len)  # a view: nothing read
        self.windows = torch.from_numpy(shard_windows(total, cfg, shard))  # global window ids
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

    def state(self) -> dict:
        """Where this peer is in its data: shard, order identity, epoch and offset in it, samples drawn."""
        n = len(self.windows)
        return {"shard": self.shard, "identity": self.identity, "epoch": self.position // n,
                "offset": self.position % n, "samples": self.position}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            if len(self._perms) >= 4:
                self._perms.clear()
            parts = (self.cfg.seed, self.shard, epoch) + ((self.identity,) if self.identity else ())
            seed = stable_hash("epoch", *parts) >> 1  # fits a signed 64-bit seed
            self._perms[epoch] = torch.randperm(len(self.windows), generator=torch.Generator().manual_seed(seed))
        return self._perms[epoch]

    def ids_at(self, position: int, count: int) -> list[int]:
        """Global ids of the `count` windows drawn from sample position `position` on."""
        n = len(self.windows)
        return [int(self.windows[self._perm(p // n)[p % n]]) for p in range(position, position + count)]

    def window_ids(self, step: int) -> list[int]:
        """Global ids of the windows that make up `batch(step)`."""
        return self.ids_at(step * self.cfg.batch_size, self.cfg.batch_size)

    def batch_at(self, position: int) -> torch.Tensor:
        """LongTensor [batch_size, seq_len] of the windows drawn from sample position `position` (>= 0) on."""
        if position < 0:
            raise ValueError(f"position must be >= 0, got {position}")
        return torch.from_numpy(self.tokens[self.ids_at(position, self.cfg.batch_size)].astype(np.int64))

    def batch(self, step: int) -> torch.Tensor:
        """LongTensor [batch_size, seq_len] for inner step `step` (>= 0) of a peer that read from position 0."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return self.batch_at(step * self.cfg.batch_size)

    def next_batch(self) -> torch.Tensor:
        """The batch at `position`, which then moves on by one batch; the windows of the next
        max(2 batches, PREFETCH_WINDOWS) samples are read ahead (swarm/data/tokens.py Prefetcher)."""
        batch = self.batch_at(self.position)
        self.position += self.cfg.batch_size
        if self._prefetch is not None:
            end = self.position + max(2 * self.cfg.batch_size, PREFETCH_WINDOWS)
            start = max(self._ahead, self.position)
            if end > start:
                L = self.cfg.seq_len
                self._prefetch.ahead([k * L for k in self.ids_at(start, end - start)], L)
                self._ahead = end
        return batch
