"""scripts/mutation_check.py: its planted bugs still apply to the code as it is, so the
mutation check cannot rot into reporting nothing (running the mutants is the script's job:
minutes of tests per mutant)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from bench.launch import ROOT


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "scripts" / "mutation_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being made
    spec.loader.exec_module(module)
    return module


MUTATION = _script()


@pytest.mark.parametrize("mutant", MUTATION.MUTANTS, ids=lambda mutant: mutant.name)
def test_each_planted_bug_applies_once_and_names_tests_that_exist(mutant: object) -> None:
    mutated = MUTATION.check_applies(mutant)
    assert mutated != (ROOT / mutant.path).read_text()  # type: ignore[attr-defined]
    for test in mutant.tests:  # type: ignore[attr-defined]
        assert (ROOT / test.split("::")[0]).is_file(), test


def test_a_mutant_whose_text_moved_is_refused(tmp_path: Path) -> None:
    (tmp_path / "module.py").write_text("x = 1\nx = 1\n")
    moved = MUTATION.Mutant("twice", "", "module.py", "x = 1", "x = 2", ())
    with pytest.raises(ValueError, match="occurs 2 times"):
        MUTATION.check_applies(moved, tmp_path)
    gone = MUTATION.Mutant("gone", "", "module.py", "y = 1", "y = 2", ())
    with pytest.raises(ValueError, match="occurs 0 times"):
        MUTATION.check_applies(gone, tmp_path)


def test_the_scratch_copy_holds_uncommitted_files_and_not_ignored_ones(tmp_path: Path) -> None:
    copy = MUTATION.scratch_copy(tmp_path / "tree")
    assert (copy / "scripts" / "mutation_check.py").is_file()
    assert (copy / "pipelines" / "stepping" / "state.py").is_file()
    assert not (copy / ".venv").exists() and not (copy / ".git").exists()
