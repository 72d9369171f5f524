"""Reading what an engine allocated from its replica's log, for engines that say it nowhere else.

A replica's log is appended to on every (re)start, each start after a launcher banner
(omni_dp/launcher/bringup/replicas.py). Only the latest start counts: an older start's KV line
is what a replica held before it was restarted, not what it holds now. Only the log's tail is
read, so a long-lived replica's large log costs a bounded read. When the tail holds no banner,
the latest banner lies before it, so every line in the tail belongs to the latest start.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from omni_dp.launcher.engines.base import EngineUnreadable
from omni_dp.logs import json_line
from omni_dp.sizes import format_size

TEXT_BANNER = "--- omni-dp: starting replica"
JSON_BANNER_LOGGER = "omni_dp.launch"
JSON_BANNER_MESSAGE = "starting replica"
# A KV line is logged once, early in a start; what follows it until the health gate (warm-up,
# CUDA graph capture, a few requests) is far less than this.
TAIL_BYTES = 8 * 1024 * 1024
# A count as engines print it: `12345`, or with thousands separators `12,345` (not the comma
# that may follow it: `#tokens: 12345, KV size: …`).
COUNT = r"(\d{1,3}(?:,\d{3})+(?!\d)|\d+)"


def start_banner(index: int, log_format: str) -> str:
    """The line the launcher writes into a replica's log before each start: what
    `is_start_banner` finds again, so that a read-back never takes an earlier start's line."""
    if log_format == "json":  # every line of the log is JSON then
        return json_line(JSON_BANNER_LOGGER, f"{JSON_BANNER_MESSAGE} {index}")
    return f"{TEXT_BANNER} {index} at {time.strftime('%F %T')} ---"


def read_tail(path: Path, max_bytes: int = TAIL_BYTES) -> list[str]:
    """The whole lines within the last `max_bytes` of the file (a line the window's start cuts
    is dropped: its missing front could have made it another line)."""
    with path.open("rb") as f:
        size = f.seek(0, os.SEEK_END)
        start = max(0, size - max_bytes)
        f.seek(max(0, start - 1))  # the byte before the window: is its first line whole?
        data = f.read(size - start + (start > 0))
    if start > 0:
        newline = data.find(b"\n")
        data = data[newline + 1:] if newline >= 0 else b""
    return data.decode("utf-8", errors="replace").splitlines()


def is_start_banner(line: str) -> bool:
    """The launcher's line before each start: plain text, or one JSON record (--log-format
    json), told apart from an engine line that merely quotes it."""
    if line.startswith(TEXT_BANNER):
        return True
    if JSON_BANNER_MESSAGE not in line or not line.lstrip().startswith("{"):
        return False
    try:
        record = json.loads(line)
    except ValueError:
        return False
    return (isinstance(record, dict) and record.get("logger") == JSON_BANNER_LOGGER
            and str(record.get("message", "")).startswith(JSON_BANNER_MESSAGE))


def since_last_start(lines: Sequence[str]) -> list[str]:
    """The lines after the last start banner; all of them when there is none."""
    for i in range(len(lines) - 1, -1, -1):
        if is_start_banner(lines[i]):
            return list(lines[i + 1:])
    return list(lines)


def parse_count(text: str) -> int:
    """`12,345` → 12345."""
    return int(text.replace(",", ""))


def last_count(lines: Iterable[str], patterns: Sequence[re.Pattern[str]]) -> int | None:
    """The count (group 1) of the last line any pattern matches; None when none does."""
    found = None
    for line in lines:
        for pattern in patterns:
            match = pattern.search(line)
            if match:
                found = parse_count(match.group(1))
                break
    return found


def kv_tokens_from_log(log: Path, patterns: Sequence[re.Pattern[str]], what: str,
                       max_bytes: int = TAIL_BYTES) -> int:
    """The KV tokens the latest start logged; EngineUnreadable naming the file and the line
    looked for (`what`) when it cannot be read or holds no such line."""
    try:
        lines = read_tail(log, max_bytes)
    except OSError as exc:
        raise EngineUnreadable(f"cannot read the replica's log {log}: {exc}") from None
    tokens = last_count(since_last_start(lines), patterns)
    if tokens is None:
        raise EngineUnreadable(
            f"no {what} line in {log} since the replica's last start (read its last "
            f"{format_size(max_bytes)}): the engine did not log its KV allocation, or "
            "logs it in other words than this omni-dp knows")
    return tokens
