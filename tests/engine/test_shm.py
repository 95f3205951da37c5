"""Shared-memory transport of large arrays (`engine.shm`), in one process."""

from __future__ import annotations

import pickle
import subprocess
import sys
from collections.abc import Iterator
from multiprocessing import shared_memory

import numpy as np
import pytest

from engine.request import PartialImage, RequestOutput
from engine.shm import (
    Packer,
    SharedArray,
    count_shared,
    segments,
    sweep,
    sweep_orphans,
    unpack,
    worker_prefix,
)

PREFIX = f"{worker_prefix()}test-"


@pytest.fixture
def packer() -> Iterator[Packer]:
    yield Packer(PREFIX, min_bytes=1024)
    sweep(PREFIX)


def test_large_arrays_anywhere_in_a_message_travel_by_handle(packer: Packer) -> None:
    big = np.arange(64 * 64 * 3, dtype=np.uint8).reshape(64, 64, 3)
    audio = np.linspace(-1, 1, 4000, dtype=np.float32)
    small = np.ones(10, np.uint8)
    message = {
        "out": RequestOutput("r", images=(big, big + 1), seeds=(1, 2), extras={"audio": [audio]}),
        "partial": [PartialImage("r", 0, (small,), 1, 4)],
    }
    packed = packer.pack(message)
    assert count_shared(packed) == 3 and len(segments(PREFIX)) == 3
    assert isinstance(packed["out"].images[0], SharedArray)
    assert packed["partial"][0].images[0] is small  # below the threshold: inside the message
    wire = pickle.loads(pickle.dumps(packed))  # what a pipe carries
    assert len(pickle.dumps(packed)) < 4096
    received = unpack(wire)
    assert segments(PREFIX) == []  # the receiver unlinked every segment
    assert np.array_equal(received["out"].images[1], big + 1)
    assert received["out"].extras["audio"][0].dtype == np.float32
    assert np.array_equal(received["out"].extras["audio"][0], audio)


def test_a_dead_senders_segments_are_swept(packer: Packer) -> None:
    packer.pack(np.zeros(4096, np.uint8))
    assert len(segments(PREFIX)) == 1
    assert sweep(PREFIX) == 1 and segments(PREFIX) == []


def test_segments_of_processes_that_are_gone_are_swept_and_the_living_keep_theirs() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    orphan = shared_memory.SharedMemory(name=f"{worker_prefix(gone.pid)}orphan", create=True, size=16)
    mine = shared_memory.SharedMemory(name=f"{worker_prefix()}mine", create=True, size=16)
    try:
        assert sweep_orphans() >= 1
        names = segments("diffbatch-")
        assert orphan.name not in names and mine.name in names
    finally:
        orphan.close()
        mine.close()
        mine.unlink()
