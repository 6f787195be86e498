"""`swarm local`: a bootstrap and N training peers as separate processes on 127.0.0.1.

Children are forked from one server process that imported torch and hivemind once (peers/forkserver.py), so N peers
start in about the time one does. Each child runs in its own process group (so a Ctrl-C reaches only this launcher,
which then stops every child: SIGTERM, a grace period, then SIGKILL to the whole group, hivemind's DHT process and
p2pd daemon included). SIGTERM and SIGHUP stop the launcher the same way, and it still writes the summary of what
its peers did. Nothing outlives the launcher even if it is killed -9: the fork server gets a SIGTERM from the
kernel when the launcher dies and each child one when the server does (PR_SET_PDEATHSIG); a peer shuts its DHT down
on it. Peers write `peer-i/status.json`, which this launcher renders as one live line per peer, and
`peer-i/peer.json`, which it merges into `summary.json` and `loss.png`. A monitor (swarm/monitor/, a DHT client)
runs in this launcher's process, shows its kills and joins among the events, and stops with the swarm. The first
peers all start round 1 together: each holds before it (faults.hold_round, `start-hold` in the run folder) until
every one of them is there, so a peer that took seconds longer to start is in round 1's group all the same.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from peers.children import Child, bootstrap_maddr, spawn_child, stop_children
from peers.forkserver import ForkServer
from swarm.config import ATTACKS, Config
from swarm.errors import SwarmError, UsageError, stop_on
from swarm.run.report import format_table, write_summary


def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not written yet, or caught mid-rename
        return None


def _status_line(peers: list[Child], rounds: int, inner_steps: int, held: dict[str, tuple[Path, int]]) -> str:
    cells = []
    for child in peers:
        s = _read_json(child.out_dir / "status.json") or {}
        loss = s.get("loss")
        state = "exited" if child.proc.poll() is not None else s.get("state", "starting")
        if child.name in held:
            state = f"joins at round {held[child.name][1]}"
        cells.append(f"{child.name}: r{s.get('round', 0)}/{rounds} s{s.get('step', 0)}/{inner_steps} "
                     f"loss {'-' if loss is None else f'{loss:.3f}'} {state}")
    return " | ".join(cells)


@dataclass
class Kill:
    """`--kill PEER@ROUND[:allreduce]`: peer PEER SIGKILLs itself in round ROUND (inner steps or all-reduce)."""

    peer: int
    round: int
    phase: str

    @classmethod
    def parse(cls, text: str) -> Kill:
        match = re.fullmatch(r"(\d+)@(\d+)(?::(allreduce|inner))?", text)
        if match is None:
            raise UsageError(f"cannot read --kill {text!r}: expected PEER@ROUND or PEER@ROUND:allreduce")
        return cls(int(match[1]), int(match[2]), match[3] or "inner")


RANKS = re.compile(r"([0-9]+)(?::(ddp|fsdp))?")


def parse_ranks(spec: str, n_peers: int) -> list[tuple[int, Optional[str]]]:
    """`--nproc-per-node K` (every peer) or `K[:ddp|fsdp],...` (one entry per peer: its ranks and its
    inner.parallel, None: the config's) -> [(K, parallel)] for peers 0..n_peers-1 (with `swarm local`, those that
    `--join` later count too, in the order they join); UsageError naming what does not parse."""
    entries = spec.split(",")
    parsed = [RANKS.fullmatch(e.strip()) for e in entries]
    for entry, match in zip(entries, parsed):
        if match is None or int(match.group(1)) < 1:
            raise UsageError(f"--nproc-per-node {spec}: {entry!r} is not K, K:ddp or K:fsdp (K >= 1)")
    if len(parsed) not in (1, n_peers):
        raise UsageError(f"--nproc-per-node {spec}: {len(parsed)} entries for {n_peers} peers (one, or one per peer)")
    plan = [(int(m.group(1)), m.group(2)) for m in parsed]
    return plan * n_peers if len(plan) == 1 else plan


def parse_hostile(texts: list[str], n_peers: int) -> dict[int, list[str]]:
    """`--hostile KIND@PEER` (repeatable) -> {peer: [kinds]}; UsageError naming what does not parse."""
    plan: dict[int, list[str]] = {}
    for text in texts:
        match = re.fullmatch(r"([a-z-]+)@(\d+)", text)
        if match is None:
            raise UsageError(f"cannot read --hostile {text!r}: expected KIND@PEER, e.g. forge-progress@3")
        if match[1] not in ATTACKS:
            raise UsageError(f"--hostile {text}: unknown attack {match[1]!r} (known: {', '.join(ATTACKS)})")
        if not 0 <= int(match[2]) < n_peers:
            raise UsageError(f"--hostile {text}: no peer {match[2]} in this swarm of {n_peers}")
        plan.setdefault(int(match[2]), []).append(match[1])
    return plan


def start_monitor(cfg: Config, maddr: str, port: Optional[int]):
    """The swarm's monitor on 127.0.0.1: on `port`, or on 8470 (any free port if that one is taken)."""
    from swarm.monitor.server import DEFAULT_PORT, Monitor, PortInUse

    swarm_cfg = dataclasses.replace(cfg.swarm, initial_peers=[maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                    announce_maddrs=[], identity=None)
    try:
        return Monitor.start(swarm_cfg, "127.0.0.1", DEFAULT_PORT if port is None else port)
    except PortInUse:
        if port is not None:
            raise
        return Monitor.start(swarm_cfg, "127.0.0.1", 0)


def defaults(n_peers: int, joins: list[int] = ()) -> list[str]:
    """The overrides `swarm local` gives every peer before the user's own (which win): one group for the whole
    swarm, joiners included, so that a round forms as soon as every live peer is ready instead of waiting out
    the matchmaking time."""
    return ["--swarm.target_group_size", str(max(n_peers + len(joins), 2))]


def check_plan(cfg: Config, n_peers: int, kills: list[str] = (), joins: list[int] = (), hostile: list[str] = (),
               monitor_port: Optional[int] = None) -> tuple[dict[int, list[str]], dict[int, Kill], list[int]]:
    """The attackers, kills and joins `swarm local` was asked for; UsageError naming the first that does not fit
    (and SwarmError if `monitor_port`, the monitor's port asked for, is in use). `cfg` is the peers' config, with
    `defaults` under the user's overrides."""
    if n_peers < 1:
        raise UsageError(f"--peers must be >= 1, got {n_peers}")
    size, peers = cfg.swarm.target_group_size, n_peers + len(joins)
    if 2 * size < peers:  # e.g. 8 peers in groups of 3: 3 hashes a round, none held by half the swarm
        raise UsageError(f"swarm.target_group_size {size} with {peers} peers: a group cannot hold half of the swarm, "
                         f"so no group's average reaches the quorum (swarm/net/policy.py) and the peers would end "
                         f"on different models; use swarm.target_group_size >= {math.ceil(peers / 2)} (swarm local "
                         f"puts all {peers} peers in one group unless told otherwise)")
    if n_peers + len(joins) > cfg.data.num_shards:  # each peer of `swarm local` trains on a shard of its own
        raise UsageError(f"--peers {n_peers}{f' and {len(joins)} --join' if joins else ''} need a data shard each: "
                         f"data.num_shards is {cfg.data.num_shards}")
    attackers = parse_hostile(list(hostile), n_peers)
    kill_plan = {k.peer: k for k in map(Kill.parse, kills)}
    for k in kill_plan.values():
        if not (0 <= k.peer < n_peers and 1 <= k.round <= cfg.diloco.rounds):
            raise UsageError(f"--kill {k.peer}@{k.round}: no peer {k.peer} or round {k.round} in this swarm")
    for round_ in joins:
        if not 1 <= round_ <= cfg.diloco.rounds:
            raise UsageError(f"--join {round_}: this swarm has rounds 1..{cfg.diloco.rounds}")
    if monitor_port is not None:
        from swarm.monitor.server import check_port

        check_port("127.0.0.1", monitor_port)  # before any process starts
    return attackers, kill_plan, sorted(joins)


START_GATE_S = 120.0  # the start gate opens after this long whoever is there (a peer stuck before round 1, or
                      # one whose --log-level error hides the warning the gate looks for)


def _at_the_gate(first: list[Child]) -> bool:
    """Whether each of the first peers holds before round 1 (its log's warning says so), already trains (it
    resumed at a later round and so never holds) or has exited."""
    def there(child: Child) -> bool:
        log = child.out_dir / "log.txt"
        return (child.proc.poll() is not None or (_read_json(child.out_dir / "status.json") or {}).get("state")
                not in (None, "starting") or (log.exists() and "holding before round 1" in log.read_text()))
    return all(there(child) for child in first)


def run_local(cfg: Config, config_path: str, overrides: list[str], n_peers: int, out_dir: Path,
              kills: list[str] = (), joins: list[int] = (), nproc: int | str = 1, hostile: list[str] = (),
              monitor: bool = True, monitor_port: Optional[int] = None, log_level: str = "info") -> Path:
    """Run the local swarm to its end (or to Ctrl-C, SIGTERM, SIGHUP: every child stopped, what it did summed up)
    and return its summary.json."""
    attackers, kill_plan, pending_joins = check_plan(cfg, n_peers, kills, joins, hostile,
                                                     monitor_port if monitor else None)
    swarm = LocalSwarm(cfg, out_dir, n_peers, attackers, kill_plan,
                       parse_ranks(str(nproc), n_peers + len(pending_joins)))
    failed: list[Child] = []
    interrupted: Optional[KeyboardInterrupt] = None
    restore_signals = stop_on(signal.SIGTERM, signal.SIGHUP)  # like Ctrl-C: stop the children, sum up
    server = ForkServer()  # one process imports torch and hivemind; every child is forked from it
    try:
        maddr = swarm.start_bootstrap(server, monitor, monitor_port)
        # Each peer gets its own shard, and `defaults` before the user's overrides (the last one given wins).
        swarm.common = ["peer", "--config", config_path, *defaults(n_peers, pending_joins), *overrides,
                        "--initial-peers", maddr, "--diloco.threads", "1", "--logging.progress_bar", "false",
                        "--swarm.host_maddrs", "/ip4/127.0.0.1/tcp/0", "--log-level", log_level]
        swarm.start_peers(server, gated=not any(o.startswith(("--faults.hold", "faults.hold")) for o in overrides))
        swarm.start_joiners(server, pending_joins)
        swarm.follow()
        failed = swarm.ended()
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM or SIGHUP: stop every child, then sum up what they did
        interrupted = e
        print(f"\nstopping {len(swarm.children)} processes ({e})", flush=True)
    finally:
        if swarm.watch is not None:  # first: once the bootstrap is gone, the monitor's last DHT read waits its time-out
            swarm.watch.close()
        stop_children(swarm.children)
        server.close()
        restore_signals()
    return swarm.sum_up(failed, interrupted)


class LocalSwarm:
    """The processes of one `swarm local` and what they did: its bootstrap and monitor, the first peers (behind a
    start gate), the joiners (held until the round they join at), the events (kills, joins, attacks)."""

    def __init__(self, cfg: Config, out_dir: Path, n_peers: int, attackers: dict[int, list[str]],
                 kill_plan: dict[int, Kill], ranks: list[tuple[int, Optional[str]]]):
        self.cfg, self.out_dir, self.n_peers, self.attackers, self.kill_plan, self.ranks = \
            cfg, out_dir, n_peers, attackers, kill_plan, ranks
        self.start = time.time()
        self.children: list[Child] = []
        self.peers: list[Child] = []
        self.events: list[dict] = []
        self.held: dict[str, tuple[Path, int]] = {}  # joiners not let in yet: their hold file, the round they join at
        self.watch = None  # the monitor
        self.common: list[str] = []  # what every peer runs, less its own options
        self.gate = out_dir / "start-hold"
        out_dir.mkdir(parents=True, exist_ok=True)

    def event(self, kind: str, **fields) -> None:
        self.events.append({"event": kind, "time": time.time(), **fields})
        print(f"[{time.time() - self.start:5.0f}s] {kind}: {fields}", flush=True)
        if self.watch is not None:
            self.watch.view.add_event(time.time(), kind, fields.get("peer", ""),
                                      ", ".join(f"{k} {v}" for k, v in fields.items() if k != "peer"))

    def start_bootstrap(self, server: ForkServer, monitor: bool, monitor_port: Optional[int]) -> str:
        """The bootstrap DHT (and the monitor on it); its multiaddr."""
        boot_log = self.out_dir / "bootstrap.log"
        argv = ["bootstrap", "--swarm.host_maddrs", "/ip4/127.0.0.1/tcp/0", "--out", str(self.out_dir / "bootstrap")]
        boot = spawn_child(server, "bootstrap", argv, boot_log)  # its own log in the run's folder, not in runs/
        self.children.append(boot)
        maddr = bootstrap_maddr(boot, boot_log)
        print(f"bootstrap at {maddr}", flush=True)
        if monitor:
            self.watch = start_monitor(self.cfg, maddr, monitor_port)
            print(f"monitor at {self.watch.url} (JSON: {self.watch.url}api/swarm, Prometheus: "
                  f"{self.watch.url}metrics)", flush=True)
        return maddr

    def _start_peer(self, server: ForkServer, i: int, *extra: str) -> Child:
        peer_dir = self.out_dir / f"peer-{i}"
        k, parallel = self.ranks[i]
        extra = ("--nproc-per-node", str(k), *(["--inner.parallel", parallel] if parallel else []), *extra)
        child = spawn_child(server, f"peer-{i}", [*self.common, *extra, "--name", f"peer-{i}", "--out", str(peer_dir),
                                                  "--data.shard", str(i)], peer_dir / "log.txt", peer_dir)
        self.children.append(child)
        self.peers.append(child)
        return child

    def start_peers(self, server: ForkServer, gated: bool) -> None:
        """The first N peers. The start gate: they hold before round 1 until every one of them is there (rounds of a
        tiny model end within a second, and a peer that started a few seconds late found the others rounds ahead)."""
        if gated:
            self.gate.touch()
        for i in range(self.n_peers):
            k = self.kill_plan.get(i)
            self._start_peer(server, i,
                             *(["--faults.hold_round", "1", "--faults.hold_file", str(self.gate)] if gated else []),
                             *(["--faults.kill_round", str(k.round), "--faults.kill_phase", k.phase] if k else []),
                             *(["--faults.hostile", *self.attackers[i]] if i in self.attackers else []))
            if i in self.attackers:
                self.event("hostile", peer=f"peer-{i}", attacks=self.attackers[i])

    def start_joiners(self, server: ForkServer, joins: list[int]) -> None:
        """Joiners start now, held until the swarm has committed the round before theirs: a process start-up
        takes seconds (more on a loaded machine) and must not race the rounds it is meant to join."""
        for round_ in joins:
            hold = self.out_dir / f"peer-{len(self.peers)}" / "hold"
            hold.parent.mkdir(parents=True, exist_ok=True)
            hold.touch()
            child = self._start_peer(server, len(self.peers), "--faults.hold_round", "0", "--faults.hold_file",
                                     str(hold))
            self.held[child.name] = (hold, round_)
        print(f"started {self.n_peers} peers{f' and {len(self.held)} joiners' if self.held else ''}; "
              f"logs in {self.out_dir}/peer-*/log.txt", flush=True)

    def follow(self) -> None:
        """Until every peer let in has exited: open the start gate, let joiners in, note kills, show a line."""
        interactive, last_print, seen_dead = sys.stdout.isatty(), 0.0, set()
        while any(p.proc.poll() is None for p in self.peers if p.name not in self.held):
            if self.gate.exists() and (_at_the_gate(self.peers[:self.n_peers])
                                       or time.time() - self.start > START_GATE_S):
                self.gate.unlink()
            statuses = [_read_json(p.out_dir / "status.json") or {} for p in self.peers]
            committed = max((s.get("round", 0) for s in statuses), default=0)
            for name, (hold, round_) in sorted(self.held.items(), key=lambda item: item[1][1]):
                if committed >= round_ - 1:
                    hold.unlink()
                    del self.held[name]
                    self.event("join", peer=name, round=round_)
            for p in self.peers:
                if p.proc.poll() is not None and p.name not in seen_dead:
                    seen_dead.add(p.name)
                    k = self.kill_plan.get(int(p.name.split("-")[1]))
                    # a killed rank of a multi-process peer ends its launcher with status 1
                    several = self.ranks[int(p.name.split("-")[1])][0] > 1
                    if k is not None and p.proc.returncode in (-signal.SIGKILL, 1 if several else -signal.SIGKILL):
                        self.event("kill", peer=p.name, round=k.round, phase=k.phase)
            line = _status_line(self.peers, self.cfg.diloco.rounds, self.cfg.diloco.inner_steps, self.held)
            if interactive:
                print("\r\033[K" + line[: os.get_terminal_size().columns - 1], end="", flush=True)
            elif time.time() - last_print >= 10:
                print(f"[{time.time() - self.start:5.0f}s] {line}", flush=True)
                last_print = time.time()
            time.sleep(0.5)
        if interactive:
            print()

    def ended(self) -> list[Child]:
        """The peers that failed (not killed, not hostile, not a joiner the swarm finished without), each named."""
        for name, (_, round_) in self.held.items():
            self.event("join_skipped", peer=name, round=round_, reason="the swarm finished before that round")
        stop_children([p for p in self.peers if p.name in self.held])  # they never took part
        killed = {e["peer"] for e in self.events if e["event"] == "kill"}
        hostile_names = {f"peer-{i}" for i in self.attackers}
        failed = [p for p in self.peers if p.proc.returncode != 0 and p.name not in killed | hostile_names
                  and p.name not in self.held]
        for p in failed:
            tail = (p.out_dir / "log.txt").read_text().strip().splitlines()[-1:]
            print(f"{p.name} exited with status {p.proc.returncode}: {tail[0] if tail else ''}", flush=True)
        if self.watch is not None and self.watch.error is not None:
            print(f"the monitor stopped reading the DHT: {self.watch.error}", flush=True)
        return failed

    def sum_up(self, failed: list[Child], interrupted: Optional[KeyboardInterrupt]) -> Path:
        """summary.json, loss.png and the table from what the peers wrote; then what ended the run, raised."""
        summaries, events = [], list(self.events)
        for p in (p for p in self.peers if p.name not in self.held):
            summary = _read_json(p.out_dir / "peer.json")
            if summary is not None:
                if int(p.name.split("-")[1]) in self.attackers:
                    summary["hostile"] = self.attackers[int(p.name.split("-")[1])]
                summaries.append(summary)
                events += [{**e, "peer": p.name} for e in summary.get("events", [])]
        if not summaries:
            if interrupted is not None:
                raise interrupted
            raise SwarmError(f"no peer finished; see the logs in {self.out_dir}")
        events.sort(key=lambda e: e["time"])
        path = write_summary(self.out_dir, self.cfg.swarm.run_id, f"local x{self.n_peers}", self.cfg.to_dict(),
                             time.time() - self.start, summaries, events, fault_report(events, summaries))
        print(format_table(summaries))
        honest = [s for s in summaries if "hostile" not in s]
        hashes = {s["final_global_sha256"] for s in honest}
        print(f"final global parameters: {'identical on every' if len(hashes) == 1 else 'DIFFER across'} "
              f"{'honest ' if self.attackers else ''}peer ({len(honest)} peers, wall {time.time() - self.start:.0f}s)")
        if interrupted is not None:
            print(f"summary of the interrupted run in {path}", flush=True)
            raise interrupted
        if failed:
            raise SwarmError(f"{len(failed)} of {len(self.peers)} peers failed ({', '.join(p.name for p in failed)}); "
                             f"summary in {path}")
        check_agreement(summaries, self.cfg.diloco.rounds, path)
        return path


def check_agreement(summaries: list[dict], rounds: int, path: Path) -> None:
    """SwarmError unless every honest peer (no `hostile` key) that finished the run's `rounds` ended on one hash
    (a peer killed on purpose stopped where it was)."""
    hashes = {s["final_global_sha256"] for s in summaries
              if "hostile" not in s and s.get("rounds_completed", 0) >= rounds}
    if len(hashes) > 1:
        raise SwarmError(f"the honest peers ended on {len(hashes)} different models (final_global_sha256 in "
                         f"{path}): the swarm did not agree")


def fault_report(events: list[dict], summaries: list[dict]) -> dict:
    """What the swarm did about each injected fault: time to the next committed round, time to contribute."""
    report = {}
    commits = sorted((r["time"], s.get("name"), r) for s in summaries for r in s["rounds"] if r["committed"])
    for e in events:
        if e["event"] == "kill":
            after = [t for t, name, r in commits if t > e["time"] and name != e["peer"]]
            report[f"kill {e['peer']}"] = {"s_to_next_committed_round": after[0] - e["time"] if after else None}
        elif e["event"] == "join":
            joined = [(t, r) for t, name, r in commits if name == e["peer"] and r["group_size"] > 1]
            report[f"join {e['peer']}"] = {
                "s_to_first_contribution": joined[0][0] - e["time"] if joined else None,
                "first_round": joined[0][1]["round"] if joined else None}
    return report
