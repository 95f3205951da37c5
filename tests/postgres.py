"""A throwaway PostgreSQL cluster for the tests: Debian's server binaries, a temporary
directory, a free port, and its unix socket in that directory (no TCP listener).

PostgreSQL refuses to run as root, so as root the cluster runs as `nobody` (`runuser`),
in a directory made for it outside pytest's private (0700) temporary tree.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

UNPRIVILEGED_USER = "nobody"


def server_binaries() -> Path | None:
    """The newest installed PostgreSQL's bin directory (Debian keeps it off PATH)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(found[-1]).parent if found else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class Cluster:
    bin_dir: Path
    directory: Path
    port: int

    @property
    def data(self) -> Path:
        return self.directory / "data"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@/{database}?host={self.directory}&port={self.port}"

    def _run(self, *command: str) -> None:
        prefix = ["runuser", "-u", UNPRIVILEGED_USER, "--"] if os.geteuid() == 0 else []
        subprocess.run([*prefix, *command], check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        self._run(
            str(self.bin_dir / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
            "-E", "UTF8", "--no-sync",
        )  # fmt: skip
        options = (
            f"-k {self.directory} -p {self.port} -c listen_addresses='' -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off"
        )
        self._run(
            str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-l", str(self.directory / "log"),
            "-o", options, "-w", "start",
        )  # fmt: skip

    def stop(self) -> None:
        try:
            self._run(str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)

    def create_database(self, name: str) -> str:
        """A fresh, empty database; returns its URL."""
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


def start_cluster() -> Cluster:
    bin_dir = server_binaries()
    if bin_dir is None:
        raise FileNotFoundError("no PostgreSQL server binaries in /usr/lib/postgresql/*/bin")
    directory = Path(tempfile.mkdtemp(prefix="diffbatch-pg-"))
    if os.geteuid() == 0:
        shutil.chown(directory, UNPRIVILEGED_USER)
    cluster = Cluster(bin_dir, directory, _free_port())
    try:
        cluster.start()
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return cluster
