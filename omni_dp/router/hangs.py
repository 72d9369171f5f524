"""Hung replicas: a replica that took a request and answers nothing in time is checked, and one
that fails the check too is ejected at once, and every request waiting on it let go (to be
resent or resumed elsewhere, as the proxy allows).

Why a check and not the timeout alone: a busy replica (a long buffered answer, a deep queue) is
slow, not hung; ejecting it would move its load onto the others, which would then be slow in
turn. A replica that cannot answer GET /health either is hung (SIGSTOP, a deadlock, a wedged
event loop).

The check runs early enough that its verdict is in by the timeout: it starts at T - c and
may take c = min(--health-timeout, T / 2), so the router lets go of a request on a hung replica
by its timeout T (a resumed stream then waits for another replica to regenerate the answer up
to its offset). A replica that passes is checked again T - c later, if still late. One check
per replica at a time, whatever the number of requests waiting on it.

A replica that fails the check while --max-ejection-percent of the replicas are ejected already
is not ejected (health.record_hang answers False): a flood can make every replica slow to
answer, /health too, and letting go of its requests would only move them onto replicas as
slow. It is waited on as a slow one, and checked again T - c later.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from omni_dp.router.replicas import Ejected, Health, Replica

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # aiohttp depends on async-timeout there
    from async_timeout import timeout as _timeout

# (replica, seconds) -> (answered 200 in time, what happened)
Check = Callable[[Replica, float], Awaitable[tuple[bool, str]]]


class HangTimeout(Exception):
    """The replica waited on is hung (found so now, or earlier): stop waiting on it."""


class _Waiter:
    """One request waiting on one replica: since when (its last byte), and how it is let go.

    `expire` is called once the replica is found hung: the head wait's timeout scope is ended
    (HangTimeout), or the stream's connection closed (`expire_now`; its read fails, `expired`
    says why). A slotted class: one is made per request.
    """

    __slots__ = ("expire_now", "expired", "last", "message", "scope", "timeout_s", "timer",
                 "what")

    def __init__(self, timeout_s: float, what: str, last: float,
                 expire_now: Callable[[], None] | None = None) -> None:
        self.timeout_s = timeout_s
        self.what = what  # "status line", "byte": for the messages
        self.last = last  # loop time the wait began, or of the stream's last byte
        self.expire_now = expire_now
        self.scope = None  # the head wait's timeout scope
        self.timer: asyncio.TimerHandle | None = None
        self.expired = False
        self.message = ""

    def touch(self, now: float) -> None:
        """A byte arrived: the next check is due a whole period from now."""
        self.last = now

    def expire(self, replica: Replica) -> None:
        if self.expired:
            return
        self.expired = True
        self.message = (f"replica {replica.id} is hung: no {self.what} within "
                        f"{self.timeout_s:g} s, and no answer to its health check")
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.scope is not None:
            # async-timeout's scope (Python 3.10) has update() where asyncio's has
            # reschedule(): either ends the scope now.
            end = getattr(self.scope, "reschedule", None) or self.scope.update
            end(asyncio.get_running_loop().time())
        if self.expire_now is not None:
            self.expire_now()


class _NoWatch:
    """A stream with no stall timeout: never expires."""

    expired = False
    message = ""

    def touch(self, now: float) -> None:
        pass


@dataclass
class HangWatch:
    """Waits on replicas under a timeout, and finds hung ones (see the module's docstring)."""

    check: Check  # the replica's health check, with its own timeout
    health_timeout_s: float  # --health-timeout: the longest a check may take
    # ejects the replica (health.record_hang): True if it is out, False if the bound on
    # ejections kept it in
    on_hang: Callable[[Replica, str], bool]
    _waiting: dict[Replica, set[_Waiter]] = field(default_factory=dict)
    _checks: dict[Replica, asyncio.Task] = field(default_factory=dict)

    def check_time(self, timeout_s: float) -> float:
        """How long the check of a replica may take when its waiter's timeout is `timeout_s`."""
        return min(self.health_timeout_s, timeout_s / 2)

    async def wait(self, replica: Replica, timeout_s: float | None, awaitable: Awaitable,
                   what: str):
        """`await awaitable` (an answer's head), unless `replica` is found hung first: then
        HangTimeout. `timeout_s` None or 0: no timeout, a plain await."""
        if not timeout_s:
            return await awaitable
        loop = asyncio.get_running_loop()
        waiter = _Waiter(timeout_s, what, loop.time())
        try:
            async with _timeout(None) as scope:
                waiter.scope = scope
                self._register(loop, replica, waiter)
                try:
                    return await awaitable
                finally:
                    self._unregister(replica, waiter)
        except asyncio.TimeoutError:  # TimeoutError from 3.11 on; async-timeout's before
            if waiter.expired:
                raise HangTimeout(waiter.message) from None
            raise

    @contextlib.contextmanager
    def watch(self, replica: Replica, timeout_s: float | None, what: str,
              cut: Callable[[], None]) -> Iterator[_Waiter | _NoWatch]:
        """An answer's body under a stall timeout: `touch` the watch at every byte; when the
        replica is found hung, `cut()` ends the stream (its next read fails) and the watch
        says `expired`. One timer per answer, moved on lazily: a flowing stream costs one
        attribute write per chunk."""
        if not timeout_s:
            yield _NoWatch()
            return
        loop = asyncio.get_running_loop()
        waiter = _Waiter(timeout_s, what, loop.time(), expire_now=cut)
        self._register(loop, replica, waiter)
        try:
            yield waiter
        finally:
            self._unregister(replica, waiter)

    async def stop(self) -> None:
        checks = list(self._checks.values())
        for task in checks:
            task.cancel()
        await asyncio.gather(*checks, return_exceptions=True)

    # --- inside the loop ----------------------------------------------------------------
    # Register and unregister are plain calls around a try/finally, not a generator context
    # manager: every request's head wait takes them.
    def _register(self, loop: asyncio.AbstractEventLoop, replica: Replica,
                  waiter: _Waiter) -> None:
        waiters = self._waiting.get(replica)
        if waiters is None:
            waiters = self._waiting[replica] = set()
        waiters.add(waiter)
        self._arm(loop, replica, waiter)

    def _unregister(self, replica: Replica, waiter: _Waiter) -> None:
        if waiter.timer is not None:
            waiter.timer.cancel()
        waiters = self._waiting.get(replica)
        if waiters is not None:
            waiters.discard(waiter)
            if not waiters:
                del self._waiting[replica]

    def _arm(self, loop: asyncio.AbstractEventLoop, replica: Replica, waiter: _Waiter) -> None:
        due = waiter.last + waiter.timeout_s - self.check_time(waiter.timeout_s)
        waiter.timer = loop.call_at(due, self._overdue, loop, replica, waiter)

    def _overdue(self, loop: asyncio.AbstractEventLoop, replica: Replica,
                 waiter: _Waiter) -> None:
        waiter.timer = None
        if loop.time() < waiter.last + waiter.timeout_s - self.check_time(waiter.timeout_s):
            self._arm(loop, replica, waiter)  # a byte came meanwhile: not late after all
        elif replica.ejected_reason is Ejected.HANG and replica.health is Health.UNHEALTHY:
            waiter.expire(replica)  # found hung already, by another request's check
        elif replica not in self._checks:
            task = loop.create_task(
                self._run_check(replica, self.check_time(waiter.timeout_s), waiter),
                name=f"hang-check-{replica.id}")
            self._checks[replica] = task

    async def _run_check(self, replica: Replica, seconds: float, first: _Waiter) -> None:
        try:
            ok, reason = await self.check(replica, seconds)
        finally:
            self._checks.pop(replica, None)
        waiting = list(self._waiting.get(replica, ()))
        # Slow, not hung (or hung, but kept in by the bound on ejections): each late waiter is
        # checked again a period from now.
        if ok or not self.on_hang(
                replica, f"no {first.what} within {first.timeout_s:g} s, and {reason}"):
            loop = asyncio.get_running_loop()
            for waiter in waiting:
                if waiter.timer is None and not waiter.expired:
                    waiter.touch(loop.time())
                    self._arm(loop, replica, waiter)
            return
        for waiter in waiting:
            waiter.expire(replica)
