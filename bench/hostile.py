"""Hostile peers: a real local swarm with one attacker (`swarm local --hostile KIND@PEER`), once per attack,
beside the same swarm unattacked, all with the default settings (the defaults bound influence). For each: did
the honest peers commit every round on one hash, how many samples they averaged per round (share of the
unattacked run's), their final eval loss (vs the unattacked run's), and what caught the attacker (the honest
peers' summary events that name it; for an attack on newcomers, whether the newcomer joined).

Every attack in `swarm.config.ATTACKS` is a row (another helper's attacks become rows once they are
there), plus the VARIANTS (an attack under other settings). `--quick` runs QUICK only.

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

from bench.common import REPO, md_table, spawn, stamp, stop
from swarm.config import ATTACKS, SwarmConfig

PEERS, ATTACKER = 4, 3
RUN = ["--rounds", "4", "--diloco.inner_steps", "30", "--diloco.delay", "0",  # blocking, as in the committed table
       "--inner.warmup_steps", "10", "--data.eval_batches", "4",
       "--swarm.matchmaking_time", "3", "--swarm.request_timeout", "1", "--swarm.stall_timeout", "10"]
# a newcomer at round 2 that downloads the state, from the donors in random order: the attacker is its first in a
# third of the runs (three newcomers at once churned a swarm this small out of a round)
EXTRA = {"poison-state": ["--join", "2"], "poison-momentum": ["--join", "2"]}
# a newcomer started only once the attacker's log has this line (`swarm local --join` starts joiners at once, held:
# they would check the fingerprint before the sybil voted)
LATE = {"sybil": "sybil: "}
# row: (attack, extra args); with identity_work the sybil mints for its whole budget (hostile.SYBIL_BUDGET_S) and
# the late newcomer finds its key's work: 12 rounds keep the swarm there for it
VARIANTS = {"sybil, identity_work 20": ("sybil", ["--swarm.identity_work", "20", "--rounds", "12"])}
QUICK = ["huge", "trickle", "sybil"]
JOINER = f"peer-{PEERS}"  # the first newcomer's name (swarm local numbers joiners after the peers)
FIRST = {f"peer-{i}" for i in range(PEERS)}  # the peers there from the start


def run_args(extra: tuple = ()) -> list[str]:
    """RUN, then `extra` (whose `--rounds`, if any, replaces RUN's)."""
    return [*(RUN[2:] if "--rounds" in extra else RUN), *extra]


def local_swarm(out: Path, hostile: Optional[str], timeout: float = 900, extra: tuple = ()) -> dict:
    argv = [sys.executable, "-m", "swarm.cli", "local", "--config", "configs/tiny.yaml", "--peers", str(PEERS),
            "--out", str(out), "--no-monitor", *run_args(extra), *EXTRA.get(hostile, []),
            *(["--hostile", f"{hostile}@{ATTACKER}"] if hostile else [])]
    shutil.rmtree(out, ignore_errors=True)  # a run left there would resume from its checkpoints
    start, late = time.time(), None
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None and time.time() - start < timeout:
                if late is None and hostile in LATE and _last_line(out / f"peer-{ATTACKER}" / "log.txt", LATE[hostile]):
                    late = newcomer(out, extra)
                time.sleep(1.0)
        finally:
            if proc.poll() is None:  # past the timeout: the launcher stops its children on SIGTERM
                proc.terminate()
            proc.wait()
            if late is not None:
                stop([late], grace=60.0)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else None
    late_log = out / "newcomer" / "log.txt"
    joined = None if late is None else ("joined" if _last_line(late_log, "joined run") else
                                        f"exit {late.returncode}: {_last_line(late_log)[-160:]}")
    return {"rc": proc.returncode, "wall_s": time.time() - start, "summary": summary, **logged(out),
            **({"late_newcomer": joined} if late is not None else {})}


def newcomer(out: Path, extra: tuple) -> subprocess.Popen:
    """A peer that starts now against the local swarm's bootstrap (from the launcher's log), as a newcomer would."""
    maddr = _last_line(out.with_suffix(".log"), "bootstrap at ").removeprefix("bootstrap at ")
    return spawn(["-m", "swarm.cli", "peer", "--config", "configs/tiny.yaml", "--initial-peers", maddr, "--name",
                  "newcomer", "--out", str(out / "newcomer"),
                  *[("--diloco.rounds" if arg == "--rounds" else arg) for arg in run_args(extra)],
                  "--swarm.target_group_size", str(PEERS + 1),
                  "--diloco.threads", "1", "--logging.progress_bar", "false"], out / "newcomer" / "log.txt")


def _last_line(path: Path, pattern: str = "") -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if pattern in line] if path.exists() else []
    return lines[-1].strip() if lines else ""


