"""Priority classes inside a replica: the pure policy (engine/priority.py), the header's
parsing, and the talker scheduler's admission order by class (engine/scheduler.py)."""

from __future__ import annotations

from collections import deque

import pytest
from test_scheduler import check_invariants, make_request, make_scheduler, step

from omni_dp.contract import PRIORITY_HEADER, BadPriority, Priority
from omni_dp.engine.options import ServeOptions
from omni_dp.engine.plan import ServePlanError, plan_serve
from omni_dp.engine.priority import QUEUE_WAIT_BUCKETS, PriorityPolicy, priority_of

HI, MID, LO = Priority.INTERACTIVE, Priority.DEFAULT, Priority.BULK


def drain(policy: PriorityPolicy, queues: dict[Priority, deque[int]], count: int) -> list[int]:
    """Dispatch `count` items (their arrival numbers) as a busy replica would, one per turn."""
    out = []
    for _ in range(count):
        heads = {p: q[0] for p, q in queues.items() if q}
        chosen = policy.select(heads)
        if chosen is None:
            break
        out.append(queues[chosen].popleft())
        policy.dispatched(heads, chosen)
    return out


def test_interactive_goes_before_queued_bulk_and_default_fifo_within_a_class():
    # bulk 0, 1, 2 queued first, default 3, 4, then interactive 5, 6
    queues = {HI: deque([5, 6]), MID: deque([3, 4]), LO: deque([0, 1, 2])}
    policy = PriorityPolicy(share_every=100)  # no share within these few turns
    assert drain(policy, queues, 7) == [5, 6, 3, 4, 0, 1, 2]


def test_all_default_is_plain_fifo():
    queues = {MID: deque(range(10))}
    assert drain(PriorityPolicy(2), queues, 10) == list(range(10))


def test_nothing_waiting_selects_nothing():
    assert PriorityPolicy().select({}) is None


def test_bulk_keeps_one_turn_in_every_k_under_a_continuous_interactive_stream():
    k = 4
    policy = PriorityPolicy(share_every=k)
    bulk = deque(range(1000, 1010))  # queued long before any interactive request
    interactive: deque[int] = deque()
    order: list[str] = []
    for arrival in range(40):  # a new interactive item arrives every turn: never empty
        interactive.append(arrival)
        heads = {p: q[0] for p, q in ((HI, interactive), (LO, bulk)) if q}
        chosen = policy.select(heads)
        assert chosen is not None
        (interactive if chosen is HI else bulk).popleft()
        policy.dispatched(heads, chosen)
        order.append(chosen.label)
    for start in range(len(order) - k + 1):  # every window of k turns has a bulk one
        assert "bulk" in order[start:start + k], order
    assert order.count("bulk") == 10 - len(bulk) == len(order) // k


def test_the_share_goes_to_the_longest_waiting_lower_class():
    policy = PriorityPolicy(share_every=2)
    heads = {HI: 50, MID: 20, LO: 10}  # the bulk item has waited longest
    assert policy.select(heads) is HI
    policy.dispatched(heads, HI)
    assert policy.select(heads) is LO
    policy.dispatched(heads, LO)
    assert policy.select(heads) is HI  # the count starts again


def test_a_selection_not_dispatched_changes_nothing():
    policy = PriorityPolicy(share_every=2)
    heads = {HI: 5, LO: 1}
    for _ in range(5):  # e.g. the batch is full: select is asked again and again
        assert policy.select(heads) is HI


def test_share_every_below_two_is_refused():
    with pytest.raises(ValueError, match="at least 2"):
        PriorityPolicy(1)


@pytest.mark.parametrize(("value", "expected"), [
    (None, MID), ("", MID), ("interactive", HI), ("default", MID), ("bulk", LO), (" Bulk ", LO),
])
def test_header_values(value, expected):
    assert priority_of(value) is expected


