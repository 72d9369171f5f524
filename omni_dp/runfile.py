"""The run-state format, typed, and its one reader (launcher, `status`, `verify-mps` alike).

    <state dir>/runs/<run-id>/      mode 0700 (omni_dp/rundir.py names the paths)
      run.json      schema 2: a `RunRecord` (below); written atomically by one process at a time
                    (schema 1, before a run could span GPUs, is still read: one GPU, one daemon)
      run_token     the run's secret, mode 0600; also in every child's environment

A run.json is parsed field by field into frozen records before anything in it is used; a file
that does not parse is a `RunFileError` naming the file and what is wrong. States are enums with
an allowed-transition map, so a state change the design does not allow fails where it is made.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from omni_dp.mps.attach import DeclaredProcess, ReplicaProcesses
from omni_dp.mps.daemon import DaemonRecord
from omni_dp.procs import ProcessIdentity, is_alive
from omni_dp.records import Malformed, Record, Shape, json_kind
from omni_dp.rundir import RUN_FILE, RUN_ID, TOKEN_FILE, run_dir, runs_dir, state_dir

SCHEMA = 2
READABLE_SCHEMAS = (1, 2)  # 1: one GPU, `"mps": {"daemon": …}`; 2: `gpus` and one daemon per GPU


class RunFileError(Exception):
    """A run directory cannot be read, or its run.json is not one this omni-dp reads."""


class RunNotFound(RunFileError):
    """Nothing there: no run of that id, or no run at all. Not bad input — the question has an
    answer — so the commands that read a run exit 1 on it, and `down` 0 (nothing to stop)."""


class IllegalTransition(RuntimeError):
    """A state change the lifecycle does not allow: a bug in whoever asked for it."""


class RunPhase(str, enum.Enum):
    """The run's `state` in run.json."""

    STARTING = "starting"
    RUNNING = "running"  # every replica healthy
    DEGRADED = "degraded"  # supervised, but some replica is not healthy
    STOPPING = "stopping"  # teardown began (or left something behind)
    STOPPED = "stopped"
    FAILED = "failed"  # bring-up or supervision failed: the state is kept for diagnosis


class ReplicaState(str, enum.Enum):
    PLANNED = "planned"
    STARTING = "starting"
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"  # failing /health, not yet past the threshold
    DOWN = "down"  # a restart failed; the next sweep tries again
    RESTARTING = "restarting"
    FAILED = "failed"  # out of restarts (or failed at bring-up): stays out of the router
    STOPPED = "stopped"


_P, _R = RunPhase, ReplicaState
RUN_TRANSITIONS: Mapping[RunPhase, frozenset[RunPhase]] = {
    _P.STARTING: frozenset({_P.RUNNING, _P.STOPPING, _P.FAILED}),
    _P.RUNNING: frozenset({_P.DEGRADED, _P.STOPPING, _P.FAILED}),
    _P.DEGRADED: frozenset({_P.RUNNING, _P.STOPPING, _P.FAILED}),
    _P.STOPPING: frozenset({_P.STOPPED, _P.FAILED}),
    _P.STOPPED: frozenset(),
    _P.FAILED: frozenset(),  # kept as it is until `down` removes it
}
REPLICA_TRANSITIONS: Mapping[ReplicaState, frozenset[ReplicaState]] = {
    _R.PLANNED: frozenset({_R.STARTING, _R.STOPPED}),
    _R.STARTING: frozenset({_R.HEALTHY, _R.FAILED, _R.DOWN, _R.RESTARTING, _R.STOPPED}),
    _R.HEALTHY: frozenset({_R.UNHEALTHY, _R.RESTARTING, _R.DOWN, _R.STOPPED}),
    _R.UNHEALTHY: frozenset({_R.HEALTHY, _R.RESTARTING, _R.DOWN, _R.STOPPED}),
    _R.DOWN: frozenset({_R.HEALTHY, _R.UNHEALTHY, _R.RESTARTING, _R.STOPPED}),
    _R.RESTARTING: frozenset({_R.STARTING, _R.FAILED, _R.DOWN, _R.STOPPED}),
    _R.FAILED: frozenset({_R.RESTARTING, _R.STOPPED}),  # an MPS restart takes every replica
    _R.STOPPED: frozenset({_R.STARTING, _R.FAILED, _R.DOWN}),
}
# The states the supervisor's sweep checks (a restart owns the others).
WATCHED = frozenset({_R.HEALTHY, _R.UNHEALTHY, _R.DOWN})


