"""Resolve a placement request into one replica's processes, and refuse a bad one at once.

Everything a placement could get wrong is found here, when the configuration is read, never at
serving time: a process on two GPUs, colocated GPU stages without declared fractions or over the
per-GPU limit, derived process names that collide, a process-local edge split across processes,
fusion that is not adjacent and ordered, replicas of a stage that keeps state. Every problem is
collected first, so that one run shows the user all of them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from omni_dp.placement.config import suggestion
from omni_dp.placement.model import (
    MAIN_PROCESS,
    MAX_CPU_DEVICE_MEMORY_BYTES,
    MAX_REPLICAS,
    MAX_TP_SIZE,
    PipelineSpec,
    Placement,
    PlacementError,
    PlacementRequest,
    ProcessPlan,
    Provenance,
    Source,
    StageConfig,
    StageSpec,
)
from omni_dp.sizes import format_size
from omni_dp.yamlconfig import brief, clip

CPU = "cpu"
_TOLERANCE = 1e-9  # 0.85 + 0.05 must fit under 0.9 despite binary floats


@dataclass(frozen=True)
class _Stage:
    """One stage as resolved: its declaration, its configuration, where it runs."""

    spec: StageSpec
    config: StageConfig
    device: str  # cpu | cuda:N
    rank_devices: tuple[str, ...]  # a TP stage: one per rank; else (device,)
    process: str  # after fusion; a TP or replicated stage: the base of its process names
    origin: Provenance  # of `process`

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def is_tp(self) -> bool:
        return self.config.tp_size > 1

    @property
    def is_replicated(self) -> bool:
        return self.config.replicas > 1


@dataclass
class _Draft:
    """A process before its budget is known: its name, stages and where the name came from."""

    name: str
    stages: list[_Stage]
    origin: Provenance
    what: str  # the process in words, for a name collision
    device: str | None = None  # a TP rank's or replica's device; None: from its stages
    tp_rank: int | None = None
    tp_size: int = 1
    replica: int | None = None
    fractions: list[float] = field(default_factory=list)


def _gpu_index(device: str) -> int | None:
    return int(device.removeprefix("cuda:")) if device.startswith("cuda:") else None


def _resolved_device(value: str, spec: StageSpec, default_device: str) -> str:
    """auto → the replica's --device for an accelerator stage, the CPU for a CPU stage."""
    if value == "auto":
        return default_device if spec.accelerator else CPU
    return CPU if value == CPU else f"cuda:{value}"


def _names(stages: Iterable[str]) -> str:
    return ", ".join(stages)


def _fraction_text(value: float) -> str:
    return f"{round(value, 6):g}"


# --- per stage: devices, TP, replicas -------------------------------------------------------
def _device_problems(stage: _Stage, gpu_count: int) -> list[str]:
    problems = []
    name, config = stage.name, stage.config
    places = [(f"{name}'s device", stage.device)] if not stage.is_tp else [
        (f"{name}'s rank {rank} device", device) for rank, device in enumerate(stage.rank_devices)]
    for what, device in places:
        index = _gpu_index(device)
        if index is not None and index >= gpu_count:
            problems.append(f"{what} is {device}, but only {gpu_count} GPU(s) visible")
    if not stage.spec.accelerator and any(d != CPU for d in stage.rank_devices):
        problems.append(f"{name} runs on the CPU only; its device {config.device} would put it "
                        f"on {stage.device}")
    if config.devices and not stage.is_tp:
        problems.append(f"{name}.devices is for tp_size > 1 (one device per rank); {name} has "
                        f"tp_size 1: use {name}.device")
    return problems


