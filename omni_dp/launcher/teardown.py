"""Take a run down completely, touching nothing that is not the run's.

Order: supervisor (so no restart races the teardown) → (--register) the fleet gateway lets go of
the run's workers → router (stops accepting, drains) →
replica groups (each replica's leader, its session's processes and those recorded with it, also
the orphans a dead leader left: SIGTERM drains, MPS clients' GPU work is terminated, SIGKILL
after the bound; processes/groups.py; with --share-weights the followers' groups before the
weight-share leader's) → any process still carrying the run token (a replacement a
SIGKILLed supervisor never recorded) → MPS, one daemon per GPU: each daemon, once no client is
left on it, is `quit` and waited for (a daemon a foreign client still holds is left, named; the
other GPUs' daemons are stopped all the same) → remove the state directory. Whatever could not
be confirmed gone is named, with commands to inspect it, and the state directory is kept.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from omni_dp.launcher.bringup.gateway_link import GatewayLink
from omni_dp.launcher.planning.share_group import stop_waves
from omni_dp.launcher.processes.groups import (
    ReplicaGroup,
    live_processes,
    mps_terminator,
    replica_gpus,
    stop_groups,
    unproven_orphans,
)
from omni_dp.launcher.processes.ours import signal_ours, stop_processes, token_carriers, wait_gone
from omni_dp.launcher.record.events import Event
from omni_dp.launcher.record.state import RunState
from omni_dp.mps.control import MpsControlError
from omni_dp.mps.daemon import DaemonRecord, MpsDaemon, MpsDaemonError
from omni_dp.procs import ProcessIdentity, is_alive
from omni_dp.rundir import share_dir
from omni_dp.runfile import ReplicaState, RunPhase, RunRecord
from omni_dp.sharefile import segment_path

CLIENTS_GONE_WAIT_S = 30.0  # how long the daemons' clients may take to be let go of


@dataclass
class TeardownResult:
    leftovers: list[str] = field(default_factory=list)  # what could not be confirmed gone
    removed: bool = False

    @property
    def clean(self) -> bool:
        return not self.leftovers


def teardown(state: RunState, *, drain_timeout: float, keep_state: bool = False,
             say: Callable[[str], None] = lambda line: None,
             reap: list = ()) -> TeardownResult:
    result = TeardownResult()
    me = os.getpid()
    state.event(Event.TEARDOWN_STARTED, by_pid=me)
    # A failed run stays "failed" (kept for diagnosis); a stopped one had every recorded
    # process confirmed gone already.
    if state.record.state not in (RunPhase.FAILED, RunPhase.STOPPED):
        state.set_phase(RunPhase.STOPPING)
    for role in ("supervisor", "launcher"):
        reloaded = _stop_owner(state, role, drain_timeout, result, say)
        if reloaded is None:  # the owner tore everything down and removed the state
            result.removed = True
            return result
        state = reloaded
    _leave_gateway(state, result, say)
    _stop_router(state, drain_timeout, result, say, reap)
    _stop_replicas(state, drain_timeout, result, say, reap)
    _leave_gateway(state, result, say)  # again: a restart may have registered meanwhile
    _stop_token_carriers(state, result, say)
    _stop_daemons(state, result, say)

    if result.clean and not keep_state:
        state.remove()
        result.removed = True
    else:
        if result.clean:
            _drop_share_segment(state)
        state.event(Event.TEARDOWN_FINISHED, leftovers=result.leftovers)
        if state.record.state not in (RunPhase.FAILED, RunPhase.STOPPED):
            state.set_phase(RunPhase.STOPPED if result.clean else RunPhase.STOPPING)
    return result


def _drop_share_segment(state: RunState) -> None:
    """A kept state (for diagnosis) keeps the share manifest, not the weights' CPU segment:
    nothing maps it once every process is gone, and it may hold gigabytes of a tmpfs."""
    segment = segment_path(share_dir(state.directory))
    with contextlib.suppress(FileNotFoundError):
        size = segment.stat().st_size
        segment.unlink()
        state.event(Event.SHARE_SEGMENT_REMOVED, path=str(segment), bytes=size)


def _stop_owner(state: RunState, role: str, drain_timeout: float, result: TeardownResult,
                say: Callable[[str], None]) -> RunState | None:
    """The process in charge — the supervisor, or `omni-dp launch` still bringing the run up —
    goes first: it tears the run down itself on SIGTERM (router and replicas drain one after
    the other, then the daemons), with the drain bound of the stop request written just
    before. Returns the state it left (None: it removed the run), to finish what it left."""
    owner = _owner(state.record, role)
    if owner is None or owner.pid == os.getpid() or not is_alive(owner):
        return state
    say(f"stopping the {role} (pid {owner.pid}), which tears the run down with drain "
        f"≤ {drain_timeout:g} s")
    state.request_stop(drain_timeout)
    signal_ours(owner, signal.SIGTERM)
    if wait_gone([owner], owner_bound(state.record, drain_timeout)):
        signal_ours(owner, signal.SIGKILL)
        _note(result, wait_gone([owner], 5.0), role)  # never "clean" with it still running
    if not state.directory.exists():
        return None
    return RunState.load(state.directory)


def owner_bound(record: RunRecord, drain_timeout: float) -> float:
    """How long the owner may take to tear the run down before it is SIGKILLed: a drain for
    the router and one for each wave the replicas stop in (with --share-weights the followers,
    then their leader), and a minute for the rest (grace periods, the daemon)."""
    waves = stop_waves(record, [r.index for r in record.replicas])
    return (1 + max(len(waves), 1)) * drain_timeout + 60


def _leave_gateway(state: RunState, result: TeardownResult,
                   say: Callable[[str], None]) -> None:
    """--register: the fleet gateway stops sending here first; an entry it may still list is
    a leftover (named, with what removes it), never a clean teardown."""
    record = state.record.gateway
    if record is None or not record.entries:
        return
    say(f"removing {len(record.entries)} worker(s) of the run from the gateway {record.url}")
    result.leftovers += GatewayLink(state).deregister_all()


def _stop_router(state: RunState, drain_timeout: float, result: TeardownResult,
                 say: Callable[[str], None], reap: list) -> None:
    router = state.record.router.identity if state.record.router else None
    if router is None or not is_alive(router):
        return
    say(f"stopping the router (pid {router.pid}); in-flight requests drain "
        f"(≤ {drain_timeout:g} s)")
    _note(result, stop_processes([router], state.token, drain_timeout, grace_s=5.0,
                                 reap=reap), "router")


def _stop_replicas(state: RunState, drain_timeout: float, result: TeardownResult,
                   say: Callable[[str], None], reap: list) -> None:
    """Every replica with a process left — its leader, or orphans its dead leader left (an
    engine's children): whole groups, MPS clients' GPU work dropped before any SIGKILL."""
    live: dict[int, tuple[ReplicaGroup, list[ProcessIdentity]]] = {}
    groups = [ReplicaGroup.of(record) for record in state.replicas]
    for record, group in zip(state.replicas, groups, strict=True):
        processes = live_processes(group, state.token)
        if processes:
            live[record.index] = (group, processes)
    if not live:
        _note_unproven(state, groups, result)
        return
    orphaned = [i for i, (group, _) in live.items()
                if group.leader is None or not is_alive(group.leader)]
    say(f"stopping {len(live)} replica(s): {', '.join(map(str, live))} "
        f"(drain ≤ {drain_timeout:g} s)"
        + (f"; replica(s) {', '.join(map(str, orphaned))} lost their leader, stopping the "
           "processes it left" if orphaned else ""))
    state.event(Event.REPLICAS_STOPPING, replicas=[
        {"index": i, "leader": group.leader.pid if group.leader else None,
         "leader_alive": i not in orphaned, "pids": [p.pid for p in processes]}
        for i, (group, processes) in live.items()])
    survivors: list[ProcessIdentity] = []
    for wave in stop_waves(state.record, list(live)):  # weight-share followers before the leader
        survivors += stop_groups([live[i][0] for i in wave], state.token, drain_timeout,
                                 grace_s=10.0, reap=reap, before_kill=mps_terminator(
                                     state, gpus=replica_gpus(state, wave)))
    state.event(Event.REPLICAS_STOPPED, indices=list(live), survivors=[s.pid for s in survivors])
    _note(result, survivors, "replica")
    _note_unproven(state, groups, result)
    for i in live:
        state.update_replica(i, state=ReplicaState.STOPPED)


def _note_unproven(state: RunState, groups: list[ReplicaGroup],
                   result: TeardownResult) -> None:
    """What is left in a dead leader's session without a record is not ours to signal, and
    not gone either: named, so the teardown is never called clean beside it."""
    for group in groups:
        for orphan in unproven_orphans(group):
            result.leftovers.append(
                f"pid {orphan.pid} is in the session of a replica's dead leader (pid "
                f"{group.leader.pid}) but was never recorded as the run's, so it was not "
                f"signalled (inspect: ps -o pid,lstart,args -s {group.leader.pid})")
            state.event(Event.UNPROVEN_ORPHAN, pid=orphan.pid, session=group.leader.pid)


def _stop_token_carriers(state: RunState, result: TeardownResult,
                         say: Callable[[str], None]) -> None:
    """A replacement a SIGKILLed supervisor never recorded still carries the run token. The
    daemons (every GPU's) are left out: each is stopped through `quit`, never by a signal."""
    daemons = {d.identity.pid for d in state.record.daemons}
    strays = token_carriers(state.token, exclude={os.getpid()} | daemons)
    if not strays:
        return
    say(f"stopping {len(strays)} unrecorded process(es) carrying the run token: "
        + ", ".join(str(s.pid) for s in strays))
    _note(result, stop_processes(strays, state.token, 10.0), "token carrier")


def _owner(record: RunRecord, role: str) -> ProcessIdentity | None:
    """The process in charge in this role: the supervisor, or the `omni-dp launch` process."""
    if role == "supervisor":
        return record.supervisor.identity if record.supervisor else None
    return record.launcher


def _note(result: TeardownResult, survivors: list[ProcessIdentity], what: str) -> None:
    for s in survivors:
        result.leftovers.append(
            f"{what} pid {s.pid} is still running (inspect: ps -o pid,pgid,lstart,args -p "
            f"{s.pid})")


def _stop_daemons(state: RunState, result: TeardownResult,
                  say: Callable[[str], None]) -> None:
    """Every GPU's daemon, each as soon as no client is left on it (the server lets go of a
    client shortly after it exits), all waited for together within one bound: a daemon a
    foreign client still holds is left and named, and never holds the others up."""
    pending = [d for d in state.record.daemons if is_alive(d.identity)]
    deadline = time.monotonic() + CLIENTS_GONE_WAIT_S
    held: dict[int, list[int]] = {}  # GPU slot -> the clients still on its daemon
    while pending:
        for record in list(pending):
            clients = _clients(record)
            if clients:
                held[record.gpu] = clients
                continue
            pending.remove(record)
            _quit_daemon(state, record, result, say)
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    for record in pending:
        clients = held[record.gpu]
        result.leftovers.append(
            f"MPS client(s) {', '.join(map(str, clients))} are still attached to the run's "
            f"daemon{_of_gpu(state.record, record.gpu)} (pid {record.identity.pid}); they are "
            "not the run's processes, so they were left alone, and so was the daemon (inspect: "
            f"ps -o pid,args -p {','.join(map(str, clients))})")


def _clients(record: DaemonRecord) -> list[int]:
    """The pids attached to the daemon's servers; none when it cannot be asked (its stop then
    says why)."""
    try:
        return sorted(p for c in MpsDaemon(record.control()).clients().values() for p in c)
    except MpsControlError:
        return []


def _quit_daemon(state: RunState, record: DaemonRecord, result: TeardownResult,
                 say: Callable[[str], None]) -> None:
    of = _of_gpu(state.record, record.gpu)
    say(f"stopping the MPS daemon{of} (pid {record.identity.pid})")
    try:
        MpsDaemon(record.control()).stop(record)
    except MpsDaemonError as exc:
        result.leftovers.append(f"MPS daemon{of} pid {record.identity.pid}: {exc}")
    else:
        state.event(Event.MPS_DAEMON_STOPPED, gpu=record.gpu, pid=record.identity.pid)


def _of_gpu(record: RunRecord, gpu: int) -> str:
    """How messages name a daemon's GPU: ' of GPU 1 (NVIDIA H200)' in a run over several
    GPUs; '' in a one-GPU run, whose messages read as they always did."""
    title = record.gpu_title(gpu)
    return f" of {title}" if title else ""
