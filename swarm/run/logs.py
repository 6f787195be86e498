"""Where a command's log lines go: stderr, and `log.txt` in the run folder of every command that has one.

One format (`HH:MM:SS LEVEL logger: message`) and one level for both (`--log-level`, `-v`, `-q`; the ranks of
a multi-process peer other than rank 0 log warnings and errors only, to stderr). hivemind's own log lines
are routed through the same handlers (`route_hivemind`, once hivemind is imported). The one-line error a
command ends with (`swarm: error: ...`, printed by swarm/cli.py) is added to log.txt too, so that the file
alone says how a peer ended.

A peer's log says, one line each, every change of its state: it joined a run (or started one), a group
formed to average, a round committed (with its global hash), it took the state of a peer, it left.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Iterator, Optional

from swarm.errors import UsageError

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATEFMT = "%H:%M:%S"
LOG_FILE = "log.txt"
_FILE_ONLY = "swarm_file_only"  # a record with this attribute set goes to log.txt only


class _Stderr(logging.StreamHandler):
    """A handler that writes to whatever `sys.stderr` is when it emits (a test may swap it)."""

    def __init__(self):
        super().__init__()

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass

    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, _FILE_ONLY, False) and super().filter(record)


_installed: list[logging.Handler] = []
_file: Optional[logging.FileHandler] = None
_depth = 0  # sessions open: a forked rank opens one inside its launcher's


def _rank_level(level: str) -> int:
    value = logging.getLevelName(level.upper())
    return value if os.environ.get("RANK", "0") == "0" else max(value, logging.WARNING)


@contextlib.contextmanager
def session(level: str) -> Iterator[None]:
    """Log at `level` to stderr for the duration of a command; undone afterwards (the handlers removed, the
    root level restored), so that a command called in-process leaves no handler behind."""
    global _file, _depth
    root = logging.getLogger()
    previous = root.level
    if _depth:  # a rank forked by peers/launch.py runs the command again: the handlers are there already
        _depth += 1
        root.setLevel(_rank_level(level))
        try:
            yield
        finally:
            _depth -= 1
        return
    _depth = 1
    handler = _Stderr()
    handler.setFormatter(logging.Formatter(FORMAT, DATEFMT))
    root.addHandler(handler)
    _installed.append(handler)
    root.setLevel(_rank_level(level))
    try:
        yield
    finally:
        for h in _installed:
            root.removeHandler(h)
            h.close()
        _installed.clear()
        _file, _depth = None, 0
        root.setLevel(previous)


def forget() -> None:
    """In a process forked from a command that logs (the fork server `swarm local` forks, peers/forkserver.py):
    drop the command's handlers and session, which a fresh interpreter would not have; the commands it runs
    open their own."""
    global _file, _depth
    root = logging.getLogger()
    for h in _installed:
        root.removeHandler(h)
        h.close()
    _installed.clear()
    _file, _depth = None, 0
    root.setLevel(logging.WARNING)


def to_folder(folder: Path, option: str = "--out") -> Path:
    """From now on, also append every log line to `folder`/log.txt (rank 0 only), unless stderr already goes
    there (`swarm local` points a peer's stderr at that file). UsageError naming the folder if it cannot be
    written: a peer that cannot keep its log or metrics must not train for weeks without them."""
    global _file
    path = folder / LOG_FILE
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.environ.get("RANK", "0") != "0" or _same_file(path) or _file is not None:
            return path
        handler = logging.FileHandler(path, encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot write the log file {path} ({option}): {e.strerror or e}") from None
    handler.setFormatter(logging.Formatter(FORMAT, DATEFMT))
    logging.getLogger().addHandler(handler)
    _installed.append(handler)
    _file = handler
    return path


def _same_file(path: Path) -> bool:
    try:
        return path.exists() and os.path.samestat(os.fstat(sys.stderr.fileno()), path.stat())
    except (OSError, ValueError, AttributeError):  # stderr is not a file (a test's capture)
        return False


def file_only(message: str, error: Optional[BaseException] = None) -> None:
    """Add `message` (the command's closing error line, about `error`) to log.txt without printing it again on
    stderr; once per error (a rank of a multi-process peer runs the command inside the command)."""
    if _file is not None and not getattr(error, "swarm_logged", False):
        logging.getLogger("swarm").error(message, extra={_FILE_ONLY: True})
        if error is not None:
            error.swarm_logged = True


def route_hivemind() -> None:
    """hivemind's loggers write through ours (format, level, log.txt) instead of their own stderr handler."""
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("nowhere")
