"""In-process stand-ins for hivemind's P2P: streams between them are socket pairs in this process, so the stream
handlers (`wire.serve`), the state server and the hostile peers' stream attacks run without any daemon."""

from __future__ import annotations

import asyncio
import os
import socket
from dataclasses import dataclass

from hivemind.p2p import PeerID


@dataclass
class StreamInfo:
    peer_id: PeerID  # who opened the stream


class LoopbackNet:
    """P2P stand-ins that reach each other by peer id."""

    def __init__(self):
        self.nodes: dict[PeerID, LoopbackP2P] = {}
        self.tasks: set[asyncio.Task] = set()

    def p2p(self) -> LoopbackP2P:
        node = LoopbackP2P(self, PeerID(b"\x12\x20" + os.urandom(32)))
        self.nodes[node.peer_id] = node
        return node

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class LoopbackP2P:
    """What `wire.py` uses of `hivemind.p2p.P2P`: handlers by name, and streams opened to a peer's handler."""

    def __init__(self, net: LoopbackNet, peer_id: PeerID):
        self.net, self.peer_id = net, peer_id
        self.handlers: dict[str, object] = {}

    async def add_binary_stream_handler(self, name: str, handler) -> None:
        self.handlers[name] = handler

    async def remove_binary_stream_handler(self, name: str) -> None:
        self.handlers.pop(name, None)

    async def call_binary_stream_handler(self, peer: PeerID, name: str):
        node = self.net.nodes.get(peer)
        if node is None or name not in node.handlers:
            raise ConnectionError(f"{peer} has no handler {name!r}")
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=ours)
        their_reader, their_writer = await asyncio.open_connection(sock=theirs)
        task = asyncio.ensure_future(node.handlers[name](StreamInfo(self.peer_id), their_reader, their_writer))
        self.net.tasks.add(task)
        task.add_done_callback(self.net.tasks.discard)
        return StreamInfo(peer), reader, writer
