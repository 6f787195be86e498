"""One member of a 2-member all-reduce in its own network namespace, driven by test_shaped_link.py:
`python shaped_proc.py '<json job>'`.

It starts a DHT on its namespace's address (joining the other member's when `initial_peers` is given), writes
`<name>.maddr` and `<name>.id`, waits for the file `go`, and averages a seeded fp32 vector with the other
member (sorted by name) under the job's stall_timeout and min_bandwidth. It writes `<name>.json`: whether it
averaged, when it ended (unix time), its error, and the sha256 of the average.
"""

import asyncio
import concurrent.futures
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from swarm.config import SwarmConfig
from swarm.net.allreduce import AllReduce
from swarm.net.allreduce.groupstate import Contribution
from swarm.net.allreduce.layout import WireLayout
from swarm.net.budget import chunk_elements
from swarm.net.codec import get_codec
from swarm.net.dht import start_dht, visible_maddrs


async def average(dht, job: dict, folder: Path) -> dict:
    from hivemind.p2p import PeerID

    p2p = await dht.replicate_p2p()
    pool = concurrent.futures.ThreadPoolExecutor(2)
    service = AllReduce(p2p, "shaped", job["stall"], job["min_bandwidth"], pool)
    await service.start()  # before anyone may open a stream to us
    (folder / f"{job['name']}.maddr").write_text(visible_maddrs(dht)[0])
    (folder / f"{job['name']}.id").write_text(str(dht.peer_id))
    while not (folder / "go").exists():
        await asyncio.sleep(0.05)
    others = {p.stem: PeerID.from_base58(p.read_text()) for p in folder.glob("*.id") if p.stem != job["name"]}
    vector = torch.randn(job["numel"], generator=torch.Generator().manual_seed(job["seed"]))
    out = [torch.empty(job["numel"])]
    members = [p2p.peer_id if name == job["name"] else others[name] for name in sorted([job["name"], *others])]
    layout = WireLayout([vector.shape], get_codec("none"), 2, chunk_elements(job["stall"], job["min_bandwidth"]))
    start = time.monotonic()
    try:
        await service.run(b"shaped", members, layout, Contribution(lambda i, a, b: vector[a:b].clone(), 1.0, out),
                          [1.0, 1.0])
        return {"ok": True, "seconds": time.monotonic() - start, "end": time.time(),
                "sha256": hashlib.sha256(out[0].numpy().tobytes()).hexdigest()}
    except Exception as e:
        return {"ok": False, "seconds": time.monotonic() - start, "end": time.time(), "error": f"{e!r}"}
    finally:
        await service.drain()


def main(job: dict) -> None:
    folder = Path(job["dir"])
    cfg = SwarmConfig(host_maddrs=[f"/ip4/{job['host']}/tcp/0"], initial_peers=job["initial_peers"],
                      bootstrap_timeout=20.0)
    dht = start_dht(cfg)
    try:
        result = asyncio.run(average(dht, job, folder))
        (folder / f"{job['name']}.json").write_text(json.dumps(result))
    finally:
        dht.shutdown()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
