"""The `swarm` command: `peer`, `join`, `runs`, `sim`, `local`, `bootstrap`, `monitor`.

Config overrides follow the named flags as dotted keys: `--inner.lr 3e-4` or `inner.lr=3e-4`.
Every failure ends with one line on stderr (`swarm: error: ...`) and a non-zero exit: 2 for bad input
(config key, multiaddr, path), 1 for a refusal by the world (unreachable peers, port in use, corrupt
checkpoint).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional

from swarm.config import Config, ConfigError, SwarmConfig
from swarm.configfile import load_config
from swarm.errors import SwarmError, UsageError, exit_code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm", description="DiLoCo training across peers on hivemind.")
    sub = parser.add_subparsers(dest="command", required=True)

    peer = sub.add_parser("peer", help="run one training peer (joins a swarm, starts one, or --solo)")
    peer.add_argument("--config", required=True, help="YAML config file, e.g. configs/tiny.yaml")
    peer.add_argument("--solo", action="store_true", help="train alone, without any network")
    peer.add_argument("--initial-peers", nargs="+", default=None, metavar="MADDR",
                      help="multiaddrs of peers already in the swarm; none: start a new swarm")
    peer.add_argument("--name", default=None, help="peer name (default: hostname-pid); picks the data shard")
    peer.add_argument("--out", default=None, help="run folder (default: runs/<run>-<time>)")
    peer.add_argument("--client-mode", action="store_true",
                      help="this peer cannot be dialed (behind a NAT): it averages but owns no part and serves no "
                           "state (swarm.client_mode)")
    peer.add_argument("--nproc-per-node", type=int, default=1, metavar="K",
                      help="train this peer with K processes (DDP; one per GPU), launched with torchrun")

    join = sub.add_parser("join", help="run one training peer in a run found by name (its config from the DHT)")
    join.add_argument("run", help="the run's id (swarm.run_id); `swarm runs` lists them")
    join.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR",
                      help="multiaddrs of peers in the swarm")
    join.add_argument("--name", default=None, help="peer name (default: hostname-pid); picks the data shard")
    join.add_argument("--out", default=None, help="run folder (default: runs/<run>-join-<time>)")
    join.add_argument("--nproc-per-node", type=int, default=1, metavar="K",
                      help="train this peer with K processes (DDP; one per GPU): the manifest's config is written to "
                           "<out>/config.yaml and `swarm peer` runs it under torchrun")

    runs = sub.add_parser("runs", help="list the runs a DHT advertises: round, live peers, model size")
    runs.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR",
                      help="multiaddrs of peers in the swarm")

    sim = sub.add_parser("sim", help="M replicas in one process, averaged in memory")
    sim.add_argument("--config", required=True)
    sim.add_argument("--replicas", type=int, default=4)
    sim.add_argument("--out", default=None)

    local = sub.add_parser("local", help="a local multi-peer test swarm on 127.0.0.1")
    local.add_argument("--config", required=True)
    local.add_argument("--peers", type=int, default=4)
    local.add_argument("--rounds", type=int, default=None, help="override diloco.rounds")
    local.add_argument("--out", default=None)
    local.add_argument("--kill", action="append", default=[], metavar="PEER@ROUND[:allreduce]",
                       help="SIGKILL peer PEER in round ROUND (inside the all-reduce with :allreduce); repeatable")
    local.add_argument("--join", action="append", default=[], type=int, metavar="ROUND",
                       help="start an extra peer when the swarm reaches round ROUND; repeatable")
    local.add_argument("--nproc-per-node", type=int, default=1, metavar="K", help="processes per peer (DDP)")
    local.add_argument("--hostile", action="append", default=[], metavar="KIND@PEER",
                       help="peer PEER attacks the swarm (forge-progress, nan, huge, weight, bad-part, garbage-meta, "
                            "poison-state, flood); repeatable")
    local.add_argument("--monitor-port", type=int, default=None, metavar="PORT",
                       help="port of the swarm's monitor page (default 8470, or any free port if it is taken)")
    local.add_argument("--no-monitor", action="store_true", help="start no monitor")

    boot = sub.add_parser("bootstrap", help="a DHT-only peer that others use as --initial-peers")
    boot.add_argument("--identity", default=None, help="key file for a stable peer id (created if missing)")
    boot.add_argument("--host-maddrs", nargs="+", default=["/ip4/0.0.0.0/tcp/0"])
    boot.add_argument("--announce-maddrs", nargs="+", default=[])
    boot.add_argument("--initial-peers", nargs="+", default=[])

    mon = sub.add_parser("monitor", help="serve a run's live state: web page, JSON and Prometheus metrics")
    mon.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR",
                     help="multiaddrs of peers in the swarm")
    mon.add_argument("--run", required=True, help="the run's id (swarm.run_id)")
    mon.add_argument("--port", type=int, default=8470, help="HTTP port (default 8470)")
    mon.add_argument("--host", default="127.0.0.1", help="HTTP address to listen on (default 127.0.0.1)")
    mon.add_argument("--config", default=None, help="the run's YAML config, for its swarm timings (optional)")
    return parser


def _out_dir(out: Optional[str], cfg: Config, mode: str) -> Path:
    if out is not None:
        return Path(out)
    return Path("runs") / f"{cfg.swarm.run_id}-{mode}-{time.strftime('%Y%m%d-%H%M%S')}"


def _setup_logging() -> None:
    """INFO lines from a peer's rank 0 only: the other ranks of a multi-process peer log warnings and errors."""
    level = logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)


