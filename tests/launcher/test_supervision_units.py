"""The supervisor's decisions on their own: the fakes of support/supervision.py (a fake clock,
a fake world, a fake replica set and a fake router); no process is started."""

from __future__ import annotations

import threading
from dataclasses import replace
from types import SimpleNamespace

import pytest

from omni_dp.contract import API_KEY_ENV
from omni_dp.launcher.bringup.steps import BringUpFailed
from omni_dp.launcher.engines.replica_api import GateFailed
from omni_dp.launcher.record.state import RunState
from omni_dp.launcher.supervision import mps_restart, router_link
from omni_dp.launcher.supervision.hang_watch import HANG_GRACE_S, HangReports, HungReplica
from omni_dp.launcher.supervision.mps_watch import MpsWatch, describe_fault
from omni_dp.launcher.supervision.replica_watch import ReplicaWatch, Seen, Verdict
from omni_dp.launcher.supervision.restart_policy import GiveUp, Restart, RestartPolicy
from omni_dp.launcher.supervision.slots import (
    ROUTER,
    Busy,
    Dependencies,
    Slot,
    replica_group,
    restart_group,
    run_slots,
)
from omni_dp.launcher.supervision.supervisor import Supervisor
from omni_dp.launcher.views.status import collect, format_status
from omni_dp.mps.daemon import DaemonHealth
from omni_dp.mps.faults import FaultScanner
from omni_dp.runfile import ReplicaState, RunPhase, ShareRecord

from support.supervision import (
    NOW,
    FakeReplicas,
    FakeRouter,
    FakeStop,
    FakeWorld,
    events,
    make_state,
    names,
    supervisor,
)

H, U, R = ReplicaState.HEALTHY, ReplicaState.UNHEALTHY, ReplicaState.RESTARTING
MPS = Slot.mps(0)  # the daemon of a one-GPU run


# --- the restart policy --------------------------------------------------------------------


def test_the_first_restart_is_immediate_and_the_budget_counts_restarts_in_the_window():
    policy = RestartPolicy(budget=3, window=600.0)
    assert policy.decide((), NOW) == Restart(delay=0.0, attempt=1, history=(NOW,))
    assert policy.decide((NOW - 2, NOW - 1), NOW) == Restart(2.0, 3, (NOW - 2, NOW - 1, NOW))
    over = policy.decide((NOW - 3, NOW - 2, NOW - 1), NOW)
    assert over == GiveUp(restarts=3, window=600.0)
    assert over.reason == "3 restarts within 600 s"


def test_backoff_doubles_from_one_second_up_to_its_cap():
    policy = RestartPolicy(budget=100, window=1e9)
    history: tuple[float, ...] = ()
    delays = []
    for k in range(9):
        decision = policy.decide(history, NOW + k)
        assert isinstance(decision, Restart) and decision.attempt == k + 1
        delays.append(decision.delay)
        history = decision.history
    assert delays == [0, 1, 2, 4, 8, 16, 30, 30, 30]


def test_restarts_older_than_the_window_no_longer_count():
    policy = RestartPolicy(budget=2, window=60.0)
    history = (NOW, NOW + 10)
    assert isinstance(policy.decide(history, NOW + 50), GiveUp)
    # the first has left the window: one counts, backoff 1 s, the old one is forgotten
    assert policy.decide(history, NOW + 65) == Restart(1.0, 2, (NOW + 10, NOW + 65))
    assert policy.decide(history, NOW + 75) == Restart(0.0, 1, (NOW + 75,))


def test_a_budget_of_zero_never_restarts():
    assert RestartPolicy(budget=0, window=600.0).decide((), NOW) == GiveUp(0, 600.0)


# --- health counting -----------------------------------------------------------------------


def test_a_restart_is_due_only_after_threshold_failed_health_checks_in_a_row():
    watch = ReplicaWatch(threshold=3)
    first = watch.observe(H, Seen(alive=True, health=503))
    assert first == Verdict(U, "/health answered 503 (1 in a row)", None)
    assert watch.observe(U, Seen(alive=True, health=0)).restart is None
    third = watch.observe(U, Seen(alive=True, health=503))
    assert third.restart == "/health answered 503 (3 in a row)" == third.error


def test_one_good_health_check_recovers_and_restarts_the_count():
    watch = ReplicaWatch(threshold=2)
    assert watch.observe(H, Seen(alive=True, health=500)).state is U
    assert watch.observe(U, Seen(alive=True, health=200)) == Verdict(H)  # recovered
    assert watch.observe(H, Seen(alive=True, health=200)) == Verdict()  # nothing to record
    again = watch.observe(H, Seen(alive=True, health=0))
    assert again.error == "/health answered nothing (1 in a row)" and again.restart is None


def test_a_dead_process_is_restarted_at_once_naming_how_it_ended():
    watch = ReplicaWatch(threshold=3)
    assert watch.observe(H, Seen(alive=False, exit_code=-9)).restart == \
        "its process was killed by SIGKILL"
    assert watch.observe(U, Seen(alive=False, exit_code=1)).restart == \
        "its process exited with code 1"
    assert watch.observe(H, Seen(alive=False)) == Verdict(restart="its process is gone")


def test_the_sweep_counts_failed_health_checks_and_restarts_past_the_threshold(tmp_path):
    state = make_state(tmp_path, failures=2)
    sup, world, said = supervisor(state)
    started: list[tuple[int, str]] = []
    sup.restart_replica = lambda index, reason, group: started.append((index, reason))
    world.health_of["http://replica-0.test"] = 503
    sup.sweep()
    assert state.replica(0).state is U and started == []
    assert state.replica(0).last_error == "/health answered 503 (1 in a row)"
    assert state.record.state is RunPhase.DEGRADED
    sup.sweep()
    sup.busy.join(5)
    assert started == [(0, "/health answered 503 (2 in a row)")]
    assert state.replica(0).state is R and state.replica(1).state is H
    assert said == ["replica 0: /health answered 503 (2 in a row); restarting"]


def test_a_replica_the_router_found_hung_is_restarted_once_after_the_grace(tmp_path):
    """The router took replica 1 out as hung (a SIGSTOPped process: its socket still accepts,
    so the supervisor's own /health checks may not have failed yet): past the grace it is
    restarted through the gates, once for that ejection; a replica ejected for failures is the
    health checks' business, and one still within the grace may yet be re-admitted."""
    state = make_state(tmp_path)
    sup, world, said = supervisor(state)
    started: list[tuple[int, str]] = []
    sup.restart_replica = lambda index, reason, group: started.append((index, reason))
    world.workers = [
        {"id": "0", "ejected_reason": "failures", "ejected_at": NOW - 60, "last_error": "x"},
        {"id": "1", "ejected_reason": "hang", "ejected_at": NOW - HANG_GRACE_S + 1,
         "last_error": "no answer within --first-byte-timeout 5 s; /health: no answer"}]
    sup.sweep()
    assert started == []  # still within the grace
    sup.crew.clock.now += 2
    sup.sweep()
    sup.busy.join(5)
    assert started == [(1, "hung: the router took it out (no answer within "
                           "--first-byte-timeout 5 s; /health: no answer)")]
    assert [e["replica"] for e in events(state) if e["event"] == "replica_hung"] == [1]
    sup.sweep()  # the same ejection: not again
    sup.busy.join(5)
    assert len(started) == 1 and said[-1].startswith("replica 1: hung: the router took it out")


def test_hang_reports_act_on_each_ejection_once_and_ignores_what_is_not_a_hang():
    watch = HangReports(grace_s=10.0)
    hung = {"id": "2", "ejected_reason": "hang", "ejected_at": 100.0, "last_error": "stalled"}
    assert watch.due([hung], now=105.0) == []
    assert watch.due([hung], now=111.0) == [HungReplica(2, 100.0, "stalled")]
    assert watch.due([hung], now=200.0) == []  # acted on
    again = {**hung, "ejected_at": 300.0}  # re-admitted, then hung again: a new ejection
    assert watch.due([again], now=311.0) == [HungReplica(2, 300.0, "stalled")]
    odd = [{"id": "router", "ejected_reason": "hang", "ejected_at": 1.0},
           {"id": "3", "ejected_reason": "hang", "ejected_at": None},
           {"id": "4", "ejected_reason": None, "ejected_at": None}]
    assert watch.due(odd, now=1000.0) == []


