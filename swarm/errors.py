"""Errors that end a command with a one-line message and a non-zero exit status.

`UsageError` (exit 2): the user gave something unreadable (a config key, a multiaddr, a path).
`SwarmError` (exit 1): the input was well-formed but the world refused it (peers unreachable, port in use,
a corrupt checkpoint, state that fails its checks).
"""

import signal
from typing import Callable

from swarm.config import ConfigError


class UsageError(ConfigError):
    exit_code = 2


class SwarmError(RuntimeError):
    exit_code = 1


class Stopped(KeyboardInterrupt):
    """A signal asked this process to stop (SIGTERM): it stops like on Ctrl-C (the committed round's checkpoint
    is finished, the summary written) and exits 128 + the signal's number, 143 for SIGTERM."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def exit_code(error: BaseException) -> int:
    if isinstance(error, ConfigError):
        return 2
    return getattr(error, "exit_code", 1)


def stop_on(*signals: int) -> Callable[[], None]:
    """From now on `signals` stop this process like Ctrl-C (`Stopped`, raised in the main thread), so that it
    shuts down cleanly; returns what puts the previous handlers back."""
    def stop(signum, frame):
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, stop) for sig in signals}

    def restore() -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return restore
