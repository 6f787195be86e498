"""Churn soak: a local swarm that loses and gains peers all along, and whether every finisher ends on one hash.

A bootstrap and PEERS `swarm peer` processes (configs/tiny.yaml, ROUNDS rounds of H inner steps) on loopback;
every EVERY_S seconds one event, alternately: a random live peer is killed -9 (its whole process group: DHT
and p2pd too) and restarted on its own folder and key (it resumes from its checkpoint), or a newcomer starts.
EVENTS events, so PEERS + EVENTS peer processes over the run (14 in the full run). Per finisher (a process
that exited on its own): its exit code, final hash, rounds committed, states downloaded (each a switch of
lineage: it threw its own parameters away for a donor's), and the rounds whose committed hash was not the
majority's of that round among all peers (a minority lineage). A finisher that failed: its last log line.

Target (issue 21, item 9): every finisher exits 0 on one hash.
"""

from __future__ import annotations

import collections
import json
import random
import shutil
import signal
import sys
import time
from pathlib import Path

from bench.common import REPO, md_table, spawn, stamp, stop, wait_for_line

FULL = dict(peers=5, rounds=30, inner_steps=20, every_s=20.0, events=9)
QUICK = dict(peers=3, rounds=6, inner_steps=10, every_s=10.0, events=3)
SEED = 0


