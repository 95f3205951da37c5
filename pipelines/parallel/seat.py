"""A worker's seat in a lane of several devices (`--cfg-parallel`): which member it is, how
many the lane has, and where the members meet. Torch-free, so the server can put it in a
`PipelineConfig`; `pipelines.parallel.lane_group` joins the group with it."""

from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LaneSeat:
    """Member `rank` of `size` (rank 0 leads: it decodes and answers); the members meet at
    `address` (host:port of the group's rendezvous store, which rank 0 serves). A restarted
    group meets at the same address: every member is restarted together."""

    rank: int
    size: int
    address: str

    @property
    def leads(self) -> bool:
        return self.rank == 0


def lane_seats(size: int, host: str = "127.0.0.1") -> list[LaneSeat]:
    """The seats of a new lane of `size` members, meeting at a port free on `host` now (the
    lane keeps it: its members are restarted together and meet there again). Loopback: a
    lane's members are processes of this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
    return [LaneSeat(rank, size, f"{host}:{port}") for rank in range(size)]
