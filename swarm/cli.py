"""The `swarm` command: `peer`, `join`, `runs`, `sim`, `local`, `bootstrap`, `monitor`, `export`, `data prepare`,
`config show`. Its options, help texts and rules: swarm/run/cliargs.py.

Config overrides follow the named flags as dotted keys: `--inner.lr 3e-4` or `inner.lr=3e-4`.
Every failure ends with one line on stderr (`swarm: error: ...`, also the last line of the run folder's
log.txt) and a non-zero exit: 2 for bad input (config key, option, multiaddr, path, a port in use given as
`--port`), 1 for a refusal by the world (unreachable peers, a run that refuses this peer, corrupt checkpoint).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional

from swarm.config import Config, ConfigError
from swarm.errors import SwarmError, UsageError, exit_code
from swarm.run import cliargs, logs
from swarm.run.configfile import load_config


def _out_dir(out: Optional[str], cfg: Config, mode: str) -> Path:
    if out is not None:
        return Path(out)
    return Path("runs") / f"{cfg.swarm.run_id}-{mode}-{time.strftime('%Y%m%d-%H%M%S')}"


def _network(args: argparse.Namespace) -> list[str]:
    """The config overrides the network options stand for (cliargs.SHORTCUTS), before the dotted ones, which
    win over them."""
    from swarm.net.addresses import network_overrides

    out = ["--swarm.initial_peers", *args.initial_peers] if args.initial_peers else []
    if getattr(args, "client_mode", False):
        out += ["--swarm.client_mode", "true"]
    return out + network_overrides(args.port, args.announce_ip)


def _no_rest(rest: list[str], command: str) -> None:
    if rest:
        raise UsageError(f"swarm {command}: unknown argument {rest[0]!r} (see `swarm {command} --help`)")


def _bootstrap(args: argparse.Namespace, rest: list[str], argv: list[str]) -> int:
    from swarm.net.dht import run_bootstrap

    cfg = load_config(args.config, [*_network(args), *rest])
    logs.to_folder(Path(args.out))
    run_bootstrap(cfg.swarm)
    return 0


def _monitor(args: argparse.Namespace, rest: list[str], argv: list[str]) -> int:
    from swarm.monitor.server import run_monitor

    cfg = load_config(args.config, [*rest, "--swarm.initial_peers", *args.initial_peers, "--swarm.run_id", args.run])
    history = Path(args.history) if args.history else Path("runs") / f"monitor-{args.run}" / "history.json"
    logs.to_folder(history.parent, "--history")
    return run_monitor(cfg.swarm, args.host, args.http_port, history)


def _export(args: argparse.Namespace, rest: list[str], argv: list[str]) -> int:
    """`swarm export SOURCE` (a peer's checkpoint) or `swarm export --from-swarm RUN` (the swarm's state)."""
    from swarm.state.export import export_hf, usage_snippet

    if (args.source is None) == (args.from_swarm is None):
        raise UsageError("swarm export takes a SOURCE (a peer's folder) or --from-swarm RUN, one of them")
    if (args.from_swarm is None) != (args.initial_peers is None):
        raise UsageError("--from-swarm RUN and --initial-peers MADDR ... go together")
    if args.from_swarm is not None:
        from peers.export_swarm import export_from_swarm

        out, round = export_from_swarm(args.from_swarm, args.initial_peers, rest, Path(args.hf_out), args.dtype,
                                       args.force)
        what = f"the state of round {round} of run {args.from_swarm}"
    else:
        _no_rest(rest, "export")
        out = export_hf(Path(args.source), Path(args.hf_out), args.dtype, args.force, args.config)
        what = f"the last checkpoint of {args.source}"
    print(f"wrote {out} ({what}); load it with:\n{usage_snippet(out)}")
    return 0


def _runs(args: argparse.Namespace, rest: list[str], argv: list[str]) -> int:
    from peers.join import run_runs

    cfg = load_config(None, ["--swarm.initial_peers", *args.initial_peers, *rest])
    return run_runs(cfg.swarm.initial_peers, cfg.swarm.bootstrap_timeout)


def _config(args: argparse.Namespace, rest: list[str], argv: list[str]) -> int:
    from peers.inspect import show_config

    print(show_config(load_config(args.config, rest), args.config, rest))
    return 0


def _join(args: argparse.Namespace, rest: list[str], argv: list[str]) -> int:
    from peers.join import joined_config, write_config

    cfg, run = joined_config(args.run, args.initial_peers, [*_network(args), *rest])
    _check_pretrained(cfg)
    from peers.prepare import check_corpus_here

    if check_corpus_here(cfg.data, args.run, run.corpus_sha256, args.dry_run):
        from peers.corpus_fetch import fetch_corpus

        fetch_corpus(cfg, run)
    if args.dry_run:
        from peers.inspect import dry_run

        return dry_run(cfg, _planned(args, cfg, "peer"), networked=True, run=run, nproc=args.nproc_per_node)
    if args.nproc_per_node != 1:
        from swarm.train.ranks import check

        check(cfg, args.nproc_per_node)
    with _folder(args, cfg, "peer") as folder:
        if args.nproc_per_node != 1:
            from peers.launch import launch_ranks

            peer = _rank_argv(["peer", "--config", str(write_config(cfg, folder.path / "config.yaml")),
                               "--log-level", cliargs.log_level(args)], folder)
            return launch_ranks(args.nproc_per_node, lambda: run(peer))
        from peers.node import run_peer

        return _wrote(run_peer(cfg, folder.path, folder.name or args.name), folder.path)


def _planned(args: argparse.Namespace, cfg: Config, kind: str) -> Path:
    """The folder a command would train in (for --dry-run: nothing is claimed or made)."""
    from peers.folder import claim

    return claim(args.out, cfg.swarm.run_id, getattr(args, "name", None), kind, lock=False).path


def _folder(args: argparse.Namespace, cfg: Config, kind: str):
    """The peer (or swarm) folder this command trains in, claimed for this process; its log.txt begins, and the
    first log line says whether the peer resumes or starts fresh (peers/folder.py)."""
    from peers.folder import claim, start
    from swarm.train.ranks import Ranks

    distributed = Ranks.from_env().distributed  # a rank of a peer of several processes: its launcher holds it
    folder = claim(args.out, cfg.swarm.run_id, getattr(args, "name", None), kind, lock=not distributed)
    logs.to_folder(folder.path)
    if kind != "local" and not distributed:
        start(folder.path, cfg, args.fresh, networked=kind == "peer")
    return folder


def _sim(args: argparse.Namespace, cfg: Config) -> int:
    """`swarm sim`: M replicas in this process, in `--out`'s replica-<i>/ folders."""
    from peers.local_trainers import check_replicas, replica_folders, run_sim

    check_replicas(cfg, args.replicas)
    out = _out_dir(args.out, cfg, f"sim{args.replicas}")
    if args.dry_run:
        from peers.inspect import dry_run

        return dry_run(cfg, out, networked=False)
    logs.to_folder(out)
    if args.fresh:
        from peers.folder import start

        for folder, replica in replica_folders(cfg, args.replicas, out):
            start(folder, replica, fresh=True, networked=False)
    return _wrote(run_sim(cfg, args.replicas, out), None)


