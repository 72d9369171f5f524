"""Day-two changes without processes: how a restart and a scale are planned (which steps, in
which order, what is refused and why), the machine as it would be without the run, and the
request handed to the supervisor (one at a time). The changes made on live replicas are in
test_changes_live.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
from click.testing import CliRunner

from omni_dp.cli import cli
from omni_dp.cli.commands import changes as change_commands
from omni_dp.launcher.changes.follow import describe
from omni_dp.launcher.changes.plan import (
    RESTART_MARGIN_S,
    ChangePlanError,
    plan_restart,
    plan_scale,
    without_run,
)
from omni_dp.launcher.changes.request import (
    CHANGE_FILE,
    OLD_REQUEST_WAIT_S,
    REQUEST_FILE,
    ChangeRefused,
    ChangeRequest,
    Relaunch,
    Step,
    basis_of,
    finish,
    read_change,
    stale_basis,
    submit,
    take,
)
from omni_dp.launcher.engines import EngineSizing
from omni_dp.launcher.planning.facts import KnownRun, LaunchFacts
from omni_dp.launcher.planning.options import LaunchOptions
from omni_dp.launcher.planning.plan import plan_launch
from omni_dp.launcher.planning.topology import Core, CpuTopology
from omni_dp.launcher.record.events import Event
from omni_dp.launcher.record.state import RunState
from omni_dp.procs import ProcessIdentity
from omni_dp.runfile import ReplicaState

from support.plans import GiB, gpu_slots, h200

H = ReplicaState.HEALTHY


def cpu_facts(tmp_path, cores: int = 2) -> LaunchFacts:
    return LaunchFacts(
        state_root=tmp_path / "state", new_run_id="run-d2",
        topology=CpuTopology(tuple(Core((i,), 0) for i in range(cores)),
                             frozenset(range(cores))),
        gpu_problems=(), mps_binary=None, mps_problems=(),
        taken_ports=frozenset(), runs=(),
        sizing=EngineSizing(weights_bytes=1, kv_cache_bytes=8192 * 1024, kv_tokens=1024,
                            overhead_bytes=1, device="cpu"),
        engine_problems=(), host_memory_available=1 << 34, numactl=None)


def launched(tmp_path, facts: LaunchFacts, **options) -> RunState:
    """A run as launch records it, every replica healthy."""
    o = LaunchOptions(**{"replicas": 2, "max_total_tokens": 1024, **options})
    state = RunState.create(plan_launch(o, facts))
    for r in state.replicas:
        state.update_replica(r.index, identity=ProcessIdentity(1000 + r.index, 1.0),
                             state=ReplicaState.STARTING)
        state.update_replica(r.index, state=H)
    return state


def replanner(facts: LaunchFacts):
    """Re-planning as the command does, on the hand-made machine."""
    from omni_dp.launcher.planning.options import options_from_record

    def replan(record, changes):
        options, problems = options_from_record(dict(record.plan.options))
        assert problems == []
        return plan_launch(dataclasses.replace(options, run_id=None, **changes),
                           dataclasses.replace(facts, new_run_id=record.run_id))
    return replan


def steps(request: ChangeRequest) -> list[tuple[str, int]]:
    return [(s.action, s.replica) for s in request.steps]


# --- omni-dp restart -------------------------------------------------------------------------


def test_a_rolling_restart_is_one_replica_at_a_time_with_the_runs_own_plan(tmp_path):
    state = launched(tmp_path, cpu_facts(tmp_path))
    request = plan_restart(state.record)
    assert steps(request) == [("restart", 0), ("restart", 1)]
    assert all(s.relaunch is None for s in request.steps)  # the recorded argv, env and block
    assert request.plan is None and request.summary == "rolling restart of replicas 0, 1"
    assert request.drain_timeout == state.supervision.drain_timeout
    assert steps(plan_restart(state.record, replicas=[1])) == [("restart", 1)]


def test_a_restart_that_leaves_nothing_serving_is_refused_unless_downtime_is_allowed(tmp_path):
    state = launched(tmp_path, cpu_facts(tmp_path, cores=1), replicas=1)
    with pytest.raises(ChangePlanError) as refused:
        plan_restart(state.record)
    assert refused.value.problems == [
        "replica 0 is the run's only replica: while it restarts every request fails; add "
        "--allow-downtime to restart it anyway (or scale to 2 first)"]
    assert steps(plan_restart(state.record, allow_downtime=True)) == [("restart", 0)]
    two = launched(tmp_path / "two", cpu_facts(tmp_path / "two"))
    two.update_replica(1, state=ReplicaState.DOWN)  # the other one does not serve
    with pytest.raises(ChangePlanError, match="no other replica is serving meanwhile"):
        plan_restart(two.record, replicas=[0])


@pytest.mark.parametrize("broken", [ReplicaState.FAILED, ReplicaState.DOWN])
def test_a_rolling_restart_restarts_the_replicas_that_do_not_serve_first(tmp_path, broken):
    """A failed replica is what an operator's restart is for: it goes first (each later step
    waits for the others to be healthy, so a failed one left for last would fail the change
    at its first step), and the steps after it count on it serving again, not on its state now
    (before: refused as leaving nothing serving)."""
    def break_(run: RunState, index: int) -> None:
        path = [broken] if broken is ReplicaState.DOWN else [ReplicaState.RESTARTING, broken]
        for step in path:  # as the sweep records it
            run.update_replica(index, state=step)

    state = launched(tmp_path, cpu_facts(tmp_path, cores=3), replicas=3)
    break_(state, 2)
    assert steps(plan_restart(state.record)) == [("restart", 2), ("restart", 0), ("restart", 1)]
    two = launched(tmp_path / "two", cpu_facts(tmp_path / "two"))
    break_(two, 1)
    assert steps(plan_restart(two.record)) == [("restart", 1), ("restart", 0)]
    with pytest.raises(ChangePlanError, match="no other replica is serving meanwhile"):
        plan_restart(two.record, replicas=[0])  # nothing restarts 1 first: still refused


def test_a_weight_share_leader_restarts_last_and_takes_its_followers(tmp_path):
    state = launched(tmp_path, cpu_facts(tmp_path, cores=3), replicas=3, share_weights=True)
    with pytest.raises(ChangePlanError, match="replica 0's restart takes down replicas 0, 1, 2"):
        plan_restart(state.record)  # the group is the whole run
    request = plan_restart(state.record, allow_downtime=True)
    assert steps(request) == [("restart", 0)]
    assert "followers restart with it" in request.summary
    # what is wanted has no order of its own: the followers go by their numbers
    assert steps(plan_restart(state.record, replicas=[2, 1])) == [("restart", 1),
                                                                   ("restart", 2)]


def test_a_model_update_restarts_every_replica_with_its_new_launch(tmp_path):
    facts = cpu_facts(tmp_path)
    state = launched(tmp_path, facts)
    request = plan_restart(state.record, engine_args=("--model", "tiny", "--seed", "3"),
                           replan=replanner(facts))
    assert steps(request) == [("restart", 0), ("restart", 1)]
    for step, old in zip(request.steps, state.replicas, strict=True):
        assert step.relaunch.argv[-4:] == ("--model", "tiny", "--seed", "3")
        assert step.relaunch.argv[:-4] == old.argv  # port, block, threads: as they were
        assert step.relaunch.cpus == old.cpus
    assert request.plan.engine_args == ("--model", "tiny", "--seed", "3")
    assert request.summary == "model update of replicas 0, 1 to `--model tiny --seed 3`"
    with pytest.raises(ChangePlanError, match="give no --replica"):
        plan_restart(state.record, replicas=[0], engine_args=("--model", "tiny"))
    with pytest.raises(ChangePlanError, match=r"--replica 7: run run-d2 has replicas 0, 1"):
        plan_restart(state.record, replicas=[7])


def test_a_run_without_its_options_cannot_be_replanned(tmp_path):
    from omni_dp.launcher.changes.plan import replan

    state = launched(tmp_path, cpu_facts(tmp_path))
    old = dataclasses.replace(state.record, plan=dataclasses.replace(state.plan, options=None))
    with pytest.raises(ChangePlanError, match="did not keep its options"):
        replan(old, {"replicas": 3})


# --- omni-dp scale ---------------------------------------------------------------------------


def test_scaling_up_adds_replicas_and_moves_the_others_into_their_new_blocks(tmp_path):
    facts = cpu_facts(tmp_path)
    state = launched(tmp_path, facts, replicas=1)
    assert state.replica(0).cpus == "0-1"
    request = plan_scale(state.record, 2, replan=replanner(facts))
    assert steps(request) == [("add", 1), ("restart", 0)]  # the new one serves first
    add, restart = request.steps
    assert add.added.cpus == "1" and add.added.port == state.replica(0).port + 1
    assert restart.relaunch.cpus == "0"
    assert request.plan.replicas == 2 and request.plan.options["replicas"] == 2
    assert "replicas 0 restart into their new CPU blocks, one at a time" in request.summary


def test_scaling_down_removes_from_the_top_and_keeps_the_last_one_serving_as_it_is(tmp_path):
    facts = cpu_facts(tmp_path)
    state = launched(tmp_path, facts)
    request = plan_scale(state.record, 1, replan=replanner(facts))
    assert steps(request) == [("remove", 1)]  # replica 0 would grow to both cores: kept
    assert "replica 0 keeps running as it was started" in request.summary
    unpinned = launched(tmp_path / "u", cpu_facts(tmp_path / "u"), replicas=3,
                        cpu_blocks="none")
    assert steps(plan_scale(unpinned.record, 1, replan=replanner(cpu_facts(tmp_path / "u")))
                 )[:2] == [("remove", 2), ("remove", 1)]


def test_scaling_to_the_count_it_has_changes_nothing(tmp_path):
    state = launched(tmp_path, cpu_facts(tmp_path))
    request = plan_scale(state.record, 2, replan=lambda *a: pytest.fail("re-planned"))
    assert request.steps == () and request.summary == "already 2 replicas: nothing to change"


def test_a_scale_is_held_to_launchs_checks_every_problem_at_once(tmp_path):
    facts = cpu_facts(tmp_path)
    state = launched(tmp_path, facts)
    with pytest.raises(ChangePlanError) as refused:
        plan_scale(state.record, 3, replan=replanner(facts))  # 3 blocks on 2 cores
    assert any("3 replicas need 3 physical cores" in p for p in refused.value.problems)
    with pytest.raises(ChangePlanError, match="--replicas must be at least 1, got 0"):
        plan_scale(state.record, 0)


def test_the_machine_without_the_run_has_its_ports_id_and_memory_free(tmp_path):
    facts = cpu_facts(tmp_path)
    state = launched(tmp_path, facts)
    record = state.record
    for r in record.replicas:
        state.update_replica(r.index, memory_bytes=3 * GiB)
    record = state.record
    own = {r.port for r in record.replicas}
    facts = dataclasses.replace(
        facts, slots=gpu_slots(h200(memory_used_bytes=10 * GiB)),
        taken_ports=frozenset({*own, 9999}),
        runs=(KnownRun(record.run_id, state.directory, "cpu", True),
              KnownRun("other", state.directory, "cpu", True)))
    freed = without_run(facts, record)
    assert freed.taken_ports == frozenset({9999})
    assert [r.run_id for r in freed.runs] == ["other"]
    assert freed.first_gpu.memory_used_bytes == 4 * GiB  # its two replicas' 3 GiB each, as measured


# --- the request handed to the supervisor ----------------------------------------------------


def request_of(kind: str = "restart") -> ChangeRequest:
    return ChangeRequest(kind, (Step("restart", 0),), "rolling restart of replicas 0", 30.0)


def test_one_change_at_a_time(tmp_path):
    first = request_of()
    submit(tmp_path, first)
    with pytest.raises(ChangeRefused, match=f"another change is already asked for .*{first.id}"):
        submit(tmp_path, request_of())
    taken = take(tmp_path)
    assert taken.id == first.id and taken.state == "running"
    assert not (tmp_path / REQUEST_FILE).exists()
    with pytest.raises(ChangeRefused, match=f"change {first.id} .* is still running"):
        submit(tmp_path, request_of())
    ended = finish(tmp_path, taken, None)
    assert read_change(tmp_path).state == "done" == ended.state
    submit(tmp_path, request_of("scale"))  # the next may come now
    assert take(tmp_path).kind == "scale"


def test_an_unreadable_request_is_set_aside_not_made(tmp_path):
    (tmp_path / REQUEST_FILE).write_text('{"kind": "explode"}')
    assert take(tmp_path) is None
    assert not (tmp_path / REQUEST_FILE).exists()
    assert (tmp_path / f"{REQUEST_FILE}.unreadable").exists()
    assert not (tmp_path / CHANGE_FILE).exists()


@pytest.mark.parametrize(("edit", "why"), [
    (lambda steps: steps[1].update(action="grow"),
     "change.steps[1].action is 'grow', not one of restart, add, remove"),
    (lambda steps: steps[1]["launch"].pop("port"), "change.steps[1].launch has no 'port'"),
    (lambda steps: steps[1].update(launch=None),
     "change.steps[1].launch: an add step, and only one, carries the replica's record"),
    (lambda steps: steps[0].update(launch={"argv": "serve", "env": {}, "cpus": None}),
     "change.steps[0].launch.argv is a string, not a list"),
])
def test_a_malformed_request_is_refused_whole_before_any_step(tmp_path, edit, why):
    """Every step is typed when the request is taken: a bad second step is refused with the
    first (which would otherwise have run), said, and set aside."""
    state = launched(tmp_path, cpu_facts(tmp_path))
    added = dataclasses.replace(state.replica(1), index=2, port=state.replica(1).port + 1)
    data = ChangeRequest("scale", (Step("restart", 0), Step("add", 2, added=added)),
                         "scale to 3", 5.0, plan=dataclasses.replace(state.plan, replicas=3)
                         ).to_json()
    edit(data["steps"])
    (state.directory / REQUEST_FILE).write_text(json.dumps(data))
    said: list[str] = []
    assert take(state.directory, said.append) is None
    assert not (state.directory / CHANGE_FILE).exists()  # never running: no step was made
    assert (state.directory / f"{REQUEST_FILE}.unreadable").exists()
    [refusal] = said
    assert refusal.endswith(f"{REQUEST_FILE} cannot be read: {why}")


def test_a_step_cannot_be_built_wrong_where_it_is_written():
    with pytest.raises(ValueError, match="an add step, and only one, carries"):
        Step("add", 1)
    with pytest.raises(ValueError, match="a remove step carries no new launch"):
        Step("remove", 1, relaunch=Relaunch(("serve",), {}, None))


def test_a_request_round_trips_whole(tmp_path):
    state = launched(tmp_path, cpu_facts(tmp_path))
    added = dataclasses.replace(state.replica(1), index=2, port=state.replica(1).port + 1)
    request = ChangeRequest("scale", (Step("add", 2, added=added), Step("remove", 3),
                                      Step("restart", 0, relaunch=Relaunch(("serve",), {}, "0"))),
                            "scale from 4 to 3", 5.0,
                            plan=dataclasses.replace(state.plan, replicas=3),
                            gpus=state.record.gpus, wait_healthy=12.5)
    assert ChangeRequest.from_json(json.loads(json.dumps(request.to_json()))) == request
    older = {k: v for k, v in request.to_json().items() if k != "wait_healthy"}
    assert ChangeRequest.from_json(older).wait_healthy == OLD_REQUEST_WAIT_S


# --- --wait-healthy: how long a step waits for the other replicas -----------------------------


def test_the_wait_for_the_others_is_the_runs_start_timeout_and_a_restart_unless_asked(tmp_path):
    facts = cpu_facts(tmp_path)
    state = launched(tmp_path, facts, replicas=3, cpu_blocks="none")
    default = state.supervision.start_timeout + RESTART_MARGIN_S
    assert plan_restart(state.record).wait_healthy == default
    assert plan_restart(state.record, wait_healthy=7.0).wait_healthy == 7.0
    assert plan_restart(state.record, wait_healthy=0.0).wait_healthy == 0.0
    scale = plan_scale(state.record, 2, replan=replanner(facts))
    assert scale.wait_healthy == default
    assert plan_scale(state.record, 2, wait_healthy=0.0, replan=replanner(facts)
                      ).wait_healthy == 0.0


def test_wait_healthy_goes_from_the_command_line_to_the_request(tmp_path, monkeypatch):
    state = launched(tmp_path, cpu_facts(tmp_path))
    asked: list[ChangeRequest] = []
    monkeypatch.setattr(change_commands, "_live", lambda run_id, command: state)
    monkeypatch.setattr(change_commands, "_ask",
                        lambda command, state, request, as_json: asked.append(request))
    for args in (["restart", "r", "--wait-healthy", "7"], ["scale", "r", "-n", "2",
                                                          "--wait-healthy", "0"],
                 ["restart", "r"]):
        result = CliRunner().invoke(cli, args, prog_name="omni-dp")
        assert result.exit_code == 0, result.output
    assert [r.wait_healthy for r in asked] == [7.0, 0.0, state.supervision.start_timeout
                                               + RESTART_MARGIN_S]
    for bad in ("-1", "nan"):
        refused = CliRunner().invoke(cli, ["restart", "r", "--wait-healthy", bad])
        assert refused.exit_code == 2 and "--wait-healthy" in refused.output
    for command in ("restart", "scale"):
        # click may wrap a line at a hyphen ("--start-" / "timeout"): joined again
        shown = " ".join(CliRunner().invoke(cli, [command, "--help"]).output.split()
                         ).replace("- ", "-")
        assert "0: do not wait" in shown and "--start-timeout plus 60 s" in shown, shown


# --- events: one enum, written and read ------------------------------------------------------


def test_an_event_is_written_only_by_its_name_in_the_enum(tmp_path):
    state = launched(tmp_path, cpu_facts(tmp_path))
    with pytest.raises(TypeError, match="an event is named by an Event, not 'change_stpe'"):
        state.event("change_stpe", change="x")  # a typo no reader would ever match
    state.event(Event.CHANGE_STEP, change="x", step=1, action="restart", replica=0)
    [line] = [e for e in state.events() if e.get("change") == "x"]
    assert line["event"] == "change_step" and describe(line) == "step 1: restart replica 0"


def test_no_event_name_is_dead():
    """Writers and readers name events by the enum alone, every name in it is used by the
    launcher's modules (written, or read back by follow.py), and none they use is missing."""
    import ast
    from pathlib import Path

    import omni_dp.launcher as launcher

    written: set[str] = set()
    for path in Path(launcher.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id == "Event":
                written.add(node.attr)
    assert written == {e.name for e in Event}  # and none named that is not one


# --- a change acts only on the run it was planned from ----------------------------------------


def test_a_change_carries_the_run_it_was_planned_from_as_the_supervisor_sees_it(tmp_path):
    """The command plans from run.json; the supervisor of a foreground launch holds the record
    bring-up made: both see the same basis, and it moves only with the run's shape."""
    facts = cpu_facts(tmp_path)
    state = launched(tmp_path, facts)
    read_back = RunState.load(state.directory).record
    assert basis_of(state.record) == basis_of(read_back)
    assert plan_restart(read_back).basis == basis_of(state.record)
    assert plan_scale(read_back, 2, replan=replanner(facts)).basis == basis_of(state.record)
    state.update_replica(1, state=ReplicaState.DOWN, last_error="gone",
                         identity=ProcessIdentity(77, 2.0))
    assert basis_of(state.record) == basis_of(read_back)  # health and pids are not its shape
    state.set_scale(state.replicas[:1], dataclasses.replace(state.plan, replicas=1),
                    state.record.gpus)
    assert basis_of(state.record) != basis_of(read_back)


def test_a_change_planned_from_another_run_shape_does_not_begin(tmp_path):
    facts = cpu_facts(tmp_path, cores=4)
    state = launched(tmp_path, facts, replicas=1)
    up = plan_scale(state.record, 3, replan=replanner(facts))
    assert stale_basis(up, state.record) is None
    grown = plan_scale(state.record, 2, replan=replanner(facts))
    state.set_scale((*state.replicas, grown.desired.replicas[1]), grown.desired.plan,
                    grown.gpus)
    why = stale_basis(up, state.record)  # another scale ended meanwhile
    assert why.startswith(f"run {state.run_id} changed after this change was planned") and \
        "it has 2 replicas now): nothing was done; ask again" in why
    unchecked = dataclasses.replace(up, basis=None)  # a request of an omni-dp before it
    assert stale_basis(unchecked, state.record) is None
