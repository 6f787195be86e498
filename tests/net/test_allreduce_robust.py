"""Bounded influence in the streamed all-reduce, in one process (three DHTs): a weight claim of 1e30 capped,
a 1e6x contribution trimmed away, owners audited (an honest group passes, a lying owner is named)."""

import pytest
import torch
from conftest import SkipsOwnCheck, run_group, three_dhts

from swarm.net.allreduce import agree
from swarm.net.allreduce.groupstate import PROOF, SEEN, TOLD, AllReduceFailed
from swarm.net.allreduce.layout import WireLayout
from swarm.net.allreduce.robust import Rule
from swarm.net.codec import get_codec
from swarm.net.hostile import Attacker, Hooks
from swarm.net.wire import Channel


@pytest.fixture
def dhts():  # fresh daemons per test: once a replica of a daemon shut down, later replicas get no streams
    with three_dhts() as started:
        yield started


@pytest.mark.timeout(30)
def test_a_weight_of_1e30_gets_the_capped_share(dhts):
    vectors = [torch.randn(5000) for _ in range(3)]
    _, results = run_group(dhts, vectors, [1e30, 2.0, 2.0], rule=Rule(max_weight_share=0.5), chunk_elements=1024)
    expected = 0.5 * vectors[0] + 0.25 * vectors[1] + 0.25 * vectors[2]
    for r in results:
        assert not isinstance(r, BaseException), r
        assert torch.equal(r.tensor, results[0].tensor)
        assert (r.tensor - expected).abs().max() < 1e-5


@pytest.mark.timeout(30)
@pytest.mark.parametrize("aggregation", ["trimmed_mean", "centered_clip"])
def test_a_1e6x_contribution_is_bounded(dhts, aggregation):
    """Member 1 sends 1e6 times its vector. trimmed_mean of 3 is the coordinate-wise median; centered clip
    stays within the honest spread (the mean would be ~3e5 x)."""
    vectors = [torch.randn(6000) for _ in range(3)]
    vectors[1] = vectors[1] * 1e6
    _, results = run_group(dhts, vectors, [1.0, 1.0, 1.0], rule=Rule(aggregation), chunk_elements=1024)
    for r in results:
        assert not isinstance(r, BaseException), r
        assert torch.equal(r.tensor, results[0].tensor)
    got = results[0].tensor
    if aggregation == "trimmed_mean":
        assert torch.allclose(got, torch.stack(vectors).median(0).values, rtol=1e-6, atol=1e-6)
    else:
        assert got.abs().max() < 20 and got.norm() < 2 * vectors[0].norm()


@pytest.mark.timeout(30)
def test_norm_clip_bounds_a_1e6x_contribution(dhts):
    """Member 2 sends 1e6 x; clip_norm_ratio 1 cuts it, chunk by chunk, to the lower median norm."""
    vectors = [torch.randn(4096) for _ in range(3)]
    vectors[2] = vectors[2] * 1e6
    _, results = run_group(dhts, vectors, [1.0, 1.0, 1.0], rule=Rule(clip_norm_ratio=1.0), chunk_elements=1024)
    assert all(not isinstance(r, BaseException) for r in results), results
    got = results[0].tensor
    assert got.norm() < vectors[0].norm() + vectors[1].norm()  # the plain mean's norm is ~3e5 x larger


@pytest.mark.timeout(40)
@pytest.mark.parametrize("codec", ["none", "int8"])
def test_audited_honest_group_passes_and_counts_the_audit_bytes(dhts, codec):
    numel, chunk = 30_000, 2048
    vectors = [torch.randn(numel) for _ in range(3)]
    rule = Rule("trimmed_mean", 4.0, 0.5, verify=True)
    members, results = run_group(dhts, vectors, [1.0, 2.0, 3.0], rule=rule, codec=codec, chunk_elements=chunk)
    layout = WireLayout([torch.Size([numel])], get_codec(codec), 3, chunk)
    for me, r in enumerate(results):
        assert not isinstance(r, BaseException), r
        assert torch.equal(r.tensor, results[0].tensor)
        # on top of the all-reduce's bytes: one fetched chunk from each of the 2 others for each of the 2
        # other parts (4 at most 2048 elements each), and 3 x 16 bytes of digests per result chunk taken
        others = [j for j in range(3) if j != me]
        digests = 48 * sum(len(layout.chunks(j)) for j in others)
        base = layout.member_wire_bytes(me) + digests
        frames = 5 * (2 * len(layout.chunks(0)) * 3 + 20)
        assert base + 2 * 2 * 64 <= r.traffic.received <= (base + 4 * layout.codec.wire_bytes(chunk) + frames + 500
                                                            + agree.wire_bytes(3))  # the owners' digests
    if codec == "none":  # trimmed mean of 3: the coordinate-wise median
        assert torch.allclose(results[0].tensor, torch.stack(vectors).median(0).values, rtol=1e-6, atol=1e-6)


