"""Log set-up of the long-running commands (`serve`, `router` and its workers, `launch` and
the detached supervisor), and the reading of a run's logs (`omni-dp logs`).

One module decides the line format so that every process of a run writes the same kind of
line: `text` (the format these commands always had) or `json` (one JSON object per line, for
log collectors). JSON lines come from python-json-logger: a stdlib `logging.Formatter`, so no
call site changes and third-party loggers (aiohttp, asyncio) come out as JSON too.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from pythonjsonlogger.json import JsonFormatter

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# `log.info(text, extra={FIELDS: {...}})`: in JSON the fields become keys of the line (and the
# message is their "event"), in text the message alone is written. The router's route lines
# use it, so their fields are not a JSON string inside a JSON string.
FIELDS = "fields"
_CORE = ("time", "level", "logger", "message")


@dataclass(frozen=True)
class LogSetup:
    """What `setup_logging` was given, so that child processes can repeat it."""

    level: int
    fmt: str
    worker: int | None = None


_current = LogSetup(logging.WARNING, "text")


class JsonLines(JsonFormatter):
    """time (UTC, ISO 8601), level, logger, message, then any extras; a traceback is one
    escaped string (`exc_info`), so a record is always exactly one line."""

    def __init__(self, static_fields: dict[str, Any] | None = None) -> None:
        super().__init__("%(levelname)s %(name)s %(message)s",
                         rename_fields={"levelname": "level", "name": "logger"},
                         static_fields=static_fields)  # ASCII (\u escapes): safe on any stream

    def add_fields(self, log_data: dict[str, Any], record: logging.LogRecord,
                   message_dict: dict[str, Any]) -> None:
        log_data["time"] = datetime.fromtimestamp(record.created, tz=timezone.utc).isoformat(
            timespec="milliseconds")
        super().add_fields(log_data, record, message_dict)
        fields = log_data.pop(FIELDS, None)
        if isinstance(fields, dict):
            if "event" in fields:
                log_data["message"] = fields["event"]
            for key, value in fields.items():
                if key not in _CORE:  # never let a field pass for the record's own keys
                    log_data[key] = value


def formatter(fmt: str, worker: int | None = None) -> logging.Formatter:
    """The formatter of one format; a router worker's lines name it (`name[i]` / `worker`)."""
    if fmt == "json":
        return JsonLines({"worker": worker} if worker is not None else None)
    if fmt != "text":
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    name = "%(name)s" if worker is None else f"%(name)s[{worker}]"
    return logging.Formatter(TEXT_FORMAT.replace("%(name)s", name))


def setup_logging(level: str | int, fmt: str = "text", *, stream: TextIO | None = None,
                  worker: int | None = None) -> None:
    """Send every logger of this process to `stream` (stderr) in `fmt`, replacing any set-up.

    With json, Python warnings and uncaught exceptions (main thread and others) are logged
    too, so that nothing this process writes through Python is a bare multi-line traceback.
    """
    global _current
    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(formatter(fmt, worker))
    logging.basicConfig(level=numeric, handlers=[handler], force=True)
    _current = LogSetup(numeric, fmt, worker)
    as_json = fmt == "json"
    logging.captureWarnings(as_json)
    sys.excepthook = _log_uncaught if as_json else sys.__excepthook__
    threading.excepthook = _log_uncaught_in_thread if as_json else threading.__excepthook__


def current() -> LogSetup:
    """This process's set-up (a router worker process repeats its parent's)."""
    return _current


def json_line(logger: str, message: str) -> str:
    """One JSON log line (no newline) written outside the logging set-up: the banner the
    launcher puts in a replica's log before each start, launch's preflight line on stderr."""
    record = logging.LogRecord(logger, logging.INFO, __file__, 0, message, None, None)
    return formatter("json").format(record)


def _log_uncaught(kind: type[BaseException], value: BaseException, tb) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, tb)
        return
    logging.getLogger("omni_dp").critical("uncaught exception", exc_info=(kind, value, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    thread = args.thread.name if args.thread is not None else "?"
    logging.getLogger("omni_dp").critical(
        "uncaught exception in thread %s", thread,
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback))


# --- reading a run's logs (`omni-dp logs`) ------------------------------------------------------
# Hand-written: `tail -n N -F` semantics (whole lines only, a replaced or truncated file
# followed from its start) over several files with a prefix each; no maintained library does
# that, and the standard library's line iteration does the splitting.


def last_lines(file: BinaryIO, count: int, *, whole_only: bool) -> list[bytes]:
    """The last `count` lines of `file` from where it stands, without their newlines; memory
    bounded by `count`. With whole_only an unterminated last line is left unread (the file
    stays positioned before it), so that a follower prints it once it is whole."""
    kept: deque[bytes] = deque(maxlen=count)
    end = file.tell()
    for raw in file:
        if not raw.endswith(b"\n"):
            if whole_only:
                break
            kept.append(raw)
            end += len(raw)
            break
        kept.append(raw[:-1])
        end += len(raw)
    file.seek(end)
    return list(kept)


class Follower:
    """One log file read as it grows, whole lines at a time (`tail -F`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file: BinaryIO = open(path, "rb")  # noqa: SIM115 - closed in close()
        self.partial = b""  # the start of a line whose newline has not been written yet

    def start(self, count: int) -> list[bytes]:
        """The last `count` whole lines written so far."""
        return last_lines(self.file, count, whole_only=True)

    def poll(self) -> list[bytes]:
        """The lines completed since the last call. A file renamed away (the supervisor keeps
        an old replica log aside after an MPS fault) is read to its end first, then the new
        file at the path from its start; a truncated file from its start."""
        lines = self._drain()
        try:
            now = os.stat(self.path)
        except OSError:
            return lines  # not (re)created yet: keep the old one
        mine = os.fstat(self.file.fileno())
        if (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
            if self.partial:  # the old file ended without a newline: that line is complete
                lines.append(self.partial)
                self.partial = b""
            self.file.close()
            self.file = open(self.path, "rb")  # noqa: SIM115 - closed in close()
            lines += self._drain()
        elif now.st_size < self.file.tell():
            self.file.seek(0)
            self.partial = b""
            lines += self._drain()
        return lines

    def close(self) -> None:
        self.file.close()

    def _drain(self) -> list[bytes]:
        chunk = self.file.read()
        if not chunk:
            return []
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        return lines
