"""Shared-memory transport of large arrays (`engine.executor.shm`), in one process."""

from __future__ import annotations

import pickle
import subprocess
import sys
from collections.abc import Iterator
from multiprocessing import shared_memory

import numpy as np
import pytest

from engine.executor.shm import (
    Packer,
    SharedArray,
    count_shared,
    inputs_prefix,
    segments,
    sweep,
    sweep_orphans,
    unpack,
    worker_prefix,
)
from engine.request import PartialImage, RequestOutput

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


def test_each_executor_and_worker_incarnation_names_its_inputs_apart() -> None:
    """Lanes of one server send input images at once: no name is taken twice, and sweeping
    one lane's (one worker's) inputs touches no other's."""
    prefixes = [inputs_prefix(executor, worker) for executor in (1, 2, 12) for worker in (1, 2, 21)]
    assert all(not a.startswith(b) for a in prefixes for b in prefixes if a != b)
    assert all(prefix.startswith(worker_prefix()) for prefix in prefixes)  # swept as this process's
    try:
        for prefix in prefixes:
            Packer(prefix, min_bytes=1024).pack(np.zeros(4096, np.uint8))
        assert sweep(prefixes[0]) == 1
        assert all(len(segments(prefix)) == 1 for prefix in prefixes[1:])
    finally:
        for prefix in prefixes:
            sweep(prefix)


def test_a_message_with_a_missing_segment_still_frees_the_others(packer: Packer) -> None:
    packed = packer.pack([np.zeros(4096, np.uint8), np.ones(4096, np.uint8), np.ones(4096, np.uint8)])
    gone = shared_memory.SharedMemory(name=packed[1].name)
    gone.close()
    gone.unlink()
    with pytest.raises(FileNotFoundError):
        unpack(packed)
    assert segments(PREFIX) == []


def test_a_message_that_cannot_be_shared_whole_leaves_no_segment(packer: Packer) -> None:
    taken = shared_memory.SharedMemory(name=f"{PREFIX}1", create=True, size=16)  # its 2nd name
    try:
        with pytest.raises(FileExistsError):
            packer.pack([np.zeros(4096, np.uint8), np.ones(4096, np.uint8)])
        assert segments(PREFIX) == [taken.name]
    finally:
        taken.close()
        taken.unlink()
