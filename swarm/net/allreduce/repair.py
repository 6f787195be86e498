"""A member that lost a part's owner takes that part from a groupmate that holds it (allreduce.py, step 4).

An owner that died after serving some members must not split the group into committers and discarders:
any member holding part j's whole average serves it, in fp32, to a groupmate that asks (`serve_repair`),
until every groupmate is settled or `stall` s passed (`AllReduce._linger`). A member that lost the same owner
before it held the whole part says so at once: when the owner died before anyone held its average (the common
case: it dies while it reduces), every member then fails the attempt within an round trip and retries, instead of
each waiting out `stall` for a groupmate that waits for it in turn.
"""

from __future__ import annotations

import logging

from swarm.net.allreduce.groupstate import SEEN, AllReduceFailed, GroupState
from swarm.net.allreduce.layout import decode_into, gather
from swarm.net.allreduce.slots import GroupSlots
from swarm.net.codec import EXACT, CodecError
from swarm.net.wire import Channel, Kind, WireError

logger = logging.getLogger("swarm.net.allreduce")  # one log for the whole all-reduce


async def repair(slots: GroupSlots, group: GroupState, j: int, lost: Exception) -> None:
    """Take the rest of part j from any groupmate that holds it, in fp32; AllReduceFailed if none does."""
    tried = []
    group.lost.add(j)
    await group.notify()
    for k in [k for k in group.layout.owners if k not in (j, group.me)]:  # a client cannot be dialed
        try:
            channel = await Channel.open(slots.p2p, group.members[k], f"{slots.name}_repair", slots.stall,
                                         group.traffic)
            try:
                await channel.send_control(Kind.HELLO, {"group": group.group_id, "part": j, "start": group.have[j]})
                for chunk in group.chunks[j][group.have[j]:]:
                    payload = await channel.recv_kind(Kind.RESULT, EXACT.wire_bytes(chunk.numel))
                    await slots.cpu(decode_into, group.mine.out, chunk, EXACT, payload)
                    group.have[j] += 1
                group.repaired.add(j)  # no owner's digest to agree on (agree.py)
                await group.notify()
                logger.info(f"all-reduce: part {j} repaired from {group.members[k]}")
                return
            finally:
                channel.close()
        except (WireError, CodecError) as e:
            tried.append(f"{group.members[k]}: {e}")
    raise AllReduceFailed(f"part {j}: its owner {group.members[j]} was lost ({lost}) and no groupmate "
                          f"could send it ({'; '.join(tried) or 'nobody else in the group'})", group.members[j], SEEN)


async def serve_repair(slots: GroupSlots, channel: Channel) -> None:
    """Send part j of a complete group's average, in fp32, to a groupmate that lost j's owner."""
    if not slots.access.admits(channel.peer):
        return await channel.refuse(slots.access.refusal(channel.peer))
    hello = await channel.recv_control()
    group = slots.held(hello.get("group"))
    j, start = hello.get("part"), hello.get("start")
    valid = (group is not None and channel.peer in group.members and isinstance(j, int)
             and 0 <= j < len(group.members) and isinstance(start, int) and 0 <= start <= len(group.chunks[j]))
    if not valid:
        return await channel.refuse("no such group or part here")
    channel.count_into(group.traffic)
    try:
        await group.wait_for(lambda: group.have[j] == len(group.chunks[j]) or j in group.lost, slots.stall,
                             f"part {j}")
        if group.have[j] < len(group.chunks[j]):
            return await channel.refuse(f"lost the owner of part {j} too, before it sent the whole average")
        for chunk in group.chunks[j][start:]:
            values = await slots.cpu(gather, group.read_out, chunk)
            await channel.send(Kind.RESULT, values.numpy().tobytes())
    except (AllReduceFailed, WireError) as e:
        await channel.fail(str(e), getattr(e, "culprit", None))
