"""Bench numbers as the table and the figure write them: ranges as `median [low–high]`,
failures as `failed/sent (kind: count)`, the machine in a few words."""

from __future__ import annotations

import math

from omni_dp.bench.results import Range


def number(value: float | None) -> str:
    """Three significant figures or so, never scientific notation: 0.0123, 1.23, 12.3, 123."""
    if value is None or not math.isfinite(value):
        return "—"
    size = abs(value)
    if size >= 100 or value == 0:
        return f"{value:.0f}"
    if size >= 10:
        return f"{value:.1f}"
    if size >= 1:
        return f"{value:.2f}"
    return f"{value:.{min(2 - math.floor(math.log10(size)), 9)}f}"  # 0.850, 0.0123


def range_text(r: Range | None, suffix: str = "") -> str:
    """`median [low–high]`: the spread over the trials, said with the median."""
    if r is None:
        return "—"
    return f"{number(r.median)}{suffix} [{number(r.low)}–{number(r.high)}{suffix}]"


def failures_text(failures: dict[str, int], requests: int) -> str:
    """`8/1200 (http 503: 5, timeout: 3)`: failed of sent, by kind."""
    failed = sum(failures.values())
    kinds = ", ".join(f"{kind}: {count}" for kind, count in sorted(failures.items()) if count)
    return f"{failed}/{requests}" + (f" ({kinds})" if kinds else "")


def machine_text(machine: dict) -> str:
    """The machine in a few words: its GPU (name, memory) or CPU only, its CPUs, its host."""
    gpu = machine.get("gpu")
    if isinstance(gpu, dict):
        memory = gpu.get("memory_bytes") or gpu.get("memory_total_bytes") or gpu.get("memory")
        gpu_words = str(gpu.get("name") or "a GPU")
        if isinstance(memory, int):
            gpu_words += f" {memory / 1024**3:.0f} GiB"
        elif memory:
            gpu_words += f" {memory}"
    elif gpu in (None, "", "none", False):
        gpu_words = "CPU only"
    else:
        gpu_words = str(gpu)
    words = [gpu_words]
    cpus = machine.get("cpus")
    if cpus:
        words.append(f"{cpus} CPUs")
    if machine.get("host"):
        words.append(str(machine["host"]))
    return ", ".join(words)


def settings_text(settings: dict) -> str:
    """`trials 3; duration_s 20; concurrency 16,32`: the settings that are set, as given."""
    parts = []
    for key, value in settings.items():
        if value is None or isinstance(value, dict):
            continue
        if isinstance(value, (list, tuple)):
            value = ",".join(map(str, value))
        parts.append(f"{key} {value}")
    return "; ".join(parts)
