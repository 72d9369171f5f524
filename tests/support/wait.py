"""Waiting until something holds, with a deadline: an AssertionError naming what never came.

`wait_for` blocks (processes, files, HTTP); `until` is the same inside a test's event loop
(support.router's in-process servers), polling every 5 ms unless told otherwise.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_for(what: str, check: Callable[[], object], timeout: float,
             interval: float = 0.2) -> object:
    """Poll check() until it returns something truthy (returned); AssertionError naming
    `what` if not within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} "
                                 f"(last: {last!r})")
        time.sleep(interval)


async def until(predicate: Callable[[], object], timeout: float = 3.0, what: str = "",
                interval: float = 0.005) -> None:
    """Poll `predicate` every `interval` seconds until it holds; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        await asyncio.sleep(interval)
