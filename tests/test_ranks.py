"""A peer of several processes (peers/launch.py; DDP over gloo on CPU): its ranks train as one process would and
end on one hash; a killed two-rank peer resumes exactly; in a swarm, a rank that dies takes its peer down
and the other peers, every rank of them, go on to one hash."""

import json
from pathlib import Path

import pytest
import torch

from swarm.errors import UsageError
from swarm.run.configfile import load_config
from swarm.train.ranks import Ranks, check
from tests.conftest import ROOT
from tests.swarm_harness import SMALL

pytestmark = pytest.mark.slow  # starts peers, DHTs or `swarm` processes (make test-fast leaves it out)

RUN = [*SMALL, "--diloco.rounds", "3", "--diloco.inner_steps", "6", "--data.batch_size", "4"]


def solo(swarm_cmd, out: Path, nproc: int, *extra: str):
    return swarm_cmd("peer", "--config", "configs/tiny.yaml", "--solo", "--nproc-per-node", str(nproc),
                   "--out", str(out), *RUN, *extra, timeout=150)


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def rank_hashes(out: Path) -> list[str]:
    return [json.loads(p.read_text())["global_sha256"] for p in sorted((out / "ranks").glob("rank-*.json"))]


@pytest.mark.timeout(600)
def test_two_ranks_train_like_one_process_and_a_killed_peer_resumes_exactly(tmp_path, swarm_cmd):
    one, two = solo(swarm_cmd, tmp_path / "one", 1), solo(swarm_cmd, tmp_path / "two", 2)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    (a,), (b,) = summary(tmp_path / "one")["peers"], summary(tmp_path / "two")["peers"]
    assert (a["nproc"], b["nproc"]) == (1, 2) and b["tokens_per_s"] > 0
    # DDP averages the two half-batch gradients: the step of the whole batch, up to float rounding
    assert b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-5)
    assert b["eval_loss"] == pytest.approx(a["eval_loss"], abs=1e-5)
    assert rank_hashes(tmp_path / "two") == [b["final_global_sha256"]] * 2

    # overlap on: rank 0's exchange runs behind both ranks' next inner steps; both take its outcome at the settle.
    # Alone, the average is the peer's own pseudo-gradient, so the local model resumed from the very outer step
    # that lands: the delayed run trains exactly as the blocking one.
    two_d = solo(swarm_cmd, tmp_path / "two-d", 2, "--diloco.delay", "2")
    assert two_d.returncode == 0, two_d.stderr[-3000:]
    (b_d,) = summary(tmp_path / "two-d")["peers"]
    assert b_d["train_loss"] == pytest.approx(a["train_loss"], abs=1e-5)
    assert rank_hashes(tmp_path / "two-d") == [b_d["final_global_sha256"]] * 2

    # overlap on, streaming: two exchanges a round, each running in rank 0's background thread behind the next
    # inner step of both ranks, which take its outcome where it lands (the first mid-round)
    streams = [solo(swarm_cmd, tmp_path / f"f2-{n}", n, "--diloco.fragments", "2", "--diloco.delay", "1") for n in (1, 2)]
    assert all(r.returncode == 0 for r in streams), streams[1].stderr[-3000:]
    (a_f,), (b_f,) = summary(tmp_path / "f2-1")["peers"], summary(tmp_path / "f2-2")["peers"]
    assert b_f["train_loss"] == pytest.approx(a_f["train_loss"], abs=1e-5)
    assert b_f["eval_loss"] == pytest.approx(a_f["eval_loss"], abs=1e-5)
    assert rank_hashes(tmp_path / "f2-2") == [b_f["final_global_sha256"]] * 2

    killed = solo(swarm_cmd, tmp_path / "resumed", 2, "--faults.kill_round", "3", "--faults.kill_rank", "1")
    assert killed.returncode != 0 and not (tmp_path / "resumed" / "summary.json").exists()
    resumed = solo(swarm_cmd, tmp_path / "resumed", 2)
    assert resumed.returncode == 0 and "resumed from" in resumed.stderr, resumed.stderr[-3000:]
    (c,) = summary(tmp_path / "resumed")["peers"]
    assert c["final_global_sha256"] == b["final_global_sha256"]
    assert rank_hashes(tmp_path / "resumed") == [b["final_global_sha256"]] * 2


@pytest.mark.timeout(400)
def test_local_swarm_of_two_rank_peers_survives_a_dead_rank(tmp_path, swarm_cmd):
    """With overlap on (two fragments, each landing 1 inner step after its exchange started): rank 0 averages in a
    background thread while both ranks run DDP inner steps, and both ranks take its outcome where it lands."""
    result = swarm_cmd("local", "--config", "configs/tiny.yaml", "--peers", "3", "--nproc-per-node", "2",
                     "--rounds", "3", "--kill", "1@2", "--out", str(tmp_path), *RUN, "--faults.kill_rank", "1",
                     "--diloco.fragments", "2", "--diloco.delay", "1", timeout=380)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    done = summary(tmp_path)
    assert "kill" in [e["event"] for e in done["events"]]
    peers = {p["name"]: p for p in done["peers"]}
    # peer-1's rank 0 was stopped by its launcher (SIGTERM) once rank 1 died, and wrote where it stopped
    assert "peer-1" not in peers or peers["peer-1"]["rounds_completed"] < 3
    live = {name: peers[name] for name in ("peer-0", "peer-2")}
    (final,) = {p["final_global_sha256"] for p in live.values()}
    assert all(p["rounds_completed"] == 3 and p["nproc"] == 2 for p in live.values())
    for name in live:
        assert rank_hashes(tmp_path / name) == [final] * 2


def test_ranks_that_cannot_share_the_batch_or_the_devices_are_refused(swarm_cmd):
    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["--data.batch_size", "8", "--inner.micro_batch_size", "2"])
    check(cfg, 2)
    with pytest.raises(UsageError, match="data.batch_size 8 is not divisible by inner.micro_batch_size 2 x "
                                         "--nproc-per-node 3"):
        check(cfg, 3)
    delayed = load_config(ROOT / "configs" / "tiny.yaml", ["--diloco.delay", "2"])
    check(delayed, 1)
    check(delayed, 2)  # the exchange runs in rank 0's background thread, its outcome reaches the ranks at settle
    more = torch.cuda.device_count() + 1
    cuda = load_config(ROOT / "configs" / "tiny.yaml", ["--diloco.device", "cuda", "--data.batch_size", str(8 * more)])
    with pytest.raises(UsageError, match=f"--nproc-per-node {more} exceeds the {more - 1} CUDA devices"):
        check(cuda, more)
    result = swarm_cmd("peer", "--config", "configs/tiny.yaml", "--solo", "--nproc-per-node", "3", timeout=60)
    assert result.returncode == 2 and "data.batch_size 8 is not divisible by --nproc-per-node 3" in result.stderr


def test_each_rank_takes_its_own_rows_of_the_batch():
    batch = torch.arange(8).view(8, 1)
    rows = [Ranks(rank, 4).slice(batch).flatten().tolist() for rank in range(4)]
    assert rows == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert Ranks.from_env({}).world_size == 1 and Ranks.from_env({"RANK": "1", "WORLD_SIZE": "2"}).rank == 1