def _tp_problems(stage: _Stage, pipeline: PipelineSpec) -> list[str]:
    if not stage.is_tp:
        return []
    name, config = stage.name, stage.config
    problems = []
    if not stage.spec.tp_capable:
        capable = [s.name for s in pipeline.stages if s.tp_capable]
        who = f"only {_names(capable)} can" if capable else f"no stage of {pipeline.name} can"
        problems.append(f"{name}.tp_size is {config.tp_size}, but {name} cannot be split "
                        f"across ranks; {who}")
    if config.replicas > 1:
        problems.append(f"{name} has tp_size {config.tp_size} and replicas "
                        f"{config.replicas}; give a TP stage one set of ranks")
    if not config.devices:
        if stage.device != CPU:
            problems.append(f"{name}.tp_size is {config.tp_size} on {stage.device}: give "
                            f"{name}.devices, one GPU per rank (e.g. 0,1)")
        return problems
    if len(config.devices) != config.tp_size:
        problems.append(f"{name}.devices lists {len(config.devices)} device(s) for tp_size "
                        f"{config.tp_size}; give one per rank")
        return problems
    gpus = [d for d in stage.rank_devices if d != CPU]
    if gpus and len(gpus) != len(stage.rank_devices):
        problems.append(f"{name}'s TP ranks mix the CPU and GPUs ({_names(stage.rank_devices)});"
                        " put every rank on the CPU, or each on its own GPU")
    elif len(set(gpus)) != len(gpus):
        problems.append(f"{name}'s TP ranks share a GPU ({_names(stage.rank_devices)}): NCCL "
                        "needs one GPU per rank")
    return problems


def _rank_devices(spec: StageSpec, config: StageConfig, device: str,
                  default_device: str) -> tuple[str, ...]:
    """A TP stage's device per rank: its `devices`, else tp_size × its device."""
    if config.tp_size <= 1:
        return (device,)
    if len(config.devices) == config.tp_size:
        return tuple(_resolved_device(d, spec, default_device) for d in config.devices)
    return (device,) * config.tp_size  # the CPU default, or a problem already reported


def _replica_problems(stage: _Stage, stages: list[_Stage]) -> list[str]:
    if not stage.is_replicated:
        return []
    name, count = stage.name, stage.config.replicas
    if not stage.spec.replicable:
        state = f" ({stage.spec.state})" if stage.spec.state else ""
        return [f"{name}.replicas is {count}, but {name} keeps state across requests{state}; "
                "scale it with DP replicas: omni-dp launch --replicas"]
    if stage.process == MAIN_PROCESS:  # only where set so: by default they are named after it
        return [f"{name}.replicas is {count}, so {name} needs processes of its own, but "
                f"{name}.process is {MAIN_PROCESS}, the replica's HTTP front; name another "
                f"process, or leave {name}.process unset ({name}-r0, {name}-r1, ...)"]
    others = [s.name for s in stages if s.process == stage.process and s is not stage]
    if others:
        return [f"{name}.replicas is {count}, so {name} needs a process of its own; its "
                f"process {stage.process!r} also holds {_names(others)}"]
    return []


def _process_problems(stage: _Stage, stages: list[_Stage], request: PlacementRequest) -> list[str]:
    """Rule 1 (a non-TP stage names a process) and a TP stage's process of its own."""
    name = stage.name
    if not stage.is_tp:
        return [] if stage.process else [f"{name} names no process; give {name}.process"]
    explicit = request.source_of(name, "process").source != Source.DEFAULT
    if stage.process == MAIN_PROCESS and explicit:
        return [f"{name} has tp_size {stage.config.tp_size}, so it runs in rank processes of "
                f"its own; it cannot be in {MAIN_PROCESS}"]
    others = [s.name for s in stages if s.process == stage.process and s is not stage]
    if others:
        return [f"{name} has tp_size {stage.config.tp_size}, so it shares its process with no "
                f"other stage; {_names(others)} {'names' if len(others) == 1 else 'name'} "
                f"process {stage.process!r}"]
    return []


