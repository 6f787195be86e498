"""Prepared corpora (swarm/data/tokens.py): prepare throughput, and what a peer's memory and start-up owe to the corpus.

For generated text corpora of growing size (one document per line, words drawn from a fixed vocabulary): the
time and peak RSS of preparing each with byte tokens, in a process of its own; then, in a fresh process per
corpus, a training peer's start-up (loading the prepared corpus, cutting its shard, building the model: the
time to its first inner step) and its peak RSS after a few inner steps; and the loader's throughput, windows of
1024 tokens in batches of 32 (the 150M recipe's micro-batch) read in the order of a shard's epoch. One corpus is
also prepared with a Hugging Face BPE of 8000 tokens trained on it here, for the cost of a real tokenizer.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO

SIZES_MB = {True: [40, 400], False: [40, 400, 4000]}  # another set: `python -m bench.data 40 2000`
BATCH, SEQ = 32, 1024

CHILD = r'''
import json, resource, sys, time
start = time.perf_counter()
from swarm.run.configfile import load_config
from swarm.data.batches import load_corpus, TrainBatches
if sys.argv[1] == "peer":  # imported before the clock starts: the same for every corpus size
    from swarm.train.averaging import SoloAverager
    from swarm.train.trainer import Trainer
mode, dataset, cache, tokenizer = sys.argv[1:5]
cfg = load_config("configs/tiny.yaml", {"data": {"source": "hf", "dataset": dataset, "cache_dir": cache,
    "tokenizer": tokenizer, "num_shards": 64, "seq_len": 128, "batch_size": 8}, "diloco": {"rounds": 1,
    "inner_steps": 3, "threads": 1, "delay": 0}, "inner": {"warmup_steps": 1}, "checkpoint": {"every": 0},
    "logging": {"progress_bar": False}})
imported = time.perf_counter()
out = {}
if mode == "prepare":
    corpus = load_corpus(cfg.data)
    out["tokens"] = len(corpus.train) + len(corpus.eval)
    out["seconds"] = time.perf_counter() - imported
else:
    trainer = Trainer(cfg, SoloAverager(), "bench", shard=3, out_dir=__import__("pathlib").Path(sys.argv[5]))
    trainer.inner_step()
    out["start_s"] = time.perf_counter() - imported
    trainer.train()
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before the loader reads pages
    seq, batch = int(sys.argv[6]), int(sys.argv[7])
    import os
    from swarm.config import DataConfig
    loader = TrainBatches(trainer.corpus, DataConfig(seq_len=seq, batch_size=batch, num_shards=1), 0, "bench")
    path = trainer.corpus.prepared.folder / "train.bin"

    def tokens_per_s():
        t, steps = time.perf_counter(), 0
        while time.perf_counter() - t < 3.0:
            loader.next_batch()
            steps += 1
        return steps * seq * batch / (time.perf_counter() - t)

    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # out of the page cache: a corpus read for the first time
    os.close(fd)
    out["loader_cold_tokens_per_s"] = tokens_per_s()
    with open(path, "rb") as f:  # into the page cache: the corpus after its first epoch (or on a machine with RAM)
        while f.read(1 << 26):
            pass
    out["loader_tokens_per_s"] = tokens_per_s()
out.setdefault("peak_rss_mb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
print("RESULT " + json.dumps(out))
'''


def generate(path: Path, megabytes: int, seed: int = 0) -> None:
    """A .txt corpus of about `megabytes` MB: one document (50-300 words) per line."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(5000)]
    lines = [" ".join(rng.choices(words, k=rng.randint(50, 300))) + "\n" for _ in range(4000)]
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "part.txt", "w") as f:
        written = 0
        while written < megabytes * 1_000_000:
            line = rng.choice(lines)
            f.write(line)
            written += len(line)


def child(*args: str) -> dict:
    result = subprocess.run([sys.executable, "-c", CHILD, *args], cwd=REPO, capture_output=True, text=True,
                            timeout=3600)
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-2000:])
    return json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))[7:])


