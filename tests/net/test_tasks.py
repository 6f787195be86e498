"""Tasks and streams end accounted for (swarm/net/tasks.py): no failure is left for the garbage collector to
report (the `no_lost_exceptions` fixture fails a test that leaves one), and a stream we close ends within `stall`
even when its peer reads nothing more."""

import asyncio
import socket
import time

import pytest
from hivemind.p2p import PeerID

from swarm.net.tasks import cancel_all, together
from swarm.net.wire import Channel, Closed, Kind, PeerFailed


async def fails(n: int) -> None:
    raise ValueError(n)


def test_steps_that_fail_together_raise_one_failure_and_leave_none_untaken():
    async def main():
        with pytest.raises(ValueError):
            await together(fails(1), fails(2))
    asyncio.run(main())


def test_cancel_all_takes_a_failure_that_came_before_or_despite_the_cancel():
    async def stubborn() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            raise ValueError("failed while cancelled") from None

    async def main():
        ended, pending = asyncio.ensure_future(fails(1)), asyncio.ensure_future(stubborn())
        await asyncio.sleep(0.01)
        cancel_all([ended, pending])
        await asyncio.sleep(0.01)
        assert ended.done() and pending.done() and not pending.cancelled()
    asyncio.run(main())


async def pair() -> tuple[Channel, asyncio.StreamReader, asyncio.StreamWriter]:
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=ours)
    their_reader, their_writer = await asyncio.open_connection(sock=theirs)
    return Channel(reader, writer, "peer", stall=0.5), their_reader, their_writer


def test_a_stream_its_peer_broke_closes_and_its_error_is_taken():
    async def main():
        channel, _, their_writer = await pair()
        their_writer.transport.abort()
        with pytest.raises(Closed):
            for _ in range(100):
                await channel.send(Kind.DATA, b"x" * 65536)
        channel.close()
        await asyncio.sleep(0.05)
        assert channel.writer.transport.is_closing()
    asyncio.run(main())


def test_a_stream_whose_peer_reads_nothing_is_cut_stall_seconds_after_we_close_it():
    async def main():
        channel, their_reader, _ = await pair()
        channel.writer.write(b"x" * (64 << 20))  # far more than the sockets hold: the rest waits in our buffer
        start = time.monotonic()
        channel.close()
        await asyncio.wait_for(channel.writer.wait_closed(), 5.0)
        assert 0.4 < time.monotonic() - start < 2.0  # stall is 0.5 s
    asyncio.run(main())


def test_a_send_cancelled_mid_frame_still_lets_our_fail_through():
    """A push cancelled between the pieces of its frame (our group failed meanwhile): the frame's rest goes out
    behind it, then our FAIL, naming the culprit we know; the peer reads a whole frame and then the FAIL, rather
    than a stream that closed (for which it would blame us)."""
    async def main():
        channel, their_reader, their_writer = await pair()
        theirs = Channel(their_reader, their_writer, "us", stall=5.0)
        payload = bytes(range(256)) * (16 << 10)  # 4 MiB: more than the sockets hold before the peer reads
        sending = asyncio.ensure_future(channel.send(Kind.DATA, payload))
        await asyncio.sleep(0.05)
        assert not sending.done()
        sending.cancel()
        culprit = PeerID(b"\x12\x20" + bytes(32))
        await channel.fail("lost the owner of part 0", culprit)
        kind, got = await theirs.recv(len(payload))
        assert kind == Kind.DATA and got == payload
        with pytest.raises(PeerFailed) as failed:
            await theirs.recv(len(payload))
        assert "lost the owner of part 0" in str(failed.value) and failed.value.culprit == culprit
        channel.close()
        theirs.close()
    asyncio.run(main())
