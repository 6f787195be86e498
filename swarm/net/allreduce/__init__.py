"""The all-reduce: a group's members average their pseudo-gradients, streamed chunk by chunk, into results
that are bit-identical on every member (allreduce.py has the protocol).

- allreduce.py: `AllReduce`, one per peer: runs the groups matchmaking formed, and serves its part to them.
- slots.py: the groups a peer runs or waits for, by id: what a stranger's stream reaches first.
- groupstate.py: one group's run (`GroupState`), what a member contributes (`Contribution`), `AllReduceFailed`.
- layout.py: where every element goes on the wire (`WireLayout`: parts, chunks); an average kept in the wire's
  bytes until read (`EncodedAverage`).
- robust.py: how an owner reduces a chunk (`Rule`: the weighted mean or a bounded-influence rule).
- agree.py: one result per part: members compare the owners' signed digests before returning.
- audit.py: `swarm.verify_parts`, every member recomputing one chunk of every other part.
- hashing.py: the one hash of the all-reduce's bytes (BLAKE3): chunk, result and evidence digests.
- evidence.py: who lied when an audit disagrees, by the member's signature over what it pushed.
- repair.py: a part taken from a groupmate when its owner was lost.
- hooks.py: where a peer's own part can be changed from outside (`AllReduceHooks`: hostile peers, tests).

Other modules use what this file exports; the rest is the package's own.
"""

from swarm.net.allreduce.allreduce import AllReduce
from swarm.net.allreduce.groupstate import CONCLUSIVE, PROOF, SEEN, TOLD, AllReduceFailed, Contribution
from swarm.net.allreduce.hooks import AllReduceHooks
from swarm.net.allreduce.layout import EncodedAverage, WireLayout
from swarm.net.allreduce.robust import Rule

__all__ = ["CONCLUSIVE", "PROOF", "SEEN", "TOLD", "AllReduce", "AllReduceFailed", "AllReduceHooks", "Contribution",
           "EncodedAverage", "Rule", "WireLayout"]