# A replica in these states runs as the process that passed its gates: a weight-share leader
# is its run's publisher, a follower proven attached stays so (RunRecord.with_replica).
ATTACHED = frozenset({_R.HEALTHY, _R.UNHEALTHY})


def can_transition(old: enum.Enum, new: enum.Enum,
                   allowed: Mapping[Any, frozenset[Any]] = REPLICA_TRANSITIONS) -> bool:
    """Whether the lifecycle lets old become new (staying as it is always may)."""
    return new == old or new in allowed[old]


def check_transition(old: enum.Enum, new: enum.Enum,
                     allowed: Mapping[Any, frozenset[Any]]) -> None:
    if not can_transition(old, new, allowed):
        raise IllegalTransition(f"{type(old).__name__}: {old.value} -> {new.value} is not an "
                                "allowed transition")


def _read_run(data: dict) -> dict:
    """A run.json of either schema in the fields' layout: schema 1's single
    `{"mps": {"daemon": …}}` is GPU slot 0's daemon, and its one GPU (no `gpus`) slot 0."""
    mps = data.pop("mps", None)
    if mps is not None and not isinstance(mps, Mapping):
        raise Malformed(f"mps is {json_kind(mps)}, not an object")
    if mps is not None:
        data["daemons"] = mps["daemons"] if "daemons" in mps else [mps.get("daemon")]
    data["schema"] = SCHEMA  # written back in this schema's form, whichever it was read from
    plan = data.get("plan")
    if not data.get("gpus") and isinstance(plan, Mapping):
        data["gpus"] = [{"slot": 0, "label": data.get("gpu"),
                         "numa_node": plan.get("gpu_numa_node")}]
    return data


def _write_run(data: dict) -> dict:
    """The fields' layout as run.json has it: the daemons under "mps" (null without one), the
    schema first and the replicas last, for a reader with `cat`."""
    out = {"schema": data.pop("schema")}
    replicas = data.pop("replicas")
    for key, value in data.items():
        if key == "daemons":
            out["mps"] = {"daemons": value} if value else None
        else:
            out[key] = value
    return {**out, "replicas": replicas}


def gpu_key(gpu_count: int, index: int | None, slot: int) -> int | None:
    """The one rule naming a GPU's MPS files (the plan uses it before a record exists)."""
    if gpu_count <= 1:
        return None
    return index if index is not None else slot


# --- the records --------------------------------------------------------------------------


@dataclass(frozen=True)
class SupervisionSettings(Record):
    """How the supervisor watches and restarts (from the launch options)."""

    # run.json keeps the keys of schema 1, named before the launch flags were renamed
    JSON_SHAPE = Shape(keys={"restart_after_failures": "health_failures",
                             "start_timeout": "health_timeout"})

    check_interval: float
    restart_after_failures: int  # consecutive failed /health before a restart
    restart_budget: int  # restarts allowed within restart_window
    restart_window: float
    on_mps_fault: str  # restart | fail
    start_timeout: float  # seconds for one replica to start
    drain_timeout: float

@dataclass(frozen=True)
class RouterPlan(Record):
    url: str
    policy: str
    workers: int
    argv: tuple[str, ...]