# --- restarting one replica ----------------------------------------------------------------


def test_past_the_budget_a_replica_is_failed_and_stays_out_of_the_router(tmp_path):
    state = make_state(tmp_path, budget=2, restarts=(NOW - 20, NOW - 10))
    router = FakeRouter()
    sup, _, said = supervisor(state, router=router)
    state.update_replica(0, state=R)
    sup.restart_replica.through_gates(0, "its process is gone")
    assert state.replica(0).state is not F and not said  # reported; the loop writes it
    sup.apply_outcomes()
    record = state.replica(0)
    why = "restart budget exhausted (2 restarts within 600 s); last: its process is gone"
    assert record.state is ReplicaState.FAILED and record.last_error == why
    assert [c for c in sup.replicas.calls if c[0] == "start"] == []
    assert [(u, d) for u, d, _ in router.calls] == [("http://router.test/workers/0", True)]
    assert names(state) == ["router_disabled", "replica_failed"]
    assert said == [f"replica 0: {why}; it stays out of the router"]


def test_a_restart_backs_off_passes_the_gates_and_is_back_in_the_router(tmp_path):
    state = make_state(tmp_path, restarts=(NOW - 30,))
    sup, _, said = supervisor(state)
    sup.crew.stop = FakeStop()
    sup.watches[0].failures = 2
    state.update_replica(0, state=R)
    sup.restart_replica.through_gates(0, "its process is gone")
    assert sup.crew.stop.waits == [1.0]  # one restart within the window before this one
    record = state.replica(0)
    assert record.state is H and record.last_error is None and record.restarts == (NOW - 30, NOW)
    assert sup.replicas.calls == [("stop", 0), ("start", 0), ("wait_healthy", 0),
                                  ("record_processes", 0), ("check_kv", 0),
                                  ("measure_memory", 0)]
    [started] = [e for e in events(state) if e["event"] == "restart_started"]
    assert (started["attempt"], started["backoff_s"]) == (2, 1.0)
    assert names(state)[-2:] == ["router_enabled", "restart_completed"]
    assert said == [f"replica 0: restarted (pid {record.pid}), passed its gates (health, "
                    "processes, KV), back in the router"]
    assert events(state)[-1]["gates"] == ["health", "processes", "KV"]
    assert sup.watches[0].failures == 2  # the loop's own: the thread reported the pass...
    sup.apply_outcomes()
    assert sup.watches[0].failures == 0  # ...which the loop applied


def test_a_replica_failing_its_gates_is_down_and_stopped_again(tmp_path):
    state = make_state(tmp_path)
    sup, world, said = supervisor(state, healthy=False)
    state.update_replica(0, state=R)
    sup.restart_replica(0, "its process is gone")
    record = state.replica(0)
    assert record.state is ReplicaState.DOWN
    assert record.last_error == "not healthy within 5 s (last /health: 503); last lines of x:"
    assert sup.replicas.calls[-1] == ("stop", 0) and record.pid not in world.live
    assert said == ["replica 0: restart failed: not healthy within 5 s (last /health: 503); "
                    "last lines of x:"]


def test_a_port_that_stays_busy_fails_the_restart(tmp_path, monkeypatch):
    from omni_dp.launcher.supervision import replica_restart

    monkeypatch.setattr(replica_restart, "PORT_FREE_TIMEOUT_S", 0.2)
    state = make_state(tmp_path)
    sup, world, said = supervisor(state)
    world.taken.add(41000)
    state.update_replica(0, state=R)
    sup.restart_replica(0, "its process is gone")
    assert state.replica(0).state is ReplicaState.DOWN
    assert ("start", 0) not in sup.replicas.calls
    assert said == ["replica 0: restart failed: port 41000 still busy after 0 s"]


# --- the router link -----------------------------------------------------------------------


@pytest.mark.parametrize("status", [401, 500])
def test_a_refused_admin_call_is_a_warning_with_the_routers_words_never_a_success(tmp_path,
                                                                                 status):
    state = make_state(tmp_path)
    state.api_key = "k3y"
    router = FakeRouter(status, {"error": "nope"})
    sup, _, said = supervisor(state, router=router)
    assert sup.router.set_disabled(1, True) is False
    error = ("the router did not take replica 1 out: PUT /workers/1 answered "
             f"{status} (nope)")
    if status == 401:
        error += (f"; the router wants an API key: launch with --api-key (or {API_KEY_ENV}) "
                  "so that the supervisor sends it")
    assert state.replica(1).last_error == error and said == [f"warning: {error}"]
    [event] = events(state)
    assert (event["event"], event["action"], event["status"]) == ("router_admin_failed",
                                                                  "disabled", status)
    assert router.calls == [("http://router.test/workers/1", True,
                             {"Authorization": "Bearer k3y"})]


def test_without_a_router_recorded_nothing_answers_and_nothing_is_done(tmp_path):
    state = make_state(tmp_path)
    state.update(router=None)
    sup, _, said = supervisor(state)
    assert sup.router.set_disabled(0, False, warn=False) is False
    assert sup.router.http.calls == [] and said == []
    assert events(state)[0]["error"] == ("the router did not take replica 0 back: "
                                         "PUT /workers/0 answered nothing")


def test_a_restarted_replica_the_router_refuses_is_not_reported_back_and_is_asked_again(
        tmp_path):
    state = make_state(tmp_path)
    router = FakeRouter()
    router.answer[False] = (503, None)
    sup, _, said = supervisor(state, router=router)
    state.update_replica(0, state=R)
    sup.restart_replica(0, "its process is gone")
    assert sup.router.not_in_router == {0}
    assert said[-1].endswith("but NOT back in the router (above); retrying at every sweep")
    assert not any(s.endswith("back in the router") for s in said)
    assert events(state)[-1]["in_router"] is False
    assert "answered 503" in state.replica(0).last_error
    sup.sweep()  # still refused: said once, not again
    assert sup.router.not_in_router == {0} and len(said) == 2
    router.answer[False] = (200, None)
    sup.sweep()
    assert sup.router.not_in_router == set() and said[-1] == "replica 0: back in the router"
    assert state.replica(0).last_error is None


@pytest.mark.parametrize("error", [
    BringUpFailed("the router was not ready within 30 s (last /ready: 503); last lines of "
                  "router.log:\n    boom"),
    FileNotFoundError(2, "No such file or directory")])
def test_a_failed_router_restart_is_said_and_never_reported_as_done(tmp_path, monkeypatch,
                                                                    error):
    def fails(state):
        raise error

    monkeypatch.setattr(router_link, "start_router", fails)
    state = make_state(tmp_path)
    sup, world, said = supervisor(state)
    sup.router.not_in_router.add(1)
    world.live.discard(900)
    sup.router.restart(0.0, [])
    assert said == [f"the router restart failed: {str(error).splitlines()[0]}"]
    assert names(state) == ["router_restart_failed"]
    assert sup.router.not_in_router == {1}  # nothing pretends a new router took them


def test_a_restarted_router_is_told_which_replicas_are_not_healthy(tmp_path, monkeypatch):
    popen = object()
    monkeypatch.setattr(router_link, "start_router",
                        lambda state: SimpleNamespace(pid=901, popen=popen))
    state = make_state(tmp_path, replicas=3)
    state.update_replica(1, state=U)
    router = FakeRouter()
    sup, _, said = supervisor(state, router=router)
    sup.router.not_in_router.add(2)
    reap: list = []
    sup.router.restart(0.0, reap)
    assert reap == [popen] and said == ["router restarted (pid 901), ready"]
    assert [(u, d) for u, d, _ in router.calls] == [("http://router.test/workers/1", True)]
    assert sup.router.not_in_router == set()


