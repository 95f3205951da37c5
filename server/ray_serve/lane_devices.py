"""The devices of an engine replica whose lanes span several (`--cfg-parallel`,
`--sequence-parallel`): Serve made the replica's placement group, one bundle per worker
(`placement.replica_bundles`), and started the replica in the first bundle.

The workers are the replica's own processes, as on one machine (results through shared
memory, one `torch.distributed` group), not Ray's: Ray gives the replica only its own
bundle's GPU. So each other bundle is taken by a `BundleHolder`, an idle actor Ray schedules
into that bundle: it keeps the bundle's device for the replica (Ray kills an actor with the
replica that made it, and Serve removes the group with the replica) and says which GPU Ray
gave it. The workers then see those GPUs, in bundle order, through CUDA_VISIBLE_DEVICES, as
Ray sets it for an actor that asked for all of them; `cuda:0..N-1` are the bundles' GPUs.
On the CPU the holders keep the bundles' CPUs, and there is no GPU to name.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
from ray.util import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

logger = logging.getLogger(__name__)

VISIBLE_GPUS = "CUDA_VISIBLE_DEVICES"


@ray.remote
class BundleHolder:
    """Holds one bundle of a replica's placement group while the replica lives."""

    def gpus(self) -> list[str]:
        return _own_gpus()


async def hold_lane_devices() -> list[Any]:
    """In a replica: take every bundle of its placement group but its own, and let the
    workers it spawns see their GPUs. Returns the holders (kept while the replica lives);
    none for a replica without a group of several bundles."""
    group = get_current_placement_group()
    if group is None or len(group.bundle_specs) < 2:
        return []
    holders = [
        BundleHolder.options(  # type: ignore[attr-defined]  # ray.remote's class gains options()
            num_cpus=bundle.get("CPU", 0.0),
            num_gpus=bundle.get("GPU", 0.0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
        ).remote()
        for index, bundle in enumerate(group.bundle_specs)
        if index > 0
    ]
    held = [await holder.gpus.remote() for holder in holders]
    gpus = visible_gpus(_own_gpus(), held)
    if gpus is not None:
        os.environ[VISIBLE_GPUS] = gpus  # read by the worker processes spawned after this
    logger.info(
        "holding %d bundles of placement group %s for the lanes' workers%s",
        len(group.bundle_specs),
        group.id.hex(),
        f" (GPUs {gpus})" if gpus is not None else "",
    )
    return holders


def visible_gpus(own: list[str], held: list[list[str]]) -> str | None:
    """CUDA_VISIBLE_DEVICES for the workers: the replica's GPUs, then each holder's in bundle
    order (worker i's device cuda:i is bundle i's GPU); None where no bundle has a GPU."""
    gpus = [*own, *(gpu for each in held for gpu in each)]
    return ",".join(gpus) if gpus else None


def _own_gpus() -> list[str]:
    ids: list[str] = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
    return ids