def test_unknown_header_value_names_the_header_and_the_classes():
    with pytest.raises(BadPriority) as caught:
        priority_of("urgent")
    message = str(caught.value)
    assert PRIORITY_HEADER in message and "urgent" in message
    assert all(name in message for name in ("interactive", "default", "bulk"))


# --- the talker scheduler ----------------------------------------------------------------------


def classed(request_id: str, priority: Priority):
    request = make_request(request_id, 6, max_new_tokens=4)
    request.priority = priority
    return request


def admitted(output) -> list[str]:
    return [item.request.request_id for item in output.scheduled
            if item.num_new_tokens > 1]


def test_scheduler_admits_the_interactive_request_before_queued_bulk_ones():
    scheduler = make_scheduler(64, max_running=1)
    scheduler.add_request(classed("b0", LO))
    assert admitted(step(scheduler)[0]) == ["b0"]  # the one worker is busy
    for name in ("b1", "b2", "d1"):
        scheduler.add_request(classed(name, LO if name.startswith("b") else MID))
    scheduler.add_request(classed("i1", HI))
    assert [r.request_id for r in scheduler.waiting] == ["i1", "d1", "b1", "b2"]
    assert scheduler.stats().queue_depth == {"interactive": 1, "default": 1, "bulk": 2}
    order = []
    while scheduler.has_requests():
        output, _ = step(scheduler)
        order += admitted(output)
    assert order == ["i1", "d1", "b1", "b2"]
    check_invariants(scheduler)


def test_scheduler_counts_each_requests_first_wait_by_class():
    scheduler = make_scheduler(64, max_running=1)
    scheduler.add_request(classed("b0", LO))
    scheduler.add_request(classed("i0", HI))
    while scheduler.has_requests():
        step(scheduler)
    stats = scheduler.stats()
    assert len(stats.queue_wait_counts["bulk"]) == len(QUEUE_WAIT_BUCKETS) + 1
    assert sum(stats.queue_wait_counts["bulk"]) == 1
    assert sum(stats.queue_wait_counts["interactive"]) == 1
    assert sum(stats.queue_wait_counts["default"]) == 0
    assert stats.queue_depth == {"interactive": 0, "default": 0, "bulk": 0}


def test_scheduler_gives_bulk_its_share_under_a_continuous_interactive_stream():
    """One slot; three bulk requests wait while an interactive one arrives for every admission:
    every 4th admission (the default --priority-share-every) is the oldest bulk request."""
    scheduler = make_scheduler(64, max_running=1)
    for index in range(3):
        scheduler.add_request(classed(f"b{index}", LO))
    order: list[str] = []
    arrivals = 0
    while len(order) < 12:
        if not scheduler.queues[HI]:  # the stream never runs dry
            scheduler.add_request(classed(f"i{arrivals}", HI))
            arrivals += 1
        output, _ = step(scheduler)
        order += admitted(output)
    assert [name for name in order if name.startswith("b")] == ["b0", "b1", "b2"]
    assert [i for i, name in enumerate(order) if name.startswith("b")] == [3, 7, 11]


def test_share_every_below_two_is_a_plan_error():
    with pytest.raises(ServePlanError, match="--priority-share-every"):
        plan_serve(ServeOptions(model="tiny", device="cpu", priority_share_every=1))


def test_a_requests_class_and_the_stats_by_class_cross_a_process_boundary():
    """A talker in a stage process gets the class with the request (Add over the wire) and
    sends its queue depth and waits back (Stats) for the front's /metrics."""
    from omni_dp.engine import messages  # registers the messages with the wire codec
    from omni_dp.engine.core import Add
    from omni_dp.engine.wire import decode, encode

    sent = Add(classed("b", LO))
    received = decode(encode(sent))
    assert received.request.priority is LO
    scheduler = make_scheduler(64, max_running=1)
    scheduler.add_request(classed("i", HI))
    step(scheduler)
    stats = decode(encode(messages.Stats(scheduler.stats()))).stats
    assert stats.queue_depth == {"interactive": 0, "default": 0, "bulk": 0}
    assert sum(stats.queue_wait_counts["interactive"]) == 1
