"""Which GPUs a run uses and which replicas go on each: pure, like the rest of the plan.

`--gpu X` (one GPU, or the CPU) makes one slot; `--gpus 0,1,…|all` one slot per GPU, each with
its own MPS daemon, its own CPU cores and its own memory fit. Replicas are numbered across the
run and laid out GPU by GPU: `--replicas-per-gpu N` puts N on each, `--replicas R` spreads R as
evenly as it goes (the first R mod G GPUs take one more), `--gpus` alone puts one on each.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from omni_dp.gpus import GpuFacts
from omni_dp.launcher.planning.options import LaunchOptions
from omni_dp.runfile import GpuRecord

MAX_GPUS = 64  # more than any host has: a longer --gpus list is a typo
MAX_PORTS = 65535


@dataclass(frozen=True)
class GpuGroup:
    """One GPU slot of the plan and the replicas placed on it."""

    slot: int
    gpu: GpuFacts | None  # None: the CPU, or a GPU taken unchecked (--no-gpu-check)
    index: int | None  # as NVML numbers it (as given, unchecked); None on the CPU
    numa_node: int | None
    replicas: tuple[int, ...]

    @property
    def label(self) -> str:
        """What CUDA_VISIBLE_DEVICES names it by: its UUID, else its index; "cpu" for none."""
        if self.gpu is not None:
            return self.gpu.uuid or str(self.gpu.index)
        return "cpu" if self.index is None else str(self.index)

    @property
    def title(self) -> str:
        """`GPU 1 (NVIDIA H200)` in messages; `cpu` without a GPU."""
        if self.gpu is not None:
            return self.gpu.label
        return "cpu" if self.index is None else f"GPU {self.index} (unchecked)"

    def record(self) -> GpuRecord:
        return GpuRecord(self.slot, self.label, self.index, self.numa_node,
                         self.gpu.name if self.gpu is not None else None)


def parse_gpu_list(text: str) -> tuple[list[str], list[str]]:
    """`0,1` / `GPU-a,GPU-b` / `all` → the entries (["all"] for all), or the problems."""
    entries = [entry.strip() for entry in text.split(",")]
    if entries == ["all"]:
        return entries, []
    problems = []
    if any(not entry for entry in entries):
        problems.append(f"--gpus {text!r}: an empty entry; give GPU indices or UUIDs separated "
                        "by commas (e.g. --gpus 0,1), or --gpus all")
    if "all" in entries:
        problems.append(f"--gpus {text!r}: `all` stands alone (every GPU NVML sees)")
    if len(entries) > MAX_GPUS:
        problems.append(f"--gpus lists {len(entries)} GPUs; a host has at most {MAX_GPUS}")
    seen: set[str] = set()
    for entry in entries:
        if entry and entry.lower() in seen:
            problems.append(f"--gpus {text!r}: GPU {entry} is listed twice")
        seen.add(entry.lower())
    return ([], problems) if problems else (entries, [])


def gpu_option_problems(o: LaunchOptions) -> list[str]:
    """What is wrong with --gpus / --replicas-per-gpu whatever the machine."""
    problems = []
    if o.gpus is not None:
        problems += parse_gpu_list(o.gpus)[1]
        if o.gpu != "auto":
            problems.append(f"--gpu {o.gpu} and --gpus {o.gpus} are exclusive: --gpu runs on one "
                            "GPU, --gpus on several")
    if o.replicas_per_gpu is not None:
        if o.gpus is None:
            problems.append("--replicas-per-gpu needs --gpus (with one GPU, --replicas is the "
                            "count)")
        if not 1 <= o.replicas_per_gpu <= MAX_PORTS:  # each replica listens on a port
            problems.append(f"--replicas-per-gpu must be from 1 to {MAX_PORTS}, got "
                            f"{o.replicas_per_gpu}")
    return problems


def spread(total: int, gpu_count: int) -> list[tuple[int, ...]]:
    """Replica indices 0..total-1 in GPU order, as evenly as they go: 5 over 2 → (0,1,2),(3,4)."""
    base, extra = divmod(total, gpu_count)
    groups, start = [], 0
    for k in range(gpu_count):
        size = base + (1 if k < extra else 0)
        groups.append(tuple(range(start, start + size)))
        start += size
    return groups


def with_gpu_replicas(o: LaunchOptions, gpu_count: int) -> tuple[LaunchOptions, list[str]]:
    """The options with --replicas the run's total once the GPUs are known (`--gpus` counted),
    or the problem that says why the count does not fit the GPUs."""
    if o.gpus is None or gpu_count < 1 or gpu_option_problems(o):
        return o, []
    if o.replicas_per_gpu is not None:
        total = o.replicas_per_gpu * gpu_count
        if o.replicas not in (1, total):
            return o, [f"--replicas {o.replicas} and --replicas-per-gpu {o.replicas_per_gpu} "
                       f"disagree over {gpu_count} GPU(s) ({total} replicas); give one of them"]
        return dataclasses.replace(o, replicas=total), []
    if o.replicas == 1:  # --gpus alone: one replica on each GPU
        return dataclasses.replace(o, replicas=gpu_count), []
    if o.replicas < gpu_count:
        return o, [f"--replicas {o.replicas} over {gpu_count} GPUs would leave "
                   f"{gpu_count - o.replicas} GPU(s) idle; list fewer GPUs in --gpus, or give "
                   "--replicas-per-gpu N"]
    return o, []


def gpu_groups(gpus: list[tuple[GpuFacts | None, int | None, int | None]],
               total: int) -> tuple[GpuGroup, ...]:
    """One group per (facts, index, NUMA node), the replicas spread over them."""
    return tuple(GpuGroup(slot, facts, index, node, replicas)
                 for slot, ((facts, index, node), replicas)
                 in enumerate(zip(gpus, spread(total, len(gpus)), strict=True)))


