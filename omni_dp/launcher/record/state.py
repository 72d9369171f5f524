"""A run's state directory: run.json (written atomically at every step), events.jsonl, logs/.

    <state dir>/runs/<run-id>/      mode 0700
      run.json      schema 2: omni_dp/runfile.py types it (RunRecord) and reads it (and 1)
      run_token     the run's secret, mode 0600; also in every child's environment
      events.jsonl  one JSON object per line: {"ts", "event", ...}
      stop_request.json  {"drain_timeout", "by_pid", "ts"}: written by `omni-dp down` before it
                    signals the process in charge, which then tears down with that bound
      logs/         replica_<i>.log, router.log, supervisor.log
      mps/pipe, mps/log, mps_attach.txt, mps_attach.json   (with --mps, one GPU)
      mps/gpu<i>/pipe, mps/gpu<i>/log, mps_attach.gpu<i>.txt/.json  (with --mps, per GPU i)
      share/        weights.json (+ weights.bin on CPU)      (with --share-weights)

run.json:
    {"schema": 2, "run_id", "created_at", "state", "gpu", "device", "plan": {...},
     "launcher": {"pid", "create_time"},  # the `omni-dp launch` process
     "supervisor": {"pid", "create_time", "detached",
                    "supervising_since"} | null,  # set once its loop has run a first sweep
     "router": {"pid", "create_time", "pgid", "url", "argv", "log"} | null,
     "mps": {"daemons": [{"pid", "create_time", "binary", "pipe_dir", "log_dir", "gpu_uuid",
                          "server_binary", "gpu"}]} | null,  # one per GPU slot
     "gpus": [{"slot", "label", "index", "numa_node", "name"}],  # "cpu" (one slot) without
     "share": {"leader", "followers", "directory", "policy", "shared_bytes",
               "private_bytes", "tensors", "leader_pid", "published_at"} | null,
     "replicas": [{"index", "port", "url", "cpus", "argv", "env", "log",
                   "pid", "create_time", "pgid",          # null until started
                   "processes": [{"pid", "role", "device"}],  # from /get_server_info
                   "state", "kv_tokens", "mps_attached", "memory_bytes", "restarts",
                   "last_error", "gpu", "generation"}],  # gpu: the slot in "gpus"
     "desired": {"change", "plan", "gpus", "replicas"}}  # only while a change runs

Exactly one process writes run.json at a time: `omni-dp launch` until the supervisor is up, then
the supervisor; `omni-dp down` only once the supervisor is gone. Within the supervisor one thread
does, its loop: every change is a write (record/writes.py) that a supervision thread hands the
loop and waits for (self.writer).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omni_dp.cpulist import format_cpu_list
from omni_dp.files import atomic_write, make_private_dir
from omni_dp.launcher.planning.plan import LaunchPlan, ReplicaPlan
from omni_dp.launcher.record.events import Event
from omni_dp.launcher.record.writes import (
    DaemonStarted,
    DesiredSet,
    EventWritten,
    FollowerAdded,
    GatewayChanged,
    PhaseSet,
    PlanSet,
    RecordsReplaced,
    ReplicaChanged,
    ScaleSet,
    Write,
    apply,
)
from omni_dp.mps.daemon import DaemonRecord
from omni_dp.procs import identify
from omni_dp.rundir import RUN_FILE, TOKEN_FILE, logs_dir
from omni_dp.runfile import (
    Desired,
    GatewayRecord,
    GpuRecord,
    PlanRecord,
    ReplicaRecord,
    RunPhase,
    RunRecord,
    SupervisionSettings,
    read_run,
)

EVENTS_FILE = "events.jsonl"
STOP_FILE = "stop_request.json"


def append_private(path: Path):
    """Open for appending; created 0600 whatever the umask (logs can hold request text)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")


def replica_record(r: ReplicaPlan) -> ReplicaRecord:
    """What run.json keeps of a planned replica before it first starts."""
    return ReplicaRecord(index=r.index, port=r.port, url=r.url,
                         cpus=format_cpu_list(r.cpus) if r.cpus else None,
                         argv=tuple(r.argv), env=dict(r.env), log=r.log_name, gpu=r.gpu)


