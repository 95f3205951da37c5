#!/usr/bin/env python3
"""Plant known bugs, one at a time, in a scratch copy of the checkout, and report which tests
catch each (issue 47: tests that can tell).

Each mutant is one textual change to one source file — a reference blanked, a row's guidance
taken from its neighbour, a mask inverted, a seed reused — and the tests that should see it.
The checkout itself is never touched: the working tree (uncommitted changes included) is
copied to a temporary folder, the change applied there, and pytest run in that folder with
it first on `PYTHONPATH`, so the servers the end-to-end tests start import the mutant too.

    python scripts/mutation_check.py              # every mutant
    python scripts/mutation_check.py --only mask-inverted --baseline

Exit status 1 when a mutant survives (no test failed), 2 when a mutant no longer applies
(its text changed: update the mutant with the code). A test that fails on the unchanged
copy too (`--baseline` runs them once first) is not counted as catching anything.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class Mutant:
    """A planted bug: `old` (which must occur exactly once in `path`) becomes `new`, and
    `tests` (pytest paths or node ids) are the ones expected to catch it."""

    name: str
    what: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "guidance-from-first-row",
        "every request of a step group is guided with the first request's guidance scale",
        "pipelines/stepping/state.py",
        "guided.append(guide(state, rows[:n], rows[n:]))",
        "guided.append(guide(states[0], rows[:n], rows[n:]))",
        ("tests/pipelines/test_stepping.py", "tests/pipelines/test_edit_stepping.py"),
    ),
    Mutant(
        "seed-reused",
        "every image of a request draws from its first seed (n images come out alike)",
        "pipelines/stepping/setup.py",
        'return [torch.Generator("cpu").manual_seed(seed) for seed in request.params.image_seeds()]',
        'return [torch.Generator("cpu").manual_seed(request.params.image_seeds()[0])'
        " for _ in request.params.image_seeds()]",
        ("tests/pipelines/test_stepping.py", "tests/pipelines/test_families.py"),
    ),
    Mutant(
        "mask-inverted",
        "inpainting keeps the input's pixels inside the mask and draws outside it",
        "pipelines/tasks/inpainting.py",
        "keep = mask[..., None] < 128",
        "keep = mask[..., None] >= 128",
        ("tests/pipelines/test_edit_stepping.py", "tests/pipelines/test_image_to_image.py"),
    ),
    Mutant(
        "kontext-reference-blanked",
        "FLUX.1-Kontext's step path encodes its reference image as zeros",
        "pipelines/families/flux_kontext.py",
        "packed = pipe._pack_latents(latents, n, channels, side_h, side_w)",
        "packed = pipe._pack_latents(latents * 0, n, channels, side_h, side_w)",
        ("tests/pipelines/test_flux_kontext_fill.py", "tests/pipelines/test_edit_stepping.py"),
    ),
    Mutant(
        "qwen-image-21-references-blanked",
        "Qwen-Image 2.1's step path encodes its reference images as zeros",
        "pipelines/families/qwen_image_21_references.py",
        "latents = torch.cat([latents] * n)\n            packed.append(",
        "latents = torch.cat([latents * 0] * n)\n            packed.append(",
        ("tests/pipelines/test_qwen_image_21.py", "tests/pipelines/test_qwen_image_21_references.py"),
    ),
    Mutant(
        "vace-references-blanked",
        "Wan VACE's step path encodes its reference images as zeros",
        "pipelines/families/wan_vace.py",
        "latents = pipe.prepare_video_latents(video, mask, references, None, device)",
        "latents = pipe.prepare_video_latents(\n"
        "                video, mask, [[image * 0 for image in row] for row in references], None, device\n"
        "            )",
        ("tests/pipelines/test_wan_vace.py",),
    ),
)


def check_applies(mutant: Mutant, root: Path = ROOT) -> str:
    """The mutated text of `mutant.path` under `root`; ValueError unless `old` occurs once."""
    source = (root / mutant.path).read_text()
    count = source.count(mutant.old)
    if count != 1:
        raise ValueError(f"{mutant.name}: its text occurs {count} times in {mutant.path}, not once")
    return source.replace(mutant.old, mutant.new)


def scratch_copy(destination: Path) -> Path:
    """The working tree as it is (tracked files and untracked ones git does not ignore)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for raw in listed:
        if not raw:
            continue
        relative = raw.decode()
        source = ROOT / relative
        if not source.is_file():
            continue  # deleted in the working tree
        target = destination / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    return destination


def failed_tests(copy: Path, tests: tuple[str, ...], extra: list[str]) -> tuple[list[str], int]:
    """Run `tests` in `copy`; the node ids that failed or errored, and pytest's exit status."""
    report = copy / ".mutation-report.xml"
    environment = {**os.environ, "PYTHONPATH": str(copy)}
    command = [sys.executable, "-m", "pytest", "-q", "--tb=line", "-p", "no:cacheprovider"]
    command.append(f"--junitxml={report}")
    completed = subprocess.run([*command, *extra, *tests], cwd=copy, env=environment, check=False)
    failed = []
    if report.is_file():
        for case in ElementTree.parse(report).getroot().iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                module = str(case.get("classname")).replace(".", "/")
                failed.append(f"{module}.py::{case.get('name')}")
        report.unlink()
    return failed, completed.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=[mutant.name for mutant in MUTANTS])
    parser.add_argument("--baseline", action="store_true", help="run each mutant's tests unmutated first")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args()
    chosen = [mutant for mutant in MUTANTS if not args.only or mutant.name in args.only]
    results: list[tuple[Mutant, list[str]]] = []
    with tempfile.TemporaryDirectory(prefix="diffbatch-mutants-") as scratch:
        copy = scratch_copy(Path(scratch) / "tree")
        for mutant in chosen:
            try:
                mutated = check_applies(mutant, copy)
            except ValueError as error:
                print(f"STALE {error}", file=sys.stderr)
                return 2
            already: set[str] = set()
            if args.baseline:
                already = set(failed_tests(copy, mutant.tests, args.pytest_args)[0])
            original = (copy / mutant.path).read_text()
            (copy / mutant.path).write_text(mutated)
            try:
                failed, _ = failed_tests(copy, mutant.tests, ["-x", *args.pytest_args])
            finally:
                (copy / mutant.path).write_text(original)
            results.append((mutant, [test for test in failed if test not in already]))
    print("\nmutant                              caught by")
    survivors = 0
    for mutant, caught in results:
        survivors += not caught
        print(f"{mutant.name:<36}{caught[0] if caught else 'SURVIVED (' + mutant.what + ')'}")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
