"""Planning a day-two change: a rolling restart (with the run's own plan, or new engine
arguments: a model update) or a scale to N replicas, as the steps the supervisor will take.

A change with new engine arguments or a new replica count is planned as `launch` plans — the
same options (as run.json kept them), the machine read again, `plan_launch` with every check
(CPU blocks, memory fit, KV pin, the MPS client limit) — on the machine as it would be without
this run: its own ports are not "taken", its run id is not "in use", the memory its replicas
hold is counted as free. Every problem is said at once (ChangePlanError: exit 2), nothing is
written. Nothing here starts, stops or writes anything.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Callable

from omni_dp.contract import Problems
from omni_dp.cpulist import format_cpu_list
from omni_dp.gpus import GpuFacts
from omni_dp.launcher.changes.request import ChangeRequest, Relaunch, Step, basis_of
from omni_dp.launcher.planning.checks import check_options
from omni_dp.launcher.planning.facts import LaunchFacts, gather_facts
from omni_dp.launcher.planning.memory import memory_formula
from omni_dp.launcher.planning.options import options_from_record
from omni_dp.launcher.planning.plan import LaunchPlan, LaunchPlanError, plan_launch
from omni_dp.launcher.planning.share_group import LEADER, followers
from omni_dp.launcher.record.state import replica_record
from omni_dp.runfile import ReplicaRecord, ReplicaState, RunRecord

# Replicas in these states serve requests (or will, once their restart passed): what keeps a
# run up while another restarts.
SERVING = frozenset({ReplicaState.HEALTHY, ReplicaState.UNHEALTHY, ReplicaState.STARTING,
                     ReplicaState.RESTARTING})


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


def _launch(r) -> Relaunch:
    """A planned replica's launch, as a restart step carries it."""
    return Relaunch(tuple(r.argv), dict(r.env), format_cpu_list(r.cpus) if r.cpus else None)


def _changed(old: ReplicaRecord, launch: Relaunch) -> bool:
    return (tuple(old.argv) != launch.argv or dict(old.env) != dict(launch.env)
            or old.cpus != launch.cpus)


def _group(record: RunRecord, index: int) -> list[int]:
    """What a restart of this replica takes down with it: a weight-share leader its group."""
    if record.plan.share_weights and index == LEADER:
        return [LEADER, *followers(True, (r.index for r in record.replicas))]
    return [index]


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
    order = _restart_order(record, replicas)
    problems = [] if allow_downtime else _downtime_of(record, order)
    plan, launches = None, {}
    if engine_args is not None:  # planned whatever else is wrong: every problem at once
        try:
            new = _replanned(record, {"engine_args": tuple(engine_args)}, replan)
            plan = new.record()
            launches = {r.index: _launch(r) for r in new.replicas}
        except ChangePlanError as exc:
            problems += exc.problems
    if problems:
        raise ChangePlanError(problems)
    steps = tuple(Step("restart", i, relaunch=launches.get(i)) for i in order)
    return ChangeRequest("restart", steps, _restart_summary(record, order, engine_args),
                         _drain(record, drain_timeout), plan=plan,
                         wait_healthy=wait_bound(record, wait_healthy),
                         basis=basis_of(record))


def _restart_order(record: RunRecord, replicas: list[int] | None) -> list[int]:
    """The replicas to restart, in the order they go. The ones that do not serve first, as
    Kubernetes replaces its broken pods first: each later step waits for every other replica
    to be healthy (--wait-healthy), and a failed one that the change restarts last would fail
    the change at its first step. A weight-share leader last: its restart takes its
    followers."""
    wanted = list(dict.fromkeys(replicas)) if replicas else [r.index for r in record.replicas]
    state = {r.index: r.state for r in record.replicas}
    wanted.sort(key=lambda i: state[i] in SERVING)
    group = _group(record, LEADER)
    if LEADER in wanted and len(group) > 1:
        return [i for i in wanted if i not in group] + [LEADER]
    return wanted


def _downtime_of(record: RunRecord, order: list[int]) -> list[str]:
    """Each step of `order` that would leave nothing serving (what earlier steps restarted
    counts as serving: the change fails there if one does not pass its gates)."""
    problems = []
    for n, index in enumerate(order):
        back = frozenset(j for k in order[:n] for j in _group(record, k))
        problems += _downtime(record, index, back)
    return problems


def _restart_summary(record: RunRecord, order: list[int],
                     engine_args: tuple[str, ...] | None) -> str:
    what = (f"model update of replicas {_names(order)} to `{shlex.join(engine_args)}`"
            if engine_args is not None else f"rolling restart of replicas {_names(order)}")
    if any(len(_group(record, i)) > 1 for i in order):
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
    down = _group(record, index)
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
    kept = min(now, total)
    restarts, kept_as_is = [], []
    for r in new.replicas[:kept]:
        launch = _launch(r)
        if not _changed(record.replicas[r.index], launch):
            continue
        if total == 1 and now > 1:  # the survivor restarting would leave nothing serving
            kept_as_is.append(r.index)
            continue
        restarts.append(Step("restart", r.index, relaunch=launch))
    if total > now:
        steps = [*(Step("add", r.index, added=replica_record(r)) for r in new.replicas[now:]),
                 *restarts]
    else:
        steps = [*(Step("remove", i) for i in range(now - 1, total - 1, -1)), *restarts]
    plan = new.record()
    what = f"scale from {now} to {total} replicas" + (
        f"; replicas {_names([s.replica for s in restarts])} restart into their new CPU "
        "blocks, one at a time" if restarts else "") + (
        f"; replica {_names(kept_as_is)} keeps running as it was started (its CPU block and "
        "threads: restarting the only one left serving would drop requests)"
        if kept_as_is else "")
    return ChangeRequest("scale", tuple(steps), what, _drain(record, drain_timeout),
                         plan=plan, gpus=new.gpus,
                         wait_healthy=wait_bound(record, wait_healthy),
                         basis=basis_of(record))


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