class RunState:
    """One run's directory and its record. Every change is a write (record/writes.py) that
    replaces the frozen record and rewrites run.json; the supervisor's threads share one
    instance, and while its loop runs only the loop applies writes."""

    def __init__(self, directory: Path, record: RunRecord, token: str) -> None:
        self.directory = directory
        self._record = record
        self.token = token
        # The router's API key, in memory only: from the launch options, or (in the detached
        # supervisor) its environment. Never in run.json.
        self.api_key: str | None = None
        self._lock = threading.RLock()
        # Who applies a write made here: None, the calling thread; while a supervision loop
        # runs, the loop (every thread's write is handed to it: supervision/outcomes.py)
        self.writer: Callable[[Write], object] | None = None

    # --- creating and loading -------------------------------------------------------------

    @classmethod
    def create(cls, plan: LaunchPlan) -> RunState:
        make_private_dir(plan.run_dir.parent.parent)  # the state root, 0700
        make_private_dir(plan.run_dir.parent)
        plan.run_dir.mkdir(mode=0o700)  # fails if it exists: never reuse a run's directory
        os.chmod(plan.run_dir, 0o700)
        logs_dir(plan.run_dir).mkdir(mode=0o700)
        token = secrets.token_hex(16)
        atomic_write(plan.run_dir / TOKEN_FILE, token + "\n")
        record = RunRecord(
            run_id=plan.run_id, created_at=time.time(), state=RunPhase.STARTING,
            gpu=plan.gpu_label, device=plan.device, plan=plan.record(),
            launcher=identify(os.getpid()),  # `omni-dp launch`, until it hands off
            replicas=tuple(replica_record(r) for r in plan.replicas),
            gpus=plan.gpus,
        )
        state = cls(plan.run_dir, record, token)
        state.save()
        return state

    @classmethod
    def load(cls, directory: Path) -> RunState:
        """RunFileError (omni_dp.runfile) when the directory is not a readable run."""
        record, token = read_run(directory)
        return cls(directory, record, token)

    # --- reading --------------------------------------------------------------------------

    @property
    def record(self) -> RunRecord:
        return self._record

    @property
    def run_id(self) -> str:
        return self._record.run_id

    @property
    def replicas(self) -> tuple[ReplicaRecord, ...]:
        return self._record.replicas

    def replica(self, index: int) -> ReplicaRecord:
        return self._record.replicas[index]

    @property
    def plan(self) -> PlanRecord:
        return self._record.plan

    @property
    def supervision(self) -> SupervisionSettings:
        return self._record.plan.supervision

    @property
    def logs(self) -> Path:
        return logs_dir(self.directory)

    # --- writing --------------------------------------------------------------------------

    @property
    def removed(self) -> bool:
        """Someone removed the run directory: the in-memory record is all that is left, and
        it is still enough to tear the run down."""
        return not self.directory.is_dir()

    def save(self) -> None:
        with self._lock:
            if self.removed:
                return  # never recreate a removed run directory
            atomic_write(self.directory / RUN_FILE,
                         json.dumps(self._record.to_json(), indent=1) + "\n")

    def write(self, change: Write) -> object:
        """Make one write (record/writes.py): applied here and now, or, while a supervision
        loop owns the record, handed to it and waited for (self.writer). What apply answers."""
        writer = self.writer
        return self.apply(change) if writer is None else writer(change)

    def apply(self, change: Write) -> object:
        """Apply one write in this thread: the writer's own path (launch, the loop)."""
        with self._lock:
            return apply(change, self)

    def commit(self, record: RunRecord) -> None:
        """The record after a write (apply's alone), in run.json at once."""
        with self._lock:
            self._record = record
            self.save()

    def append_event(self, line: str) -> None:
        """One line of events.jsonl (apply's alone); nothing once the directory is gone."""
        with self._lock:
            if self.removed:
                return
            with append_private(self.directory / EVENTS_FILE) as f:
                f.write(line.encode() + b"\n")

    def update(self, **fields: Any) -> None:
        """Replace top-level records (router, supervisor, launcher), typed: a RouterRecord, …;
        the run's phase goes through set_phase, a daemon through set_daemon."""
        assert "state" not in fields, "set_phase() changes the run's phase"
        self.write(RecordsReplaced(fields))

    def set_daemon(self, record: DaemonRecord) -> None:
        """Record the MPS daemon now serving record.gpu's slot (it replaces the one before)."""
        self.write(DaemonStarted(record))

    def change_gateway(self, change: Callable[[GatewayRecord | None], GatewayRecord]) -> None:
        """Replace the gateway record by change(current), in one write: two restart threads
        registering at once must not drop each other's entry."""
        self.write(GatewayChanged(change))

    def set_phase(self, phase: RunPhase) -> None:
        self.write(PhaseSet(phase))

    def update_replica(self, index: int, **fields: Any) -> None:
        """Change one replica's fields, typed (state=ReplicaState.HEALTHY); a `state` change
        is checked against the lifecycle."""
        self.write(ReplicaChanged(index, fields))

    def set_scale(self, replicas: tuple[ReplicaRecord, ...], plan: PlanRecord,
                  gpus: tuple[GpuRecord, ...]) -> None:
        """The replica list after a scale (omni-dp scale), with the plan it follows."""
        self.write(ScaleSet(replicas, plan, gpus))

    def set_plan(self, plan: PlanRecord) -> None:
        """The plan after a change that keeps the replicas (a model update)."""
        self.write(PlanSet(plan))

    def set_desired(self, desired: Desired | None) -> None:
        """What the running day-two change wants the run to be (None: no change runs)."""
        self.write(DesiredSet(desired))

    def add_follower(self, index: int, leader_pid: int) -> bool:
        """Record a follower proven attached to the share the leader leader_pid published (in
        one write: two followers' gates may pass together); False when that share is not the
        recorded one (none is, or another leader's)."""
        return bool(self.write(FollowerAdded(index, leader_pid)))

    def event(self, name: Event, **fields) -> None:
        """One line of events.jsonl; `name` an Event (TypeError for a plain string: a name no
        reader knows is a bug where it is written)."""
        if not isinstance(name, Event):
            raise TypeError(f"an event is named by an Event, not {name!r}")
        self.write(EventWritten(name, fields))

    def request_stop(self, drain_timeout: float) -> None:
        """Tell the process in charge with which drain bound to tear down (read on SIGTERM)."""
        with self._lock:
            if self.removed:
                return
            atomic_write(self.directory / STOP_FILE, json.dumps(
                {"drain_timeout": drain_timeout, "by_pid": os.getpid(), "ts": time.time()}))

    def requested_drain(self, default: float) -> float:
        """The drain bound of the last stop request, else default."""
        try:
            value = json.loads((self.directory / STOP_FILE).read_text())["drain_timeout"]
        except (OSError, ValueError, KeyError, TypeError):
            return default
        valid = isinstance(value, (int, float)) and math.isfinite(value) and value >= 0
        return float(value) if valid else default

    def events(self) -> list[dict]:
        try:
            lines = (self.directory / EVENTS_FILE).read_text().splitlines()
        except OSError:
            return []
        return [json.loads(line) for line in lines if line.strip()]

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=self.removed)
