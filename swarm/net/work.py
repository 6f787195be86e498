"""Proof of work on a peer's key (`swarm.identity_work: BITS`): what makes an identity cost something.

A peer id is free (a fresh RSA key), so any vote counted per peer id (the run's fingerprint, manifest
copies, the hash of an outer step in progress and commit records, a seat in a group) can be outnumbered by one
machine minting identities. With `identity_work` B > 0 a peer id counts only with a nonce such that
sha256(public key || nonce as 8 bytes, big-endian) starts with B zero bits, where the public key is the one
in the owner marker of its records (`[owner:ssh-rsa ...]`, identity.py). A peer finds its nonce once per
key (2^B hashes expected), keeps it next to its key file (`<swarm.identity>.work`, JSON) and puts it in
every record it signs (the records' `work` field); a reader checks it with one hash (`proves`).

The ceiling: MAX_IDENTITY_WORK is the most bits whose expected search takes at most a minute on one core
of the development machine: the search (`search`, Python's hashlib) does 3.4-3.5 M hashes per CPU second
there (`python -m swarm.net.work`, 3 runs; a minute is 2^27.6 hashes), so 2^27 = 134 M hashes take ~39 s and
2^28 would take ~79 s. A config asking for more exits 2 naming swarm.identity_work. On a shared machine the
wall time is what the core is shared by: with 14 processes on its 2 cores it ran at 0.3 M hashes/s.

What it buys: an identity costs 2^B hashes, so k votes cost k x 2^B. It does not make an attacker with
more compute than the honest peers together a minority (a GPU hashes sha256 thousands of times faster than
this search), and it does nothing against a peer that did the work and then lies: the bounded-influence
rules and the audits still have to hold for every member.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
from typing import Optional

from swarm.config import MAX_IDENTITY_WORK

logger = logging.getLogger(__name__)

RATE = 3.4e6  # hashes per second of one free core here (the ceiling above)
NONCE_BYTES = 8


def leading_zero_bits(digest: bytes) -> int:
    value = int.from_bytes(digest, "big")
    return len(digest) * 8 - value.bit_length()


@functools.lru_cache(maxsize=8192)
def proves(public_key: bytes, nonce: int, bits: int) -> bool:
    """Whether `nonce` is a proof of `bits` of work on `public_key` (bits <= 0: always)."""
    if bits <= 0:
        return True
    if not 0 <= nonce < 2 ** (8 * NONCE_BYTES):
        return False
    digest = hashlib.sha256(public_key + nonce.to_bytes(NONCE_BYTES, "big")).digest()
    return leading_zero_bits(digest) >= bits


def search(public_key: bytes, bits: int, start: int = 0, budget_s: Optional[float] = None) -> Optional[int]:
    """The first nonce >= `start` that proves `bits` of work on `public_key` (None: not found in `budget_s`)."""
    prefix = hashlib.sha256(public_key)
    deadline = None if budget_s is None else time.monotonic() + budget_s
    whole, rest = divmod(min(bits, 256), 8)  # zero bytes, then a byte below 2^(8 - rest): no int per hash
    zeros, below = bytes(whole), 1 << (8 - rest)
    batch = start
    while True:
        for nonce in range(batch, batch + 4096):
            h = prefix.copy()
            h.update(nonce.to_bytes(NONCE_BYTES, "big"))
            digest = h.digest()
            if digest[:whole] == zeros and (rest == 0 or digest[whole] < below):
                return nonce
        batch += 4096
        if deadline is not None and time.monotonic() > deadline:
            return None


def public_key(owner: bytes) -> bytes:
    """The key inside an owner marker `[owner:<key>]` (what the work is done on)."""
    return owner[len(b"[owner:"):-1] if owner.startswith(b"[owner:") and owner.endswith(b"]") else owner


def nonce_for(owner: bytes, bits: int, key_path: Optional[str]) -> int:
    """This peer's nonce for `bits` of work on its key: read from `<key_path>.work` if it proves enough, else
    searched (logged, with its time) and written there. bits <= 0: 0, nothing searched."""
    if bits <= 0:
        return 0
    key = public_key(owner)
    path = f"{key_path}.work" if key_path else None
    if path is not None and os.path.exists(path):
        try:
            with open(path) as f:
                nonce = json.load(f)["nonce"]
            if isinstance(nonce, int) and proves(key, nonce, bits):
                return nonce
        except (OSError, ValueError, KeyError, TypeError):
            logger.warning(f"{path}: unreadable proof of work; searching again")
    start = time.monotonic()
    logger.info(f"searching a proof of work of {bits} bits for this peer's key (swarm.identity_work; "
                f"~{2 ** bits / RATE:.0f} s expected on a free core)")
    nonce = search(key, bits)
    logger.info(f"proof of work of {bits} bits found in {time.monotonic() - start:.1f} s (nonce {nonce})")
    if path is not None:
        try:
            with open(path, "w") as f:
                json.dump({"bits": bits, "nonce": nonce}, f)
        except OSError as e:
            logger.warning(f"{path}: cannot keep the proof of work ({e.strerror}); it is searched at every start")
    return nonce


def measure(seconds: float = 3.0) -> float:
    """Hashes per CPU second of `search` on this machine, i.e. what one core does while nothing else runs on it
    (for the ceiling above; CPU time, so that other work sharing the cores does not lower it)."""
    key, start, tried = os.urandom(400), time.process_time(), 0
    while time.process_time() - start < seconds:
        search(key, 256, start=tried, budget_s=0.0)  # 256 bits: never found, one batch of 4096
        tried += 4096
    return tried / (time.process_time() - start)


if __name__ == "__main__":
    import math

    rate = measure()
    print(f"{rate / 1e6:.2f} M hashes/s: a minute is 2^{math.log2(rate * 60):.1f} hashes "
          f"(MAX_IDENTITY_WORK = {MAX_IDENTITY_WORK})")
