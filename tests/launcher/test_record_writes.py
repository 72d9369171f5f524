"""The supervisor as the run record's single writer: each write a value (record/writes.py),
applied by one function — write in, record and events out, no thread — and, while the loop
owns the record, a thread's write applied by the loop alone, in the thread's order."""

from __future__ import annotations

import threading

import pytest

from omni_dp.launcher.record.events import Event
from omni_dp.launcher.record.writes import (
    EventWritten,
    FollowerAdded,
    PhaseSet,
    RecordsReplaced,
    ReplicaBack,
    ReplicaChanged,
    ReplicaDown,
    ReplicaStarted,
    RestartDecided,
    apply,
    next_record,
)
from omni_dp.launcher.supervision.death_watch import DeathWatch
from omni_dp.launcher.supervision.outcomes import GatesPassed, Outcomes
from omni_dp.procs import ProcessIdentity
from omni_dp.runfile import IllegalTransition, ReplicaState, RunPhase, ShareRecord

from support.supervision import (
    NOW,
    FakeRouter,
    FakeStop,
    events,
    make_state,
    names,
    supervisor,
)

H, R, D = ReplicaState.HEALTHY, ReplicaState.RESTARTING, ReplicaState.DOWN


# --- write in, record and events out -------------------------------------------------------



def restart_on_a_thread(sup, index: int) -> None:
    """Replica `index` restarted on a thread of its own while this thread, as the loop does,
    applies what it reports until it ends."""
    worker = threading.Thread(target=sup.restart_replica, args=(index, "its process is gone"),
                              name=f"restart-{index}")
    worker.start()
    while worker.is_alive():
        sup.apply_outcomes()
        worker.join(0.01)
    sup.apply_outcomes()

def test_a_started_replica_has_its_new_process_and_forgets_its_predecessors_facts(tmp_path):
    state = make_state(tmp_path)
    state.update_replica(0, state=R, kv_tokens=1024, memory_bytes=7, mps_attached=True)
    apply(ReplicaStarted(0, ProcessIdentity(5001, 2.5), 5001), state)
    record = state.replica(0)
    assert (record.pid, record.identity.create_time, record.pgid) == (5001, 2.5, 5001)
    assert record.state is ReplicaState.STARTING
    assert (record.kv_tokens, record.memory_bytes, record.mps_attached) == (None, None, None)
    [started] = events(state)
    assert (started["event"], started["replica"], started["pid"], started["port"]) == (
        "replica_started", 0, 5001, 41000)


def test_a_decided_restart_charges_only_its_replica_and_names_its_group(tmp_path):
    state = make_state(tmp_path, replicas=3)
    apply(RestartDecided(0, (NOW,), "its process is gone", 1, 0.0, (0, 1, 2)), state)
    apply(RestartDecided(2, (NOW, NOW + 1), "hung", 2, 1.0, (2,)), state)
    assert [r.restarts for r in state.replicas] == [(NOW,), (), (NOW, NOW + 1)]
    first, second = events(state)
    assert (first["event"], first["group"], first["attempt"]) == ("restart_started", [0, 1, 2], 1)
    assert "group" not in second and second["backoff_s"] == 1.0


def test_a_replica_back_is_said_with_the_pid_the_record_holds(tmp_path):
    state = make_state(tmp_path)
    apply(ReplicaBack(1, False, ("health", "KV")), state)
    [back] = events(state)
    assert back == {"ts": back["ts"], "event": "restart_completed", "replica": 1, "pid": 1001,
                    "in_router": False, "gates": ["health", "KV"]}


def test_down_follows_the_lifecycle_as_the_record_is_when_it_is_applied(tmp_path):
    """A failed replica is not made down by a thread that decided "down" before the loop
    recorded the failure: the check is made against the record the write lands on."""
    state = make_state(tmp_path)
    for i in (0, 1):
        state.update_replica(i, state=R)
    state.update_replica(1, state=ReplicaState.FAILED, last_error="budget spent")
    apply(ReplicaDown(0, "restart failed: x"), state)
    before = state.record
    apply(ReplicaDown(1, "restart failed: y"), state)
    assert state.replica(0).state is D and state.replica(0).last_error == "restart failed: x"
    assert state.record is before  # nothing written for replica 1
    assert state.replica(1).last_error == "budget spent"


