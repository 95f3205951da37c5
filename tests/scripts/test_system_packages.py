"""scripts/system_packages: the README's test command installs the browser the tests drive,
or says what to run, on a machine that lacks it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from bench.launch import ROOT

SCRIPT = ROOT / "scripts" / "system_packages"


def fake_bin(tmp_path: Path, *, uid: int, commands: tuple[str, ...] = ()) -> Path:
    """A PATH of its own: `id` says `uid`, `apt-get` records its arguments, `sudo -n` fails
    (a password would be needed), and `commands` exist as empty programs."""
    folder = tmp_path / "bin"
    folder.mkdir()
    scripts = {
        "id": f"echo {uid}",
        "apt-get": f'echo "$@" >> {tmp_path / "apt.log"}',
        "sudo": "exit 1",
        **{name: "exit 0" for name in commands},
    }
    for name, body in scripts.items():
        program = folder / name
        program.write_text(f"#!/bin/bash\n{body}\n")
        program.chmod(0o755)
    (folder / "env").symlink_to("/usr/bin/env")
    return folder


def run(tmp_path: Path, folder: Path) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "PATH": str(folder)}
    return subprocess.run(
        ["/bin/bash", str(SCRIPT)], env=environment, capture_output=True, text=True, timeout=60, check=False
    )


def test_as_root_a_missing_browser_is_installed(tmp_path: Path) -> None:
    result = run(tmp_path, fake_bin(tmp_path, uid=0))
    assert result.returncode == 0, result.stderr
    calls = (tmp_path / "apt.log").read_text().splitlines()
    assert calls[0] == "update -q"
    assert calls[1].startswith("install -y") and calls[1].split()[-1] == "chromium"


def test_without_root_it_says_what_to_run_and_stops(tmp_path: Path) -> None:
    result = run(tmp_path, fake_bin(tmp_path, uid=1000))
    assert result.returncode == 1
    assert "sudo apt-get install -y chromium" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "apt.log").exists()


def test_nothing_is_installed_when_everything_is_there(tmp_path: Path) -> None:
    result = run(tmp_path, fake_bin(tmp_path, uid=0, commands=("chromium",)))
    assert result.returncode == 0 and result.stderr == ""
    assert not (tmp_path / "apt.log").exists()