def test_the_router_is_restarted_within_the_budget_then_the_run_stops(tmp_path):
    state = make_state(tmp_path, budget=1)
    sup, world, said = supervisor(state)
    restarts: list[float] = []
    sup.router.restart = lambda delay, reap: restarts.append(delay)
    world.live.discard(900)
    sup.sweep()
    sup.busy.join(5)
    assert restarts == [0.0] and said == ["the router died; restarting it"]
    sup.sweep()  # died again (the fake restart started nothing): the budget is spent
    assert restarts == [0.0] and sup.exit_code == 3 and sup.stop_requested.is_set()
    assert said[-1] == ("the router died; restart budget exhausted (1 restarts within 600 s); "
                        "stopping the run")
    assert names(state) == ["router_died", "router_died", "router_failed"]


# --- slots and their dependencies ----------------------------------------------------------


def test_a_new_dependency_is_one_declaration():
    leader, f1, f2, other = (Slot.replica(i) for i in range(4))
    deps = Dependencies([f1, leader, f2, other])
    deps.declare(f1, on=leader)
    deps.declare(f2, on=leader)
    assert deps.dependents(leader) == [f1, f2]
    assert deps.order() == [leader, f1, f2, other]  # what a slot depends on is checked first
    busy = Busy(deps)
    hold = threading.Event()
    busy.start(leader, hold.wait)
    try:
        assert busy.skipped(f1) and busy.skipped(f2) and busy.skipped(leader)
        assert not busy.skipped(other)
    finally:
        hold.set()
        busy.join(5)
    assert not busy.skipped(f1)
    with pytest.raises(ValueError, match="cycle"):
        deps.declare(leader, on=f2)


def test_under_mps_every_replica_depends_on_the_daemon(tmp_path):
    deps = run_slots(make_state(tmp_path, replicas=3, mps=True).record)
    assert deps.dependents(MPS) == [Slot.replica(0), Slot.replica(1), Slot.replica(2)]
    assert deps.order()[0] == MPS and deps.dependents(ROUTER) == []
    assert MPS not in run_slots(make_state(tmp_path / "plain").record).slots


# --- a weight-sharing group: the followers depend on the leader ------------------------------


def test_with_share_weights_every_follower_depends_on_the_leader(tmp_path):
    deps = run_slots(make_state(tmp_path, replicas=3, share=True).record)
    leader, f1, f2 = (Slot.replica(i) for i in range(3))
    assert deps.dependents(leader) == [f1, f2] and deps.dependents(f1) == []
    assert replica_group(deps, 0) == [0, 1, 2] and replica_group(deps, 2) == [2]
    assert deps.order()[:3] == [leader, f1, f2]  # a sweep sees a dead leader first
    both = run_slots(make_state(tmp_path / "mps", replicas=3, share=True, mps=True).record)
    assert both.order()[:2] == [MPS, leader] and both.dependents(MPS) == [leader, f1, f2]
    assert replica_group(run_slots(make_state(tmp_path / "plain").record), 0) == [0]


def gates(i: int, *more: int) -> list[tuple]:
    """What FakeReplicas records for replicas started and gated one after another."""
    return [c for j in (i, *more) for c in (("start", j), ("wait_healthy", j),
                                           ("record_processes", j), ("check_kv", j),
                                           ("share_gate", j))]


def test_a_dead_leader_restarts_its_group_in_waves_and_no_follower_restarts_on_its_own(
        tmp_path):
    state, router, sup, world, said = sharing_run(tmp_path)
    real, handed = sup.restart_replica, []
    began, release = threading.Event(), threading.Event()

    def held(index, reason, group):
        handed.append((index, group))
        began.set()
        release.wait(10)
        real(index, reason, group)

    sup.restart_replica = held
    world.live.discard(1000)  # the leader is SIGKILLed
    sup.sweep()
    assert began.wait(5)
    try:
        assert [r.state for r in state.replicas] == [R, R, R]
        world.live -= {1001, 1002}  # its followers exit 4 a moment later
        sup.sweep()
        sup.sweep()  # neither sweep restarts a follower: the group restart owns them
        assert handed == [(0, [0, 1, 2])] and sup._watched() == [state.record.router.identity]
    finally:
        release.set()
        sup.busy.join(5)
    assert said[0] == ("replica 0: its process is gone; restarting with replica(s) 1, 2, which "
                       "depend on it")
    # stopped as a group (ReplicaControl.stop orders it), then in waves: [0], then [1, 2] together
    assert sup.replicas.calls[0] == ("stop", 0, 1, 2)
    assert sup.replicas.calls[1:] == [
        *gates(0), ("start", 1), ("start", 2),
        *[c for j in (1, 2) for c in gates(j) if c[0] != "start"], ("measure_memory", 0, 1, 2)]
    assert [r.state for r in state.replicas] == [H, H, H]
    assert all(r.last_error is None for r in state.replicas)
    # only the failed slot is charged: its followers did not fail on their own
    assert [r.restarts for r in state.replicas] == [(NOW,), (), ()]
    [started] = [e for e in events(state) if e["event"] == "restart_started"]
    assert (started["replica"], started["group"]) == (0, [0, 1, 2])
    assert [e["replica"] for e in events(state) if e["event"] == "restart_completed"] == [0, 1, 2]
    assert [(u[-1], d) for u, d, _ in router.calls] == [
        ("0", True), ("1", True), ("2", True), ("0", False), ("1", False), ("2", False)]
    sup.sweep()  # the new processes are healthy: nothing more to restart
    sup.busy.join(5)
    assert handed == [(0, [0, 1, 2])]


def test_a_dead_follower_is_restarted_alone_and_its_leader_untouched(tmp_path):
    state, router, sup, world, _ = sharing_run(tmp_path)
    world.live.discard(1002)
    sup.sweep()
    sup.busy.join(5)
    assert sup.replicas.calls == [("stop", 2), *gates(2), ("measure_memory", 2)]
    assert [r.pid for r in state.replicas][:2] == [1000, 1001]
    assert [len(r.restarts) for r in state.replicas] == [0, 0, 1]
    assert [(u[-1], d) for u, d, _ in router.calls] == [("2", True), ("2", False)]


def test_past_the_budget_a_leader_fails_with_its_whole_group(tmp_path):
    state = make_state(tmp_path, replicas=3, share=True, budget=1, restarts=(NOW - 10,))
    sup, _, said = supervisor(state)
    sup.restart_replica.through_gates(0, "its process is gone", [0, 1, 2])
    sup.apply_outcomes()
    assert [r.state for r in state.replicas] == [ReplicaState.FAILED] * 3
    assert sup.replicas.calls == [("stop", 0, 1, 2)]
    assert state.replica(2).last_error == (
        "restart budget exhausted (1 restarts within 600 s); last: its process is gone (of "
        "replica 0, which it depends on)")
    assert [e["replica"] for e in events(state) if e["event"] == "replica_failed"] == [0, 1, 2]
    assert len(said) == 3


def test_a_leader_failing_its_gates_leaves_its_followers_unstarted_and_down(tmp_path):
    state = make_state(tmp_path, replicas=3, share=True)
    sup, _, said = supervisor(state, healthy=False)
    sup.restart_replica(0, "its process is gone", [0, 1, 2])
    assert [c for c in sup.replicas.calls if c[0] == "start"] == [("start", 0)]
    assert [r.state for r in state.replicas] == [ReplicaState.DOWN] * 3
    assert state.replica(1).last_error == ("not started: replica(s) 0 it depends on did not "
                                           "come back")
    assert said[0].startswith("replica 0: restart failed: not healthy within 5 s")


