"""The state of one request as the proxy forwards it: what its route log line says, what
reached the client, what budget is left, and how a replica failed it. No I/O here."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from omni_dp.contract import Priority
from omni_dp.logs import FIELDS
from omni_dp.router.audio_slo import RelayedAudio
from omni_dp.router.policies import RequestContext
from omni_dp.router.resume import NOT_RESUMABLE, Continuable, Resume

log = logging.getLogger("omni_dp.router.access")


@dataclass
class RouteRecord:
    """Everything the completion log line says about one request."""

    request_id: str
    method: str
    path: str
    replica: str | None = None  # the replica that answered last
    status: int = 0
    outcome: str = "ok"
    attempts: int = 0  # replicas the request was sent to
    tried: list[str] = field(default_factory=list)  # those replicas, in order
    retries: list[str] = field(default_factory=list)  # why each retry (before the first byte)
    resumes: list[str] = field(default_factory=list)  # why each resume (after it)
    resumed_from: int | None = None  # the byte the last resume started at
    migrations: list[str] = field(default_factory=list)  # why each migration (LLM streams)
    migrated_at: int | None = None  # the tokens the client had at the last migration
    cut: str | None = None  # why an answer cut after its first byte was not continued
    waited_s: float = 0.0  # seconds spent waiting for a replica to go to (--replica-wait)
    priority: str = "default"  # its class (classes.py)
    queued_s: float = 0.0  # seconds spent in its class's queue for an in-flight slot
    preempted: int = 0  # times it was taken back from a replica for an interactive request
    seed: str | None = None  # the seed the answer was sampled with (its X-Seed)
    bytes: int = 0
    ttfb_s: float | None = None
    duration_s: float = 0.0

    def log(self) -> None:
        if log.isEnabledFor(logging.INFO):  # skip the JSON encoding when nobody reads it
            line = {"event": "route", **self.__dict__,
                    "client_disconnected": self.outcome == "client_disconnected"}
            log.info("%s", json.dumps(line, separators=(",", ":")), extra={FIELDS: line})


class UpstreamFailed(Exception):
    """A replica broke the exchange.

    `kind` names what failed (a bounded set: metrics label it); `retryable`: the request may go
    to another replica (before the client's first byte) or be resumed there (after it);
    `failure`: it counts against the replica's health (a replica going away, or one refusing a
    resume, is not broken; a hang was counted when it was found)."""

    def __init__(self, kind: str, detail: str, retryable: bool, failure: bool = True) -> None:
        super().__init__(detail)
        self.kind = kind
        self.retryable = retryable
        self.failure = failure


@dataclass
class Head:
    """The first answer's status line and headers, sent with its first body byte."""

    status: int
    reason: str | None
    headers: CIMultiDict
    content_length: int | None
    bodiless: bool
    sse: bool


@dataclass
class Exchange:
    """One client request across its attempts: what reached the client, what budget is left."""

    request: web.Request
    body: bytes
    headers: CIMultiDict  # what goes upstream
    record: RouteRecord
    ctx: RequestContext
    started: float  # perf_counter, for the route log
    deadline: float  # loop time by which the whole request must be done (--request-timeout)
    retries_left: int
    resumes_left: int
    migrations_left: int = 0
    migration: Continuable | None = None  # an LLM stream's plan (migration.py), or None
    head: Head | None = None
    response: web.StreamResponse | None = None  # set once the head went out to the client
    resume: Resume = NOT_RESUMABLE  # the resume strategy (resume.py), from the first answer
    # Why it goes on to another replica (a failure's kind), until one takes it: only then is
    # the retry, resume or migration counted, so one whose wait ran out is not.
    going_on: str | None = None
    priority: Priority = Priority.DEFAULT
    # Its attempt was cancelled to free its in-flight slot for an interactive request
    # (Router.preempt_bulk): it queues again and goes to a replica it has not tried.
    taken_back: bool = False
    # A speech answer's audio as it reaches the client (audio_slo.py), from its first answer.
    audio: RelayedAudio | None = None
    # Its spans (router/tracing.py's RequestTrace, which imports this module), when the
    # router traces; None otherwise.
    trace: Any = None

    def preemptible(self) -> bool:
        """Nothing of the answer reached the client, nor was it taken back already."""
        return self.response is None and self.record.ttfb_s is None and not self.taken_back

    def time_left(self) -> float:
        return self.deadline - asyncio.get_running_loop().time()

    def continuations_left(self) -> int:
        """What is left of the budget of the answer's kind: migrations or resumes."""
        return self.migrations_left if self.resume.migrates else self.resumes_left
