"""An asyncio loop on a virtual clock, for tests of timing mechanisms that do no I/O.

Its time() stands still while anything is ready to run, and whenever the loop would wait for
its next timer it jumps to it at once. So a test can assert *when*, in loop time, something
happened, exactly, however loaded the machine: real work takes no virtual time, and nothing
waits in real time. Sockets still work (polled without waiting), but a wait on real I/O would
let the clock jump past it: keep these loops to in-memory futures, tasks and timers.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine


class _JumpingSelector(selectors.DefaultSelector):
    """Never waits: what is ready now, else the clock moved on by the wait asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None):
        events = super().select(0)
        if events or timeout == 0:
            return events
        if timeout is None:  # nothing ready and no timer: nothing could ever happen
            raise RuntimeError("the virtual-clock loop has nothing left to run or wait for")
        self.now += timeout
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """A selector loop whose time() is the virtual clock (see the module's docstring)."""

    def __init__(self) -> None:
        self._jumping = _JumpingSelector()
        super().__init__(selector=self._jumping)

    def time(self) -> float:
        return self._jumping.now


def run_virtual(coro: Coroutine, limit_s: float = 3600.0):
    """Run `coro` to its end on a new VirtualClockLoop, bounded by `limit_s` virtual seconds
    (a test that would wait for ever fails at once instead)."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(asyncio.wait_for(coro, limit_s))
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
