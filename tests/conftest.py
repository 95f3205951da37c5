"""Test-wide set-up: tiny models are built fresh into a temporary cache for each run."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def tiny_model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Never read or write the user's cache; building each tiny model also tests the builder."""
    cache = tmp_path_factory.mktemp("diffbatch-cache")
    previous = os.environ.get("DIFFBATCH_CACHE_DIR")
    os.environ["DIFFBATCH_CACHE_DIR"] = str(cache)
    yield cache
    if previous is None:
        os.environ.pop("DIFFBATCH_CACHE_DIR", None)
    else:
        os.environ["DIFFBATCH_CACHE_DIR"] = previous


@pytest.fixture(scope="session")
def standin_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A weights folder with untrained stand-ins of `shapes` and `shapes-dit` (tests/standin.py):
    the shape of the shipped files, never their quality."""
    from tests.standin import build_standin_root

    return build_standin_root(tmp_path_factory.mktemp("standin-weights"))
