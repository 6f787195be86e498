"""Fixtures for network tests: a bootstrap DHT and a launcher for peer processes, all cleaned up."""

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from peers.forkserver import ForkServer
from swarm.config import SwarmConfig
from swarm.net.allreduce import AllReduceHooks
from swarm.net.dht import start_dht, visible_maddrs

REPO = Path(__file__).resolve().parents[2]
PEER_SCRIPT = Path(__file__).with_name("peer_proc.py")

FAST = dict(host_maddrs=["/ip4/127.0.0.1/tcp/0"], matchmaking_time=2.0, request_timeout=1.0, stall_timeout=5.0,
            bootstrap_timeout=10.0, progress_expiration=30.0, target_group_size=3,
            # the plain sample-weighted mean, which these tests check results against; a test of a bounded-influence
            # rule sets it (the defaults bound influence: tests/net/test_robust*.py, tests/test_config.py)
            max_weight_share=1.0, clip_norm_ratio=0.0, aggregation="mean",
            compression="none")  # exact fp32, which they check to 1e-6 (the default int8: everywhere else)


def fast_cfg(**overrides) -> SwarmConfig:
    return SwarmConfig(**{**FAST, **overrides})


@contextlib.contextmanager
def three_dhts():
    """Three connected DHTs in this process (their daemons on loopback), shut down on exit."""
    started = [start_dht(fast_cfg())]
    try:
        started += [start_dht(fast_cfg(initial_peers=visible_maddrs(started[0]))) for _ in range(2)]
        yield started
    finally:
        for dht in started:
            dht.shutdown()


@dataclass
class GroupResult:
    tensor: torch.Tensor  # the averaged flat vector this member ended with
    traffic: object  # wire.Traffic
    residual: object = None


class SkipsOwnCheck(AllReduceHooks):
    """A hostile member that sends its contribution without checking that it is finite: the owners must refuse it."""

    def checks_own(self) -> bool:
        return False


def run_group(dhts, vectors, weights, *, codec="none", stall=10.0, skip=(), group_id=b"g", chunk_elements=None,
              residual=False, shapes=None, abandon=(), rule=None, hooks=None, clients=(), encoded=()):
    """One in-process all-reduce among `dhts` of flat fp32 `vectors` (one tensor each, or cut into `shapes`);
    members in `skip` never start it, members in `abandon` tell the others they leave it; `rule`: a
    robust.Rule; `hooks`: {member: {attribute: value}} set on its AllReduce (fault injection, e.g. "hooks": a
    hostile.Hooks); `clients`: members that own no part
    (`swarm.client_mode`); `encoded`: members that keep the average in the wire's bytes (`EncodedAverage`),
    decoded after.
    Returns (members, GroupResult or exception per started member)."""
    import asyncio

    from swarm.net.allreduce.groupstate import Contribution
    from swarm.net.allreduce.layout import CHUNK_ELEMENTS, EncodedAverage, WireLayout
    from swarm.net.codec import get_codec
    from swarm.net.identity import owner_key

    shapes = shapes or [torch.Size([vectors[0].numel()])]

    def split(flat):
        return list(torch.split(flat, [math.prod(s) for s in shapes]))

    async def group(p2ps, services):
        keys = [owner_key(dht.identity.owner) for dht in dhts]  # as their signed metas carry them
        members = [p2p.peer_id for p2p in p2ps]
        layout = WireLayout(shapes, get_codec(codec), len(members), chunk_elements or CHUNK_ELEMENTS, clients)

        async def one(service, vector, weight, encoded):
            out = EncodedAverage(shapes) if encoded else [torch.full(s, float("nan")) for s in shapes]
            parts = [p.reshape(s) for p, s in zip(split(vector), shapes)]
            kept = [torch.zeros(s) for s in shapes] if residual else None
            read = lambda i, a, b: parts[i].reshape(-1)[a:b].clone()  # noqa: E731
            traffic = await service.run(group_id, members, layout, Contribution(read, weight, out, kept), weights,
                                        keys)
            flat = lambda ts: torch.cat([t.reshape(-1) for t in ts])  # noqa: E731
            if encoded:
                out = [t for _, t in sorted(out.each(), key=lambda pair: pair[0])]
            return GroupResult(flat(out), traffic, flat(kept) if kept is not None else None)

        for i in abandon:
            await services[i].abandon(group_id, members, "a phantom group")
        runs = [one(s, v, w, i in encoded) for i, (s, v, w) in enumerate(zip(services, vectors, weights))
                if i not in (*skip, *abandon)]
        results = await asyncio.gather(*runs, return_exceptions=True)
        for service in services:
            await service.drain()
        return members, results

    async def main():
        async with all_reduces(dhts, stall, rule, hooks) as (p2ps, services):
            return await group(p2ps, services)
    return asyncio.run(main())


