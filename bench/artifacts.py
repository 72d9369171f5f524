"""A run directory's files copied out for the record (standard library only: the device call's
runner imports it before it knows what else this machine's Python has)."""

from __future__ import annotations

import os
from pathlib import Path

ARTIFACT_MAX_BYTES = 2 * 1024**2  # per file: the tail of a long replica log is what matters
SECRET_FILES = {"run_token"}
BULK_SUFFIXES = {".bin", ".safetensors", ".pt"}  # weights: evidence of nothing, megabytes each


def copy_artifacts(run_dir: Path, dest: Path, max_bytes: int = ARTIFACT_MAX_BYTES) -> list[str]:
    """Regular files of a run (run.json, events, mps_attach.*, MPS and replica logs), never
    its token, weights, the pipe directory's sockets and FIFO (opening a FIFO would block); of a
    file over `max_bytes`, its tail."""
    copied = []
    for path in sorted(run_dir.rglob("*")):
        if (path.name in SECRET_FILES or path.suffix in BULK_SUFFIXES or not path.is_file()
                or path.is_symlink()):
            continue
        target = dest / path.relative_to(run_dir)
        target.parent.mkdir(parents=True, exist_ok=True)
        with path.open("rb") as src:
            size = os.fstat(src.fileno()).st_size
            if size > max_bytes:
                src.seek(size - max_bytes)
            target.write_bytes(src.read())
        copied.append(str(target.relative_to(dest)))
    return copied
