"""Whose word counts: a peer's weight is the rounds it took part in, as this peer saw them.

Identities are free (a key pair takes a fraction of a second to make), so the rule that decides whose state an
honest peer takes (policy.py) must not count identities: it weighs each voter by the rounds of the run that
the voter averaged in together with this peer. `Ledger.record` keeps the members of every group this peer
completed an all-reduce with, for the outer step it closed; the ledger lives in the peer's folder
(`ledger.json`), beside its key (`identity.key`), so that a restart keeps both and the peer's weight in the
others' ledgers still means the same key.

`Ledger.weights(s)`: the weights that decide outer step s, from the steps before s only (what happened at s is
what is in dispute): one per recorded step a key was a member at (the cap per identity: a key weighs at most
one member's share of a step, whatever samples it claimed), over the last `WINDOW` recorded steps before s, so
a peer that left stops counting after WINDOW steps. With no step before s recorded (a newcomer, a run's first
step) it is None, and the quorum rule counts identities, as it must where nothing is known yet.

What it promises, for a peer that has averaged with others: keys that were members of none of its last WINDOW
groups weigh nothing, however many of them vote: they cannot make it take another state, skip a step, or stop
(a forged commit record alone, when nobody else is live, neither). To steer it, an attacker must have been a
member of more of its recent groups, and stayed, than the honest peers. What it does not promise: a newcomer
(nothing recorded) still counts identities, as does every peer at a run's first step (protect an open swarm's
newcomers with `swarm.identity_work` and a private one with `swarm.auth: allowlist`); and a key that takes part
in groups earns weight like any other, what it sends bounded by the robust aggregation (allreduce/robust.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Optional

from swarm.errors import UsageError

WINDOW = 64
"""Outer steps before the disputed one that weigh: a member of any of them counts, one per step."""
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
        """The group that closed `outer_step` (this peer among its `members`). Called in the training thread while
        the heartbeat may read the weights: the steps are replaced whole, never changed in place."""
        steps = {**self.steps, outer_step: frozenset(list(members)[:MAX_MEMBERS])}
        self.steps = {s: steps[s] for s in sorted(steps)[-KEPT:]}
        if self.path is not None:
            _save(self.path, self.steps)

    def weights(self, outer_step: int) -> Optional[dict[str, int]]:
        """Each member's weight in the dispute over `outer_step`: how many of the last WINDOW recorded steps
        before it counted that member; None if no step before it is recorded (count identities)."""
        steps = self.steps
        before = sorted(s for s in steps if s < outer_step)[-WINDOW:]
        if not before:
            return None
        out: dict[str, int] = {}
        for s in before:
            for peer in steps[s]:
                out[peer] = out.get(peer, 0) + 1
        return out


def _load(path: Path) -> dict[int, frozenset[str]]:
    try:
        data = json.loads(path.read_text())
        steps = {int(s): frozenset(members) for s, members in data["steps"].items()}
        if data["version"] != 1 or not all(isinstance(m, str) for ms in steps.values() for m in ms):
            raise ValueError("not a ledger of version 1")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(f"the ledger {path} is unreadable ({e}); delete it to start this peer's with nothing "
                         f"recorded (it then counts identities until it averages with others again)") from None
    return steps


def _save(path: Path, steps: dict[int, frozenset[str]]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"version": 1, "steps": {str(s): sorted(m) for s, m in sorted(steps.items())}}))
    os.replace(tmp, path)
