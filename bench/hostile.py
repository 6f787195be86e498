"""Hostile peers: a real local swarm with one attacker (`swarm local --hostile KIND@PEER`), once per attack,
beside the same swarm unattacked. For each: did the honest peers commit every round on one hash, how many
samples they averaged per round (share of the unattacked run's), their final eval loss (vs the unattacked
run's), and what caught the attacker (the honest peers' summary events that name it).

Targets (issue: strangers in the swarm): every round committed on one hash, >= 90% of the samples per round,
eval loss within 2%.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from bench.common import REPO, md_table, stamp
from swarm.net.attacks import ATTACKS

PEERS, ATTACKER = 4, 3
RUN = ["--rounds", "4", "--diloco.inner_steps", "30", "--diloco.delay", "0",  # blocking, as in the committed table
       "--inner.warmup_steps", "10", "--data.eval_batches", "4",
       "--swarm.matchmaking_time", "3", "--swarm.request_timeout", "1", "--swarm.stall_timeout", "10",
       # the defenses (off by default): every run, the unattacked one too, uses them
       "--swarm.max_weight_share", "0.5", "--swarm.clip_norm_ratio", "4", "--swarm.aggregation", "trimmed_mean",
       "--swarm.verify_parts", "true"]
EXTRA = {"poison-state": ["--join", "2"]}  # a newcomer that downloads the state, maybe from the attacker


def local_swarm(out: Path, hostile: Optional[str], timeout: float = 900) -> dict:
    argv = [sys.executable, "-m", "swarm.cli", "local", "--config", "configs/tiny.yaml", "--peers", str(PEERS),
            "--out", str(out), "--no-monitor", *RUN, *EXTRA.get(hostile, []),
            *(["--hostile", f"{hostile}@{ATTACKER}"] if hostile else [])]
    shutil.rmtree(out, ignore_errors=True)  # a run left there would resume from its checkpoints
    start = time.time()
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.run(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else None
    return {"rc": proc.returncode, "wall_s": time.time() - start, "summary": summary}


def outcome(run: dict) -> dict:
    """What the honest peers got: rounds committed, one hash, samples per committed round, final eval loss, and
    the events in which they refused someone."""
    summary = run["summary"] or {"peers": [], "events": []}
    # the same peers in every run: all but peer ATTACKER (honest in the unattacked run), plus any joiner
    honest = [p for p in summary["peers"] if "hostile" not in p and p.get("name") != f"peer-{ATTACKER}"]
    attacker_ids = {p["peer_id"] for p in summary["peers"] if "hostile" in p}
    committed = [[r for r in p["rounds"] if r["committed"]] for p in honest]
    seq_len = summary["config"]["data"]["seq_len"] if run["summary"] else 1
    rounds = min((len(c) for c in committed), default=0)
    # the honest peers' own samples (inner steps x batch) per committed round, summed over the honest peers
    samples = [sum(sum(round(r["tokens_per_s"] * r["compute_s"] / seq_len) for r in c) / len(c)
                   for c in committed if c)] if rounds else []
    losses = [p["eval_loss"][-1] for p in honest if p["eval_loss"] and p["eval_loss"][-1] is not None]
    caught = sorted({f"{e['event']}: {e.get('what', '')}" for e in summary["events"]
                     if e.get("peer_id") in attacker_ids and e["event"] in ("offense", "banned", "ignored_claim")})
    return {"rc": run["rc"], "wall_s": run["wall_s"], "honest": len(honest),
            "rounds": rounds,
            "one_hash": len({p["final_global_sha256"] for p in honest}) == 1 and bool(honest),
            "samples_per_round": statistics.mean(samples) if samples else 0.0,
            "eval_loss": statistics.mean(losses) if losses else None, "caught": caught}


def run(quick: bool = False, rerun: bool = True) -> dict:
    """Each attack's local swarm (or, with `rerun=False`, the table from the runs already on disk)."""
    out_root = REPO / "runs" / ("bench-quick" if quick else "bench") / "hostile"
    out_root.mkdir(parents=True, exist_ok=True)
    attacks = ["forge-progress", "huge"] if quick else list(ATTACKS)

    def swarm(name: str, hostile: Optional[str]) -> dict:
        if rerun:
            return local_swarm(out_root / name, hostile)
        path = out_root / name / "summary.json"
        return {"rc": 0, "wall_s": 0.0, "summary": json.loads(path.read_text()) if path.exists() else None}
    base = outcome(swarm("none", None))
    rows, results = [], {"none": base}
    rows.append(["none", f"{base['rounds']}/4", base["one_hash"], f"{base['samples_per_round']:.0f} (100%)",
                 f"{base['eval_loss']:.4f}" if base["eval_loss"] else "-", "-", "-"])
    for attack in attacks:
        got = outcome(swarm(attack, attack))
        results[attack] = got
        share = got["samples_per_round"] / base["samples_per_round"] if base["samples_per_round"] else 0.0
        loss = got["eval_loss"]
        delta = f"{100 * (loss / base['eval_loss'] - 1):+.1f}%" if loss and base["eval_loss"] else "-"
        rows.append([attack, f"{got['rounds']}/4", got["one_hash"], f"{got['samples_per_round']:.0f} ({share:.0%})",
                     f"{loss:.4f}" if loss else "-", delta, "; ".join(got["caught"])[:160] or ATTACKS[attack]])
    table = md_table(["attack (peer 3 of 4)", "honest rounds committed", "one hash", "samples / round",
                      "eval loss", "vs unattacked", "what caught it (honest peers' events)"], rows)
    note = (f"\n\n`swarm local --config configs/tiny.yaml --peers {PEERS} {' '.join(RUN)} --hostile KIND@{ATTACKER}`; "
            f"samples / round: the honest peers' own samples (inner steps x batch) that entered committed rounds, "
            f"per round (the attacker's never count); eval loss: mean of the honest peers' last eval.")
    return {"stamp": stamp(), "quick": quick, "results": results, "table": table + note}


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv)["table"])
