"""A voice's sentences wait here, by priority class, for one of its workers.

A Piper voice speaks one sentence per call on a fixed number of workers (threads here, or
those of its stage processes). Their own queues are FIFO: a bulk request's queued sentences
would run before an interactive request's. So a sentence first takes a slot here (as many
slots as workers) and is only then handed to a worker; when every slot is taken it waits in
its class's FIFO queue, and each freed slot goes to the class engine/priority.py's policy
selects. The event loop's thread is the only one that touches a gate.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass

from omni_dp.contract import Priority
from omni_dp.engine.priority import PriorityPolicy, QueueWaits


@dataclass
class _Waiter:
    arrival: int
    granted: asyncio.Future
    queued_at: float


class PriorityGate:
    def __init__(self, slots: int, share_every: int) -> None:
        if slots < 1:
            raise ValueError(f"a gate needs at least 1 slot, got {slots}")
        self.free = slots
        self.queues: dict[Priority, deque[_Waiter]] = {p: deque() for p in Priority}
        self.policy = PriorityPolicy(share_every)
        self.waits = QueueWaits()
        self._arrivals = itertools.count()

    def depth(self) -> dict[str, int]:
        return {p.label: len(queue) for p, queue in self.queues.items()}

    async def acquire(self, priority: Priority) -> None:
        """Until a slot is this caller's; it must call release() once its work is done. A
        caller cancelled while it waits leaves the queue (or gives back the slot it got)."""
        if self.free > 0 and not any(self.queues.values()):
            self.free -= 1
            self.waits.observe(priority, 0.0)
            return
        waiter = _Waiter(next(self._arrivals), asyncio.get_running_loop().create_future(),
                         time.monotonic())
        self.queues[priority].append(waiter)
        try:
            await waiter.granted
        except asyncio.CancelledError:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self.release()  # granted as it was cancelled: the slot goes on
            else:
                self.queues[priority].remove(waiter)
            raise
        self.waits.observe(priority, time.monotonic() - waiter.queued_at)

    def release(self) -> None:
        self.free += 1
        while self.free > 0:
            heads = {p: queue[0].arrival for p, queue in self.queues.items() if queue}
            chosen = self.policy.select(heads)
            if chosen is None:
                return
            waiter = self.queues[chosen].popleft()
            self.policy.dispatched(heads, chosen)
            self.free -= 1
            waiter.granted.set_result(None)
