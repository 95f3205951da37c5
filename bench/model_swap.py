"""What a switch between two models costs when only one fits: loaded again from disk, or
brought back from host memory (`--models-host-memory-mb`). Drives a `ModelSet` as the
server builds it, alternating requests for the two models, and prints each way's median
switch time and their ratio, measured side by side in one run.

    python -m bench.model_swap --model tiny-sd --switches 6
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from engine.models.model_set import ModelSet
from server.app import build_engine
from server.settings import load_settings


async def switch_times(model: str, budget_mb: float, host_mb: float | None, switches: int) -> list[float]:
    values: dict[str, object] = {"models": [f"a={model}", f"b={model}"], "models_memory_mb": budget_mb}
    if host_mb is not None:
        values["models_host_memory_mb"] = host_mb
    models = build_engine(load_settings(overrides=values))
    assert isinstance(models, ModelSet)
    await models.start()
    try:
        for name in ("a", "b"):  # both loaded once from disk: sizes known, b resident
            await models.engine_for(name)
        times = []
        for i in range(switches):
            started = time.perf_counter()  # host work only on the CPU; a GPU move syncs inside
            await models.engine_for("ab"[i % 2])
            times.append(time.perf_counter() - started)
        return times
    finally:
        await models.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny-sd")
    parser.add_argument("--budget-mb", type=float, default=6.0, help="room for one copy of the model")
    parser.add_argument("--switches", type=int, default=6)
    args = parser.parse_args()
    dropped = asyncio.run(switch_times(args.model, args.budget_mb, None, args.switches))
    parked = asyncio.run(switch_times(args.model, args.budget_mb, args.budget_mb, args.switches))
    drop_s, park_s = statistics.median(dropped), statistics.median(parked)
    print(f"model={args.model} switches={args.switches} budget_mb={args.budget_mb}")
    print("| switch | median s | min s | max s |\n|---|---:|---:|---:|")
    print(f"| load from disk | {drop_s:.3f} | {min(dropped):.3f} | {max(dropped):.3f} |")
    print(f"| back from host memory | {park_s:.4f} | {min(parked):.4f} | {max(parked):.4f} |")
    print(f"ratio load / back from host: {drop_s / max(park_s, 1e-9):.0f}x")


if __name__ == "__main__":
    main()
