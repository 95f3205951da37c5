"""The frames between an API process and the engine process: arrays cross as out-of-band
buffers and arrive as they were sent (writable: a read-only one stays read-only, as pickle
protocol 5 keeps); a peer that goes away is a `ChannelClosedError`."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

from engine.request import RequestOutput
from server.api_servers.channel import SOCKET_BUFFER, Channel, ChannelClosedError
from server.api_servers.messages import Finished, ForRequest


async def _pair() -> tuple[Channel, Channel]:
    left, right = socket.socketpair()
    a = Channel(*await asyncio.open_unix_connection(sock=left))
    b = Channel(*await asyncio.open_unix_connection(sock=right))
    return a, b


def test_each_end_asks_for_socket_buffers_that_hold_an_image() -> None:
    """As large as the kernel lets it (Linux caps a request at net.core.wmem_max / rmem_max
    and reports twice what it keeps), so a 1024² image crosses in a few round trips."""

    def cap(name: str) -> int:
        with open(f"/proc/sys/net/core/{name}") as limit:
            return int(limit.read())

    async def run() -> None:
        for sock in socket.socketpair():
            channel = Channel(*await asyncio.open_unix_connection(sock=sock))
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= min(SOCKET_BUFFER, cap("wmem_max"))
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) >= min(SOCKET_BUFFER, cap("rmem_max"))
            channel.close()
            await channel.wait_closed()

    asyncio.run(run())


def test_an_image_crosses_whole_and_writable() -> None:
    async def run() -> None:
        sender, receiver = await _pair()
        image = np.random.default_rng(0).integers(0, 256, (512, 512, 3), dtype=np.uint8)
        sender.send(ForRequest("r1", Finished("engine", output=RequestOutput("r1", (image,), (7,)))))
        sender.send("next")
        message = await receiver.receive()
        assert await receiver.receive() == "next"  # frames never run into each other
        assert isinstance(message, ForRequest) and isinstance(message.event, Finished)
        output = message.event.output
        assert output is not None and output.seeds == (7,)
        got = output.images[0]
        assert got.flags.writeable and (got == image).all()
        sender.close()
        await sender.wait_closed()
        with pytest.raises(ChannelClosedError):
            await receiver.receive()
        receiver.close()
        await receiver.wait_closed()

    asyncio.run(run())
