"""Planning a day-two change: a rolling restart (with the run's own plan, or new engine
arguments: a model update) or a scale to N replicas, as what the run should be once it is made
(runfile.Desired), which the supervisor reconciles the run with one step per sweep
(changes/desired.py), and the steps that takes from the run as it is now (what the command
shows).

A change with new engine arguments or a new replica count is planned as `launch` plans — the
same options (as run.json kept them), the machine read again, `plan_launch` with every check
(CPU blocks, memory fit, KV pin, the MPS client limit) — on the machine as it would be without
this run: its own ports are not "taken", its run id is not "in use", the memory its replicas
hold is counted as free. Every problem is said at once (ChangePlanError: exit 2), nothing is
written. Nothing here starts, stops or writes anything.
"""

from __future__ import annotations

import dataclasses
import secrets
import shlex
from collections.abc import Callable

from omni_dp.contract import Problems
from omni_dp.cpulist import format_cpu_list
from omni_dp.gpus import GpuFacts
from omni_dp.launcher.changes.desired import (
    SERVING,
    expected_steps,
    restart_group,
    wanted,
)
from omni_dp.launcher.changes.request import ChangeRequest, basis_of
from omni_dp.launcher.planning.checks import check_options
from omni_dp.launcher.planning.facts import LaunchFacts, gather_facts
from omni_dp.launcher.planning.memory import memory_formula
from omni_dp.launcher.planning.options import options_from_record
from omni_dp.launcher.planning.plan import (
    LaunchPlan,
    LaunchPlanError,
    ReplicaPlan,
    plan_launch,
)
from omni_dp.launcher.planning.share_group import LEADER
from omni_dp.launcher.record.state import replica_record
from omni_dp.runfile import Desired, GpuRecord, PlanRecord, ReplicaRecord, RunRecord

# The default bound of a step's wait for the other replicas to be healthy: one restart of
# theirs, on top of its start (--start-timeout): the sweep sees it down (a few checks) and its
# restart's backoff (at most 30 s) comes first.
RESTART_MARGIN_S = 60.0


class ChangePlanError(Problems):
    """Every problem that stops this change, before anything was asked of the run."""


Replan = Callable[[RunRecord, dict], LaunchPlan]


def replan(record: RunRecord, changes: dict) -> LaunchPlan:
    """The run's plan with `changes` to its options, as `launch` would make it on this machine
    without the run; LaunchPlanError / ChangePlanError with every problem."""
    if record.plan.options is None:
        raise ChangePlanError([f"run {record.run_id} was launched by an omni-dp that did not "
                               "keep its options in run.json: it cannot be re-planned; down it "
                               "and launch it again to change it"])
    options, problems = options_from_record(dict(record.plan.options))
    if problems:
        raise ChangePlanError(problems)
    options = dataclasses.replace(options, run_id=record.run_id, detach=True, **changes)
    option_problems = check_options(options)
    facts = without_run(gather_facts(options, option_problems=option_problems), record)
    return plan_launch(options, facts)


def without_run(facts: LaunchFacts, record: RunRecord) -> LaunchFacts:
    """The machine as it would be without this run: its ports free, its id unused, the memory
    its replicas hold (as measured at their gates; else as the plan counts one) available."""
    ports = {r.port for r in record.replicas}
    if record.router is not None:
        ports.add(int(record.router.url.rsplit(":", 1)[1]))
    held = {slot: _held(facts, [r for r in record.replicas if r.gpu == slot], record)
            for slot in {r.gpu for r in record.replicas}}
    slots = tuple(dataclasses.replace(s, gpu=_freed(s.gpu, held.get(s.slot, 0)))
                  for s in facts.slots)
    host = facts.host_memory_available + (sum(held.values()) if facts.first_gpu is None else 0)
    return dataclasses.replace(
        facts, taken_ports=frozenset(facts.taken_ports - ports),
        runs=tuple(r for r in facts.runs if r.run_id != record.run_id),
        slots=slots, host_memory_available=host)


def _held(facts: LaunchFacts, replicas: list[ReplicaRecord], record: RunRecord) -> int:
    measured = [r.memory_bytes for r in replicas]
    if measured and all(m is not None for m in measured):
        return sum(m for m in measured if m is not None)
    if facts.sizing is None:
        return 0  # neither measured nor sized: counted as held by others (a stricter check)
    return memory_formula(facts.sizing, len(replicas), record.plan.share_weights)[0]


