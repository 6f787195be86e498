"""The round at real model sizes: an 85M-parameter Llama (configs/scale-85m.yaml) trained by a 3-peer
`swarm local` on loopback, with a 4th peer joining when the swarm reaches round 2 (it downloads the state).

Reported from the peers' own summary.json:
- peak resident memory per peer / its training state (fp32 parameters, gradients, both AdamW moments, global
  parameters and outer momentum: 24 bytes per parameter), next to the same ratio for one `swarm peer --solo`
  process on the same model and batch: the floor any DiLoCo peer with this micro-batch has; and, as section 10
  counts a rank, (peak - constant) / training state, the constant being the largest peak of a peer of the same
  swarm with a model of 30k parameters: what a peer process holds whatever it trains (torch, hivemind,
  bitsandbytes, the corpus);
- all-reduce MB/s per peer (bytes it received in the all-reduce / the all-reduce's seconds);
- state download MB/s (the joiner's download of global parameters, outer momentum and AdamW moments);
- time per round outside inner steps and matchmaking + all-reduce (`overhead_s`), as a share of the round.
Both for blocking rounds (`diloco.delay 0`) and delayed ones (`diloco.delay 1`: the outer step overlaps the
next round's first inner step, a tenth of H as in the shipped configs). Every peer runs on 1 torch thread;
4 peers share the machine's 2 cores. `--quick`: a 21M-parameter model.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, md_table, stamp
from swarm.data.batches import load_corpus
from swarm.run.configfile import load_config
from swarm.train.model import build_model, count_parameters

CONFIG = REPO / "configs" / "scale-85m.yaml"
FULL = dict(overrides=[], rounds=4, inner_steps=10)
QUICK = dict(overrides=["--model.hidden_size", "512", "--model.num_layers", "6", "--model.num_heads", "8",
                        "--model.intermediate_size", "1376"], rounds=4, inner_steps=6)
EMPTY = ["--model.hidden_size", "32", "--model.num_layers", "1", "--model.num_heads", "2",
         "--model.intermediate_size", "64"]  # the per-process constant's model: 30k parameters
BYTES_PER_PARAMETER = 6 * 4  # parameters, gradients, exp_avg, exp_avg_sq, global parameters, outer momentum


def swarm_local(args: list[str], out: Path, timeout: float) -> dict:
    proc = subprocess.run([sys.executable, "-m", "swarm.cli", "local", "--config", str(CONFIG), *args, "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"swarm local exited {proc.returncode}: {proc.stdout[-1500:]} {proc.stderr[-1500:]}")
    return json.loads((out / "summary.json").read_text())


def solo_peak(overrides: list[str], out: Path) -> int:
    """Peak resident bytes of one `swarm peer --solo` on the same model: 1 round of 3 inner steps."""
    subprocess.run([sys.executable, "-m", "swarm.cli", "peer", "--solo", "--config", str(CONFIG), *overrides,
                    "--diloco.rounds", "1", "--diloco.inner_steps", "3", "--inner.warmup_steps", "1",
                    "--diloco.threads", "1", "--logging.progress_bar", "false", "--out", str(out)],
                   cwd=REPO, check=True, capture_output=True, timeout=900)
    return json.loads((out / "summary.json").read_text())["peers"][0]["peak_rss_bytes"]


def measure(summary: dict, state_bytes: int) -> dict:
    peers = summary["peers"]
    rounds = [r for p in peers for r in p["rounds"] if r["committed"] and r["group_size"] > 1]
    allreduce = [r["bytes_received"] / r["allreduce_s"] / 1e6 for r in rounds if r["allreduce_s"] > 0]
    share = [r["overhead_s"] / (r["compute_s"] + r["comm_s"] + r["overhead_s"]) for r in rounds]
    plain = [r for r in rounds if r["eval_s"] < 0.05]  # rounds without the held-out eval
    downloads = [e for p in peers for e in p["events"] if e["event"] == "state_downloaded"]
    return {
        "peak_rss_ratio": {p["name"]: p["peak_rss_bytes"] / state_bytes for p in peers},
        "allreduce_mb_s": allreduce, "overhead_s": [r["overhead_s"] for r in rounds], "overhead_share": share,
        "overhead_share_without_eval": [r["overhead_s"] / (r["compute_s"] + r["comm_s"] + r["overhead_s"])
                                        for r in plain],
        "eval_s": [r["eval_s"] for r in rounds if r["eval_s"] >= 0.05],
        "round_s": [r["compute_s"] + r["comm_s"] + r["overhead_s"] for r in rounds],
        "downloads": [{"mb": e["bytes"] / 1e6, "seconds": e["seconds"], "mb_s": e["bytes"] / 1e6 / e["seconds"]}
                      for e in downloads],
        "identical": len({p["final_global_sha256"] for p in peers}) == 1,
    }


MODES = {"blocking": ["--diloco.delay", "0"], "delayed": ["--diloco.delay", "1"]}
"""The outer step blocking the next round's inner steps, or overlapping its first one (a tenth of H=10, the ratio
of the shipped configs)."""


def run(quick: bool) -> dict:
    spec = QUICK if quick else FULL
    cfg = load_config(CONFIG, spec["overrides"])
    params = count_parameters(build_model(cfg.model, load_corpus(cfg.data).tokenizer.vocab_size))
    state_bytes = BYTES_PER_PARAMETER * params
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        floor = solo_peak(spec["overrides"], Path(tmp) / "solo") / state_bytes

        def swarm(model: list[str], flags: list[str], out: Path) -> dict:
            return swarm_local([*model, *flags, "--peers", "3", "--join", "2", "--rounds", str(spec["rounds"]),
                                "--diloco.inner_steps", str(spec["inner_steps"])], out, 3000)
        empty = swarm(EMPTY, MODES["delayed"], Path(tmp) / "empty")
        constant = max(p["peak_rss_bytes"] for p in empty["peers"])
        modes = {mode: measure(swarm(spec["overrides"], flags, Path(tmp) / mode), state_bytes)
                 for mode, flags in MODES.items()}
        for m in modes.values():
            m["over_constant_ratio"] = {k: v - constant / state_bytes for k, v in m["peak_rss_ratio"].items()}
    med = statistics.median
    rows = []
    for mode, m in modes.items():
        ratios = m["peak_rss_ratio"]
        rows += [
            [f"{mode}: peak resident memory / training state, per peer",
             " ".join(f"{k} {v:.2f}x" for k, v in ratios.items()),
             f"max {max(ratios.values()):.2f}x; one `--solo` process: {floor:.2f}x"],
            [f"{mode}: (peak - constant) / training state, per peer",
             " ".join(f"{k} {v:.2f}x" for k, v in m["over_constant_ratio"].items()),
             f"max {max(m['over_constant_ratio'].values()):.2f}x (section 10's measure)"],
            [f"{mode}: all-reduce MB/s per peer (received)", f"median {med(m['allreduce_mb_s']):.0f}",
             f"min {min(m['allreduce_mb_s']):.0f}, max {max(m['allreduce_mb_s']):.0f}"],
            [f"{mode}: state download MB/s (joiner)", " ".join(f"{d['mb_s']:.0f}" for d in m["downloads"]) or "–",
             " ".join(f"{d['mb']:.0f} MB in {d['seconds']:.1f} s" for d in m["downloads"])],
            [f"{mode}: time outside inner steps and all-reduce, per round", f"median {med(m['overhead_s']):.2f} s "
             f"({100 * med(m['overhead_share']):.1f}% of the round)",
             f"max {100 * max(m['overhead_share']):.1f}% ({100 * max(m['overhead_share_without_eval']):.1f}% in "
             f"rounds without the eval, which takes {med(m['eval_s'] or [0]):.1f} s); rounds of "
             f"{med(m['round_s']):.0f} s"],
        ]
    table = md_table(["what", "measured", "detail"], rows)
    identical = ", ".join(f"{mode} {m['identical']}" for mode, m in modes.items())
    table += (f"\n\n{params / 1e6:.1f}M parameters (training state {state_bytes / 1e9:.2f} GB), micro-batch "
              f"{cfg.data.batch_size}x{cfg.data.seq_len}, {spec['rounds']} rounds of H={spec['inner_steps']}, "
              f"3 peers + 1 joiner at round 2 on loopback, 1 torch thread each on 2 shared cores; blocking: "
              f"`--diloco.delay 0`, delayed: `--diloco.delay 1`; pseudo-gradients sent {cfg.swarm.compression} "
              f"(the config's swarm.compression). The per-process constant, {constant / 1e9:.2f} GB: the largest "
              f"peak of the same delayed swarm with a 30k-parameter model. "
              f"Every peer ended on the same hash: {identical}. "
              f"All-reduce time against hivemind's averager: section 5.")
    return {"table": table, "params": params, "state_bytes": state_bytes, "solo_peak_ratio": floor,
            "constant_bytes": constant, "modes": modes,
            "config": spec, "wall_s_swarm": time.time() - start, "timestamp": stamp()}
