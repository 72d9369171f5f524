"""A day-two change handed from a command (`omni-dp restart`, `omni-dp scale`) to the run's
supervisor, which owns the run and makes the change; one at a time.

The command plans the change (every problem before anything is written: exit 2) and writes
`change_request.json` in the run directory — exclusively: a request already there, or a
change still running (`change.json`), refuses a second one. The supervisor takes the request at
its next sweep (renamed to `change.json`, state "running"), makes it step by step, saying each
step in events.jsonl (`change_*` events carrying the change's id), and records how it ended in
`change.json` ("done" or "failed"). The command follows those events.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from omni_dp.files import atomic_write
from omni_dp.jsonfields import JsonFields, Malformed

REQUEST_FILE = "change_request.json"  # written by the command, taken by the supervisor
CHANGE_FILE = "change.json"  # the change the supervisor took: running, then done or failed
KINDS = ("restart", "scale")
# A request without wait_healthy (written by an omni-dp before it) waits as long as the
# default of a run with the builtin engine's start timeout (300 s) would (plan.wait_bound)
OLD_REQUEST_WAIT_S = 360.0


class ChangeRefused(Exception):
    """A change that cannot be asked for now (another one runs); the message says which."""


@dataclass(frozen=True)
class Step:
    """One step of a change, on one replica:
    - restart: out of the router, drained, stopped, started (with `launch`, its new argv/env/
      block, when given), through every gate, back in;
    - add: a new replica (`launch` is its whole record), started through the gates, then in;
    - remove: out of the router, drained, stopped, gone from the router and the record."""

    action: str  # restart | add | remove
    replica: int
    launch: dict | None = None  # restart: {"argv", "env", "cpus"}; add: the replica's record

    def to_json(self) -> dict:
        return {"action": self.action, "replica": self.replica, "launch": self.launch}

    @classmethod
    def from_json(cls, f: JsonFields) -> Step:
        action = f.str("action")
        if action not in ("restart", "add", "remove"):
            raise Malformed(f"{f.path('action')} is {action!r}, not restart, add or remove")
        launch = f.object("launch", optional=True)
        return cls(action, f.int("replica"), dict(launch.data) if launch else None)


@dataclass(frozen=True)
class ChangeRequest:
    kind: str  # restart | scale
    steps: tuple[Step, ...]
    summary: str  # one line, said by the command and in the events
    drain_timeout: float  # per replica: requests in flight get this long
    plan: dict | None = None  # the run.json plan after the change (None: unchanged)
    gpus: list | None = None  # the run.json gpus after a scale
    id: str = field(default_factory=lambda: secrets.token_hex(4))
    by_pid: int = field(default_factory=os.getpid)
    ts: float = field(default_factory=time.time)
    state: str = "requested"  # requested | running | done | failed
    error: str | None = None
    # before a step takes its replica out, every other replica must be healthy: waited for at
    # most this long, then the step fails (0: not waited for)
    wait_healthy: float = OLD_REQUEST_WAIT_S

    def to_json(self) -> dict:
        return {"id": self.id, "kind": self.kind, "summary": self.summary,
                "steps": [s.to_json() for s in self.steps], "drain_timeout": self.drain_timeout,
                "wait_healthy": self.wait_healthy, "plan": self.plan, "gpus": self.gpus,
                "by_pid": self.by_pid, "ts": self.ts, "state": self.state, "error": self.error}

    @classmethod
    def from_json(cls, data: object) -> ChangeRequest:
        f = JsonFields(data, "change")
        kind = f.str("kind")
        if kind not in KINDS:
            raise Malformed(f"change.kind is {kind!r}, not one of {', '.join(KINDS)}")
        plan = f.object("plan", optional=True)
        gpus = f.items("gpus", None) if f.data.get("gpus") is not None else None
        return cls(kind, tuple(Step.from_json(s) for s in f.items("steps")), f.str("summary"),
                   f.number("drain_timeout"), dict(plan.data) if plan else None,
                   [dict(g.data) for g in gpus] if gpus is not None else None, f.str("id"),
                   f.int("by_pid"), f.number("ts"), f.str("state"),
                   f.str("error", None, optional=True),
                   wait_healthy=f.number("wait_healthy", OLD_REQUEST_WAIT_S))


def read_change(directory: Path, name: str = CHANGE_FILE) -> ChangeRequest | None:
    """The change recorded under `name` (None: none, or one that cannot be read)."""
    try:
        return ChangeRequest.from_json(json.loads((directory / name).read_text()))
    except (OSError, ValueError, Malformed):
        return None


def submit(directory: Path, request: ChangeRequest) -> None:
    """Hand the request over; ChangeRefused when one is already asked for or running."""
    running = read_change(directory)
    if running is not None and running.state == "running":
        raise ChangeRefused(f"change {running.id} ({running.summary}) is still running; wait "
                            "for it to end")
    tmp = directory / f".{REQUEST_FILE}.{request.id}"
    atomic_write(tmp, json.dumps(request.to_json()) + "\n")
    try:
        os.link(tmp, directory / REQUEST_FILE)  # fails if there is one: never two at once
    except FileExistsError:
        pending = read_change(directory, REQUEST_FILE)
        raise ChangeRefused("another change is already asked for" + (
            f" ({pending.summary}, id {pending.id})" if pending else "")) from None
    finally:
        tmp.unlink(missing_ok=True)


def take(directory: Path) -> ChangeRequest | None:
    """The supervisor's side: the request, now running (None: no request, or one that cannot
    be read, which is set aside as failed so the next one may come)."""
    path = directory / REQUEST_FILE
    if not path.exists():
        return None
    request = read_change(directory, REQUEST_FILE)
    if request is None:
        with contextlib.suppress(OSError):
            os.replace(path, directory / f"{REQUEST_FILE}.unreadable")
        return None
    running = replace(request, state="running")
    atomic_write(directory / CHANGE_FILE, json.dumps(running.to_json()) + "\n")
    path.unlink(missing_ok=True)
    return running


def finish(directory: Path, request: ChangeRequest, error: str | None) -> ChangeRequest:
    """Record how the change ended."""
    ended = replace(request, state="failed" if error else "done", error=error)
    if directory.is_dir():
        atomic_write(directory / CHANGE_FILE, json.dumps(ended.to_json()) + "\n")
    return ended
