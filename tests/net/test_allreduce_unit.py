"""The streamed all-reduce in one process (three DHTs, one asyncio loop): layout, arithmetic, validation,
time-outs, and a member that lost a part's owner taking that part from a groupmate."""

import asyncio
import logging
import time

import pytest
import torch
from conftest import all_reduces, run_group, three_dhts

from swarm.net import grouping
from swarm.net.allreduce import AllReduceHooks, groupstate
from swarm.net.allreduce.groupstate import AllReduceFailed, Contribution
from swarm.net.allreduce.layout import WireLayout, part_bounds
from swarm.net.codec import FP32_BELOW, get_codec
from swarm.net.matchmaking import Group
from swarm.net.wire import Kind, WireError


@pytest.fixture
def dhts():  # fresh daemons per test: once a replica of a daemon shut down, later replicas get no streams
    with three_dhts() as started:
        yield started


def test_part_bounds_cover_everything():
    assert part_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert part_bounds(2, 3) == [(0, 1), (1, 2), (2, 2)]


def test_layout_puts_small_tensors_last_and_chunks_never_straddle_them():
    shapes = [torch.Size([100]), torch.Size([300, 100]), torch.Size([FP32_BELOW - 1]), torch.Size([20_000])]
    layout = WireLayout(shapes, get_codec("int8"), 3, chunk_elements=4096)
    assert layout.order == [1, 3, 0, 2] and layout.exact_from == 30_000 + 20_000
    seen = []
    for j in range(3):
        chunks = layout.chunks(j)
        assert chunks[0].start == layout.parts[j][0] and chunks[-1].end == layout.parts[j][1]
        for c in chunks:
            assert c.numel <= 4096 and (c.end <= layout.exact_from or c.start >= layout.exact_from)
            assert c.exact == (c.start >= layout.exact_from)
            seen += [(s.tensor, i) for s in c.spans for i in range(s.start, s.end)]
    assert sorted(seen) == sorted((t, i) for t, s in enumerate(shapes) for i in range(s.numel()))  # each once
    lossless = WireLayout(shapes, get_codec("none"), 2)
    assert lossless.order == [0, 1, 2, 3] and lossless.exact_from == lossless.numel
    assert not any(c.exact for j in range(2) for c in lossless.chunks(j))


@pytest.mark.timeout(30)
def test_weighted_mean_identical_and_bytes_counted(dhts):
    vectors, weights = [torch.randn(10_001) for _ in range(3)], [1.0, 0.0, 3.0]
    _, results = run_group(dhts, vectors, weights, codec="fp16", chunk_elements=1024)
    expected = (vectors[0] * 1 + vectors[2] * 3) / 4
    for r in results:
        assert not isinstance(r, BaseException), r
        assert torch.equal(r.tensor, results[0].tensor)
        assert (r.tensor - expected).abs().max() < 1e-2
        assert r.traffic.sent > 2 * 10_001 * 2 / 3 and r.traffic.received > 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("codec", ["int8", "int4", "fp16", "none"])
def test_an_average_kept_encoded_decodes_to_the_same_floats(dhts, codec):
    """The average kept in the wire's bytes until read (EncodedAverage, what a networked peer's outer step reads)
    is the average decoded on arrival, bit for bit, tensor by tensor, quantized and fp32-carried tensors alike; it
    holds about the wire's bytes, not 4 per element; and it gives nothing while any tensor is incomplete."""
    shapes = [torch.Size([3, 3000]), torch.Size([FP32_BELOW - 1]), torch.Size([100, 70]), torch.Size([5])]
    vectors = [torch.randn(sum(s.numel() for s in shapes)) for _ in range(3)]
    _, results = run_group(dhts, vectors, [1.0, 2.0, 3.0], codec=codec, chunk_elements=2048, shapes=shapes,
                           encoded=(1, 2))  # member 0 decodes on arrival, as ever
    assert all(not isinstance(r, BaseException) for r in results), results
    assert all(torch.equal(r.tensor, results[0].tensor) for r in results)
    from swarm.net.allreduce import EncodedAverage
    from swarm.net.allreduce.layout import decode_into

    layout = WireLayout(shapes, get_codec(codec), 1, 2048)
    average = EncodedAverage(shapes)
    chunks = layout.chunks(0)
    for chunk in chunks[:-1]:
        decode_into(average, chunk, layout.codec_of(chunk), layout.codec_of(chunk).encode(torch.ones(chunk.numel)))
    with pytest.raises(ValueError, match="incomplete"):
        next(average.each())
    last = chunks[-1]
    decode_into(average, last, layout.codec_of(last), layout.codec_of(last).encode(torch.ones(last.numel)))
    got = dict(average.each())
    assert sorted(got) == [0, 1, 2, 3] and all(torch.equal(got[i], torch.ones(s)) for i, s in enumerate(shapes))
    assert average.nbytes == layout.part_wire_bytes(0)  # int8: 1.0625 bytes per quantized element
    own = [torch.randn(s) for s in shapes]  # a peer alone: its own pseudo-gradient, kept exactly
    average.fill(lambda i, a, b: own[i].reshape(-1)[a:b].clone())
    got = dict(average.each())
    assert all(torch.equal(got[i], own[i]) for i in range(len(shapes)))


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
    _, results = run_group(dhts, vectors, weights, group_id=bad.encode(), stall=3.0)
    assert all(isinstance(r, AllReduceFailed) for r in results), results


