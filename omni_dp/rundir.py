"""Where runs live, named once (docs/contracts.md "Run state"); the launcher writes them,
omni_dp/runfile.py reads them (for the launcher, `status` and `verify-mps` alike).

    $OMNI_DP_STATE_DIR (default ${XDG_RUNTIME_DIR:-/tmp}/omni-dp-<uid>)/runs/<run-id>/
        run.json  run_token  events.jsonl  logs/  mps/pipe  mps/log  share/
    A run over several GPUs has one daemon per GPU: mps/gpu<INDEX>/pipe, mps/gpu<INDEX>/log,
    and its attachment proof in mps_attach.gpu<INDEX>.{txt,json}.
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


def mps_dir(run: Path, gpu_index: int | None = None) -> Path:
    """A daemon's directory: mps/ for a one-GPU run (as before runs spanned GPUs), mps/gpu<i>/
    for GPU i of a run over several."""
    return run / "mps" if gpu_index is None else run / "mps" / f"gpu{gpu_index}"


def mps_pipe_dir(run: Path, gpu_index: int | None = None) -> Path:
    return mps_dir(run, gpu_index) / "pipe"


def attach_stem(gpu_index: int | None = None) -> str:
    """The attachment proof's file name without .txt/.json: one per daemon."""
    return "mps_attach" if gpu_index is None else f"mps_attach.gpu{gpu_index}"


def engine_work_dir(run: Path, index: int) -> Path:
    """An external engine replica's own TMPDIR and caches: the run's, removed with it."""
    return run / "engines" / f"replica_{index}"


def share_dir(run: Path) -> Path:
    """Where a weight-sharing leader publishes its manifest and CPU segment (sharefile.py)."""
    return run / "share"


def mps_log_dir(run: Path, gpu_index: int | None = None) -> Path:
    return mps_dir(run, gpu_index) / "log"


def logs_dir(run: Path) -> Path:
    return run / "logs"


def numeric_check_file(run: Path, index: int) -> Path:
    """A capped replica's BF16 GEMM check, as it ran under its caps before the replica
    started (processes/numeric_gate.py writes it; the launcher reports it)."""
    return logs_dir(run) / f"replica_{index}.numeric_check.json"
