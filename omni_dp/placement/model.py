"""The placement model's types: what a pipeline declares, what a user configures, what comes out.

Torch-free: the engine (`omni-dp serve`) and the launcher read the same placement. The shape
follows docs/design.md (placement model): one field, a stage's `process`, decides topology
(same name, same process); a TP stage gets one derived process per rank; every value of the
resolved placement says where it came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

MAIN_PROCESS = "main"  # the replica's own process: HTTP front, coordinator, form ①'s stages
# The bounds of the counts and sizes a placement takes: each becomes that many processes (or a
# budget), so a typo of 10**23 is refused by name before anything is sized by it.
MAX_TP_SIZE = 64
MAX_REPLICAS = 64
MAX_CPU_DEVICE_MEMORY_BYTES = 2**60  # 1 EiB


# --- what a pipeline declares (not configurable) --------------------------------------------
@dataclass(frozen=True)
class StageSpec:
    name: str
    accelerator: bool  # may run on a GPU; False: always on the CPU (preprocess)
    tp_capable: bool = False  # its model can be split across ranks (tp_size > 1)
    replicable: bool = False  # keeps no state across requests: several processes may serve it
    state: str = ""  # what a non-replicable stage keeps across requests, in words (for messages)


@dataclass(frozen=True)
class EdgeSpec:
    """A stage → stage edge and what crosses it. `process_local`: its payload lives in process
    memory (a registry, a queue of live objects) and cannot be serialised, so the two stages
    must share a process; a placement that splits it is refused at validation."""

    source: str
    target: str
    payload: str  # what crosses, in words (for messages)
    process_local: bool = False


@dataclass(frozen=True)
class PipelineSpec:
    name: str
    stages: tuple[StageSpec, ...]  # in pipeline order; the pipeline is linear
    edges: tuple[EdgeSpec, ...]

    def stage(self, name: str) -> StageSpec:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(name)


# --- what a user configures ------------------------------------------------------------------
@dataclass(frozen=True)
class StageConfig:
    """One stage's placement fields; the defaults are form ① (every stage in `main`)."""

    process: str = MAIN_PROCESS
    device: str = "auto"  # auto (the replica's --device; cpu for a CPU stage) | cpu | GPU index
    gpu_memory_fraction: float | None = None  # of the device's TOTAL memory
    tp_size: int = 1  # 1 to MAX_TP_SIZE
    devices: tuple[str, ...] = ()  # tp_size > 1: one device per rank (cpu | GPU index)
    replicas: int = 1  # processes serving this stage, ≤ MAX_REPLICAS; a request goes to the
    # least-loaded


@dataclass(frozen=True)
class PlacementConfig:
    """The `placement.*` fields."""

    max_total_gpu_memory_fraction_per_gpu: float = 0.9
    # Groups of adjacent stages to run in one process: topology only, never scheduling.
    fused_stages: tuple[tuple[str, ...], ...] = ()
    # The size budgets are fractions of, on the CPU (there is no device to ask): declared so
    # that the budget rules are exercised without a GPU. None: the host's total memory; else
    # 1 to MAX_CPU_DEVICE_MEMORY_BYTES.
    cpu_device_memory_bytes: int | None = None


class Source(str, Enum):
    DEFAULT = "default"  # the pipeline's default placement
    FILE = "file"  # --placement-config FILE
    CLI = "cli"  # a dotted --<stage>.<field> / --placement.<field> override
    DERIVED = "derived"  # computed (a TP rank's or replica's process, a fused group's process)


@dataclass(frozen=True)
class Provenance:
    source: Source
    detail: str = ""  # the file's path, the CLI flag as given, or how it was derived

    def __str__(self) -> str:
        return f"{self.source.value}" + (f" ({self.detail})" if self.detail else "")


@dataclass(frozen=True)
class PlacementRequest:
    """Defaults, then the YAML file, then dotted CLI overrides, merged: every value with the
    provenance of the layer that set it last. Made by config.load_placement."""

    stages: dict[str, StageConfig]
    placement: PlacementConfig
    # (stage name or "placement", field name) → where its value came from
    provenance: dict[tuple[str, str], Provenance] = field(default_factory=dict)

    def source_of(self, owner: str, name: str) -> Provenance:
        return self.provenance.get((owner, name), Provenance(Source.DEFAULT))


# --- what comes out ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ProcessPlan:
    """One OS process of the replica: the stages it runs, on which device, with what budget."""

    name: str  # the process name (a stage's `process`, or derived: `talker-tp1`, `vocoder-r0`)
    stages: tuple[str, ...]  # in pipeline order
    device: str  # "cpu" | "cuda:N"
    gpu_memory_fraction: float | None  # the sum of its stages' fractions; None: undeclared
    budget_bytes: int | None  # fraction × the device's total memory; None: undeclared
    tp_rank: int | None = None  # a TP rank process: its rank (0 talks to the pipeline)
    tp_size: int = 1
    replica: int | None = None  # a replicated stage's process: which replica (0..n-1)
    # of its name and stages: the stage's `process` as set (default, file, cli), or derived
    # (detail: "talker.tp_size 2", "vocoder.replicas 2", "fused_stages [talker, vocoder]")
    provenance: Provenance = Provenance(Source.DEFAULT)


@dataclass(frozen=True)
class Placement:
    """A validated placement: every process of one replica, `main` first."""

    pipeline: PipelineSpec
    request: PlacementRequest
    processes: tuple[ProcessPlan, ...]
    device_total_bytes: dict[str, int]  # the total memory budgets are fractions of, per device

    def process_of(self, stage: str) -> tuple[ProcessPlan, ...]:
        """The process(es) serving a stage: one, or one per replica / TP rank."""
        return tuple(p for p in self.processes if stage in p.stages)

    def crosses_processes(self, source: str, target: str) -> bool:
        """True when an edge's two ends are not in one process."""
        ours = {p.name for p in self.process_of(source)}
        theirs = {p.name for p in self.process_of(target)}
        return ours != theirs or len(ours) != 1

    @property
    def is_single_process(self) -> bool:
        return len(self.processes) == 1


class PlacementError(ValueError):
    """Every problem of a placement at once; each names the stages (or fields) at fault."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems
