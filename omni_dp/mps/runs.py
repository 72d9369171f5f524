"""Reading a run's state for `omni-dp verify-mps`, and re-proving its attachment.

The launcher writes the run state (docs/contracts.md: `<state dir>/runs/<run-id>/`; the whole
schema is in omni_dp/launcher/state.py). What this module reads of it — fields the launcher
keeps:

    run.json   {"schema": 1, "run_id": str, "gpu": "GPU-<uuid>" | "<index>" | "cpu",
                "mps": {"daemon": {"pid", "create_time", "binary", "pipe_dir", "log_dir",
                                   "gpu_uuid", "server_binary" (may be absent)}} | null,
                "replicas": [{"index": int,
                              "processes": [{"pid": int, "role": str, "device": str}]}]}
    run_token  the run token, mode 0600 (also in each replica's environment)

verify-mps writes `mps_attach.txt` and `mps_attach.json` into the run directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from omni_dp.mps.attach import (
    AttachReport,
    ReplicaProcesses,
    nvml_gpu_pids,
    verify_attachment,
    write_artifacts,
)
from omni_dp.mps.daemon import DaemonRecord
from omni_dp.procs import is_alive
from omni_dp.rundir import RUN_FILE, RUN_ID, TOKEN_FILE, run_dir, runs_dir, state_dir

SCHEMA = 1


class CannotCheck(Exception):
    """verify-mps cannot give a verdict (exit 2); the message says why."""


@dataclass(frozen=True)
class RunState:
    run_id: str
    directory: Path
    gpu: str
    daemon: DaemonRecord | None
    replicas: list[ReplicaProcesses]
    run_token: str

    @property
    def live(self) -> bool:
        return self.daemon is not None and is_alive(self.daemon.identity)


def load_run(directory: Path) -> RunState:
    try:
        data = json.loads((directory / RUN_FILE).read_text())
        token = (directory / TOKEN_FILE).read_text().strip()
    except FileNotFoundError as exc:
        raise CannotCheck(f"{exc.filename} is missing: is {directory} a run directory?") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise CannotCheck(f"cannot read the state of {directory}: {exc}") from None
    try:
        if data.get("schema") != SCHEMA:
            raise CannotCheck(f"{directory}/run.json has schema {data.get('schema')!r}; this "
                              f"omni-dp reads schema {SCHEMA}")
        mps = data.get("mps")
        daemon = DaemonRecord.from_json(mps["daemon"]) if mps else None
        replicas = [ReplicaProcesses.from_json(r["index"], r["processes"])
                    for r in data["replicas"]]
        return RunState(str(data["run_id"]), directory, str(data["gpu"]), daemon, replicas,
                        token)
    except (KeyError, TypeError, ValueError) as exc:
        raise CannotCheck(f"{directory}/run.json is malformed: {exc!r}") from None


def list_runs(root: Path | None = None) -> list[RunState]:
    parent = runs_dir(root or state_dir())
    runs = []
    for directory in sorted(parent.glob("*")) if parent.is_dir() else []:
        try:
            runs.append(load_run(directory))
        except CannotCheck:
            continue  # not a run (or a broken one): listed by `omni-dp status`, not here
    return runs


def pick_run(run_id: str | None, root: Path | None = None) -> RunState:
    root = root or state_dir()
    if run_id is not None:
        if not RUN_ID.match(run_id):
            raise CannotCheck(f"{run_id!r} is not a run id (letters, digits, '_', '.', '-')")
        directory = run_dir(root, run_id)
        if not directory.is_dir():
            raise CannotCheck(f"no run {run_id!r} under {runs_dir(root)}")
        return load_run(directory)
    live = [run for run in list_runs(root) if run.live]
    if len(live) == 1:
        return live[0]
    if not live:
        raise CannotCheck(f"no live run with an MPS daemon under {runs_dir(root)}")
    names = ", ".join(run.run_id for run in live)
    raise CannotCheck(f"{len(live)} live runs ({names}): name one, e.g. omni-dp verify-mps "
                      f"{live[0].run_id}")


def verify_run(run: RunState, *, use_nvml: bool = True) -> AttachReport:
    """Re-prove a live run's attachment and rewrite its artifacts."""
    if run.daemon is None:
        raise CannotCheck(f"run {run.run_id} was started without --mps: nothing to verify")
    if not is_alive(run.daemon.identity):
        raise CannotCheck(
            f"the MPS daemon of run {run.run_id} (pid {run.daemon.identity.pid}) is not running"
        )
    return verify_and_record(run.daemon, run.replicas, run.run_token, run.gpu, run.directory,
                             use_nvml=use_nvml)


def verify_and_record(daemon: DaemonRecord, replicas: list[ReplicaProcesses], run_token: str,
                      gpu: str, directory: Path, *, use_nvml: bool = True) -> AttachReport:
    """The attachment verdict over these replicas, written as the run's artifacts. A run on
    "cpu" has no GPU for NVML to list."""
    control = daemon.control()
    gpu_pids = (lambda: nvml_gpu_pids(gpu)) if use_nvml and gpu != "cpu" else None
    report = verify_attachment(replicas, run_token, control, gpu_pids=gpu_pids)
    write_artifacts(report, directory)
    return report
