"""bench/engine_steps.py's device-memory baseline: read by NVML before anything makes a CUDA
context (planning makes one on a GPU), so the overhead it reports includes this process's
context — the figure engine/plan.py's CUDA_OVERHEAD_BYTES assumes until it is measured."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the bench scripts import each other as top-level modules

import engine_steps  # noqa: E402
from engine_steps import DeviceMemory, nvml_target, overhead_figures  # noqa: E402

MiB = 1024**2
UUID = "GPU-5d1c8c1e-9f0a-4f55-8d3b-0f7e1c2a9b11"


def test_the_baseline_is_read_before_planning_makes_a_context(monkeypatch):
    """A stand-in for NVML records each reading; planning (which, on a GPU, asks torch for free
    memory and so makes the context) records itself, then plans for the CPU so this runs
    here. The first reading must come before it; the last after the steps."""
    calls: list[str] = []
    readings = iter([DeviceMemory(1000 * MiB, None), DeviceMemory(3000 * MiB, 1800 * MiB)])
    real_plan_serve = engine_steps.plan_serve

    def nvml_standin(gpu):
        calls.append(f"nvml {gpu}")
        return next(readings)

    def planning_makes_a_context(options):
        calls.append("context")
        return real_plan_serve(dataclasses.replace(options, device="cpu"))

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(engine_steps, "device_memory_used", nvml_standin)
    monkeypatch.setattr(engine_steps, "plan_serve", planning_makes_a_context)
    result = engine_steps.measure("cuda", "tiny", batch=2, steps=2, warmup=1, sync_steps=1)
    assert calls == ["nvml 0", "context", "nvml 0"]
    assert result["baseline_used_bytes"] == 1000 * MiB
    assert result["device_memory_bytes"] == 2000 * MiB
    assert result["process_memory_bytes"] == 1800 * MiB
    assert result["overhead_source"] == "nvml_process"
    assert result["measured_overhead_bytes"] == (
        1800 * MiB - result["weights_bytes"] - result["kv_cache_bytes"])


def test_the_overhead_prefers_this_process_figure_and_falls_back_to_the_device_delta():
    before = DeviceMemory(500 * MiB, None)
    own = overhead_figures(before, DeviceMemory(4000 * MiB, 1500 * MiB), 600 * MiB, 300 * MiB)
    assert own["measured_overhead_bytes"] == 600 * MiB  # 1500 - 600 - 300, the context in it
    assert own["overhead_source"] == "nvml_process"
    assert own["device_memory_bytes"] == 3500 * MiB
    withheld = overhead_figures(before, DeviceMemory(2000 * MiB, None), 600 * MiB, 300 * MiB)
    assert withheld["measured_overhead_bytes"] == 600 * MiB  # 2000 - 500 - 600 - 300
    assert withheld["overhead_source"] == "device_used_delta"
    blind = overhead_figures(DeviceMemory(None, None), DeviceMemory(None, None), 1, 1)
    assert blind["measured_overhead_bytes"] is None and blind["overhead_source"] is None


@pytest.mark.parametrize(("device", "visible", "expected"), [
    ("cuda", None, "0"),
    ("cuda:1", None, "1"),
    ("cuda", UUID, UUID),
    ("cuda", "2", "2"),  # torch's 0 is NVML's 2
    ("cuda:1", "2, 3", "3"),
    ("cuda:1", "2", None),
    ("cuda", "", None),
    ("cpu", "0", None),
])
def test_the_nvml_target_follows_cuda_visible_devices(device, visible, expected):
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert nvml_target(device, environ) == expected


def test_off_a_gpu_nvml_is_not_asked():
    assert engine_steps.device_memory_used(None) == DeviceMemory(None, None)
