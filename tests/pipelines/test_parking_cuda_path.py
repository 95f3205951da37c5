"""The CUDA side of `pipelines.memory.parking.move_weights`, on this CPU with torch.cuda's
calls recorded: a move off a GPU waits for the copy and gives the freed blocks back; a move
onto one waits for the copy; nothing CUDA is called for the CPU."""

from __future__ import annotations

import pytest
import torch

from pipelines.memory import parking


class Pipe:
    def __init__(self) -> None:
        self.moves: list[str] = []
        self.components = {"unet": torch.nn.Linear(2, 2)}

    def to(self, device: str) -> None:
        self.moves.append(device)


class Adapter:
    def __init__(self) -> None:
        self.pipe = Pipe()


@pytest.mark.parametrize(
    ("before", "device", "synced", "emptied"),
    [
        ("cuda:0", "cpu", ["cuda:0"], 1),  # off the GPU: wait, then free its cached blocks
        ("cpu", "cuda:0", ["cuda:0"], 0),  # back onto it: wait for the copy
        ("cpu", "cpu", [], 0),
    ],
)
def test_moves_wait_for_the_gpu_and_free_its_cache(
    monkeypatch: pytest.MonkeyPatch, before: str, device: str, synced: list[str], emptied: int
) -> None:
    synchronized: list[str] = []
    emptied_caches: list[None] = []
    monkeypatch.setattr(parking, "weights_device", lambda pipeline: before)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronized.append)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied_caches.append(None))
    adapter = Adapter()
    parking.move_weights(adapter, device)
    assert adapter.pipe.moves == [device]
    assert synchronized == synced and len(emptied_caches) == emptied