def logged(out: Path) -> dict:
    """What the logs say beside the summary: how a newcomer ended (a refused one writes no peer.json) and what
    the attacker reported of its own work (the sybil's cost per identity)."""
    joiner = out / JOINER
    minted = _last_line(out / f"peer-{ATTACKER}" / "log.txt", "identities minted: ").partition("minted: ")[2]
    return {"joiner": None if not joiner.exists() else
            "joined" if (joiner / "peer.json").exists() else _last_line(joiner / "log.txt")[-160:],
            "attacker_says": _last_line(out / f"peer-{ATTACKER}" / "log.txt", "sybil: ")[-200:],
            "minted": [p for p in minted.split(", ") if p]}


def outcome(run: dict) -> dict:
    """What the honest peers got: rounds committed, one hash, samples per committed round, final eval loss, and
    the events in which they refused someone."""
    summary = run["summary"] or {"peers": [], "events": []}
    # the same peers in every run: all but peer ATTACKER (honest in the unattacked run), plus any joiner
    honest = [p for p in summary["peers"] if "hostile" not in p and p.get("name") != f"peer-{ATTACKER}"]
    # the attacker's peer id, and the identities it minted (sybil-quorum says which in its log)
    attacker_ids = {p["peer_id"] for p in summary["peers"] if "hostile" in p} | set(run.get("minted", []))
    committed = [[r for r in p["rounds"] if r["committed"]] for p in honest]
    seq_len = summary["config"]["data"]["seq_len"] if run["summary"] else 1
    # rounds committed by the peers there from the start (a joiner cannot commit the rounds before it came)
    rounds = min((len(c) for p, c in zip(honest, committed) if p.get("name") in FIRST), default=0)
    # the honest peers' own samples (inner steps x batch) per committed round, summed over the honest peers
    samples = [sum(sum(round(r["tokens_per_s"] * r["compute_s"] / seq_len) for r in c) / len(c)
                   for c in committed if c)] if rounds else []
    losses = [p["eval_loss"][-1] for p in honest if p["eval_loss"] and p["eval_loss"][-1] is not None]
    # honest peers that an honest peer banned (the attacker's own bans are its business)
    honest_ids, honest_names = {p["peer_id"] for p in honest}, {p["name"] for p in honest}
    honest_banned = sorted({e["peer_id"] for e in summary["events"] if e["event"] == "banned"
                            and e.get("peer_id") in honest_ids and e.get("peer") in honest_names})
    naming = ("offense", "banned", "left out", "ignored_claim", "uncertified_claim", "outsized_weight", "streams",
              "unproven")
    caught = sorted({f"{e['event']}: {e.get('what', '')}" for e in summary["events"] if e.get("peer_id") in attacker_ids
                     and e["event"] in naming})
    if run.get("joiner") is not None:
        caught.append(f"newcomer {JOINER}: {run['joiner']}")
    if run.get("late_newcomer") is not None:
        caught.append(f"a newcomer after the attack: {run['late_newcomer']}")
    if run.get("attacker_says"):
        caught.append(run["attacker_says"].partition("sybil: ")[2] or run["attacker_says"])
    return {"rc": run["rc"], "wall_s": run["wall_s"], "honest": len(honest), "joiner": run.get("joiner"),
            "late_newcomer": run.get("late_newcomer"),
            "rounds": rounds, "of": summary["config"]["diloco"]["rounds"] if run["summary"] else 0,
            "one_hash": len({p["final_global_sha256"] for p in honest}) == 1 and bool(honest),
            "samples_per_round": statistics.mean(samples) if samples else 0.0,
            "eval_loss": statistics.mean(losses) if losses else None, "caught": caught,
            "honest_banned": honest_banned}


