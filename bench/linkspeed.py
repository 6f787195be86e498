"""The exchange at link speed: the all-reduce's MB/s per peer next to what one raw TCP stream carries between two
processes on the same link, measured in the same run.

MB/s per peer = bytes a peer received in the all-reduce / the slowest peer's all-reduce time (bench/arpeer.py, the
swarm's shipped defaults: trimmed mean, clipping, audits and agreement on). Raw TCP = one Python process sending
1 GB (shaped links: 8 s worth) to another in 4 MiB writes, read with `recv_into`. CPU = seconds of user + system
time per kind of process over the whole launch (start-up included), from /proc. Rows with `data plane off` run
the same all-reduce over libp2p streams only (`swarm.data_plane false`): what the daemons cost.

Loopback rows: every peer a process on the 2 shared cores. Shaped rows: each peer in its own network namespace
behind a tbf-shaped veth link (bench/swarmrun.py `Namespaces`), the bootstrap in another.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from bench.allreduce import launch
from bench.common import md_table, spawn, stamp, stop
from bench.swarmrun import Namespaces, netns_available, wait_for_line

M = 1_000_000
# (link, params, peers, compression, data plane)
FULL = [("loopback", 100 * M, 2, "none", True), ("loopback", 100 * M, 2, "none", False),
        ("loopback", 100 * M, 4, "none", True), ("loopback", 100 * M, 2, "int8", True),
        ("loopback", 25 * M, 8, "none", True),
        ("1000mbit", 100 * M, 2, "none", True), ("1000mbit", 100 * M, 4, "none", True),
        ("1000mbit", 100 * M, 2, "int8", True), ("1000mbit", 25 * M, 8, "none", True),
        ("100mbit", 100 * M, 2, "none", True), ("100mbit", 100 * M, 2, "int8", True),
        ("1000mbit", 25 * M, 2, "none", True), ("100mbit", 25 * M, 2, "none", True)]
QUICK = [("loopback", 10 * M, 2, "none", True), ("loopback", 10 * M, 2, "none", False)]

RECEIVER = """
import socket, sys, time
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(1); print(s.getsockname()[1], flush=True)
c, _ = s.accept(); buf = bytearray(4 << 20); view = memoryview(buf); total = 0; start = None
while True:
    n = c.recv_into(view)
    if not n: break
    start = start or time.perf_counter(); total += n
print(total / (time.perf_counter() - start) / 1e6, flush=True)
"""
SENDER = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); block = bytes(4 << 20)
for _ in range(int(sys.argv[3])): c.sendall(block)
c.close()
"""


def raw_tcp(host: str, blocks: int, prefixes: tuple[list[str], list[str]]) -> float:
    """MB/s of one TCP stream from a process (under prefixes[0]) to another (prefixes[1]) listening on `host`."""
    receiver = subprocess.Popen([*prefixes[1], sys.executable, "-c", RECEIVER, host], stdout=subprocess.PIPE,
                                text=True)
    try:
        port = receiver.stdout.readline().strip()
        subprocess.run([*prefixes[0], sys.executable, "-c", SENDER, host, port, str(blocks)], check=True, timeout=120)
        return float(receiver.stdout.readline())
    finally:
        receiver.kill()
        receiver.wait()


