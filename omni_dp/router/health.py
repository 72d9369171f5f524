"""Replica health: active /health probes and passive failure signals, one state machine.

unknown --1 success--> healthy --failure_threshold failures--> unhealthy (ejected)
unhealthy --success_threshold successful probes--> healthy
Failures are consecutive failed probes, or connection errors / 502 / 504 while proxying; any
other answer from a replica (4xx, 429, 503, ordinary 500) is a working replica, not a failure.
Every such answer but 503 also clears the failures counted so far; a 503 leaves them as they
are, so checks that fail keep counting however much traffic a replica answers with 503.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable

import aiohttp

from omni_dp.router.config import HealthConfig
from omni_dp.router.replicas import Backends, Health, Replica

log = logging.getLogger("omni_dp.router.health")


def record_failure(replica: Replica, cfg: HealthConfig, reason: str) -> None:
    """Count one failure; the failure_threshold-th in a row ejects a healthy replica."""
    replica.consecutive_failures += 1
    replica.consecutive_successes = 0
    replica.last_error = reason
    if replica.health == Health.HEALTHY and replica.consecutive_failures >= cfg.failure_threshold:
        replica.health = Health.UNHEALTHY
        replica.num_ejections += 1
        log.warning("replica %s ejected after %d failures: %s",
                    replica.id, replica.consecutive_failures, reason)


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


def mark_healthy(replica: Replica) -> None:
    """Routable now, whatever the probes said: for a replica proven by a stronger check."""
    replica.health = Health.HEALTHY
    replica.consecutive_failures = 0
    replica.consecutive_successes = 0
    replica.last_error = None


async def probe(session: aiohttp.ClientSession, replica: Replica, cfg: HealthConfig) -> None:
    try:
        timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
        async with session.get(replica.url + cfg.path, timeout=timeout) as resp:
            await resp.read()
            ok, reason = resp.status == 200, f"{cfg.path} answered {resp.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        ok, reason = False, f"{cfg.path} failed: {type(exc).__name__}: {exc}"
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
