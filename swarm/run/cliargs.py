"""The `swarm` command line: every command, option, help text and default (swarm/cli.py runs them).

Rules every command follows, so that an option means one thing everywhere:
- one spelling per option: an option that sets a config key is that key (`--swarm.identity FILE`), except the
  shortcuts in `SHORTCUTS`, which every command that takes them spells alike;
- every option has a help text, which shows its real default;
- no abbreviations (`--init` is not `--initial-peers`); a list option stops at the first config override
  (`--initial-peers A inner.lr=3e-4` is one address and one override);
- every command takes `--log-level LEVEL`, `-v` (debug) and `-q` (warnings and errors only);
- a usage error is one line, `swarm: error: ...`, and exit 2 (swarm/errors.py), like every other bad input.
"""

from __future__ import annotations

import argparse
from importlib import metadata
from typing import Optional

from swarm.config import joinable_keys
from swarm.errors import UsageError

LOG_LEVELS = ("debug", "info", "warning", "error")
SHORTCUTS = {
    "--initial-peers": "swarm.initial_peers",
    "--client-mode": "swarm.client_mode",
    "--rounds": "diloco.rounds",
    "--port": "swarm.host_maddrs (/ip4/0.0.0.0/tcp/PORT)",
    "--announce-ip": "swarm.announce_maddrs (/ip4/IP/tcp/PORT)",
    "--hostile": "faults.hostile of one peer of `swarm local` (KIND@PEER)",
}
"""Options that stand for config keys, on every command that has them; any other config key is set as itself."""


def version() -> str:
    try:
        return metadata.version("swarm")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are UsageErrors (one line, exit 2) and that takes no abbreviations."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", _DefaultsHelp)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:
        raise UsageError(f"{message} (see `{self.prog} --help`)")


class _DefaultsHelp(argparse.HelpFormatter):
    """Appends `(default: X)` to a help text when the option has a real default that the text does not name."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or default in (None, False, [], argparse.SUPPRESS) or not action.option_strings:
            return text
        shown = " ".join(map(str, default)) if isinstance(default, list) else default
        return f"{text} (default: {shown})"


class _NoConfig(argparse.Action):
    """`swarm join --config`: refused, saying why (the run's config comes from its manifest)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        raise UsageError("swarm join takes no --config: the run's config comes from its manifest in the DHT "
                         "(`swarm config show` prints a config file's)")


class _Renamed(argparse.Action):
    """An option that was renamed: refused, naming the new one (its old meaning differed from the same flag's on
    other commands)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        raise UsageError(f"swarm {parser.prog.split()[-1]} {option_string} is now {self.const}: {option_string} is a "
                         f"peer's TCP port on the other commands")


class _Addresses(argparse.Action):
    """`--initial-peers MADDR ...`: takes multiaddrs (they start with `/`) and hands anything else that followed
    them back as config overrides, so `--initial-peers A inner.lr=3e-4` does not read the override as an address."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        values = list(values)
        cut = next((i for i, v in enumerate(values) if not v.startswith("/")), len(values))
        if cut == 0:
            raise UsageError(f"{option_string}: {values[0]!r} is not a multiaddr (they look like "
                             f"/ip4/1.2.3.4/tcp/31337/p2p/12D3Koo...)")
        setattr(namespace, self.dest, values[:cut])
        namespace.spilled = [*getattr(namespace, "spilled", []), *values[cut:]]


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    logs = common.add_argument_group("logging")
    logs.add_argument("--log-level", type=str.lower, default="info", metavar="LEVEL",
                      help=f"what goes to stderr and the run folder's log.txt: {', '.join(LOG_LEVELS)}")
    logs.add_argument("-v", "--verbose", action="store_true", help="same as --log-level debug")
    logs.add_argument("-q", "--quiet", action="store_true", help="same as --log-level warning")
    return common


def _network(p: argparse.ArgumentParser, *, peers_required: bool, client: bool = True) -> None:
    net = p.add_argument_group("network")
    net.add_argument("--initial-peers", nargs="+", action=_Addresses, required=peers_required, default=None,
                     metavar="MADDR", help="multiaddrs of peers already in the swarm (swarm.initial_peers)"
                     + ("" if peers_required else "; none: start a new swarm"))
    net.add_argument("--port", type=int, default=None, metavar="PORT",
                     help="TCP port to listen on, on every interface: the one to open in a firewall (default: any "
                          "free port, printed at start; a --swarm.host_maddrs override wins)")
    net.add_argument("--announce-ip", default=None, metavar="IP",
                     help="the public IP others dial this peer at, e.g. a cloud VM's (default: the addresses it "
                          "listens on; a warning if all are private)")
    if client:
        net.add_argument("--client-mode", action="store_true",
                         help="this peer cannot be dialed (behind a NAT): it averages but owns no part and serves "
                              "no state (swarm.client_mode)")


