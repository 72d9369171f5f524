"""`omni-dp supervise`: a supervisor again for a live run whose supervisor died.

The refusals and the failures of the command on hand-made runs (support/plans.py; a `sleep`
process stands in for what runs), the take-over in the new supervisor on the supervisor's fakes
(support/supervision.py), and once, live: a detached run whose supervisor is SIGKILLed, given
a new one that restarts a killed replica.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from click.testing import CliRunner

from omni_dp.blocking_http import http_json
from omni_dp.launcher.changes.request import (
    ChangeRefused,
    ChangeRequest,
    Step,
    finish,
    read_change,
    submit,
    take,
)
from omni_dp.launcher.record.state import RunState
from omni_dp.launcher.supervision import detached
from omni_dp.launcher.supervision.resume import ResumeFailed, resume
from omni_dp.procs import ProcessIdentity, identify, start_of
from omni_dp.runfile import ReplicaState, RouterRecord, RunPhase, SupervisorRecord

from support.launcher import (
    RESTART_TIMEOUT_S,
    SUPERVISION,
    alive,
    describe,
    kill_replica,
    token_pids,
)
from support.plans import two_replica_plan
from support.stub_http import StubHttp
from support.supervision import FakeRouter, make_state, names, supervisor
from support.wait import wait_for

RUN = "run-test"  # two_replica_plan's run id


# --- a hand-made run ----------------------------------------------------------------------------


@pytest.fixture
def sleeper():
    """A live process standing in for what a run still runs; killed at teardown."""
    proc = subprocess.Popen(["sleep", "120"], stdin=subprocess.DEVNULL, start_new_session=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)


def hand_made(tmp_path, phase: RunPhase = RunPhase.RUNNING, *, running: int | None = None,
              launcher: bool = False, **options) -> RunState:
    """A run as bring-up leaves it (phase `phase`), replica 0 recorded as the process
    `running` (None: nothing of it runs), its launcher this test process (alive) or gone."""
    state = RunState.create(two_replica_plan(tmp_path, **options))
    if not launcher:
        state.update(launcher=None)
    if running is not None:
        state.update_replica(0, state=ReplicaState.STARTING, identity=identify(running),
                             pgid=running)
        state.update_replica(0, state=ReplicaState.HEALTHY)
    steps = {RunPhase.STARTING: [], RunPhase.RUNNING: [RunPhase.RUNNING],
             RunPhase.DEGRADED: [RunPhase.RUNNING, RunPhase.DEGRADED],
             RunPhase.FAILED: [RunPhase.FAILED],
             RunPhase.STOPPED: [RunPhase.STOPPING, RunPhase.STOPPED]}[phase]
    for step in steps:
        state.set_phase(step)
    return state


def supervise(tmp_path, *args: str, env: dict | None = None):
    """`omni-dp supervise ARGS` in this process, on tmp_path's state directory."""
    from omni_dp.cli import cli

    runner = CliRunner()
    return runner.invoke(cli, ["supervise", *args], catch_exceptions=False, env={
        "OMNI_DP_STATE_DIR": str(tmp_path / "state"), "OMNI_DP_API_KEY": None, **(env or {})})


def nothing_started(state: RunState) -> None:
    again = RunState.load(state.directory)
    assert again.record.supervisor is None
    assert not (state.logs / "supervisor.log").exists()
    assert not [e for e in again.events() if e["event"].startswith("supervisor")]


def test_status_names_the_command_that_supervises_an_unsupervised_run_again(tmp_path, sleeper):
    from omni_dp.launcher.views.status import collect, format_status

    state = hand_made(tmp_path, running=sleeper.pid)
    state.update(supervisor=SupervisorRecord(ProcessIdentity(4242, 1.0), True, 1.0))  # dead
    report = collect(RunState.load(state.directory), probe=False)
    assert report["state"] == "unsupervised"
    assert format_status(report, "omni-dp").splitlines()[-1] == (
        "its supervisor is gone: nothing restarts a replica that fails; `omni-dp supervise "
        "run-test` supervises it again; `omni-dp down run-test` stops it")


# --- refused, before anything is started --------------------------------------------------------


