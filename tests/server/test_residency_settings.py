"""The models' memory budgets: `--models-memory-mb`, else a share of the CUDA device's
memory when `--gpu-memory-utilization` is given, else none; and the host budget."""

from __future__ import annotations

from server.settings import load_settings

GiB = 2**30
TWO = ["a=tiny-sd", "b=tiny-flux"]


def cuda(total: int) -> object:
    def device_total(device: str) -> int | None:
        return total if device.startswith("cuda") else None

    return device_total


def test_a_given_utilization_on_a_cuda_device_is_the_default_budget() -> None:
    settings = load_settings(overrides={"models": TWO, "device": "cuda:1", "gpu_memory_utilization": 0.5})
    assert settings.models_budget_bytes(cuda(80 * GiB)) == 40 * GiB  # type: ignore[arg-type]


def test_no_default_budget_without_the_flag_or_without_a_gpu() -> None:
    untold = load_settings(overrides={"models": TWO, "device": "cuda"})
    assert untold.models_budget_bytes(cuda(80 * GiB)) is None  # type: ignore[arg-type]
    on_cpu = load_settings(overrides={"models": TWO, "gpu_memory_utilization": 0.5})
    assert on_cpu.models_budget_bytes(cuda(80 * GiB)) is None  # type: ignore[arg-type]
    no_gpu = load_settings(overrides={"models": TWO, "device": "cuda", "gpu_memory_utilization": 0.5})
    assert no_gpu.models_budget_bytes(lambda device: None) is None


def test_models_memory_mb_wins_and_the_host_budget_is_its_own() -> None:
    settings = load_settings(
        overrides={
            "models": TWO,
            "models_memory_mb": 6,
            "gpu_memory_utilization": 0.5,
            "models_host_memory_mb": 3,
        }
    )
    assert settings.models_budget_bytes(cuda(80 * GiB)) == 6 * 2**20  # type: ignore[arg-type]
    assert settings.host_budget_bytes() == 3 * 2**20
    assert load_settings(overrides={"models": TWO}).host_budget_bytes() is None
