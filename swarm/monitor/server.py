"""`swarm monitor`: a read-only DHT client that serves the run's state over HTTP.

`Monitor.start` binds the HTTP port first (a port in use fails in milliseconds, before any process
starts), then starts a hivemind DHT in client mode (it dials out, accepts nothing, stores nothing of
its own), then two threads: one reads the run's records every `max(1 s, swarm.progress_interval)` into
a `SwarmView`, one serves

- `/`            the page (swarm/monitor/page.py), which polls
- `/api/swarm`   the view as JSON (swarm/monitor/render.py), and
- `/metrics`     the view in Prometheus text format.

Every wait ends: a DHT read is given up after `live_window` (a reading older than that cannot tell a live
peer from a gone one; counted as timed out and the view kept as it was), an HTTP client that sends nothing
for HTTP_TIMEOUT is dropped.

With a history file (`swarm monitor --history FILE`, default runs/monitor-<run>/history.json) the view's
history (eval loss per round, events) is written every SAVE_EVERY_S and at close, and read back at start.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional

import hivemind
from hivemind.utils.timed_storage import get_dht_time
from prometheus_client import CONTENT_TYPE_LATEST

from swarm.config import SwarmConfig, live_window
from swarm.errors import SwarmError, UsageError
from swarm.monitor.collect import SwarmView, read_swarm
from swarm.monitor.page import PAGE
from swarm.monitor.render import snapshot, to_json, to_metrics

logger = logging.getLogger(__name__)

DEFAULT_PORT = 8470
HTTP_TIMEOUT = 10.0  # seconds a client may stay silent on a connection (each holds one server thread)
MIN_POLL_S = 1.0  # records change once per progress_interval; reading faster only loads the DHT
SAVE_EVERY_S = 10.0  # seconds between two writes of the history file (and one at close)


class PortInUse(SwarmError):
    pass


def _handler(monitor: Monitor) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = HTTP_TIMEOUT

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path in ("/", "/index.html"):
                body, kind = PAGE.encode(), "text/html; charset=utf-8"
            elif path == "/api/swarm":
                body, kind = to_json(snapshot(monitor.view, get_dht_time())), "application/json"
            elif path == "/metrics":
                body, kind = to_metrics(snapshot(monitor.view, get_dht_time())), CONTENT_TYPE_LATEST
            else:
                self.send_error(404, "not found: try /, /api/swarm or /metrics")
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:
            logger.debug("%s %s", self.address_string(), format % args)

    return Handler


class Monitor:
    """A running monitor; `close()` stops its threads and its DHT."""

    def __init__(self, cfg: SwarmConfig, server: ThreadingHTTPServer, dht: hivemind.DHT, host: str,
                 history: Optional[Path] = None):
        self.cfg, self.server, self.dht, self.history = cfg, server, dht, history
        self.port = server.server_address[1]
        self.url = f"http://{host}:{self.port}/"
        self.view = SwarmView(cfg.run_id, live_window(cfg))
        if history is not None:
            load_history(self.view, history)
        self.saved = time.monotonic()
        self.error: Optional[BaseException] = None  # what stopped the polling thread, for the caller to raise
        self._stop = threading.Event()
        server.RequestHandlerClass = _handler(self)
        self._serving = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.5},
                                         name="monitor-http", daemon=True)
        self._polling = threading.Thread(target=self._poll, name="monitor-dht", daemon=True)
        self._serving.start()
        self._polling.start()

    @classmethod
    def start(cls, cfg: SwarmConfig, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
              history: Optional[Path] = None) -> Monitor:
        """`history`: the file the monitor keeps what it saw in across restarts (None: memory only)."""
        from swarm.net.dht import check_addresses, start_dht

        cfg = dataclasses.replace(cfg, client_mode=True)
        check_addresses(cfg)
        if not 0 <= port <= 65535:
            raise UsageError(f"monitor port {port}: not a TCP port (0-65535)")
        if history is not None:
            _check_writable(history)
        server = _bind(host, port)
        try:
            dht = start_dht(cfg)
        except BaseException:
            server.server_close()
            raise
        return cls(cfg, server, dht, host, history)

    def _poll(self) -> None:
        timeout, interval = live_window(self.cfg), max(MIN_POLL_S, self.cfg.progress_interval)
        while not self._stop.is_set():
            if not self.dht.is_alive():
                self.error = SwarmError("the monitor's DHT process died")
                return
            try:
                reading = read_swarm(self.dht, self.cfg.run_id, timeout)
            except TimeoutError:
                self.view.read_failed()
                logger.warning(f"a DHT read took over {timeout:g} s (the live window); keeping the last view")
            except Exception as e:  # not a time-out: the caller raises it (run_monitor) or reports it
                self.error = e
                return
            else:
                self.view.update(reading, get_dht_time())
            if self.history is not None and time.monotonic() - self.saved >= SAVE_EVERY_S:
                self.save()
            self._stop.wait(interval)

    def save(self) -> None:
        """Write the history file (atomically: a monitor killed mid-write leaves the previous one)."""
        if self.history is None:
            return
        self.saved = time.monotonic()
        tmp = self.history.with_name(self.history.name + ".tmp")
        try:
            tmp.write_text(json.dumps(self.view.history()))
            os.replace(tmp, self.history)
        except OSError as e:  # the disk filled up meanwhile: the page goes on, from memory
            logger.warning(f"cannot write the monitor's history {self.history}: {e.strerror or e}")

    def close(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
        self._serving.join(HTTP_TIMEOUT)
        self._polling.join(live_window(self.cfg) + MIN_POLL_S)
        self.dht.shutdown()
        self.save()


def load_history(view: SwarmView, path: Path) -> None:
    """Take back what a previous monitor of the run saw; a file that does not fit is set aside (renamed
    `.bad`, with a warning) and the monitor starts from nothing."""
    if not path.exists():
        return
    try:
        view.restore(json.loads(path.read_text()))
        logger.info(f"monitor history from {path}: {len(view.evals)} rounds of eval loss, {len(view.events)} events")
    except (OSError, ValueError) as e:
        aside = path.with_name(path.name + ".bad")
        os.replace(path, aside)
        logger.warning(f"the monitor's history {path} is unreadable ({e}); set aside as {aside}, starting afresh")


def _check_writable(path: Path) -> None:
    probe = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"--history {path}: cannot write it ({e.strerror or e})") from None


def _bind(host: str, port: int) -> ThreadingHTTPServer:
    """The HTTP server on host:port (its handler is set once the monitor exists); one-line errors naming the
    port or host."""
    try:
        server = ThreadingHTTPServer((host, port), BaseHTTPRequestHandler)
    except socket.gaierror as e:
        raise UsageError(f"monitor host {host!r}: {e.strerror}") from None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise PortInUse(f"the monitor cannot listen on port {port}: address already in use") from None
        raise SwarmError(f"the monitor cannot listen on {host}:{port}: {e.strerror or e}") from None
    server.daemon_threads = True  # a client still connected never holds up close()
    return server


def check_port(host: str, port: int) -> None:
    """Fail now, with `_bind`'s one-line errors, if the monitor could not listen on host:port (e.g. before a
    launcher starts any process that a taken port would leave without a monitor)."""
    _bind(host, port).server_close()


def run_monitor(cfg: SwarmConfig, host: str, port: int, history: Optional[Path] = None) -> int:
    """`swarm monitor`: print the URL, serve until SIGINT/SIGTERM; SwarmError if the DHT client fails."""
    monitor = Monitor.start(cfg, host, port, history)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"monitor of run {cfg.run_id!r} at {monitor.url} (JSON: {monitor.url}api/swarm, "
              f"Prometheus: {monitor.url}metrics)")
        sys.stdout.flush()
        while not stop.wait(1.0):
            if monitor.error is not None:
                raise SwarmError(f"the monitor stopped reading the DHT: {monitor.error}") from monitor.error
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        monitor.close()
    return 0
