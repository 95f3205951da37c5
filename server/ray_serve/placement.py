"""What each deployment asks Ray for, and whether a cluster can hold it all: checked before
deploying, because Serve waits without end for a replica no node can take.

`unplaceable` refuses only what surely cannot be placed: a replica bigger than every node,
or more in all than the cluster has free. A cluster whose free resources are split so that
no node holds a replica can still pass; then the start waits, relays Serve's word on it and
gives up after its timeout (`start.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from server.settings import ServeSettings

Resources = Mapping[str, float]

# Ray counts resources in ten-thousandths: what is below that is rounding.
_EPSILON = 1e-4


@dataclass(frozen=True, slots=True)
class Demand:
    """One deployment's replicas as Ray places them: `replicas` actors of `each`."""

    deployment: str
    replicas: int
    each: Resources


@dataclass(frozen=True, slots=True)
class ClusterResources:
    """`free`: what the cluster's nodes have unused, together (`ray.available_resources()`);
    `nodes`: what each live node has in all (a replica runs on one node)."""

    free: Resources
    nodes: Sequence[Resources]


# A lane's members are the replica's own worker processes (results through shared memory,
# one torch.distributed group): every bundle of its placement group on the replica's node.
LANE_STRATEGY = "STRICT_PACK"


def replica_resources(settings: ServeSettings) -> dict[str, float]:
    """An engine replica's request: its CPUs and GPUs (one device each by default); with
    lanes of several devices, its placement group's in all (one node holds them)."""
    if (bundles := replica_bundles(settings)) is not None:
        return {name: sum(b.get(name, 0.0) for b in bundles) for name in ("CPU", "GPU")}
    on_cpu = settings.device.strip() == "cpu"
    cpus = settings.replica_cpus
    gpus = settings.replica_gpus
    if cpus is None:
        cpus = 1.0 if on_cpu else 0.0
    if gpus is None:
        gpus = 0.0 if on_cpu else float(settings.data_parallel_size)
    return {"CPU": cpus, "GPU": gpus}


def replica_bundles(settings: ServeSettings) -> list[dict[str, float]] | None:
    """With lanes of several devices (`--cfg-parallel`, `--sequence-parallel`), a replica's
    placement group: one bundle per worker process (its lanes' members, times
    `--data-parallel-size`), each one GPU on a GPU device and `--replica-cpus` CPUs (default
    1 with --device cpu, 0 on a GPU). Serve starts the replica in the first; the others are
    taken for the other workers (`lane_devices.py`). None for one-device lanes: the replica
    is one actor with all its devices (`replica_resources`)."""
    if settings.lane_shape.size == 1:
        return None
    on_cpu = settings.device.strip() == "cpu"
    cpus = settings.replica_cpus
    if cpus is None:
        cpus = 1.0 if on_cpu else 0.0
    # Ray refuses a bundle that names a resource at 0.
    bundle = {name: amount for name, amount in (("CPU", cpus), ("GPU", 0.0 if on_cpu else 1.0)) if amount}
    return [dict(bundle) for _ in range(len(settings.worker_devices()))]


def gateway_resources(settings: ServeSettings) -> dict[str, float]:
    return {"CPU": settings.gateway_cpus, **settings.gateway_resources}


def actor_options(resources: Resources) -> dict[str, Any]:
    """Serve's `ray_actor_options` for a request. CPUs are always given: Serve's default is 1."""
    custom = {name: amount for name, amount in resources.items() if name not in ("CPU", "GPU")}
    options: dict[str, Any] = {"num_cpus": resources.get("CPU", 0.0), "num_gpus": resources.get("GPU", 0.0)}
    if custom:
        options["resources"] = custom
    return options


def unplaceable(demands: Sequence[Demand], cluster: ClusterResources) -> str | None:
    """One line saying what cannot be placed, or None when nothing is sure not to fit."""
    too_big = [d for d in demands if d.replicas and not _fits_a_node(d, cluster.nodes)]
    problems = [_too_big(d, cluster.nodes) for d in too_big]
    # A resource already named as too big for any node is not counted once more.
    named = {name for d in too_big for name, amount in d.each.items() if amount > 0}
    problems += _short(demands, cluster.free, named)
    if not problems:
        return None
    return (
        f"cannot place the application on this Ray cluster: {'; '.join(problems)} (set --replicas, "
        "--replica-cpus, --replica-gpus or --gateway-cpus to fit, or --ray-resource-check warn to "
        "deploy and wait for nodes)"
    )


def _fits_a_node(demand: Demand, nodes: Sequence[Resources]) -> bool:
    """Whether some node has, in all, what one replica asks for."""
    return any(all(node.get(name, 0.0) + _EPSILON >= n for name, n in demand.each.items()) for node in nodes)


def _too_big(demand: Demand, nodes: Sequence[Resources]) -> str:
    wanted = {name: amount for name, amount in demand.each.items() if amount > 0}
    most = {name: max((node.get(name, 0.0) for node in nodes), default=0.0) for name in wanted}
    return (
        f"each {demand.deployment} replica asks for {_amounts(wanted)}, which no node has "
        f"(the most on one node: {_amounts(most)})"
    )


def _short(demands: Sequence[Demand], free: Resources, named: set[str]) -> list[str]:
    """Each resource (but those `named`) the replicas ask for more of in all than the
    cluster has free."""
    problems = []
    names = sorted({name for d in demands for name, amount in d.each.items() if amount > 0} - named)
    for name in names:
        askers = [d for d in demands if d.replicas and d.each.get(name, 0.0) > 0]
        asked = sum(d.replicas * d.each[name] for d in askers)
        available = free.get(name, 0.0)
        if asked > available + _EPSILON:
            who = ", ".join(f"{d.deployment} {d.replicas} x {d.each[name]:g}" for d in askers)
            problems.append(
                f"{asked:g} {name} asked ({who}), {available:g} free ({asked - available:g} short)"
            )
    return problems


def _amounts(resources: Resources) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in resources.items())