def _peer_options(p: argparse.ArgumentParser, mode: str) -> None:
    p.add_argument("--name", default=None, help="peer name, which seeds its batch order and finds its data shard's "
                                                "lease again after a restart (default: the hostname and the end of "
                                                "its key's peer id, kept in the peer folder)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="peer folder: log.txt, metrics.csv, checkpoint/, summary.json; the same command again "
                        "resumes from its checkpoint (default: runs/<run id>/<name>"
                        f"{', runs/<run id>/solo with --solo' if mode == 'peer' else ''})")
    p.add_argument("--fresh", action="store_true", help="delete the peer folder's checkpoints and start over")
    p.add_argument("--nproc-per-node", type=int, default=1, metavar="K",
                   help="train this peer with K processes (one per GPU; inner.parallel: DDP or FSDP), forked by "
                        "this command as torchrun would start them")
    p.add_argument("--dry-run", action="store_true",
                   help="check the config, data, identity and addresses, print the run's fingerprint, and exit")


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog="swarm", description="DiLoCo training across peers on hivemind. Config overrides follow "
                  "a command's options as dotted keys: --inner.lr 3e-4 or inner.lr=3e-4.")
    top.add_argument("--version", action="version", version=f"swarm {version()}")
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    common = [_common()]

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, parents=common)

    peer = command("peer", "run one training peer: joins a swarm (--initial-peers), starts one, or trains --solo")
    peer.add_argument("--config", required=True, help="YAML config file, e.g. configs/tiny.yaml")
    peer.add_argument("--solo", action="store_true", help="train alone, without any network")
    _network(peer, peers_required=False)
    _peer_options(peer, "peer")

    join = command("join", "run one training peer in a run found by name: its config comes from the DHT")
    join.epilog = ("config overrides a joiner may pass (each peer's own, and where its copy of the run's corpus "
                   "lies; every other key is the run's): " + ", ".join(joinable_keys()))
    join.add_argument("run", help="the run's id (swarm.run_id); `swarm runs` lists them")
    join.add_argument("--config", action=_NoConfig, help=argparse.SUPPRESS)
    _network(join, peers_required=True)
    _peer_options(join, "join")

    runs = command("runs", "list the runs a DHT advertises: round, live peers, model size, fingerprint")
    runs.add_argument("--initial-peers", nargs="+", action=_Addresses, required=True, metavar="MADDR",
                      help="multiaddrs of peers in the swarm (swarm.initial_peers)")

    sim = command("sim", "M replicas in one process, averaged in memory")
    sim.add_argument("--config", required=True, help="YAML config file, e.g. configs/tiny.yaml")
    sim.add_argument("--replicas", type=int, default=4, metavar="M", help="replicas trained side by side")
    sim.add_argument("--out", default=None, metavar="DIR", help="run folder, one replica-<i>/ per replica; the same "
                                                                "command again resumes them from their checkpoints "
                                                                "(default: runs/<run id>-simM-<time>)")
    sim.add_argument("--fresh", action="store_true", help="delete the replicas' checkpoints and start over")
    sim.add_argument("--dry-run", action="store_true", help="check the config and data, print the memory plan, "
                                                            "then exit")

    local = command("local", "a local multi-peer swarm on 127.0.0.1: bootstrap, N peers, a monitor, a summary")
    local.add_argument("--config", required=True, help="YAML config file, e.g. configs/tiny.yaml")
    local.add_argument("--peers", type=int, default=4, metavar="N", help="training peers")
    local.add_argument("--rounds", type=int, default=None, help="rounds to train (default: diloco.rounds)")
    local.add_argument("--out", default=None, metavar="DIR",
                       help="run folder, with one peer-<i>/ folder per peer; the same command again resumes every "
                            "peer from its checkpoint (default: runs/<run id>)")
    local.add_argument("--fresh", action="store_true", help="delete the peers' checkpoints and start over")
    local.add_argument("--kill", action="append", default=[], metavar="PEER@ROUND[:allreduce]",
                       help="SIGKILL peer PEER in round ROUND (inside the all-reduce with :allreduce); repeatable")
    local.add_argument("--join", action="append", default=[], type=int, metavar="ROUND",
                       help="start an extra peer when the swarm reaches round ROUND; repeatable")
    local.add_argument("--nproc-per-node", default="1", metavar="K[,K...]",
                       help="processes per peer: K for every peer, or one entry per peer (then those of --join, in "
                            "order), K or K:ddp or K:fsdp (that peer's inner.parallel), e.g. 1,2:fsdp,2:ddp")
    local.add_argument("--hostile", action="append", default=[], metavar="KIND@PEER",
                       help="peer PEER attacks the swarm (forge-progress, nan, huge, weight, bad-part, garbage-meta, "
                            "poison-state, poison-momentum, flood, ...: swarm/config.py ATTACKS); repeatable")
    local.add_argument("--monitor-port", type=int, default=None, metavar="PORT",
                       help="port of the swarm's monitor page (default: 8470, or any free port if it is taken)")
    local.add_argument("--no-monitor", action="store_true", help="start no monitor")
    local.add_argument("--dry-run", action="store_true", help="check the config and data, then exit")

    boot = command("bootstrap", "a DHT-only peer that others use as --initial-peers; prints its multiaddrs")
    _network(boot, peers_required=False, client=False)
    boot.add_argument("--config", default=None, help="YAML config file, for its swarm.* keys (optional)")
    boot.add_argument("--out", default="runs/bootstrap", metavar="DIR", help="where its log.txt goes (default: "
                                                                            "runs/bootstrap)")

    mon = command("monitor", "serve a run's live state: web page, JSON and Prometheus metrics")
    mon.add_argument("--initial-peers", nargs="+", action=_Addresses, required=True, metavar="MADDR",
                     help="multiaddrs of peers in the swarm (swarm.initial_peers)")
    mon.add_argument("--run", required=True, help="the run's id (swarm.run_id)")
    mon.add_argument("--http-port", type=int, default=8470, metavar="PORT", help="HTTP port of the page (default: "
                                                                               "8470)")
    mon.add_argument("--port", action=_Renamed, const="--http-port", help=argparse.SUPPRESS)
    mon.add_argument("--host", default="127.0.0.1", help="HTTP address to listen on (0.0.0.0: every interface)")
    mon.add_argument("--config", default=None, help="the run's YAML config, for its swarm timings (optional)")
    mon.add_argument("--history", default=None, metavar="FILE",
                     help="where the monitor keeps what it saw (eval loss per round, events) across restarts, "
                          "its log.txt beside it (default: runs/monitor-<run>/history.json)")

    data = command("data", "corpora: `swarm data prepare` tokenizes one once, for every peer on this machine")
    data_sub = data.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND", parser_class=_Parser)
    what = ("tokenize the corpus of a config into token files where a peer with the same data.* settings looks; "
            "verify it if done")
    prepare = data_sub.add_parser("prepare", parents=common, help=what, description=what)
    prepare.add_argument("--config", default=None, help="YAML config file (default: every key at its default); "
                                                         "--data.* overrides follow")

    config = command("config", "configs: `swarm config show` prints a resolved config and its fingerprint")
    config_sub = config.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND",
                                       parser_class=_Parser)
    what = "print the resolved config (overrides applied), which keys are each peer's own, and the run's fingerprint"
    show = config_sub.add_parser("show", parents=common, help=what, description=what)
    show.add_argument("--config", default=None, help="YAML config file (default: every key at its default)")

    export = command("export", "write a peer's (or the swarm's) committed model as a Hugging Face model folder")
    export.add_argument("source", nargs="?", default=None,
                        help="a peer's folder (runs/<run>/peer-0), its checkpoint folder or one round-* of it")
    export.add_argument("--from-swarm", default=None, metavar="RUN",
                        help="instead: download the current committed state of run RUN (with --initial-peers)")
    export.add_argument("--initial-peers", nargs="+", action=_Addresses, default=None, metavar="MADDR",
                        help="with --from-swarm: multiaddrs of peers in the swarm (swarm.initial_peers)")
    export.add_argument("--hf-out", required=True, metavar="DIR", help="the Hugging Face folder to write")
    export.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="the weights' dtype")
    export.add_argument("--force", action="store_true", help="replace --hf-out if it exists and is not empty")
    export.add_argument("--config", default=None, help="the run's YAML config (only for checkpoints without one)")
    return top


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The command's options and the rest (config overrides), with what a list option handed back first."""
    args, rest = parser().parse_known_args(argv)
    command = " ".join(c for c in (args.command, getattr(args, "data_command", None),
                                   getattr(args, "config_command", None)) if c)
    for arg in rest:
        if arg.startswith("-") and not arg[1:2].isdigit() and "." not in arg.partition("=")[0]:
            raise UsageError(f"swarm {command}: unknown option {arg!r} (see `swarm {command} --help`)")
    return args, [*getattr(args, "spilled", []), *rest]


def log_level(args: argparse.Namespace) -> str:
    """The level `--log-level`, `-v` and `-q` ask for; UsageError naming an unknown one."""
    level: Optional[str] = "debug" if args.verbose else "warning" if args.quiet else args.log_level
    if args.verbose and args.quiet:
        raise UsageError("-v and -q ask for opposite log levels: give one")
    if level not in LOG_LEVELS:
        raise UsageError(f"--log-level {args.log_level!r}: not one of {', '.join(LOG_LEVELS)}")
    return level