@dataclass(frozen=True)
class GpuRecord(Record):
    """One GPU of the run (a slot: replicas and a daemon name it by `slot`, its position in
    RunRecord.gpus), or the CPU ("cpu") for a run without one."""

    slot: int
    label: str  # what CUDA_VISIBLE_DEVICES names it by: "GPU-<uuid>", an index; or "cpu"
    index: int | None = None  # as NVML numbers it; None on the CPU
    numa_node: int | None = None
    name: str | None = None  # e.g. "NVIDIA H200"

    @property
    def title(self) -> str:
        """How messages and tables name it: `GPU 1 (NVIDIA H200)`, or `cpu`."""
        if self.index is None:
            return self.label
        return f"GPU {self.index}" + (f" ({self.name})" if self.name else "")

@dataclass(frozen=True)
class PlanRecord(Record):
    """What run.json keeps of the launch plan: what the run was asked to be."""

    # keys a run.json written before them lacks (a null command, too, is the default)
    JSON_SHAPE = Shape(absent={"config_file": None, "gpu_numa_node": None,
                               "kv_cache_bytes": None, "max_total_tokens": None,
                               "expected_kv_tokens": None, "log_format": "text",
                               "warnings": [], "command": "omni-dp", "api_key_set": False},
                       null_is_absent=("command",))

    replicas: int
    engine: str
    engine_args: tuple[str, ...]
    config_file: str | None
    device: str
    gpu: str
    gpu_numa_node: int | None
    mps: bool
    start: str  # sequential | parallel
    cpu_blocks: str
    kv_cache_bytes: int | None
    max_total_tokens: int | None
    expected_kv_tokens: int | None  # what every replica must report (None: equal to each other)
    router: RouterPlan
    supervision: SupervisionSettings
    log_format: str
    warnings: tuple[str, ...]
    command: str  # how the user runs omni-dp, for the commands the supervisor prints
    api_key_set: bool  # the key itself never goes to disk
    share_weights: bool = False  # --share-weights: replica 0 leads, the others follow
    register: str | None = None  # --register: the fleet gateway's URL
    register_as: str = "replicas"  # replicas | router
    register_url: str | None = None  # with register_as router: the URL the gateway uses
    replicas_per_gpu: int | None = None  # --replicas-per-gpu (replicas is the run's total)
    # The launch options as merged at launch (keys as in a --config file, no secret): what a
    # day-two change plans from; None for a run launched before they were kept
    options: Mapping[str, object] | None = None
    # --mps-thread-percentage / --mps-memory-limit: each replica process's MPS caps (None:
    # uncapped); the daemons' defaults are set to them and read back (DaemonRecord.limits)
    mps_thread_percentage: float | None = None
    mps_memory_limit: int | None = None

@dataclass(frozen=True)
class SupervisorRecord(Record):
    JSON_SHAPE = Shape(flat=("identity",), omit_none=("supervising_since",),
                       absent={"detached": False})

    identity: ProcessIdentity
    detached: bool
    supervising_since: float | None = None  # set once its loop has run a first sweep

@dataclass(frozen=True)
class RouterRecord(Record):
    JSON_SHAPE = Shape(flat=("identity",))

    identity: ProcessIdentity
    pgid: int
    url: str
    argv: tuple[str, ...]
    log: str

@dataclass(frozen=True)
class ReplicaRecord(Record):
    """One replica: what the plan fixed (port, block, argv, env) and what it is now."""

    # its process as "pid", "create_time" (null until started); "cpus" absent: unpinned;
    # "generation" absent: 0 (no change relaunched it)
    JSON_SHAPE = Shape(flat=("identity",), absent={"cpus": None},
                       omit_default=("generation",))

    index: int
    port: int
    url: str
    cpus: str | None  # "0-3", None when unpinned
    argv: tuple[str, ...]
    env: Mapping[str, str]  # what the launcher sets; the run token is added at spawn
    log: str  # its log's name under logs/
    identity: ProcessIdentity | None = None  # None until started
    pgid: int | None = None
    processes: tuple[DeclaredProcess, ...] = ()  # from /get_server_info
    state: ReplicaState = ReplicaState.PLANNED
    kv_tokens: int | None = None
    mps_attached: bool | None = None
    # Its measured private memory once healthy (CPU: USS of its processes; CUDA: NVML's used
    # GPU memory of its processes); None until measured or where it cannot be measured
    memory_bytes: int | None = None
    restarts: tuple[float, ...] = ()  # when each restart began (time.time())
    last_error: str | None = None
    gpu: int = 0  # the slot of the GPU it runs on (RunRecord.gpus); fixed by the plan
    # How many times a day-two change relaunched it (a restart a change asked for, made; a
    # crash restart by the sweep is no new generation): what a change's Desired compares
    generation: int = 0

    @property
    def pid(self) -> int | None:
        return self.identity.pid if self.identity else None

    def declared(self) -> ReplicaProcesses:
        return ReplicaProcesses(self.index, self.processes)

