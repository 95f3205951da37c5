"""A local Ray cluster on this machine (`ray start --head`), started and stopped by its
owner: the Ray Serve benchmark and end-to-end tests. Its own temp dir and auth token, so it
neither finds nor disturbs another cluster's files."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.launch import ROOT, free_port

RAY = str(Path(sys.executable).parent / "ray")


@dataclass
class LocalCluster:
    address: str
    temp_dir: Path
    # For `ray stop` and for every process that talks to the cluster.
    env: dict[str, str]

    def stop(self) -> list[int]:
        """Stop the cluster; return the pids of Ray processes still running afterwards.

        `ray stop` stops every Ray process of this machine (Ray offers no other way)."""
        subprocess.run([RAY, "stop", "--force"], check=False, env=self.env, capture_output=True, timeout=120)
        # Ray renames some of its processes (ray::...): their command lines no longer name
        # the directory.
        leftover = processes_mentioning(str(self.temp_dir)) + processes_mentioning("ray::")
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return leftover


def start_cluster(num_cpus: int = 4, extra_env: dict[str, str] | None = None) -> LocalCluster:
    # A short directory: Ray puts unix sockets under it (at most 107 characters).
    temp_dir = Path(tempfile.mkdtemp(prefix="dbray-", dir="/tmp"))
    token = temp_dir / "token"
    token.write_text(secrets.token_hex(32))
    port = free_port()
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        # The replicas are the cluster's workers: they import from this checkout.
        "PYTHONPATH": str(ROOT),
        **(extra_env or {}),
    }
    subprocess.run(
        [
            RAY, "start", "--head", "--port", str(port), "--num-cpus", str(num_cpus),
            "--include-dashboard=false", "--disable-usage-stats",
            "--object-store-memory", str(200 * 2**20), "--temp-dir", str(temp_dir),
        ],
        env=env, check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return LocalCluster(f"127.0.0.1:{port}", temp_dir, env)


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in command:
            found.append(int(entry.name))
    return found
