"""The asking command's side of a day-two change: hand it to the run's supervisor, then follow it
in events.jsonl until it ended, saying each replica's progress as it comes.

The supervisor takes a request at its next sweep; one that nobody takes (the supervisor gone, or
stuck) is withdrawn after TAKE_TIMEOUT (never left to surprise the next supervisor), said. A
supervisor that dies mid-change ends the following with that said (the supervisor that takes
the run over goes on with the change: supervision/takeover.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from omni_dp.launcher.changes.request import (
    CHANGE_FILE,
    REQUEST_FILE,
    ChangeRequest,
    read_change,
    submit,
)
from omni_dp.launcher.record.events import Event
from omni_dp.launcher.record.state import EVENTS_FILE
from omni_dp.procs import ProcessIdentity, is_alive

TAKE_TIMEOUT_S = 30.0  # beyond a sweep interval or two: the supervisor did not take it
POLL_S = 0.2


@dataclass
class Outcome:
    change: ChangeRequest
    ok: bool
    error: str | None = None
    steps: list[dict] = field(default_factory=list)  # each step's action, replica, seconds
    seconds: float = 0.0
    # stopped while the router had not taken them out: no drain, whatever it still sent them
    # was cut or retried by the router
    stopped_in_router: list[int] = field(default_factory=list)
    # each step that found other replicas not healthy: whom, and how long it waited for them
    # (waited false: --wait-healthy 0, taken out without waiting)
    waits: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"id": self.change.id, "kind": self.change.kind, "summary": self.change.summary,
                "ok": self.ok, "error": self.error, "steps": self.steps,
                "stopped_in_router": self.stopped_in_router, "waits": self.waits,
                "seconds": round(self.seconds, 2)}

    def note(self, event: dict) -> None:
        """What the --json outcome keeps of one of the change's events."""
        name = event.get("event")
        if name == Event.CHANGE_STEP_DONE:
            self.steps.append({k: event.get(k) for k in ("action", "replica", "seconds")})
        if name == Event.CHANGE_DRAINED and not event.get("out_of_router"):
            self.stopped_in_router.append(event.get("replica"))
        if name == Event.CHANGE_WAITED:
            self.waits.append({"replica": event.get("replica"), "others": event.get("others"),
                               "seconds": event.get("seconds"), "waited": True})
        if name == Event.CHANGE_NOT_WAITING:
            self.waits.append({"replica": event.get("replica"),
                               "others": [o.get("replica") for o in event.get("others") or []],
                               "seconds": 0.0, "waited": False})


