"""Where a run's files live under the state directory (DESIGN.md), named in one place."""

from __future__ import annotations

from pathlib import Path


def runs_dir(root: Path) -> Path:
    return root / "runs"


def run_dir(root: Path, run_id: str) -> Path:
    return runs_dir(root) / run_id


def mps_pipe_dir(run: Path) -> Path:
    return run / "mps" / "pipe"


def mps_log_dir(run: Path) -> Path:
    return run / "mps" / "log"


def logs_dir(run: Path) -> Path:
    return run / "logs"
