"""`swarm data prepare`: tokenize a config's corpus once into token files (swarm/data/tokens.py), with a progress line;
on a corpus already prepared, check its token files against their hash."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Optional

from swarm.config import DataConfig
from swarm.data.batches import build_tokenizer, check_vocabulary, load_corpus
from swarm.data.tokens import corpus_folder
from swarm.errors import UsageError

log = logging.getLogger("swarm.data")


def run_prepare(cfg: DataConfig, model_vocab: Optional[int] = None) -> int:
    """Prepare (or verify) the corpus of `cfg`; `model_vocab`: the config's model.vocab_size, which the
    tokenizer must fit."""
    check_vocabulary(build_tokenizer(cfg), model_vocab, cfg)
    folder, start = corpus_folder(cfg), time.perf_counter()
    done = (folder / "meta.json").exists()
    corpus = load_corpus(cfg, cache=False, verify=done)  # with its progress bar (swarm/run/progress.py PrepareProgress)
    meta = corpus.prepared.meta
    what = "verified" if done else f"prepared in {time.perf_counter() - start:.1f}s"
    print(f"{what}: {folder}\n{meta['documents']} documents, {meta['train_tokens']} train and {meta['eval_tokens']} "
          f"eval tokens ({meta['dtype']}), sha256 {meta['sha256'][:16]}")
    return 0


CORPUS_KEYS = ("source", "dataset", "dataset_config", "split", "text_field", "tokenizer", "max_documents",
               "eval_fraction", "seed")
"""The `data.*` keys that decide a corpus's tokens (swarm/data/tokens.py corpus_key), those a prepare command needs."""


def prepare_command(cfg: DataConfig) -> str:
    """The `swarm data prepare` command that prepares the corpus of `cfg` where a peer with `cfg` looks."""
    default = DataConfig()
    flags = [f"--data.{k} {getattr(cfg, k)}" for k in CORPUS_KEYS if getattr(cfg, k) != getattr(default, k)]
    if cfg.cache_dir is not None:
        flags.append(f"--data.cache_dir {cfg.cache_dir}")
    return " ".join(["swarm data prepare", *flags])


def check_prepared(cfg: DataConfig) -> None:
    """UsageError (exit 2) with the command that prepares it, if `cfg` names a hub dataset that is not prepared on
    this machine: a peer never downloads a corpus itself (a recipe naming C4 would otherwise start a download of
    hundreds of GB, or before this rule train on the embedded toy corpus); a local dataset it prepares first."""
    from swarm.data.batches import is_local

    if cfg.source != "hf" or is_local(str(cfg.dataset)) or (corpus_folder(cfg) / "meta.json").exists():
        return
    raise UsageError(f"data.dataset {cfg.dataset} is not prepared on this machine, and a peer downloads no corpus "
                     f"itself: prepare it once (it downloads and tokenizes it, for every peer here) with: "
                     f"{prepare_command(cfg)}")


def check_corpus_here(cfg: DataConfig, run_id: str, corpus_sha256: str, dry_run: bool = False) -> bool:
    """Before `swarm join` starts a peer: whether the run's corpus must be fetched from its peers (True:
    peers/corpus_fetch.py), because it is not prepared here and its dataset is not here either (a hub name, or a
    path this machine lacks). False: it is prepared, or it will be prepared here first (a line says so). UsageError
    (exit 2) naming what to do if the tokenizer's files are not here (they are not fetched), or with `dry_run`
    (which fetches nothing) if the corpus would be fetched."""
    from swarm.data.batches import is_local

    if (corpus_folder(cfg) / "meta.json").exists():
        return False
    wanted = f"run {run_id!r} trains on corpus sha256 {corpus_sha256[:16] or '?'}"
    if cfg.tokenizer != "bytes" and is_local(cfg.tokenizer) and not Path(cfg.tokenizer).expanduser().exists():
        raise UsageError(f"{wanted}, tokenized by {cfg.tokenizer}, which is not on this machine: join with "
                         f"--data.tokenizer PATH, this machine's copy of it")
    here = cfg.source == "embedded" or (is_local(str(cfg.dataset)) and Path(str(cfg.dataset)).expanduser().exists())
    if here:
        source = "the embedded corpus" if cfg.source == "embedded" else f"dataset {cfg.dataset}"
        log.info("%s, from %s, not prepared here yet: preparing it first (as `%s` does)", wanted, source,
                 prepare_command(cfg))
        return False
    if dry_run:
        raise UsageError(f"{wanted}, from dataset {cfg.dataset}, which is not on this machine: a join fetches it "
                         f"from the run's peers, a dry run fetches nothing (or join with --data.dataset PATH, this "
                         f"machine's copy of it, or prepare it ahead with: {prepare_command(cfg)})")
    return True
