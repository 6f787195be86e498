"""Quantized all-reduce among 3 members: the fp32 weighted mean within each scheme's bound, identical bytes on
every member, bytes counted, bad input refused naming the sender; and through SwarmAverager processes with
small tensors in fp32 and the error-feedback residual."""

import logging

import pytest
import torch
from conftest import SkipsOwnCheck, run_group, three_dhts
from peer_proc import make_vector

from swarm.net.allreduce import agree, audit
from swarm.net.allreduce.groupstate import AllReduceFailed
from swarm.net.allreduce.layout import WireLayout, gather, scatter
from swarm.net.codec import FP32_BELOW, get_codec

# Bound on |result - exact weighted mean| per element, as a fraction of the largest |input| (one quantization
# of each contribution, one of the result): int8 2/250, int4 2/14; fp16: of the largest |input| there.
ELEMENT_BOUND = {"none": 1e-6, "fp16": 2e-3, "int8": 2 / 250, "int4": 2 / 14}
REL_BOUND = {"none": 1e-6, "fp16": 1e-3, "int8": 0.015, "int4": 0.16}


@pytest.fixture
def dhts():  # fresh daemons per test: once a replica of a daemon shut down, later replicas get no streams
    with three_dhts() as started:
        yield started


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", ["none", "fp16", "int8", "int4"])
def test_three_members_quantized_mean_within_bound_and_identical(dhts, codec):
    numel = 60_001
    vectors = [make_vector(i, numel) for i in range(3)]
    flats = [torch.cat([t.reshape(-1) for t in v]) for v in vectors]
    weights = [5.0, 1.0, 2.0]
    _, results = run_group(dhts, flats, weights, codec=codec, chunk_elements=4096)
    exact = sum(f * w for f, w in zip(flats, weights)) / sum(weights)
    for r in results:
        assert not isinstance(r, BaseException), r
        assert torch.equal(r.tensor, results[0].tensor), "members must hold bit-identical results"
    err = (results[0].tensor - exact).abs()
    stacked = torch.stack(flats).abs()
    scale = stacked.amax(0) if codec == "fp16" else stacked.max()
    assert (err <= ELEMENT_BOUND[codec] * scale + 1e-6).all()
    assert (err.norm() / exact.norm()).item() <= REL_BOUND[codec]
    # bytes: each member sends 2 of its 3 parts and serves its part's result to 2 others (plus frame headers)
    wire = {"none": 4, "fp16": 2, "int8": 1 + 4 / 64, "int4": 0.5 + 4 / 32}[codec]
    for r in results:
        for counted in (r.traffic.sent, r.traffic.received):
            assert 4 / 3 * numel * wire <= counted <= 4 / 3 * numel * wire + 2000 + agree.wire_bytes(3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_nan_contribution_fails_the_part_and_names_the_sender(dhts, codec, caplog):
    flats = [torch.randn(9000) for _ in range(3)]
    flats[1][100] = float("nan")
    with caplog.at_level(logging.WARNING, logger="swarm.net.allreduce"):
        members, results = run_group(dhts, flats, [1.0, 1.0, 1.0], codec=codec, stall=3.0,
                                     hooks={1: {"hooks": SkipsOwnCheck()}})
    assert isinstance(results[0], AllReduceFailed) and isinstance(results[2], AllReduceFailed), results
    # the hostile member cannot even decode its own share: its attempt fails (it stays, to be named), not the peer
    assert isinstance(results[1], AllReduceFailed), results[1]
    layout = WireLayout([torch.Size([9000])], get_codec(codec), 3)
    owner = next(j for j, (s, e) in enumerate(layout.parts) if s <= 100 < e)
    assert owner != 1
    assert f"rejected the contribution of {members[1]}" in caplog.text and "not finite" in caplog.text


def expected_residual(codec, tensors: list[torch.Tensor], layout: WireLayout) -> list[torch.Tensor]:
    """What each chunk of `tensors` loses to `codec` on its way to its owner (exact chunks lose nothing)."""
    out = [torch.zeros_like(t) for t in tensors]
    for j in range(layout.members):
        for chunk in layout.chunks(j):
            if chunk.exact:
                continue
            values = gather(lambda i, a, b: tensors[i].reshape(-1)[a:b], chunk)
            scatter(out, chunk, values - codec.round_trip(values))
    return out


@pytest.mark.timeout(90)
def test_swarm_averagers_int4_small_tensors_fp32_and_residual(bootstrap, peers):
    """3 SwarmAverager processes with int4 + error feedback: the small tensor (8000 < FP32_BELOW elements)
    is averaged exactly, the large one within the int4 bound; each peer's residual is its own loss."""
    numel = 24_000  # make_vector: tensors of 8000 and 16000 elements
    assert numel // 3 < FP32_BELOW <= numel - numel // 3
    jobs = [peers.start(f"p{i}", bootstrap, seed=i, samples=s, numel=numel, compression="int4",
                        error_feedback=True) for i, s in enumerate((3, 1, 2))]
    peers.go()
    outcomes = [peers.wait(j, 60)["outcome"] for j in jobs]
    vectors = [make_vector(j["seed"], numel) for j in jobs]
    weights = [j["samples"] for j in jobs]
    exact = [sum(v[k] * w for v, w in zip(vectors, weights)) / sum(weights) for k in range(2)]
    for o in outcomes:
        assert o["averaged"] is not None, o["note"] + "\n" + peers.logs()
        for a, b in zip(o["averaged"], outcomes[0]["averaged"]):
            assert torch.equal(a, b)
    small, large = outcomes[0]["averaged"]
    assert (small - exact[0]).abs().max() < 1e-6  # fp32 path
    assert (large - exact[1]).abs().max() <= 2 / 14 * max(v[1].abs().max() for v in vectors)
    assert ((large - exact[1]).norm() / exact[1].norm()) < 0.16
    codec = get_codec("int4")
    layout = WireLayout([v.shape for v in vectors[0]], codec, 3)
    per_member = [layout.member_wire_bytes(j) for j in range(3)]
    # swarm.verify_parts (on by default): one chunk of each of the 2 other parts, from each of the 2 others,
    # fetched and served, with 16-byte digests of every member's contribution per result chunk
    chunk = max(layout.codec_of(c).wire_bytes(c.numel) for j in range(3) for c in layout.chunks(j))
    checks = audit.audit_bytes(3, chunk) + 3 * audit.DIGEST * sum(len(layout.chunks(j)) for j in range(3))
    for o, v in zip(outcomes, vectors):
        residual = o["residual"]
        assert residual is not None and torch.equal(residual[0], torch.zeros_like(v[0]))
        assert all(torch.equal(a, b) for a, b in zip(residual, expected_residual(codec, v, layout)))
        # our parts go out and results come back; our own part's result is served to the 2 groupmates as
        # they ask for it, which may be after average() returned, so `sent` has an exact upper bound only
        assert min(per_member) <= o["bytes_received"] <= max(per_member) + 4000 + agree.wire_bytes(3) + checks
        assert 0 < o["bytes_sent"] <= max(per_member) + 4000 + agree.wire_bytes(3) + checks
