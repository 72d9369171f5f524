"""Replica health: active /health probes and passive failure signals, one state machine.

unknown --1 success--> healthy --failure_threshold failures--> unhealthy (ejected)
healthy --found hung (hangs.py: no answer in time, then a failed check)--> unhealthy (ejected)
unhealthy --success_threshold successful probes--> healthy
Each way into healthy (and an admin's enable, mark_healthy) is a new generation of the replica
(Replica.readmitted): requests that tried it before may go to it again, and those waiting for
a replica are woken.
Failures are consecutive failed probes, or connection errors / 502 / 504 while proxying; any
other answer from a replica (4xx, 429, 503, ordinary 500) is a working replica, not a failure.
Every such answer but 503 also clears the failures counted so far; a 503 leaves them as they
are, so checks that fail keep counting however much traffic a replica answers with 503.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable

import aiohttp

from omni_dp.router.config import HealthConfig
from omni_dp.router.replicas import Backends, Ejected, Health, Replica

log = logging.getLogger("omni_dp.router.health")


def record_failure(replica: Replica, cfg: HealthConfig, reason: str) -> None:
    """Count one failure; the failure_threshold-th in a row ejects a healthy replica."""
    replica.consecutive_failures += 1
    replica.consecutive_successes = 0
    replica.last_error = reason
    if replica.health == Health.HEALTHY and replica.consecutive_failures >= cfg.failure_threshold:
        _eject(replica, Ejected.FAILURES)
        log.warning("replica %s ejected after %d failures: %s",
                    replica.id, replica.consecutive_failures, reason)


def record_hang(replica: Replica, reason: str) -> None:
    """The replica took a request and answered nothing in time, nor its /health check: it is
    ejected at once, whatever its count of failures (GET /workers says `hang`)."""
    replica.consecutive_failures += 1
    replica.consecutive_successes = 0
    replica.last_error = reason
    replica.num_hangs += 1
    if replica.health != Health.UNHEALTHY:
        _eject(replica, Ejected.HANG)
    else:  # already out (its checks failed first): now known to be hung
        replica.ejected_reason = Ejected.HANG
    log.warning("replica %s ejected: hung (%s)", replica.id, reason)


def _eject(replica: Replica, why: Ejected) -> None:
    replica.health = Health.UNHEALTHY
    replica.num_ejections += 1
    replica.ejected_reason = why
    replica.ejected_at = time.time()


def record_success(replica: Replica, cfg: HealthConfig, *, probe: bool) -> None:
    """A probe passed, or the replica answered a proxied request."""
    replica.consecutive_failures = 0
    if not probe:
        return  # traffic only reaches routable replicas; re-admission is the probes' call
    replica.consecutive_successes += 1
    if replica.health == Health.UNKNOWN or (
        replica.health == Health.UNHEALTHY
        and replica.consecutive_successes >= cfg.success_threshold
    ):
        if replica.health == Health.UNHEALTHY:
            log.info("replica %s re-admitted after %d successful checks",
                     replica.id, replica.consecutive_successes)
        replica.health = Health.HEALTHY
        replica.last_error = None
        replica.ejected_reason = replica.ejected_at = None
        replica.readmitted()


def mark_healthy(replica: Replica) -> None:
    """Routable now, whatever the probes said: for a replica proven by a stronger check."""
    replica.health = Health.HEALTHY
    replica.consecutive_failures = 0
    replica.consecutive_successes = 0
    replica.last_error = None
    replica.ejected_reason = replica.ejected_at = None
    replica.readmitted()


async def check(session: aiohttp.ClientSession, replica: Replica, path: str,
                timeout_s: float) -> tuple[bool, str]:
    """One GET of the replica's health path: (it answered 200 in time, what happened)."""
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.get(replica.url + path, timeout=timeout) as resp:
            await resp.read()
            return resp.status == 200, f"{path} answered {resp.status}"
    except asyncio.TimeoutError:
        return False, f"{path} did not answer within {timeout_s:g} s"
    except (aiohttp.ClientError, OSError) as exc:
        return False, f"{path} failed: {type(exc).__name__}: {exc}"


async def probe(session: aiohttp.ClientSession, replica: Replica, cfg: HealthConfig) -> None:
    ok, reason = await check(session, replica, cfg.path, cfg.timeout_s)
    if ok:
        record_success(replica, cfg, probe=True)
    else:
        record_failure(replica, cfg, reason)


class HealthChecker:
    """Probes every replica every interval (with jitter) until stopped."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        replicas: Callable[[], Backends],
        cfg: HealthConfig,
        rng: random.Random | None = None,
    ) -> None:
        self.session = session
        self.replicas = replicas  # read at each round: the set is replaced on every change
        self.cfg = cfg
        self.rng = rng or random.Random()
        self._task: asyncio.Task | None = None

    async def check_all(self) -> None:
        backends: Backends = self.replicas()
        await asyncio.gather(*(probe(self.session, r, self.cfg) for r in backends))

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="health-checker")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await self.check_all()
            spread = self.cfg.jitter
            await asyncio.sleep(self.cfg.interval_s * self.rng.uniform(1 - spread, 1 + spread))