@dataclass(frozen=True)
class ShareRecord(Record):
    """--share-weights, as proven: the leader's manifest read and checked after its wave."""

    leader: int  # the replica that loaded and published the weights
    followers: tuple[int, ...]  # the followers proven attached to it (their share gate passed)
    directory: str  # the run's share/ (manifest, and on CPU the segment)
    policy: str  # the architecture's share policy, e.g. "omni-dp-tts/1"
    shared_bytes: int  # held once on the device, whatever the replica count
    private_bytes: int  # what every replica still holds of its own
    tensors: int  # tensors shared
    leader_pid: int | None = None  # who published it (the manifest's leader)
    published_at: float | None = None  # the manifest's created_at

    def with_follower(self, index: int) -> ShareRecord:
        """This share with one more follower proven attached."""
        return replace(self, followers=tuple(sorted({*self.followers, index})))

    def without(self, index: int) -> ShareRecord | None:
        """This share once replica index no longer runs as what passed its gates: none left
        when it is the leader (nothing publishes), else without that follower."""
        if index == self.leader:
            return None
        return replace(self, followers=tuple(i for i in self.followers if i != index))

@dataclass(frozen=True)
class GatewayEntry(Record):
    """One worker this run registered with the fleet gateway, as the gateway named it."""

    target: str  # the URL the gateway was given (a replica's, or the router's)
    replica: int | None  # None: the router
    worker_id: str

@dataclass(frozen=True)
class GatewayRecord(Record):
    """--register: the gateway, and what of this run it lists (each entry proven listed and
    healthy there when it was added; removed here once the gateway no longer lists it)."""

    url: str
    entries: tuple[GatewayEntry, ...] = ()

    def with_entry(self, entry: GatewayEntry) -> GatewayRecord:
        kept = tuple(e for e in self.entries if e.target != entry.target)
        return replace(self, entries=(*kept, entry))

    def without(self, target: str) -> GatewayRecord:
        return replace(self, entries=tuple(e for e in self.entries if e.target != target))


def _numbered(replicas: tuple[ReplicaRecord, ...]) -> None:
    if [r.index for r in replicas] != list(range(len(replicas))):
        raise ValueError("replicas must be numbered 0..N-1, got "
                         f"{[r.index for r in replicas]}")


@dataclass(frozen=True)
class Desired(Record):
    """What a day-two change wants the run to be, kept in run.json while the change runs: the
    supervisor's loop compares the live record with it at each sweep and makes the one step
    that brings them closer (omni_dp/launcher/changes/desired.py), so a change acts on the run
    as it is, never on the snapshot it was planned from; a supervisor taking the run over finds
    it and goes on (supervision/takeover.py). Here, not in changes/, because run.json holds it.

    `replicas` are the launches wanted, numbered 0..N-1: an existing replica's argv, env, CPU
    block and `generation` (one more than it has: a restart asked for), a new one's whole
    planned record; none of them says how a process is now (state, pid: planned, empty)."""

    change: str  # the id of the change that set it (change.json)
    replicas: tuple[ReplicaRecord, ...]
    plan: PlanRecord  # the run's plan once the change is made
    gpus: tuple[GpuRecord, ...]  # the run's GPU slots once it is made

    def __post_init__(self) -> None:
        _numbered(self.replicas)
        if self.plan.replicas != len(self.replicas):
            raise ValueError(f".plan says {self.plan.replicas} replicas, .replicas has "
                             f"{len(self.replicas)}")