def _freed(gpu: GpuFacts | None, held: int) -> GpuFacts | None:
    if gpu is None or gpu.memory_used_bytes is None:
        return gpu
    return dataclasses.replace(gpu, memory_used_bytes=max(0, gpu.memory_used_bytes - held))


def _launched(old: ReplicaRecord, planned: ReplicaPlan) -> ReplicaRecord:
    """The replica as a change wants it: its planned launch (argv, env, CPU block)."""
    return dataclasses.replace(wanted(old), argv=tuple(planned.argv), env=dict(planned.env),
                               cpus=format_cpu_list(planned.cpus) if planned.cpus else None)


def _desired(change: str, record: RunRecord, replicas: list[ReplicaRecord],
             plan: PlanRecord | None = None,
             gpus: tuple[GpuRecord, ...] | None = None) -> Desired:
    plan = dataclasses.replace(plan or record.plan, replicas=len(replicas))
    return Desired(change, tuple(replicas), plan, gpus if gpus is not None else record.gpus)


def _serving_others(record: RunRecord, down: list[int],
                    back: frozenset[int] = frozenset()) -> list[int]:
    """The replicas that serve while `down` is down: serving now, or `back` (restarted by an
    earlier step of the same change, which fails there if one does not pass its gates)."""
    return [r.index for r in record.replicas
            if r.index not in down and (r.state in SERVING or r.index in back)]


# --- omni-dp restart -------------------------------------------------------------------------


def plan_restart(record: RunRecord, *, replicas: list[int] | None = None,
                 engine_args: tuple[str, ...] | None = None, allow_downtime: bool = False,
                 drain_timeout: float | None = None, wait_healthy: float | None = None,
                 replan: Replan = replan) -> ChangeRequest:
    """A rolling restart, one replica (or share group) at a time; with engine_args, a model
    update of every replica. ChangePlanError with every problem."""
    problems = _restart_problems(record, replicas, engine_args)
    if problems:
        raise ChangePlanError(problems)
    change = secrets.token_hex(4)
    asked = list(dict.fromkeys(replicas)) if replicas else [r.index for r in record.replicas]
    restarted = {i for k in asked for i in restart_group(record, k)}
    goal = [dataclasses.replace(wanted(r), generation=r.generation + (r.index in restarted))
            for r in record.replicas]
    plan, problems = None, []
    if engine_args is not None:  # planned whatever else is wrong: every problem at once
        try:
            new = _replanned(record, {"engine_args": tuple(engine_args)}, replan)
            plan = new.record()
            goal = [_launched(r, p) for r, p in zip(goal, new.replicas, strict=True)]
        except ChangePlanError as exc:
            problems += exc.problems
    desired = _desired(change, record, goal, plan)
    steps = expected_steps(desired, record)
    order = [s.replica for s in steps]
    if not allow_downtime:
        problems = _downtime_of(record, order) + problems
    if problems:
        raise ChangePlanError(problems)
    return ChangeRequest("restart", steps, _restart_summary(record, order, engine_args),
                         _drain(record, drain_timeout), plan=plan,
                         wait_healthy=wait_bound(record, wait_healthy),
                         basis=basis_of(record), id=change, desired=desired)


def _downtime_of(record: RunRecord, order: list[int]) -> list[str]:
    """Each step of `order` that would leave nothing serving (what earlier steps restarted
    counts as serving: the change fails there if one does not pass its gates)."""
    problems = []
    for n, index in enumerate(order):
        back = frozenset(j for k in order[:n] for j in restart_group(record, k))
        problems += _downtime(record, index, back)
    return problems


def _restart_summary(record: RunRecord, order: list[int],
                     engine_args: tuple[str, ...] | None) -> str:
    what = (f"model update of replicas {_names(order)} to `{shlex.join(engine_args)}`"
            if engine_args is not None else f"rolling restart of replicas {_names(order)}")
    if any(len(restart_group(record, i)) > 1 for i in order):
        what += f" (replica {LEADER} leads the weight share: its followers restart with it)"
    return what


def _restart_problems(record: RunRecord, replicas: list[int] | None,
                      engine_args: tuple[str, ...] | None) -> list[str]:
    known = {r.index for r in record.replicas}
    problems = [f"--replica {i}: run {record.run_id} has replicas "
                f"{_names(sorted(known))}" for i in replicas or [] if i not in known]
    if engine_args is not None and replicas:
        problems.append("new engine arguments go to every replica (a model update); give no "
                        "--replica: some replicas on the old arguments would serve another "
                        "model for good")
    return problems


