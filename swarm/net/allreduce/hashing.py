"""The one hash of the all-reduce's bytes: BLAKE3, cut to 16-byte digests.

Every byte of an outer step is hashed at least twice (an owner's results, and each member's copy of them for the
agreement: agree.py; each contribution chunk for the audit: audit.py), so the hash is on the exchange's
critical path: BLAKE3 is several times faster than BLAKE2b per core (the measurements: bench/results/README.md,
section 12).
"""

from __future__ import annotations

import blake3

DIGEST = 16  # bytes of a chunk's or a part's digest


def digest(data: bytes | bytearray | memoryview, size: int = DIGEST) -> bytes:
    return blake3.blake3(data).digest(size)


class Running:
    """A digest of bytes that arrive in pieces (a part's results, chunk by chunk)."""

    def __init__(self) -> None:
        self._hash = blake3.blake3()

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._hash.update(data)

    def digest(self) -> bytes:
        return self._hash.digest(DIGEST)
