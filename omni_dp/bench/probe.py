"""`omni-dp plan`'s reading of the machine: one replica probed as `launch` probes it (the
engine's dry run, or an external engine's model directory and KV pin), the CPU topology, the
GPU by NVML; then capacity.plan_capacity counts what fits.

The launcher's own facts, sub-planners and problem messages, so that a bad flag or a missing
GPU reads here as it does in `launch`, and what `plan` says fits is what `launch` accepts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from omni_dp.bench.capacity import Capacity, plan_capacity
from omni_dp.contract import Problems
from omni_dp.cpulist import format_cpu_list
from omni_dp.gpus import GpuFacts
from omni_dp.launcher.engines import ENGINES, EngineSizing
from omni_dp.launcher.planning.checks import check_options
from omni_dp.launcher.planning.devices import plan_gpus
from omni_dp.launcher.planning.facts import gather_facts
from omni_dp.launcher.planning.gpus import with_gpu_replicas
from omni_dp.launcher.planning.memory import plan_kv
from omni_dp.launcher.planning.options import LaunchOptions
from omni_dp.launcher.planning.plan import NO_DRY_RUN
from omni_dp.launcher.planning.topology import CpuTopology
from omni_dp.sizes import format_size
from omni_dp.tables import Grid

DEFAULTS = LaunchOptions()


class CapacityPlanError(Problems):
    """Every problem that stops the probe (the launcher's own words); nothing was started."""


@dataclass(frozen=True)
class CapacityPlan:
    """What was probed, and what fits."""

    engine: str
    device: str  # "cpu" or "cuda"
    gpus: tuple[GpuFacts, ...]  # the GPUs planned for (none on the CPU)
    topology: CpuTopology
    sizing: EngineSizing
    kv_pinned: bool
    shares_weights: bool  # the engine can share weights (--share-weights)
    capacity: Capacity
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {
            "engine": self.engine, "device": self.device,
            "gpus": [{"index": g.index, "uuid": g.uuid, "name": g.name,
                      "memory_total_bytes": g.memory_total_bytes,
                      "memory_used_bytes": g.memory_used_bytes,
                      "capability": list(g.capability) if g.capability else None}
                     for g in self.gpus],
            "physical_cores": len(self.topology.cores),
            "cpus": format_cpu_list(self.topology.allowed),
            "sizing": {**dataclasses.asdict(self.sizing),
                       "total_bytes": self.sizing.total_bytes,
                       "private_weights_bytes": self.sizing.private_weights_bytes,
                       "cuda_processes": self.sizing.cuda_processes},
            "kv_pinned": self.kv_pinned, "shares_weights": self.shares_weights,
            **self.capacity.to_json(),
            "notes": [*self.notes, *self.capacity.notes],
        }

    def title(self) -> str:
        where = ", ".join(g.label for g in self.gpus) or "the CPU"
        return (f"omni-dp plan: engine {self.engine} on {where}; one replica probed, "
                f"{len(self.topology.cores)} physical cores "
                f"({format_cpu_list(self.topology.allowed)})")

    def rows(self) -> list[tuple[str, str]]:
        """(what, its value): each limit on N with its formula, the verdict, the notes."""
        c = self.capacity
        rows = [("per replica", c.footprint)]
        if self.shares_weights and not self.sizing.shared_weights_bytes:
            rows.append(("sharing", "the engine can share weights, but this replica has none "
                                    "to share (its dry run reports 0 B shareable)"))
        elif self.shares_weights:
            once = "once per GPU" if self.gpus else "once (a shared segment)"
            rows.append(("sharing", f"weights can be shared (--share-weights): "
                                    f"{format_size(self.sizing.shared_weights_bytes)} held "
                                    f"{once}"))
        else:
            rows.append(("sharing", f"engine {self.engine} cannot share weights"))
        for limit in c.limits:
            n = "—" if limit.n is None else str(limit.n)
            rows.append((limit.name, f"N ≤ {n}: {limit.formula}"))
        if c.n_mps_clients is None and not self.gpus:
            rows.append(("mps clients", "no GPU: MPS does not apply"))
        named = ", ".join(f"{limit.name} {limit.n}" for limit in c.limits
                          if limit.n is not None and limit.name != "memory (shared)")
        per_gpu = " per GPU" if c.gpu_count > 1 else ""
        rows.append(("fits", f"N = min({named}) = {c.n_fits}{per_gpu} (set by "
                             f"{', '.join(c.limiting)})"
                             + (f"; {c.n_fits_total} in all" if c.gpu_count > 1 else "")))
        if c.candidates:
            rows.append(("candidates", ", ".join(c.candidates)))
            rows.append(("confirm with", c.bench_command))
        rows += [("note", note) for note in (*self.notes, *c.notes)]
        return rows

    def grid(self) -> Grid:
        return Grid(self.title(), ("what", "value"), self.rows(), show_headers=False,
                    indent="  ")

    def describe(self) -> list[str]:
        return [self.title(), *(f"  {what:<14} {value}" for what, value in self.rows())]


def _bench_args(o: LaunchOptions, gpu: GpuFacts | None, sizing: EngineSizing) -> list[str]:
    """The flags that make the bench run the replica probed here: its device, its engine and
    its KV pin (the engine's default pinned when none was given: equal KV for every N)."""
    if o.gpus is not None:
        args = ["--gpus", o.gpus]
    elif gpu is None:
        args = ["--gpu", "none"]
    else:
        args = ["--gpu", o.gpu if o.gpu != "auto" else str(gpu.index)]
    if o.engine != DEFAULTS.engine:
        args += ["--engine", o.engine]
    if o.kv_cache_bytes is not None:
        args += ["--kv-cache-bytes", str(o.kv_cache_bytes)]
    elif o.max_total_tokens is not None or sizing.kv_tokens:  # 0: a model with no KV, no pin
        args += ["--max-total-tokens", str(o.max_total_tokens or sizing.kv_tokens)]
    for name in ("engine_python", "engine_overhead", "engine_stage", "memory_headroom"):
        value = getattr(o, name)
        if value != getattr(DEFAULTS, name):
            args += ["--" + name.replace("_", "-"), str(value)]
    return args


def _tightest(gpus: tuple[GpuFacts, ...], headroom: float) -> GpuFacts | None:
    """Of several GPUs, the one with the least usable memory: N per GPU must fit on each."""
    def usable(g: GpuFacts) -> int:
        return int((g.memory_total_bytes or 0) * (1 - headroom)) - (g.memory_used_bytes or 0)

    return min(gpus, key=usable) if gpus else None


def probe_capacity(options: LaunchOptions, *, cores_per_replica: int = 1) -> CapacityPlan:
    """Read the machine as `launch` does for one replica (per GPU with --gpus), then count;
    CapacityPlanError with every problem (the launcher's) when it cannot."""
    options = dataclasses.replace(options, replicas=1, mps=False, replicas_per_gpu=None)
    facts = gather_facts(options, option_problems=check_options(options))
    o, problems = with_gpu_replicas(options, len(facts.slots))
    problems = [*check_options(o), *problems]
    gpu_part, found = plan_gpus(o, facts)
    problems += found
    kv, found = plan_kv(o, facts, gpu_part)
    problems += found
    if problems:
        raise CapacityPlanError(problems)
    if kv is None or gpu_part is None:
        raise CapacityPlanError([NO_DRY_RUN])
    engine = ENGINES[o.engine]
    sizing = kv.sizing
    gpus = tuple(g.gpu for g in gpu_part.groups if g.gpu is not None)
    gpu = _tightest(gpus, o.memory_headroom)
    pinned = o.kv_cache_bytes is not None or o.max_total_tokens is not None
    notes = []
    if not pinned and sizing.kv_tokens == 0 and sizing.kv_cache_bytes == 0:
        notes.append("no KV: the engine's model keeps none (a Piper voice), so there is no "
                     "pin to give")
    elif not pinned:
        notes.append(f"KV not pinned: planned with the engine's default ({sizing.kv_tokens} "
                     "tokens); pin it with --max-total-tokens N or --kv-cache-bytes SIZE to plan "
                     "the size you will run")
    if len({g.memory_total_bytes for g in gpus}) > 1:
        notes.append(f"the GPUs differ in memory: N per GPU is counted on {gpu.label}, the "
                     "one with the least usable")
    cuda = sizing.cuda_processes
    capacity = plan_capacity(
        sizing, gpu, facts.topology, headroom=o.memory_headroom,
        shares_weights=engine.shares_weights,
        cuda_processes_per_replica=cuda if cuda is not None else engine.cuda_processes_per_replica,
        cores_per_replica=cores_per_replica, gpus=max(len(gpu_part.groups), 1),
        host_memory=facts.host_memory_available, command=facts.command,
        bench_args=tuple(_bench_args(o, gpu, sizing)), engine_args=o.engine_args)
    return CapacityPlan(engine=o.engine, device=gpu_part.device, gpus=gpus,
                        topology=facts.topology, sizing=sizing, kv_pinned=pinned,
                        shares_weights=engine.shares_weights, capacity=capacity,
                        notes=tuple(notes))
