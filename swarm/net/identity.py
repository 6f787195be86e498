"""A peer's identity: one RSA key that is both its libp2p identity and the key that signs its DHT records.

The key file (`swarm.identity`) is libp2p's protobuf `PrivateKey`, the format `p2pd` reads; it is created
if missing (hivemind's `P2P.generate_identity`), and without `swarm.identity` a fresh key is made for the
process. The peer id is the hash of the public key (libp2p's rule), so:

- every stream is authenticated: libp2p's handshake proves the remote end holds the key of its peer id;
- every DHT record a peer writes carries its public key in the subkey (`[owner:ssh-rsa ...]`, hivemind's
  `RSASignatureValidator`) and its signature in the value: DHT nodes refuse unsigned or forged records, and
  a reader derives the writer's peer id from the owner key (`owner_peer_id`), so nobody can write a record
  in another peer's name.

RSA because hivemind's record validator signs with RSA only; a foreign key type is refused at start.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Iterator, Optional

import multihash
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey

from swarm.errors import UsageError

_OWNER = re.compile(RSASignatureValidator.PUBLIC_KEY_REGEX)


@dataclass(frozen=True)
class Identity:
    private_key: RSAPrivateKey
    peer_id: PeerID
    path: Optional[str]  # None: made for this process only
    work: int = 0  # nonce of the proof of work on this key (swarm.identity_work, work.py), in every record
    made_now: bool = False  # the key file was created by this process: no other peer can be running under it

    @property
    def owner(self) -> bytes:
        """This peer's owner marker, `[owner:<public key>]`: the subkey of every record it writes."""
        return self.validator().local_public_key

    def validator(self) -> RSASignatureValidator:
        return RSASignatureValidator(self.private_key)

    @contextlib.contextmanager
    def key_file(self) -> Iterator[str]:
        """A path p2pd can read the key from: the key file, or a private temporary copy of a fresh key."""
        if self.path is not None:
            yield self.path
            return
        with tempfile.TemporaryDirectory(prefix="swarm-identity-") as folder:
            path = os.path.join(folder, "identity.key")
            with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
                f.write(crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA,
                                              data=self.private_key.to_bytes()).SerializeToString())
            yield path


def with_work(identity: Identity, bits: int) -> Identity:
    """`identity` with a nonce that proves `bits` of work on its key (found or read back: work.nonce_for)."""
    from swarm.net.work import nonce_for, proves, public_key

    if proves(public_key(identity.owner), identity.work, bits):
        return identity
    return dataclasses.replace(identity, work=nonce_for(identity.owner, bits, identity.path))


def _rsa_key(der: bytes) -> RSAPrivateKey:
    key = RSAPrivateKey.__new__(RSAPrivateKey)
    key.__setstate__({"_private_key": der})  # hivemind's own unpickling path: DER -> cryptography key
    return key


def load_identity(path: Optional[str]) -> Identity:
    """The identity in `path` (created if missing), or a fresh one; UsageError naming the file if unusable."""
    if path is None:
        key = RSAPrivateKey()
        return Identity(key, PeerID.from_identity(crypto_pb2.PrivateKey(
            key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes()).SerializeToString()), None)
    made_now = not os.path.exists(path)
    if made_now:
        try:
            P2P.generate_identity(path)
        except (FileNotFoundError, PermissionError) as e:
            raise UsageError(f"swarm.identity: cannot create the key file {path!r} ({e})") from None
    try:
        with open(path, "rb") as f:
            data = f.read()
        protobuf = crypto_pb2.PrivateKey.FromString(data)
    except OSError as e:
        raise UsageError(f"swarm.identity: cannot read the key file {path!r} ({e.strerror})") from None
    except Exception:  # protobuf's DecodeError: not a libp2p key file
        raise UsageError(f"swarm.identity: {path!r} is not a libp2p private key file") from None
    if protobuf.key_type != crypto_pb2.KeyType.RSA or not protobuf.data:
        kind = crypto_pb2.KeyType.Name(protobuf.key_type) if protobuf.data else "empty"
        raise UsageError(f"swarm.identity: {path!r} holds a {kind} key; swarm signs its records with RSA keys "
                         f"(delete it to have a new one made)")
    try:
        key = _rsa_key(protobuf.data)
    except ValueError as e:
        raise UsageError(f"swarm.identity: {path!r} holds an unreadable RSA key ({e})") from None
    return Identity(key, PeerID.from_identity(data), path, made_now=made_now)


@functools.lru_cache(maxsize=4096)
def peer_id_of_public_key(ssh_public_key: bytes) -> Optional[str]:
    """The base58 peer id of an RSA public key in OpenSSH format (libp2p's rule); None if it is not one."""
    try:
        public_key = serialization.load_ssh_public_key(ssh_public_key)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        return None
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return PeerID(digest).to_base58()


def owner_key(subkey: bytes) -> bytes:
    """The public key inside an owner marker subkey (b"" if it is none)."""
    found = _OWNER.fullmatch(subkey) if isinstance(subkey, bytes) else None
    return found.group(1) if found else b""


def owner_peer_id(subkey: object) -> Optional[str]:
    """The peer id of the key in an owner marker subkey (base58), or None if `subkey` is not one."""
    if not isinstance(subkey, bytes):
        return None
    found = _OWNER.fullmatch(subkey)
    return peer_id_of_public_key(found.group(1)) if found else None
