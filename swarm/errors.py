"""Errors that end a command with a one-line message and a non-zero exit status.

`UsageError` (exit 2): the user gave something unreadable (a config key, a multiaddr, a path).
`SwarmError` (exit 1): the input was well-formed but the world refused it (peers unreachable, port in use,
a corrupt checkpoint, state that fails its checks).
"""

from swarm.config import ConfigError


class UsageError(ConfigError):
    exit_code = 2


class SwarmError(RuntimeError):
    exit_code = 1


def exit_code(error: BaseException) -> int:
    if isinstance(error, ConfigError):
        return 2
    return getattr(error, "exit_code", 1)
