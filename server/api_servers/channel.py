"""`Channel`: one connection between an API process and the engine process, carrying
pickled messages as frames over a Unix socket.

Large arrays (images, video frames, previews) do not go through the pickle stream: pickle
protocol 5 hands them out as out-of-band buffers, which are written as frames of their own
straight from the array's memory and read into writable buffers the arrays are rebuilt on.
Shared memory (`engine.executor.shm`) would save the socket's copy but not the copy out,
and its segments would outlive a receiver killed mid-message, which is one of the faults
this link must survive. Each end asks for socket buffers of `SOCKET_BUFFER` bytes: with
the kernel's default (~208 KiB) a 3 MiB image crossed in ~15 round trips between the two
processes' event loops, each a wake-up and a partial write. What one 1024² image costs
here: `python -m bench.channel_throughput` (on the quiet 2-core development machine 5.6-6.0
ms with the default buffers, 1.4-1.5 ms with 4 MiB ones; Linux caps the request at
`net.core.wmem_max` and `rmem_max`, so a host that keeps them at their ~208 KiB default
keeps the slower figure: raise them there). A `BufferedProtocol` reading straight into the
buffer took another ~0.5 ms off in a throwaway trial (not in the tree), not built.

Both ends are processes of one server run by one user, the socket in a directory only that
user can enter (`supervisor`): pickle is safe between them as between a server and its
worker processes.

Frame: a 4-byte count of parts, an 8-byte length per part, then the parts: the pickle
stream, then each out-of-band buffer in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import socket
import struct
from typing import Any

_COUNT = struct.Struct("!I")
_LENGTH = struct.Struct("!Q")
# Reads of a large part go in chunks of at most this many bytes.
_CHUNK = 1 << 20
# The socket buffers each end asks for: a 1024² RGB image (3 MiB) and its frame in one go.
SOCKET_BUFFER = 4 << 20


class ChannelClosedError(ConnectionError):
    """The other end closed the connection, or its process died."""


class Channel:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        sock = writer.get_extra_info("socket")
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            # Best effort: the kernel caps it (`net.core.wmem_max`, `rmem_max`), and a
            # transport without a socket (a test's) has none to set.
            with contextlib.suppress(OSError, AttributeError):
                sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)

    def send(self, message: Any) -> None:
        """Queue `message` on the connection (never blocks: a frame is written whole, in one
        call, so messages from several tasks never interleave). Raises `ChannelClosedError`
        once the connection is closed."""
        if self._writer.is_closing():
            raise ChannelClosedError("the connection is closed")
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps(message, protocol=5, buffer_callback=buffers.append)
        parts: list[bytes | memoryview] = [data, *(buffer.raw() for buffer in buffers)]
        header = _COUNT.pack(len(parts)) + b"".join(_LENGTH.pack(len(part)) for part in parts)
        self._writer.writelines([header, *parts])

    async def drain(self) -> None:
        """Wait while the peer is slow to read what was sent."""
        await self._writer.drain()

    async def receive(self) -> Any:
        """The next message; `ChannelClosedError` at the end of the connection."""
        try:
            (count,) = _COUNT.unpack(await self._reader.readexactly(_COUNT.size))
            sizes = await self._reader.readexactly(_LENGTH.size * count)
            lengths = [_LENGTH.unpack_from(sizes, i * _LENGTH.size)[0] for i in range(count)]
            data = await self._reader.readexactly(lengths[0])
            buffers = [await self._read_buffer(length) for length in lengths[1:]]
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise ChannelClosedError("the other process closed the connection") from exc
        return pickle.loads(data, buffers=buffers)

    async def _read_buffer(self, length: int) -> bytearray:
        """A writable buffer: an array sent writable is rebuilt writable on it, as if it had
        never crossed a process (pickle marks one sent read-only so)."""
        buffer = bytearray(length)
        view = memoryview(buffer)
        done = 0
        while done < length:
            chunk = await self._reader.read(min(length - done, _CHUNK))
            if not chunk:
                raise asyncio.IncompleteReadError(bytes(view[:done]), length)
            view[done : done + len(chunk)] = chunk
            done += len(chunk)
        return buffer

    def close(self) -> None:
        self._writer.close()

    async def wait_closed(self) -> None:
        """Returns once the connection is closed (after `close`)."""
        await self._writer.wait_closed()

    @property
    def closed(self) -> bool:
        return self._writer.is_closing()
