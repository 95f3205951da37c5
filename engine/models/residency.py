"""Which served models stay loaded: one memory budget, least recently used idle models out first.

Pure and synchronous (no engine, no torch): `ModelSet` asks `Residency.evictions` which
models to unload before loading another, and tells it what loaded, what ran and what
was unloaded. A model that runs or has requests queued (`busy`) is never chosen, so a
load that cannot fit waits until enough models go idle rather than cutting anyone off.

With a host budget, a model taken off the device may be parked in host memory instead of
dropped (`engine.models.host_parking`): `parked` holds those, least recently used dropped first
when another must be parked.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Resident:
    name: str
    footprint: int  # bytes of weights it holds (measured once loaded; 0 while unknown)
    last_used: float  # time.monotonic() of the last request it was given


@dataclass(slots=True)
class Residency:
    """The loaded models and the budget they share (None: no limit), and the models parked
    in host memory within the host budget (None: none is parked, each is dropped)."""

    budget: int | None
    host_budget: int | None = None
    loaded: dict[str, Resident] = field(default_factory=dict)
    parked: dict[str, Resident] = field(default_factory=dict)
    # Footprints of models measured on an earlier load: a model that comes back is known
    # before it loads, so room is made for it first.
    known: dict[str, int] = field(default_factory=dict)

    @property
    def used(self) -> int:
        return sum(r.footprint for r in self.loaded.values())

    def evictions(self, name: str, busy: set[str]) -> list[str] | None:
        """The idle models to unload, least recently used first, so that `name` fits; [] when
        it fits already (or its size is unknown: it loads, then `over_budget` says who goes);
        None when it cannot fit until some busy model goes idle."""
        if self.budget is None or name in self.loaded:
            return []
        need = self.known.get(name, 0)
        return self._victims(need, exclude=busy)

    def over_budget(self, busy: set[str], keep: str) -> list[str] | None:
        """After a load whose size was unknown: the idle models to unload so that all fit
        again (never `keep`, the one just loaded); None when the busy ones alone overflow."""
        if self.budget is None:
            return []
        return self._victims(0, exclude=busy | {keep})

    def _victims(self, need: int, exclude: set[str]) -> list[str] | None:
        assert self.budget is not None
        free = self.budget - self.used
        victims: list[str] = []
        for resident in sorted(self.loaded.values(), key=lambda r: r.last_used):
            if free >= need:
                break
            if resident.name in exclude:
                continue
            victims.append(resident.name)
            free += resident.footprint
        return victims if free >= need else None

    def add(self, name: str, footprint: int, now: float) -> None:
        self.loaded[name] = Resident(name, footprint, now)
        self.known[name] = footprint

    def remove(self, name: str) -> None:
        self.loaded.pop(name, None)

    def touch(self, name: str, now: float) -> None:
        if (resident := self.loaded.get(name)) is not None:
            resident.last_used = now

    @property
    def host_used(self) -> int:
        return sum(r.footprint for r in self.parked.values())

    def host_room(self, name: str, returning: str | None = None) -> list[str] | None:
        """The parked models to drop, least recently used first, so that `name` (loaded
        now) can be parked; None when it cannot be (no host budget, or bigger than it).
        `returning`: a parked model going back to the device in the same swap, whose host
        memory counts as free (it leaves right after: host memory may briefly hold both,
        rather than the device)."""
        footprint = self.known.get(name, 0)
        if self.host_budget is None or footprint > self.host_budget:
            return None
        leaving = self.parked[returning].footprint if returning in self.parked else 0
        free = self.host_budget - self.host_used + leaving
        victims: list[str] = []
        for resident in sorted(self.parked.values(), key=lambda r: r.last_used):
            if free >= footprint:
                break
            if resident.name == returning:
                continue
            victims.append(resident.name)
            free += resident.footprint
        return victims

    def park(self, name: str, now: float) -> None:
        """`name` (just removed from the device) is in host memory now."""
        self.parked[name] = Resident(name, self.known.get(name, 0), now)

    def unpark(self, name: str, now: float) -> None:
        """`name` is back on the device."""
        self.parked.pop(name, None)
        self.add(name, self.known.get(name, 0), now)

    def drop_parked(self, name: str) -> None:
        self.parked.pop(name, None)

    def fits_alone(self, name: str) -> bool:
        """Whether `name` could ever fit (its known size within the whole budget)."""
        return self.budget is None or self.known.get(name, 0) <= self.budget
