"""What one image costs on the API servers' IPC link (`server.api_servers.channel`): 100
answers carrying a 1024x1024 RGB array sent over a Unix socket pair in one event loop,
pickled, framed, read and rebuilt, as the engine process and an API process do.

    python -m bench.channel_throughput
"""

from __future__ import annotations

import asyncio
import socket
import time

import numpy as np

from engine.request import RequestOutput
from server.api_servers.channel import Channel

IMAGES = 100


async def run() -> float:
    left, right = socket.socketpair()
    sender = Channel(*await asyncio.open_unix_connection(sock=left))
    receiver = Channel(*await asyncio.open_unix_connection(sock=right))
    image = np.zeros((1024, 1024, 3), np.uint8)

    async def send() -> None:
        for i in range(IMAGES):
            sender.send(RequestOutput(str(i), (image,), (i,)))
            await sender.drain()

    start = time.perf_counter()
    sending = asyncio.create_task(send())
    for _ in range(IMAGES):
        await receiver.receive()
    await sending
    seconds = (time.perf_counter() - start) / IMAGES
    for channel in (sender, receiver):
        channel.close()
        await channel.wait_closed()
    return seconds


def main() -> None:
    seconds = asyncio.run(run())
    print(f"{seconds * 1000:.1f} ms per 1024² image ({3 * 2**20 / seconds / 1e6:.0f} MB/s)")


if __name__ == "__main__":
    main()
