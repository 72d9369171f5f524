"""Which device the replicas use: the GPU (or, with --gpus, each GPU and its replicas) or the
CPU, and what --mps needs of it."""

from __future__ import annotations

from dataclasses import dataclass

from omni_dp.gpus import NO_DRIVER, GpuFacts
from omni_dp.launcher.engines import ENGINES
from omni_dp.launcher.planning.checks import (
    replica_count_problems,
    replica_port_problems,
)
from omni_dp.launcher.planning.facts import LaunchFacts, visible_id
from omni_dp.launcher.planning.gpus import GpuGroup, gpu_groups, gpu_option_problems
from omni_dp.launcher.planning.options import LaunchOptions
from omni_dp.mps.binaries import MpsBinaries
from omni_dp.mps.preflight import NO_DRIVER_MESSAGE


@dataclass(frozen=True)
class GpuPart:
    gpu: GpuFacts | None  # the first GPU (the only one without --gpus); None: on the CPU
    device: str  # "cpu" or "cuda"
    label: str  # "GPU-<uuid>" (or the index), or "cpu"; comma-separated over GPUs
    warnings: tuple[str, ...] = ()
    groups: tuple[GpuGroup, ...] = ()  # one per GPU slot, with its replicas

    def group_of(self, index: int) -> GpuGroup:
        return next(g for g in self.groups if index in g.replicas)


@dataclass(frozen=True)
class MpsPart:
    binary: str | None  # the control binary; None without --mps
    binaries: MpsBinaries | None


def plan_gpu(o: LaunchOptions, facts: LaunchFacts) -> tuple[GpuPart | None, list[str]]:
    """Which device the replicas use, and what --mps needs of it."""
    gpu = facts.gpu
    problems = []
    if o.gpu not in ("auto", "none") and gpu is None:
        problems += facts.gpu_problems or [f"--gpu {o.gpu}: no such GPU"]
    problems += _mps_gpu_problems(o, facts)
    engine = ENGINES.get(o.engine)
    if engine is not None and engine.needs_gpu and (gpu is None or o.gpu == "none"):
        on_cpu = ", ".join(name for name, e in ENGINES.items() if not e.needs_gpu)
        problems.append(f"engine {o.engine} needs a CUDA GPU and there is none to use"
                        + (" (--gpu none)" if o.gpu == "none" else "")
                        + f"; it cannot serve on the CPU (these can: {on_cpu})")
    if problems:
        return None, problems
    warnings = ()
    if o.mps and gpu is None:  # --no-gpu-check
        warnings = ("--no-gpu-check: no GPU, the replicas run on CPU; the MPS daemon runs but "
                    "no process can attach to it, so attach verification will fail",)
    # the replicas' indices only once their count is valid (10**30 of them must not be made)
    count = 0 if replica_count_problems(o) or replica_port_problems(o) else o.replicas
    groups = (GpuGroup(0, gpu, gpu.index if gpu is not None else None, facts.gpu_numa_node,
                       tuple(range(count))),)
    return GpuPart(gpu, "cuda" if gpu is not None else "cpu", visible_id(gpu) or "cpu",
                   warnings, groups), []


def plan_gpus(o: LaunchOptions, facts: LaunchFacts) -> tuple[GpuPart | None, list[str]]:
    """--gpus: one slot per GPU, the replicas spread over them (o.replicas is the total)."""
    problems = list(facts.gpu_problems)
    if gpu_option_problems(o) or replica_count_problems(o) or replica_port_problems(o):
        return None, problems
    listed = [(g, g.index, node) for g, node in zip(facts.gpus, facts.gpu_nodes, strict=True)]
    listed += [(None, index, None) for index in facts.unchecked_gpus]
    if not listed and not problems:
        problems.append(f"--gpus {o.gpus}: no GPU to use")
    if o.mps:
        problems += [_no_uuid(g) for g, _, _ in listed if g is not None and not g.uuid]
    engine = ENGINES.get(o.engine)
    if engine is not None and engine.needs_gpu and facts.unchecked_gpus:
        problems.append(f"engine {o.engine} needs CUDA GPUs; --no-gpu-check runs the replicas "
                        "on the CPU")
    if o.share_weights and len(listed) > 1:
        problems.append("--share-weights shares one copy of the weights on one GPU; with "
                        "--gpus over several GPUs each GPU would need its own leader, which "
                        "omni-dp does not do yet: run one launch per GPU, or without "
                        "--share-weights")
    if listed and o.replicas < len(listed):  # with_gpu_replicas said why
        return None, problems
    if problems:
        return None, problems
    groups = gpu_groups(listed, o.replicas)
    warnings: tuple[str, ...] = ()
    if facts.unchecked_gpus:
        warnings = (f"--no-gpu-check: GPUs {o.gpus} taken unchecked (NVML sees none): one MPS "
                    "daemon per GPU runs, the replicas run on the CPU and nothing can attach, "
                    "so attach verification will fail",)
    first = facts.gpus[0] if facts.gpus else None
    return GpuPart(first, "cuda" if first is not None else "cpu",
                   ",".join(g.label for g in groups), warnings, groups), []


def _no_uuid(gpu: GpuFacts) -> str:
    return (f"--mps: NVML could not read the UUID of GPU {gpu.index}; its MPS daemon and "
            "clients must name the GPU by UUID; check `nvidia-smi -L` and the driver, or run "
            "without --mps")


def _mps_gpu_problems(o: LaunchOptions, facts: LaunchFacts) -> list[str]:
    gpu = facts.gpu
    if not o.mps:
        return []
    if gpu is None and not o.no_gpu_check:
        why = "; ".join(p.replace(NO_DRIVER_MESSAGE, NO_DRIVER) for p in facts.gpu_problems)
        return [f"--mps needs a GPU, and there is none to use ({why or 'NVML sees no GPU here'})"
                "; run without --mps to use the CPU"]
    if gpu is not None and not gpu.uuid:
        return [f"--mps: NVML could not read the UUID of GPU {gpu.index}; the MPS daemon and "
                "its clients must name the GPU by UUID (a client's CUDA_VISIBLE_DEVICES index "
                "is renumbered under MPS and names the right GPU only by chance); check "
                "`nvidia-smi -L` and the driver, or run without --mps"]
    return []


def plan_mps(o: LaunchOptions, facts: LaunchFacts) -> tuple[MpsPart | None, list[str]]:
    """The MPS binaries the run uses, and the MPS preflight's word (read with the facts).
    Where there is no GPU at all (and no --no-gpu-check), --mps is refused by plan_gpu in one
    line: where its binaries were looked for is beside the point there."""
    if o.mps and not o.no_gpu_check and facts.gpu is None and not facts.gpus:
        return None, []
    if facts.mps_problems:
        return None, list(facts.mps_problems)
    return MpsPart(facts.mps_binary, facts.mps_binaries), []