# --- fusion ----------------------------------------------------------------------------------
def _group_problems(group: tuple[str, ...], label: str, pipeline: PipelineSpec,
                    stages: Mapping[str, _Stage]) -> list[str]:
    """Fusion is placement only: adjacent, ordered, non-TP stages on at most one GPU."""
    if not group:
        return [f"{label} is empty"]
    unknown = [s for s in group if s not in stages]
    if unknown:
        return [f"unknown stage {brief(s)} in {label}" + suggestion(s, list(stages), "stages")
                for s in unknown]
    problems = []
    order = [s.name for s in pipeline.stages]
    first = order.index(group[0])
    if list(group) != order[first:first + len(group)]:
        problems.append(f"{label}: fused stages must be adjacent and in pipeline order "
                        f"({' → '.join(order)})")
    problems += [f"{label}: {s} has tp_size {stages[s].config.tp_size}; a TP stage runs in "
                 "rank processes of its own and cannot be fused" for s in group if stages[s].is_tp]
    problems += [f"{label}: {s} has replicas {stages[s].config.replicas}; a replicated stage "
                 "runs in processes of its own and cannot be fused"
                 for s in group if stages[s].is_replicated]
    gpus = {stages[s].device for s in group} - {CPU}
    if len(gpus) > 1:
        placed = _names(f"{s} on {stages[s].device}" for s in group)
        problems.append(f"{label} spans {len(gpus)} GPUs ({placed}); fused stages share one "
                        "process, which holds at most one GPU")
    return problems


def _fuse(pipeline: PipelineSpec, groups: tuple[tuple[str, ...], ...],
          stages: dict[str, _Stage]) -> list[str]:
    """Give each valid group's stages its first stage's process (in place), derived from the
    group where that moves a stage; the problems."""
    problems: list[str] = []
    group_of: dict[str, int] = {}
    for number, group in enumerate(groups, 1):
        label = f"placement.fused_stages group {number} ({clip('+'.join(group)) or 'empty'})"
        found = _group_problems(group, label, pipeline, stages)
        found += [f"{s} is in placement.fused_stages groups {group_of[s]} and {number}; a stage "
                  "fuses into one group" for s in group if s in group_of]
        group_of.update({s: number for s in group if s not in group_of})
        problems += found
        if found:
            continue
        process = stages[group[0]].process
        if any(stages[s].process != process for s in group):  # else fusion changes nothing
            origin = Provenance(Source.DERIVED, f"fused_stages [{_names(group)}]")
            for s in group:
                stages[s] = _replace_process(stages[s], process, origin)
    return problems


def _replace_process(stage: _Stage, process: str, origin: Provenance) -> _Stage:
    return _Stage(stage.spec, stage.config, stage.device, stage.rank_devices, process, origin)


# --- processes -------------------------------------------------------------------------------
def _drafts(stages: list[_Stage]) -> list[_Draft]:
    """main first, then each process at its first stage's place in the pipeline."""
    drafts: dict[tuple[str, ...], _Draft] = {
        ("group", MAIN_PROCESS): _Draft(MAIN_PROCESS, [], Provenance(Source.DEFAULT),
                                        f"{MAIN_PROCESS} (the replica's HTTP front)")}
    for stage in stages:
        fraction = stage.config.gpu_memory_fraction
        declared = [] if fraction is None else [fraction]
        if stage.is_tp:
            for rank, device in enumerate(stage.rank_devices):
                drafts[("tp", stage.name, str(rank))] = _Draft(
                    f"{stage.process}-tp{rank}", [stage],
                    Provenance(Source.DERIVED, f"{stage.name}.tp_size {stage.config.tp_size}"),
                    f"{stage.name}'s TP rank {rank}", device, rank, stage.config.tp_size,
                    fractions=declared)
        elif stage.is_replicated:
            for i in range(stage.config.replicas):
                drafts[("replica", stage.name, str(i))] = _Draft(
                    f"{stage.process}-r{i}", [stage],
                    Provenance(Source.DERIVED, f"{stage.name}.replicas {stage.config.replicas}"),
                    f"{stage.name}'s replica {i}", stage.device, replica=i, fractions=declared)
        elif stage.process:
            draft = drafts.setdefault(("group", stage.process),
                                      _Draft(stage.process, [], stage.origin, ""))
            if stage.origin.source == Source.DERIVED:  # fusion put it here: main included
                draft.origin = stage.origin
            draft.stages.append(stage)
            draft.fractions += declared
    for draft in drafts.values():
        if not draft.what:
            draft.what = f"the process of {_names(s.name for s in draft.stages)}"
    return list(drafts.values())


def _draft_device(draft: _Draft) -> str:
    """The GPU one if any stage is on a GPU, else the CPU (rule 2 refuses two GPUs)."""
    if draft.device is not None:
        return draft.device
    gpus = [s.device for s in draft.stages if s.device != CPU]
    return gpus[0] if gpus else CPU


