"""Priority classes inside one replica: which queued piece of work goes to a free worker next.

The router forwards each request's class in `X-Omni-DP-Priority` (interactive, default, bulk;
absent = default). The engine keeps its waiting work in one FIFO queue per class and, each
time a worker (a slot of the talker's running batch) is free, asks `PriorityPolicy.select`
which class's oldest item goes next: the highest class that has work, so an interactive
request's work runs before queued default and bulk work.

No starvation: a lower class that waits is passed over at most K - 1 dispatches in a row
(K = --priority-share-every, default 4); the K-th goes to the longest-waiting item of the
classes below the highest. Under a continuous interactive stream bulk still gets at least 1
dispatch in every K, and within a class the order is always FIFO. With every request default
there is one class and the order is the plain FIFO it always was.

The policy is pure bookkeeping (like sglang-router's policies): it never touches the work,
so it is tested alone (tests/engine/test_priority.py) and used by the scheduler.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping

from omni_dp.contract import (
    PRIORITY_NAMES,
    Priority,
    parse_priority,
)
from omni_dp.engine.options import DEFAULT_PRIORITY_SHARE_EVERY

# DEFAULT_PRIORITY_SHARE_EVERY (--priority-share-every) is 4: 1 dispatch in every 4 may go to a
# waiting lower class, so bulk keeps at least a quarter of the workers' turns while it waits,
# and interactive work waits behind at most one lower-class item per 4 it is given.


# Upper bounds (seconds) of omni_dp_queue_wait_seconds' buckets; +Inf is implied.
QUEUE_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class QueueWaits:
    """Each class's histogram of queue waits, as plain numbers: it travels in SchedulerStats
    from a stage process to the front, whose /metrics exports it."""

    def __init__(self) -> None:
        # per class: a count per bucket of QUEUE_WAIT_BUCKETS then +Inf (not cumulative)
        self.counts = {name: [0] * (len(QUEUE_WAIT_BUCKETS) + 1) for name in PRIORITY_NAMES}
        self.sums = {name: 0.0 for name in PRIORITY_NAMES}

    def observe(self, priority: Priority, seconds: float) -> None:
        seconds = max(0.0, seconds)
        self.counts[priority.label][bisect.bisect_left(QUEUE_WAIT_BUCKETS, seconds)] += 1
        self.sums[priority.label] += seconds

    def snapshot(self) -> tuple[dict[str, list[int]], dict[str, float]]:
        return {name: list(c) for name, c in self.counts.items()}, dict(self.sums)


def priority_of(value: str | None) -> Priority:
    """The header's value → its class; absent or empty is default (BadPriority otherwise)."""
    if value is None or not value.strip():
        return Priority.DEFAULT
    return parse_priority(value)


class PriorityPolicy:
    """Chooses the class whose oldest waiting item is dispatched next.

    `select(heads)` takes, for each class with waiting work, the arrival number of its oldest
    item (smaller = older; classes with nothing waiting are left out) and returns the class to
    dispatch from, or None when nothing waits. It changes nothing: the caller calls
    `dispatched(heads, chosen)` once the item really went (a batch that is full or short of
    memory may not take it), which counts the turns the lower classes were passed over.
    """

    def __init__(self, share_every: int = DEFAULT_PRIORITY_SHARE_EVERY) -> None:
        if share_every < 2:
            raise ValueError(f"share_every must be at least 2 (1 would put bulk first), got "
                             f"{share_every}")
        self.share_every = share_every
        self.passed_over = 0  # dispatches in a row that went to the top class while lower waited

    def select(self, heads: Mapping[Priority, int]) -> Priority | None:
        if not heads:
            return None
        top = min(heads, key=int)
        lower = {p: arrival for p, arrival in heads.items() if p is not top}
        if lower and self.passed_over >= self.share_every - 1:
            return min(lower, key=lambda p: lower[p])  # the lower classes' longest waiting
        return top

    def dispatched(self, heads: Mapping[Priority, int], chosen: Priority) -> None:
        """`chosen`'s oldest item went to a worker; `heads` as select saw them."""
        top = min(heads, key=int)
        lower_waited = any(p is not top for p in heads)
        self.passed_over = self.passed_over + 1 if lower_waited and chosen is top else 0
