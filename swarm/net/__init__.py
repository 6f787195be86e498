"""The swarm's network side: what `SwarmAverager` (peer.py) does for the trainer, and what each module is.

`peer.py` is the only module the trainer's side uses (through the `Averager` interface, swarm/train/averaging.py);
everything below serves it. By concern:

Transport
- `dht.py`: starting the hivemind DHT (validated addresses, a bounded bootstrap); `p2pd.py`: the libp2p daemon
  under it, started with the services swarm uses and no others (no circuit relay).
- `wire.py`: framed messages over raw libp2p streams; bounded memory, waits that end.
- `dataplane.py`: the all-reduce's bulk bytes on direct TCP between groupmates, sealed (AES-GCM) with a key
  given over libp2p; libp2p where a groupmate cannot be dialed.
- `codec.py`: how a run of the pseudo-gradient travels as bytes (`swarm.compression`: none, fp16, int8, int4).
- `budget.py`: how long a transfer may take, from its bytes and a floor on bandwidth; the chunk size.
- `limits.py`: caps on the incoming streams one peer holds (per remote peer, in total); the open-file limit.

Identity and trust
- `identity.py`: a peer's RSA key, both its libp2p identity and the signer of its DHT records.
- `work.py`: proof of work on a key (`swarm.identity_work`): what makes an identity, and so a vote, cost something.
- `schema.py`: every DHT key and record `swarm` stores, and reading them back as their signers wrote them.
- `access.py`: who may take part (the run's allowlist), offenses and bans.
- `hostile.py`: the hostile-peer suite (the attacks named in swarm/config.py ATTACKS; the `Hooks` the protocol calls);
  `sybil.py`: records in the names of many minted identities (the `sybil` attack, and tests).
- `manifest.py`: a run's manifest and the run index (`swarm join`, `swarm runs`).

Where a peer stands
- `records.py`: this peer's progress and commit records (a heartbeat keeps them fresh) and the others'.
- `policy.py`: one pure function over the records: alive, ahead, behind, alone, in the majority.
- `certificates.py`: which votes count: the statements committing groups sign, read into certificates grounded
  on this peer's lineage (pure, like policy.py); `ledger.py`: what this peer keeps of it (groups, lineage,
  statements, founders) beside its key.

Who it averages with
- `matchmaking.py`: forming a group for an outer step (hivemind's averager, used only to agree on members).
- `grouping.py`: who in that group this peer averages with (offenders out, the left-outs of most groupmates
  adopted, the majority's base, clients).

The all-reduce
- `allreduce/`: the group's streamed butterfly all-reduce, bit-identical on every member, with its robust
  reducers, audits and repairs (its `__init__` lists the modules and exports what the rest uses).
- `outcome.py`: one call of `SwarmAverager.average`, and the outcomes it ends in.

State transfer
- `statesync.py`: a newcomer (or a peer behind) downloads a donor's state, tensor by tensor, checked against
  the hash the swarm committed.
- `linger.py`: after the last outer step, serving the state while live peers need it; the end of a run agrees.
- `corpussync.py`: a joiner without the run's corpus fetches its token files, piece by piece, checked against
  the run's corpus hash; every peer serves its own, rate-capped.
"""
