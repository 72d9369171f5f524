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

Overload is not a fault. A flood can make every replica slow to answer, its /health checks
included, and each would then look failed or hung: ejecting them all would leave the router
nothing to send to. So outlier ejections (failures, hang) are bounded, as Envoy's
max_ejection_percent: one that would leave more than `ejection_bound` replicas ejected at once is
not done (`may_eject`); the replica stays routable, marked `ejection_suppressed`, and is ejected
on a later failure once another one came back. A replica whose port refuses connections (its
process is gone) is not an outlier: it is ejected whatever the bound (Ejected.REFUSED), and does
not count against it; nor do replicas an admin disabled (the supervisor, before a restart).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import random
import time
from collections.abc import Callable

import aiohttp

from omni_dp.router.config import HealthConfig
from omni_dp.router.replicas import Backends, Ejected, Health, Replica

log = logging.getLogger("omni_dp.router.health")


def ejection_bound(replicas: int, percent: int) -> int:
    """How many of `replicas` outlier detection may hold ejected at once under
    --max-ejection-percent: percent of them rounded down, but at least one (Envoy's rule: a host
    is ejected when none is, whatever the percent). 50%: 1 of 1, 1 of 2, 1 of 3, 2 of 4."""
    return max(1, replicas * percent // 100)


def may_eject(ejected: int, replicas: int, percent: int) -> bool:
    """Whether one more outlier ejection is allowed with `ejected` of `replicas` out already."""
    return ejected + 1 <= ejection_bound(replicas, percent)


def connection_refused(exc: BaseException | None) -> bool:
    """The failure is a refused connection (nothing listens: the process is gone), or was
    raised while handling one (the proxy's UpstreamFailed is raised `from None` in the handler
    of aiohttp's ClientConnectorError: its __context__ is that error)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, ConnectionRefusedError):
            return True
        os_error = getattr(exc, "os_error", None)  # aiohttp.ClientConnectorError
        if isinstance(os_error, OSError) and (
                isinstance(os_error, ConnectionRefusedError)
                or os_error.errno == errno.ECONNREFUSED):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def record_failure(replica: Replica, cfg: HealthConfig, reason: str, *,
                   refused: bool = False) -> None:
    """Count one failure; the failure_threshold-th in a row ejects a healthy replica, within
    the bound on ejections unless this failure is a refused connection (`refused`)."""
    replica.consecutive_failures += 1
    replica.consecutive_successes = 0
    replica.last_error = reason
    if replica.health == Health.UNHEALTHY:
        if refused and replica.ejected_reason is not Ejected.REFUSED:
            # out already, and now its process is gone: it no longer holds a share of the bound
            replica.ejected_reason = Ejected.REFUSED
        return
    if replica.health != Health.HEALTHY or replica.consecutive_failures < cfg.failure_threshold:
        return
    if refused:
        _eject(replica, Ejected.REFUSED)
        log.warning("replica %s ejected after %d failures, the last a refused connection: %s",
                    replica.id, replica.consecutive_failures, reason)
    elif _bounded(replica, Ejected.FAILURES, reason):
        _eject(replica, Ejected.FAILURES)
        log.warning("replica %s ejected after %d failures: %s",
                    replica.id, replica.consecutive_failures, reason)


def record_hang(replica: Replica, reason: str) -> bool:
    """The replica took a request and answered nothing in time, nor its /health check: it is
    ejected at once, whatever its count of failures (GET /workers says `hang`), within the
    bound on ejections. True: it is out (its waiters are let go); False: the bound kept it in,
    and it is waited on as a slow one."""
    replica.consecutive_failures += 1
    replica.consecutive_successes = 0
    replica.last_error = reason
    if replica.health == Health.UNHEALTHY:  # already out (its checks failed first)
        if replica.ejected_reason is not Ejected.REFUSED:
            replica.ejected_reason = Ejected.HANG  # now known to be hung
    elif not _bounded(replica, Ejected.HANG, reason):
        return False
    else:
        _eject(replica, Ejected.HANG)
    replica.num_hangs += 1
    log.warning("replica %s ejected: hung (%s)", replica.id, reason)
    return True


def _bounded(replica: Replica, why: Ejected, reason: str) -> bool:
    """Whether the outlier ejection of `replica` is within --max-ejection-percent; if not, it
    is marked, counted and logged as not done."""
    backends = replica.backends
    if backends is None or not backends.holds(replica):
        return True  # outside any set (or removed from it): nothing to keep routable
    ejected, total = backends.outlier_ejected(), len(backends)
    percent = backends.max_ejection_percent
    if may_eject(ejected, total, percent):
        return True
    first = replica.ejection_suppressed is None  # a flood repeats it every check: said once
    replica.ejection_suppressed = why
    replica.num_suppressed += 1
    backends.on_suppressed(replica, why)
    log.log(logging.WARNING if first else logging.DEBUG,
            "replica %s not ejected (%s: %s): %d of %d replicas are ejected already, the most "
            "--max-ejection-percent %d allows; it stays routable",
            replica.id, why.value, reason, ejected, total, percent)
    return False


def _eject(replica: Replica, why: Ejected) -> None:
    replica.health = Health.UNHEALTHY
    replica.num_ejections += 1
    replica.ejected_reason = why
    replica.ejected_at = time.time()
    replica.ejection_suppressed = None


def record_success(replica: Replica, cfg: HealthConfig, *, probe: bool) -> None:
    """A probe passed, or the replica answered a proxied request."""
    replica.consecutive_failures = 0
    replica.ejection_suppressed = None  # answering again: no ejection is due now
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
    replica.ejection_suppressed = None
    replica.readmitted()


async def check(session: aiohttp.ClientSession, replica: Replica, path: str,
                timeout_s: float) -> tuple[bool, str]:
    """One GET of the replica's health path: (it answered 200 in time, what happened)."""
    ok, reason, _ = await _check(session, replica, path, timeout_s)
    return ok, reason


async def _check(session: aiohttp.ClientSession, replica: Replica, path: str,
                 timeout_s: float) -> tuple[bool, str, bool]:
    """`check`, and whether the connection was refused (the process is gone)."""
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.get(replica.url + path, timeout=timeout) as resp:
            await resp.read()
            return resp.status == 200, f"{path} answered {resp.status}", False
    except asyncio.TimeoutError:
        return False, f"{path} did not answer within {timeout_s:g} s", False
    except (aiohttp.ClientError, OSError) as exc:
        return False, f"{path} failed: {type(exc).__name__}: {exc}", connection_refused(exc)


async def probe(session: aiohttp.ClientSession, replica: Replica, cfg: HealthConfig) -> None:
    ok, reason, refused = await _check(session, replica, cfg.path, cfg.timeout_s)
    if ok:
        record_success(replica, cfg, probe=True)
    else:
        record_failure(replica, cfg, reason, refused=refused)


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