def test_bring_up_starts_the_leader_alone_before_its_followers(tmp_path):
    from omni_dp.launcher.bringup.steps import start_replicas

    state = make_state(tmp_path, replicas=3, share=True)
    for i in range(3):  # as the MPS group restart leaves them (bring-up: planned)
        state.update_replica(i, state=R)
    fake = FakeReplicas(state, FakeWorld(set()))
    start_replicas(state, fake, [0, 1, 2], sequential=False, timeout_s=5.0, say=lambda _: None)
    assert fake.calls == [
        ("start", 0), ("wait_healthy", 0), ("record_processes", 0), ("check_kv", 0),
        ("share_gate", 0), ("start", 1), ("start", 2), ("wait_healthy", 1),
        ("record_processes", 1), ("wait_healthy", 2), ("record_processes", 2),
        ("check_kv", 1, 2), ("share_gate", 1), ("share_gate", 2), ("measure_memory", 0, 1, 2)]
    assert [r.state for r in state.replicas] == [H, H, H]


class RecordedProgress:
    """bringup.steps.StartProgress, kept as a list."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def begin(self, index, log, phase):
        self.calls.append(("begin", index, log.name, phase))

    def phase(self, index, phase):
        self.calls.append(("phase", index, phase))

    def end(self, index):
        self.calls.append(("end", index))


def test_bring_up_tells_its_progress_what_it_waits_on_and_ends_it_on_failure(tmp_path):
    from omni_dp.launcher.bringup.steps import start_replicas

    state = make_state(tmp_path, replicas=2)
    for i in range(2):
        state.update_replica(i, state=R)
    progress = RecordedProgress()
    start_replicas(state, FakeReplicas(state, FakeWorld(set())), [0, 1], sequential=False,
                   timeout_s=5.0, say=lambda _: None, progress=progress)
    starting, healthy = "starting, waiting for /health", "healthy, waiting for the KV read-back"
    assert progress.calls == [
        ("begin", 0, state.replica(0).log, starting), ("begin", 1, state.replica(1).log, starting),
        ("phase", 0, healthy), ("phase", 1, healthy), ("end", 0), ("end", 1)]

    state = make_state(tmp_path / "failing", replicas=2)
    for i in range(2):
        state.update_replica(i, state=R)
    progress = RecordedProgress()
    with pytest.raises(BringUpFailed):
        start_replicas(state, FakeReplicas(state, FakeWorld(set()), healthy=False), [0, 1],
                       sequential=False, timeout_s=5.0, say=lambda _: None, progress=progress)
    assert progress.calls[-2:] == [("end", 0), ("end", 1)]  # no board left ticking


def test_bring_up_says_published_and_attached_only_for_what_passed_its_share_gate(tmp_path):
    from omni_dp.launcher.bringup.steps import BringUpFailed, start_replicas

    def planned(directory):
        state = make_state(directory, replicas=3, share=True)
        for i in range(3):  # as an MPS group restart leaves them (bring-up: planned)
            state.update_replica(i, state=R)
        return state

    state = planned(tmp_path)
    fake, said = FakeReplicas(state, FakeWorld(set())), []
    fake.share_fails = {2}
    with pytest.raises(BringUpFailed, match=r"replica 2 .*it is not sharing"):
        start_replicas(state, fake, [0, 1, 2], sequential=False, timeout_s=5.0, say=said.append)
    assert any(line.startswith("replica 0 published ") for line in said)
    assert not [line for line in said if "attached" in line]
    state = planned(tmp_path / "again")
    fake, said = FakeReplicas(state, FakeWorld(set())), []
    start_replicas(state, fake, [0, 1, 2], sequential=False, timeout_s=5.0, say=said.append)
    assert said[-1] == ("replica(s) 1, 2 attached to the leader's weights (replica 0, pid "
                        f"{state.replica(0).pid})")


def test_a_follower_failing_its_share_gate_in_a_restart_stays_down_and_out(tmp_path):
    state, router, sup, _, said = sharing_run(tmp_path)
    sup.replicas.share_gate(0)  # the leader's proof, as bring-up left it
    sup.replicas.share_fails = {1}
    sup.restart_replica(1, "its process is gone", [1])
    assert state.replica(1).state is D and enabled(router) == []
    assert state.replica(1).last_error.startswith("replica 1 (a weight-share follower)")
    assert not [line for line in said if "restarted (pid" in line]
    assert ("stop", 1) in sup.replicas.calls[-2:]  # stopped again: it never serves ungated


# --- a weight-sharing group: what a restart charges, what it takes, what it undoes -------------


F, D, S = ReplicaState.FAILED, ReplicaState.DOWN, ReplicaState.STOPPED


def sharing_run(tmp_path) -> tuple[RunState, FakeRouter, Supervisor, FakeWorld, list[str]]:
    """Three replicas sharing weights (0 leads), all healthy, supervised with a fake world
    and a router whose calls are kept."""
    state = make_state(tmp_path, replicas=3, share=True)
    router = FakeRouter()
    sup, world, said = supervisor(state, router=router)
    return state, router, sup, world, said


def share_proof(state: RunState, followers: tuple[int, ...] = (1, 2)) -> ShareRecord:
    share = ShareRecord(leader=0, followers=followers, directory="share", policy="p/1",
                        shared_bytes=1024, private_bytes=32, tensors=1,
                        leader_pid=state.replica(0).pid)
    state.update(share=share)
    return share


def enabled(router: FakeRouter) -> list[int]:
    return [int(url.rsplit("/", 1)[1]) for url, disabled, _ in router.calls if not disabled]


def test_an_unexpected_error_in_the_followers_wave_leaves_the_leader_that_passed_up(tmp_path):
    state, router, sup, world, said = sharing_run(tmp_path)
    fake, start = sup.replicas, sup.replicas.start

    def spawn(i):
        if i == 1:
            raise OSError("spawn failed")
        start(i)

    fake.start = spawn
    sup.restart_replica(0, "its process is gone", [0, 1, 2])
    leader = state.replica(0)
    assert [r.state for r in state.replicas] == [H, D, D]
    assert world.alive(leader.identity) and leader.last_error is None and enabled(router) == [0]
    assert ("stop", 1, 2) in fake.calls  # not through the gates: stopped, whatever they left
    [failed] = [e for e in events(state) if e["event"] == "restart_failed"]
    assert (failed["group"], failed["passed"], failed["stopped"], failed["ungated"]) == (
        [0, 1, 2], [0], [1, 2], [1])
    assert state.replica(2).last_error == "restart failed: OSError('spawn failed')"
    assert said[-1] == ("replica 0: restart failed: OSError('spawn failed'); replica(s) 0 passed "
                        "and stay; replica(s) 1, 2 not through the gates: stopped, down, the "
                        "next sweep restarts them")


def test_an_unexpected_error_stops_the_followers_started_but_not_gated(tmp_path):
    state, router, sup, world, _ = sharing_run(tmp_path)
    fake, share_gate = sup.replicas, sup.replicas.share_gate

    def broken(i):
        if i == 1:
            raise RuntimeError("boom")  # not a GateFailed: a bug, a run.json not written
        share_gate(i)

    fake.share_gate = broken
    sup.restart_replica(0, "its process is gone", [0, 1, 2])
    r1, r2 = state.replica(1), state.replica(2)
    assert [r.state for r in state.replicas] == [H, D, D]
    # both were started together, neither passed: neither runs ungated
    assert not world.alive(r1.identity) and not world.alive(r2.identity)
    assert fake.calls[-1] == ("stop", 1, 2) and enabled(router) == [0]
    fake.share_gate = share_gate
    sup.sweep()  # they are dead, so restarted (alone: their leader runs), never "healthy"
    sup.busy.join(5)
    assert [r.state for r in state.replicas] == [H, H, H] and sorted(enabled(router)) == [0, 1, 2]
    assert state.replica(1).pid not in (r1.pid, None)


def test_an_unexpected_error_before_anything_started_puts_the_old_healthy_ones_back(tmp_path):
    state, router, sup, _, _ = sharing_run(tmp_path)

    def stop(indices, timeout_s):
        raise RuntimeError("cannot stop")

    sup.replicas.stop = stop
    sup.restart_replica(0, "/health answered 503 (3 in a row)", [0, 1, 2])
    assert [r.state for r in state.replicas] == [D, D, D] and enabled(router) == []
    sup.sweep()  # their old processes still answer: healthy, and back in the router
    assert [r.state for r in state.replicas] == [H, H, H]
    assert enabled(router) == [0, 1, 2]


def test_an_unexpected_error_before_the_stop_stops_the_old_processes_too(tmp_path):
    """A leader still running its old process, put back by a sweep without its gates, would
    serve with no share recorded: what did not pass is stopped, and restarted properly."""
    state, router, sup, _, _ = sharing_run(tmp_path)

    class Broken:
        def decide(self, history, now):
            raise OSError(28, "No space left on device")

    sup.crew.policy = Broken()
    sup.restart_replica(0, "/health answered 503 (3 in a row)", [0, 1, 2])
    assert ("stop", 0, 1, 2) in sup.replicas.calls
    assert [r.state for r in state.replicas] == [D, D, D] and enabled(router) == []
    assert not sup.router.not_in_router  # nothing left running that a sweep could put back
    [event] = [e for e in events(state) if e["event"] == "restart_failed"]
    assert event["stopped"] == [0, 1, 2] and event["ungated"] == []


def test_a_follower_whose_leader_died_meanwhile_waits_uncharged_for_its_groups_restart(tmp_path):
    state = make_state(tmp_path, replicas=3, share=True)
    sup, world, _ = supervisor(state)
    real, handed, release = sup.restart_replica, [], threading.Event()

    def held(index, reason, group):
        handed.append((index, list(group)))
        if index == 1:
            release.wait(10)  # follower 1's own restart is still under way when...
        real(index, reason, group)

    sup.restart_replica = held
    world.live.discard(1001)
    sup.sweep()
    world.live -= {1000, 1002}  # ...the leader dies, and follower 2 exits 4
    sup.sweep()  # the leader is left alone (follower 1's restart runs): follower 2 is handed
    release.set()
    sup.busy.join(5)
    assert handed == [(1, [1]), (2, [2])]
    why = "waiting for its leader (replica 0), which is gone"
    for i in (1, 2):  # neither started against a dead leader, neither charged
        assert (state.replica(i).state, state.replica(i).last_error) == (D, why)
        assert state.replica(i).restarts == ()
    assert not [c for c in sup.replicas.calls if c[0] in ("start", "stop")]
    assert sorted(e["replica"] for e in events(state) if e["event"] == "restart_deferred") == [1, 2]
    sup.sweep()  # now the dead leader is seen: its whole group restarts, the leader charged
    sup.busy.join(5)
    assert handed[2:] == [(0, [0, 1, 2])]
    assert [r.state for r in state.replicas] == [H, H, H]
    assert [r.restarts for r in state.replicas] == [(NOW,), (), ()]


def test_a_follower_restarted_with_its_leader_is_not_charged_for_it(tmp_path):
    state = make_state(tmp_path, replicas=3, share=True, budget=1)
    sup, world, _ = supervisor(state)
    world.live.discard(1000)
    sup.sweep()
    sup.busy.join(5)
    assert [len(r.restarts) for r in state.replicas] == [1, 0, 0]
    world.live.discard(state.replica(1).pid)  # follower 1's own first crash: restarted
    sup.sweep()
    sup.busy.join(5)
    assert [r.state for r in state.replicas] == [H, H, H]
    assert [len(r.restarts) for r in state.replicas] == [1, 1, 0]


def test_a_failed_follower_stays_failed_and_out_of_the_router_when_its_leader_restarts(
        tmp_path):
    state = make_state(tmp_path, replicas=3, share=True, budget=1)
    for step in (R, F):  # out of its own budget
        state.update_replica(2, state=step, restarts=(NOW - 5,))
    router = FakeRouter()
    sup, world, said = supervisor(state, router=router)
    world.live -= {1000, 1002}
    real, handed = sup.restart_replica, []
    sup.restart_replica = lambda index, reason, group: (handed.append(list(group)),
                                                       real(index, reason, group))
    sup.sweep()
    sup.busy.join(5)
    assert handed == [[0, 1]] and ("start", 2) not in sup.replicas.calls
    assert [r.state for r in state.replicas] == [H, H, F] and 2 not in enabled(router)
    assert state.replica(2).restarts == (NOW - 5,)
    [left] = [e for e in events(state) if e["event"] == "restart_left_out"]
    assert (left["replica"], left["group_of"], left["state"]) == (2, 0, "failed")
    assert said[0] == ("replica 0: its process is gone; restarting with replica(s) 1, which "
                       "depend on it; replica 2, which depends on it, stays failed (out of its "
                       "own restart budget), out of the router")


def test_a_stopped_follower_is_neither_labelled_nor_handed_to_its_leaders_restart(tmp_path):
    state = make_state(tmp_path, replicas=3, share=True)
    state.update_replica(2, state=S)
    sup, world, said = supervisor(state)
    world.live.discard(1000)
    real, handed = sup.restart_replica, []
    sup.restart_replica = lambda index, reason, group: (handed.append(list(group)),
                                                       real(index, reason, group))
    sup.sweep()
    sup.busy.join(5)
    assert handed == [[0, 1]] and ("start", 2) not in sup.replicas.calls
    assert said[0].startswith("replica 0: its process is gone; restarting with replica(s) 1, "
                              "which depend on it; replica 2, which depends on it, is stopped")
    assert [r.state for r in state.replicas] == [H, H, S]
    assert restart_group(sup.busy.deps, state.record, 1) == ([1], [])


def test_the_share_proof_is_gone_once_the_leaders_restart_begins_or_it_fails(tmp_path):
    state = make_state(tmp_path, replicas=3, share=True)
    share_proof(state)
    sup, world, _ = supervisor(state)
    real, seen = sup.restart_replica, []
    sup.restart_replica = lambda index, reason, group: (seen.append(state.record.share),
                                                       real(index, reason, group))
    world.live.discard(1000)
    sup.sweep()
    sup.busy.join(5)
    assert seen == [None]  # not while the restart runs: the leader publishes nothing then
    over = make_state(tmp_path / "over", replicas=3, share=True, budget=1,
                      restarts=(NOW - 10,))
    share_proof(over)
    sup, _, _ = supervisor(over)
    sup.restart_replica.through_gates(0, "its process is gone", [0, 1, 2])
    sup.apply_outcomes()
    assert over.record.share is None and over.replica(0).state is F
    assert collect(over, probe=False)["share"]["leader_state"] == "failed"
    text = format_status(collect(over, probe=False))
    assert "not published (the leader is failed, out of its restart budget)" in text


def test_a_followers_restart_keeps_the_leaders_proof_without_that_follower(tmp_path):
    state = make_state(tmp_path, replicas=3, share=True)
    share = share_proof(state)
    sup, world, _ = supervisor(state)
    world.live.discard(1002)
    sup.sweep()
    assert state.record.share == replace(share, followers=(1,))
    sup.busy.join(5)
    assert state.replica(2).state is H  # the fake gate proves nothing: not listed again


def test_once_teardown_began_a_restart_writes_and_says_nothing(tmp_path):
    state = make_state(tmp_path, replicas=3, share=True)
    sup, _, said = supervisor(state)
    wait_healthy = sup.replicas.wait_healthy

    def teardown_begins(index, timeout_s):
        sup.crew.gate.close()
        raise GateFailed("not healthy: it was stopped")

    sup.replicas.wait_healthy = teardown_begins
    sup.restart_replica(0, "its process is gone", [0, 1, 2])
    assert said == [] and [r.state for r in state.replicas] == [S, S, S]
    assert not [e for e in events(state) if e["event"] in ("restart_failed", "replica_failed")]
    sup.replicas.wait_healthy = wait_healthy
    over = make_state(tmp_path / "over", replicas=3, share=True, budget=0)
    sup, _, said = supervisor(over)
    sup.crew.gate.close()
    sup.restart_replica.through_gates(0, "its process is gone", [0, 1, 2])
    assert said == [] and [r.state for r in over.replicas] == [H, H, H]
    assert ("stop", 0, 1, 2) not in sup.replicas.calls


def test_a_restarted_follower_says_every_gate_it_passed(tmp_path):
    state = make_state(tmp_path, replicas=3, share=True)
    sup, world, said = supervisor(state)
    world.live.discard(1002)
    sup.sweep()
    sup.busy.join(5)
    assert said[-1] == (f"replica 2: restarted (pid {state.replica(2).pid}), passed its gates "
                        "(health, processes, KV, share), back in the router")


# --- the MPS daemon --------------------------------------------------------------------------


def test_an_mps_fault_restarts_every_dependent_replica_and_no_sweep_touches_them_meanwhile(
        tmp_path):
    state = make_state(tmp_path, mps=True)
    sup, world, said = supervisor(state)
    began, release, groups = threading.Event(), threading.Event(), []

    def group_restart(record, fault, indices, delay):
        groups.append((record.identity.pid, fault, indices, delay))
        began.set()
        release.wait(10)
        for i in indices:  # it ends, as a restart whose start failed: down, watched again
            state.update_replica(i, state=ReplicaState.DOWN, last_error="start failed")

    replica_restarts: list[int] = []
    sup.restart_group = group_restart
    sup.restart_replica = lambda index, reason, group: replica_restarts.append(index)
    world.daemon = DaemonHealth(alive=False, reachable=False)
    world.live -= {800, 1000}  # the daemon and one of its clients are gone
    world.health_of["http://replica-1.test"] = 503
    try:
        sup.sweep()
        assert began.wait(5)
        assert groups == [(800, "the MPS daemon is gone", [0, 1], 0.0)]
        assert said == ["the MPS daemon is gone: every replica is suspect"]
        assert replica_restarts == []  # the daemon was checked first: one fault, one restart
        for _ in range(3):  # meanwhile: no sweep looks at the replicas or the daemon
            sup.sweep()
        assert replica_restarts == [] and world.daemon_checks == 1
        # restarting, written by the loop as it handed them over (the thread only waits)
        assert [r.state for r in state.replicas] == [R, R] and sup.watches[1].failures == 0
        assert {r.last_error for r in state.replicas} == {"the MPS daemon is gone"}
        assert sup._watched() == [state.record.router.identity]
        [fault] = [e for e in events(state) if e["event"] == "mps_fault"]
        assert (fault["action"], fault["restarts_in_window"]) == ("restart", 0)
    finally:
        release.set()
        sup.busy.join(5)
    world.daemon = DaemonHealth(alive=True, reachable=True)
    sup.sweep()  # the restart is over: the replicas are watched again
    sup.busy.join(5)
    assert replica_restarts == [0] and world.daemon_checks == 2


def test_a_replica_restart_in_progress_defers_the_daemon_check(tmp_path):
    state = make_state(tmp_path, mps=True)
    sup, world, _ = supervisor(state)
    release = threading.Event()
    sup.restart_replica = lambda index, reason, group: release.wait(10)
    world.live.discard(1000)
    try:
        sup.sweep()  # the daemon is fine, replica 0 is dead: its restart begins
        assert Slot.replica(0) in sup.busy.slots() and world.daemon_checks == 1
        world.daemon = DaemonHealth(alive=False, reachable=False)
        sup.sweep()  # a group restart now would race the replica's restart
        assert world.daemon_checks == 1 and "mps_fault" not in names(state)
    finally:
        release.set()
        sup.busy.join(5)
    sup.restart_group = lambda *args: None
    sup.sweep()
    assert "mps_fault" in names(state)


def test_mps_restarts_are_budgeted_like_every_other(tmp_path):
    state = make_state(tmp_path, mps=True, budget=1)
    sup, world, said = supervisor(state)
    sup.restart_group = lambda *args: None
    world.daemon = DaemonHealth(alive=True, reachable=False, error="timed out")
    sup.sweep()
    sup.busy.join(5)
    assert not sup.stop_requested.is_set()
    sup.crew.clock.now += 5
    sup.sweep()
    assert sup.exit_code == 3 and sup.stop_requested.is_set()
    assert said[-1] == ("1 MPS restarts within 600 s: the restart budget is spent; stopping "
                        "the run")
    faults = [e for e in events(state) if e["event"] == "mps_fault"]
    assert [(f["action"], f["restarts_in_window"]) for f in faults] == [("restart", 0),
                                                                       ("fail", 1)]
    assert faults[0]["detail"] == "the MPS daemon does not answer (timed out)"


def test_a_sweep_that_stopped_the_run_begins_no_restart(tmp_path):
    state = make_state(tmp_path, mps=True, on_mps_fault="fail")
    sup, world, said = supervisor(state)
    sup.restart_replica = lambda *args: pytest.fail("a restart during the teardown")
    world.daemon = DaemonHealth(alive=False, reachable=False)
    world.live.discard(1000)  # its client died with it
    sup.sweep()
    sup.busy.join(5)
    assert sup.exit_code == 3 and sup.stop_requested.is_set()
    assert said == ["the MPS daemon is gone: every replica is suspect"]
    assert state.replica(0).state is H and sup.busy.slots() == set()


def test_on_mps_fault_fail_stops_without_restarting():
    watch = MpsWatch(RestartPolicy(5, 600.0), "fail")
    act = watch.decide(NOW, "the MPS daemon is gone")
    assert (act.action, act.over_budget) == ("fail", False) and watch.restarts == ()
    watch = MpsWatch(RestartPolicy(5, 600.0), "restart")
    assert watch.decide(NOW, "x").delay == 0.0 and watch.decide(NOW + 1, "x").delay == 1.0


def test_faults_in_the_logs_are_named_three_at_most():
    health = DaemonHealth(alive=True, reachable=True,
                          faults=["a: MpsRpc 1", "b: FAULT 2", "c: FAULT 3", "d: FAULT 4"])
    assert describe_fault(health) == "MPS faults in the logs: a: MpsRpc 1; b: FAULT 2; c: FAULT 3"
    assert describe_fault(DaemonHealth(alive=True, reachable=True)) is None


def fake_daemon_restart(monkeypatch) -> list[str]:
    """The group restart's daemon and bring-up, faked: returns what was done to daemons."""
    daemons: list[str] = []
    monkeypatch.setattr(mps_restart, "MpsDaemon", lambda control: SimpleNamespace(
        stop=lambda record, force: daemons.append(f"stop {record.identity.pid}")))
    monkeypatch.setattr(mps_restart, "start_daemon",
                        lambda state, gpu, binary, server: daemons.append(f"{binary} {gpu}"))

    def start_replicas(state, replicas, indices, *, sequential, timeout_s, say):
        for i in indices:
            replicas.start(i)
            state.update_replica(i, state=H)

    monkeypatch.setattr(mps_restart, "start_replicas", start_replicas)
    return daemons