def run(argv: list[str]) -> int:
    from swarm.ranks import Ranks, check

    args, rest = _parser().parse_known_args(argv)
    _setup_logging()
    if args.command == "bootstrap":
        if rest:
            raise ConfigError(f"unknown argument {rest[0]!r}")
        from peers.bootstrap import run_bootstrap

        return run_bootstrap(args.identity, args.host_maddrs, args.announce_maddrs, args.initial_peers)
    if args.command == "monitor":
        from swarm.monitor.server import run_monitor

        cfg = load_config(args.config, [*rest, "--swarm.initial_peers", *args.initial_peers,
                                        "--swarm.run_id", args.run])
        return run_monitor(cfg.swarm, args.host, args.port)

    if args.command == "runs":
        if rest:
            raise UsageError(f"unknown argument {rest[0]!r}")
        from peers.join import run_runs

        return run_runs(args.initial_peers, SwarmConfig().bootstrap_timeout)
    if args.command == "join":
        from peers.join import joined_config, write_config
        from peers.node import run_peer

        cfg = joined_config(args.run, args.initial_peers, rest)
        out = _out_dir(args.out, cfg, "join")
        if args.nproc_per_node != 1:
            check(cfg, args.nproc_per_node)
            name = ["--name", args.name] if args.name else []
            _exec_torchrun(args.nproc_per_node, ["peer", "--config", str(write_config(cfg, out / "config.yaml")),
                                                 "--out", str(out), *name])
        path = run_peer(cfg, out, args.name)
        print(f"wrote {path} and {path.parent / 'loss.png'}")
        return 0

    overrides = list(rest)
    if getattr(args, "initial_peers", None):
        overrides += ["--swarm.initial_peers", *args.initial_peers]
    if getattr(args, "client_mode", False):
        overrides += ["--swarm.client_mode", "true"]
    if getattr(args, "rounds", None) is not None:
        overrides += ["--diloco.rounds", str(args.rounds)]
    cfg = load_config(args.config, overrides)

    if args.command == "peer":
        ranks = Ranks.from_env()
        if ranks.distributed and args.nproc_per_node not in (1, ranks.world_size):
            raise UsageError(f"--nproc-per-node {args.nproc_per_node} but torchrun started {ranks.world_size} ranks")
        if not ranks.distributed and args.nproc_per_node != 1:
            check(cfg, args.nproc_per_node)
            _exec_torchrun(args.nproc_per_node, argv)

    if args.command == "local":
        check(cfg, args.nproc_per_node)

    if args.command == "peer" and args.solo:
        from peers.local_trainers import run_solo

        path = run_solo(cfg, _out_dir(args.out, cfg, "solo"))
    elif args.command == "peer":
        from peers.node import run_peer

        path = run_peer(cfg, _out_dir(args.out, cfg, "peer"), args.name)
    elif args.command == "sim":
        from peers.local_trainers import run_sim

        path = run_sim(cfg, args.replicas, _out_dir(args.out, cfg, f"sim{args.replicas}"))
    else:
        from peers.local_swarm import run_local

        path = run_local(cfg, args.config, overrides, args.peers, _out_dir(args.out, cfg, f"local{args.peers}"),
                         args.kill, args.join, args.nproc_per_node, args.hostile,
                         monitor=not args.no_monitor, monitor_port=args.monitor_port)
    if Ranks.from_env().endpoint:
        print(f"wrote {path} and {path.parent / 'loss.png'}")
    return 0


def _exec_torchrun(nproc: int, argv: list[str]) -> None:
    """Replace this process with torchrun running the same command on `nproc` ranks (signals reach torchrun,
    which stops every rank; one rank that dies stops the others)."""
    rest, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            rest.append(arg)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                              f"--nproc-per-node={nproc}", "-m", "swarm.cli", *rest])


def main(argv: Optional[list[str]] = None) -> None:
    try:
        code = run(sys.argv[1:] if argv is None else argv)
    except (ConfigError, SwarmError) as e:
        print(f"swarm: error: {e}", file=sys.stderr)
        code = exit_code(e)
    except KeyboardInterrupt as e:  # Ctrl-C (SIGINT: exit 130) or swarm.errors.Stopped (SIGTERM: exit 143)
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"swarm: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        code = 128 + signum
    sys.exit(code)


if __name__ == "__main__":
    main()