class EventTail:
    """The lines appended to events.jsonl since it was opened, whole lines only."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0
        self.partial = b""

    def read(self) -> list[dict]:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        found = []
        for line in lines:
            try:
                found.append(json.loads(line))
            except ValueError:
                continue
        return found


def _drained(event: dict) -> str:
    """What taking a replica out before its stop came to: out and drained, out and still busy,
    or — the router refused or did not answer — not out at all, so not drained either."""
    i, seconds = event.get("replica"), event.get("seconds")
    if not event.get("out_of_router"):
        return (f"replica {i}: NOT out of the router ({event.get('error') or 'no reason recorded'}"
                "); stopped without a drain: what the router still sends it is cut or retried")
    if event.get("drained"):
        return f"replica {i}: out of the router, drained in {seconds} s"
    return f"replica {i}: out of the router, still busy after {seconds} s: the stop drains the rest"


def _replicas(indices: object) -> str:
    listed = indices if isinstance(indices, list) else []
    return ("replica " if len(listed) == 1 else "replicas ") + ", ".join(map(str, listed))


def _others(event: dict) -> str:
    """The replicas a step found not healthy, each with why: "replica 0 (restarting)"."""
    others = [o for o in event.get("others") or [] if isinstance(o, dict)]
    return ("replica " if len(others) == 1 else "replicas ") + ", ".join(
        f"{o.get('replica')} ({o.get('why')})" for o in others)


def _waiting(event: dict) -> str:
    out = ", ".join(map(str, event.get("taking_out") or []))
    bound = event.get("bound_s")
    return (f"replica {event.get('replica')}: waiting for {_others(event)} to be healthy before "
            f"taking {out} out (at most "
            f"{f'{bound:g}' if isinstance(bound, (int, float)) else bound} s)")


def _waited(event: dict) -> str:
    out = ", ".join(map(str, event.get("taking_out") or []))
    return (f"replica {event.get('replica')}: {_replicas(event.get('others'))} healthy again "
            f"after {event.get('seconds')} s; taking {out} out")


def _not_waiting(event: dict) -> str:
    out = ", ".join(map(str, event.get("taking_out") or []))
    are = "is" if len(event.get("others") or []) == 1 else "are"
    return (f"replica {event.get('replica')}: taking {out} out although {_others(event)} "
            f"{are} not healthy (--wait-healthy 0)")


def describe(event: dict) -> str | None:
    """A progress line for one event of the change (None: not one to say)."""
    name, i = event.get("event"), event.get("replica")
    lines: dict[Event, Callable[[], str | None]] = {
        Event.CHANGE_STEP: lambda: f"step {event['step']}: {event['action']} replica {i}",
        Event.CHANGE_WAITING: lambda: _waiting(event),
        Event.CHANGE_WAITED: lambda: _waited(event),
        Event.CHANGE_NOT_WAITING: lambda: _not_waiting(event),
        Event.CHANGE_DRAINED: lambda: _drained(event),
        Event.RESTART_COMPLETED: lambda: f"replica {i}: passed its gates "
                                         f"({', '.join(event.get('gates') or [])}), "
                                         + ("back in the router" if event.get("in_router")
                                            else "NOT back in the router"),
        Event.RESTART_FAILED: lambda: f"replica {i}: failed: {event.get('error')}",
        Event.ROUTER_ADDED: lambda: f"replica {i}: in the router (out of rotation until its "
                                    "gates)",
        Event.ROUTER_REMOVED: lambda: f"replica {i}: out of the router for good",
        Event.ROUTER_ADMIN_FAILED: lambda: (f"replica {i}: warning: {event.get('error')}"
                                            if event.get("action") == "removed" else None),
        Event.CHANGE_STEP_DONE: lambda: f"step {event['step']} done in {event['seconds']} s",
    }
    say = lines.get(name)
    return say() if say else None


def ask_and_follow(directory: Path, request: ChangeRequest, supervisor: ProcessIdentity | None,
                   say: Callable[[str], None]) -> Outcome:
    """Submit (ChangeRefused when another change is asked for or running), then follow."""
    tail = EventTail(directory / EVENTS_FILE)
    started = time.monotonic()
    submit(directory, request)
    say(f"asked the run's supervisor for change {request.id}: {request.summary}")
    if not _taken(directory, request, supervisor):
        return Outcome(request, False, "the run's supervisor did not take the change within "
                       f"{TAKE_TIMEOUT_S:.0f} s (is it running? `omni-dp status`); withdrawn")
    outcome = Outcome(request, False)
    while True:
        for event in tail.read():
            if event.get("change") not in (None, request.id):
                continue
            outcome.note(event)
            line = describe(event)  # a restart's own events carry no change id: said too
            if line:
                say(line)
            if event.get("event") in (Event.CHANGE_DONE, Event.CHANGE_FAILED) and \
                    event.get("change") == request.id:
                outcome.ok = event["event"] == Event.CHANGE_DONE
                outcome.error = event.get("error")
                outcome.seconds = time.monotonic() - started
                return outcome
        if supervisor is not None and not is_alive(supervisor):
            ended = read_change(directory)
            if ended is not None and ended.id == request.id and ended.state in ("done", "failed"):
                return Outcome(request, ended.state == "done", ended.error, outcome.steps,
                               time.monotonic() - started, outcome.stopped_in_router,
                               outcome.waits)
            outcome.error = ("the run's supervisor is gone; the change did not end (`omni-dp "
                             "supervise` takes the run over and goes on with it)")
            return outcome
        time.sleep(POLL_S)


def _taken(directory: Path, request: ChangeRequest, supervisor: ProcessIdentity | None) -> bool:
    deadline = time.monotonic() + TAKE_TIMEOUT_S
    while time.monotonic() < deadline:
        taken = read_change(directory)
        if taken is not None and taken.id == request.id:
            return True
        if supervisor is not None and not is_alive(supervisor):
            break
        time.sleep(POLL_S)
    pending = read_change(directory, REQUEST_FILE)
    if pending is not None and pending.id == request.id:
        (directory / REQUEST_FILE).unlink(missing_ok=True)
    taken = read_change(directory, CHANGE_FILE)  # taken as the request was withdrawn
    return taken is not None and taken.id == request.id
