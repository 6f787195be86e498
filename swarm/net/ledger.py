"""Whose commits count for a peer left alone: the keys that took part in a round with it, one vote each.

Identities are free (a key pair takes a fraction of a second to make). Where no other peer is live (the first
peer of a run, a restarted peer, the last one lingering), the last commit records decide where the swarm got to
(policy.py), and one forged record at the next round made such a peer exit. So it counts only the keys it knows
to have taken part in the run: `Ledger.record` keeps, per outer step, the members of every group this peer
completed an all-reduce with, and the live peers whose records held a state it took from the swarm (its own
group was outvoted, it fell behind, or it joined). The ledger lives in the peer's folder (`ledger.json`), beside
its key (`identity.key`), so that a restart keeps both and the peer stays known under the same key.

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

from swarm.errors import UsageError

WINDOW = 64
"""Outer steps before the disputed one that count: a key recorded at any of them has a vote."""
KEPT = 2 * WINDOW  # steps kept in the file: a peer that resumes a few steps back still has its window
MAX_MEMBERS = 4096  # members of one recorded group (a group beyond this was not formed by matchmaking)


class Ledger:
    """The groups this peer averaged with, by outer step; saved to `path` (if any) at every record."""

    def __init__(self, path: Optional[Path] = None):
        self.path = path
        self.steps: dict[int, frozenset[str]] = {}
        if path is not None and path.exists():
            self.steps = _load(path)

    def record(self, outer_step: int, members: Iterable[str]) -> None:
        """Peers that took part in `outer_step`: the group this peer closed it with, or the holders of the state it
        took for it (added to those already recorded). Called in the training thread while the heartbeat may
        read them: the steps are replaced whole, never changed in place."""
        known = self.steps.get(outer_step, frozenset())
        steps = {**self.steps, outer_step: known | frozenset(list(members)[:MAX_MEMBERS - len(known)])}
        self.steps = {s: steps[s] for s in sorted(steps)[-KEPT:]}
        if self.path is not None:
            _save(self.path, self.steps)

    def known(self, outer_step: int) -> Optional[frozenset[str]]:
        """The keys that vote in the dispute over `outer_step`: those recorded at any of the last WINDOW recorded
        steps before it; None if no step before it is recorded (count identities)."""
        steps = self.steps
        before = sorted(s for s in steps if s < outer_step)[-WINDOW:]
        if not before:
            return None
        return frozenset().union(*(steps[s] for s in before))


def _load(path: Path) -> dict[int, frozenset[str]]:
    try:
        data = json.loads(path.read_text())
        steps = {int(s): frozenset(members) for s, members in data["steps"].items()}
        if data["version"] != 1 or not all(isinstance(m, str) for ms in steps.values() for m in ms):
            raise ValueError("not a ledger of version 1")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(f"the ledger {path} is unreadable ({e}); delete it to start this peer with nothing "
                         f"recorded (it then counts identities until it averages with others again)") from None
    return steps


def _save(path: Path, steps: dict[int, frozenset[str]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"version": 1, "steps": {str(s): sorted(m) for s, m in sorted(steps.items())}}))
    os.replace(tmp, path)
