"""Tasks and streams end accounted for (swarm/net/tasks.py): no failure is left for the garbage collector to
report (the `no_lost_exceptions` fixture fails a test that leaves one), and a stream we close ends within `stall`
even when its peer reads nothing more."""

import asyncio
import socket
import time

import pytest

from swarm.net.tasks import cancel_all, together
from swarm.net.wire import Channel, Closed, Kind


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
