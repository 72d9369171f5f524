"""MPS trouble in the logs: the patterns that name it (FAULT_PATTERNS), the lines that match
(the daemon's health reads control.log whole with them), and the scanner of the replica logs.

A fault restarts every replica of the GPU, so a pattern names one fact that means the daemon's
server is broken for all its clients, and no line that a healthy run writes:
- control.log: a server that exits non-zero (`[... Control 64] Server 92 exited with status
  1`, drivers 535 to 580) or says it met a fatal exception (`Server encountered a fatal
  exception. Shutting down`); the FAULT state's name wherever it is written;
- a client's log: the server-level MPS errors — 805 (no connection to the daemon or server),
  806 (the client-server RPC failed), 807 (the server is not ready: in FAULT, recovering) —
  by their names (cudaErrorMps…, CUDA_ERROR_MPS_…) and in the runtime's own words, which is
  what torch prints (`CUDA error: the remote procedural call between the MPS server and the
  MPS client failed`: cudaGetErrorString, no name, no number).
Worded loosely where drivers reword (case, "exited with status|code"), never by a bare
substring: "DEFAULT" is no FAULT. Not faults: a client terminated (810: omni-dp's own
terminate_client of a replica that would not stop), the client or connection limits (808, 809:
no restart frees them), and the daemon's normal lines (`NEW CLIENT … Server is not ready, push
client to pending list`, `User did not send valid credentials`, a server's `exited with status
0`).

A replica's log grows with its traffic, so it is read incrementally: each scan starts where the
last one ended (from the start again when the file shrank: replaced). A log set aside after a
daemon restart is forgotten with it: old faults must not condemn the new daemon.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

_MPS_ERROR_NAMES = (r"cudaErrorMps(?:ConnectionFailed|RpcFailure|ServerNotReady)"
                    r"|CUDA_ERROR_MPS_(?:CONNECTION_FAILED|RPC_FAILURE|SERVER_NOT_READY)"
                    r"|MpsRpc")
# (what the line shows, its pattern): one fact each.
FAULT_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("an MPS server exited non-zero", re.compile(
        r"\bserver\s+\d+\s+exited\s+with\s+(?:exit\s+)?(?:status|code)\s+[1-9]\d*", re.I)),
    ("an MPS server met a fatal exception", re.compile(
        r"\bserver\b[^.]{0,40}\bfatal\s+(?:gpu\s+)?exception\b", re.I)),
    ("an MPS server in the FAULT state", re.compile(r"(?<![A-Za-z0-9_])FAULT(?![A-Za-z0-9_])")),
    ("an MPS error by name", re.compile(_MPS_ERROR_NAMES)),
    ("an MPS error in the runtime's words", re.compile(
        r"\bMPS\s+(?:client|server|control\s+daemon)\b.*\b(?:fail(?:s|ed|ure)?|not\s+ready)\b"
        r"|\bMPS\s+RPC\b", re.I)),
)


def is_fault_line(line: str) -> bool:
    """Whether the line shows one of FAULT_PATTERNS' facts."""
    return any(pattern.search(line) for _, pattern in FAULT_PATTERNS)


def fault_lines(name: str, text: str) -> list[str]:
    """The lines of text that show MPS trouble, each prefixed with the log's name."""
    return [f"{name}: {line.strip()}" for line in text.splitlines() if is_fault_line(line)]


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
