"""A worker's seat in a lane of several devices (`--cfg-parallel`, `--sequence-parallel`):
the lane's shape, which member it is, and where the members meet. Torch-free, so the server
can put it in a `PipelineConfig`; `pipelines.parallel.lane_group` joins the group with it."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Literal

SequenceMode = Literal["ulysses", "ring"]


@dataclass(frozen=True, slots=True)
class LaneShape:
    """How a lane shares a step: `cfg` devices share out its guided rows (1 or 2), and each
    of them is `sequence` devices that split every forward's tokens, Ulysses (an all-to-all
    per attention) or ring (the keys and values passed round) attention."""

    cfg: int = 1
    sequence: int = 1
    mode: SequenceMode = "ulysses"

    @property
    def size(self) -> int:
        return self.cfg * self.sequence

    def flags(self) -> str:
        """The serve flags that asked for this shape, as a refusal names them."""
        named = [("--cfg-parallel", self.cfg), ("--sequence-parallel", self.sequence)]
        return " ".join(f"{flag} {value}" for flag, value in named if value > 1)


@dataclass(frozen=True, slots=True)
class LaneSeat:
    """Member `rank` of a lane of `shape` (rank 0 leads: it decodes and answers); the members
    meet at `address` (host:port of the group's rendezvous store, which rank 0 serves). A
    restarted group meets at the same address: every member is restarted together.

    Ranks run CFG-major: members `c * sequence .. c * sequence + sequence - 1` split the tokens
    of CFG share `c` (the layout of the device mesh `pipelines.parallel.sequence` builds)."""

    rank: int
    shape: LaneShape
    address: str

    @property
    def size(self) -> int:
        return self.shape.size

    @property
    def leads(self) -> bool:
        return self.rank == 0

    @property
    def cfg_rank(self) -> int:
        """Which share of the guided rows this member runs."""
        return self.rank // self.shape.sequence


def lane_seats(shape: LaneShape, host: str = "127.0.0.1") -> list[LaneSeat]:
    """The seats of a new lane of `shape`, meeting at a port free on `host` now (the lane keeps
    it: its members are restarted together and meet there again). Loopback: a lane's members
    are processes of this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port = probe.getsockname()[1]
    return [LaneSeat(rank, shape, f"{host}:{port}") for rank in range(shape.size)]