def test_a_follower_is_added_only_to_the_share_its_leader_published(tmp_path):
    state = make_state(tmp_path, replicas=3, share=True)
    assert apply(FollowerAdded(1, 1000), state) is False  # no share recorded yet
    share = ShareRecord(leader=0, followers=(), directory="share", policy="p/1",
                        shared_bytes=1, private_bytes=1, tensors=1, leader_pid=1000)
    apply(RecordsReplaced({"share": share}), state)
    assert apply(FollowerAdded(2, 999), state) is False  # another leader's
    assert apply(FollowerAdded(1, 1000), state) is True
    assert state.record.share.followers == (1,)


def test_a_write_that_changes_nothing_leaves_the_record_as_it_was(tmp_path):
    record = make_state(tmp_path).record
    assert next_record(PhaseSet(RunPhase.RUNNING), record) is record
    assert next_record(EventWritten(Event.RUN_READY), record) is record
    assert next_record(PhaseSet(RunPhase.DEGRADED), record).state is RunPhase.DEGRADED


def test_a_write_the_lifecycle_refuses_raises_and_writes_nothing(tmp_path):
    state = make_state(tmp_path)
    state.update_replica(0, state=ReplicaState.STOPPED)
    before = state.record
    with pytest.raises(IllegalTransition):
        apply(ReplicaChanged(0, {"state": ReplicaState.UNHEALTHY}), state)
    assert state.record is before and events(state) == []


# --- the loop alone applies a thread's writes ----------------------------------------------


def test_a_threads_write_waits_for_the_loop_and_reads_its_own_write_back(tmp_path):
    state = make_state(tmp_path)
    outcomes = Outcomes()
    outcomes.own(state)  # this thread is the loop
    seen: list = []

    def thread() -> None:
        state.update_replica(0, state=R, last_error="gone")
        seen.append(state.replica(0).state)  # its own write, applied before it goes on
        seen.append(state.add_follower(1, 1000))

    worker = threading.Thread(target=thread)
    worker.start()
    worker.join(0.3)
    assert worker.is_alive() and state.replica(0).state is H  # not applied: the loop did not
    while worker.is_alive():
        for posted in outcomes.take():
            posted.settle(state)
        worker.join(0.01)
    assert seen == [R, False] and state.replica(0).last_error == "gone"


def test_an_error_applying_a_threads_write_is_raised_in_that_thread(tmp_path):
    state = make_state(tmp_path)
    state.update_replica(0, state=ReplicaState.STOPPED)
    outcomes = Outcomes()
    outcomes.own(state)
    raised: list = []

    def thread() -> None:
        try:
            state.update_replica(0, state=ReplicaState.UNHEALTHY)
        except IllegalTransition as exc:
            raised.append(exc)

    worker = threading.Thread(target=thread)
    worker.start()
    while worker.is_alive():
        for posted in outcomes.take():
            posted.settle(state)
        worker.join(0.01)
    assert len(raised) == 1 and state.replica(0).state is ReplicaState.STOPPED


def test_once_released_a_threads_write_is_applied_where_it_is_made(tmp_path):
    """Teardown owns the run: a late write of a thread (a start inside the spawn gate) must
    not wait for a loop that no longer applies anything."""
    state = make_state(tmp_path)
    outcomes = Outcomes()
    outcomes.own(state)
    outcomes.release()
    worker = threading.Thread(target=state.update_replica, args=(0,), kwargs={"state": R})
    worker.start()
    worker.join(5)
    assert not worker.is_alive() and state.replica(0).state is R and outcomes.take() == []


def test_a_restart_thread_writes_nothing_itself_the_loop_applies_it_all_in_order(tmp_path):
    """A replica's restart (decision, stop, start, gates, back in the router) in its own
    thread while the test is the loop: every record change and every event is applied on the
    loop's thread, in the order the restart made them."""
    state = make_state(tmp_path, restarts=(NOW - 30,))
    sup, _, said = supervisor(state)
    sup.crew.stop = FakeStop()
    state.update_replica(0, state=R)
    sup.outcomes.own(state)
    writers: list[str] = []
    commit, append = state.commit, state.append_event
    state.commit = lambda record: (writers.append(threading.current_thread().name),
                                   commit(record))[1]
    state.append_event = lambda line: (writers.append(threading.current_thread().name),
                                       append(line))[1]
    restart_on_a_thread(sup, 0)
    assert writers and set(writers) == {threading.current_thread().name}
    record = state.replica(0)
    assert record.state is H and record.restarts == (NOW - 30, NOW) and record.pid == 5001
    assert names(state) == ["router_disabled", "restart_started", "router_enabled",
                            "restart_completed"]
    assert said[-1].startswith("replica 0: restarted (pid 5001)")
    assert sup.watches[0].failures == 0  # the pass, reported in order with the writes