class CpuMeter:
    """User + system seconds of every descendant of this process, by name (python, p2pd), sampled from /proc."""

    def __init__(self):
        self.last: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> CpuMeter:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def totals(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, seconds in self.last.values():
            out[name] = out.get(name, 0.0) + seconds
        return out

    def _sample(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        while not self._stop.wait(0.2):
            children = {os.getpid()}
            stats = {}
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    text = Path(f"/proc/{pid}/stat").read_text()
                except OSError:
                    continue
                name, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
                stats[int(pid)] = (name, int(rest[1]), (int(rest[11]) + int(rest[12])) / tick)
            grew = True
            while grew:  # descendants: ppid in the set
                grew = False
                for pid, (_, ppid, _) in stats.items():
                    if ppid in children and pid not in children:
                        children.add(pid)
                        grew = True
            for pid in children - {os.getpid()}:
                name, _, seconds = stats[pid]
                kind = "p2pd" if "p2pd" in name else "python" if "python" in name or "py-spy" in name else name
                self.last[pid] = (kind, seconds)


def one_row(link: str, params: int, n: int, comp: str, plane: bool, tmp: Path, timeout: float) -> dict:
    with ExitStack() as stack:
        nets = stack.enter_context(Namespaces(n + 1, link)) if link != "loopback" else None
        host = (lambda i: nets.addr(i)) if nets else (lambda i: "127.0.0.1")
        prefix = (lambda i: ["ip", "netns", "exec", nets.ns(i)]) if nets else (lambda i: [])
        boot_log = tmp / f"boot-{link}-{n}-{comp}-{plane}.log"
        boot = spawn(["-m", "swarm.cli", "bootstrap", "--swarm.host_maddrs", f"/ip4/{host(0)}/tcp/0"], boot_log,
                     prefix(0) or None)
        try:
            maddr = wait_for_line(boot_log, rf"/ip4/{host(0)}/tcp/\d+/p2p/\w+", boot)
            with CpuMeter() as meter:
                peers = launch("swarm", comp, n, [params], [maddr], tmp, timeout,
                               extra={"data_plane": plane}, host=host, prefix=prefix,
                               tag=f"{link}-{params}-{plane}")
            cpu = meter.totals()
        finally:
            stop([boot])
        seconds = 8 if nets else 0
        rate_mb = float(link.rstrip("mbit")) / 8 if nets else 0
        blocks = max(8, int(rate_mb * seconds / 4)) if nets else 250
        raw = raw_tcp(host(2), blocks, (prefix(1), prefix(2)))
    if any("error" in p for p in peers):
        return {"error": next(p["error"] for p in peers if "error" in p), "raw_mb_s": raw}
    results = [p["results"][0] for p in peers]
    slowest = max(r["allreduce_s"] for r in results)
    received = sum(r["bytes_sent"] for r in results) / n  # a peer receives what it sends (layout.member_wire_bytes)
    return {"allreduce_s": slowest, "mb_s": received / slowest / 1e6, "raw_mb_s": raw,
            "ok": all(r["ok"] for r in results), "wire_mb": received / 1e6,
            "cpu_python_s": cpu.get("python", 0.0), "cpu_p2pd_s": cpu.get("p2pd", 0.0)}


def make_table(rows: list[tuple[tuple, dict]]) -> str:
    body = []
    for (link, params, n, comp, plane), r in rows:
        head = [link, f"{params / M:g}M", n, comp, "on" if plane else "off"]
        if "error" in r:
            body.append(head + ["failed: " + r["error"][:60], "–", "–", f"{r['raw_mb_s']:.0f}", "–", "–", "–"])
            continue
        body.append(head + [f"{r['wire_mb']:.0f}", f"{r['allreduce_s']:.2f}", f"{r['mb_s']:.0f}",
                            f"{r['raw_mb_s']:.0f}", f"{100 * r['mb_s'] / r['raw_mb_s']:.1f}%",
                            f"{r['cpu_python_s']:.1f}", f"{r['cpu_p2pd_s']:.1f}"])
    return md_table(["link", "params", "peers", "compression", "data plane", "MB received per peer",
                     "all-reduce s (slowest)", "MB/s per peer", "raw TCP MB/s", "of raw", "CPU s python",
                     "CPU s p2pd"], body)


def run(quick: bool) -> dict:
    spec = QUICK if quick else FULL
    if not netns_available()[0]:
        spec = [row for row in spec if row[0] == "loopback"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-link-") as tmp:
        for row in spec:
            start = time.time()
            result = one_row(*row, Path(tmp), timeout=300.0)
            rows.append((row, result))
            print(f"  linkspeed {row}: {time.time() - start:.0f}s {json.dumps(result)}", flush=True)
    return {"table": table_with_notes(rows), "rows": [{"row": list(r), **res} for r, res in rows],
            "timestamp": stamp()}


def table_with_notes(rows: list[tuple[tuple, dict]]) -> str:
    notes = " ".join(__doc__.split("\n\n")[1:3]).replace("\n", " ")
    return (make_table(rows) + "\n\nOne try per row on this 2-core box. " + notes + " Where the time goes, and what "
            "each change of the data plane gave: [exchange-profile.md](exchange-profile.md).")

