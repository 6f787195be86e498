"""The state's hash: the one sha256 a peer records for each outer step it commits, that commit records vouch for,
and that a newcomer checks a downloaded state against (swarm/net/statesync.py). One definition, here, for
unsharded and sharded peers alike (`DiLoCo.global_sha256`, `Shards.sha256`) and for the downloader.

It covers everything a downloaded state sets that is the same on every peer that committed the same outer steps
(one lineage), so that no donor can hand a newcomer a forged value of any of it under the committed hash:

- the global parameters (`global.{i}`) and then the outer momentum (`momentum.{i}`: absent before the first
  outer step and with `outer.momentum: 0`; a fragment that has not stepped yet counts as zeros, which is how
  it steps), as the fp32 bytes that travel, in that order: `tensors_digest`;
- the count of rounds closed (`DiLoCo.round`, a state's `meta.round`): `state_sha256` binds it to that digest.

The count of outer steps is not in it: every record, offer and check pairs the hash with that count already.

Not covered, because they are a peer's own (two honest peers of one lineage hold different values), and so a
taker does not take them from its donor (swarm/train/trainer_state.py `intake`):

- the inner optimizer's state (AdamW moments and step count): built by each peer's own gradients on its own
  data (the DiLoCo paper keeps it local too). A donor's moments could steer the taker's next pseudo-gradient
  (an `exp_avg` pointing where the donor wants, a tiny `exp_avg_sq`) and no hash can vouch for them, so a
  served state carries none and a taker starts its inner optimizer afresh, as a sharded donor's takers always
  did (swarm/state/shard_state.py).
- the inner step (`meta.step`, the learning-rate schedule's position): a straggler ends its rounds early, so it
  differs between honest peers. A taker puts itself on the run's schedule at the committed round instead
  (`rounds * H + inner`), whatever the donor says.
- the data position: never in a served state (swarm/data/peerdata.py: a donor's data is the donor's).

Taken from the donor without a hash, within bounds: the inner step of the round (`meta.inner`, only with
fragments; 0 otherwise), where the donor stood when it committed, so that the taker's next exchange meets the
others'. It must be below H; a lie only misplaces the taker's next exchange, which then finds it behind and it
takes a state again: it cannot change the model.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

import torch

COVERED = ("global.", "momentum.")  # the names of the tensors the hash covers, in this order


def covers(name: str) -> bool:
    """Whether the state tensor `name` (swarm/state/peerstate.py names) is one the hash covers."""
    return name.startswith(COVERED)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of `t` that the hash reads (and the wire carries): its values, contiguous, on the CPU."""
    return memoryview(t.detach().cpu().contiguous().numpy()).cast("B")


def tensors_digest(tensors: Iterable[torch.Tensor]) -> str:
    """sha256 (hex) of the covered tensors' bytes, one after the other (global parameters, then momentum)."""
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(tensor_bytes(t))
    return digest.hexdigest()


def state_sha256(digest: str, rounds: int) -> str:
    """The state's hash: its covered tensors' `digest` (`tensors_digest`, or the same sha256 fed piece by piece)
    bound to its count of rounds closed."""
    if type(rounds) is not int:
        raise ValueError(f"rounds closed must be an int, not {rounds!r}")
    return hashlib.sha256(f"swarm state {digest} rounds {rounds}".encode()).hexdigest()
