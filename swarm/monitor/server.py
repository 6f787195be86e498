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
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import signal
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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

    def __init__(self, cfg: SwarmConfig, server: ThreadingHTTPServer, dht: hivemind.DHT, host: str):
        self.cfg, self.server, self.dht = cfg, server, dht
        self.port = server.server_address[1]
        self.url = f"http://{host}:{self.port}/"
        self.view = SwarmView(cfg.run_id, live_window(cfg))
        self.error: Optional[BaseException] = None  # what stopped the polling thread, for the caller to raise
        self._stop = threading.Event()
        server.RequestHandlerClass = _handler(self)
        self._serving = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.5},
                                         name="monitor-http", daemon=True)
        self._polling = threading.Thread(target=self._poll, name="monitor-dht", daemon=True)
        self._serving.start()
        self._polling.start()

    @classmethod
    def start(cls, cfg: SwarmConfig, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> Monitor:
        from swarm.net.dht import check_addresses, start_dht

        cfg = dataclasses.replace(cfg, client_mode=True)
        check_addresses(cfg)
        if not 0 <= port <= 65535:
            raise UsageError(f"monitor port {port}: not a TCP port (0-65535)")
        server = _bind(host, port)
        try:
            dht = start_dht(cfg)
        except BaseException:
            server.server_close()
            raise
        return cls(cfg, server, dht, host)

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
            self._stop.wait(interval)

    def close(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
        self._serving.join(HTTP_TIMEOUT)
        self._polling.join(live_window(self.cfg) + MIN_POLL_S)
        self.dht.shutdown()


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


def run_monitor(cfg: SwarmConfig, host: str, port: int) -> int:
    """`swarm monitor`: print the URL, serve until SIGINT/SIGTERM; SwarmError if the DHT client fails."""
    monitor = Monitor.start(cfg, host, port)
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