@pytest.mark.timeout(40)
def test_an_owner_returning_a_wrong_average_is_named(dhts):
    """Member 0 adds 1e-3 to one chunk of its part's average (on every member, itself included): every
    member that audits that chunk names it, and with verify_parts nobody returns the wrong average."""
    class LiesOnItsFirstChunk(Hooks):
        def average(self, values, chunk):
            return values + 1e-3 if chunk == 0 else values
    vectors = [torch.randn(3000) for _ in range(3)]  # one chunk per part: every audit picks the lie
    members, results = run_group(dhts, vectors, [1.0, 1.0, 1.0], rule=Rule(verify=True),
                                 hooks={0: {"hooks": LiesOnItsFirstChunk()}}, stall=5.0)
    assert all(isinstance(r, AllReduceFailed) for r in results), results
    for r in results[1:]:  # each found it itself (a groupmate's word would name nobody)
        assert f"owner {members[0]} returned a wrong average" in str(r) and r.culprit == members[0], results
    assert isinstance(results[0], AllReduceFailed)  # the liar is refused too: the others' FAIL reached it


@pytest.mark.timeout(30)
def test_a_weight_other_than_announced_is_refused_naming_its_sender(dhts, monkeypatch):
    """Member 1 announced 7 samples (the weights every member holds) but says 7e6 in its HELLOs. Each owner that
    reads such a HELLO names member 1 (PROOF); member 2 may get owner 0's FAIL, or member 1's own FAIL (its
    group failed when owner 0 refused it), before member 1's HELLO: every FAIL names the culprit, so member 2
    names member 1 whichever arrives first (TOLD, then: not an offense)."""
    send_control = Channel.send_control

    async def lying(self, kind, value):
        if value.get("weight") == 7.0:
            value = dict(value, weight=7e6)
        await send_control(self, kind, value)
    monkeypatch.setattr(Channel, "send_control", lying)
    members, results = run_group(dhts, [torch.randn(3000) for _ in range(3)], [1.0, 7.0, 1.0], stall=3.0)
    for i in (0, 2):
        assert isinstance(results[i], AllReduceFailed) and results[i].culprit == members[1], results
        assert "sent weight 7000000.0, not the 7.0 it announced" in str(results[i])
    assert results[0].blame == PROOF and results[2].blame in (PROOF, TOLD), results


@pytest.mark.timeout(30)
def test_a_nan_contribution_names_its_sender_as_culprit(dhts):
    vectors = [torch.randn(3000) for _ in range(3)]
    vectors[1][100] = float("nan")  # in part 0: owner 0 sees it itself
    members, results = run_group(dhts, vectors, [1.0, 1.0, 1.0], stall=3.0, hooks={1: {"hooks": SkipsOwnCheck()}})
    assert isinstance(results[0], AllReduceFailed) and results[0].culprit == members[1], results
    assert all(isinstance(r, AllReduceFailed) for r in results)


@pytest.mark.timeout(30)
def test_an_unreadable_hello_names_its_sender(dhts, monkeypatch):
    send_control = Channel.send_control

    async def garbled(self, kind, value):
        if value.get("weight") == 7.0:  # member 1's HELLOs: 0xc1 is a byte msgpack never uses
            return await self.send(kind, b"\xc1\xc1\xc1")
        await send_control(self, kind, value)
    monkeypatch.setattr(Channel, "send_control", garbled)
    members, results = run_group(dhts, [torch.randn(3000) for _ in range(3)], [1.0, 7.0, 1.0], stall=3.0)
    for i in (0, 2):
        assert isinstance(results[i], AllReduceFailed) and results[i].culprit == members[1], results
        assert "unreadable HELLO" in str(results[i])


@pytest.mark.timeout(40)
def test_an_owner_sending_members_different_bytes_is_named_and_nobody_returns(dhts):
    """The `lying-owner` attack: owner 0 sends member 1 other bytes of its part than member 2, signing the digest of
    what each got. Members compare the owners' signed digests before returning (agree.py): two digests of part 0,
    both signed by owner 0, prove it; no member returns an average, so none would commit a different hash."""
    vectors = [torch.randn(3000) for _ in range(3)]
    members, results = run_group(dhts, vectors, [1.0, 1.0, 1.0], hooks={0: {"hooks": Attacker(["lying-owner"])}},
                                 stall=5.0)
    assert all(isinstance(r, AllReduceFailed) for r in results), results
    for r in results[1:]:
        assert r.culprit == members[0], results
        assert f"its owner {members[0]} sent" in str(r) and "other bytes than it sent others" in str(r), results
    assert any(r.blame == PROOF for r in results[1:]), results  # at least one caught it itself, the other maybe told


