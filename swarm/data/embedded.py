"""The embedded corpus: a pinned snapshot of CPython 3.11.7's standard library source, shipped in the package.

`make swarm`, `swarm local` and every config with `data.source: embedded` train on it with nothing to download.
It is the same bytes on every machine and under every Python: it used to be read from the running interpreter's
own library, so a peer on another Python prepared another corpus and was refused as another run.

The snapshot is the `*.py` files of `Lib/` (test suites, idlelib, turtledemo, lib2to3 and ensurepip left out),
one document per file, keyed by its path and sorted by it: 576 documents, 11.4 MB of text, kept as xz-compressed
JSON lines ([path, text] per line) in swarm/data/corpus/, under the PSF license (swarm/data/corpus/LICENSE-PSF.txt).
`SHA256` pins the decompressed bytes; the README quotes it. A copy that differs (an altered or truncated install)
is refused with both hashes rather than silently training another run.
"""

from __future__ import annotations

import hashlib
import json
import lzma
from collections.abc import Iterator
from pathlib import Path

from swarm.errors import SwarmError

ARCHIVE = Path(__file__).parent / "corpus" / "cpython-3.11.7-stdlib.jsonl.xz"
SHA256 = "2fd6933bf66eb6d2267d7a8b6914c963e2695c2a73ee00540a014c5cd7843f85"  # of the decompressed JSON lines
TEXT_BYTES = 11_416_814  # of the decompressed JSON lines: what a prepare of it reads (its progress bar's total)


def read() -> bytes:
    """The snapshot's JSON lines, checked against `SHA256`; SwarmError naming the file if it does not read or
    differs."""
    try:
        blob = lzma.decompress(ARCHIVE.read_bytes())
    except (OSError, lzma.LZMAError) as e:
        raise SwarmError(f"the embedded corpus {ARCHIVE} does not read ({e}): reinstall swarm") from None
    if (got := hashlib.sha256(blob).hexdigest()) != SHA256:
        raise SwarmError(f"the embedded corpus {ARCHIVE} has sha256 {got[:16]}, not the pinned {SHA256[:16]}: "
                         f"reinstall swarm")
    return blob


def documents() -> Iterator[tuple[str, str]]:
    """`(path, text)` of every document of the snapshot, sorted by path."""
    for line in read().split(b"\n"):
        if line:
            key, text = json.loads(line)
            yield key, text
