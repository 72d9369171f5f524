"""A day-two change as desired state (changes/desired.py): record in → step out, no thread, no
process. The step is chosen from the live record at each call, so a run that changed after the
change was planned gets the step that fits it, never one of the old snapshot's."""

from __future__ import annotations

import dataclasses
import json

import pytest

from omni_dp.launcher.changes.desired import (
    desired_of,
    expected_steps,
    next_step,
    wanted,
)
from omni_dp.launcher.changes.request import ChangeRequest, Relaunch, Step
from omni_dp.launcher.record.writes import DesiredSet, next_record
from omni_dp.runfile import Desired, ReplicaRecord, ReplicaState, RunRecord

from support.supervision import make_state


def desired(record: RunRecord, replicas: list[ReplicaRecord], change: str = "c0") -> Desired:
    plan = dataclasses.replace(record.plan, replicas=len(replicas))
    return Desired(change, tuple(replicas), plan, record.gpus)


def as_is(record: RunRecord) -> list[ReplicaRecord]:
    return [wanted(r) for r in record.replicas]


def bumped(r: ReplicaRecord) -> ReplicaRecord:
    return dataclasses.replace(r, generation=r.generation + 1)


def new_replica(index: int) -> ReplicaRecord:
    return ReplicaRecord(index=index, port=41000 + index, url=f"http://replica-{index}.test",
                         cpus=None, argv=("serve",), env={}, log=f"replica_{index}.log")


def with_states(record: RunRecord, **states: ReplicaState) -> RunRecord:
    replicas = tuple(dataclasses.replace(r, state=states.get(f"r{r.index}", r.state))
                     for r in record.replicas)
    return dataclasses.replace(record, replicas=replicas)


def test_a_run_as_wanted_has_no_step(tmp_path):
    record = make_state(tmp_path).record
    assert next_step(desired(record, as_is(record)), record) is None


def test_fewer_replicas_than_wanted_adds_the_next_one_with_its_wanted_record(tmp_path):
    record = make_state(tmp_path, replicas=1).record
    goal = desired(record, [*as_is(record), new_replica(1), new_replica(2)])
    assert next_step(goal, record) == Step("add", 1, added=new_replica(1))
    assert expected_steps(goal, record) == (Step("add", 1, added=new_replica(1)),
                                            Step("add", 2, added=new_replica(2)))


def test_more_replicas_than_wanted_removes_the_highest_numbered_first(tmp_path):
    record = make_state(tmp_path, replicas=3).record
    goal = desired(record, as_is(record)[:1])
    assert [(s.action, s.replica) for s in expected_steps(goal, record)] == [
        ("remove", 2), ("remove", 1)]


def test_a_restart_is_due_by_generation_and_carries_a_new_launch_only_when_there_is_one(
        tmp_path):
    record = make_state(tmp_path, replicas=2).record
    restart_both = desired(record, [bumped(r) for r in as_is(record)])
    assert next_step(restart_both, record) == Step("restart", 0)  # same launch: none carried
    updated = [dataclasses.replace(r, argv=("serve", "--model", "new")) for r in as_is(record)]
    goal = desired(record, [bumped(r) for r in updated])
    assert next_step(goal, record) == Step("restart", 0, relaunch=Relaunch(
        ("serve", "--model", "new"), {}, None))
    # a replica relaunched by the change (its launch and generation written) is not due again
    relaunched = record.with_replica(0, argv=("serve", "--model", "new"), generation=1)
    assert next_step(goal, relaunched).replica == 1
    # a crash restart by the sweep makes no generation: still due
    crashed = record.with_replica(0, state=ReplicaState.RESTARTING)
    assert next_step(restart_both, crashed) == Step("restart", 0)


def test_the_replicas_that_do_not_serve_restart_first_and_a_share_leader_last(tmp_path):
    record = with_states(make_state(tmp_path, replicas=3).record, r2=ReplicaState.DOWN)
    goal = desired(record, [bumped(r) for r in as_is(record)])
    assert [s.replica for s in expected_steps(goal, record)] == [2, 0, 1]
    share = make_state(tmp_path / "s", replicas=3, share=True).record
    # the leader takes its followers with it: one step for the group
    goal = desired(share, [bumped(r) for r in as_is(share)])
    assert expected_steps(goal, share) == (Step("restart", 0),)
    # followers asked for alone restart alone
    goal = desired(share, [as_is(share)[0], *map(bumped, as_is(share)[1:])])
    assert [s.replica for s in expected_steps(goal, share)] == [1, 2]


