"""The safety checker of `--safety-checker` (`pipelines.safety`) with `tiny-safety-checker`,
whose one live concept is pure red: it flags red at the default threshold and not at the
lenient one, other colours and noise never, each request at its own level in one call, and a
video by frames spread from its first to its last."""

from __future__ import annotations

import numpy as np
import pytest

from pipelines.safety import SafetyChecker, load_safety_checker
from pipelines.tiny.safety_checker import FLAGGED_COLOUR, TINY_SAFETY_CHECKER


@pytest.fixture(scope="module")
def checker() -> SafetyChecker:
    return load_safety_checker(TINY_SAFETY_CHECKER, "cpu")


def flat(colour: tuple[int, int, int], size: int = 64) -> np.ndarray:
    return np.full((size, size, 3), colour, dtype=np.uint8)


def test_red_is_flagged_at_the_default_threshold_only(checker: SafetyChecker) -> None:
    red = (flat(FLAGGED_COLOUR),)
    assert checker.flags([red, red], ["auto", "low"]) == [True, False]


def test_other_pictures_pass(checker: SafetyChecker) -> None:
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    others = [(flat((200, 0, 0)),), (flat((0, 255, 0)),), (noise,), (flat((0, 0, 255)), noise)]
    assert checker.flags(others, ["auto"] * len(others)) == [False] * len(others)


def test_a_request_is_flagged_by_any_of_its_images(checker: SafetyChecker) -> None:
    assert checker.flags([(flat((0, 255, 0)), flat(FLAGGED_COLOUR))], ["auto"]) == [True]


def test_a_video_is_checked_by_frames_spread_to_its_last(checker: SafetyChecker) -> None:
    video = np.stack([flat((0, 255, 0), 32)] * 9 + [flat(FLAGGED_COLOUR, 32)])
    assert checker.flags([(video,), (video[:-1],)], ["auto", "auto"]) == [True, False]
