"""The supervisor's side of a day-two change (supervision/change_runner.py), followed as the
command follows it (changes/follow.py) and ended as the command ends it (exit code, last line):
the fakes of support/supervision.py, one admin router that records every call on the same
timeline as the replicas' calls; no process is started.

What the live test (test_changes_live.py) cannot show under load, since the router's retries
hide it: that each replica leaves the router and drains BEFORE it is stopped, that a change
stops at its first failed step, that the command exits 3 then — and that the command says
"out of the router" only when the router took the replica out."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

import pytest

from omni_dp.cli.commands.changes import _ask
from omni_dp.contract import ExitCode
from omni_dp.launcher.changes.follow import ask_and_follow, describe
from omni_dp.launcher.changes.request import ChangeRequest, Step, read_change, take
from omni_dp.launcher.record.state import RunState
from omni_dp.launcher.supervision.slots import Slot
from omni_dp.launcher.supervision.supervisor import Supervisor
from omni_dp.procs import identify
from omni_dp.runfile import ReplicaState, SupervisorRecord

from support.supervision import FakeWorld, TickingStop, make_state, supervisor


class AdminRouter:
    """The router's admin API (PUT, POST, DELETE /workers) and GET /workers' in-flight counts,
    each call written to `timeline` (the fake replicas' own call list) so that the test reads
    one order of everything. `refuse` maps a call ("out", "in", "add", "remove") to the
    (status, body) the router answers instead of 200."""

    def __init__(self, timeline: list[tuple], in_flight: tuple[int, ...] = (2, 1, 0)) -> None:
        self.timeline = timeline
        self.in_flight = in_flight  # each replica's count, poll after poll, then 0
        self.polls: dict[int, int] = {}
        self.refuse: dict[str, tuple[int, object]] = {}
        self.disabled: set[int] = set()  # taken out by a PUT the router answered 2xx
        self.ejected: set[int] = set()  # found unhealthy by the router's own checks

    def __call__(self, method, url, body=None, timeout=3.0, headers=None):
        index = int(url.rsplit("/", 1)[1]) if method != "POST" else int(body["id"])
        call = {"PUT": "out" if body and body.get("disabled") else "in", "POST": "add",
                "DELETE": "remove"}[method]
        self.timeline.append((call, index))
        answer = self.refuse.get(call, (200, {}))
        if 200 <= answer[0] < 300 and call in ("out", "in"):
            (self.disabled.add if call == "out" else self.disabled.discard)(index)
        return answer

    def workers(self) -> list[dict]:
        """GET /workers: each replica's in-flight count, one step further at each poll, and
        whether the router routes to it (as the real router describes a replica)."""
        entries = []
        for i in range(8):
            n = self.polls.get(i, 0)
            count = self.in_flight[n] if n < len(self.in_flight) else 0
            health = "unhealthy" if i in self.ejected else "healthy"
            entries.append({"id": str(i), "in_flight": count, "disabled": i in self.disabled,
                            "health": health,
                            "ejected_reason": "failures" if i in self.ejected else None,
                            "routable": i not in self.disabled and i not in self.ejected})
        return entries

    def polled(self, index: int) -> None:
        n = self.polls.get(index, 0)
        count = self.in_flight[n] if n < len(self.in_flight) else 0
        self.timeline.append(("in_flight", index, count))
        self.polls[index] = n + 1


class PolledWorld(FakeWorld):
    """The world whose GET /workers is the admin router's, one poll per drain step."""

    def __init__(self, live: set[int], router: AdminRouter) -> None:
        super().__init__(live)
        self.admin = router
        self.asked: int | None = None

    def router_workers(self, url, api_key):
        return self.admin.workers()


@dataclass
class Run:
    state: RunState
    sup: Supervisor
    router: AdminRouter
    timeline: list[tuple]  # the replicas' calls and the router's, in one order
    stop: TickingStop  # its waits pass on the supervisor's fake clock


def a_run(tmp_path, replicas: int = 3, in_flight: tuple[int, ...] = (2, 1, 0),
          share: bool = False) -> Run:
    """A live run of `replicas` healthy replicas, its supervisor on fakes, the admin router."""
    state = make_state(tmp_path, replicas=replicas, share=share)
    sup, world, _ = supervisor(state)
    timeline = sup.replicas.calls
    router = AdminRouter(timeline, in_flight)
    polled = PolledWorld(world.live, router)
    sup.crew.probe = sup.replicas.world = polled
    sup.router.http = router
    stop = TickingStop(sup.crew.clock)
    sup.crew.stop = stop  # the drain's polls, the slot waits and the others' do not sleep
    sup.router.in_flight = _counting(sup.router.in_flight, router)
    return Run(state, sup, router, timeline, stop)


def _counting(in_flight, router: AdminRouter):
    """RouterLink.in_flight, each poll written to the timeline."""

    def polled(index: int) -> int | None:
        value = in_flight(index)
        router.polled(index)
        return value

    return polled


def restart(*replicas: int, wait: float = 30.0) -> ChangeRequest:
    return ChangeRequest("restart", tuple(Step("restart", i) for i in replicas),
                         f"restart replicas {', '.join(map(str, replicas))}", drain_timeout=5.0,
                         wait_healthy=wait)


def scale_down(state, to: int, wait: float = 30.0) -> ChangeRequest:
    plan = dataclasses.replace(state.record.plan, replicas=to)
    return ChangeRequest("scale", tuple(Step("remove", i)
                                        for i in range(len(state.replicas) - 1, to - 1, -1)),
                         f"scale to {to}", drain_timeout=5.0, plan=plan, wait_healthy=wait)


def followed(state, sup, request: ChangeRequest):
    """The command's side (ask_and_follow) against the supervisor's (take, then the change
    runner in its own thread, as the sweep does): the outcome and every line said."""

    def supervise() -> None:
        while (change := take(state.directory)) is None:
            threading.Event().wait(0.05)
        sup.change(change)

    thread = threading.Thread(target=supervise, daemon=True)
    thread.start()
    lines: list[str] = []
    outcome = ask_and_follow(state.directory, request, None, lines.append)
    thread.join(10)
    assert not thread.is_alive()
    return outcome, lines


def order(timeline: list[tuple], index: int) -> list[str]:
    """What happened to one replica, in order (in-flight polls by their count)."""
    return [c[0] if c[0] != "in_flight" else f"in_flight={c[2]}"
            for c in timeline if c[1] == index and c[0] in
            ("out", "in_flight", "stop", "start", "wait_healthy", "in", "remove")]


# --- restart ------------------------------------------------------------------------------


def test_a_restart_takes_each_replica_out_and_drains_it_before_its_stop_one_at_a_time(
        tmp_path):
    run = a_run(tmp_path)
    state, sup, timeline = run.state, run.sup, run.timeline
    outcome, lines = followed(state, sup, restart(0, 1, 2))
    assert outcome.ok, outcome.error
    for i in range(3):
        assert order(timeline, i) == ["out", "in_flight=2", "in_flight=1", "in_flight=0",
                                      "stop", "start", "wait_healthy", "in"], i
    # one at a time: a replica leaves the router only once the one before is back in it
    assert timeline.index(("in", 0)) < timeline.index(("out", 1))
    assert timeline.index(("in", 1)) < timeline.index(("out", 2))
    drained = [line for line in lines if "out of the router" in line]
    assert [line.split(":")[0] for line in drained] == ["replica 0", "replica 1", "replica 2"]
    assert all("drained in" in line for line in drained), drained
    assert sum("back in the router" in line for line in lines) == 3, lines
    assert outcome.stopped_in_router == []
    assert read_change(state.directory).state == "done"


def test_a_replica_still_busy_at_the_drain_bound_is_said_busy_not_drained(tmp_path):
    run = a_run(tmp_path, replicas=2, in_flight=(1,) * 10**6)
    state, sup, timeline = run.state, run.sup, run.timeline
    sup.crew.clock = iter(range(0, 10**6, 1)).__next__  # a second per look: the bound passes
    outcome, lines = followed(state, sup, restart(0))
    assert outcome.ok, outcome.error
    assert order(timeline, 0)[:2] == ["out", "in_flight=1"]
    assert order(timeline, 0).index("stop") > order(timeline, 0).index("in_flight=1")
    [line] = [line for line in lines if line.startswith("replica 0: out of the router")]
    assert "still busy after" in line and "drained in" not in line


def test_a_router_that_does_not_take_a_replica_out_is_said_and_no_drain_is_claimed(
        tmp_path, capsys):
    """The command says 'out of the router' only on the router's 2xx: a refusal is said with
    the router's words, the replica is stopped without a drain (no in-flight poll), and the
    last line and --json say which replica that was."""
    run = a_run(tmp_path, replicas=2)
    state, sup, router, timeline = run.state, run.sup, run.router, run.timeline
    router.refuse["out"] = (401, {"error": "missing or wrong API key"})
    state.update(supervisor=SupervisorRecord(identify(_pid()), detached=True))
    request = restart(0)
    done = threading.Thread(target=_supervise_once, args=(state, sup), daemon=True)
    done.start()
    with pytest.raises(SystemExit) as exited:
        _ask("restart", state, request, as_json=False)
    done.join(10)
    out, err = capsys.readouterr()
    assert exited.value.code == ExitCode.OK
    assert "out of the router," not in err, err
    assert "drained" not in err.replace("without a drain", ""), err
    assert ("omni-dp restart: replica 0: NOT out of the router (the router did not take "
            "replica 0 out: PUT /workers/0 answered 401 (missing or wrong API key)") in err, err
    assert out.startswith("omni-dp restart: done in ") and out.rstrip().endswith(
        "; replica 0 stopped without a drain (the router did not take it out, said above)"), out
    assert order(timeline, 0)[:2] == ["out", "stop"]  # no drain was waited for
    drained = next(e for e in state.events() if e["event"] == "change_drained")
    assert drained["out_of_router"] is False and drained["drained"] is False
    assert "401" in drained["error"]


def test_the_json_outcome_names_the_replicas_stopped_while_in_the_router(tmp_path):
    run = a_run(tmp_path, replicas=2)
    state, sup, router = run.state, run.sup, run.router
    router.refuse["out"] = (0, None)  # the router did not answer
    outcome, lines = followed(state, sup, restart(0, 1))
    assert outcome.ok
    assert outcome.to_json()["stopped_in_router"] == [0, 1]
    assert sum("NOT out of the router" in line and "answered nothing" in line
               for line in lines) == 2, lines


def test_a_failed_step_stops_the_change_there_and_the_command_exits_3(tmp_path, capsys):
    run = a_run(tmp_path)
    state, sup, timeline = run.state, run.sup, run.timeline
    sup.replicas.unhealthy = {1}
    state.update(supervisor=SupervisorRecord(identify(_pid()), detached=True))
    done = threading.Thread(target=_supervise_once, args=(state, sup), daemon=True)
    done.start()
    with pytest.raises(SystemExit) as exited:
        _ask("restart", state, restart(0, 1, 2), as_json=False)
    done.join(10)
    assert exited.value.code == ExitCode.RUNTIME == 3
    last = capsys.readouterr().out.strip()
    assert last.startswith("omni-dp restart: FAILED: replica 1 did not pass its gates"), last
    assert order(timeline, 0)[-1] == "in"  # what passed stays
    assert "in" not in order(timeline, 1)  # failed: down, not back in the router
    assert order(timeline, 2) == []  # never touched
    ended = read_change(state.directory)
    assert ended.state == "failed" and "replica 1" in ended.error
    assert [e["event"] for e in state.events()].count("change_step_done") == 1


# --- scale --------------------------------------------------------------------------------


def test_a_scale_down_takes_the_top_replica_out_drains_stops_then_removes_it(tmp_path):
    run = a_run(tmp_path)
    state, sup, timeline = run.state, run.sup, run.timeline
    outcome, lines = followed(state, sup, scale_down(state, 1))
    assert outcome.ok, outcome.error
    for i in (2, 1):
        assert order(timeline, i) == ["out", "in_flight=2", "in_flight=1", "in_flight=0",
                                      "stop", "remove"], i
    assert timeline.index(("remove", 2)) < timeline.index(("out", 1))  # the top one first
    assert [r.index for r in state.replicas] == [0]
    assert order(timeline, 0) == []
    assert sum("out of the router for good" in line for line in lines) == 2


def test_a_router_that_does_not_remove_a_replica_fails_the_scale_and_says_why(tmp_path):
    run = a_run(tmp_path)
    state, sup, router, timeline = run.state, run.sup, run.router, run.timeline
    router.refuse["remove"] = (500, {"error": "boom"})
    outcome, lines = followed(state, sup, scale_down(state, 1))
    assert not outcome.ok
    assert outcome.error == ("replica 2 is stopped and gone from the run, but the router did "
                             "not remove replica 2: answered 500 (boom) (its health checks "
                             "keep it out of rotation)")
    assert order(timeline, 1) == []  # the change stopped at the failed step
    assert [r.index for r in state.replicas] == [0, 1]
    assert any(line == "replica 2: warning: the router did not remove replica 2: answered "
               "500 (boom)" for line in lines), lines
    assert not any("out of the router for good" in line for line in lines)


def test_a_replica_the_router_does_not_add_fails_the_scale_up_with_the_routers_words(
        tmp_path):
    run = a_run(tmp_path, replicas=1)
    state, sup, router, timeline = run.state, run.sup, run.router, run.timeline
    router.refuse["add"] = (409, {"error": "id 1 exists"})
    new = dataclasses.replace(state.replica(0), index=1, port=41001,
                              url="http://replica-1.test", identity=None, pgid=None,
                              state=ReplicaState.STARTING, restarts=())
    plan = dataclasses.replace(state.record.plan, replicas=2)
    outcome, _ = followed(state, sup, ChangeRequest(
        "scale", (Step("add", 1, added=new),), "scale to 2", drain_timeout=5.0, plan=plan))
    assert not outcome.ok
    assert outcome.error == "the router did not add replica 1: answered 409 (id 1 exists)"
    assert ("start", 1) not in timeline  # never started outside the router


# --- the others healthy first ----------------------------------------------------------
# A step takes its replica out only while every other replica is healthy (Kubernetes'
# maxUnavailable counts the broken ones too): it waits, says so, and goes on.


def restarting(run: Run, index: int):
    """The sweep restarting this replica (its process was killed); what brings it back."""
    run.state.update_replica(index, state=ReplicaState.RESTARTING,
                             last_error="its process is gone")

    def back() -> None:
        run.state.update_replica(index, state=ReplicaState.STARTING)
        run.state.update_replica(index, state=ReplicaState.HEALTHY, last_error=None)
        run.timeline.append(("healthy", index))

    return back


def killed(run: Run, index: int):
    """Killed a moment ago: the record still says healthy, the process table does not."""
    pid = run.state.replica(index).pid
    run.sup.crew.probe.live.discard(pid)

    def back() -> None:
        run.sup.crew.probe.live.add(pid)
        run.timeline.append(("healthy", index))

    return back


def ejected(run: Run, index: int):
    """Healthy in the record and alive, but the router's own checks ejected it."""
    run.router.ejected.add(index)

    def back() -> None:
        run.router.ejected.discard(index)
        run.timeline.append(("healthy", index))

    return back


def failed(run: Run, index: int) -> None:
    """Out of its restart budget: nothing brings it back on its own."""
    run.state.update_replica(index, state=ReplicaState.RESTARTING)
    run.state.update_replica(index, state=ReplicaState.FAILED,
                             last_error="restart budget exhausted (5 restarts within 600 s)")


@pytest.mark.parametrize(("cause", "why"), [
    (restarting, "restarting"),
    (killed, "its process is gone"),
    (ejected, "not routable: the router's health checks find it unhealthy (ejected: failures)"),
], ids=["restarting", "killed", "ejected"])
def test_a_restart_takes_its_replica_out_only_once_the_other_one_is_healthy_again(
        tmp_path, cause, why):
    run = a_run(tmp_path, replicas=2)
    run.stop.after(1.5, cause(run, 0))
    outcome, lines = followed(run.state, run.sup, restart(1))
    assert outcome.ok, outcome.error
    assert run.timeline.index(("healthy", 0)) < run.timeline.index(("out", 1))
    waiting = (f"replica 1: waiting for replica 0 ({why}) to be healthy before taking 1 out "
               "(at most 30 s)")
    waited = "replica 1: replica 0 healthy again after 1.5 s; taking 1 out"
    out = next(line for line in lines if line.startswith("replica 1: out of the router"))
    assert lines.index(waiting) < lines.index(waited) < lines.index(out), lines
    assert outcome.to_json()["waits"] == [{"replica": 1, "others": [0], "seconds": 1.5,
                                           "waited": True}]
    [event] = [e for e in run.state.events() if e["event"] == "change_waiting"]
    assert [(o["replica"], o["why"], o["hopeless"]) for o in event["others"]] == \
        [(0, why, False)]
    assert event["taking_out"] == [1] and event["bound_s"] == 30.0


def test_a_scale_down_removes_its_replica_only_once_the_others_are_healthy(tmp_path):
    run = a_run(tmp_path, replicas=3)
    run.stop.after(2.0, restarting(run, 0))
    outcome, lines = followed(run.state, run.sup, scale_down(run.state, 2))
    assert outcome.ok, outcome.error
    assert run.timeline.index(("healthy", 0)) < run.timeline.index(("out", 2))
    assert ("replica 2: waiting for replica 0 (restarting) to be healthy before taking 2 out "
            "(at most 30 s)") in lines, lines
    assert "replica 2: replica 0 healthy again after 2.0 s; taking 2 out" in lines, lines
    assert [r.index for r in run.state.replicas] == [0, 1]


def test_a_step_never_waits_for_its_own_replica_nor_its_group(tmp_path):
    run = a_run(tmp_path, replicas=2)
    run.state.update_replica(1, state=ReplicaState.UNHEALTHY,
                             last_error="/health answered 503 (1 in a row)")
    outcome, lines = followed(run.state, run.sup, restart(1, wait=5.0))
    assert outcome.ok, outcome.error
    assert not [line for line in lines if "waiting for" in line], lines
    # a weight-share leader's restart takes its followers: one of them down is its own
    share = a_run(tmp_path / "share", replicas=3, share=True)
    share.state.update_replica(2, state=ReplicaState.DOWN, last_error="waiting for its leader")
    outcome, lines = followed(share.state, share.sup, restart(0, wait=5.0))
    assert outcome.ok, outcome.error
    assert not [line for line in lines if "waiting for" in line], lines
    assert order(share.timeline, 2)[0] == "out"


def test_the_bound_fails_the_step_saying_which_replica_and_what_to_do(tmp_path, capsys):
    run = a_run(tmp_path, replicas=2)
    state, sup = run.state, run.sup
    restarting(run, 0)  # and it never comes back
    state.update(supervisor=SupervisorRecord(identify(_pid()), detached=True))
    done = threading.Thread(target=_supervise_once, args=(state, sup), daemon=True)
    done.start()
    with pytest.raises(SystemExit) as exited:
        _ask("restart", state, restart(1, wait=3.0), as_json=False)
    done.join(10)
    assert exited.value.code == ExitCode.RUNTIME
    out, err = capsys.readouterr()
    error = ("replica 1 not taken out of the router: replica 0 still not healthy (restarting; "
             "last error: its process is gone) after 3 s; wait until `omni-dp status "
             "run-units` shows it healthy and ask again, restart it first (`omni-dp restart "
             "run-units --replica 0`), or give `omni-dp restart` a longer --wait-healthy (0: "
             "take replica 1 out anyway)")
    assert out.strip() == f"omni-dp restart: FAILED: {error}"
    assert ("omni-dp restart: replica 1: waiting for replica 0 (restarting) to be healthy "
            "before taking 1 out (at most 3 s)") in err, err
    assert order(run.timeline, 1) == []  # never out of the router, never stopped
    assert read_change(state.directory).error == error


def test_a_failed_replica_fails_the_step_at_once_nothing_brings_it_back(tmp_path):
    run = a_run(tmp_path, replicas=3)
    failed(run, 0)
    outcome, lines = followed(run.state, run.sup, scale_down(run.state, 2))
    assert not outcome.ok
    assert not [line for line in lines if "waiting for" in line], lines
    assert outcome.error == (
        "replica 2 not taken out of the router: replica 0 is failed (last error: restart "
        "budget exhausted (5 restarts within 600 s)), and nothing brings it back on its own; "
        "restart it first (`omni-dp restart run-units --replica 0`), or give `omni-dp scale` "
        "--wait-healthy 0 to take replica 2 out anyway")
    assert run.stop.waits == []  # not waited for
    assert order(run.timeline, 2) == []
    assert [r.index for r in run.state.replicas] == [0, 1, 2]


def test_wait_healthy_0_does_not_wait_and_says_whom_it_did_not_wait_for(tmp_path):
    run = a_run(tmp_path, replicas=3)
    failed(run, 0)
    outcome, lines = followed(run.state, run.sup, restart(1, wait=0))
    assert outcome.ok, outcome.error
    assert ("replica 1: taking 1 out although replica 0 (failed) is not healthy "
            "(--wait-healthy 0)") in lines, lines
    assert outcome.to_json()["waits"] == [{"replica": 1, "others": [0], "seconds": 0.0,
                                           "waited": False}]
    assert order(run.timeline, 1)[0] == "out"


def test_the_others_are_looked_at_again_once_the_replicas_slot_is_held(tmp_path):
    """A restart the sweep began held replica 1's slot while the step waited for it, and
    replica 0 went down meanwhile: the step waits for 0 again before taking 1 out."""
    run = a_run(tmp_path, replicas=2)
    released = threading.Event()
    sweep = run.sup.busy.start(Slot.replica(1), released.wait, name="restart-1")

    def meanwhile() -> None:
        back = restarting(run, 0)
        released.set()
        sweep.join(10)  # the sweep's restart ended: the slot is free
        run.stop.after(3.0, back)

    run.stop.after(0.25, meanwhile)
    outcome, lines = followed(run.state, run.sup, restart(1))
    assert outcome.ok, outcome.error
    assert run.timeline.index(("healthy", 0)) < run.timeline.index(("out", 1))
    assert ("replica 1: waiting for replica 0 (restarting) to be healthy before taking 1 out "
            "(at most 30 s)") in lines, lines


def test_the_waiting_lines_name_every_replica_waited_for():
    others = [{"replica": 3, "why": "down"}, {"replica": 4, "why": "its process is gone"}]
    assert describe({"event": "change_waiting", "replica": 0, "taking_out": [0, 1, 2],
                     "others": others, "bound_s": 360.0}) == (
        "replica 0: waiting for replicas 3 (down), 4 (its process is gone) to be healthy "
        "before taking 0, 1, 2 out (at most 360 s)")
    assert describe({"event": "change_waited", "replica": 0, "taking_out": [0, 1, 2],
                     "others": [3, 4], "seconds": 12.5}) == (
        "replica 0: replicas 3, 4 healthy again after 12.5 s; taking 0, 1, 2 out")
    assert describe({"event": "change_not_waiting", "replica": 0, "taking_out": [0],
                     "others": others}) == (
        "replica 0: taking 0 out although replicas 3 (down), 4 (its process is gone) are not "
        "healthy (--wait-healthy 0)")


# --- helpers ------------------------------------------------------------------------------


def _pid() -> int:
    import os

    return os.getpid()


def _supervise_once(state, sup) -> None:
    while (change := take(state.directory)) is None:
        threading.Event().wait(0.05)
    sup.change(change)


# --- a change planned from an older run ---------------------------------------------------


def test_a_change_planned_before_another_one_reshaped_the_run_fails_before_any_step(
        tmp_path, capsys):
    """Planned from 3 replicas, taken once another change left 2: it touches nothing (the
    step list would remove the wrong replica), fails, and the command exits 3 saying so."""
    from omni_dp.launcher.changes.request import basis_of

    run = a_run(tmp_path)
    state, sup, timeline = run.state, run.sup, run.timeline
    planned = dataclasses.replace(scale_down(state, 2), basis=basis_of(state.record))
    state.set_scale(state.replicas[:2], dataclasses.replace(state.plan, replicas=2),
                    state.record.gpus)  # what another change did meanwhile
    state.update(supervisor=SupervisorRecord(identify(_pid()), detached=True))
    done = threading.Thread(target=_supervise_once, args=(state, sup), daemon=True)
    done.start()
    with pytest.raises(SystemExit) as exited:
        _ask("scale", state, planned, as_json=False)
    done.join(10)
    assert exited.value.code == ExitCode.RUNTIME == 3
    last = capsys.readouterr().out.strip()
    assert "changed after this change was planned" in last and "ask again" in last, last
    assert timeline == []  # nothing taken out, drained, stopped or removed
    assert len(state.replicas) == 2
    assert [e["event"] for e in state.events()].count("change_step_done") == 0


# --- the loop makes the change ------------------------------------------------------------


def step_events(state) -> list[tuple]:
    return [(e["event"], e.get("step")) for e in state.events()
            if e["event"].startswith("change_") and e["event"] not in
            ("change_drained", "change_waiting", "change_waited")]


def test_the_loop_makes_a_change_one_step_per_sweep_applying_each_steps_outcome(tmp_path):
    """Step n's thread reports how it ended; the loop writes it (change_step_done) and only
    then begins step n + 1, checked against the record as it is at that sweep."""
    from omni_dp.launcher.changes.request import submit

    run = a_run(tmp_path, replicas=2)
    state, sup = run.state, run.sup
    submit(state.directory, restart(0, 1))
    sup.sweep()  # taken, step 1 handed to its thread
    sup.busy.join(10)
    assert step_events(state) == [("change_started", None), ("change_step", 1)]
    assert order(run.timeline, 0)[-1] == "in" and order(run.timeline, 1) == []
    sup.sweep()  # step 1's outcome applied, step 2 handed out
    sup.busy.join(10)
    assert step_events(state)[2:] == [("change_step_done", 1), ("change_step", 2)]
    sup.sweep()
    assert step_events(state)[4:] == [("change_step_done", 2), ("change_done", None)]
    assert read_change(state.directory).state == "done" and sup.changing is None


def test_a_replica_gone_between_two_sweeps_is_brought_back_as_the_change_wants_it(tmp_path):
    """The step after is chosen from the record as it is then, never the list planned: the
    restart of replica 2 planned becomes its add (as the change wants it: already restarted)."""
    from omni_dp.launcher.changes.request import submit

    run = a_run(tmp_path, replicas=3)
    state, sup = run.state, run.sup
    submit(state.directory, restart(0, 2))
    sup.sweep()
    sup.busy.join(10)
    assert state.record.desired is not None and state.record.desired.change == \
        read_change(state.directory).id
    # meanwhile the record loses replica 2 (what another writer did, were there one)
    state.set_scale(state.replicas[:2], dataclasses.replace(state.plan, replicas=2),
                    state.record.gpus)
    sup.sweep()
    sup.busy.join(10)
    step_2 = [e for e in state.events() if e["event"] == "change_step"][-1]
    assert (step_2["step"], step_2["action"], step_2["replica"]) == (2, "add", 2)
    sup.sweep()
    assert read_change(state.directory).state == "done" and state.record.desired is None
    assert len(state.replicas) == 3 and state.replica(2).generation == 1
    assert "out" not in order(run.timeline, 2)  # started as new, nothing taken out
    assert [e for e, _ in step_events(state)][-2:] == ["change_step_done", "change_done"]


def test_a_remove_is_dropped_from_the_record_by_the_loop_once_its_thread_stopped_it(tmp_path):
    from omni_dp.launcher.changes.request import submit

    run = a_run(tmp_path, replicas=3)
    state, sup = run.state, run.sup
    submit(state.directory, scale_down(state, 2))
    sup.sweep()
    sup.busy.join(10)
    assert state.replica(2).state is ReplicaState.STOPPED and len(state.replicas) == 3
    sup.sweep()  # outcome in → record out
    assert len(state.replicas) == 2 and state.plan.replicas == 2
    assert read_change(state.directory).state == "done"
    assert sorted(sup.watches) == [0, 1]


# --- a change a dead supervisor was making ------------------------------------------------


def test_a_change_a_dead_supervisor_was_making_is_resumed_from_the_record(tmp_path):
    """The dead one took restart(0, 1, 2), wrote what it wants, made step 1 (replica 0, a new
    generation) and was cut off in step 2 (replica 1 restarting). The new one resumes: replica
    1 is restarted by its sweep, then each step chosen from the record — replica 0 is never
    restarted again, the steps numbered on from 3 — and the change ends done."""
    from omni_dp.launcher.changes.desired import desired_of
    from omni_dp.launcher.changes.request import submit
    from omni_dp.launcher.record.events import Event
    from omni_dp.procs import ProcessIdentity

    run = a_run(tmp_path, replicas=3)
    state, sup = run.state, run.sup
    submit(state.directory, restart(0, 1, 2))
    change = take(state.directory)
    state.set_desired(desired_of(change, state.record))
    state.event(Event.CHANGE_STEP, change=change.id, step=1, action="restart", replica=0)
    state.update_replica(0, generation=1)
    state.event(Event.CHANGE_STEP_DONE, change=change.id, step=1, action="restart",
                replica=0, seconds=1.0)
    state.event(Event.CHANGE_STEP, change=change.id, step=2, action="restart", replica=1)
    state.update_replica(1, state=ReplicaState.RESTARTING)
    state.update(supervisor=SupervisorRecord(ProcessIdentity(4242, 1.0), True, 1.0))
    sup._take_over(state.record.supervisor)
    assert read_change(state.directory).state == "running" and sup.changing.made == 2
    resumed = [e for e in state.events() if e["event"] == "supervisor_resumed"][-1]
    assert resumed["change"] == change.id and resumed["change_resumed"] is True
    for _ in range(8):
        sup.sweep()
        sup.busy.join(10)
        if read_change(state.directory).state != "running":
            break
    assert read_change(state.directory).state == "done", read_change(state.directory).error
    assert [r.generation for r in state.replicas] == [1, 1, 1]
    assert state.record.desired is None and sup.changing is None
    assert "stop" not in order(run.timeline, 0)  # made before the takeover: not again
    steps = [(e["step"], e["replica"]) for e in state.events()
             if e["event"] == "change_step" and e["change"] == change.id]
    assert steps == [(1, 0), (2, 1), (3, 1), (4, 2)]


def test_a_model_update_of_a_share_group_relaunches_each_member_with_its_own_launch(tmp_path):
    """The leader's step restarts its followers with it: each comes back on the launch the
    change wants for it (a follower's argv is not its leader's), each a new generation, and
    the change is one step."""
    from omni_dp.launcher.changes.desired import expected_steps, wanted
    from omni_dp.launcher.changes.request import submit
    from omni_dp.runfile import Desired

    run = a_run(tmp_path, replicas=3, share=True)
    state, sup = run.state, run.sup
    goal = tuple(dataclasses.replace(wanted(r), argv=("serve", "--model", "new", f"#{r.index}"),
                                     generation=1) for r in state.replicas)
    desired = Desired("upd00001", goal, state.plan, state.record.gpus)
    steps = expected_steps(desired, state.record)
    assert [(s.action, s.replica) for s in steps] == [("restart", 0)]
    submit(state.directory, ChangeRequest("restart", steps, "model update", 5.0,
                                          wait_healthy=0, id="upd00001", desired=desired))
    sup.change(take(state.directory))
    assert read_change(state.directory).state == "done", read_change(state.directory).error
    assert [(r.argv, r.generation) for r in state.replicas] == [(g.argv, 1) for g in goal]
    assert all("start" in order(run.timeline, i) for i in range(3))  # each started again
    assert state.record.desired is None


def test_a_step_the_run_did_not_follow_is_never_made_twice_in_a_row(tmp_path):
    """A restart that passed but left its replica still due (its launch not written) ends the
    change rather than restarting it again sweep after sweep."""
    from omni_dp.launcher.changes.desired import desired_of

    run = a_run(tmp_path, replicas=2)
    state, runner = run.state, run.sup.change
    change = restart(0)
    state.set_desired(desired_of(change, state.record))
    assert runner.next(change, None) == (Step("restart", 0), None)
    step, error = runner.next(change, Step("restart", 0))
    assert step is None and error == (f"replica 0 is still not as change {change.id} wants it "
                                      "after its restart passed")
    state.set_desired(None)
    assert runner.next(change, None) == (None, "what the change wants is gone from run.json")