def peer_argv(name: str, out: Path, maddr: str, rounds: int, inner_steps: int, group: int) -> list[str]:
    folder = out / name
    return ["-m", "swarm.cli", "peer", "--config", "configs/tiny.yaml", "--initial-peers", maddr, "--name", name,
            "--out", str(folder), "--swarm.identity", str(folder / "identity.key"), "--diloco.rounds", str(rounds),
            "--diloco.inner_steps", str(inner_steps), "--diloco.eval_every", str(max(1, rounds // 3)),
            "--data.eval_batches", "4", "--swarm.target_group_size", str(group), "--diloco.threads", "1",
            "--logging.progress_bar", "false", "--swarm.host_maddrs", "/ip4/127.0.0.1/tcp/0"]


def soak(out: Path, peers: int, rounds: int, inner_steps: int, every_s: float, events: int,
         timeout: float = 1800) -> dict:
    """Run the soak into `out`; returns the events and every peer process's outcome."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    rng, start = random.Random(SEED), time.time()
    boot = spawn(["-m", "swarm.cli", "bootstrap", "--swarm.host_maddrs", "/ip4/127.0.0.1/tcp/0"], out / "bootstrap.log")
    procs, log = [boot], []
    try:
        maddr = wait_for_line(out / "bootstrap.log", r"/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+", boot)
        group = peers + events
        live: dict[str, object] = {}  # name -> its current process
        runs: list[tuple[str, object]] = []  # every process started: (name, proc)

        def start_peer(name: str) -> None:
            proc = spawn(peer_argv(name, out, maddr, rounds, inner_steps, group), out / name / f"log-{len(runs)}.txt")
            procs.append(proc)
            runs.append((name, proc))
            live[name] = proc
        for i in range(peers):
            start_peer(f"peer-{i}")
        next_event, done_events, newcomers = start + every_s, 0, peers
        while any(p.poll() is None for p in live.values()) and time.time() - start < timeout:
            if done_events < events and time.time() >= next_event:
                running = sorted(n for n, p in live.items() if p.poll() is None)
                if done_events % 2 == 0 and running:
                    victim = rng.choice(running)
                    stop_group(live[victim])
                    log.append({"t": round(time.time() - start, 1), "event": "kill -9 + restart", "peer": victim})
                    start_peer(victim)
                else:
                    name = f"peer-{newcomers}"
                    newcomers += 1
                    log.append({"t": round(time.time() - start, 1), "event": "newcomer", "peer": name})
                    start_peer(name)
                done_events += 1
                next_event += every_s
            time.sleep(0.5)
        wall = time.time() - start
    finally:
        stop(procs)
    return {"events": log, "wall_s": wall, "runs": [outcome(out, name, proc, i) for i, (name, proc) in enumerate(runs)]}


def stop_group(proc) -> None:
    """kill -9 a peer's whole process group (its DHT child and p2pd die with it) and reap it."""
    import os

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def outcome(out: Path, name: str, proc, index: int) -> dict:
    """One process's end: killed (by us), or finished with its exit code and its peer.json (if it is the folder's
    latest process: a restarted peer rewrites the folder's peer.json)."""
    killed = proc.returncode == -signal.SIGKILL
    log_path = out / name / f"log-{index}.txt"
    lines = log_path.read_text(errors="replace").splitlines() if log_path.exists() else []
    summary_path = out / name / "peer.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() and not killed else None
    return {"name": name, "index": index, "killed": killed, "rc": proc.returncode, "summary": summary,
            "last_line": lines[-1][-200:] if lines else ""}


def lineages(runs: list[dict]) -> dict[int, str]:
    """The majority committed hash of every round, over every process that left a summary."""
    votes: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for run in runs:
        for r in (run["summary"] or {}).get("rounds", []):
            if r["committed"]:
                votes[r["round"]][r["global_sha256"]] += 1
    return {k: max(c, key=lambda h: (c[h], h)) for k, c in votes.items()}


def report(result: dict) -> dict:
    runs = result["runs"]
    majority = lineages(runs)
    finishers = [r for r in runs if not r["killed"]]
    rows = []
    for run in finishers:
        s = run["summary"] or {}
        committed = [r for r in s.get("rounds", []) if r["committed"]]
        minority = sorted(r["round"] for r in committed if majority.get(r["round"]) != r["global_sha256"])
        downloads = [e for e in s.get("events", []) if e.get("event") == "state_downloaded"]
        rows.append({"name": f"{run['name']} (#{run['index']})", "rc": run["rc"],
                     "final_sha256": (s.get("final_global_sha256") or "-")[:12],
                     "final_round": s.get("rounds_completed"), "committed": len(committed),
                     "downloads": [f"{e['from_round']}->{e['to_round']}" for e in downloads],
                     "minority_rounds": minority, "last_line": "" if run["rc"] == 0 else run["last_line"]})
    hashes = {r["final_sha256"] for r in rows}
    return {"finishers": rows, "one_hash": len(hashes) == 1, "all_exit_0": all(r["rc"] == 0 for r in rows),
            "processes": len(runs), "killed": sum(r["killed"] for r in runs)}


def run(quick: bool = False) -> dict:
    settings = QUICK if quick else FULL
    out = REPO / "runs" / ("bench-quick" if quick else "bench") / "churn"
    result = soak(out, **settings)
    got = report(result)
    table = md_table(["finisher (#process)", "exit", "final hash", "final round", "rounds committed",
                      "states downloaded (from->to round)", "rounds on a minority lineage", "last line (if failed)"],
                     [[r["name"], r["rc"], r["final_sha256"], r["final_round"], r["committed"],
                       ", ".join(r["downloads"]) or "-", ", ".join(map(str, r["minority_rounds"])) or "-",
                       r["last_line"][:120] or "-"] for r in got["finishers"]])
    events = "; ".join(f"{e['t']:.0f} s {e['event']} {e['peer']}" for e in result["events"])
    note = (f"\n\n{settings['peers']} peers, {settings['rounds']} rounds of H={settings['inner_steps']} "
            f"(configs/tiny.yaml), an event every {settings['every_s']:g} s: {events}. {got['processes']} peer "
            f"processes, {got['killed']} killed; every finisher on one hash: {got['one_hash']}, every finisher "
            f"exited 0: {got['all_exit_0']}; wall {result['wall_s']:.0f} s.")
    return {"stamp": stamp(), "quick": quick, **got, "events": result["events"], "table": table + note}


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv)["table"])
