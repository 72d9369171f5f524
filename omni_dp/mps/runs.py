"""Reading a run's state for `omni-dp verify-mps`, and re-proving its attachment.

The launcher writes the run state (docs/contracts.md: `<state dir>/runs/<run-id>/`); it is read
through omni_dp/runfile.py, the one reader, like every other reader of it. What verify-mps uses
of a `RunRecord`: its run id, its GPU ("GPU-<uuid>", an index, or "cpu"), its MPS daemon's
record, and each replica's declared processes; and the run token (also in each replica's
environment). verify-mps writes `mps_attach.txt` and `mps_attach.json` into the run directory.
"""

from __future__ import annotations

from pathlib import Path

from omni_dp.gpus import nvml_gpu_pids
from omni_dp.mps.attach import AttachReport, ReplicaProcesses, verify_attachment, write_artifacts
from omni_dp.mps.daemon import DaemonRecord
from omni_dp.procs import is_alive
from omni_dp.rundir import runs_dir, state_dir
from omni_dp.runfile import RunFileError, StoredRun, find_run_dir, stored_runs
from omni_dp.runfile import pick_run as pick_one


class CannotCheck(Exception):
    """verify-mps cannot give a verdict (exit 2); the message says why."""


def pick_run(run_id: str | None, root: Path | None = None) -> StoredRun:
    """The named run, or the only live run (omni_dp.runfile's one meaning) with an MPS daemon
    record; CannotCheck saying why there is none to check."""
    root = root or state_dir()
    try:
        if run_id is not None:
            return StoredRun.read(find_run_dir(run_id, root))
        # Unreadable directories are listed by `omni-dp status`, not here.
        candidates = [run for run in stored_runs(root)
                      if run.live and run.record is not None and run.record.mps is not None]
        return pick_one(candidates, what="live run with an MPS daemon", plural="live runs",
                        none=f"no live run with an MPS daemon under {runs_dir(root)}",
                        example="omni-dp verify-mps")
    except RunFileError as exc:
        raise CannotCheck(str(exc)) from None


def verify_run(run: StoredRun, *, use_nvml: bool = True) -> AttachReport:
    """Re-prove a live run's attachment and rewrite its artifacts."""
    record = run.record
    if record is None or run.token is None:
        raise CannotCheck(run.error or f"the state of run {run.run_id} cannot be read")
    if record.mps is None:
        raise CannotCheck(f"run {run.run_id} was started without --mps: nothing to verify")
    if not is_alive(record.mps.identity):
        raise CannotCheck(
            f"the MPS daemon of run {run.run_id} (pid {record.mps.identity.pid}) is not running"
        )
    return verify_and_record(record.mps, [r.declared() for r in record.replicas], run.token,
                             record.gpu, run.directory, use_nvml=use_nvml)


def verify_and_record(daemon: DaemonRecord, replicas: list[ReplicaProcesses], run_token: str,
                      gpu: str, directory: Path, *, use_nvml: bool = True) -> AttachReport:
    """The attachment verdict over these replicas, written as the run's artifacts. A run on
    "cpu" has no GPU for NVML to list."""
    control = daemon.control()
    gpu_pids = (lambda: nvml_gpu_pids(gpu)) if use_nvml and gpu != "cpu" else None
    report = verify_attachment(replicas, run_token, control, gpu_pids=gpu_pids)
    write_artifacts(report, directory)
    return report
