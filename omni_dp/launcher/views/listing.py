"""`omni-dp list`: every run under the state directory, one line each, from what status.py
collects of it (without probing: a listing is quick); and whether a run has any state left."""

from __future__ import annotations

from pathlib import Path

from omni_dp.launcher.record.state import RunState
from omni_dp.launcher.views.status import collect
from omni_dp.rundir import RUN_ID, run_dir, state_dir
from omni_dp.runfile import run_dirs, stored_runs


def list_runs(root: Path | None = None) -> list[dict]:
    """One row per run directory, live or kept after a failure; an unreadable one says why."""
    rows = []
    for run in stored_runs(root):
        if run.record is None or run.token is None:
            rows.append({"run_id": run.run_id, "state": "unreadable", "error": run.error})
            continue
        report = collect(RunState(run.directory, run.record, run.token), probe=False)
        rows.append({"run_id": report["run_id"], "state": report["state"],
                     "replicas": len(report["replicas"]), "router": report["router"]["url"],
                     "gpu": report["gpu"], "directory": report["directory"]})
    return rows


def format_runs(rows: list[dict]) -> str:
    return "\n".join(
        f"{r['run_id']}  {r['state']}  " + (f"{r['replicas']} replica(s)  {r['router']}  "
                                            f"{r['gpu']}" if "replicas" in r else r["error"])
        for r in rows) or "no runs"


def no_state_left(run_id: str | None) -> bool:
    """Nothing to stop: no run at all (run_id None), or no directory for this well-formed id.
    A malformed id is not decided here: picking the run says what is wrong with it."""
    if run_id is None:
        return not run_dirs()
    return bool(RUN_ID.match(run_id)) and not run_dir(state_dir(), run_id).exists()
