"""Who lied when an audit finds a member's bytes and its owner's digest of them apart: the member's signature.

An audit (audit.py) compares what member i sends the auditor for chunk k of part j with the digest that owner j
committed of what i sent it. When they differ, either i answers the audit with other bytes than it sent, or j
committed a digest of bytes i never sent; without more, the auditor cannot tell which, and the outer step failed
with nobody to blame (a member could fail every attempt unnamed). So, with the members' keys (agree.py):

1. After its last chunk of part j, member i sends owner j `Kind.DIGEST`: a hash of the digests of its chunks as
   it sent them, and its signature over (group id, j, that hash). The owner checks both against the digests of
   what it received (a mismatch is i's own doing: PROOF) and keeps i's digests and signature (`received`).
2. On a mismatch the auditor asks owner j for i's evidence (`serve`, `settle`): i's chunk digests and signature.
   If the signature verifies and i's digest of chunk k is what j committed, i signed the bytes it then denied:
   i is the culprit. If not (or j sends nothing that verifies), j committed a digest i never signed: j is.
   An owner that gives no evidence (an honest one holds it for every member whose chunks it took) is named
   as seen (SEEN: out of our groups for this attempt, no offense, since it may only have died).

Cost: one signature per member and part it pushes (n-1 per member and outer step), one verification per member at
each owner, 16 bytes per chunk kept at the owner; nothing else moves unless an audit disagrees.
"""

from __future__ import annotations

import struct
from typing import Optional

from swarm.net.allreduce.agree import digest_frame, parse_digest, signature_verifies
from swarm.net.allreduce.groupstate import PROOF, SEEN, AllReduceFailed, GroupState
from swarm.net.allreduce.hashing import DIGEST, digest
from swarm.net.identity import Identity
from swarm.net.wire import Channel, Kind, WireError

DOMAIN = b"swarm contribution v2\0"  # v2: BLAKE3 digests (hashing.py)


def summary(digests: bytes) -> bytes:
    return digest(digests, 32)


def signed_bytes(group_id: bytes, part: int, digests: bytes) -> bytes:
    return DOMAIN + group_id + struct.pack("<I", part) + summary(digests)


def sign(identity: Identity, group: GroupState, part: int, digests: bytes) -> bytes:
    return identity.private_key.sign(signed_bytes(group.group_id, part, digests))


def verifies(key: Optional[bytes], group_id: bytes, part: int, digests: object, sig: object) -> bool:
    return isinstance(digests, bytes) and signature_verifies(key, signed_bytes(group_id, part, digests), sig)


def frame(digests: bytes, sig: bytes) -> bytes:
    """Our DIGEST after our last chunk of a part: the chunks' digests themselves travel only as evidence."""
    return digest_frame(summary(digests), sig)


def check(group: GroupState, i: int, payload: bytes | bytearray) -> None:
    """Member i's DIGEST after its chunks of our part: keep its evidence, or AllReduceFailed (PROOF) naming it."""
    digests = b"".join(group.received[i])
    claimed, sig = parse_digest(payload)
    if claimed != summary(digests) or not verifies(group.keys[i], group.group_id, group.me, digests, sig):
        raise AllReduceFailed(f"part {group.me}: {group.members[i]} signed other bytes than it sent us",
                              group.members[i], PROOF)
    group.evidence[i] = (digests, sig)


async def serve(group: GroupState, channel: Channel, i: object, stall: float) -> None:
    """An auditor asks for member i's evidence of its contribution to our part (it may reach us before i's DIGEST,
    which follows i's last chunk: we wait for it `stall` s)."""
    if not isinstance(i, int) or not 0 <= i < len(group.members) or i == group.me:
        return await channel.fail("no such member")
    if (channel.peer, i) in group.evidence_served:
        return await channel.fail("asked already")
    group.evidence_served.add((channel.peer, i))
    try:
        await group.wait_for(lambda: i in group.evidence, stall, "evidence")
    except AllReduceFailed:
        if i not in group.evidence:
            return await channel.fail(f"no evidence of {group.members[i]} here")
    digests, sig = group.evidence[i]
    await channel.send(Kind.DIGEST, digest_frame(digests, sig))


async def settle(slots, group: GroupState, i: int, j: int, k: int, committed: bytes) -> AllReduceFailed:
    """The failure to raise when member i's audit answer for chunk k of part j differs from `committed`, its owner's
    digest of it: naming i or the owner by i's signature, or nobody if the owner gives no evidence."""
    member, owner = group.members[i], group.members[j]
    try:
        channel = await Channel.open(slots.p2p, owner, f"{slots.name}_audit", slots.stall, group.traffic)
        try:
            await channel.send_control(Kind.HELLO, {"group": group.group_id, "part": j, "evidence": i})
            digests, sig = parse_digest(await channel.recv_kind(Kind.DIGEST, 4096 + DIGEST * len(group.chunks[j])))
        finally:
            channel.close()
    except WireError as e:  # an honest owner holds the evidence of every member whose chunks it took
        return AllReduceFailed(f"part {j}: owner {owner} and {member} disagree on what {member} sent for chunk {k}, "
                               f"and the owner gave no evidence ({e})", owner, SEEN)
    signed = verifies(group.keys[i], group.group_id, j, digests, sig)
    if signed and digests[k * DIGEST:(k + 1) * DIGEST] == committed:
        return AllReduceFailed(f"part {j}: {member} answered our audit of chunk {k} with other bytes than it signed",
                               member, PROOF)
    return AllReduceFailed(f"part {j}: owner {owner} committed a digest of {member}'s chunk {k} that {member} did "
                           f"not sign", owner, PROOF)