@dataclass(frozen=True)
class RunRecord(Record):
    """A run.json: schema 2's layout written, schema 1's read too (`_read_run`)."""

    JSON_SHAPE = Shape(read=_read_run, write=_write_run, absent={"launcher": None},
                       paths={"daemons": "mps.daemons"}, omit_none=("desired",))

    run_id: str
    created_at: float
    state: RunPhase
    gpu: str  # the GPUs' labels ("GPU-<uuid>" or an index), comma-separated; or "cpu"
    device: str  # "cpu" or "cuda"
    plan: PlanRecord
    launcher: ProcessIdentity | None  # the `omni-dp launch` process
    replicas: tuple[ReplicaRecord, ...]
    supervisor: SupervisorRecord | None = None
    router: RouterRecord | None = None
    # One MPS daemon per GPU slot, started so far; run.json: {"mps": {"daemons": [...]}}
    daemons: tuple[DaemonRecord, ...] = ()
    schema: int = field(default=SCHEMA)
    share: ShareRecord | None = None  # --share-weights: what is shared, once published
    gpus: tuple[GpuRecord, ...] = ()  # the run's GPUs by slot (one "cpu" slot without one)
    gateway: GatewayRecord | None = None  # --register: what the fleet gateway lists of us
    # while a day-two change runs: what it wants the run to be (absent otherwise)
    desired: Desired | None = None

    def identities(self) -> Iterator[ProcessIdentity]:
        """Every process this run recorded as its own."""
        for ident in (self.launcher, self.supervisor and self.supervisor.identity,
                      self.router and self.router.identity,
                      *(d.identity for d in self.daemons),
                      *(r.identity for r in self.replicas)):
            if ident is not None:
                yield ident

    def daemon(self, slot: int) -> DaemonRecord | None:
        """The MPS daemon serving GPU slot `slot`; None without --mps or before it started."""
        return next((d for d in self.daemons if d.gpu == slot), None)

    def replicas_on(self, slot: int) -> tuple[ReplicaRecord, ...]:
        """The replicas placed on GPU slot `slot` (its daemon's clients under --mps)."""
        return tuple(r for r in self.replicas if r.gpu == slot)

    def gpu_record(self, slot: int) -> GpuRecord:
        return next((g for g in self.gpus if g.slot == slot),
                    GpuRecord(slot, self.gpu if len(self.gpus) <= 1 else "?"))

    def gpu_title(self, slot: int) -> str | None:
        """How messages name GPU slot `slot`: its title in a run over several GPUs; None in a
        one-GPU run, whose messages need no name (and read as they always did)."""
        return self.gpu_record(slot).title if len(self.gpus) > 1 else None

    def gpu_key(self, slot: int) -> int | None:
        """How the slot's daemon directory and attachment proof are named (rundir.mps_dir,
        attach_stem): None in a one-GPU run (the names of before), else the GPU's index."""
        return gpu_key(len(self.gpus), self.gpu_record(slot).index, slot)

    def with_daemon(self, record: DaemonRecord) -> RunRecord:
        """This record with the daemon of record.gpu's slot replaced (or added)."""
        others = tuple(d for d in self.daemons if d.gpu != record.gpu)
        return replace(self, daemons=tuple(sorted((*others, record), key=lambda d: d.gpu)))

    def with_replica(self, index: int, **fields: Any) -> RunRecord:
        """This record with one replica's fields changed (their types and its state change
        checked: TypeError for a plain "healthy" or a dict where a record goes).

        The share proof follows the replica's state: once a replica is no longer running as
        the process that passed its gates (it restarts, is down, failed, stopped, or a new
        process starts), a weight-share leader's `share` is null and a follower leaves
        `share.followers`, whoever changed the state."""
        old = self.replicas[index]
        check_types("replica", fields, REPLICA_FIELD_TYPES)
        share = self.share
        if "state" in fields:
            check_transition(old.state, fields["state"], REPLICA_TRANSITIONS)
            if share is not None and fields["state"] not in ATTACHED:
                share = share.without(index)
        replicas = list(self.replicas)
        replicas[index] = replace(old, **fields)
        return replace(self, replicas=tuple(replicas), share=share)

    def with_scale(self, replicas: tuple[ReplicaRecord, ...], plan: PlanRecord,
                   gpus: tuple[GpuRecord, ...]) -> RunRecord:
        """This record with its replica list (a scale added or removed some, numbered 0..N-1
        still) and the plan and GPU slots they follow from."""
        _numbered(replicas)
        if plan.replicas != len(replicas):
            raise ValueError(f"the plan says {plan.replicas} replicas, the list has "
                             f"{len(replicas)}")
        share = self.share
        for gone in (r.index for r in self.replicas if r.index >= len(replicas)):
            share = share.without(gone) if share is not None else None
        return replace(self, replicas=replicas, plan=plan, gpus=gpus, share=share)

    def with_plan(self, plan: PlanRecord) -> RunRecord:
        """This record following a changed plan (new engine arguments: a model update)."""
        check_types("run", {"plan": plan}, {"plan": (PlanRecord,)})
        return replace(self, plan=plan)

    def with_desired(self, desired: Desired | None) -> RunRecord:
        """This record wanting what a running change wants (None: no change runs)."""
        check_types("run", {"desired": desired}, {"desired": (Desired, _NONE)})
        return replace(self, desired=desired)

    def with_phase(self, phase: RunPhase) -> RunRecord:
        check_types("run", {"state": phase}, {"state": (RunPhase,)})
        check_transition(self.state, phase, RUN_TRANSITIONS)
        return replace(self, state=phase)

    def with_records(self, **fields: Any) -> RunRecord:
        """This record with top-level records replaced (launcher, supervisor, router, daemons);
        the phase changes through with_phase; one daemon through with_daemon."""
        if "state" in fields:
            raise TypeError("the run's phase changes through with_phase()")
        check_types("run", fields, RUN_FIELD_TYPES)
        return replace(self, **fields)


