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
class GpuSlot:
    """One GPU of the run as the machine was read: `--gpu X` makes one, `--gpus` one per GPU,
    no GPU one CPU slot (gpu and index None)."""

    slot: int
    gpu: GpuFacts | None  # None: the CPU, or a GPU taken unchecked (--no-gpu-check)
    index: int | None  # as NVML numbers it (as given, unchecked); None on the CPU
    numa_node: int | None

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

    @property
    def unchecked(self) -> bool:
        """A GPU index taken as given (--mps --no-gpu-check, NVML sees none)."""
        return self.gpu is None and self.index is not None


CPU_SLOT = GpuSlot(0, None, None, None)


@dataclass(frozen=True)
class GpuGroup(GpuSlot):
    """One GPU slot of the plan and the replicas placed on it."""

    replicas: tuple[int, ...] = ()

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


def spread_counts(total: int, gpu_count: int) -> list[int]:
    """How many of `total` replicas each GPU takes, as evenly as they go: 5 over 2 → 3, 2."""
    base, extra = divmod(total, gpu_count)
    return [base + (1 if k < extra else 0) for k in range(gpu_count)]


def spread(total: int, gpu_count: int) -> list[tuple[int, ...]]:
    """Replica indices 0..total-1 in GPU order, as evenly as they go: 5 over 2 → (0,1,2),(3,4)."""
    groups, start = [], 0
    for size in spread_counts(total, gpu_count):
        groups.append(tuple(range(start, start + size)))
        start += size
    return groups


def replica_total(o: LaunchOptions, gpu_count: int) -> tuple[int, list[str]]:
    """The run's replica count once its GPUs are known (`--gpus` counted; else --replicas),
    and the problem that says why the count does not fit the GPUs."""
    if o.gpus is None or gpu_count < 1 or gpu_option_problems(o):
        return o.replicas, []
    if o.replicas_per_gpu is not None:
        total = o.replicas_per_gpu * gpu_count
        if o.replicas not in (1, total):
            return o.replicas, [
                f"--replicas {o.replicas} and --replicas-per-gpu {o.replicas_per_gpu} disagree "
                f"over {gpu_count} GPU(s) ({total} replicas); give one of them"]
        return total, []
    if o.replicas == 1:  # --gpus alone: one replica on each GPU
        return gpu_count, []
    if o.replicas < gpu_count:
        return o.replicas, [f"--replicas {o.replicas} over {gpu_count} GPUs would leave "
                            f"{gpu_count - o.replicas} GPU(s) idle; list fewer GPUs in --gpus, "
                            "or give --replicas-per-gpu N"]
    return o.replicas, []


def with_gpu_replicas(o: LaunchOptions, gpu_count: int) -> tuple[LaunchOptions, list[str]]:
    """The options with --replicas the run's total (replica_total), and why it does not fit."""
    total, problems = replica_total(o, gpu_count)
    return (o if total == o.replicas else dataclasses.replace(o, replicas=total)), problems


def gpu_groups(slots: tuple[GpuSlot, ...], total: int) -> tuple[GpuGroup, ...]:
    """The slots, the replicas spread over them."""
    return tuple(GpuGroup(s.slot, s.gpu, s.index, s.numa_node, replicas)
                 for s, replicas in zip(slots, spread(total, len(slots)), strict=True))