@pytest.mark.parametrize(("phase", "runs", "launcher", "said"), [
    (RunPhase.RUNNING, False, False, "nothing of run run-test runs any more (no process it "
                                     "recorded is alive): there is nothing to supervise"),
    (RunPhase.STOPPED, True, False, "run run-test is stopped: there is nothing to supervise"),
    (RunPhase.FAILED, True, False, "run run-test failed (bring-up, or its supervisor stopped "
                                   "it after a failure)"),
    (RunPhase.STARTING, True, True, "run run-test is still starting: its `launch` (pid "),
    (RunPhase.STARTING, True, False, "run run-test never finished starting (starting): its "
                                     "`launch` died during bring-up"),
], ids=["gone", "stopped", "failed", "launch-still-runs", "abandoned"])
def test_a_run_that_is_not_live_is_refused_with_why_and_what_to_do(tmp_path, sleeper, phase,
                                                                    runs, launcher, said):
    state = hand_made(tmp_path, phase, running=sleeper.pid if runs else None, launcher=launcher)
    result = supervise(tmp_path, RUN)
    assert result.exit_code == 2, result.output
    assert said in result.output
    assert "`omni-dp status run-test`" in result.output if launcher else \
        "`omni-dp down run-test`" in result.output
    nothing_started(state)
    assert sleeper.poll() is None  # and nothing stopped


def test_a_router_that_wants_an_api_key_needs_it_set_and_right(tmp_path, sleeper):
    refused = StubHttp(lambda method, path, auth, body: (
        (200, b'{"workers": []}') if auth == "Bearer right" else (401, b"{}")))
    try:
        state = hand_made(tmp_path, running=sleeper.pid, api_key="right")
        assert state.plan.api_key_set
        state.update(router=RouterRecord(identify(os.getpid()), 0, refused.url, (),
                                         "router.log"))
        result = supervise(tmp_path, RUN)
        assert result.exit_code == 2, result.output
        assert ("run run-test's router wants an API key: set OMNI_DP_API_KEY to the key it was "
                "launched with (the supervisor's admin calls would be refused without it)"
                in result.output)
        nothing_started(state)
        result = supervise(tmp_path, RUN, env={"OMNI_DP_API_KEY": "wrong"})
        assert result.exit_code == 2, result.output
        assert "run run-test's router refuses the key in OMNI_DP_API_KEY (401)" in result.output
        assert refused.seen[-1][:3] == ("GET", "/workers", "Bearer wrong")
        nothing_started(state)
    finally:
        refused.close()


