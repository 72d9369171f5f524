"""Where runs live, named once (docs/contracts.md "Run state"); the launcher writes them,
omni_dp/runfile.py reads them (for the launcher, `status` and `verify-mps` alike).

    $OMNI_DP_STATE_DIR (default ${XDG_RUNTIME_DIR:-/tmp}/omni-dp-<uid>)/runs/<run-id>/
        run.json  run_token  events.jsonl  logs/  mps/pipe  mps/log  share/
"""

from __future__ import annotations

import os
import re
from pathlib import Path

RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")  # \Z: no trailing newline
RUN_FILE = "run.json"
TOKEN_FILE = "run_token"


def state_dir() -> Path:
    explicit = os.environ.get("OMNI_DP_STATE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return Path(base) / f"omni-dp-{os.getuid()}"


def runs_dir(root: Path) -> Path:
    return root / "runs"


def run_dir(root: Path, run_id: str) -> Path:
    return runs_dir(root) / run_id


def mps_pipe_dir(run: Path) -> Path:
    return run / "mps" / "pipe"


def engine_work_dir(run: Path, index: int) -> Path:
    """An external engine replica's own TMPDIR and caches: the run's, removed with it."""
    return run / "engines" / f"replica_{index}"


def share_dir(run: Path) -> Path:
    """Where a weight-sharing leader publishes its manifest and CPU segment (sharefile.py)."""
    return run / "share"


def mps_log_dir(run: Path) -> Path:
    return run / "mps" / "log"


def logs_dir(run: Path) -> Path:
    return run / "logs"
