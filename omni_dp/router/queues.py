"""The queues where requests wait for an in-flight slot, one per priority class.

A slot freed goes to the head of the first class queue that may take it: interactive, then
default, then bulk (FIFO inside a class). The slot is handed over, not announced: the waiter
is counted as granted at once (`Router.num_granted`), so a request arriving in between cannot
take it first. A preempted bulk request goes back to the head of its queue.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from omni_dp.contract import Priority

GRANTED = "granted"
STOPPING = "stopping"


class ClassQueues:
    """FIFO queues of waiters (futures resolved with GRANTED or STOPPING), one per class."""

    def __init__(self, on_depth: Callable[[Priority, int], None]) -> None:
        """`on_depth(class, depth)`: called whenever a queue's depth changes (the gauge)."""
        self._queues: dict[Priority, deque[asyncio.Future]] = {p: deque() for p in Priority}
        self._on_depth = on_depth

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    def depth(self, priority: Priority) -> int:
        return len(self._queues[priority])

    def ahead_of(self, priority: Priority) -> bool:
        """Whether a request of this class or a higher one is waiting (a newcomer queues
        behind it)."""
        return any(self._queues[p] for p in Priority if p <= priority)

    def push(self, priority: Priority, *, head: bool = False) -> asyncio.Future:
        waiter = asyncio.get_running_loop().create_future()
        queue = self._queues[priority]
        if head:
            queue.appendleft(waiter)
        else:
            queue.append(waiter)
        self._on_depth(priority, len(queue))
        return waiter

    def discard(self, priority: Priority, waiter: asyncio.Future) -> None:
        """Take out a waiter that stops waiting (timed out, or its client left)."""
        queue = self._queues[priority]
        if waiter in queue:
            queue.remove(waiter)
            self._on_depth(priority, len(queue))

    def grant(self, take_slot: Callable[[Priority], bool]) -> int:
        """Hand free slots to the heads of the queues in class order; how many were handed.
        `take_slot(class)` takes a slot for a request of that class if one is free.

        A class whose head gets no slot blocks the classes after it: a slot kept for
        interactive requests is never taken by the bulk request behind them.
        """
        handed = 0
        for priority in Priority:
            queue = self._queues[priority]
            while queue:
                if queue[0].done():  # its task was cancelled and has not taken it out yet
                    queue.popleft()
                    continue
                if not take_slot(priority):
                    break
                queue.popleft().set_result(GRANTED)
                handed += 1
            self._on_depth(priority, len(queue))
            if queue:
                break
        return handed

    def stop_all(self) -> None:
        """The router begins stopping: every waiter is answered (503, going away)."""
        for priority, queue in self._queues.items():
            while queue:
                queue.popleft().set_result(STOPPING)
            self._on_depth(priority, 0)
