"""A webhook receiver for the tests: a small HTTP server on loopback that records what it is
sent and answers each request with the next status of its script (then 200)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
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