_NONE = type(None)
# What each changeable field holds: a write of anything else is a bug where it is made, not a
# run.json that cannot be written (or read back) later.
RUN_FIELD_TYPES: Mapping[str, tuple[type, ...]] = {
    "launcher": (ProcessIdentity, _NONE), "supervisor": (SupervisorRecord, _NONE),
    "router": (RouterRecord, _NONE), "daemons": (tuple,),
    "share": (ShareRecord, _NONE), "gateway": (GatewayRecord, _NONE),
}
REPLICA_FIELD_TYPES: Mapping[str, tuple[type, ...]] = {
    "port": (int,), "url": (str,), "cpus": (str, _NONE), "argv": (tuple,), "env": (Mapping,),
    "log": (str,), "identity": (ProcessIdentity, _NONE), "pgid": (int, _NONE),
    "processes": (tuple,), "state": (ReplicaState,), "kv_tokens": (int, _NONE),
    "mps_attached": (bool, _NONE), "restarts": (tuple,), "last_error": (str, _NONE),
    "memory_bytes": (int, _NONE), "generation": (int,),
}


def check_types(what: str, fields: Mapping[str, Any],
                types: Mapping[str, tuple[type, ...]]) -> None:
    for name, value in fields.items():
        if name not in types:
            raise TypeError(f"{what} record: {name!r} is not a field that changes")
        if not isinstance(value, types[name]):
            expected = " or ".join("None" if t is _NONE else t.__name__ for t in types[name])
            raise TypeError(f"{what} record: {name} must be {expected}, got {value!r}")
    for item in fields.get("processes", ()):
        if not isinstance(item, DeclaredProcess):
            raise TypeError(f"{what} record: processes must be DeclaredProcess, got {item!r}")
    for item in fields.get("daemons", ()):
        if not isinstance(item, DaemonRecord):
            raise TypeError(f"{what} record: daemons must be DaemonRecord, got {item!r}")