def _rank_argv(argv: list[str], folder) -> list[str]:
    """The command each rank of a peer of several processes runs: `argv` in the claimed `folder` (the launcher
    holds its lock and did `--fresh` already)."""
    return [arg for arg in argv if arg != "--fresh"] + ["--out", str(folder.path),
                                                        *(["--name", folder.name] if folder.name else [])]


def _check_pretrained(cfg: Config) -> None:
    """A warm start's folder (`model.pretrained`) checked before anything starts (swarm/state/pretrained.py)."""
    from swarm.state.pretrained import check

    check(cfg)


def _prepare(args: argparse.Namespace, rest: list[str], argv: list[str]) -> int:
    from peers.prepare import run_prepare

    cfg = load_config(args.config, rest)
    return run_prepare(cfg.data, cfg.model.vocab_size)


def _train(args: argparse.Namespace, rest: list[str], argv: list[str]) -> int:
    """`peer`, `sim` and `local`: a config file, a run folder, training."""
    networked = args.command == "peer" and not args.solo
    overrides = [*(_network(args) if networked else []), *rest]
    if getattr(args, "rounds", None) is not None:
        overrides += ["--diloco.rounds", str(args.rounds)]
    if args.command == "local":  # what each peer of the local swarm will run with
        from peers.local_swarm import defaults

        cfg = load_config(args.config, [*defaults(args.peers, args.join), *overrides])
    else:
        cfg = load_config(args.config, overrides)
    _check_pretrained(cfg)
    if not getattr(args, "dry_run", False):  # a dry run says so after the memory plan
        from peers.prepare import check_prepared

        check_prepared(cfg.data)
    from swarm.train.ranks import Ranks, check

    kind = "local" if args.command == "local" else "peer" if networked else "solo"
    if args.command == "local":
        from peers.local_swarm import parse_ranks

        for nproc, _ in parse_ranks(args.nproc_per_node, args.peers + len(args.join)):  # UsageError: exit 2
            check(cfg, nproc)
    if args.command == "local":
        from peers.local_swarm import check_plan

        check_plan(cfg, args.peers, args.kill, args.join, args.hostile,  # before the folder is made, or a dry run
                   None if args.no_monitor or args.dry_run else args.monitor_port)
    if args.command == "sim":
        return _sim(args, cfg)
    if args.command in ("peer", "local") and args.dry_run:
        from peers.inspect import dry_run

        return dry_run(cfg, _planned(args, cfg, kind), networked=networked,
                       nproc=args.nproc_per_node if args.command == "peer" else 1,
                       local_peers=args.peers + len(args.join) if args.command == "local" else None)
    if args.command == "local":
        from peers.local_swarm import run_local

        with _folder(args, cfg, "local") as folder:
            path = run_local(cfg, args.config, overrides + ["--fresh"] * args.fresh, args.peers, folder.path,
                             args.kill, args.join, args.nproc_per_node, args.hostile, monitor=not args.no_monitor,
                             monitor_port=args.monitor_port, log_level=cliargs.log_level(args))
        return _wrote(path, folder.path / "peer-0")
    ranks = Ranks.from_env()
    if ranks.distributed and args.nproc_per_node not in (1, ranks.world_size):
        raise UsageError(f"--nproc-per-node {args.nproc_per_node} but {ranks.world_size} ranks were started")
    if not ranks.distributed and args.nproc_per_node != 1:
        check(cfg, args.nproc_per_node)
    with _folder(args, cfg, kind) as folder:
        if not ranks.distributed and args.nproc_per_node != 1:
            from peers.launch import launch_ranks

            ranks_argv = _rank_argv(argv, folder)
            return launch_ranks(args.nproc_per_node, lambda: run(ranks_argv))
        if args.solo:
            from peers.local_trainers import run_solo

            path = run_solo(cfg, folder.path)
        else:
            from peers.node import run_peer

            path = run_peer(cfg, folder.path, folder.name or args.name)
        return _wrote(path, folder.path)


