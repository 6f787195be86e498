"""Memory per rank of a sharded peer (`inner.parallel: fsdp`, swarm/train/sharding.py): one `swarm peer --solo`
of K = 1, 2, 4 ranks on a model of >= 150M parameters, two rounds of 3 inner steps, and each rank's peak resident memory
(ru_maxrss, which each rank writes to ranks/rank-<k>.json) against its share of the training state, with blocking
exchanges and with delayed ones (`diloco.delay 1`: the exchange in flight while the next inner steps run).

The training state is 24 bytes per parameter (fp32 parameters, gradients, both AdamW moments, global parameters
and outer momentum); a rank of K holds 1/K of it. The per-process constant is the peak of a rank of the same
peer on a model of ~30k parameters (the interpreter, torch, transformers, hivemind, the corpus). Reported per K:
the state's share, rank 0's peak and the other ranks' largest, and (peak - constant) / (state / K), the target
being <= 1.3. The exchange passes through two node-local files (swarm/train/sharding.py), so rank 0 holds no more
than the others.
`--quick`: a 3M-parameter model, K = 1, 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, md_table, stamp
from swarm.data.batches import load_corpus
from swarm.run.configfile import load_config
from swarm.train.model import build_model

BYTES_PER_PARAMETER = 6 * 4
RUN = ["--data.seq_len", "64", "--model.max_seq_len", "64", "--data.batch_size", "4", "--data.eval_batches", "1",
       "--diloco.rounds", "2", "--diloco.inner_steps", "3", "--inner.warmup_steps", "1", "--diloco.threads", "1",
       "--checkpoint.every", "0", "--logging.progress_bar", "false", "--inner.parallel", "fsdp",
       "--data.max_documents", "200"]
MODELS = {
    "full": ["--model.hidden_size", "1024", "--model.num_layers", "12", "--model.num_heads", "16",
             "--model.intermediate_size", "2816"],
    "quick": ["--model.hidden_size", "256", "--model.num_layers", "4", "--model.num_heads", "4",
              "--model.intermediate_size", "688"],
    "empty": ["--model.hidden_size", "32", "--model.num_layers", "2", "--model.num_heads", "2",
              "--model.intermediate_size", "64"],
}
EXCHANGES = {"blocking": ["--diloco.delay", "0"], "delayed": ["--diloco.delay", "1"]}


EXPORT = r'''
import resource, sys
from pathlib import Path
from swarm.state.export import export_hf
export_hf(Path(sys.argv[1]), Path(sys.argv[2]))
print("PEAK", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
'''


def peaks(model: list[str], k: int, out: Path, *extra: str) -> list[int]:
    """Each rank's peak resident bytes (rank order) of one solo peer of `k` ranks."""
    proc = subprocess.run([sys.executable, "-m", "swarm.cli", "peer", "--solo", "--config", "configs/tiny.yaml",
                           "--nproc-per-node", str(k), *model, *RUN, *extra, "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"swarm peer exited {proc.returncode}: {proc.stderr[-2000:]}")
    if k == 1:
        return [json.loads((out / "summary.json").read_text())["peers"][0]["peak_rss_bytes"]]
    return [json.loads(p.read_text())["peak_rss_bytes"] for p in sorted((out / "ranks").glob("rank-*.json"))]


def export_peak(model: list[str], out: Path) -> int:
    """Peak resident bytes of `swarm export` (in a fresh process) of the sharded checkpoint a 2-rank peer of `model`
    wrote after its round."""
    peaks(model, 2, out, "--checkpoint.every", "1", *EXCHANGES["blocking"])
    proc = subprocess.run([sys.executable, "-c", EXPORT, str(out), str(out / "hf")], cwd=REPO, capture_output=True,
                          text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"swarm export exited {proc.returncode}: {proc.stderr[-2000:]}")
    return int(next(line for line in proc.stdout.splitlines() if line.startswith("PEAK "))[5:])


def run(quick: bool) -> dict:
    model, ks = (MODELS["quick"], [1, 2]) if quick else (MODELS["full"], [1, 2, 4])
    cfg = load_config(REPO / "configs" / "tiny.yaml", model)
    sizes = [p.numel() for p in build_model(cfg.model, load_corpus(cfg.data).tokenizer.vocab_size,
                                            device="meta").parameters()]
    params, largest = sum(sizes), max(sizes)
    state = BYTES_PER_PARAMETER * params
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-shards-") as tmp:
        constant = max(peaks(MODELS["empty"], 2, Path(tmp) / "empty", *EXCHANGES["blocking"]))
        measured = {(mode, k): peaks(model, k, Path(tmp) / f"{mode}-k{k}", *flags)
                    for mode, flags in EXCHANGES.items() for k in ks}
        export = {"model": export_peak(model, Path(tmp) / "export"),
                  "constant": export_peak(MODELS["empty"], Path(tmp) / "export-empty")}
    rows, points = [], []
    for (mode, k), per_rank in measured.items():
        share = state / k
        others = max(per_rank[1:], default=None)
        ratio = [(p - constant) / share for p in per_rank]
        points.append({"exchange": mode, "k": k, "peak_rss_bytes": per_rank, "state_share_bytes": share,
                       "ratio": ratio})
        rows.append([mode, str(k), f"{share / 2**20:.0f}", f"{per_rank[0] / 2**20:.0f} ({ratio[0]:.2f}x)",
                     "-" if others is None else f"{others / 2**20:.0f} ({max(ratio[1:]):.2f}x)"])
    table = md_table(["exchange", "K ranks", "state / K, MiB", "rank 0 peak RSS, MiB ((peak - constant) / (state / K))",
                      "other ranks' largest peak RSS, MiB (ratio)"], rows)
    table += (f"\n\n{params / 1e6:.1f}M parameters, training state {state / 2**20:.0f} MiB (24 bytes per parameter); "
              f"per-process constant (a rank of a 2-rank peer of a 30k-parameter model) {constant / 2**20:.0f} MiB. "
              f"One `swarm peer --solo --inner.parallel fsdp` per K and exchange (blocking: `--diloco.delay 0`; "
              f"delayed: `--diloco.delay 1`, the exchange in flight during the next inner step): 2 rounds of 3 inner "
              f"steps, batch 4 x 64 tokens, 1 torch thread per rank on 2 shared cores. The exchange passes through "
              f"two node-local files (the pseudo-gradient, the average: swarm/train/sharding.py), read and written a "
              f"chunk at a time, so rank 0 holds no more than the others (the files' pages are the page cache's, not "
              f"a process's).")
    table += "\n\n" + md_table(
        ["`swarm export` of the 2-rank checkpoint", "peak RSS, MiB", "over the constant, MiB", "global parameters, MiB",
         "largest tensor, MiB"],
        [["fp32", f"{export['model'] / 2**20:.0f}", f"{(export['model'] - export['constant']) / 2**20:.0f}",
          f"{4 * params / 2**20:.0f}", f"{4 * largest / 2**20:.1f}"]])
    table += ("\n\nExport in a fresh process; its constant: the same export of the 30k-parameter model's checkpoint. "
              "The model is built on the meta device and each tensor read from its pieces, cast and written in turn.")
    return {"table": table, "params": params, "state_bytes": state, "constant_bytes": constant, "points": points,
            "export_peak_bytes": export["model"], "export_constant_bytes": export["constant"],
            "largest_tensor_bytes": 4 * largest,
            "wall_s_runs": time.time() - start, "timestamp": stamp()}


if __name__ == "__main__":
    print(run("--quick" in sys.argv)["table"])