@contextlib.asynccontextmanager
async def all_reduces(dhts, stall=10.0, rule=None, hooks=None, planes=None):
    """An `AllReduce` per DHT (on a replica of its P2P), started, with `hooks` ({member: {attribute: value}})
    set; yields (p2ps, services) and stops them all on exit. `planes`: each member's `DataPlane` (default: one
    on 127.0.0.1 each, as a peer's default; None in the list: libp2p only)."""
    import concurrent.futures

    from swarm.net.allreduce import AllReduce
    from swarm.net.dataplane import DataPlane

    p2ps = [await dht.replicate_p2p() for dht in dhts]
    pool = concurrent.futures.ThreadPoolExecutor(2)
    planes = planes if planes is not None else [DataPlane(["127.0.0.1"], 0, stall) for _ in dhts]
    services = [AllReduce(p2p, "unit", stall, 1e6, pool, rule, identity=dht.identity, data_plane=plane)
                for p2p, dht, plane in zip(p2ps, dhts, planes)]
    for i, hook in (hooks or {}).items():
        for name, fn in hook.items():
            setattr(services[i], name, fn)
    try:
        for service in services:
            await service.start()
        yield p2ps, services
    finally:
        for service in services:
            await service.stop()
        for p2p in p2ps:
            await p2p.shutdown()
        pool.shutdown()


@pytest.fixture
def bootstrap():
    dht = start_dht(fast_cfg())
    try:
        yield visible_maddrs(dht)
    finally:
        dht.shutdown()


@pytest.fixture
def stock_bootstrap():
    """A stock `hivemind-dht` process (the venv's console script) on loopback."""
    exe = Path(sys.executable).with_name("hivemind-dht")
    proc = subprocess.Popen([str(exe), "--host_maddrs", "/ip4/127.0.0.1/tcp/0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline, maddr = time.monotonic() + 30, None
        while maddr is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            found = re.search(r"/ip4/127\.0\.0\.1/tcp/\d+/p2p/\w+", line)
            maddr = found.group(0) if found else None
        assert maddr, "hivemind-dht printed no multiaddr"
        yield [maddr]
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


class Peers:
    """Launch peer_proc.py children; `go()` releases them together; every child is reaped at the end."""

    def __init__(self, tmp: Path, server: ForkServer):
        self.tmp, self.server, self.procs, self.jobs = tmp, server, [], []

    def start(self, name: str, initial_peers: list[str], *, seed: int, samples: int, numel: int,
              mode: str = "honest", round: int = 0, fingerprint: str = "fp-test", base: str = "", **cfg) -> dict:
        job = dict(name=name, mode=mode, seed=seed, samples=samples, numel=numel, round=round, base=base,
                   fingerprint=fingerprint, cfg={**FAST, "initial_peers": initial_peers, **cfg},
                   ready=str(self.tmp / f"{name}.ready"), go=str(self.tmp / "go"),
                   out=str(self.tmp / f"{name}.pt"), marker=str(self.tmp / f"{name}.marker"))
        # forked in a session of its own: cleanup also reaches the peer's DHT, averager and p2pd children
        self.procs.append(self.server.spawn([json.dumps(job)], self.tmp / f"{name}.log", script=PEER_SCRIPT,
                                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}))
        self.jobs.append(job)
        return job

    def go(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not all(Path(j["ready"]).exists() for j in self.jobs):
            for job, proc in zip(self.jobs, self.procs):
                assert proc.poll() is None, f"{job['name']} died early:\n{self.log(job)}"
            assert time.monotonic() < deadline, "peers did not start in time"
            time.sleep(0.1)
        (self.tmp / "go").touch()

    def wait(self, job: dict, timeout: float) -> dict:
        import torch
        proc = self.procs[self.jobs.index(job)]
        proc.wait(timeout)
        assert proc.returncode == 0, f"{job['name']} exited with {proc.returncode}:\n{self.log(job)}"
        return torch.load(job["out"], weights_only=False)

    def log(self, job: dict, tail: int | None = 4000) -> str:
        text = (self.tmp / f"{job['name']}.log").read_text()
        return text if tail is None else text[-tail:]

    def logs(self) -> str:
        """Every peer's log tail: the message of an assertion about the group."""
        return "\n".join(f"== {job['name']}\n{self.log(job)}" for job in self.jobs)

    def kill(self, job: dict) -> None:
        """SIGKILL the peer's main process only (its children must notice and die with it)."""
        self.procs[self.jobs.index(job)].send_signal(signal.SIGKILL)

    def group_gone(self, job: dict, timeout: float) -> bool:
        """Whether every process of the peer's group (DHT, averager, p2pd) has exited."""
        pgid, deadline = self.procs[self.jobs.index(job)].pid, time.monotonic() + timeout
        self.procs[self.jobs.index(job)].wait(timeout)
        while time.monotonic() < deadline:
            alive = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout.split()
            if not alive:
                return True
            time.sleep(0.2)
        return False

    def cleanup(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):  # the group may be gone already
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def peers(tmp_path, fork_server):
    launcher = Peers(tmp_path, fork_server)
    try:
        yield launcher
    finally:
        launcher.cleanup()
