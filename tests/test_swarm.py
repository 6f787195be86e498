"""Real peers on loopback: rounds commit identical bytes everywhere and equal the reference math."""

import time

import pytest
import torch

from swarm.run.configfile import load_config
from swarm.train.averaging import weighted_mean
from tests.conftest import ROOT
from tests.swarm_harness import local_swarm

pytestmark = pytest.mark.slow  # starts peers, DHTs or `swarm` processes (make test-fast leaves it out)

MATCHMAKING_S = load_config(ROOT / "configs" / "tiny.yaml").swarm.matchmaking_time


# the sample-weighted mean the reference math below replays (the defaults bound influence instead)
# the plain sample-weighted mean in exact fp32, which the reference below computes
PLAIN_MEAN = ("--swarm.aggregation", "mean", "--swarm.clip_norm_ratio", "0", "--swarm.max_weight_share", "1",
              "--swarm.compression", "none")


@pytest.mark.timeout(240)
def test_three_peers_commit_identical_rounds_equal_to_reference(tmp_path, fork_server):
    with local_swarm(tmp_path, fork_server) as swarm:
        swarm.start_bootstrap()
        # The late peer contributes fewer inner steps to round 1 (the other two wait for it, so it stops early):
        # the mean must be weighted by the samples. (Peers of one run share data.batch_size: it is in the run's
        # fingerprint.) Every round is averaged by all three (min_group_size 3): on a loaded machine a peer can
        # take longer to start than a round's matchmaking, and the other two would commit round 1 as a pair while
        # it downloads the state.
        def start(i: int):
            return swarm.start_peer(f"p{i}", "--diloco.rounds", "3", "--diloco.inner_steps", "4",
                                    "--data.batch_size", "2", "--data.shard", str(i),
                                    "--swarm.target_group_size", "3", "--swarm.min_group_size", "3",
                                    "--logging.dump_tensors", "true", *PLAIN_MEAN)
        peers = [start(0), start(1)]
        time.sleep(MATCHMAKING_S + 2)  # the third starts late, as under load: the first two must wait for it
        peers.append(start(2))
        swarm.wait(peers, timeout=200)
        for p in peers:
            assert p.proc.returncode == 0, swarm.log(p)[-3000:]
        summaries = [swarm.summary(p) for p in peers]
        # the committed attempts (a peer that started first may have discarded one while waiting for the third)
        dumps = [[d for d in swarm.dumps(p) if d["record"]["committed"]] for p in peers]

    for r in range(3):
        assert len({s["round_hashes"][r] for s in summaries}) == 1, f"round {r + 1} hashes differ"
    assert all(s["rounds_completed"] == 3 for s in summaries)

    # Replay the outer optimizer (Nesterov SGD, lr 0.7, momentum 0.9) from the peers' own
    # pseudo-gradients and sample counts, and compare with what every peer committed.
    lr, mu = 0.7, 0.9
    momentum = None
    for r in range(3):
        contributions = [(d[r]["pseudo_grad"], float(d[r]["samples"])) for d in dumps]
        # weight = sequences this round: a multiple of the batch size (a straggler may stop early)
        assert all(w > 0 and w % 2 == 0 for _, w in contributions)
        mean = weighted_mean(contributions)
        momentum = [torch.zeros_like(g) for g in mean] if momentum is None else momentum
        expected = []
        for i, g in enumerate(mean):
            momentum[i] = mu * momentum[i] + g
            expected.append(dumps[0][r]["global_before"][i] - lr * (g + mu * momentum[i]))
        for d in dumps:
            assert d[r]["record"]["committed"] and d[r]["record"]["group_size"] == 3
            for ours, ref in zip(d[r]["global_after"], expected):
                assert torch.allclose(ours, ref, atol=1e-6, rtol=0)
