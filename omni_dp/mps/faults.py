"""MPS trouble in the logs: the pattern that names it (FAULT_LINE), the lines that match
(the daemon's health reads control.log whole with them), and the scanner of the replica logs.

A replica's log grows with its traffic, so it is read incrementally: each scan starts where the
last one ended (from the start again when the file shrank: replaced). A log set aside after a
daemon restart is forgotten with it: old faults must not condemn the new daemon.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

FAULT_LINE = re.compile(r"MpsRpc|cudaErrorMps\w*|exited with status [1-9]\d*|FAULT")


def fault_lines(name: str, text: str) -> list[str]:
    """The lines of text that show MPS trouble, each prefixed with the log's name."""
    return [f"{name}: {line.strip()}" for line in text.splitlines() if FAULT_LINE.search(line)]


class FaultScanner:
    def __init__(self) -> None:
        self.offsets: dict[Path, int] = {}  # where the last read of each log ended

    def new_faults(self, paths: Iterable[Path]) -> list[str]:
        """Fault lines written to these logs since the last scan."""
        return [line for path in paths for line in self._scan(path)]

    def _scan(self, path: Path) -> list[str]:
        try:
            with open(path, "rb") as f:
                offset = self.offsets.get(path, 0)
                if os.fstat(f.fileno()).st_size < offset:
                    offset = 0  # replaced by a shorter file
                f.seek(offset)
                chunk = f.read()
        except OSError:
            return []
        self.offsets[path] = offset + len(chunk)
        return fault_lines(path.name, chunk.decode(errors="replace"))

    def set_aside(self, paths: Iterable[Path], stamp: int) -> None:
        """Rename these logs to NAME.<stamp> and read their successors from the start."""
        for path in paths:
            if path.exists():
                path.rename(path.with_name(f"{path.name}.{stamp}"))
            self.offsets.pop(path, None)