def test_the_group_restart_brings_every_client_back_through_the_gates(tmp_path, monkeypatch):
    state = make_state(tmp_path, mps=True)
    sup, _, said = supervisor(state)
    daemons = fake_daemon_restart(monkeypatch)
    old_log = state.logs / "replica_0.log"
    old_log.write_text("cudaErrorMpsServerNotReady\n")
    sup.watches[1].failures = 1
    sup.restart_group(state.record.daemon(0), "the MPS daemon is gone", [0, 1])
    assert daemons == ["stop 800", "mps-control 0"]
    assert ("stop", 0, 1) in sup.replicas.calls
    assert [r.state for r in state.replicas] == [H, H]
    assert [r.last_error for r in state.replicas] == [None, None]
    assert not old_log.exists() and list(state.logs.glob("replica_0.log.*"))
    sup.apply_outcomes()
    assert names(state)[-1] == "mps_restarted" and sup.watches[1].failures == 0
    assert said == ["MPS daemon and every replica restarted and verified; all back in the "
                    "router"]


def test_a_group_restart_whose_clients_do_not_attach_is_never_reported_verified(
        tmp_path, monkeypatch):
    state = make_state(tmp_path, mps=True)
    sup, _, said = supervisor(state)
    fake_daemon_restart(monkeypatch)
    sup.replicas.attached = False
    sup.restart_group(state.record.daemon(0), "the MPS daemon is gone", [0, 1])
    assert sup.exit_code == 3 and sup.stop_requested.is_set()
    assert said == ["restarting after the MPS fault failed: MPS attachment FAILED after the "
                    "daemon restart; stopping the run"]
    assert "mps_restarted" not in names(state) and "router_enabled" not in names(state)
    assert names(state)[-1] == "mps_restart_failed"