def test_a_run_whose_supervisor_is_alive_is_left_as_it_is(tmp_path, sleeper):
    state = hand_made(tmp_path, running=sleeper.pid)
    me = identify(os.getpid())
    state.update(supervisor=SupervisorRecord(me, True, time.time()))
    result = supervise(tmp_path, RUN)
    assert result.exit_code == 0, result.output
    assert result.stdout == f"run run-test is supervised by pid {me.pid}\n"
    result = supervise(tmp_path, RUN, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["supervised"] is True and data["already"] is True and data["pid"] == me.pid
    assert RunState.load(state.directory).record.supervisor.identity == me
    assert not (state.logs / "supervisor.log").exists()


# --- started, and not supervising: stopped, said, the run left as it is ------------------------


def test_a_supervisor_that_dies_first_exits_3_with_its_log_and_tears_nothing_down(
        tmp_path, sleeper, monkeypatch):
    state = hand_made(tmp_path, running=sleeper.pid)
    state.update(supervisor=SupervisorRecord(ProcessIdentity(4242, 1.0), True, 1.0))  # dead
    monkeypatch.setattr(detached, "SUPERVISOR_MODULE", "omni_dp_no_such_module")
    result = supervise(tmp_path, RUN, "--json")
    assert result.exit_code == 3, result.output
    assert "before it was supervising; last lines of" in result.output
    assert "No module named omni_dp_no_such_module" in result.output  # the log's tail
    assert "run run-test goes on serving, unsupervised (nothing was torn down)" in result.output
    data = json.loads(result.stdout)  # the outcome; what happened is on stderr
    assert data["supervised"] is False and data["previous_pid"] == 4242
    assert sleeper.poll() is None and state.directory.is_dir()
    failed = [e for e in RunState.load(state.directory).events()
              if e["event"] == "supervisor_resume_failed"]
    assert [(e["previous_pid"], e["exit"]) for e in failed] == [(4242, 1)]


def test_a_supervisor_that_does_not_supervise_in_time_is_killed_not_asked_to_tear_down(
        tmp_path, sleeper):
    """SIGTERM would make a real supervisor tear the run down: it gets SIGKILL, by identity."""
    state = hand_made(tmp_path, running=sleeper.pid)
    said: list[str] = []
    with pytest.raises(ResumeFailed) as failed:
        resume(state, say=said.append, timeout_s=1.0,
               argv=[sys.executable, "-c", "import signal, time\n"
                     "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('starting')\n"
                     "time.sleep(60)"])
    text = str(failed.value)
    pid = failed.value.resumed.pid
    assert f"the detached supervisor (pid {pid}) did not start supervising within 1 s" in text
    assert f"it is stopped (SIGKILL: pid {pid})" in text and "starting" in text
    assert not alive(pid) and sleeper.poll() is None and state.directory.is_dir()
    assert said[0].startswith(f"supervisor pid {pid} started; waiting for its first sweep")


# --- the new supervisor takes over what the dead one left half-done -----------------------------


def _dead_supervisor(state: RunState) -> SupervisorRecord:
    record = SupervisorRecord(ProcessIdentity(4242, 1.0), True, 1.0)
    state.update(supervisor=record)
    return record


def test_a_restart_the_dead_supervisor_left_half_done_is_made_again_through_the_gates(
        tmp_path):
    """Replica 1 was restarting: its process may answer /health, but nothing proved it passed
    the gates: restarted, not taken for healthy."""
    state = make_state(tmp_path)
    state.update_replica(1, state=ReplicaState.RESTARTING, last_error="killed")
    sup, _, said = supervisor(state)
    started: list[tuple[int, str]] = []
    sup.restart_replica = lambda index, reason, group: started.append((index, reason))
    sup._take_over(_dead_supervisor(state))
    why = "its restart was cut off: the supervisor making it (pid 4242) died"
    assert state.replica(1).state is ReplicaState.DOWN and state.replica(1).last_error == why
    sup.sweep()
    sup.busy.join(5)
    assert started == [(1, why)]
    assert state.replica(1).state is ReplicaState.RESTARTING
    resumed = [e for e in state.events() if e["event"] == "supervisor_resumed"]
    assert [(e["previous_pid"], e["pid"], e["cut_off"]) for e in resumed] == [
        (4242, os.getpid(), [1])]
    assert said[0] == ("supervising run run-units again, after supervisor pid 4242; replica(s) "
                       "1: restart cut off, restarted now")
    sup.sweep()
    sup.busy.join(5)
    assert len(started) == 1  # once


def test_a_replica_the_dead_supervisor_left_out_of_the_router_is_put_back(tmp_path):
    state = make_state(tmp_path)
    sup, world, said = supervisor(state, router=FakeRouter())
    world.workers = [{"id": "0", "disabled": True, "routable": False},
                     {"id": "1", "disabled": False, "routable": True}]
    sup._take_over(_dead_supervisor(state))
    sup.sweep()
    assert [(url, disabled) for url, disabled, _ in sup.router.http.calls] == [
        ("http://router.test/workers/0", False)]
    assert "replica 0: back in the router" in said


def test_a_change_the_dead_supervisor_left_without_what_it_wants_is_recorded_failed(tmp_path):
    """Taken, but what it wants never written into run.json (died in between): nothing to
    resume from, so it fails, and a change can be asked for again."""
    state = make_state(tmp_path)
    submit(state.directory, ChangeRequest("restart", (Step("restart", 0),), "restart 0", 1.0))
    running = take(state.directory)
    with pytest.raises(ChangeRefused):  # as it was: no change could ever be asked for again
        submit(state.directory, ChangeRequest("restart", (Step("restart", 1),), "1", 1.0))
    sup, _, _ = supervisor(state)
    sup._take_over(_dead_supervisor(state))
    ended = read_change(state.directory)
    assert ended.id == running.id and ended.state == "failed"
    assert ended.error.startswith("cut off: the supervisor making it (pid 4242) died")
    assert "change_failed" in names(state)
    assert sup.changing is None
    submit(state.directory, ChangeRequest("restart", (Step("restart", 1),), "1", 1.0))


def test_what_no_running_change_wants_is_cleared_at_a_takeover(tmp_path):
    """A supervisor that died after recording its change ended but before clearing what it
    wanted leaves a Desired nobody owns: cleared, nothing resumed."""
    from omni_dp.launcher.changes.desired import desired_of

    state = make_state(tmp_path)
    submit(state.directory, ChangeRequest("restart", (Step("restart", 0),), "restart 0", 1.0))
    running = take(state.directory)
    state.set_desired(desired_of(running, state.record))
    finish(state.directory, running, None)
    sup, _, _ = supervisor(state)
    sup._take_over(_dead_supervisor(state))
    assert state.record.desired is None and sup.changing is None
    assert read_change(state.directory).state == "done"


def test_a_supervisor_never_starts_beside_a_live_one_and_never_tears_its_run_down(
        tmp_path, sleeper):
    state = make_state(tmp_path)
    other = SupervisorRecord(identify(sleeper.pid), True, 1.0)
    state.update(supervisor=other)
    sup, _, said = supervisor(state)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        assert sup.run() == 2
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert state.record.supervisor == other and state.record.state is RunPhase.RUNNING
    assert sup.replicas.calls == [] and names(state) == []
    assert said == [f"run run-units is supervised by pid {sleeper.pid}; this supervisor stops "
                    "without touching it"]


# --- live: SIGKILL the supervisor, supervise again, the new one restarts a replica --------------


def _routable(run, index: int) -> bool:
    status, body = http_json("GET", run.router_url + "/workers", timeout=2.0)
    workers = body.get("workers", []) if status == 200 and isinstance(body, dict) else []
    return any(w.get("id") == str(index) and w.get("routable") for w in workers)


@pytest.mark.slow
def test_supervise_brings_supervision_back_to_a_run_whose_supervisor_was_killed(runs):
    begun = time.monotonic()
    run = runs(2)
    run.launch(*SUPERVISION)
    launched = time.monotonic()
    old = run.run_json()["supervisor"]
    assert start_of(old["pid"]) == old["create_time"]
    os.kill(old["pid"], signal.SIGKILL)
    wait_for("the supervisor to die", lambda: not alive(old["pid"]), timeout=10)
    assert run.status()["state"] == "unsupervised"
    text = run.cli("status", run.run_id)
    assert f"supervise {run.run_id}` supervises it again" in text.stdout, describe(text)

    asked = time.monotonic()
    done = run.cli("supervise", run.run_id)
    supervised = time.monotonic()
    assert done.returncode == 0, describe(done)
    new = run.run_json()["supervisor"]
    assert new["pid"] != old["pid"] and new["supervising_since"]
    assert done.stdout == (f"supervisor pid {new['pid']} is supervising run {run.run_id} again"
                           f" (log {run.run_dir / 'logs' / 'supervisor.log'})\n")
    status = run.status()
    assert status["supervisor"] == {"pid": new["pid"], "alive": True, "detached": True}
    assert status["state"] == "running"
    assert [(e["previous_pid"], e["pid"]) for e in run.events()
            if e["event"] == "supervisor_resumed"] == [(old["pid"], new["pid"])]

    # The replicas are not the new supervisor's children: it watches them all the same.
    killed = kill_replica(run, 0)
    # (a start of a tiny replica takes ~5 s on an idle machine, over 20 s on a busy one)
    wait_for("replica 0 restarted by the new supervisor", lambda: (
        (r := run.status()["replicas"][0])["pid"] != killed and r["restarts"] == 1
        and r["health"] == "healthy"), timeout=2 * RESTART_TIMEOUT_S, interval=0.3)
    wait_for("replica 0 routable again", lambda: _routable(run, 0), timeout=RESTART_TIMEOUT_S,
             interval=0.2)
    assert psutil.Process(run.run_json()["replicas"][0]["pid"]).ppid() == new["pid"]

    again = run.cli("supervise", run.run_id, "--json")
    assert again.returncode == 0, describe(again)
    assert json.loads(again.stdout)["already"] is True
    assert json.loads(again.stdout)["pid"] == new["pid"]

    down = run.down()
    assert down.returncode == 0, describe(down)
    assert token_pids(run.token) == [] and run.leftover_pids() == []
    assert not run.run_dir.exists()
    print(f"live supervise test: {time.monotonic() - begun:.1f} s (launch "
          f"{launched - begun:.1f} s, supervise {supervised - asked:.1f} s)")
