"""All-reduce time: the swarm's butterfly all-reduce (swarm/net, via SwarmAverager) next to a raw hivemind
DecentralizedAverager on the same random vectors, between peer processes on loopback.

Each peer is a process (bench/arpeer.py) that averages one vector per size; the launcher releases all peers of
a size together. Reported per (size, peers, compression): the slowest peer's all-reduce time alone and its whole
call (matchmaking included). hivemind has no 4-bit codec; its 8-bit here is BlockwiseQuantization
(bitsandbytes), against our int8.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import hivemind

from bench.common import md_table, spawn, stamp, stop
from swarm.config import SwarmConfig
from swarm.net.dht import start_dht, visible_maddrs

M = 1_000_000
FULL = dict(sizes=[M, 10 * M, 50 * M], max_size_8=10 * M,
            launches=[("swarm", "none", 2), ("swarm", "none", 4), ("swarm", "none", 8), ("swarm", "fp16", 4),
                      ("swarm", "int8", 4), ("swarm", "int4", 4), ("hivemind", "none", 2), ("hivemind", "none", 4),
                      ("hivemind", "none", 8), ("hivemind", "fp16", 4), ("hivemind", "int8", 4)])
QUICK = dict(sizes=[M], max_size_8=M, launches=[("swarm", "none", 2), ("swarm", "none", 4), ("swarm", "int8", 2),
                                                 ("hivemind", "none", 2), ("hivemind", "none", 4)])
SKIPPED = ("50M x 8 peers: 8 processes each holding several copies of a 200 MB vector (plus hivemind's shared-"
           "memory copy) do not fit 2 shared cores and 24 GiB alongside the others' work; compression sweeps at 4 "
           "peers only, to fit the suite's 30 minutes")


def launch(mode: str, comp: str, n: int, sizes: list[int], maddrs: list[str], tmp: Path, timeout: float,
           extra: dict | None = None, host=lambda i: "127.0.0.1", prefix=lambda i: [], tag: str = "") -> list:
    """Run `n` peer processes (bench/arpeer.py) through `sizes`; `extra`: more job fields (swarm's `data_plane`);
    peer i listens on `host(i + 1)` and runs under `prefix(i + 1)` (a network namespace, bench/linkspeed.py)."""
    d = tmp / f"{mode}-{comp}-{n}{'-' + tag if tag else ''}"
    d.mkdir()
    procs = []
    for i in range(n):
        job = dict(mode=mode, compression=comp, peers=n, sizes=sizes, initial_peers=maddrs, name=f"p{i}", seed=i,
                   dir=str(d), run_id=f"bench-ar-{mode}-{comp}-{n}-{int(time.time())}", timeout=timeout,
                   host=host(i + 1), **(extra or {}))
        procs.append(spawn(["-m", "bench.arpeer", json.dumps(job)], d / f"p{i}.log", prefix(i + 1) or None))
    steps = [str(k) for k in range(len(sizes))] + [str(len(sizes))]  # the sizes, then "all done"
    if mode == "hivemind":  # one averager per size: nobody shuts theirs down before everybody finished
        steps = [s for k in range(len(sizes)) for s in (str(k), f"{k}.done")] + [str(len(sizes))]
    try:
        for k in steps:
            deadline = time.time() + 300
            while not all((d / f"p{i}.{k}.ready").exists() for i in range(n)):
                if any(p.poll() is not None for p in procs) or time.time() > deadline:
                    raise RuntimeError(f"{mode} {comp} x{n}: a peer exited or stalled at step {k} of {steps}")
                time.sleep(0.05)
            (d / f"go.{k}").touch()
        for p in procs:
            p.wait(timeout=timeout * 2 + 60)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return [{"error": str(e), "log": (d / "p0.log").read_text()[-1500:]}]
    finally:
        stop(procs, grace=5)
    out = []
    for i in range(n):
        path = d / f"p{i}.json"
        out.append(json.loads(path.read_text()) if path.exists() else {"error": "no result",
                                                                        "log": (d / f"p{i}.log").read_text()[-1500:]})
    return out


def summarize(peers: list[dict], sizes: list[int]) -> dict[int, dict]:
    """Per size: slowest peer's all-reduce and call seconds, and whether every peer got the full group's mean."""
    if any("error" in p for p in peers):
        return {s: {"error": next(p["error"] for p in peers if "error" in p)} for s in sizes}
    out = {}
    for k, size in enumerate(sizes):
        rs = [p["results"][k] for p in peers if k < len(p["results"])]
        ar = [r["allreduce_s"] for r in rs if r.get("allreduce_s") is not None]
        out[size] = {"allreduce_s": max(ar) if ar else None, "call_s": max(r["call_s"] for r in rs),
                     "ok": len(rs) == len(peers) and all(r["ok"] for r in rs),
                     "bytes_sent": statistics.mean(r.get("bytes_sent", 0) for r in rs)}
    return out


def make_table(results: dict[tuple, dict], quick: bool) -> str:
    """One row per (params, peers, compression): swarm and hivemind side by side."""
    def cell(r: dict | None, key: str) -> str:
        if r is None:
            return "–"
        if "error" in r:
            return "failed"
        return f"{r[key]:.2f}" + ("" if r["ok"] else " (incomplete)") if r[key] is not None else "–"

    rows = []
    for size, n, comp in sorted({k[:3] for k in results}, key=lambda k: (k[0], k[1], k[2])):
        ours, theirs = results.get((size, n, comp, "swarm")), results.get((size, n, comp, "hivemind"))
        ratio = (f"{theirs['allreduce_s'] / ours['allreduce_s']:.2f}" if ours and theirs and "error" not in ours
                 and "error" not in theirs and ours["allreduce_s"] and theirs["allreduce_s"] else "–")
        rows.append([f"{size / M:g}M", n, comp, cell(ours, "allreduce_s"), cell(ours, "call_s"),
                     cell(theirs, "allreduce_s"), cell(theirs, "call_s"), ratio])
    table = md_table(["params", "peers", "compression", "swarm all-reduce s", "swarm call s (with matchmaking)",
                      "hivemind all-reduce s", "hivemind step s (with matchmaking)", "hivemind / swarm"], rows)
    table += (f"\n\nSlowest peer, one try each, loopback, every peer its own process on 2 shared cores (1 torch "
              f"thread). hivemind int8 = BlockwiseQuantization (bitsandbytes 8-bit). Skipped: "
              f"{SKIPPED if not quick else 'quick mode: 1M only, 2 and 4 peers'}.")
    return table


def run(quick: bool) -> dict:
    spec = QUICK if quick else FULL
    timeout = 120.0
    raw, results = {}, {}
    swarm_boot = start_dht(SwarmConfig())
    plain_boot = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        boots = {"swarm": visible_maddrs(swarm_boot), "hivemind": [str(a) for a in plain_boot.get_visible_maddrs()]}
        with tempfile.TemporaryDirectory(prefix="bench-ar-") as tmp:
            for mode, comp, n in spec["launches"]:
                sizes = [s for s in spec["sizes"] if n < 8 or s <= spec["max_size_8"]]
                start = time.time()
                peers = launch(mode, comp, n, sizes, boots[mode], Path(tmp), timeout)
                raw[f"{mode} {comp} x{n}"] = peers
                for size, r in summarize(peers, sizes).items():
                    results[(size, n, comp, mode)] = r
                print(f"  allreduce: {mode} {comp} x{n}: {time.time() - start:.0f}s "
                      f"{[(s, results[(s, n, comp, mode)].get('allreduce_s')) for s in sizes]}", flush=True)
    finally:
        swarm_boot.shutdown()
        plain_boot.shutdown()

    table = make_table(results, quick)
    return {"table": table, "config": {**spec, "timeout": timeout}, "skipped": SKIPPED,
            "results": [{"params": k[0], "peers": k[1], "compression": k[2], "impl": k[3], **v}
                        for k, v in results.items()], "raw": raw, "timestamp": stamp()}