def _span_problems(draft: _Draft) -> list[str]:
    """Rule 2: a process spans any number of CPU stages but at most one GPU."""
    if draft.device is not None or len({s.device for s in draft.stages} - {CPU}) <= 1:
        return []
    placed = _names(f"{s.name} on {s.device}" for s in draft.stages)
    return [f"process {draft.name!r} would span several GPUs ({placed}); a process holds any "
            "number of CPU stages but at most one GPU"]


def _collision_problems(drafts: list[_Draft]) -> list[str]:
    """Rule 4: a derived name (talker-tp1, vocoder-r0) never equals another process's."""
    by_name: dict[str, list[_Draft]] = {}
    for draft in drafts:
        by_name.setdefault(draft.name, []).append(draft)
    return [f"process name {name!r} is taken twice: {' and '.join(d.what for d in same)}; "
            "rename one (its stage's process)"
            for name, same in by_name.items() if len(same) > 1]


def _device_total(device: str, request: PlacementRequest, gpu_total_bytes: Mapping[int, int],
                  host_total_bytes: int) -> int | None:
    index = _gpu_index(device)
    if index is None:
        declared = request.placement.cpu_device_memory_bytes
        return host_total_bytes if declared is None else declared
    return gpu_total_bytes.get(index)


def _plan(draft: _Draft, totals: Mapping[str, int | None]) -> ProcessPlan:
    device = _draft_device(draft)
    fraction = round(math.fsum(draft.fractions), 9) if draft.fractions else None
    total = totals.get(device)
    budget = int(fraction * total) if fraction is not None and total is not None else None
    return ProcessPlan(draft.name, tuple(s.name for s in draft.stages), device, fraction, budget,
                       draft.tp_rank, draft.tp_size, draft.replica, draft.origin)


# --- sharing a device (rule 3) ---------------------------------------------------------------
def _sharing_problems(device: str, plans: list[ProcessPlan], stages: Mapping[str, _Stage],
                      limit: float) -> list[str]:
    """Colocated GPU stages all declare fractions (optional on the CPU); the sum fits."""
    problems = []
    if device != CPU and len(plans) > 1:
        missing = list(dict.fromkeys(s for p in plans for s in p.stages
                                     if stages[s].config.gpu_memory_fraction is None
                                     and device in stages[s].rank_devices))
        if missing:
            problems.append(f"{device} is shared by {len(plans)} processes "
                            f"({_names(p.name for p in plans)}), so every GPU stage on it must "
                            f"declare gpu_memory_fraction; {_names(missing)} "
                            f"{'declares' if len(missing) == 1 else 'declare'} none")
    declared = [p for p in plans if p.gpu_memory_fraction is not None]
    total = math.fsum(p.gpu_memory_fraction for p in declared)
    if total > limit + _TOLERANCE:
        shares = _names(f"{p.name} ({'+'.join(p.stages)}) {_fraction_text(p.gpu_memory_fraction)}"
                        for p in declared)
        problems.append(f"{device}: gpu_memory_fraction sums to {_fraction_text(total)} over "
                        f"{shares}, above placement.max_total_gpu_memory_fraction_per_gpu "
                        f"{_fraction_text(limit)}")
    return problems


def _edge_problems(placement: Placement) -> list[str]:
    return [f"edge {e.source} → {e.target} carries {e.payload}, which lives in process memory; "
            f"keep {e.source} and {e.target} in one process"
            for e in placement.pipeline.edges
            if e.process_local and placement.crosses_processes(e.source, e.target)]