def train_bpe(texts: list[str], out: Path, vocab_size: int) -> str:
    """A byte-level BPE of `vocab_size` tokens trained on `texts`, saved as a Hugging Face tokenizer in `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>", "<unk>"],
                                                       show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>").save_pretrained(out)
    return str(out)


def step_tokens_per_s() -> float:
    """What one rank of the 150M recipe (configs/llama-150m.yaml) consumes at most: an H200's dense bf16 peak
    (989 TFLOP/s) over the step's FLOPs per token, 6 x parameters + 12 x layers x hidden x seq_len (attention),
    i.e. 100% MFU; a real step (30-50% MFU) consumes less. An estimate from the config, not a measurement."""
    from swarm.run.configfile import load_config

    cfg = load_config(REPO / "configs" / "llama-150m.yaml", {})
    m, d = cfg.model, cfg.model.hidden_size
    params = m.vocab_size * d + m.num_layers * (4 * d * d + 3 * d * m.intermediate_size + 2 * d) + d
    return 989e12 / (6 * params + 12 * m.num_layers * d * cfg.data.seq_len)


def run(quick: bool = False, sizes: list[int] | None = None) -> dict:
    rows, work, load = [], Path(tempfile.mkdtemp(prefix="bench-data-")), os.getloadavg()[1]
    sizes = sizes or SIZES_MB[quick]
    try:
        for mb in sizes:
            corpus, cache = work / f"corpus-{mb}", work / "cache"
            generate(corpus, mb)
            texts = (corpus / "part.txt").read_text().splitlines()[:4000] if mb == sizes[0] else []
            tokenizers = ["bytes"] + ([train_bpe(texts, work / "bpe", 8000)] if texts else [])
            for tokenizer in tokenizers:
                text = str(corpus / "part.txt")
                prepared = child("prepare", text, str(cache), tokenizer)
                peer = child("peer", text, str(cache), tokenizer, str(work / "peer"), str(SEQ), str(BATCH))
                rows.append({"corpus_mb": mb, "tokenizer": "bytes" if tokenizer == "bytes" else "BPE 8000",
                             **{f"prepare_{k}": v for k, v in prepared.items()},
                             **{f"peer_{k}": v for k, v in peer.items()}})
                print(rows[-1], flush=True)
            shutil.rmtree(corpus)
            shutil.rmtree(cache)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    step = step_tokens_per_s()
    lines = ["| corpus | tokenizer | prepare | tokens/s | prepare peak RSS | peer start-up | peer peak RSS | "
             "loader tokens/s, cold | warm | cold / 150M step |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['corpus_mb']} MB | {r['tokenizer']} | {r['prepare_seconds']:.1f} s | "
                     f"{r['prepare_tokens'] / r['prepare_seconds'] / 1e6:.2f}M | {r['prepare_peak_rss_mb']:.0f} MB | "
                     f"{r['peer_start_s']:.2f} s | {r['peer_peak_rss_mb']:.0f} MB | "
                     f"{r['peer_loader_cold_tokens_per_s'] / 1e6:.1f}M | {r['peer_loader_tokens_per_s'] / 1e6:.1f}M | "
                     f"{r['peer_loader_cold_tokens_per_s'] / step:.0f}x |")
    table = "\n".join(lines) + (
        "\n\nprepare: `load_corpus` in a fresh process (imports excluded), a generated .txt file (one document per "
        "line) to token files; peer: a solo Trainer on configs/tiny.yaml in a fresh process, start-up = opening the "
        "prepared corpus, its shard, the model and one inner step (imports excluded), peak RSS after its round "
        f"(before the loader test, whose reads map the file's pages into the process); loader: `next_batch` of "
        f"{BATCH} x {SEQ} tokens (the 150M recipe's micro-batch) for 3 s on one core, cold: the token file evicted "
        "from the page cache first (a first epoch), warm: after reading it whole; 150M step: what one rank of the "
        f"150M recipe consumes at most, {step / 1e6:.2f}M tokens/s (`step_tokens_per_s`: an H200 at 100% MFU, an "
        "estimate from the config; no GPU here). Prepare: one process for bytes, one per core for the BPE "
        f"(`data.prepare_workers`). The machine: {len(os.sched_getaffinity(0))} cores, 5-minute load average "
        f"{load:.1f} at the start and {os.getloadavg()[1]:.1f} at the end.")
    return {"rows": rows, "table": table, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


if __name__ == "__main__":
    sizes = [int(a) for a in sys.argv[1:] if a.isdigit()] or None
    print(run(quick="--quick" in sys.argv, sizes=sizes)["table"])
