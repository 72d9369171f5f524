"""Which GPU slots the replicas use (`--gpu X` one, `--gpus` one per GPU, no GPU one CPU slot)
and which replicas go on each, and what --mps needs of them."""

from __future__ import annotations

from dataclasses import dataclass

from omni_dp.gpus import NO_DRIVER, GpuFacts
from omni_dp.launcher.engines import ENGINES
from omni_dp.launcher.planning.checks import (
    replica_count_problems,
    replica_port_problems,
)
from omni_dp.launcher.planning.facts import LaunchFacts
from omni_dp.launcher.planning.gpus import GpuGroup, gpu_groups, gpu_option_problems
from omni_dp.launcher.planning.options import LaunchOptions
from omni_dp.mps.binaries import MpsBinaries
from omni_dp.mps.preflight import NO_DRIVER_MESSAGE


@dataclass(frozen=True)
class GpuPart:
    """The run's GPU slots (one CPU slot without a GPU), each with its replicas."""

    groups: tuple[GpuGroup, ...]
    warnings: tuple[str, ...] = ()

    @property
    def device(self) -> str:
        """"cuda", or "cpu" (no GPU, or GPUs taken unchecked: the replicas run on the CPU)."""
        return "cuda" if self.groups[0].gpu is not None else "cpu"

    @property
    def label(self) -> str:
        """Its slots' labels, comma-separated: run.json's "gpu"."""
        return ",".join(g.label for g in self.groups)

    def group_of(self, index: int) -> GpuGroup:
        return next(g for g in self.groups if index in g.replicas)


@dataclass(frozen=True)
class MpsPart:
    binary: str | None  # the control binary; None without --mps
    binaries: MpsBinaries | None


def plan_gpus(o: LaunchOptions, facts: LaunchFacts) -> tuple[GpuPart | None, list[str]]:
    """Which GPU slots the replicas use and which replicas go on each (o.replicas is the
    run's total), and what --mps needs of the GPUs."""
    listed = o.gpus is not None
    unplaced = bool(replica_count_problems(o) or replica_port_problems(o))
    if listed and (gpu_option_problems(o) or unplaced):
        return None, list(facts.gpu_problems)
    problems = [*_lookup_problems(o, facts), *_mps_gpu_problems(o, facts),
                *_engine_gpu_problems(o, facts), *_share_problems(o, facts)]
    if problems or (listed and facts.slots and o.replicas < len(facts.slots)):
        return None, problems  # fewer replicas than GPUs: replica_total said why
    # the replicas' indices only once their count is valid (10**30 of them must not be made)
    groups = gpu_groups(facts.slots, 0 if unplaced else o.replicas)
    return GpuPart(groups, _gpu_warnings(o, facts)), []


def _lookup_problems(o: LaunchOptions, facts: LaunchFacts) -> list[str]:
    """Why a GPU asked for is not there."""
    if o.gpus is not None:
        return list(facts.gpu_problems) or ([] if facts.slots else
                                            [f"--gpus {o.gpus}: no GPU to use"])
    if o.gpu not in ("auto", "none") and facts.first_gpu is None:
        return list(facts.gpu_problems) or [f"--gpu {o.gpu}: no such GPU"]
    return []


def _engine_gpu_problems(o: LaunchOptions, facts: LaunchFacts) -> list[str]:
    """An engine that needs CUDA, and a slot without a GPU."""
    engine = ENGINES.get(o.engine)
    if engine is None or not engine.needs_gpu:
        return []
    if o.gpus is not None:
        return [f"engine {o.engine} needs CUDA GPUs; --no-gpu-check runs the replicas on the "
                "CPU"] if any(s.unchecked for s in facts.slots) else []
    if facts.first_gpu is not None and o.gpu != "none":
        return []
    on_cpu = ", ".join(name for name, e in ENGINES.items() if not e.needs_gpu)
    return [f"engine {o.engine} needs a CUDA GPU and there is none to use"
            + (" (--gpu none)" if o.gpu == "none" else "")
            + f"; it cannot serve on the CPU (these can: {on_cpu})"]


def _share_problems(o: LaunchOptions, facts: LaunchFacts) -> list[str]:
    if o.share_weights and len(facts.slots) > 1:
        return ["--share-weights shares one copy of the weights on one GPU; with --gpus over "
                "several GPUs each GPU would need its own leader, which omni-dp does not do "
                "yet: run one launch per GPU, or without --share-weights"]
    return []


def _gpu_warnings(o: LaunchOptions, facts: LaunchFacts) -> tuple[str, ...]:
    """--mps --no-gpu-check without a GPU to check: what it will and will not do."""
    if not o.mps or all(s.gpu is not None for s in facts.slots):
        return ()
    if o.gpus is not None:
        return (f"--no-gpu-check: GPUs {o.gpus} taken unchecked (NVML sees none): one MPS "
                "daemon per GPU runs, the replicas run on the CPU and nothing can attach, "
                "so attach verification will fail",)
    return ("--no-gpu-check: no GPU, the replicas run on CPU; the MPS daemon runs but no "
            "process can attach to it, so attach verification will fail",)


def _mps_gpu_problems(o: LaunchOptions, facts: LaunchFacts) -> list[str]:
    """--mps needs a GPU, named by its UUID."""
    if not o.mps:
        return []
    if o.gpus is not None:
        return [_no_uuid(s.gpu) for s in facts.slots if s.gpu is not None and not s.gpu.uuid]
    gpu = facts.first_gpu
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


def _no_uuid(gpu: GpuFacts) -> str:
    return (f"--mps: NVML could not read the UUID of GPU {gpu.index}; its MPS daemon and "
            "clients must name the GPU by UUID; check `nvidia-smi -L` and the driver, or run "
            "without --mps")


def plan_mps(o: LaunchOptions, facts: LaunchFacts) -> tuple[MpsPart | None, list[str]]:
    """The MPS binaries the run uses, and the MPS preflight's word (read with the facts).
    Where there is no GPU at all (and no --no-gpu-check), --mps is refused by plan_gpus in one
    line: where its binaries were looked for is beside the point there."""
    if o.mps and not o.no_gpu_check and all(s.gpu is None for s in facts.slots):
        return None, []
    if facts.mps_problems:
        return None, list(facts.mps_problems)
    return MpsPart(facts.mps_binary, facts.mps_binaries), []