# --- the entry points ------------------------------------------------------------------------
def _bound_problems(request: PlacementRequest) -> list[str]:
    """The bounds config's parsers enforce, again for a request built by hand."""
    problems = []
    for name, config in request.stages.items():
        for what, value, most in (("tp_size", config.tp_size, MAX_TP_SIZE),
                                  ("replicas", config.replicas, MAX_REPLICAS)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
                problems.append(f"{name}.{what} must be 1-{most}, got {brief(value)}")
    size = request.placement.cpu_device_memory_bytes
    if size is not None and (isinstance(size, bool) or not isinstance(size, int)
                             or not 1 <= size <= MAX_CPU_DEVICE_MEMORY_BYTES):
        problems.append(f"placement.cpu_device_memory_bytes must be 1 byte to 1 EiB (2**60 "
                        f"bytes), or None for the host's memory; got {brief(size)}")
    return problems


def _stages(pipeline: PipelineSpec, request: PlacementRequest,
            default_device: str) -> dict[str, _Stage]:
    """Each stage with its device(s) resolved and its process as configured (before fusion)."""
    stages = {}
    for spec in pipeline.stages:
        config = request.stages.get(spec.name, StageConfig())
        device = _resolved_device(config.device, spec, default_device)
        process, origin = config.process, request.source_of(spec.name, "process")
        if ((config.tp_size > 1 or config.replicas > 1)
                and (origin.source == Source.DEFAULT or not process)):
            process = spec.name  # TP ranks, replicas: named after the stage unless set
        stages[spec.name] = _Stage(spec, config, device,
                                   _rank_devices(spec, config, device, default_device),
                                   process, origin)
    return stages


def resolve(pipeline: PipelineSpec, request: PlacementRequest, *, default_device: str,
            gpu_count: int, gpu_total_bytes: Mapping[int, int],
            host_total_bytes: int) -> Placement:
    """The replica's processes for `request` (main first), or PlacementError with every problem.

    `default_device` is the replica's resolved --device ("cpu" or "cuda:N"); the totals are
    what memory fractions are fractions of (on the CPU: placement.cpu_device_memory_bytes, else
    `host_total_bytes`)."""
    if not re.fullmatch(r"cpu|cuda:[0-9]+", default_device):  # a caller's bug, not a user's
        raise ValueError(f"default_device must be 'cpu' or 'cuda:N', got {default_device!r}")
    bounds = _bound_problems(request)
    if bounds:  # a count of 10**23 would be expanded into that many processes below
        raise PlacementError(bounds)
    problems = [f"unknown stage {brief(name)} in the placement request"
                + suggestion(name, [s.name for s in pipeline.stages], "stages")
                for name in request.stages if name not in {s.name for s in pipeline.stages}]
    stages = _stages(pipeline, request, default_device)
    broken_ranks = set()  # TP stages whose rank devices are wrong: no sharing rule on top
    for stage in stages.values():
        tp_problems = _tp_problems(stage, pipeline)
        broken_ranks |= {stage.name} if tp_problems else set()
        problems += _device_problems(stage, gpu_count) + tp_problems
    problems += _fuse(pipeline, request.placement.fused_stages, stages)
    ordered = list(stages.values())
    for stage in ordered:
        problems += _process_problems(stage, ordered, request)
        problems += _replica_problems(stage, ordered)
    drafts = _drafts(ordered)
    problems += [p for d in drafts for p in _span_problems(d)] + _collision_problems(drafts)
    devices = dict.fromkeys(_draft_device(d) for d in drafts)
    totals = {d: _device_total(d, request, gpu_total_bytes, host_total_bytes) for d in devices}
    plans = tuple(_plan(d, totals) for d in drafts)
    limit = request.placement.max_total_gpu_memory_fraction_per_gpu
    for device in devices:
        sharing = [p for p in plans if p.device == device
                   and not (p.tp_rank is not None and p.stages[0] in broken_ranks)]
        problems += _sharing_problems(device, sharing, stages, limit)
    placement = Placement(pipeline, request, plans,
                          {d: t for d, t in totals.items() if t is not None})
    problems += _edge_problems(placement)
    if problems:
        raise PlacementError(problems)
    return placement


def budget_problems(placement: Placement, needs: Mapping[str, int]) -> list[str]:
    """A problem for every process that needs more bytes than its declared budget."""
    problems = []
    for plan in placement.processes:
        need = needs.get(plan.name)
        if plan.budget_bytes is None or need is None or need <= plan.budget_bytes:
            continue
        total = placement.device_total_bytes[plan.device]
        problems.append(
            f"process {plan.name} ({_names(plan.stages)}) needs {format_size(need)}, over its "
            f"budget of {format_size(plan.budget_bytes)} "
            f"({_fraction_text(plan.gpu_memory_fraction)} × {format_size(total)} of "
            f"{plan.device})")
    return problems
