"""A local Ray cluster on this machine (`ray start --head` on loopback), started and stopped
by its owner: the Ray Serve benchmark and end-to-end tests. Its own temp dir and auth token,
so it neither finds nor disturbs another cluster's files.

Loopback takes two things in Ray 2.60: `--node-ip-address 127.0.0.1`, and
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`. Without the variable Ray swaps 127.0.0.1 for the
machine's own address (so that other nodes could join) and its servers listen on every
interface; with it (its name says macOS and Windows, where it is the default, but it works
on Linux too) every Ray server listens on 127.0.0.1 and no other node may join."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.launch import ROOT, free_port

RAY = str(Path(sys.executable).parent / "ray")


@dataclass
class LocalCluster:
    address: str
    temp_dir: Path
    # For every process that talks to the cluster.
    env: dict[str, str]

    def stop(self) -> list[int]:
        """Stop the cluster; return the pids of Ray processes still running afterwards.

        Its processes (those naming its directory, and their children: the workers, which
        Ray renames ray::...) are killed, as `ray stop --force` would, but not every Ray
        process of this machine, and without its waits (seconds each)."""
        ours = _with_descendants(processes_mentioning(str(self.temp_dir)))
        for pid in ours:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        give_up = time.monotonic() + 60
        while (left := [pid for pid in ours if _running(pid)]) and time.monotonic() < give_up:
            time.sleep(0.05)
        leftover = left + processes_mentioning(str(self.temp_dir)) + processes_mentioning("ray::")
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return sorted(set(leftover))


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
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # a one-node cluster, on loopback (above)
        # The replicas are the cluster's workers: they import from this checkout.
        "PYTHONPATH": str(ROOT),
        **(extra_env or {}),
    }
    subprocess.run(
        [
            RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
            "--num-cpus", str(num_cpus),
            "--include-dashboard=false", "--disable-usage-stats",
            "--object-store-memory", str(200 * 2**20), "--temp-dir", str(temp_dir),
        ],
        env=env, check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return LocalCluster(f"127.0.0.1:{port}", temp_dir, env)


def listening_addresses(pids: list[int]) -> set[str]:
    """The local addresses on which processes `pids` accept TCP connections."""
    sockets = set()
    for pid in pids:
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue  # it ended meanwhile
        sockets |= {link[len("socket:[") : -1] for link in links if link.startswith("socket:[")}
    addresses = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in sockets:  # 0A: LISTEN
                addresses.add(_address(fields[1].rsplit(":", 1)[0]))
    return addresses


def _address(hex_address: str) -> str:
    """An address as /proc/net/tcp* write it: 32-bit words of hex, each in the host's order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][:: -1 if sys.byteorder == "little" else 1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(words)
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return str(mapped or address)


def _with_descendants(pids: list[int]) -> list[int]:
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue  # it ended meanwhile
    found = set(pids)
    while grown := {pid for pid, parent in parents.items() if parent in found} - found:
        found |= grown
    return sorted(found)


def _running(pid: int) -> bool:
    """Whether `pid` still runs (a zombie has ended: its parent has yet to reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


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
