"""A private MPS control daemon on its own, under a state directory the caller names (`omni-dp
mps start|stop|status`); a run's daemon is the launcher's, recorded in its run.json.

The directory holds mps/pipe, mps/log and mps/daemon.json, the record every later command reads.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omni_dp.contract import ExitCode
from omni_dp.files import atomic_write
from omni_dp.mps.control import MpsControl, MpsControlError
from omni_dp.mps.daemon import DaemonHealth, DaemonRecord, MpsDaemon, MpsDaemonError
from omni_dp.mps.preflight import GPU_CHECKS, format_report, run_preflight
from omni_dp.rundir import mps_log_dir, mps_pipe_dir


class StandaloneError(Exception):
    """What stopped the command; `code` is the exit status it asks for."""

    def __init__(self, message: str, code: int = ExitCode.USAGE) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class StandalonePaths:
    pipe: Path
    log: Path
    record: Path

    @classmethod
    def under(cls, state_dir: str | Path) -> StandalonePaths:
        base = Path(state_dir).absolute()
        return cls(mps_pipe_dir(base), mps_log_dir(base), base / "mps" / "daemon.json")


def start_daemon(state_dir: str, *, control_binary: str | None, gpu: str,
                 thread_percentage: float | None, memory_limit_bytes: int | None,
                 gpu_check: bool = True, say: Callable[[str], None] = print) -> DaemonRecord:
    """Preflight (without the GPU checks where gpu_check is off), start the daemon and record
    it; `say` hears which binaries were found. Nothing is created before preflight passed."""
    paths = StandalonePaths.under(state_dir)
    report = run_preflight(control_binary=control_binary, gpu=gpu, pipe_dir=str(paths.pipe),
                           num_client_processes=0)
    if any(gpu_check or p.check not in GPU_CHECKS for p in report.problems):
        raise StandaloneError("cannot start the MPS daemon:\n" + format_report(report))
    if paths.record.exists():
        raise StandaloneError(f"{paths.record} exists: a daemon was started here; run "
                              f"`omni-dp mps stop --state-dir {state_dir}` first")
    found = report.binaries
    assert found is not None  # else a control_binary problem stopped it above
    say(found.describe())  # which pair, where from, which versions
    try:
        control = MpsControl(found.control, str(paths.pipe), str(paths.log),
                             server_binary=found.server)
        record = MpsDaemon(control).start(
            gpu_uuid=report.gpu.uuid if report.gpu else None,
            thread_percentage=thread_percentage, memory_limit_bytes=memory_limit_bytes,
        )
    except (MpsControlError, MpsDaemonError) as exc:
        raise StandaloneError(str(exc), ExitCode.RUNTIME) from exc
    atomic_write(paths.record, json.dumps(record.to_json(), indent=2) + "\n")
    return record


def load_record(state_dir: str) -> tuple[DaemonRecord, Path]:
    path = StandalonePaths.under(state_dir).record
    try:
        return DaemonRecord.from_json(json.loads(path.read_text())), path
    except FileNotFoundError:
        raise StandaloneError(f"no daemon recorded under {state_dir} ({path} is missing)"
                              ) from None
    except (OSError, ValueError, KeyError) as exc:
        raise StandaloneError(f"cannot read {path}: {exc!r}") from None


def stop_daemon(state_dir: str, *, force: bool = False) -> tuple[DaemonRecord, bool]:
    """Quit the recorded daemon, wait for its pid to exit, remove the record. Returns the
    record and whether it was running."""
    record, path = load_record(state_dir)
    try:
        was_running = MpsDaemon(record.control()).stop(record, force=force)
    except MpsDaemonError as exc:
        raise StandaloneError(str(exc), ExitCode.CHECK_FAILED) from exc
    path.unlink()
    return record, was_running


def daemon_health(state_dir: str) -> tuple[DaemonRecord, DaemonHealth]:
    record, _ = load_record(state_dir)
    return record, MpsDaemon(record.control()).health(record)


def format_health(record: DaemonRecord, health: DaemonHealth) -> str:
    lines = [
        f"daemon pid {record.identity.pid}: {'alive' if health.alive else 'NOT RUNNING'}, "
        f"{'answering' if health.reachable else 'not answering'}",
        f"servers: {', '.join(map(str, health.servers)) or 'none'}",
        *[f"fault: {line}" for line in health.faults],
    ]
    if health.error:
        lines.append(f"error: {health.error}")
    return "\n".join(lines)
