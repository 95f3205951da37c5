"""Webhook receivers for the tests: a small HTTP server on loopback that records what it is
sent and answers each request with the next status of its script (then 200); and raw ones
that misbehave (hang, trickle, send a huge body)."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    url: str
    script: list[int] = field(default_factory=list)  # statuses to answer first, in order
    received: list[Received] = field(default_factory=list)

    def answer(self, request: Received) -> int:
        self.received.append(request)
        return self.script.pop(0) if self.script else 200


@contextmanager
def webhook_receiver(*script: int) -> Iterator[Receiver]:
    receiver = Receiver("", list(script))

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            status = receiver.answer(Received(self.path, dict(self.headers.items()), body))
            self.send_response(status)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    receiver.url = f"http://127.0.0.1:{server.server_address[1]}/hooks"
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


# Receivers that misbehave, in the test's own event loop (asyncio streams): what a receiver
# might do to the server that calls it.

Behaviour = Callable[[asyncio.StreamWriter, "RawReceiver"], Awaitable[None]]


@dataclass
class RawReceiver:
    url: str
    connections: int = 0  # accepted so far
    body_sent: int = 0  # bytes of a body written before the caller stopped reading
    ended: int = 0  # connections handled to their end
    stop: asyncio.Event = field(default_factory=asyncio.Event)  # set when the receiver closes


@asynccontextmanager
async def raw_receiver(behaviour: Behaviour) -> AsyncIterator[RawReceiver]:
    """A receiver that reads each request's head and body, then answers as `behaviour` does."""
    receiver = RawReceiver("")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        receiver.connections += 1
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = re.search(rb"(?i)content-length: *(\d+)", head)
            await reader.readexactly(int(length.group(1)) if length else 0)
            await behaviour(writer, receiver)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the caller went away: what these tests expect of it
        finally:
            receiver.ended += 1
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    receiver.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/hooks"
    try:
        yield receiver
    finally:
        receiver.stop.set()
        server.close()
        await server.wait_closed()


async def hang(writer: asyncio.StreamWriter, receiver: RawReceiver) -> None:
    """Never answer (until the receiver closes)."""
    await receiver.stop.wait()


async def trickle(writer: asyncio.StreamWriter, receiver: RawReceiver) -> None:
    """Answer a status line, then a header one byte at a time, never ending it: each read
    gets a byte well within any read timeout."""
    writer.write(b"HTTP/1.1 200 OK\r\nx-trickle: ")
    while not receiver.stop.is_set():
        writer.write(b"a")
        await writer.drain()
        await asyncio.sleep(0.05)


HUGE = 64 * 2**20


async def huge_body(writer: asyncio.StreamWriter, receiver: RawReceiver) -> None:
    """Answer 200 with a body of HUGE bytes, counting what the caller let through."""
    writer.write(f"HTTP/1.1 200 OK\r\ncontent-length: {HUGE}\r\n\r\n".encode())
    chunk = bytes(2**20)
    while receiver.body_sent < HUGE:
        writer.write(chunk)
        await writer.drain()  # blocks once the caller stops reading; fails once it closes
        receiver.body_sent += len(chunk)
