"""Whose commits count for a peer left alone: the keys that took part in an outer step with it, one vote each.

Identities are free (a key pair takes a fraction of a second to make). Where no other peer is live (the first
peer of a run, a restarted peer, the last one lingering), the last commit records decide where the swarm got to
(policy.py), and one forged record at the next outer step made such a peer exit. So it counts only the keys it knows
to have taken part in the run: `Ledger.record` keeps, per outer step, the members of every group this peer
completed an all-reduce with, and the live peers whose records held a state it took from the swarm (its own
group was outvoted, it fell behind, or it joined). The ledger lives in the peer's folder (`ledger.json`), beside
its key (`identity.key`), so that a restart keeps both and the peer stays known under the same key.

It also keeps this peer's lineage (`lineage`: the hash it held at each outer step it committed or took), the keys
it saw live at outer step 0 if it started there (`founders`): its anchor when it reads certificates
(certificates.py); and the statements it signed for its commits (`statements`, schema.py), which it republishes
after a restart, so that the certificates it signed still count.

`Ledger.known(s)`: who decides outer step s, from the steps before s only (what happened at s is what is in
dispute): the keys recorded at any of the last `WINDOW` recorded steps before s (a peer that left is forgotten
after WINDOW steps), one vote each, whatever it claims. With no step before s recorded (a newcomer, a run's first
step) it is None, and identities count.

What it promises, for a peer that has taken part: when nobody else is live, a hash of a later step counts only
if at least half of the keys it knows signed it; keys it never met, however many, and one former groupmate of
three, cannot make it take another state, skip a step, or stop. What it does not: among live peers the quorum
counts identities (policy.py says why: counted by acquaintance, the halves of a split swarm never merged), so
free identities that outnumber the live honest peers still steer them; a newcomer knows nobody; and the ledger
is this peer's own view, not a certificate a stranger could check.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Optional

from pydantic.v1 import ValidationError

from swarm.errors import UsageError
from swarm.net.schema import STATEMENTS, Statement

WINDOW = 64
"""Outer steps before the disputed one that count: a key recorded at any of them has a vote."""
KEPT = 2 * WINDOW  # steps kept in the file: a peer that resumes a few steps back still has its window
MAX_MEMBERS = 4096  # members of one recorded group (a group beyond this was not formed by matchmaking)


class Ledger:
    """The groups this peer averaged with, by outer step; saved to `path` (if any) at every record."""

    def __init__(self, path: Optional[Path] = None):
        self.path = path
        self.steps: dict[int, frozenset[str]] = {}
        self.lineage: dict[int, str] = {}  # outer step -> the hash this peer held there
        self.statements: tuple[Statement, ...] = ()  # our last STATEMENTS signed statements, oldest first
        self.founders: frozenset[str] = frozenset()  # keys seen live at outer step 0 while we were there
        self.credit: dict[str, int] = {}  # key -> last outer step it signed a grounded certificate, as we saw
        if path is not None and path.exists():
            self.steps, self.lineage, self.statements, self.founders, self.credit = _load(path)

    def remember(self, credit: dict[str, int]) -> None:
        """Keys seen signing grounded certificates, by their last outer step (certificates.Chains.credit): kept,
        the MAX_MEMBERS most recent, so that a lineage stays grounded once its common parent with ours has left
        the records. Saved only when something moved on."""
        merged = {**self.credit, **{k: s for k, s in credit.items() if s > self.credit.get(k, -1)}}
        if merged != self.credit:
            self.credit = dict(sorted(merged.items(), key=lambda item: (-item[1], item[0]))[:MAX_MEMBERS])
            self._save()

    def found(self, peers: Iterable[str]) -> None:
        """`peers` are live at outer step 0 with us: the run's founders, credited as its first signers
        (certificates.py). Only while we hold nothing yet: a peer that joins later has no founders."""
        new = frozenset(peers) - self.founders
        if new and not any(s > 0 for s in self.lineage):
            self.founders = self.founders | frozenset(sorted(new)[:MAX_MEMBERS - len(self.founders)])
            self._save()

    def hold(self, outer_step: int, sha256: str, statement: Optional[Statement] = None) -> None:
        """This peer holds `sha256` at `outer_step` (it committed it, with `statement` if it signed one, or took
        it): later steps' entries are dropped, a restart from an older checkpoint or a state taken replaces
        them; the same state offered again keeps its statement. Replaced whole, like `record`."""
        lineage = {s: h for s, h in self.lineage.items() if s < outer_step}
        self.lineage = {s: lineage.get(s, sha256) for s in sorted({*lineage, outer_step})[-KEPT:]}
        kept = tuple(st for st in self.statements if st.outer_step < outer_step
                     or (statement is None and (st.outer_step, st.sha256) == (outer_step, sha256)))  # offered again
        self.statements = (*kept, statement)[-STATEMENTS:] if statement is not None else kept[-STATEMENTS:]
        self._save()

    def record(self, outer_step: int, members: Iterable[str]) -> None:
        """Peers that took part in `outer_step`: the group this peer closed it with, or the holders of the state it
        took for it (added to those already recorded). Called in the training thread while the heartbeat may
        read them: the steps are replaced whole, never changed in place."""
        known = self.steps.get(outer_step, frozenset())
        steps = {**self.steps, outer_step: known | frozenset(list(members)[:MAX_MEMBERS - len(known)])}
        self.steps = {s: steps[s] for s in sorted(steps)[-KEPT:]}
        self._save()

    def _save(self) -> None:
        if self.path is not None:
            _save(self.path, self.steps, self.lineage, self.statements, self.founders, self.credit)

    def known(self, outer_step: int) -> Optional[frozenset[str]]:
        """The keys that vote in the dispute over `outer_step`: those recorded at any of the last WINDOW recorded
        steps before it; None if no step before it is recorded (count identities)."""
        steps = self.steps
        before = sorted(s for s in steps if s < outer_step)[-WINDOW:]
        if not before:
            return None
        return frozenset().union(*(steps[s] for s in before))


def _load(path: Path) -> tuple[dict[int, frozenset[str]], dict[int, str], tuple[Statement, ...], frozenset[str],
                              dict[str, int]]:
    """A ledger file of version 2 (`credit` optional: written since it exists), or of version 1 (groups only: no
    lineage, statements, founders or credit)."""
    try:
        data = json.loads(path.read_text())
        if data["version"] not in (1, 2):
            raise ValueError(f"version {data['version']!r}, not 1 or 2")
        steps = {int(s): frozenset(members) for s, members in data["steps"].items()}
        if not all(isinstance(m, str) for ms in steps.values() for m in ms):
            raise ValueError("a member that is not a peer id")
        lineage = {int(s): str(h) for s, h in data.get("lineage", {}).items()}
        statements = tuple(Statement.parse_obj(st) for st in data.get("statements", []))[-STATEMENTS:]
        founders = frozenset(data.get("founders", []))
        if not all(isinstance(f, str) for f in founders):
            raise ValueError("a founder that is not a peer id")
        credit = {str(k): int(v) for k, v in data.get("credit", {}).items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ValidationError) as e:
        raise UsageError(f"the ledger {path} is unreadable ({e}); delete it to start this peer with nothing "
                         f"recorded (it then counts identities until it averages with others again)") from None
    return steps, lineage, statements, founders, credit


def _save(path: Path, steps: dict[int, frozenset[str]], lineage: dict[int, str],
          statements: tuple[Statement, ...], founders: frozenset[str], credit: dict[str, int]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"version": 2, "steps": {str(s): sorted(m) for s, m in sorted(steps.items())},
                               "lineage": {str(s): h for s, h in sorted(lineage.items())},
                               "statements": [st.dict() for st in statements], "founders": sorted(founders),
                               "credit": credit}))
    os.replace(tmp, path)
