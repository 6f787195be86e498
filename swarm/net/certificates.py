"""Outer step certificates: which votes the quorum counts, read from the statements that committing groups signed.

A vote (a peer's record at outer step s on hash h) used to count one per identity, and identities are free: eight
fresh keys claiming s+1 on a perturbed hash outvoted three honest peers. Now every peer that commits an outer step
signs a `Statement` (schema.py: outer step, parent hash, new hash, group id, group size) into its progress record
(its last one) and its commit record (its last `STATEMENTS`). This module is pure: it reads those statements
into certificates and says which votes they back (`Chains.counts`); policy.py counts only those.

- **Certificate** of (s, h): the members of one group that signed the same statement (s, parent, h, group,
  size), at least half of `size` of them. A group certifies what it committed; a minority of it cannot
  certify another hash.
- **Grounded**, for an observer with a lineage (it committed or took an outer step): a certificate of a hash it
  held, or one whose signers are at least half *credited* at s: they signed grounded certificates of the
  `WINDOW` outer steps before s, or the observer saw them do so in an earlier reading (`Anchor.credit`: the
  records carry only the last WINDOW steps, and two lineages that split longer ago would no longer see their
  common parent), or are the run's founders (the keys the observer saw live at outer step 0, while
  s <= WINDOW). Certificates are grounded lowest outer step first, so the chain of credit always starts
  at the observer's own lineage or its founders: keys that never took part in a grounded outer step weigh
  nothing, their certificate of s+1 on the honest parent has no credited signer however many sign it, and a
  ladder of forged statements that starts anywhere else never starts.
- **Counts**: a vote on (s, h) counts if (s, h) is grounded and its key signed its certificate or is credited
  at s (a peer that took the state of h from its group votes for it too). Outer step 0 counts for everyone.

Peers in one lineage hold the same hashes, so they credit the same keys: unlike counting only the keys a peer
averaged with (ledger.py), two groups that split from one parent still count each other (both are credited
before the split), and the quorum's tie-break settles them on one hash.

What it does not promise: an observer without a lineage (a newcomer, every peer before its first commit)
grounds a certificate of outer step 1 by itself and a later one by its parent's certificate (at least half of
its signers signed that one too): claims without statements never count for it, but keys that forge
statements of two consecutive outer steps do. Founders are whoever was live at outer step 0, fresh keys
included. A newcomer reads the certificates from the records alone; nothing chains the state it downloads back
to the run's start. `swarm.identity_work` prices each key; a private swarm (`swarm.auth: allowlist`) shuts
strangers out.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional

from swarm.net.schema import STATEMENTS, Statement

WINDOW = STATEMENTS
"""Outer steps back along a chain whose signers are credited: what the commit records carry."""


@dataclass(frozen=True)
class Certificate:
    outer_step: int
    sha256: str
    parent: str
    signers: frozenset[str]


def gather(statements: Iterable[tuple[str, Statement]]) -> dict[tuple[int, str], Certificate]:
    """The certificates among (signer, statement) pairs: per (outer step, hash), the group with the most signers
    of those that reach half their size (a key counts once per group however often its statement was read)."""
    groups: dict[tuple, set[str]] = defaultdict(set)
    for signer, st in statements:
        groups[(st.outer_step, st.sha256, st.parent, st.group, st.size)].add(signer)
    certs: dict[tuple[int, str], Certificate] = {}
    for (outer_step, sha, parent, _, size), signers in sorted(groups.items()):
        best = certs.get((outer_step, sha))
        if 2 * len(signers) >= size and (best is None or len(signers) > len(best.signers)):
            certs[(outer_step, sha)] = Certificate(outer_step, sha, parent, frozenset(signers))
    return certs


@dataclass(frozen=True)
class Anchor:
    """What an observer grounds certificates on (ledger.py keeps it): the hash it held at each outer step it
    recorded (empty for a newcomer), and the keys it saw live at outer step 0 when it started there (the run's
    founders, as the signers of outer step 0); and the members of the groups it completed all-reduces with, which
    policy.assess waits for while their records lag a step behind."""

    lineage: Mapping[int, str]
    founders: frozenset[str] = frozenset()
    credit: Mapping[str, int] = field(default_factory=dict)  # key -> last outer step it signed, grounded, as seen
    groups: Mapping[int, frozenset[str]] = field(default_factory=dict)  # outer step -> the group it committed it with


class Chains:
    """The certificates an observer read, and which of them are grounded for it on `anchor`. Memoized: build one
    per reading of the records."""

    def __init__(self, certs: Mapping[tuple[int, str], Certificate], anchor: Anchor):
        self.certs, self.lineage, self.founders, self.remembered = certs, anchor.lineage, anchor.founders, anchor.credit
        self.settled = any(s > 0 for s in anchor.lineage)  # it committed or took an outer step: not a newcomer
        self._by_outer_step: dict[int, list[Certificate]] = defaultdict(list)
        for cert in certs.values():
            self._by_outer_step[cert.outer_step].append(cert)
        self._grounded: dict[tuple[int, str], bool] = {}
        self._credited: dict[int, frozenset[str]] = {}
        self._filled: set[int] = set()

    def grounded(self, outer_step: int, sha256: str) -> bool:
        """Whether the certificate of (outer step, sha256) counts for us (module docstring)."""
        key = (outer_step, sha256)
        if key not in self._grounded:
            self._fill(outer_step)
            self._grounded[key] = self._ground(outer_step, sha256)
        return self._grounded[key]

    def _fill(self, upto: int) -> None:
        """Ground every certificate of the outer steps before `upto`, lowest first: each needs only earlier ones,
        so however many outer steps forged statements span, nothing recurses."""
        for s in sorted(r for r in self._by_outer_step if r < upto and r not in self._filled):
            self._filled.add(s)
            for cert in self._by_outer_step[s]:
                self._grounded[(s, cert.sha256)] = self._ground(s, cert.sha256)

    def _ground(self, outer_step: int, sha256: str) -> bool:
        if self.lineage.get(outer_step) == sha256:
            return True
        cert = self.certs.get((outer_step, sha256))
        return cert is not None and self._vouched(outer_step, cert.parent, cert.signers)

    def _vouched(self, outer_step: int, parent: str, signers: frozenset[str]) -> bool:
        """Whether a certificate of `outer_step` from `parent` signed by `signers` would be grounded for us."""
        if self.settled:
            credited = self.credited(outer_step)
        elif outer_step == 1:  # a newcomer: the initial state is everyone's
            return True
        else:  # a newcomer: its parent's certificate vouches for it
            cert = self.certs.get((outer_step - 1, parent))
            credited = cert.signers if cert is not None else frozenset()
        return 2 * len(signers & credited) >= len(signers)

    def pending(self, peer: str, statement: Statement) -> bool:
        """Whether `peer`'s own `statement` is of a commit its group has not finished certifying in what we read:
        no certificate of it yet (its groupmates publish their statements a heartbeat later than the first of
        them does), and one that `peer` signed would be grounded for us. Such a claim counts for nothing yet,
        but names nobody a liar (policy.uncertified)."""
        if (statement.outer_step, statement.sha256) in self.certs:
            return False
        return self._vouched(statement.outer_step, statement.parent, frozenset({peer}))

    def credited(self, outer_step: int) -> frozenset[str]:
        """The keys credited at `outer_step`: the signers of the grounded certificates of the WINDOW outer steps before
        it, the founders among them while outer step 0 is."""
        if outer_step not in self._credited:
            self._fill(outer_step)
            self._credited[outer_step] = frozenset().union(
                self.founders if outer_step <= WINDOW else frozenset(),
                (key for key, s in self.remembered.items() if s >= outer_step - WINDOW),
                *(cert.signers for s in range(max(1, outer_step - WINDOW), outer_step)
                  for cert in self._by_outer_step.get(s, ()) if self._grounded[(s, cert.sha256)]))
        return self._credited[outer_step]

    def credit(self) -> dict[str, int]:
        """Each key that signed a grounded certificate read, and the last outer step it did: what the observer
        remembers (`Anchor.credit`, ledger.py), so that a lineage that split from ours more than WINDOW outer steps
        ago, whose common parent the records no longer carry, stays grounded for us as it was when they did."""
        if not self._by_outer_step:
            return {}
        self._fill(max(self._by_outer_step) + 1)
        out: dict[str, int] = {}
        for (s, sha), cert in sorted(self.certs.items()):
            if self._grounded.get((s, sha)):
                out.update(dict.fromkeys(cert.signers, s))
        return out

    def counts(self, peer: str, outer_step: int, sha256: str) -> bool:
        """Whether `peer`'s vote on (outer step, sha256) counts (module docstring)."""
        if outer_step == 0:
            return True
        if not sha256 or not self.grounded(outer_step, sha256):
            return False
        cert = self.certs.get((outer_step, sha256))
        return (cert is not None and peer in cert.signers) or peer in self.credited(outer_step)


def chains(signed: Iterable[tuple[str, Optional[Statement]]], anchor: Anchor) -> Chains:
    """`Chains` over the statements read: (signer, statement) pairs, None where a record carried none."""
    return Chains(gather((peer, st) for peer, st in signed if st is not None), anchor)
