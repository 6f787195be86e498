"""Starting the DHT: validated addresses, a bounded bootstrap, no orphaned child process.

A peer's DHT is a `p2pd` daemon this process starts (swarm.net.p2pd) and hivemind's `DHT` in a forked child
that connects to it. Failures we turn into one-line errors (measured with hivemind 1.1.12):
- a malformed multiaddr, or an initial peer without `/p2p/<id>`: `UsageError` naming it, before any
  process starts;
- unreachable initial peers: p2pd exits with "failed to connect to bootstrap peers" (0.3-5 s on
  loopback); a peer that accepts TCP but never answers is bounded by `cfg.bootstrap_timeout` (p2pd
  start-up). Both raise `SwarmError("initial peers unreachable: ...")`;
- a child that reports nothing at all is killed after `_start_deadline`, well past its own bounds;
- a host port already in use: `SwarmError` naming the port.
Every failure path joins (or kills, then joins) the child and stops the daemon, so no process is left behind.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import logging
import os
import re
import signal
import sys
import threading
from typing import Optional

import hivemind
from hivemind.p2p.p2p_daemon import P2PDaemonError
from hivemind.utils.mpfuture import MPFuture
from hivemind.utils.multiaddr import Multiaddr
from hivemind.utils.timed_storage import get_dht_time

from swarm.config import SwarmConfig
from swarm.errors import SwarmError, UsageError
from swarm.net import schema
from swarm.net.identity import Identity, load_identity, with_work
from swarm.net.manifest import ManifestRefused, choose_manifest, read_manifests
from swarm.net.p2pd import Daemon, identity_taken
from swarm.net.policy import run_fingerprint
from swarm.run.runid import RunIdentity

logger = logging.getLogger(__name__)

START_GRACE = 10.0  # forking the child and importing in it; seconds on a loaded 2-core machine


_fork_scope = threading.local()
_PR_SET_PDEATHSIG = 1


def _after_fork_in_child() -> None:
    if getattr(_fork_scope, "active", False):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@contextlib.contextmanager
def children_die_with_us():
    """Processes forked inside this block get SIGKILL when the forking thread dies (Linux prctl).

    hivemind's DHT and averager are forked children that outlive a SIGKILLed (OOM-killed) trainer and
    keep answering as a ghost peer; their p2pd daemons exit once their client is gone. Fork from a
    long-lived thread (the trainer's main thread).
    """
    if sys.platform != "linux":
        yield
        return
    if not getattr(children_die_with_us, "registered", False):
        os.register_at_fork(after_in_child=_after_fork_in_child)
        children_die_with_us.registered = True
    _fork_scope.active = True
    try:
        yield
    finally:
        _fork_scope.active = False


def _parse_maddrs(key: str, values: list[str], *, need_peer_id: bool = False) -> list[str]:
    for value in values:
        try:
            maddr = Multiaddr(value)
        except Exception as e:  # multiaddr raises several unrelated types (ValueError, StringParseError, ...)
            raise UsageError(f"swarm.{key}: malformed multiaddr {value!r} ({e})") from None
        if need_peer_id and "p2p" not in [p.name for p in maddr.protocols()]:
            raise UsageError(f"swarm.{key}: {value!r} lacks the /p2p/<peer id> part")
    return list(values)


def check_addresses(cfg: SwarmConfig) -> None:
    """Raise the UsageError `start_dht` would raise for an unreadable address, before anything starts."""
    _parse_maddrs("initial_peers", cfg.initial_peers, need_peer_id=True)
    _parse_maddrs("host_maddrs", cfg.host_maddrs)
    _parse_maddrs("announce_maddrs", cfg.announce_maddrs)


def _explain(error: BaseException, cfg: SwarmConfig) -> SwarmError:
    text = str(error)
    if "address already in use" in text:
        ports = re.findall(r":(\d+): bind", text)
        where = f"port {ports[0]}" if ports else f"one of {cfg.host_maddrs}"
        return SwarmError(f"cannot listen on {where}: address already in use (swarm.host_maddrs)")
    if "bootstrap" in text or "responded to a ping" in text:
        return SwarmError(f"initial peers unreachable: {', '.join(cfg.initial_peers)} ({text.splitlines()[0]})")
    if cfg.initial_peers and "failed to start in" in text:  # p2pd waits for its bootstrap peers before it is up
        return SwarmError(f"initial peers unreachable: {', '.join(cfg.initial_peers)} (no answer within "
                          f"{cfg.bootstrap_timeout:g} s, swarm.bootstrap_timeout)")
    return SwarmError(f"cannot start the DHT: {text.splitlines()[0] if text else type(error).__name__}")


def _stop(dht: DHT) -> None:
    """Shut a DHT child down, or kill it when it is stuck in start-up and cannot read its pipe; then its daemon.

    A child killed while it reports to us holds hivemind's process-shared `MPFuture._update_lock` forever;
    every later child (the next DHT, the averager) then blocks on its first report and its start times out.
    Reset hivemind's future backend if you see that lock stuck after a kill.
    """
    try:
        _stop_child(dht)
    finally:
        dht.p2pd.close()


def _stop_child(dht: DHT) -> None:
    if not dht.is_alive():
        dht.join(5)
        return
    dht.terminate()
    dht.join(5)
    if dht.is_alive():
        dht.kill()
        dht.join(5)
    if MPFuture._update_lock.acquire(timeout=2.0):
        MPFuture._update_lock.release()
    else:
        logger.warning("the DHT child was killed while reporting to this process; "
                       "resetting hivemind's MPFuture backend")
        MPFuture.reset_backend()


def _daemon_deadline(cfg: SwarmConfig) -> float:
    """Our wait for p2pd to be up: `bootstrap_timeout` when it must reach an initial peer first (its usual field
    failure), and at least START_GRACE when it need not (a loaded machine)."""
    return cfg.bootstrap_timeout if cfg.initial_peers else max(cfg.bootstrap_timeout, START_GRACE)


def _start_deadline(cfg: SwarmConfig) -> float:
    """Our wait for the child: its own bounds (connecting to the daemon, then the bootstrap pings, each
    `bootstrap_timeout`) plus START_GRACE. The child reports its own failures well within this; killing it
    at the same moment as it reports is what breaks hivemind's future backend (see `_stop`)."""
    return 2 * cfg.bootstrap_timeout + START_GRACE


def allowed_peers(cfg: SwarmConfig) -> Optional[frozenset[str]]:
    """The peers a private swarm admits (`swarm.auth: allowlist`); None: an open swarm."""
    return frozenset(cfg.allowed_peers) if cfg.auth == "allowlist" else None


class DHT(hivemind.DHT):
    """hivemind's DHT on a p2pd this process started (swarm.net.p2pd): its child process connects to the daemon,
    and `shutdown` stops the daemon after the child. `identity`: the key it runs under (matchmaking signs this
    peer's metas with it, signedmeta.py)."""

    def __init__(self, daemon: Daemon, identity: Identity, **kwargs):
        super().__init__(p2p=daemon, **kwargs)
        self.p2pd, self.identity = daemon, identity

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self.p2pd.close()


def start_dht(cfg: SwarmConfig, identity: Optional[Identity] = None, *, fingerprint: Optional[str] = None,
              run: Optional[RunIdentity] = None) -> DHT:
    """Start a DHT peer for `cfg` as `identity` (default: `swarm.identity`); with `run` (or only its
    `fingerprint`), also sign (or check) the run's fingerprint: a refusal names the first key that differs."""
    from swarm.run.logs import route_hivemind

    route_hivemind()
    fingerprint = run.fingerprint if run is not None else fingerprint
    initial = _parse_maddrs("initial_peers", cfg.initial_peers, need_peer_id=True)
    host = _parse_maddrs("host_maddrs", cfg.host_maddrs)
    announce = _parse_maddrs("announce_maddrs", cfg.announce_maddrs)
    identity = with_work(identity or load_identity(cfg.identity), cfg.identity_work)
    allowed = allowed_peers(cfg)
    if allowed is not None and identity.peer_id.to_base58() not in allowed:
        raise UsageError(f"swarm.allowed_peers: this peer's own id {identity.peer_id} is not in the allowlist "
                         f"(swarm.identity {identity.path or '(fresh key)'})")
    with identity.key_file() as key_file:
        # hivemind checks that a key file is not in use by dialing it from a second p2pd; a key made by this process
        # (a fresh one, or a key file created just now) cannot be, as hivemind says of keys it makes
        if initial and identity.path is not None and not identity.made_now and identity_taken(key_file, initial):
            raise SwarmError(f"swarm.identity {identity.path}: a peer of this swarm already runs under this key "
                             f"({identity.peer_id}); give each peer a key of its own")
        try:
            daemon = Daemon.start(host_maddrs=host, announce_maddrs=announce, initial_peers=initial,
                                  key_file=key_file, client_mode=cfg.client_mode, timeout=_daemon_deadline(cfg))
        except P2PDaemonError as e:
            raise _explain(e, cfg) from e
    try:
        dht = DHT(daemon, identity, initial_peers=initial, start=False, client_mode=cfg.client_mode,
                  record_validators=schema.validators(cfg.run_id, identity, allowed),
                  bootstrap_timeout=cfg.bootstrap_timeout, ensure_bootstrap_success=bool(initial))
    except BaseException:
        daemon.close()
        raise
    try:
        with children_die_with_us():
            dht.run_in_background(await_ready=True, timeout=_start_deadline(cfg))
    except concurrent.futures.TimeoutError:
        _stop(dht)
        if not initial:
            raise SwarmError(f"the DHT did not start within {_start_deadline(cfg):g} s "
                             f"(2 x swarm.bootstrap_timeout + {START_GRACE:g} s)") from None
        raise SwarmError(f"initial peers unreachable: no answer from {', '.join(initial)} within "
                         f"{_start_deadline(cfg):g} s (2 x swarm.bootstrap_timeout + {START_GRACE:g} s)") from None
    except Exception as e:  # RuntimeError from DHTNode.create (no initial peer answered its ping): explained, reaped
        _stop(dht)
        raise _explain(e, cfg) from e
    if fingerprint is not None:
        try:
            check_fingerprint(dht, cfg, identity, fingerprint, run)
        except BaseException:
            dht.shutdown()
            raise
    return dht


def check_fingerprint(dht: hivemind.DHT, cfg: SwarmConfig, identity: Identity, fingerprint: str,
                      run: Optional[RunIdentity] = None) -> None:
    """Refuse to join a run whose peers signed another fingerprint (naming, with `run`, the first key that
    differs from the run's manifest); otherwise sign ours.

    Two peers racing with different fingerprints both sign; the re-read after storing makes the one
    outvoted (or, on a tie, the later) refuse. With `swarm.identity_work`, only proven identities vote. Each
    DHT call waits at most `bootstrap_timeout` (this is part of the peer's start-up).
    """
    key = schema.run_key(cfg.run_id)
    for attempt in range(2):
        try:
            found = dht.get(key, latest=True, return_future=True).result(timeout=cfg.bootstrap_timeout)
        except concurrent.futures.TimeoutError:
            raise SwarmError(f"the run's fingerprint records did not answer within {cfg.bootstrap_timeout:g} s "
                             f"(swarm.bootstrap_timeout)") from None
        stored = run_fingerprint(schema.read_owned(found, schema.RunRecord, get_dht_time(), cfg.identity_work))
        if stored is not None and stored != fingerprint:
            raise SwarmError(f"refusing to join run {cfg.run_id!r}: {_difference(dht, cfg, stored, run)} "
                             f"(fingerprint {fingerprint}, the run's peers signed {stored})")
        if attempt == 0:
            now = get_dht_time()
            record = schema.RunRecord(fingerprint=fingerprint, time=now, work=identity.work).dict()
            try:
                dht.store(key, record, subkey=identity.owner, expiration_time=now + schema.RUN_RECORD_EXPIRATION,
                          return_future=True).result(timeout=cfg.bootstrap_timeout)
            except concurrent.futures.TimeoutError:
                logger.warning(f"our fingerprint record was not confirmed within {cfg.bootstrap_timeout:g} s")


def _difference(dht: hivemind.DHT, cfg: SwarmConfig, stored: str, run: Optional[RunIdentity]) -> str:
    """What differs between this peer's run and the run's (from its manifest), or why it cannot be told."""
    unknown = "its run settings differ"
    if run is None:
        return unknown
    try:
        _, manifests = read_manifests(dht, cfg.run_id, cfg.request_timeout, cfg.identity_work)
        theirs = choose_manifest(cfg.run_id, manifests, stored).run
    except (concurrent.futures.TimeoutError, ManifestRefused) as e:
        return f"{unknown} (the run's manifest, to compare keys with, is unreadable: {e or 'no answer'})"
    return run.first_difference(theirs) or unknown


def visible_maddrs(dht: hivemind.DHT) -> list[str]:
    """Full multiaddrs others can pass as `initial_peers` (each ends with /p2p/<peer id>)."""
    peer = str(dht.peer_id)
    out = []
    for maddr in dht.get_visible_maddrs():
        text = str(maddr)
        out.append(text if "/p2p/" in text else f"{text}/p2p/{peer}")
    return out


def run_bootstrap(cfg: SwarmConfig) -> None:
    """`swarm bootstrap`: a DHT-only peer that prints its multiaddrs and serves until SIGINT/SIGTERM."""
    from swarm.net.addresses import tcp_port, unreachable_warning

    dht = start_dht(cfg)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        maddrs = visible_maddrs(dht)
        logger.info(f"bootstrap listening on TCP port {tcp_port(maddrs)}; peers join with --initial-peers "
                    f"{' '.join(maddrs)}")
        if warning := unreachable_warning(maddrs, client_mode=False, can_be_client=False):
            logger.warning(warning)
        for maddr in maddrs:
            print(maddr)
        sys.stdout.flush()
        while not stop.wait(1.0):
            if not dht.is_alive():
                raise SwarmError("the DHT process died")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        dht.shutdown()
