"""One result per part: before a member commits, every member is known to hold the same bytes of every part.

An owner could send different averages of its part to different members (a lying owner): each would hold a
well-formed average, and they would commit different models. So, with every member's public key known (its
signed matchmaking meta):

1. After the last RESULT of its part to member i, owner j sends DIGEST: a BLAKE3 digest (hashing.py) of exactly
   the bytes it sent i, and its signature over (group id, j, digest). Member i checks it against the bytes it
   received: a digest or signature that does not match is the owner's own doing (PROOF).
2. A member holding the whole average sends DONE to every owner with the n signed digests it holds (n hashes,
   not n vectors: ~400 bytes each).
3. Owner j compares every member's digests with its own: two digests of one part, both signed by its owner,
   prove that owner sent two results (PROOF, anyone can check the signatures); an entry whose signature does
   not verify is its sender's. Once every member's digests are in and agree, j answers DONE (agreed).
4. A member returns (and its caller commits) only once every other owner agreed and it agreed itself as an
   owner: one honest owner that sees two results of a part is enough to stop every member it serves.

What `swarm.verify_parts` still adds (audit.py): this catches an owner that gives members different bytes,
not one that gives all of them the same wrong average; the audit recomputes a chunk to catch that. Costs
here: one signature per owner and distinct digest (one for an honest owner), n-1 verifications per member and
n^2 per owner, n x ~400 bytes per DONE, and one round trip more before returning, after the slowest member.
Not covered: a part repaired from a groupmate (repair.py) has no owner's digest and is not compared.
"""

from __future__ import annotations

import logging
import struct
from typing import Optional

from hivemind.utils.crypto import RSAPublicKey
from hivemind.utils.serializer import MSGPackSerializer

from swarm.net.allreduce.groupstate import PROOF, AllReduceFailed, GroupState
from swarm.net.identity import Identity
from swarm.net.wire import Channel, Kind

logger = logging.getLogger("swarm.net.allreduce")  # one log for the whole all-reduce

DOMAIN = b"swarm part digest v2\0"  # v2: BLAKE3 digests (hashing.py)
ENTRY_BYTES = 1024  # room for one (part, digest, signature) in a DONE; an RSA-4096 signature is 512 bytes


def signed_bytes(group_id: bytes, part: int, digest: bytes) -> bytes:
    return DOMAIN + group_id + struct.pack("<I", part) + digest


def signature_verifies(key: Optional[bytes], message: bytes, sig: object) -> bool:
    """Whether `sig` is the signature of `message` by the RSA public key `key` (False for anything malformed)."""
    if not (isinstance(key, bytes) and isinstance(sig, bytes)):
        return False
    try:
        return RSAPublicKey.from_bytes(key).verify(message, sig)
    except (ValueError, TypeError):
        return False


def verifies(key: Optional[bytes], group_id: bytes, part: int, digest: object, sig: object) -> bool:
    return isinstance(digest, bytes) and signature_verifies(key, signed_bytes(group_id, part, digest), sig)


def digest_frame(digest: bytes, sig: bytes) -> bytes:
    return MSGPackSerializer.dumps({"digest": digest, "sig": sig})


def parse_digest(payload: bytes | bytearray) -> tuple[object, object]:
    try:
        value = MSGPackSerializer.loads(bytes(payload))
        return value.get("digest"), value.get("sig")
    except Exception:  # msgpack raises several unrelated types on garbage; a non-dict has no .get
        return None, None


def done_frame(group: GroupState) -> bytes:
    """Our DONE: every part's digest we hold, signed by its owner."""
    return MSGPackSerializer.dumps([[j, d, s] for j, (d, s) in sorted(group.signed.items())])


def done_bytes(group: GroupState) -> int:
    return 64 + len(group.members) * ENTRY_BYTES


async def take_done(group: GroupState, i: int, payload: bytes | bytearray) -> None:
    """Member i's DONE: its digests, checked; AllReduceFailed (PROOF) naming the member or the owner to blame."""
    member = group.members[i]
    try:
        entries = MSGPackSerializer.loads(bytes(payload))
        entries = [(int(j), d, s) for j, d, s in entries]
    except Exception:  # unreadable, or not a list of triples
        raise AllReduceFailed(f"{member} sent an unreadable DONE", member, PROOF) from None
    for j, d, s in entries:
        if not (0 <= j < len(group.members) and verifies(group.keys[j], group.group_id, j, d, s)):
            raise AllReduceFailed(f"{member} sent a digest of part {j} its owner did not sign", member, PROOF)
    group.vectors[i] = {j: d for j, d, _ in entries}
    await group.notify()


def disagreement(group: GroupState) -> Optional[AllReduceFailed]:
    """Two digests of one part, each signed by its owner, among the members' DONEs and ours: that owner sent two
    results (PROOF). None if all agree."""
    seen = {j: d for j, (d, _) in group.signed.items()}
    for i, vector in sorted(group.vectors.items()):
        for j, d in sorted(vector.items()):
            if seen.setdefault(j, d) != d:
                return AllReduceFailed(f"part {j}: its owner {group.members[j]} sent {group.members[i]} other bytes "
                                       f"than it sent others (two digests, both signed by it)", group.members[j],
                                       PROOF)
    return None


def wire_bytes(group_size: int) -> int:
    """The most one member sends, and receives, for the agreement: a DIGEST to (from) every other member, a DONE
    of n digests from (to) every other member, an answer to (from) each, and with audits its signature over what
    it pushed each owner (evidence.py), with frame headers."""
    return (group_size - 1) * (4 * 5 + 2 * ENTRY_BYTES + 64 + group_size * ENTRY_BYTES)


def sign(identity: Identity, group: GroupState, digest: bytes) -> bytes:
    """Our signature of a digest of our part; one per distinct digest (an honest owner has one)."""
    if digest not in group.signatures:
        group.signatures[digest] = identity.private_key.sign(signed_bytes(group.group_id, group.me, digest))
    return group.signatures[digest]


async def answer(group: GroupState, channel: Channel) -> None:
    """Answer a member's DONE with ours once every member's digests are in and alike, or FAIL naming the owner."""
    try:
        await group.wait_for(lambda: everyone_done(group), None, "agreement")
        if (e := disagreement(group)) is not None:
            logger.warning(f"all-reduce: {e}")
            await group.fail(str(e), e.culprit)
            raise e
        await channel.send(Kind.DONE)
    except AllReduceFailed as e:
        await channel.fail(str(e), e.culprit)


def ready(group: GroupState) -> bool:
    """Whether we hold every part and every owner's signed digest of it (those repaired have none)."""
    return group.complete() and all(j in group.signed or j in group.repaired for j in group.layout.owners)


def everyone_done(group: GroupState) -> bool:
    """Whether every member that pushes to us sent its DONE or left (and we are ready to compare)."""
    return ready(group) and all(i in group.vectors or i in group.gone
                                for i in range(len(group.members)) if i != group.me)