# --- reading: one reader, one definition of "live" ----------------------------------------


@dataclass(frozen=True)
class StoredRun:
    """A run directory as read: its record and token, or why it could not be read."""

    directory: Path
    record: RunRecord | None
    token: str | None
    error: str | None = None

    @classmethod
    def read(cls, directory: Path) -> StoredRun:
        """This directory's run, readable (RunFileError when it is not)."""
        record, token = read_run(directory)
        return cls(directory, record, token)

    @property
    def run_id(self) -> str:
        return self.record.run_id if self.record else self.directory.name

    @property
    def live(self) -> bool:
        return self.record is not None and run_is_live(self.record)


def run_is_live(record: RunRecord) -> bool:
    """A run is live while any process it recorded still runs as itself (pid + create time)."""
    return any(is_alive(ident) for ident in record.identities())


def read_run(directory: Path) -> tuple[RunRecord, str]:
    """The record and token of one run directory; RunFileError naming what is wrong."""
    try:
        text = (directory / RUN_FILE).read_text()
        token = (directory / TOKEN_FILE).read_text().strip()
    except FileNotFoundError as exc:
        raise RunFileError(f"{exc.filename} is missing: is {directory} a run directory?") \
            from None
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8
        raise RunFileError(f"cannot read the state of {directory}: {exc}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise RunFileError(f"cannot read the state of {directory}: {directory / RUN_FILE} is "
                           f"not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("schema") not in READABLE_SCHEMAS:
        found = data.get("schema") if isinstance(data, dict) else None
        raise RunFileError(f"{directory / RUN_FILE} has schema {found!r}; this omni-dp reads "
                           f"schemas {', '.join(map(str, READABLE_SCHEMAS))}")
    try:
        return RunRecord.from_json(data), token
    except Malformed as exc:
        raise RunFileError(f"{directory / RUN_FILE} is malformed: {exc}") from None


def run_dirs(root: Path | None = None) -> list[Path]:
    parent = runs_dir(root or state_dir())
    return sorted(p for p in parent.iterdir() if p.is_dir()) if parent.is_dir() else []


def stored_runs(root: Path | None = None) -> list[StoredRun]:
    """Every run directory under the state dir, readable or not, in name order."""
    runs = []
    for directory in run_dirs(root):
        try:
            runs.append(StoredRun.read(directory))
        except RunFileError as exc:
            runs.append(StoredRun(directory, None, None, str(exc)))
    return runs


def find_run_dir(run_id: str, root: Path | None = None) -> Path:
    """The directory of the named run; RunFileError when the id is malformed or unknown."""
    root = root or state_dir()
    if not RUN_ID.match(run_id):
        raise RunFileError(f"{run_id!r} is not a run id (letters, digits, '_', '.', '-')")
    directory = run_dir(root, run_id)
    if not directory.is_dir():
        known = ", ".join(d.name for d in run_dirs(root)) or "none"
        raise RunNotFound(f"no run {run_id!r} under {runs_dir(root)} (runs: {known})")
    return directory


def pick_run(candidates: list[StoredRun], *, what: str, example: str,
             plural: str | None = None, none: str | None = None) -> StoredRun:
    """The only one of these runs; RunFileError naming them when there are none or several.
    `what` names the kind ("live run with an MPS daemon"), `plural` several of them (default
    what + "s"), `none` the whole message when there is none (default "no " + what);
    `example` the command that names one ("omni-dp verify-mps")."""
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise RunNotFound(none or f"no {what}")
    names = ", ".join(run.run_id for run in candidates)
    raise RunFileError(f"{len(candidates)} {plural or what + 's'} ({names}): name one, e.g. "
                       f"{example} {candidates[0].run_id}")