def run(quick: bool = False, rerun: bool = True) -> dict:
    """Each attack's local swarm (or, with `rerun=False`, the table from the runs already on disk)."""
    out_root = REPO / "runs" / ("bench-quick" if quick else "bench") / "hostile"
    out_root.mkdir(parents=True, exist_ok=True)
    rows_to_run = {a: (a, []) for a in (QUICK if quick else ATTACKS)} | ({} if quick else VARIANTS)

    def swarm(name: str, hostile: Optional[str], extra: list[str] = ()) -> dict:
        out = out_root / name.replace(", ", "_").replace(" ", "_")
        if rerun:
            return local_swarm(out, hostile, extra=tuple(extra))
        path = out / "summary.json"
        return {"rc": 0, "wall_s": 0.0, "summary": json.loads(path.read_text()) if path.exists() else None,
                **logged(out)}
    base = outcome(swarm("none", None))
    rows, results = [], {"none": base}
    rows.append(["none", f"{base['rounds']}/{base['of']}", base["one_hash"], f"{base['samples_per_round']:.0f} (100%)",
                 f"{base['eval_loss']:.4f}" if base["eval_loss"] else "-", "-", len(base["honest_banned"]), "-"])
    for attack, (kind, extra) in rows_to_run.items():
        got = outcome(swarm(attack, kind, extra))
        results[attack] = got
        share = got["samples_per_round"] / base["samples_per_round"] if base["samples_per_round"] else 0.0
        loss = got["eval_loss"]
        comparable = loss and base["eval_loss"] and got["of"] == base["of"]  # another run length: another loss
        delta = f"{100 * (loss / base['eval_loss'] - 1):+.1f}%" if comparable else "-"
        rows.append([attack, f"{got['rounds']}/{got['of']}", got["one_hash"],
                     f"{got['samples_per_round']:.0f} ({share:.0%})", f"{loss:.4f}" if loss else "-", delta,
                     len(got["honest_banned"]),
                     "; ".join(got["caught"])[:240] or "no event names it"])
    table = md_table(["attack (peer 3 of 4)", "honest rounds committed", "one hash", "samples / round",
                      "eval loss", "vs unattacked", "honest peers banned", "what caught it (honest peers' events)"],
                     rows)
    extras = "; ".join([*(f"{kind}: {' '.join(args)}" for kind, args in EXTRA.items()),
                        *(f"{row}: {' '.join(args)}" for row, (_, args) in VARIANTS.items())])
    d = SwarmConfig()  # the shipped defaults the table is measured with
    note = (f"\n\n`swarm local --config configs/tiny.yaml --peers {PEERS} {' '.join(RUN)} --hostile KIND@{ATTACKER}`; "
            f"(defaults otherwise: swarm.max_weight_share {d.max_weight_share:g}, "
            f"clip_norm_ratio {d.clip_norm_ratio:g}, aggregation {d.aggregation}, "
            f"verify_parts {str(d.verify_parts).lower()}, identity_work {d.identity_work}); {extras}; "
            f"samples / round: the honest peers' own samples (inner steps x batch) that entered committed rounds, "
            f"per round (the attacker's never count); eval loss: mean of the honest peers' last eval.")
    return {"stamp": stamp(), "quick": quick, "results": results, "table": table + note}


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv)["table"])
