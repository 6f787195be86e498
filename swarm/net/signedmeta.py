"""Member-owned matchmaking metadata: each member signs its own meta, so that a leader cannot put words in an
honest member's mouth (issue 21, "framing").

hivemind's matchmaking has every follower send its meta to the leader, and the leader hand the whole group's
metas to every follower: a hostile leader could forge any member's meta (another outer step, another vector size,
a weight) and have the honest members leave every group, or charge each other offenses. Now:

- a member's meta carries `key` (its RSA public key, OpenSSH format: the key its peer id hashes) and `sig`
  (its signature over `DOMAIN`, the matchmaking prefix (run and fingerprint) and the meta without `sig`);
- a leader refuses a join request whose meta is not signed by the peer asking (`_GroupAverager`), so an
  honest leader never forwards a forged meta;
- a follower checks every member's meta before it uses the group (`unsigned`): one that is not signed by
  its member was forged by whoever assembled the group, the leader, which it got the group from over an
  authenticated stream; the leader is charged the offense, never the member whose meta it forged.

What a valid signature proves: that member said that, in this run, for an outer step it names, in the attempt its
fresh nonce marks. It does not bind the meta to one group (the group forms after the member signs): a leader that
a member once joined could replay that member's meta into another group. If the member is in that group, it
finds a meta of its own that is not the one it sent for this attempt and charges the leader (`matchmaking`);
its groupmates, who cannot tell a replay from a member that resent an old meta, leave a group holding a meta of
an earlier outer step charging nobody (`matchmaking.misfit`). If the member is not in it, it never shows up, which
the barrier and the all-reduce's HELLOs catch: that costs the attempt, never an offense of the member.
Cost: an RSA-2048 signature per attempt (~1 ms), a verification per member (~0.05 ms), ~700 bytes per meta.
"""

from __future__ import annotations

from typing import Any, Optional

from cryptography.exceptions import UnsupportedAlgorithm
from hivemind.utils.crypto import RSAPublicKey
from hivemind.utils.serializer import MSGPackSerializer

from swarm.net.identity import Identity, owner_key, peer_id_of_public_key

DOMAIN = b"swarm matchmaking meta v1\0"
MAX_KEY_BYTES, MAX_SIG_BYTES = 2048, 1024  # an RSA-4096 key in OpenSSH format is ~720 bytes, its signature 512


def _signed_bytes(prefix: str, meta: dict[str, Any]) -> bytes:
    body = {k: v for k, v in meta.items() if k != "sig"}
    return DOMAIN + prefix.encode() + b"\0" + MSGPackSerializer.dumps(dict(sorted(body.items())))


def sign(identity: Identity, prefix: str, meta: dict[str, Any]) -> dict[str, Any]:
    """`meta` with our public key and our signature over it."""
    meta = dict(meta, key=owner_key(identity.owner))
    return dict(meta, sig=identity.private_key.sign(_signed_bytes(prefix, meta)))


def unsigned(member: object, prefix: str, meta: Any) -> Optional[str]:
    """Why `meta` is not `member`'s own signed meta; None if it is."""
    if not isinstance(meta, dict):
        return "its meta is not a mapping"
    key, sig = meta.get("key"), meta.get("sig")
    if not (isinstance(key, bytes) and 0 < len(key) <= MAX_KEY_BYTES and isinstance(sig, bytes)
            and 0 < len(sig) <= MAX_SIG_BYTES):
        return "its meta carries no key and signature"
    if peer_id_of_public_key(key) != str(member):
        return "its meta carries another peer's key"
    try:
        valid = RSAPublicKey.from_bytes(key).verify(_signed_bytes(prefix, meta), sig)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        valid = False
    return None if valid else "its meta's signature does not verify"