@pytest.mark.timeout(30)
def test_missing_member_stalls_out_and_nobody_hangs(dhts):
    start = time.monotonic()
    _, results = run_group(dhts, [torch.randn(100)] * 3, [1.0] * 3, stall=2.0, skip={2})
    assert all(isinstance(r, AllReduceFailed) for r in results), results
    assert time.monotonic() - start < 2.0 + 3.0


@pytest.mark.timeout(30)
def test_a_member_that_leaves_the_group_is_not_waited_for(dhts):
    """Member 2's matchmaking barrier failed (a phantom group for it): it says so, and the others drop the
    group at once instead of waiting stall_timeout for its parts."""
    start = time.monotonic()
    members, results = run_group(dhts, [torch.randn(100)] * 3, [1.0] * 3, stall=10.0, abandon={2})
    assert all(isinstance(r, AllReduceFailed) and f"{members[2]} left the group" in str(r) for r in results), results
    assert time.monotonic() - start < 5.0


@pytest.mark.timeout(40)
def test_a_member_adopts_whom_the_groupmates_that_stay_left_out_and_declines_the_rest(dhts):
    """Member 0 leaves group g for g without member 2 (grouping.without) and says so: member 1, whose run of g
    fails on it, adopts that set (the one other member that stays named it). A set named after member 1 chose
    ({0}, by member 2) is declined: member 2's run of g without 0 fails at once on member 1's word, not after a
    stall. (Member 1's run fails on member 0's word, so that word is in when it chooses: a set named only after
    another failure is declined, as here.)"""
    g = b"g" * 16

    def contribution(out):
        return Contribution(lambda i, a, b: torch.ones(b - a), 1.0, out)

    async def main():
        async with all_reduces(dhts, stall=10.0) as (p2ps, services):
            members = [p2p.peer_id for p2p in p2ps]
            ids = [str(m) for m in members]
            group = Group(g, members, [{} for _ in members])
            layout = WireLayout([torch.Size([100])], get_codec("none"), 3)
            run = asyncio.ensure_future(services[1].run(g, members, layout, contribution([torch.zeros(100)]),
                                                        [1.0] * 3))
            await services[0].abandon(g, [members[1]], "offenders left out", dropped=[ids[2]])  # fails `run`
            with pytest.raises(AllReduceFailed, match="left the group"):
                await run
            chosen = await services[1].regroup(g, lambda named: grouping.adopted(group, ids[1], named), 5.0)
            await services[2].abandon(g, [members[1]], "offenders left out", dropped=[ids[0]])
            sub = grouping.without(group, frozenset({ids[0]}))
            with pytest.raises(AllReduceFailed, match=f"{ids[1]} left the group: we do not leave out"):
                await services[2].run(sub.group_id, sub.members, WireLayout([torch.Size([100])], get_codec("none"), 2),
                                      contribution([torch.zeros(100)]), [1.0] * 2)
            return ids, chosen
    ids, chosen = asyncio.run(main())
    assert chosen == frozenset({ids[2]})


@pytest.mark.timeout(30)
def test_a_member_pushing_more_than_its_part_is_refused(dhts, caplog):
    """Member 2 sends one chunk more to every owner than the layout gives it: each owner names it."""
    class PushesMore(AllReduceHooks):
        async def push(self, group, j, channel, push):
            await push(None)
            await channel.send(Kind.CHUNK, b"\0" * 16)
    with caplog.at_level(logging.WARNING, logger="swarm.net.allreduce"):
        members, results = run_group(dhts, [torch.randn(3000) for _ in range(3)], [1.0] * 3, group_id=b"more",
                                     stall=3.0, hooks={2: {"hooks": PushesMore()}})
    assert "sent more than its part" in caplog.text and str(members[2]) in caplog.text, (results, caplog.text)