def test_a_group_restart_the_router_refuses_says_which_replicas_are_not_back(tmp_path,
                                                                           monkeypatch):
    state = make_state(tmp_path, mps=True)
    router = FakeRouter()
    router.answer[False] = (503, None)
    sup, _, said = supervisor(state, router=router)
    fake_daemon_restart(monkeypatch)
    sup.restart_group(state.record.daemon(0), "the MPS daemon is gone", [0, 1])
    assert sup.router.not_in_router == {0, 1} and not sup.stop_requested.is_set()
    assert said[-1] == ("MPS daemon and every replica restarted and verified; replica(s) 0, 1 "
                        "NOT back in the router (above), retried at every sweep")
    assert not any("all back in the router" in s for s in said)
    [done] = [e for e in events(state) if e["event"] == "mps_restarted"]
    assert done["not_in_router"] == [0, 1]
    assert all("answered 503" in r.last_error for r in state.replicas)


def test_a_failed_group_restart_stops_the_run(tmp_path, monkeypatch):
    def no_daemon(*args):
        raise BringUpFailed("the MPS daemon did not start: no GPU")

    monkeypatch.setattr(mps_restart, "start_daemon", no_daemon)
    monkeypatch.setattr(mps_restart, "MpsDaemon",
                        lambda control: SimpleNamespace(stop=lambda record, force: True))
    state = make_state(tmp_path, mps=True)
    sup, _, said = supervisor(state)
    sup.restart_group(state.record.daemon(0), "the MPS daemon is gone", [0, 1])
    assert sup.exit_code == 3 and sup.stop_requested.is_set()
    assert said[-1] == ("restarting after the MPS fault failed: the MPS daemon did not start: "
                        "no GPU; stopping the run")
    assert [r.state for r in state.replicas] == [ReplicaState.STOPPED] * 2