@pytest.mark.timeout(40)
def test_an_honest_group_agrees_on_every_part(dhts):
    vectors = [torch.randn(5000) for _ in range(3)]
    members, results = run_group(dhts, vectors, [1.0, 2.0, 3.0], chunk_elements=1024)
    expected = (vectors[0] + 2 * vectors[1] + 3 * vectors[2]) / 6
    for r in results:
        assert not isinstance(r, BaseException), r
        assert torch.equal(r.tensor, results[0].tensor) and (r.tensor - expected).abs().max() < 1e-5


@pytest.mark.timeout(40)
def test_a_member_that_goes_silent_mid_part_is_named_by_every_owner(dhts):
    """The `stall-silent` attack: member 2 pushes the first chunk of each part and then nothing, its streams open.
    Each owner waits `stall` s and names it (SEEN: left out for the round, not an offense)."""
    members, results = run_group(dhts, [torch.randn(6000) for _ in range(3)], [1.0, 1.0, 1.0], chunk_elements=1024,
                                 hooks={2: {"hooks": Attacker(["stall-silent"])}}, stall=2.0)
    for r in results[:2]:
        assert isinstance(r, AllReduceFailed) and r.culprit == members[2], results
        assert r.blame in (SEEN, TOLD), results
    assert any(r.blame == SEEN for r in results[:2]), results


@pytest.mark.timeout(40)
def test_a_member_answering_audits_with_other_bytes_is_named_by_its_own_signature(dhts):
    """Member 2 pushes honest chunks but answers every audit with one byte flipped. Each auditor's check finds
    its bytes and the owner's digest apart; the owner's evidence (member 2's signature over what it pushed)
    names member 2, never the owner (before: the round failed naming nobody)."""
    class LiesInAudits(Hooks):
        def audited(self, payload):
            return bytes([payload[0] ^ 0xFF]) + bytes(payload[1:])
    vectors = [torch.randn(3000) for _ in range(3)]
    members, results = run_group(dhts, vectors, [1.0, 1.0, 1.0], rule=Rule(verify=True), stall=5.0,
                                 hooks={2: {"hooks": LiesInAudits()}})
    assert all(isinstance(r, AllReduceFailed) for r in results), results
    for r in results[:2]:
        assert r.culprit == members[2] and r.blame == PROOF, results
        assert "answered our audit of chunk 0 with other bytes than it signed" in str(r), results


@pytest.mark.timeout(40)
def test_an_owner_committing_a_digest_a_member_did_not_sign_is_named(dhts):
    """Owner 0 commits a false digest of member 1's contribution to every chunk (the prefix of its results):
    member 2's audit finds member 1's bytes and that digest apart, and member 1's signature names the owner."""
    class FramesMember1(Hooks):
        def result(self, group, i, k, payload):
            false = bytes(16 * [0xAB])
            return payload[:16] + false + payload[32:]
    vectors = [torch.randn(3000) for _ in range(3)]
    members, results = run_group(dhts, vectors, [1.0, 1.0, 1.0], rule=Rule(verify=True), stall=5.0,
                                 hooks={0: {"hooks": FramesMember1()}})
    assert all(isinstance(r, AllReduceFailed) for r in results), results
    assert results[2].culprit == members[0] and results[2].blame == PROOF, results
    assert f"owner {members[0]} committed a digest of {members[1]}'s chunk 0" in str(results[2]), results
    assert results[1].culprit == members[0], results  # its own contribution misreported: it sees that itself


@pytest.mark.timeout(40)
def test_an_owner_answering_the_audit_of_its_own_chunk_with_other_bytes_is_named(dhts):
    """Two members: the only part member 1 audits is owner 0's, whose own contribution owner 0 re-sends with a
    byte flipped: its digest and its answer are both its word, so it is named without evidence."""
    class LiesInAudits(Hooks):
        def audited(self, payload):
            return bytes([payload[0] ^ 0xFF]) + bytes(payload[1:])
    members, results = run_group(dhts[:2], [torch.randn(3000) for _ in range(2)], [1.0, 1.0], rule=Rule(verify=True),
                                 stall=5.0, hooks={0: {"hooks": LiesInAudits()}})
    assert isinstance(results[1], AllReduceFailed) and results[1].culprit == members[0], results
    assert "answered our audit of its own chunk 0" in str(results[1]), results
