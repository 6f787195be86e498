"""The attacks a hostile peer can make (`faults.hostile`, `swarm local --hostile KIND@PEER`), by name, with
what catches each. Only names live here, so that the config can check them; the attacks are in hostile.py.
"""

ATTACKS = {
    "forge-progress": "its progress record claims it finished every round at once (ready), and every other "
                      "heartbeat a far-future round it serves the state of (policy.plausible, majority ready)",
    "claim-ahead": "its progress records claim one round more than it holds, on its real hash, serving (the quorum "
                   "rule of policy.py: one voter of several is never half of them)",
    "forged-commit": "its commit records claim one round more than it committed, on a hash nobody holds (commits "
                     "count only when no other voter is live)",
    "nan": "sends NaN in its pseudo-gradient (owners refuse the part and name it)",
    "huge": "sends its pseudo-gradient times 1e6, finite (swarm.clip_norm_ratio, robust aggregation)",
    "weight": "claims 1e18 samples (the most a strict int carries) in matchmaking and as its weight "
              "(swarm.max_weight_share)",
    "bad-part": "returns a wrong average for the part it owns (swarm.verify_parts)",
    "audit-lie": "answers its groupmates' audits with other bytes than it sent the owner (allreduce/evidence.py: "
                 "its own signature over what it sent names it)",
    "frame": "leads matchmaking (waits a third of swarm.matchmaking_time) and hands its followers forged metas "
             "of their groupmates, malformed (signedmeta: every member signs its own meta; the followers charge "
             "the leader, never each other)",
    "replay": "leads matchmaking and hands its followers each member's signed meta of an earlier round (a meta "
              "names its round and attempt's nonce: the member whose meta it is charges the leader; the others "
              "leave the group charging nobody, matchmaking.misfit)",
    "lying-owner": "sends one member other bytes of its part's average than the others (allreduce/agree.py: "
                   "members compare their owners' signed digests before committing)",
    "stall-round": "signs matchmaking metadata of another round (matchmaking.misfit names the member that signed it)",
    "stall-numel": "signs matchmaking metadata with another vector size (matchmaking.misfit names it)",
    "stall-token": "puts another token in the matchmaking barrier than its meta says (the barrier decides only "
                   "a round's first attempt; then the all-reduce's HELLOs do)",
    "stall-silent": "pushes all but the last chunk of each part, then holds its streams open, silent (each "
                    "owner names it: SEEN, left out for the averaging attempt)",
    "garbage-meta": "sends matchmaking metadata that does not fit (matchmaking.GroupMeta, then a ban)",
    "poison-state": "serves a state with the right shapes and wrong values under the committed hash (the "
                    "newcomer hashes what it downloads)",
    "poison-momentum": "serves its state with its outer momentum reversed and ten times larger (finite, same "
                       "shapes) under its real committed hash (the state's hash covers the momentum: "
                       "swarm/state/statehash.py; the newcomer refuses it naming the donor and takes another's)",
    "flood": "opens all-reduce streams for groups it is not in, as many as it can (allreduce: per-peer cap "
             "on pending groups)",
    "trickle": "holds streams open on every handler of every peer, a byte of a maximal HELLO per half stall "
               "(limits: streams per peer; wire: the first frame's deadline, then a ban)",
    "sybil": "mints identities that sign a forged fingerprint and manifest (swarm.identity_work: a proof of "
             "work per identity; without it a newcomer counts them as peers)",
    "sybil-quorum": "mints 8 identities that sign progress and commit records one round ahead of its own, on a "
                    "perturbed hash they say they serve, from the run's second round on (no certificate backs "
                    "their votes: the quorum counts none of them, certificates.py; alone, the ledger)",
}