def _downtime(record: RunRecord, index: int, back: frozenset[int] = frozenset()) -> list[str]:
    """Why restarting `index` would leave nothing serving; `back`: restarted before it."""
    down = restart_group(record, index)
    if _serving_others(record, down, back):
        return []
    if len(record.replicas) == 1:
        return [f"replica {index} is the run's only replica: while it restarts every request "
                "fails; add --allow-downtime to restart it anyway (or scale to 2 first)"]
    return [f"replica {index}'s restart takes down replicas {_names(down)}: no other replica "
            "is serving meanwhile; add --allow-downtime to restart anyway"]


# --- omni-dp scale ---------------------------------------------------------------------------


def plan_scale(record: RunRecord, target: int, *, per_gpu: bool = False,
               drain_timeout: float | None = None, wait_healthy: float | None = None,
               replan: Replan = replan) -> ChangeRequest:
    """Replicas added through launch's checks, or the highest-numbered removed; the others
    restarted one at a time where the new plan gives them another CPU block (`--cpu-blocks
    auto` splits the cores anew), never the last one serving. ChangePlanError when it cannot
    be; a ChangeRequest with no step when the run already has that many."""
    slots = max(len(record.gpus), 1)
    total = target * slots if per_gpu else target
    if target < 1:
        raise ChangePlanError([f"--replicas{'-per-gpu' if per_gpu else ''} must be at least "
                               f"1, got {target}"])
    now = len(record.replicas)
    if total == now:
        return ChangeRequest("scale", (), f"already {now} replicas: nothing to change",
                             _drain(record, drain_timeout),
                             wait_healthy=wait_bound(record, wait_healthy),
                             basis=basis_of(record))
    changes = {"replicas_per_gpu": target, "replicas": total} if per_gpu else \
        {"replicas": total, "replicas_per_gpu": None}
    new = _replanned(record, changes, replan)
    goal, kept_as_is = [], []
    for r in new.replicas:
        if r.index >= now:
            goal.append(replica_record(r))
            continue
        old = record.replicas[r.index]
        moved = _launched(old, r)
        if moved == wanted(old):
            goal.append(moved)
        elif total == 1 and now > 1:
            # the survivor restarting would leave nothing serving: kept as it was started
            goal.append(wanted(old))
            kept_as_is.append(r.index)
        else:  # restarted into its new block: a change's restart, a new generation
            goal.append(dataclasses.replace(moved, generation=old.generation + 1))
    change = secrets.token_hex(4)
    plan = new.record()
    desired = _desired(change, record, goal, plan, new.gpus)
    steps = expected_steps(desired, record)
    restarts = [s.replica for s in steps if s.action == "restart"]
    what = f"scale from {now} to {total} replicas" + (
        f"; replicas {_names(restarts)} restart into their new CPU "
        "blocks, one at a time" if restarts else "") + (
        f"; replica {_names(kept_as_is)} keeps running as it was started (its CPU block and "
        "threads: restarting the only one left serving would drop requests)"
        if kept_as_is else "")
    return ChangeRequest("scale", steps, what, _drain(record, drain_timeout),
                         plan=plan, gpus=new.gpus,
                         wait_healthy=wait_bound(record, wait_healthy),
                         basis=basis_of(record), id=change, desired=desired)


# --- shared ----------------------------------------------------------------------------------


def _replanned(record: RunRecord, changes: dict, replan: Replan) -> LaunchPlan:
    try:
        return replan(record, changes)
    except LaunchPlanError as exc:
        raise ChangePlanError(list(exc.problems)) from None


def _drain(record: RunRecord, drain_timeout: float | None) -> float:
    return record.plan.supervision.drain_timeout if drain_timeout is None else drain_timeout


def wait_bound(record: RunRecord, wait_healthy: float | None) -> float:
    """How long a step waits for the others to be healthy: as asked, else the run's start
    timeout plus RESTART_MARGIN_S."""
    if wait_healthy is not None:
        return wait_healthy
    return record.plan.supervision.start_timeout + RESTART_MARGIN_S


def _names(indices: list[int]) -> str:
    return ", ".join(map(str, indices))