@pytest.mark.timeout(30)
def test_a_member_pushing_less_than_its_part_fails_the_part(dhts, caplog):
    """Member 1 closes its streams after the first chunk: the owners fail their parts naming it."""
    class PushesOne(AllReduceHooks):
        async def push(self, group, j, channel, push):
            await push(1)
            channel.close()
    with caplog.at_level(logging.WARNING, logger="swarm.net.allreduce"):
        members, results = run_group(dhts, [torch.randn(6000) for _ in range(3)], [1.0] * 3, group_id=b"less",
                                     stall=3.0, chunk_elements=512, hooks={1: {"hooks": PushesOne()}})
    assert isinstance(results[0], AllReduceFailed) and isinstance(results[2], AllReduceFailed), results
    assert f"rejected the contribution of {members[1]}" in caplog.text


@pytest.mark.timeout(40)
@pytest.mark.parametrize("encoded", [False, True], ids=["decoded", "encoded"])
def test_a_lost_owner_s_part_comes_from_a_groupmate(dhts, caplog, encoded):
    """Owner 0 has every contribution and serves its part's averages to member 1, but its stream to member 2
    breaks before the last chunk, as when it dies: member 2 takes the rest of part 0 from member 1, and all
    three end with the same bytes (also where members 1 and 2 keep the averages encoded: member 1 serves the
    repair from the bytes it kept)."""
    class LosesMember2(AllReduceHooks):
        async def sending_result(self, group, i, k, channel):
            last = len(group.chunks[0]) - 1
            if i == 2 and k == last:
                await group.wait_for(lambda: group.have[0] == last + 1, None, "part 0")
                channel.close()
                raise WireError("the owner died")
    vectors = [torch.randn(30_000) for _ in range(3)]
    with caplog.at_level(logging.INFO, logger="swarm.net.allreduce"):
        members, results = run_group(dhts, vectors, [1.0, 2.0, 3.0], group_id=b"repair", stall=3.0,
                                     chunk_elements=2048, hooks={0: {"hooks": LosesMember2()}},
                                     encoded=(1, 2) if encoded else ())
    assert all(not isinstance(r, BaseException) for r in results), results
    assert f"part 0 repaired from {members[1]}" in caplog.text
    expected = (vectors[0] + 2 * vectors[1] + 3 * vectors[2]) / 6
    for r in results:
        assert torch.equal(r.tensor, results[0].tensor)
        assert (r.tensor - expected).abs().max() < 1e-5


@pytest.mark.timeout(40)
def test_an_owner_lost_before_anyone_held_its_part_fails_the_attempt_at_once(dhts):
    """Owner 0 dies before it sends any average: members 1 and 2 each ask the other for part 0, and each answers
    that it lost owner 0 too, so both fail naming owner 0 (not after a stall waited out while each waits for the
    other), and retry. Owner 0 dies once it holds every contribution to its part (two chunks: within the window,
    so no result has to go out first): a stream it closed while it still read from it would read as the member
    having closed it, and an owner still alive to say so would blame that member."""
    class DiesBeforeResults(AllReduceHooks):  # its streams to the members close; it says nothing more
        async def sending_result(self, group, i, k, channel):
            await group.wait_for(lambda: group.have[group.me] == len(group.chunks[group.me]), None, "contributions")
            channel.close()
            await asyncio.sleep(3600)
    members, results = run_group(dhts, [torch.randn(12_000) for _ in range(3)], [1.0] * 3, group_id=b"lost",
                                 stall=5.0, chunk_elements=2048, hooks={0: {"hooks": DiesBeforeResults()}})
    for r in results[1:]:  # which stream's end each member sees first varies; none waits out its stall
        assert isinstance(r, AllReduceFailed) and r.culprit == members[0], r
        assert "sent no byte for" not in str(r) and "not done within" not in str(r), r


@pytest.mark.timeout(30)
def test_memory_stays_bounded_by_the_window(dhts):
    """An owner never holds more than WINDOW chunks of contributions from its members, however fast they push."""
    peak = []

    class Watches(AllReduceHooks):  # samples how many chunks each owner holds, until its group is done
        sampling = []

        def started(self, group):
            async def sample():
                while group.failure is None and not group.complete():
                    peak.append(len(group.pending))
                    await asyncio.sleep(0.001)  # a poll, not a spin: a spinning sampler starves the loop it watches
            self.sampling.append(asyncio.ensure_future(sample()))
    _, results = run_group(dhts, [torch.randn(200_000) for _ in range(3)], [1.0] * 3, group_id=b"window",
                           chunk_elements=1024, hooks={i: {"hooks": Watches()} for i in range(3)})
    assert all(not isinstance(r, BaseException) for r in results), results
    assert 0 < max(peak) <= groupstate.WINDOW + 1
