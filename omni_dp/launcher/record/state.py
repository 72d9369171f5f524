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
                   "last_error", "gpu"}]}  # gpu: the slot in "gpus"

Exactly one process writes run.json at a time: `omni-dp launch` until the supervisor is up, then
the supervisor; `omni-dp down` only once the supervisor is gone.
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
from omni_dp.mps.daemon import DaemonRecord
from omni_dp.procs import identify
from omni_dp.rundir import RUN_FILE, TOKEN_FILE, logs_dir
from omni_dp.runfile import (
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
    """One run's directory and its record. Thread-safe: the supervisor's threads share one
    instance; every change replaces the frozen record and rewrites run.json."""

    def __init__(self, directory: Path, record: RunRecord, token: str) -> None:
        self.directory = directory
        self._record = record
        self.token = token
        # The router's API key, in memory only: from the launch options, or (in the detached
        # supervisor) its environment. Never in run.json.
        self.api_key: str | None = None
        self._lock = threading.RLock()

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

    def update(self, **fields: Any) -> None:
        """Replace top-level records (router, supervisor, launcher), typed: a RouterRecord, …;
        the run's phase goes through set_phase, a daemon through set_daemon."""
        assert "state" not in fields, "set_phase() changes the run's phase"
        with self._lock:
            self._record = self._record.with_records(**fields)
            self.save()

    def set_daemon(self, record: DaemonRecord) -> None:
        """Record the MPS daemon now serving record.gpu's slot (it replaces the one before)."""
        with self._lock:
            self._record = self._record.with_daemon(record)
            self.save()

    def change_gateway(self, change: Callable[[GatewayRecord | None], GatewayRecord]) -> None:
        """Replace the gateway record by change(current) under the lock: two restart threads
        registering at once must not drop each other's entry."""
        with self._lock:
            self.update(gateway=change(self._record.gateway))

    def set_phase(self, phase: RunPhase) -> None:
        with self._lock:
            if phase is not self._record.state:
                self._record = self._record.with_phase(phase)
                self.save()

    def update_replica(self, index: int, **fields: Any) -> None:
        """Change one replica's fields, typed (state=ReplicaState.HEALTHY); a `state` change
        is checked against the lifecycle."""
        with self._lock:
            self._record = self._record.with_replica(index, **fields)
            self.save()

    def set_scale(self, replicas: tuple[ReplicaRecord, ...], plan: PlanRecord,
                  gpus: tuple[GpuRecord, ...]) -> None:
        """The replica list after a scale (omni-dp scale), with the plan it follows."""
        with self._lock:
            self._record = self._record.with_scale(replicas, plan, gpus)
            self.save()

    def set_plan(self, plan: PlanRecord) -> None:
        """The plan after a change that keeps the replicas (a model update)."""
        with self._lock:
            self._record = self._record.with_plan(plan)
            self.save()

    def add_follower(self, index: int, leader_pid: int) -> bool:
        """Record a follower proven attached to the share the leader leader_pid published (at
        once: two followers' gates may pass together); False when that share is not the
        recorded one (none is, or another leader's)."""
        with self._lock:
            share = self._record.share
            if share is None or share.leader_pid != leader_pid:
                return False
            self.update(share=share.with_follower(index))
            return True

    def event(self, name: Event, **fields) -> None:
        """One line of events.jsonl; `name` an Event (TypeError for a plain string: a name no
        reader knows is a bug where it is written)."""
        if not isinstance(name, Event):
            raise TypeError(f"an event is named by an Event, not {name!r}")
        line = json.dumps({"ts": round(time.time(), 3), "event": name.value, **fields})
        with self._lock:
            if self.removed:
                return
            with append_private(self.directory / EVENTS_FILE) as f:
                f.write(line.encode() + b"\n")

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