def test_gates_passed_and_writes_share_one_queue_in_the_order_made(tmp_path):
    state = make_state(tmp_path)
    outcomes = Outcomes()
    outcomes.own(state)

    def thread() -> None:
        outcomes.report(GatesPassed(0))
        state.update_replica(0, last_error="after")

    worker = threading.Thread(target=thread)
    worker.start()
    taken: list = []
    while worker.is_alive() or not taken:
        for outcome in outcomes.take():
            taken.append(type(outcome).__name__)
            if not isinstance(outcome, GatesPassed):
                outcome.settle(state)
        worker.join(0.01)
    assert taken == ["GatesPassed", "Posted"]


# --- a write wakes the loop to apply it, not to sweep ---------------------------------------


def test_a_write_wakes_the_loop_without_a_sweep_an_outcome_with_one():
    watch = DeathWatch()
    try:
        watch.wake(False)
        assert watch.wait([], 5) is False
        watch.wake(False)
        watch.wake(True)
        assert watch.wait([], 5) is True
        assert watch.wait([], 0.01) is True  # the interval passed: a sweep is due
    finally:
        watch.close()


def test_the_loop_applies_a_write_between_sweeps_without_an_extra_health_check(tmp_path):
    state = make_state(tmp_path)
    sup, world, _ = supervisor(state)
    sup.interval = 0.5
    sup.outcomes.own(state)
    world.live.clear()  # nothing to watch: only the write or the interval ends the wait
    looks: list[int] = []
    look = sup._look
    sup._look = lambda index: (looks.append(index), look(index))[1]
    watch = DeathWatch()
    sup.outcomes.wake = watch.wake
    try:
        done = threading.Event()

        def thread() -> None:
            state.update_replica(1, last_error="written by a thread")
            done.set()

        worker = threading.Thread(target=thread)
        worker.start()
        sup._wait(watch)  # the interval, with the write applied inside it
        assert done.is_set() and state.replica(1).last_error == "written by a thread"
        assert looks == []  # no sweep for it
    finally:
        sup.outcomes.wake = None
        watch.close()
        worker.join(5)



def test_the_replicas_left_out_of_the_router_change_only_as_the_loop_applies_it(tmp_path):
    """A restart whose replica the router refuses to take back: the thread says so (an
    outcome), and the loop's own list of replicas to ask again changes when the loop applies
    it — in order with the record writes around it."""
    state = make_state(tmp_path)
    sup, _, said = supervisor(state, router=FakeRouter(status=503))
    sup.crew.stop = FakeStop()
    state.update_replica(0, state=R)
    sup.outcomes.own(state)
    changes: list = []
    apply_left_out = sup.router.apply_left_out
    sup.router.apply_left_out = lambda change: (
        changes.append((threading.current_thread().name, change.indices, change.out)),
        apply_left_out(change))[1]
    restart_on_a_thread(sup, 0)
    assert changes == [(threading.current_thread().name, (0,), True)]
    assert sup.router.not_in_router == {0}
    assert "NOT back in the router" in said[-1]


def test_a_new_router_starts_the_left_out_list_anew_when_the_loop_applies_it(tmp_path,
                                                                            monkeypatch):
    from types import SimpleNamespace

    from omni_dp.launcher.supervision import router_link

    monkeypatch.setattr(router_link, "start_router",
                        lambda state: SimpleNamespace(pid=901, popen=None))
    state = make_state(tmp_path)
    sup, _, _ = supervisor(state)
    sup.router.not_in_router.add(1)
    sup.outcomes.own(state)
    worker = threading.Thread(target=sup.router.restart, args=(0.0, []))
    worker.start()
    worker.join(5)
    assert not worker.is_alive() and sup.router.not_in_router == {1}  # not the thread's
    sup.apply_outcomes()
    assert sup.router.not_in_router == set()