def test_replica_logs_are_scanned_for_new_fault_lines_only(tmp_path):
    log = tmp_path / "replica_0.log"
    log.write_text("ok\ncudaErrorMpsConnectionFailed here\n")
    scanner = FaultScanner()
    assert scanner.new_faults([log, tmp_path / "missing.log"]) == [
        "replica_0.log: cudaErrorMpsConnectionFailed here"]
    assert scanner.new_faults([log]) == []
    with log.open("a") as f:
        f.write("still ok\nMpsRpc broke\n")
    assert scanner.new_faults([log]) == ["replica_0.log: MpsRpc broke"]
    log.write_text("FAULT x\n")  # replaced by a shorter file: read from its start
    assert scanner.new_faults([log]) == ["replica_0.log: FAULT x"]
    scanner.set_aside([log], 7)
    assert not log.exists() and (tmp_path / "replica_0.log.7").read_text() == "FAULT x\n"
    log.write_text("FAULT y\nthe new log is longer than the old one\n")
    assert scanner.new_faults([log]) == ["replica_0.log: FAULT y"]  # not read from byte 8


# --- a run over several GPUs: one daemon per GPU, each fault its own GPU's ---------------------

GPU1 = "GPU 1 (NVIDIA H200)"


def two_gpu_run(tmp_path, **changes) -> tuple[RunState, FakeRouter, Supervisor, FakeWorld,
                                               list[str]]:
    """Four replicas under MPS over two GPUs (0, 1 on GPU slot 0; 2, 3 on slot 1), one daemon
    each (pids 800, 801), supervised with a fake world and a router whose calls are kept."""
    state = make_state(tmp_path, replicas=4, mps=True, gpus=2, **changes)
    router = FakeRouter()
    sup, world, said = supervisor(state, router=router)
    return state, router, sup, world, said


def workers(router: FakeRouter) -> set[int]:
    """The replicas the router was asked to take out or put back."""
    return {int(url.rsplit("/", 1)[1]) for url, _, _ in router.calls}


def test_over_two_gpus_each_replica_depends_on_its_own_gpus_daemon_only(tmp_path):
    deps = run_slots(make_state(tmp_path, replicas=4, mps=True, gpus=2).record)
    assert [s for s in deps.slots if s.kind == "mps"] == [Slot.mps(0), Slot.mps(1)]
    assert deps.dependents(Slot.mps(0)) == [Slot.replica(0), Slot.replica(1)]
    assert deps.dependents(Slot.mps(1)) == [Slot.replica(2), Slot.replica(3)]
    assert deps.prerequisites(Slot.replica(2)) == {Slot.mps(1)}
    assert deps.order() == [Slot.mps(0), Slot.replica(0), Slot.replica(1), Slot.mps(1),
                            Slot.replica(2), Slot.replica(3), ROUTER]  # each daemon first
    # a restart of GPU 1's daemon leaves GPU 0's daemon and replicas free to be watched
    assert deps.related(Slot.mps(1)) == {Slot.mps(1), Slot.replica(2), Slot.replica(3)}
    assert str(Slot.mps(1)) == "mps 1"
    plain = run_slots(make_state(tmp_path / "plain", replicas=4, gpus=2).record)
    assert not [s for s in plain.slots if s.kind == "mps"]


def test_a_dead_daemon_on_one_gpu_hands_over_only_its_replicas_and_the_other_gpu_stays_watched(
        tmp_path):
    state, _, sup, world, said = two_gpu_run(tmp_path)
    began, release, groups = threading.Event(), threading.Event(), []

    def group_restart(record, fault, indices, delay):
        groups.append((record.identity.pid, record.gpu, fault, indices))
        began.set()
        release.wait(10)

    replica_restarts: list[int] = []
    sup.restart_group = group_restart
    sup.restart_replica = lambda index, reason, group: replica_restarts.append(index)
    world.daemon_of[1] = DaemonHealth(alive=False, reachable=False)
    world.live -= {801, 1002}  # GPU 1's daemon and one of its clients are gone
    try:
        sup.sweep()
        assert began.wait(5)
        gone = f"the MPS daemon of {GPU1} is gone"
        assert groups == [(801, 1, gone, [2, 3])]
        assert said == [f"{gone}: its replica(s) 2, 3 are suspect, the other GPUs' not"]
        [fault] = [e for e in events(state) if e["event"] == "mps_fault"]
        assert fault["gpu"] == 1 and fault["detail"] == gone
        assert Slot.mps(1) in sup.busy.slots() and Slot.mps(0) not in sup.busy.slots()
        # meanwhile GPU 0's daemon and replicas are watched, GPU 1's are left to the restart
        assert set(sup._watched()) == {state.record.router.identity,
                                       state.record.daemon(0).identity,
                                       state.replica(0).identity, state.replica(1).identity}
        world.live.discard(1000)
        sup.sweep()
        sup.busy.join(0.5)
        assert replica_restarts == [0]  # GPU 0's replica restarts on its own, at once
        assert world.checked == [0, 1, 0]  # GPU 1's daemon is not looked at meanwhile
    finally:
        release.set()
        sup.busy.join(5)


def test_a_fault_on_gpu_1_restarts_only_gpu_1s_daemon_and_replicas(tmp_path, monkeypatch):
    state, router, sup, world, said = two_gpu_run(tmp_path)
    daemons = fake_daemon_restart(monkeypatch)
    before = [state.replica(i) for i in (0, 1)]
    world.daemon_of[1] = DaemonHealth(alive=True, reachable=False, error="timed out")
    sup.sweep()
    sup.busy.join(5)
    assert daemons == ["stop 801", "mps-control 1"]  # GPU 1's daemon, started on GPU 1
    calls = sup.replicas.calls
    assert ("stop", 2, 3) in calls and ("verify_attachment", 1) in calls
    assert {c[1] for c in calls if c[0] == "start"} == {2, 3}
    assert not [c for c in calls if c[0] == "stop" and {0, 1} & set(c[1:])]
    assert ("verify_attachment", 0) not in calls
    assert workers(router) == {2, 3}  # 0 and 1 never left the router
    assert [state.replica(i) for i in (0, 1)] == before  # not restarted, not even marked
    assert [r.state for r in state.replicas] == [H] * 4
    assert said[-1] == (f"MPS daemon of {GPU1} and its replica(s) 2, 3 restarted and "
                        "verified; all back in the router")
    [done] = [e for e in events(state) if e["event"] == "mps_restarted"]
    assert done["gpu"] == 1 and done["replicas"] == [2, 3]


