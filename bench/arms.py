"""Arms: one server driven with variants of the same trace, side by side in one run.

`--compare priority,fifo,alone:2` makes each server contender three: `NAME/priority` sends
the trace as drawn, `NAME/fifo` the same requests at the same arrival times with every
priority 0 (oldest first: what the server did before priorities), `NAME/alone:2` only
tenant 2's requests at their own arrival times (what that tenant gets with nobody else).
The arms share the server, so they differ only in what is sent, and the runner's
rotation interleaves them round by round like any contenders.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from bench.contenders import Contender, Load, Pictures, RoundResult, ServerContender
from bench.workload import RequestSpec

ARM_KINDS = ("priority", "fifo", "alone:T")


@dataclass(frozen=True, slots=True)
class Arm:
    """A variant of the trace: `priority` (as drawn), `fifo`, or `alone` of one `tenant`."""

    kind: str
    tenant: int | None = None

    @property
    def name(self) -> str:
        return f"alone:{self.tenant}" if self.kind == "alone" else self.kind

    def apply(self, load: Load, specs: list[RequestSpec]) -> tuple[Load, list[RequestSpec]]:
        """The load and requests this arm sends of a round's trace."""
        if self.kind == "fifo":  # 0 sent, not left out, so that no API key's default applies
            return load, [replace(spec, priority=0) for spec in specs]
        if self.kind == "alone":
            keep = [i for i, spec in enumerate(specs) if spec.tenant == self.tenant]
            offsets = tuple(load.offsets[i] for i in keep) if load.offsets else ()
            return replace(load, offsets=offsets), [specs[i] for i in keep]
        return load, specs


def parse_arms(text: str) -> tuple[Arm, ...]:
    """`priority,fifo,alone:2` -> its arms; ValueError naming a bad or repeated one."""
    arms = []
    for item in (part.strip() for part in text.split(",")):
        kind, _, tenant = item.partition(":")
        if kind in ("priority", "fifo") and not tenant:
            arms.append(Arm(kind))
        elif kind == "alone" and tenant.isdigit() and int(tenant) >= 1:
            arms.append(Arm(kind, int(tenant)))
        else:
            raise ValueError(f"--compare: unknown arm {item!r}; arms are {', '.join(ARM_KINDS)}")
    names = [arm.name for arm in arms]
    if len(set(names)) != len(names) or not arms:
        raise ValueError(f"--compare names each arm once, got {text!r}")
    return tuple(arms)


class ArmContender:
    """A server contender sending its trace as one arm does."""

    def __init__(self, server: ServerContender, arm: Arm) -> None:
        self.server = server
        self.arm = arm
        self.name = f"{server.name}/{arm.name}"
        self.draws_previews = server.draws_previews

    async def run(self, load: Load, specs: list[RequestSpec]) -> RoundResult:
        return await self.server.run(*self.arm.apply(load, specs))

    async def pictures(self, specs: list[RequestSpec], concurrency: int) -> Pictures:
        return await self.server.pictures(specs, concurrency)


def with_arms(contenders: list[Contender], arms: tuple[Arm, ...]) -> list[Contender]:
    """Each server contender once per arm (direct, which ignores priorities, stays one)."""
    if not arms:
        return contenders
    out: list[Contender] = []
    for contender in contenders:
        if isinstance(contender, ServerContender):
            out.extend(ArmContender(contender, arm) for arm in arms)
        else:
            out.append(contender)
    return out


def server_of(contender: Contender) -> ServerContender | None:
    """The HTTP server behind a contender (an arm's own), None for direct."""
    if isinstance(contender, ArmContender):
        return contender.server
    return contender if isinstance(contender, ServerContender) else None
