"""A day-two change handed from a command (`omni-dp restart`, `omni-dp scale`) to the run's
supervisor, which owns the run and makes the change; one at a time.

The command plans the change (every problem before anything is written: exit 2) — what the
run should be once it is made (runfile.Desired) — and writes `change_request.json` in the run
directory — exclusively: a request already there, or a change still running (`change.json`),
refuses a second one. The supervisor takes the request at its next sweep (renamed to
`change.json`, state "running"), keeps what the change wants in run.json (`desired`), makes it
one step per sweep, each chosen from the run as it is then (changes/desired.py), saying each
step in events.jsonl (`change_*` events carrying the change's id), and records how it ended in
`change.json` ("done" or "failed"). The command follows those events.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from omni_dp.files import atomic_write
from omni_dp.records import Record, Shape
from omni_dp.runfile import Desired, GpuRecord, PlanRecord, ReplicaRecord, RunRecord

REQUEST_FILE = "change_request.json"  # written by the command, taken by the supervisor
CHANGE_FILE = "change.json"  # the change the supervisor took: running, then done or failed
# A request without wait_healthy (written by an omni-dp before it) waits as long as the
# default of a run with the builtin engine's start timeout (300 s) would (plan.wait_bound)
OLD_REQUEST_WAIT_S = 360.0


class ChangeRefused(Exception):
    """A change that cannot be asked for now (another one runs); the message says which."""


StepAction = Literal["restart", "add", "remove"]
ChangeKind = Literal["restart", "scale"]
ChangeState = Literal["requested", "running", "done", "failed"]


@dataclass(frozen=True)
class Relaunch(Record):
    """A restart's new launch of its replica (a model update, a new CPU block)."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    cpus: str | None


def _read_step(data: dict) -> dict:
    """A step's "launch" is a restart's Relaunch, or an added replica's whole record."""
    data["added" if data.get("action") == "add" else "relaunch"] = data.pop("launch", None)
    return data


def _write_step(data: dict) -> dict:
    added, relaunch = data.pop("added"), data.pop("relaunch")
    return {**data, "launch": added if added is not None else relaunch}


@dataclass(frozen=True)
class Step(Record):
    """One step of a change, on one replica:
    - restart: out of the router, drained, stopped, started (with `relaunch`, its new argv/
      env/block, when given), through every gate, back in;
    - add: a new replica (`added`, its whole record), started through the gates, then in;
    - remove: out of the router, drained, stopped, gone from the router and the record.
    Typed whole when the request is read: a step that does not parse refuses the request
    before any step is made."""

    JSON_SHAPE = Shape(read=_read_step, write=_write_step,
                       paths={"relaunch": "launch", "added": "launch"})

    action: StepAction
    replica: int
    relaunch: Relaunch | None = None
    added: ReplicaRecord | None = None

    def __post_init__(self) -> None:
        if (self.action == "add") != (self.added is not None):
            raise ValueError(".launch: an add step, and only one, carries the replica's record")
        if self.added is not None and self.added.index != self.replica:
            raise ValueError(f".launch is replica {self.added.index}'s record, not "
                             f"{self.replica}'s")
        if self.relaunch is not None and self.action != "restart":
            raise ValueError(f".launch: a {self.action} step carries no new launch")


@dataclass(frozen=True)
class ChangeRequest(Record):
    """A change as asked for: what the run should be once it is made (`desired`), and the
    steps that take the run there as it was planned from (`steps`: what the command and
    CHANGE_STARTED show; the supervisor chooses each step from the run as it is then,
    changes/desired.py)."""

    JSON_SHAPE = Shape(omit_none=("desired",))

    kind: ChangeKind
    steps: tuple[Step, ...]
    summary: str  # one line, said by the command and in the events
    drain_timeout: float  # per replica: requests in flight get this long
    plan: PlanRecord | None = None  # the run's plan after the change (None: unchanged)
    gpus: tuple[GpuRecord, ...] | None = None  # the run's GPU slots after a scale
    id: str = field(default_factory=lambda: secrets.token_hex(4))
    by_pid: int = field(default_factory=os.getpid)
    ts: float = field(default_factory=time.time)
    state: ChangeState = "requested"
    error: str | None = None
    # before a step takes its replica out, every other replica must be healthy: waited for at
    # most this long, then the step fails (0: not waited for)
    wait_healthy: float = OLD_REQUEST_WAIT_S
    # the run as the change was planned from it (basis_of); the supervisor makes no step of a
    # change whose run has since changed (None: a request of an omni-dp before it, unchecked)
    basis: str | None = None
    # what the run should be once the change is made (None: a request of an omni-dp before
    # it, its steps alone: changes.desired.desired_of derives it)
    desired: Desired | None = None

    def __post_init__(self) -> None:
        if self.desired is not None and self.desired.change != self.id:
            raise ValueError(f".desired.change is {self.desired.change!r}, not the change's id "
                             f"{self.id!r}")


def basis_of(record: RunRecord) -> str:
    """What a change is planned from, in one word: the run's plan, GPU slots and each replica's
    launch (index, port, argv, env, CPU block, GPU, generation). Only a change alters these,
    so another change that ended between a command's planning and the supervisor's taking
    shows here; health, pids and restarts do not."""
    # as run.json reads back: the command plans from the file, the supervisor may hold the
    # record bring-up made (a 2 there is a 2.0 read back)
    record = RunRecord.from_json(json.loads(json.dumps(record.to_json())))
    shape = {"plan": record.plan.to_json(), "gpus": [g.to_json() for g in record.gpus],
             "replicas": [[r.index, r.port, list(r.argv), dict(r.env), r.cpus, r.gpu]
                          # a generation only once a change made one: a run's basis reads
                          # as an omni-dp before generations wrote it
                          + ([r.generation] if r.generation else [])
                          for r in record.replicas]}
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]


def stale_basis(change: ChangeRequest, record: RunRecord) -> str | None:
    """Why the change must not begin on the run as `record` now is (None: it may): the run is
    no longer the one it was planned from (another change ended meanwhile)."""
    if change.basis is None or change.basis == basis_of(record):
        return None
    return (f"run {record.run_id} changed after this change was planned (another change "
            f"ended meanwhile; it has {len(record.replicas)} replicas now): nothing was done; "
            "ask again")


def read_change(directory: Path, name: str = CHANGE_FILE) -> ChangeRequest | None:
    """The change recorded under `name` (None: none, or one that cannot be read)."""
    try:
        return _read(directory / name)
    except (OSError, ValueError):
        return None


def _read(path: Path) -> ChangeRequest:
    """OSError, or ValueError (Malformed) naming what does not parse."""
    return ChangeRequest.from_json(json.loads(path.read_text()), "change")


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


def take(directory: Path, refused: Callable[[str], None] = lambda why: None
         ) -> ChangeRequest | None:
    """The supervisor's side: the request, now running (None: no request, or one that cannot
    be read — every step typed — which is set aside as failed so the next one may come, and
    `refused` told why, before any step is made)."""
    path = directory / REQUEST_FILE
    if not path.exists():
        return None
    try:
        request = _read(path)
    except (OSError, ValueError) as exc:
        with contextlib.suppress(OSError):
            os.replace(path, directory / f"{REQUEST_FILE}.unreadable")
        refused(f"{path} cannot be read: {exc}")
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
