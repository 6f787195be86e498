"""swarm: DiLoCo training across peers connected by the ordinary internet, on hivemind.

The words, used with one meaning each in code, logs and docs:

- **round**: H inner steps of a peer's local model (AdamW on its data), closed by the outer step of its last
  fragment. `DiLoCo.round` counts the rounds a peer has closed; `diloco.rounds` is how many a run has.
- **outer step**: one committed exchange: the averaged pseudo-gradient applied to the global parameters by the
  outer optimizer (Nesterov SGD). `DiLoCo.outer_steps` counts them on any fragment. With one fragment every round
  has one, so outer steps = rounds; with F fragments a round has F. A peer's place in the swarm is its count of
  outer steps: the network layer (swarm/net) keys progress records, commit records, groups and state offers by it.
- **exchange**: averaging one fragment's pseudo-gradient (global minus local parameters) with a group of peers
  (swarm/train/overlap.py `Exchange`). Blocking, it runs between two inner steps; delayed, beside them.
- **fragment**: a contiguous run of the parameter tensors exchanged on its own schedule (Streaming DiLoCo,
  swarm/train/fragments.py); one fragment (the default) is all of them.
- **delay**: `diloco.delay`, the inner steps by which an exchange lands after it started (0: blocking).
- **commit**: an exchange whose group agreed on the same averaged bytes lands: the outer step is applied, the new
  global hash recorded, the state served. Otherwise it is **discarded**: the local model keeps its progress and
  the fragment's next exchange covers both. `Trainer._settle` is the one place that decides.
- **state**: what a peer serves and a newcomer (or a peer found behind) takes: global parameters, outer momentum
  and the position (rounds closed, outer steps, inner step of the round) (swarm/state/peerstate.py). Its inner optimizer
  state stays its own (in its checkpoints, never served).
- **state hash** (the "global hash"): sha256 of the global parameters, then the outer momentum, bound to the count
  of rounds closed (swarm/state/statehash.py): what a peer records for each outer step it commits, what commit records
  vouch for, and what a taker checks a downloaded state against. It covers everything a taken state sets that is
  the same on every peer of one lineage; what differs between honest peers is not taken from a donor.
"""

__version__ = "0.1.0"