def _wrote(summary: Path, peer: Optional[Path]) -> int:
    """The last lines a user sees: what was written, and how to get the model out of `peer`'s folder."""
    from swarm.state.checkpoint import Checkpointer
    from swarm.train.ranks import Ranks

    if Ranks.from_env().endpoint:
        print(f"wrote {summary} and {summary.parent / 'loss.png'}")
        if peer is not None and Checkpointer(peer / "checkpoint").latest() is not None:
            print(f"get the model out: swarm export {peer} --hf-out {summary.parent / 'model'}")
    return 0


COMMANDS = {"bootstrap": _bootstrap, "monitor": _monitor, "export": _export, "runs": _runs, "config": _config,
            "join": _join, "data": _prepare, "peer": _train, "sim": _train, "local": _train}


def run(argv: list[str]) -> int:
    """Parse `argv` and run its command. Heavy modules (torch, hivemind, transformers) are imported only by the
    command that needs them, after its arguments and config were read: a usage error exits at once."""
    args, rest = cliargs.parse(argv)
    with logs.session(cliargs.log_level(args)):
        try:
            return COMMANDS[args.command](args, rest, argv)
        except (ConfigError, SwarmError) as e:
            logs.file_only(f"swarm: error: {e}", e)
            raise
        except KeyboardInterrupt as e:
            logs.file_only(f"swarm: stopped by {signal.Signals(getattr(e, 'signum', signal.SIGINT)).name}")
            raise


def main(argv: Optional[list[str]] = None) -> None:
    # `kill -USR1 <pid>`: every thread's Python stack on stderr, the process going on (a hang diagnosed without a
    # debugger; inherited by the ranks `--nproc-per-node` forks, and used by the tests on a time-out)
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    try:
        code = run(sys.argv[1:] if argv is None else argv)
    except (ConfigError, SwarmError) as e:
        print(f"swarm: error: {e}", file=sys.stderr)
        code = exit_code(e)
    except KeyboardInterrupt as e:  # Ctrl-C (SIGINT: exit 130) or swarm.errors.Stopped (SIGTERM: exit 143)
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"swarm: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        code = 128 + signum
    except BrokenPipeError:  # `swarm config show | head`: the reader is gone, nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a rank of a peer of several processes (swarm/train/ranks.py)
        from peers.launch import exit_rank

        exit_rank(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
