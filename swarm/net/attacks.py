"""The attacks a hostile peer can make (`faults.hostile`, `swarm local --hostile KIND@PEER`), by name, with
what catches each. Only names live here, so that the config can check them; the attacks are in hostile.py.
"""

ATTACKS = {
    "forge-progress": "its progress record claims it finished every round at once (ready), and every other "
                      "heartbeat a far-future round it serves the state of (policy.plausible, majority ready)",
    "nan": "sends NaN in its pseudo-gradient (owners refuse the part and name it)",
    "huge": "sends its pseudo-gradient times 1e6, finite (swarm.clip_norm_ratio, robust aggregation)",
    "weight": "claims 1e18 samples (the most a strict int carries) in matchmaking and as its weight "
              "(swarm.max_weight_share)",
    "bad-part": "returns a wrong average for the part it owns (swarm.verify_parts)",
    "garbage-meta": "sends matchmaking metadata that does not fit (matchmaking.GroupMeta, then a ban)",
    "poison-state": "serves a state with the right shapes and wrong values under the committed hash (the "
                    "newcomer hashes what it downloads)",
    "flood": "opens all-reduce streams for groups it is not in, as many as it can (allreduce: per-peer cap "
             "on pending groups)",
}
