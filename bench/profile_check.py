"""What the profile run at start fits on a device: start `diffbatch serve` with
`--profile-run on` and the given flags, read `/health`'s `profile_run`, print it as one
line per figure, stop the server. Exits non-zero when the server does not start, or on an
accelerator when nothing was measured (bench/gpu_check.sh runs it per family).

    python -m bench.profile_check random-flux --device cuda \\
        --pipeline-class bench.fullsize:RandomFlux --max-num-seqs 16 --default-size 1024x1024
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import httpx

from bench.launch import start_server, stop_server

# A full-size model built from random weights takes minutes to materialise on the device.
READY_TIMEOUT_S = 900


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="profile-check-") as workdir:
        server = start_server(
            Path(workdir),
            "--batching",
            "step",
            "--profile-run",
            "on",
            *argv,
            config=None,
            ready_timeout_s=READY_TIMEOUT_S,
        )
        try:
            profile = httpx.get(f"{server.url}/health").json()["profile_run"]
        finally:
            stop_server(server)
    for name, value in profile.items():
        print(f"{name:>16}: {value}")
    on_cpu = "--device" not in argv or argv[argv.index("--device") + 1] == "cpu"
    return 0 if profile["state"] == "measured" or on_cpu else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
