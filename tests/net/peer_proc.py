"""One swarm peer in its own process, driven by tests/net: `python peer_proc.py '<json job>'`.

The job names the config overrides, the vector (seeded), the round and a mode:
- "honest": average the vector;
- "nan": a hostile peer that skips the local finiteness check and sends a NaN;
- "victim": pushes its chunks to one owner only, tells the test (marker file) and waits to be SIGKILLed;
- "slow_fetch": takes the averaged parts 2 s late, when fast groupmates may already be leaving;
- "huge": sends 1e6 times its vector; "heavy": claims a weight (samples) of 1e18 in matchmaking and HELLO;
- "wrong_owner": adds 1.0 to every average it returns as a part's owner (the `bad-part` attack of
  swarm/net/hostile.py).
The result goes to `out` (torch.save); `ready` marks that the peer is up, and it starts averaging when
the file `go` appears, so all peers of a test enter matchmaking together.
"""

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import torch

from swarm.config import SwarmConfig
from swarm.net.dht import start_dht
from swarm.net.hostile import Attacker, Hooks
from swarm.net.identity import load_identity
from swarm.net.peer import SwarmAverager
from swarm.train.averaging import Snapshot
from swarm.train.diloco import PseudoGradient


def make_vector(seed: int, numel: int) -> list[torch.Tensor]:
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    return [flat[: numel // 3].clone(), flat[numel // 3:].reshape(-1, 1).clone()]  # two shapes: unflatten


def as_pseudo_gradient(tensors: list[torch.Tensor]) -> PseudoGradient:
    """A pseudo-gradient equal to `tensors` (global = them, local = zeros)."""
    return PseudoGradient(tensors, [torch.zeros_like(t) for t in tensors])


class SkipsOwnCheck(Hooks):
    """"nan": sends its contribution without checking that it is finite."""

    def __init__(self, job: dict):
        pass

    def checks_own(self) -> bool:
        return False


class PushesToOneOwner(Hooks):
    """"victim": the first owner gets our chunks, the others never do; marks that it got there, then hangs."""

    def __init__(self, job: dict):
        self.marker, self.pushed = job["marker"], []

    async def push(self, group, j, channel, push):
        if not self.pushed:
            self.pushed.append(j)
            return await push(None)
        Path(self.marker).touch()
        await asyncio.sleep(3600)


class TakesResultsLate(Hooks):
    """"slow_fetch": takes every part's averages 2 s late."""

    def __init__(self, job: dict):
        pass

    async def taking_results(self, group, j):
        await asyncio.sleep(2.0)


MODES = {"nan": SkipsOwnCheck, "victim": PushesToOneOwner, "slow_fetch": TakesResultsLate}


def main(job: dict) -> None:
    cfg = SwarmConfig(**job["cfg"])
    identity = load_identity(None)
    dht = start_dht(cfg, identity, fingerprint=job["fingerprint"])
    averager = SwarmAverager(cfg, dht, identity, job["fingerprint"], job["name"])
    try:
        if job["mode"] in MODES:
            averager.allreduce.hooks = MODES[job["mode"]](job)
        if job["mode"] == "wrong_owner":  # adds 1 to every average it returns for its part (hostile.py)
            averager.allreduce.hooks = Attacker(["bad-part"])
        if job["mode"] == "heavy":  # claims 1e18 samples in matchmaking and as its weight (hostile.py)
            averager.hooks = Attacker(["weight"])
        run = averager.allreduce.run
        timings = []

        async def timed_run(*args):
            start = time.perf_counter()
            try:
                return await run(*args)
            finally:
                timings.append(time.perf_counter() - start)
        averager.allreduce.run = timed_run

        grad = make_vector(job["seed"], job["numel"])
        if job["mode"] == "nan":
            grad[0][3] = float("nan")
        if job["mode"] == "huge":
            grad = [t * 1e6 for t in grad]
        # serve a state (never downloaded here) so that the policy counts this peer as a donor
        averager.offer_state(Snapshot(job["round"], job["base"], {}, {}, 0, lambda: 0), wait=True)
        averager.publish_progress(job["round"], 0, job["samples"], 1.0, sha256=job["base"], wait=True)
        Path(job["ready"]).touch()
        while not os.path.exists(job["go"]):
            time.sleep(0.05)
        start = time.monotonic()
        out = [torch.full_like(t, float("nan")) for t in grad]
        pseudo_grad = as_pseudo_gradient(grad)
        if job["mode"] == "nan":
            pseudo_grad.is_finite = lambda: True
        outcome = averager.average(job["round"], pseudo_grad, job["samples"], out, job["base"])
        torch.save({"outcome": outcome.__dict__, "peer_id": str(dht.peer_id), "wall_s": time.monotonic() - start,
                    "allreduce_s": timings}, job["out"])
    finally:
        averager.close()
        dht.shutdown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
