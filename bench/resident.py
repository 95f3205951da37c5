"""What a process's resident set is made of, read from `/proc/self/status` (Linux): anonymous
pages (heap, tensors: memory the process really holds) apart from file-backed ones (files
mapped in, such as safetensors files read through mmap: page cache the kernel may drop and
read again, counted in the resident set only while mapped and touched).

`VmHWM` is the kernel's exact high-water mark of the whole resident set; there is none per
kind, so `ResidentSampler` reads the status on a thread every few milliseconds and keeps
the highest of each (a peak shorter than the interval can be missed; a block of weights
held through a denoiser forward is not that short).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

STATUS = Path("/proc/self/status")
FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM")


def parse_status(text: str) -> dict[str, float]:
    """The resident-set fields (`FIELDS`) of a `/proc/<pid>/status` text, in MiB."""
    values = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in FIELDS:
            amount, unit = rest.split()
            if unit != "kB":
                raise ValueError(f"{name}: unit {unit!r}, expected kB")
            values[name] = int(amount) / 1024
    return values


def read_status() -> dict[str, float]:
    return parse_status(STATUS.read_text())


@dataclass
class ResidentSampler:
    """The highest VmRSS, RssAnon and RssFile seen since the last `reset`, sampled every
    `interval` seconds on a daemon thread (`start` / `stop`)."""

    interval: float = 0.005
    peaks: dict[str, float] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="resident-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, float]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.sample()

    def reset(self) -> None:
        with self._lock:
            self.peaks = {}
        self.sample()

    def sample(self) -> dict[str, float]:
        """Read the status now, fold it into the peaks, and return the peaks."""
        now = read_status()
        with self._lock:
            for name in ("VmRSS", "RssAnon", "RssFile"):
                self.peaks[name] = max(self.peaks.get(name, 0.0), now[name])
            return dict(self.peaks)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()
