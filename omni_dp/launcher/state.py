"""A run's state directory: run.json (written atomically at every step), events.jsonl, logs/.

    <state dir>/runs/<run-id>/      mode 0700
      run.json      schema 1 (below); the fields omni_dp.mps.runs reads keep their meaning
      run_token     the run's secret, mode 0600; also in every child's environment
      events.jsonl  one JSON object per line: {"ts", "event", ...}
      stop_request.json  {"drain_timeout", "by_pid", "ts"}: written by `omni-dp down` before it
                    signals the process in charge, which then tears down with that bound
      logs/         replica_<i>.log, router.log, supervisor.log
      mps/pipe, mps/log, mps_attach.txt, mps_attach.json   (with --mps)

run.json:
    {"schema": 1, "run_id", "created_at", "state", "gpu", "device", "plan": {...},
     "launcher": {"pid", "create_time"},  # the `omni-dp launch` process
     "supervisor": {"pid", "create_time", "detached",
                    "supervising_since"} | null,  # set once its loop has run a first sweep
     "router": {"pid", "create_time", "pgid", "port", "url", "argv", "log"} | null,
     "mps": {"daemon": {"pid", "create_time", "binary", "pipe_dir", "log_dir", "gpu_uuid",
                        "server_binary"}} | null,
     "replicas": [{"index", "port", "url", "cpus", "argv", "env", "log",
                   "pid", "create_time", "pgid",          # null until started
                   "processes": [{"pid", "role", "device"}],  # from /get_server_info
                   "state", "kv_tokens", "mps_attached", "restarts", "last_error"}]}

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
from pathlib import Path

from omni_dp.files import atomic_write
from omni_dp.launcher.plan import LaunchPlan
from omni_dp.launcher.topology import format_cpu_list
from omni_dp.mps.daemon import make_private_dir
from omni_dp.procs import ProcessIdentity, identify
from omni_dp.rundir import RUN_FILE, TOKEN_FILE, logs_dir

SCHEMA = 1
EVENTS_FILE = "events.jsonl"
STOP_FILE = "stop_request.json"


class StateError(Exception):
    """The run directory cannot be read or written; the message names it."""


def append_private(path: Path):
    """Open for appending; created 0600 whatever the umask (logs can hold request text)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")


def identity_of(record: dict | None) -> ProcessIdentity | None:
    """The process identity stored in a run.json record, if it has one."""
    if not record or record.get("pid") is None or record.get("create_time") is None:
        return None
    return ProcessIdentity(int(record["pid"]), float(record["create_time"]))


class RunState:
    """One run's directory. Thread-safe: the supervisor's threads share one instance."""

    def __init__(self, directory: Path, data: dict, token: str) -> None:
        self.directory = directory
        self.data = data
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
        data = {
            "schema": SCHEMA,
            "run_id": plan.run_id,
            "created_at": time.time(),
            "state": "starting",
            "gpu": plan.gpu_label,
            "device": plan.device,
            "plan": plan.to_json(),
            "launcher": identify(os.getpid()).to_json(),  # `omni-dp launch`, until it hands off
            "supervisor": None,
            "router": None,
            "mps": None,
            "replicas": [
                {"index": r.index, "port": r.port, "url": r.url,
                 "cpus": format_cpu_list(r.cpus) if r.cpus else None,
                 "argv": list(r.argv), "env": r.env, "log": r.log_name,
                 "pid": None, "create_time": None, "pgid": None, "processes": [],
                 "state": "planned", "kv_tokens": None, "mps_attached": None,
                 "restarts": [], "last_error": None}
                for r in plan.replicas
            ],
        }
        state = cls(plan.run_dir, data, token)
        state.save()
        return state

    @classmethod
    def load(cls, directory: Path) -> RunState:
        try:
            data = json.loads((directory / RUN_FILE).read_text())
            token = (directory / TOKEN_FILE).read_text().strip()
        except FileNotFoundError as exc:
            raise StateError(f"{exc.filename} is missing: is {directory} a run directory?") \
                from None
        except (OSError, ValueError) as exc:
            raise StateError(f"cannot read the state of {directory}: {exc}") from None
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise StateError(f"{directory / RUN_FILE} is not a schema-{SCHEMA} run file")
        return cls(directory, data, token)

    # --- reading --------------------------------------------------------------------------

    @property
    def run_id(self) -> str:
        return self.data["run_id"]

    @property
    def replicas(self) -> list[dict]:
        return self.data["replicas"]

    def replica(self, index: int) -> dict:
        return self.data["replicas"][index]

    @property
    def plan(self) -> dict:
        return self.data["plan"]

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
            atomic_write(self.directory / RUN_FILE, json.dumps(self.data, indent=1) + "\n")

    def update(self, **fields) -> None:
        with self._lock:
            self.data.update(fields)
            self.save()

    def update_replica(self, index: int, **fields) -> None:
        with self._lock:
            self.data["replicas"][index].update(fields)
            self.save()

    def event(self, name: str, **fields) -> None:
        line = json.dumps({"ts": round(time.time(), 3), "event": name, **fields})
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
