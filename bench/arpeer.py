"""One all-reduce peer in its own process, driven by bench/allreduce.py: `python -m bench.arpeer '<json job>'`.

mode "swarm": a SwarmAverager (swarm/net) averages a random vector of each size in turn (one round per size);
mode "hivemind": a raw hivemind.DecentralizedAverager per size (timeouts set, as notes/hivemind.md advises).
Before each size the peer touches `<dir>/<name>.<k>.ready` and waits for `<dir>/go.<k>`, so the launcher starts
every peer of a size together. Times (s) go to `<dir>/<name>.json`: the whole call (matchmaking included) and
the all-reduce alone.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch


def barrier(job: dict, k: int | str) -> None:
    d = Path(job["dir"])
    (d / f"{job['name']}.{k}.ready").touch()
    deadline = time.time() + 600
    while not (d / f"go.{k}").exists():
        if time.time() > deadline:
            raise TimeoutError("no go from the launcher")
        time.sleep(0.02)


def vector(job: dict, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(job["seed"]))


def run_swarm(job: dict) -> list[dict]:
    from swarm.config import SwarmConfig
    from swarm.net.dht import start_dht
    from swarm.net.identity import load_identity
    from swarm.net.peer import SwarmAverager
    from swarm.train.diloco import PseudoGradient

    n = job["peers"]
    cfg = SwarmConfig(initial_peers=job["initial_peers"], run_id=job["run_id"], compression=job["compression"],
                      target_group_size=n, min_group_size=n, matchmaking_time=30.0, request_timeout=3.0,
                      stall_timeout=job["timeout"], bootstrap_timeout=60.0, data_plane=job.get("data_plane", True),
                      host_maddrs=[f"/ip4/{job.get('host', '127.0.0.1')}/tcp/0"])
    fingerprint = f"bench-{job['compression']}"
    identity = load_identity(None)
    dht = start_dht(cfg, identity, fingerprint=fingerprint)
    averager = SwarmAverager(cfg, dht, identity, fingerprint, job["name"])
    timings, run = [], averager.allreduce.run

    async def timed(*args):
        start = time.perf_counter()
        try:
            return await run(*args)
        finally:
            timings.append(time.perf_counter() - start)

    averager.allreduce.run = timed
    out = []
    try:
        for k, numel in enumerate(job["sizes"]):
            grad = PseudoGradient([vector(job, numel)], [torch.zeros(numel)])
            into = torch.empty(numel).fill_(0.0)  # touched: a peer's outer gradient buffers persist across rounds
            barrier(job, k)
            start = time.perf_counter()
            outcome = averager.average(k, grad, 1, [into])
            wall = time.perf_counter() - start
            out.append({"numel": numel, "call_s": wall, "allreduce_s": timings[-1] if timings else None,
                        "ok": outcome.averaged is not None and outcome.group_size == n,
                        "group_size": outcome.group_size, "bytes_sent": outcome.bytes_sent, "note": outcome.note})
            timings.clear()
            del grad, outcome
        barrier(job, len(job["sizes"]))  # stay until every peer is done: groupmates may still fetch our part
    finally:
        averager.close()
        dht.shutdown()
    return out


def run_hivemind(job: dict) -> list[dict]:
    import hivemind
    from hivemind.averaging import DecentralizedAverager
    from hivemind.compression import BlockwiseQuantization, Float16Compression, NoCompression

    compression = {"none": NoCompression(), "fp16": Float16Compression(), "int8": BlockwiseQuantization()}
    if job["compression"] == "int8":  # import bitsandbytes before the averager forks, or every step pays ~3-5 s
        import bitsandbytes  # noqa: F401
    times_file = Path(job["dir"]) / f"{job['name']}.inplace"
    inner = DecentralizedAverager._run_allreduce_inplace_

    async def timed(self, *args, **kwargs):  # runs in the averager's forked process: report through a file
        start = time.perf_counter()
        try:
            return await inner(self, *args, **kwargs)
        finally:
            with open(times_file, "a") as f:
                f.write(f"{time.perf_counter() - start}\n")

    DecentralizedAverager._run_allreduce_inplace_ = timed
    dht = hivemind.DHT(initial_peers=job["initial_peers"], host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    out = []
    try:
        for k, numel in enumerate(job["sizes"]):
            times_file.unlink(missing_ok=True)
            averager = DecentralizedAverager(
                [vector(job, numel)], dht, prefix=f"{job['run_id']}-{k}", target_group_size=job["peers"],
                min_group_size=job["peers"], min_matchmaking_time=5.0, request_timeout=3.0,
                allreduce_timeout=job["timeout"], next_chunk_timeout=30.0,
                compression=compression[job["compression"]], start=True)
            try:
                barrier(job, k)
                start = time.perf_counter()
                result = averager.step(timeout=job["timeout"] + 15)
                wall = time.perf_counter() - start
                inplace = [float(x) for x in times_file.read_text().split()] if times_file.exists() else []
                out.append({"numel": numel, "call_s": wall, "allreduce_s": inplace[-1] if inplace else None,
                            "ok": result is not None and len(result) == job["peers"]})
                barrier(job, f"{k}.done")  # as above: nobody leaves while others may still need it
            finally:
                averager.shutdown()
        barrier(job, len(job["sizes"]))
    finally:
        dht.shutdown()
    return out


def main(job: dict) -> None:
    torch.set_num_threads(1)
    try:
        results = run_swarm(job) if job["mode"] == "swarm" else run_hivemind(job)
        payload = {"results": results}
    except Exception as e:
        payload = {"error": repr(e)}
    path = Path(job["dir"]) / f"{job['name']}.json"
    path.write_text(json.dumps(payload))
    sys.stdout.flush()
    os._exit(0)  # do not wait on hivemind's background threads


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