def test_a_run_changed_after_planning_gets_the_step_that_fits_it_not_the_snapshots(tmp_path):
    """Planned from 1 replica to 3 (add 1, add 2): a replica 1 recorded meanwhile makes the
    next step add 2 (the old list's add 1 would clash); planned as a restart of 0..2, a record
    that lost replica 2 gets it back first, and one with an extra replica 3 loses it first."""
    one = make_state(tmp_path, replicas=1).record
    goal = desired(one, [*as_is(one), new_replica(1), new_replica(2)])
    assert [(s.action, s.replica) for s in expected_steps(goal, one)] == [("add", 1),
                                                                          ("add", 2)]
    grown = dataclasses.replace(one, replicas=(*one.replicas, new_replica(1)))
    assert next_step(goal, grown) == Step("add", 2, added=new_replica(2))

    three = make_state(tmp_path / "3", replicas=3).record
    restart_all = desired(three, [bumped(r) for r in as_is(three)])
    lost = dataclasses.replace(three, replicas=three.replicas[:2])
    assert next_step(restart_all, lost) == Step("add", 2, added=restart_all.replicas[2])
    extra = dataclasses.replace(three, replicas=(*three.replicas, new_replica(3)))
    assert next_step(restart_all, extra) == Step("remove", 3)


def test_a_request_of_before_desired_state_wants_what_its_steps_would_leave(tmp_path):
    record = make_state(tmp_path, replicas=3).record
    old = ChangeRequest("scale", (Step("remove", 2), Step(
        "restart", 0, relaunch=Relaunch(("serve", "-x"), {"A": "1"}, "0"))), "scale to 2",
        1.0, plan=dataclasses.replace(record.plan, replicas=2))
    goal = desired_of(old, record)
    assert goal.change == old.id and goal.plan.replicas == len(goal.replicas) == 2
    assert (goal.replicas[0].argv, dict(goal.replicas[0].env), goal.replicas[0].cpus,
            goal.replicas[0].generation) == (("serve", "-x"), {"A": "1"}, "0", 1)
    assert goal.replicas[1] == wanted(record.replicas[1])
    assert [(s.action, s.replica) for s in expected_steps(goal, record)] == [("remove", 2),
                                                                             ("restart", 0)]


def test_what_a_change_wants_round_trips_in_run_json_and_is_absent_without_one(tmp_path):
    record = make_state(tmp_path, replicas=2).record
    assert "desired" not in record.to_json()
    assert "generation" not in record.to_json()["replicas"][0]  # 0: as a run.json of before
    goal = desired(record, [bumped(r) for r in as_is(record)], change="abcd1234")
    written = next_record(DesiredSet(goal), record)
    read = RunRecord.from_json(json.loads(json.dumps(written.to_json())))
    assert read.desired == goal and read.replicas == record.replicas
    assert written.to_json()["desired"]["replicas"][0]["generation"] == 1
    assert next_record(DesiredSet(None), read).desired is None


def test_a_desired_that_does_not_add_up_is_refused_where_it_is_made(tmp_path):
    record = make_state(tmp_path, replicas=2).record
    with pytest.raises(ValueError, match=r"numbered 0\.\.N-1"):
        desired(record, as_is(record)[1:])
    with pytest.raises(ValueError, match="not the change's id"):
        ChangeRequest("restart", (), "x", 1.0, desired=desired(record, as_is(record)))


def test_a_restart_a_change_made_changes_the_basis_and_none_keeps_it_as_before(tmp_path):
    """A rolling restart planned before another one ended would want a generation the run
    already has (a restart that does nothing): its basis no longer matches. A run no change
    restarted has the basis an omni-dp before generations computed."""
    import hashlib

    from omni_dp.launcher.changes.request import basis_of

    record = make_state(tmp_path, replicas=2).record
    assert basis_of(record.with_replica(0, generation=1)) != basis_of(record)
    assert basis_of(record) == basis_of(record.with_replica(1, state=ReplicaState.DOWN))
    # the digest of before: plan, GPU slots, each replica's launch, no generation
    shape = {"plan": record.plan.to_json(), "gpus": [g.to_json() for g in record.gpus],
             "replicas": [[r.index, r.port, list(r.argv), dict(r.env), r.cpus, r.gpu]
                          for r in record.replicas]}
    before = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]
    assert basis_of(record) == before