def test_each_gpus_daemon_has_its_own_restart_budget(tmp_path):
    state, _, sup, world, said = two_gpu_run(tmp_path, budget=1)
    sup.restart_group = lambda *args: None
    world.daemon_of[0] = DaemonHealth(alive=True, reachable=False, error="timed out")
    sup.sweep()
    sup.busy.join(5)
    assert len(sup.mps[0].restarts) == 1 and sup.mps[1].restarts == ()
    del world.daemon_of[0]
    sup.crew.clock.now += 5
    world.daemon_of[1] = DaemonHealth(alive=False, reachable=False)
    sup.sweep()  # GPU 0 spent its budget, GPU 1 has not: restarted, the run goes on
    sup.busy.join(5)
    assert not sup.stop_requested.is_set()
    assert len(sup.mps[0].restarts) == 1 and len(sup.mps[1].restarts) == 1
    sup.crew.clock.now += 5
    sup.sweep()  # GPU 1 again: its own budget is spent now
    assert sup.exit_code == 3 and sup.stop_requested.is_set()
    assert said[-1] == (f"1 MPS restarts on {GPU1} within 600 s: the restart budget is spent; "
                        "stopping the run")
    faults = [(e["gpu"], e["action"]) for e in events(state) if e["event"] == "mps_fault"]
    assert faults == [(0, "restart"), (1, "restart"), (1, "fail")]


def test_a_gpus_fault_scan_reads_its_own_replicas_logs_only(tmp_path):
    state, _, sup, _, said = two_gpu_run(tmp_path)
    groups: list[tuple[int, list[int]]] = []
    sup.restart_group = lambda record, fault, indices, delay: groups.append((record.gpu,
                                                                             indices))
    for i in range(4):
        (state.logs / f"replica_{i}.log").write_text("ok\n")
    (state.logs / "replica_2.log").write_text("cudaErrorMpsConnectionFailed\n")
    sup.sweep()
    sup.busy.join(5)
    assert groups == [(1, [2, 3])]  # GPU 1's client logged it: GPU 1's fault, GPU 0 is fine
    assert said == [f"MPS faults in the logs of {GPU1}: replica_2.log: "
                    "cudaErrorMpsConnectionFailed: its replica(s) 2, 3 are suspect, the other "
                    "GPUs' not"]
    logs = [state.logs / f"replica_{i}.log" for i in range(4)]
    assert set(sup.mps[0].scanner.offsets) == set(logs[:2])  # each scanner: its GPU's logs
    assert set(sup.mps[1].scanner.offsets) == set(logs[2:])


def test_a_restarted_replica_is_verified_against_its_own_gpus_daemon(tmp_path):
    state, _, sup, world, said = two_gpu_run(tmp_path)
    world.live.discard(1003)  # replica 3, on GPU 1
    sup.sweep()
    sup.busy.join(5)
    verified = [c for c in sup.replicas.calls if c[0] == "verify_attachment"]
    assert verified == [("verify_attachment", 1)]
    assert said[-1] == (f"replica 3: restarted (pid {state.replica(3).pid}), passed its gates "
                        "(health, processes, KV, MPS attachment), back in the router")


def test_two_threads_telling_the_same_follower_to_wait_say_it_once(tmp_path):
    """The followers told to wait are one set shared by every restart thread: "which are
    new?" and "now they are told" are one step, so a thread that comes between them (here:
    while the first writes the follower down) finds it told already."""
    state = make_state(tmp_path, replicas=3, share=True)
    sup, world, said = supervisor(state)
    world.live.discard(1000)  # the leader is gone
    write, second = state.write, []

    def hooked(change):
        if threading.current_thread().name == "first" and not second:
            other = threading.Thread(target=sup.restart_replica._leader_gone, args=([1],),
                                     name="second")
            second.append(other)
            other.start()
            other.join(5)
        return write(change)

    state.write = hooked
    first = threading.Thread(target=sup.restart_replica._leader_gone, args=([1],),
                             name="first")
    first.start()
    first.join(5)
    assert second and not second[0].is_alive()
    assert [e["replica"] for e in events(state) if e["event"] == "restart_deferred"] == [1]
    assert len([s for s in said if "not restarted alone" in s]) == 1


def test_shared_indices_add_new_reports_each_index_new_to_one_caller_only():
    from omni_dp.launcher.supervision.indices import SharedIndices

    shared, told = SharedIndices(), []
    start = threading.Barrier(8)

    def claim():
        start.wait(5)
        for i in range(2000):
            told.extend(shared.add_new([i]))

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(told) == list(range(2000)) and shared == set(range(2000))


# --- outcomes: what a thread reports, the loop applies -----------------------------------


def test_outcomes_are_applied_by_the_loop_in_order_and_nothing_before(tmp_path):
    """Outcome in → record out, no thread: a spent budget reported is written (failed, the
    event, said) only when the loop applies it; a pass resets the loop's own watch."""
    from omni_dp.launcher.supervision.outcomes import GatesPassed, GaveUp

    state = make_state(tmp_path, replicas=3, share=True)
    sup, _, said = supervisor(state)
    sup.watches[2].failures = 2
    for i in (0, 1):
        state.update_replica(i, state=R)
    sup.outcomes.report(GaveUp(0, (0, 1), "restart budget exhausted"))
    sup.outcomes.report(GatesPassed(2))
    assert [r.state for r in state.replicas] == [R, R, H] and sup.watches[2].failures == 2
    sup.apply_outcomes()
    assert [r.state for r in state.replicas] == [F, F, H]
    assert state.replica(1).last_error == ("restart budget exhausted (of replica 0, which it "
                                           "depends on)")
    assert [e["replica"] for e in events(state) if e["event"] == "replica_failed"] == [0, 1]
    assert said == ["replica 0: restart budget exhausted; it stays out of the router",
                    "replica 1: restart budget exhausted (of replica 0, which it depends on); "
                    "it stays out of the router"]
    assert sup.watches[2].failures == 0
    sup.apply_outcomes()  # taken once
    assert len(said) == 2


def test_a_spent_budget_reported_after_teardown_began_is_left_to_teardown(tmp_path):
    from omni_dp.launcher.supervision.outcomes import GaveUp

    state = make_state(tmp_path)
    sup, _, said = supervisor(state)
    state.update_replica(0, state=R)
    sup.outcomes.report(GaveUp(0, (0,), "restart budget exhausted"))
    sup.crew.gate.close()
    sup.apply_outcomes()
    assert state.replica(0).state is R and not said


def test_the_sweep_follows_a_record_a_scale_reshaped_without_being_told(tmp_path):
    """A change adds or removes replicas in the record; the loop's slots and watches follow
    at its next sweep (nothing calls into the loop from the change's thread)."""
    state = make_state(tmp_path, replicas=3)
    sup, world, _ = supervisor(state)
    state.set_scale(state.replicas[:2], replace(state.plan, replicas=2), state.record.gpus)
    sup.sweep()
    assert sorted(sup.watches) == [0, 1]
    assert Slot.replica(2) not in sup.busy.deps.slots
    state.set_scale((*state.replicas, replace(state.replicas[1], index=2, port=41002,
                                              url="http://replica-2.test")),
                    replace(state.plan, replicas=3), state.record.gpus)
    world.live.add(1001)
    sup.sweep()
    assert sorted(sup.watches) == [0, 1, 2] and Slot.replica(2) in sup.busy.deps.slots
