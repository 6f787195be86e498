"""Prepared corpora: a corpus tokenized once into token files on disk, which every peer memory-maps.

`prepare(cfg)` reads the documents of `cfg` (swarm/data/batches.py `iter_documents`: streaming, so the text never has
to fit in memory), splits them into train and eval by the stable rule of `is_eval_document`, tokenizes them in
batches (on `data.prepare_workers` processes for a Hugging Face tokenizer, written back in the documents' order)
and appends each document's tokens, followed by the separator, to one of two token files:

    <cache>/<name>-<key>/train.bin, eval.bin        raw tokens, uint16 (vocabularies up to 65536) or uint32
                         train_keys.txt, eval_keys.txt  the documents' keys, one JSON string per line, in order
                         meta.json                   sizes, dtype, tokenizer, sha256 of the token files
                         verified.json               the token files' sizes and times when last hashed

`<key>` is a hash of everything that decides the tokens (source, dataset, its files' sizes and times, split,
text field, tokenizer, document cap, eval fraction, seed), so `swarm data prepare` and a peer with the same
`data.*` settings find the same folder, and a changed setting never reuses a stale one. A corpus is written
into a folder of its own and renamed into place whole, under a lock (peers that start together prepare it once);
an interrupted prepare leaves only that folder, which the next one deletes. Re-running on a prepared corpus
is a no-op. Opening checks the token files' sizes against `meta.json` (a truncated file is refused) and re-hashes
them if they were written to since they were last hashed (`verified.json`: their sizes and modification times),
so a tampered or damaged file is refused by its hash, while an unchanged corpus opens without being read;
`prepare(..., verify=True)` (`swarm data prepare` on a prepared corpus) re-hashes them whatever the stamp says.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import hashlib
import json
import logging
import mmap
import multiprocessing
import os
import shutil
import time
from collections import deque
from contextlib import closing, contextmanager
from functools import partial as partial_function
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np

from swarm.config import DataConfig
from swarm.errors import SwarmError, UsageError

log = logging.getLogger("swarm.data")
FORMAT = 1
BATCH_DOCUMENTS = 512  # documents tokenized together
SPLITS = ("train", "eval")


def cache_root(cfg: DataConfig) -> Path:
    """`data.cache_dir`, or `$XDG_CACHE_HOME/swarm/tokens` (default `~/.cache/swarm/tokens`)."""
    if cfg.cache_dir is not None:
        return Path(cfg.cache_dir).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "swarm" / "tokens"


def corpus_key(cfg: DataConfig) -> str:
    """A hash of every setting and local input that decides a corpus's tokens."""
    parts: list[object] = [FORMAT, cfg.source, cfg.dataset, cfg.dataset_config, cfg.split, cfg.text_field,
                           cfg.tokenizer, cfg.max_documents, cfg.eval_fraction, cfg.seed]
    for name in (cfg.dataset, cfg.tokenizer):
        path = Path(str(name)).expanduser() if name else None
        if path is not None and path.exists():
            files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
            parts += [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def corpus_folder(cfg: DataConfig) -> Path:
    name = "embedded" if cfg.source == "embedded" else Path(str(cfg.dataset)).name or "dataset"
    return cache_root(cfg) / f"{name}-{corpus_key(cfg)}"


class Prepared:
    """An opened prepared corpus: its meta, memory-mapped token files and document keys."""

    def __init__(self, folder: Path):
        self.folder = folder
        try:
            self.meta = json.loads((folder / "meta.json").read_text())
            if self.meta.get("format") != FORMAT:
                raise ValueError(f"format {self.meta.get('format')!r}, this version reads {FORMAT}")
            self.dtype = np.dtype(self.meta["dtype"])
            for split in SPLITS:
                size, expected = (folder / f"{split}.bin").stat().st_size, self.meta[f"{split}_tokens"]
                if size != expected * self.dtype.itemsize:
                    raise ValueError(f"{split}.bin holds {size} bytes, its meta says {expected} tokens "
                                     f"of {self.dtype.itemsize} bytes (truncated?)")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SwarmError(f"prepared corpus {folder} is unreadable: {e}; delete it to prepare it again") from None

    def tokens(self, split: str) -> np.ndarray:
        """The split's tokens, memory-mapped read-only (nothing is read until used). The kernel's default
        readahead is kept: advising MADV_RANDOM read a cold 800 MB corpus's random windows 3-4x slower here
        (3-5M against 12-14M tokens/s, a virtual disk)."""
        if self.meta[f"{split}_tokens"] == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(self.folder / f"{split}.bin", dtype=self.dtype, mode="r")

    def prefetcher(self, split: str) -> Optional[Prefetcher]:
        """A `Prefetcher` of the split's token file (None for an empty split)."""
        return Prefetcher(self.folder / f"{split}.bin", self.dtype.itemsize) if self.meta[f"{split}_tokens"] else None

    def keys(self, split: str) -> list[str]:
        return [json.loads(line) for line in (self.folder / f"{split}_keys.txt").read_text().splitlines()]

    def verify(self) -> None:
        """Re-hash the token files against meta.json (SwarmError naming the folder if they differ), and note the
        files' sizes and times as verified (`verified.json`)."""
        if digest(self.folder) != self.meta["sha256"]:
            raise SwarmError(f"prepared corpus {self.folder} fails its hash (tampered or damaged): delete it to "
                             "prepare it again")
        write_stamp(self.folder)

    def check(self) -> None:
        """Re-hash the token files only if they changed since they were hashed (size or modification time differ
        from `verified.json`, written when they were prepared or last verified): a file written to since is
        caught by its hash before a peer trains on it, and an unchanged corpus opens without being read."""
        try:
            stamp = json.loads((self.folder / "verified.json").read_text())
        except (OSError, ValueError):
            stamp = None
        if stamp != _stamp(self.folder):
            log.info("prepared corpus %s changed since it was hashed: hashing it again", self.folder)
            self.verify()


class Prefetcher:
    """Asks the kernel to read token ranges ahead of their use (madvise MADV_WILLNEED on a mapping of the file):
    the reads are issued at once, many in flight, and land in the page cache while the inner step computes. A
    first epoch over a corpus that is not in the page cache reads one random window per sample; one at a time,
    at the disk's latency, that was 0.2M tokens/s on this machine's virtual disk (bench/data.py, 2 GB cold)."""

    def __init__(self, path: Path, itemsize: int):
        self.itemsize = itemsize
        with open(path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def ahead(self, starts: list[int], length: int) -> None:
        """Read ahead the `length` tokens from each token offset in `starts`."""
        size = len(self.map)
        for start in starts:
            begin = start * self.itemsize
            page = begin - begin % mmap.PAGESIZE
            self.map.madvise(mmap.MADV_WILLNEED, page, min(size, begin + length * self.itemsize) - page)


def _stamp(folder: Path) -> dict:
    return {split: [(folder / f"{split}.bin").stat().st_size, (folder / f"{split}.bin").stat().st_mtime_ns]
            for split in SPLITS}


def write_stamp(folder: Path) -> None:
    """Note the token files' sizes and modification times as hashed (`verified.json`)."""
    try:
        tmp = folder / "verified.json.tmp"
        tmp.write_text(json.dumps(_stamp(folder)))
        tmp.replace(folder / "verified.json")
    except OSError as e:  # a read-only corpus folder: hashed again at the next start, never trusted unhashed
        log.warning("cannot note prepared corpus %s as verified: %s", folder, e)


def prepare(folder: Path, cfg: DataConfig, tokenizer, documents: Callable[[], Iterator[tuple[str, str]]],
            is_eval: Callable[[str], float], verify: bool = False,
            progress: Optional[Callable[[int, int, int], None]] = None) -> Prepared:
    """The prepared corpus of `cfg` in `folder` (`corpus_folder(cfg)`), tokenized now if it is not on disk yet.
    `documents()` yields (key, text); `is_eval(key)` scores a document (held out below `cfg.eval_fraction`);
    `progress(documents, tokens, text)` is called as tokenizing goes (text: characters read so far)."""
    if not (folder / "meta.json").exists():
        try:
            folder.parent.mkdir(parents=True, exist_ok=True)
            folder.with_name(folder.name + ".lock").touch()
        except OSError as e:
            raise UsageError(f"cannot write prepared corpora in {folder.parent} ({e.strerror or e}): pass "
                             f"--data.cache_dir DIR, a folder this user can write") from None
        with _locked(folder.with_name(folder.name + ".lock")):
            if not (folder / "meta.json").exists():
                _write(folder, cfg, tokenizer, documents, is_eval, progress)
    prepared = Prepared(folder)
    if verify:
        prepared.verify()
    else:
        prepared.check()
    return prepared


@contextmanager
def _locked(path: Path):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write(folder: Path, cfg: DataConfig, tokenizer, documents, is_eval, progress) -> None:
    """Tokenize into `<folder>.partial` and rename it into place once complete."""
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # what an interrupted prepare left
    partial.mkdir()
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    start, counts = time.perf_counter(), {"documents": 0, "tokens": 0, "text": 0}
    # the document each split would give up if the other ended empty (tiny corpora): (score, key, start, end)
    edge: dict[str, Optional[tuple]] = dict.fromkeys(SPLITS)
    encode = partial_function(_encode_split, tokenizer=tokenizer, is_eval=is_eval,
                              eval_fraction=cfg.eval_fraction, dtype=dtype)
    with open(partial / "train.bin", "wb") as train, open(partial / "eval.bin", "wb") as held, \
            open(partial / "train_keys.txt", "w") as train_keys, open(partial / "eval_keys.txt", "w") as eval_keys:
        files, key_files = {"train": train, "eval": held}, {"train": train_keys, "eval": eval_keys}
        with closing(_in_order(encode, _batches(documents()), prepare_workers(cfg, tokenizer))) as encoded:
            for batch, text in encoded:
                counts["text"] += text
                for split, (tokens, keys, scores, lengths) in batch.items():
                    if keys:
                        at = files[split].tell() // dtype.itemsize
                        files[split].write(tokens.data)
                        key_files[split].write("".join(json.dumps(key) + "\n" for key in keys))
                        _keep_edge(edge, split, at, keys, scores, lengths)
                        counts["documents"] += len(keys)
                        counts["tokens"] += len(tokens)
                if progress is not None:
                    progress(counts["documents"], counts["tokens"], counts["text"])
    if counts["documents"] < 2:
        shutil.rmtree(partial)
        raise UsageError(f"data source {cfg.dataset or cfg.source} gave {counts['documents']} documents; "
                         "need at least 2")
    for split, other in [("eval", "train"), ("train", "eval")]:
        if (partial / f"{split}_keys.txt").stat().st_size == 0:  # one split empty: the other gives one document
            _move(partial, edge[other], other, split, dtype)
    meta = {"format": FORMAT, "dtype": dtype.name, "tokenizer": cfg.tokenizer, "vocab_size": tokenizer.vocab_size,
            "sep_id": tokenizer.sep_id, "documents": counts["documents"], "sha256": digest(partial),
            **{f"{s}_tokens": (partial / f"{s}.bin").stat().st_size // dtype.itemsize for s in SPLITS}}
    (partial / "meta.json").write_text(json.dumps(meta, indent=1))
    for path in partial.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    partial.rename(folder)
    write_stamp(folder)
    log.info("prepared %d documents, %d tokens in %.1fs: %s", counts["documents"], counts["tokens"],
             time.perf_counter() - start, folder)


def _keep_edge(edge: dict[str, Optional[tuple]], split: str, at: int, keys: list[str], scores: np.ndarray,
               lengths: np.ndarray) -> None:
    """Note in `edge` the document of `split` it would give up to the other split if that ended empty: train its
    lowest score, eval its highest, the first of equals; (score, key, start, end), `at`: where the batch starts."""
    i = int(np.argmin(scores) if split == "train" else np.argmax(scores))
    best = edge[split]
    if best is None or (scores[i] < best[0] if split == "train" else scores[i] > best[0]):
        begin = at + int(np.sum(lengths[:i]))
        edge[split] = (float(scores[i]), keys[i], begin, begin + int(lengths[i]))


def prepare_workers(cfg: DataConfig, tokenizer) -> int:
    """Processes that tokenize: `data.prepare_workers`, or one per core this process may run on for a Hugging Face
    tokenizer and one for bytes. Bytes are a copy (87M tokens/s in one process here) that sending documents to
    workers and tokens back only slows (52M/s with two); a BPE costs ~1M tokens/s per core, and its Rust batch
    call already threads over every core in one process, but the parent's share (documents, ids to arrays, eval
    scores, writes) then bounds it: one process per core runs that in parallel too (a BPE of 8000 on 20 MB, 2
    cores: 1.55M tokens/s in one process, 1.55-1.74M with two; the more cores, the larger the parent's share)."""
    if cfg.prepare_workers is not None:
        return cfg.prepare_workers
    return len(os.sched_getaffinity(0)) if hasattr(tokenizer, "encode_batch") else 1


def _batches(documents: Iterator[tuple[str, str]]) -> Iterator[list[tuple[str, str]]]:
    batch = []
    for doc in documents:
        batch.append(doc)
        if len(batch) == BATCH_DOCUMENTS:
            yield batch
            batch = []
    if batch:
        yield batch


Encoded = tuple[dict[str, tuple[np.ndarray, list[str], np.ndarray, np.ndarray]], int]
"""One batch tokenized: per split, its documents' tokens end to end (each followed by the separator), their keys,
and per document its eval score and its length in tokens; and the characters of text it held."""


def _encode_split(batch: list[tuple[str, str]], tokenizer, is_eval, eval_fraction: float, dtype: np.dtype) -> Encoded:
    keys = [key for key, _ in batch]
    scores = np.array([is_eval(key) for key in keys], dtype=np.float64)
    ids = [np.asarray(i, dtype=dtype) for i in _encode(tokenizer, [text for _, text in batch])]
    out = {}
    for split, mask in (("train", scores >= eval_fraction), ("eval", scores < eval_fraction)):
        chosen = np.flatnonzero(mask)
        pieces = [piece for j in chosen for piece in (ids[j], np.array([tokenizer.sep_id], dtype=dtype))]
        tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=dtype)
        out[split] = (tokens, [keys[j] for j in chosen], scores[chosen],
                      np.array([len(ids[j]) + 1 for j in chosen], dtype=np.int64))
    return out, sum(len(text) for _, text in batch)


def _encode(tokenizer, texts: list[str]) -> list:
    if hasattr(tokenizer, "encode_batch"):
        return tokenizer.encode_batch(texts)
    return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]


_WORKER_ENCODE: Optional[Callable[[list[tuple[str, str]]], Encoded]] = None
"""In a worker process of `_in_order`: the encoding function it runs (set once by `_start_worker`)."""


def _start_worker(encode: Callable[[list[tuple[str, str]]], Encoded]) -> None:
    global _WORKER_ENCODE
    _WORKER_ENCODE = encode
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the processes are the parallelism


def _run_worker(batch: list[tuple[str, str]]) -> Encoded:
    assert _WORKER_ENCODE is not None
    return _WORKER_ENCODE(batch)


def _in_order(encode: Callable[[list[tuple[str, str]]], Encoded], batches: Iterator[list[tuple[str, str]]],
              workers: int) -> Iterator[Encoded]:
    """`encode(batch)` for each batch, in the batches' order (the token files are the same whatever `workers`),
    on `workers` processes forked from this one (1: here). At most two batches per worker are in flight, so
    memory stays bounded however long the corpus (`Pool.imap` would read the whole input ahead). The workers are
    forked, not spawned: they start in milliseconds and inherit the tokenizer, and they run only the tokenizer
    and numpy, none of the threads the parent may have started. Stopped early, it lets the batches in flight end
    and joins the workers: `multiprocessing.Pool`'s terminate there hung once (its task handler
    blocked on the input queue's lock, `make test` from a clean clone), a ProcessPoolExecutor's shutdown does
    not terminate anything."""
    if workers <= 1:
        yield from map(encode, batches)
        return
    pool = concurrent.futures.ProcessPoolExecutor(workers, multiprocessing.get_context("fork"), _start_worker,
                                                  (encode,))
    try:
        pending: deque = deque()
        for batch in batches:
            pending.append(pool.submit(_run_worker, batch))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:  # also when the caller stops early (an interrupt): the batches in flight end, the workers with them
        pool.shutdown(wait=True, cancel_futures=True)


def _move(folder: Path, document: tuple, source: str, target: str, dtype: np.dtype) -> None:
    """Move one document (its tokens [start, end) and its key) from split `source` to the empty split `target`,
    copying `source` piece by piece (never whole in memory)."""
    _, key, start, end = document
    path, rest = folder / f"{source}.bin", folder / f"{source}.bin.rest"
    tokens = np.memmap(path, dtype=dtype, mode="r")
    tokens[start:end].tofile(folder / f"{target}.bin")
    with open(rest, "wb") as f:
        for a, b in [(0, start), (end, len(tokens))]:
            for piece in range(a, b, 1 << 24):
                f.write(tokens[piece:min(b, piece + (1 << 24))].tobytes())
    del tokens
    rest.replace(path)
    with open(folder / f"{source}_keys.txt") as f, open(folder / f"{source}_keys.rest", "w") as out:
        out.writelines(line for line in f if line != json.dumps(key) + "\n")
    (folder / f"{source}_keys.rest").replace(folder / f"{source}_keys.txt")
    (folder / f"{target}_keys.txt").write_text(json.dumps(key) + "\n")


def digest(folder: Path) -> str:
    """The corpus's content hash: sha256 over its token files, train then eval (meta.json's `sha256`)."""
    digest = hashlib.sha256()
    for split in SPLITS:
        with open(folder / f"{split}.bin", "rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()
