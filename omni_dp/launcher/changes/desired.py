"""A day-two change as desired state: what the run should be (runfile.Desired, in run.json while
the change runs), and `next_step`, the one step that brings the live record closer to it.

The supervisor's loop asks next_step at every sweep with no step in flight (gunicorn's
manage_workers, a Kubernetes controller): the step is chosen from the run as it is then, never
from the snapshot the change was planned from, so a replica added or removed meanwhile is
counted, and a supervisor that takes the run over goes on from where the record is. The same
function, run over a simulated record (`expected_steps`), gives the steps a command shows.
Pure: nothing here starts, stops or writes anything.
"""

from __future__ import annotations

from dataclasses import replace

from omni_dp.launcher.changes.request import ChangeRequest, Relaunch, Step
from omni_dp.launcher.planning.share_group import LEADER, followers
from omni_dp.runfile import Desired, ReplicaRecord, ReplicaState, RunRecord

# Replicas in these states serve requests (or will, once their restart passed): what keeps a
# run up while another restarts.
SERVING = frozenset({ReplicaState.HEALTHY, ReplicaState.UNHEALTHY, ReplicaState.STARTING,
                     ReplicaState.RESTARTING})


def wanted(replica: ReplicaRecord) -> ReplicaRecord:
    """A replica as a Desired keeps it: its launch and generation, nothing of a process."""
    return ReplicaRecord(index=replica.index, port=replica.port, url=replica.url,
                         cpus=replica.cpus, argv=tuple(replica.argv), env=dict(replica.env),
                         log=replica.log, gpu=replica.gpu, generation=replica.generation)


def launch_of(replica: ReplicaRecord) -> Relaunch:
    return Relaunch(tuple(replica.argv), dict(replica.env), replica.cpus)


def relaunched(live: ReplicaRecord, want: ReplicaRecord) -> bool:
    """Whether the live replica runs another launch than the wanted one (argv, env, block)."""
    return (tuple(live.argv) != tuple(want.argv) or dict(live.env) != dict(want.env)
            or live.cpus != want.cpus)


def due(live: ReplicaRecord, want: ReplicaRecord) -> bool:
    """Whether the change must still restart it: another launch, or a restart not yet made."""
    return relaunched(live, want) or live.generation < want.generation


def restart_group(record: RunRecord, index: int) -> list[int]:
    """What a restart of this replica takes down with it: a weight-share leader its group."""
    if record.plan.share_weights and index == LEADER:
        return [LEADER, *followers(True, (r.index for r in record.replicas))]
    return [index]


def restart_order(record: RunRecord, indices: list[int]) -> list[int]:
    """The replicas to restart, in the order they go. The ones that do not serve first, as
    Kubernetes replaces its broken pods first: each later step waits for every other replica
    to be healthy (--wait-healthy), and a failed one restarted last would fail the change at
    its first step. A weight-share leader last: its restart takes its followers."""
    state = {r.index: r.state for r in record.replicas}
    order = sorted(dict.fromkeys(indices), key=lambda i: state[i] in SERVING)
    group = restart_group(record, LEADER)
    if LEADER in order and len(group) > 1:
        return [i for i in order if i not in group] + [LEADER]
    return order


def next_step(desired: Desired, record: RunRecord) -> Step | None:
    """The step that brings `record` closer to `desired` (None: the run is as desired).
    Fewer replicas than wanted: add the next one (its wanted record); more: remove the
    highest-numbered (the others keep their numbers); else restart the first replica, in
    restart_order, whose launch or generation is not the wanted one (with its new launch)."""
    have, want = len(record.replicas), len(desired.replicas)
    if have < want:
        return Step("add", have, added=desired.replicas[have])
    if have > want:
        return Step("remove", have - 1)
    pending = [r.index for r in record.replicas if due(r, desired.replicas[r.index])]
    if not pending:
        return None
    index = restart_order(record, pending)[0]
    live, goal = record.replicas[index], desired.replicas[index]
    return Step("restart", index, relaunch=launch_of(goal) if relaunched(live, goal) else None)


def after(step: Step, desired: Desired, record: RunRecord) -> RunRecord:
    """The record once `step` passed, as the change's own writes leave it (what the command
    simulates to show the steps; the states are left as they were: what a step restarted
    counts as serving for the steps after it)."""
    if step.action == "add":
        assert step.added is not None
        return replace(record, replicas=(*record.replicas, step.added))
    if step.action == "remove":
        return replace(record, replicas=record.replicas[:step.replica])
    return _relaunched(record, desired, restart_group(record, step.replica))


def _relaunched(record: RunRecord, desired: Desired, members: list[int]) -> RunRecord:
    replicas = list(record.replicas)
    for i in members:
        goal = desired.replicas[i]
        replicas[i] = replace(replicas[i], argv=goal.argv, env=goal.env, cpus=goal.cpus,
                              generation=goal.generation)
    return replace(record, replicas=tuple(replicas))


def expected_steps(desired: Desired, record: RunRecord) -> tuple[Step, ...]:
    """The steps next_step takes from `record` to `desired` if every one passes and nothing
    else changes the run meanwhile: what the command shows and CHANGE_STARTED lists."""
    steps: list[Step] = []
    while (step := next_step(desired, record)) is not None:
        if len(steps) > 2 * (len(desired.replicas) + len(record.replicas)):
            raise AssertionError(f"no end to the steps towards {desired}")  # a bug, never data
        steps.append(step)
        record = after(step, desired, record)
    return tuple(steps)


def desired_of(change: ChangeRequest, record: RunRecord) -> Desired:
    """What the change wants: its own Desired, or, for a request of an omni-dp before it (a
    list of steps only), the run as `record` would be once every step passed."""
    if change.desired is not None:
        return change.desired
    plan = change.plan or record.plan
    goal = Desired(change.id, tuple(wanted(r) for r in record.replicas),
                   replace(plan, replicas=len(record.replicas)), change.gpus or record.gpus)
    for step in change.steps:
        replicas = list(goal.replicas)
        if step.action == "add" and step.added is not None:
            replicas.append(wanted(step.added))
        elif step.action == "remove":
            replicas = replicas[:step.replica]
        elif step.replica < len(replicas):
            for i in restart_group(replace(record, replicas=tuple(replicas)), step.replica):
                replicas[i] = replace(replicas[i], generation=replicas[i].generation + 1)
            if step.relaunch is not None:
                launch = step.relaunch
                replicas[step.replica] = replace(replicas[step.replica], argv=launch.argv,
                                                 env=dict(launch.env), cpus=launch.cpus)
        goal = replace(goal, replicas=tuple(replicas),
                       plan=replace(goal.plan, replicas=len(replicas)))
    return goal
