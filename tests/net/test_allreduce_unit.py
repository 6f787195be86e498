"""AllReduce and codecs in one process (three DHTs, one asyncio loop): validation and time-outs."""

import time

import pytest
import torch
from conftest import run_group, three_dhts
from hivemind.proto import runtime_pb2

from swarm.errors import SwarmError
from swarm.net.allreduce import AllReduceFailed, part_bounds
from swarm.net.codec import CodecError, get_codec


@pytest.fixture(scope="module")
def dhts():
    with three_dhts() as started:
        yield started


def test_part_bounds_cover_everything():
    assert part_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert part_bounds(2, 3) == [(0, 1), (1, 2), (2, 2)]


def test_codecs_round_trip_and_refuse_foreign_payloads():
    x = torch.randn(1000)
    assert torch.equal(get_codec("none").decode(get_codec("none").encode(x), 1000), x)
    assert (get_codec("fp16").decode(get_codec("fp16").encode(x)) - x).abs().max() < 1e-2
    with pytest.raises(CodecError):
        get_codec("none").decode(get_codec("fp16").encode(x))
    with pytest.raises(CodecError):
        get_codec("none").decode(get_codec("none").encode(x), 999)
    forged = runtime_pb2.Tensor(compression=runtime_pb2.NONE, buffer=b"\0" * 8, size=[10**9], dtype="float32")
    with pytest.raises(CodecError):
        get_codec("none").decode(forged)
    with pytest.raises(SwarmError, match="zip"):
        get_codec("zip")


@pytest.mark.timeout(30)
def test_weighted_mean_identical_and_bytes_counted(dhts):
    vectors, weights = [torch.randn(10_001) for _ in range(3)], [1.0, 0.0, 3.0]
    _, results = run_group(dhts, vectors, weights, codec="fp16")
    expected = (vectors[0] * 1 + vectors[2] * 3) / 4
    for r in results:
        assert torch.equal(r.tensor, results[0].tensor)
        assert (r.tensor - expected).abs().max() < 1e-2
        assert r.bytes_sent > 2 * 10_001 * 2 / 3 and r.bytes_received > 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", ["nan", "inf", "negative weight", "nan weight", "zero total"])
def test_bad_input_fails_every_member(dhts, bad):
    vectors, weights = [torch.randn(3000) for _ in range(3)], [1.0, 1.0, 1.0]
    if bad == "nan":
        vectors[1][2500] = float("nan")
    if bad == "inf":
        vectors[1][10] = float("inf")
    if bad == "negative weight":
        weights[2] = -1.0
    if bad == "nan weight":
        weights[0] = float("nan")
    if bad == "zero total":
        weights = [0.0, 0.0, 0.0]
    _, results = run_group(dhts, vectors, weights, group_id=bad.encode())
    assert all(isinstance(r, AllReduceFailed) for r in results), results


@pytest.mark.timeout(30)
def test_missing_member_times_out_and_nobody_hangs(dhts):
    start = time.monotonic()
    _, results = run_group(dhts, [torch.randn(100)] * 3, [1.0] * 3, timeout=2.0, skip={2})
    assert all(isinstance(r, AllReduceFailed) for r in results), results
    assert time.monotonic() - start < 2.0 + 2.0
