"""A replica is a group of processes, not one pid: finding them, stopping them all.

External engines run several processes per replica (vLLM: the API server, which omni-dp spawned
as a session leader, plus a resource tracker, `VLLM::EngineCore` and its `VLLM::Worker`). The
children rename themselves and drop the run token from what /proc shows, and a SIGKILLed leader
leaves them running. So a replica's processes are, and only ever are:

- its leader, while alive by pid + create time;
- every process in the leader's session (sid == leader pid) while the leader is alive: a live
  session leader holds its pid, so no other session can have that id;
- the members recorded in run.json (found in the session when the replica came up), while
  alive by pid + create time — this is what reaches orphans once the leader is gone;
- any process in the leader's session that carries the run token.

Everything else is never signalled, and every signal re-checks ownership when it is sent.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import psutil

from omni_dp.launcher.processes.ours import carries_token, signal_ours
from omni_dp.launcher.record.events import Event
from omni_dp.launcher.record.state import RunState
from omni_dp.mps.control import MpsControl, MpsControlError
from omni_dp.procs import ProcessIdentity, identify, is_alive
from omni_dp.runfile import ReplicaRecord

POLL_S = 0.1
KILL_WAIT_S = 5.0
MPS_EXIT_WAIT_S = 5.0
MAPS_READ_LIMIT = 16 * 1024 * 1024  # a big engine maps tens of thousands of regions
FD_SCAN_LIMIT = 4096
# What a CUDA context leaves on the CPU side. /dev/nvidiactl alone is not enough: every NVML
# user (a monitoring agent, nvidia-smi) opens it; cuInit opens /dev/nvidia-uvm and a context
# opens /dev/nvidiaN.
CUDA_LIBRARY = "libcuda.so"
CUDA_DEVICE_PREFIX = "/dev/nvidia"
CUDA_DEVICE_EXTRA = ("/dev/nvidia-uvm",)

BeforeKill = Callable[[list[ProcessIdentity]], None]


@dataclass(frozen=True)
class ReplicaGroup:
    """One replica's processes as recorded: its leader and the members found in its session."""

    leader: ProcessIdentity | None
    members: tuple[ProcessIdentity, ...] = ()

    @classmethod
    def of(cls, record: ReplicaRecord) -> ReplicaGroup:
        """Members need a create time: a bare pid (an engine's own declaration) proves nothing."""
        leader = record.identity
        members = tuple(ProcessIdentity(p.pid, p.create_time) for p in record.processes
                        if p.create_time is not None and (leader is None or p.pid != leader.pid))
        return cls(leader, members)


@dataclass(frozen=True)
class FoundProcess:
    """A process of a replica's session, as the launcher records it once the replica is up."""

    identity: ProcessIdentity
    name: str  # psutil's name(): after setproctitle e.g. "VLLM::EngineCore"
    cuda_evidence: str | None  # why it seems to hold a CUDA context; None: no sign of one


# --- finding ----------------------------------------------------------------------------------


def _sessions(sids: set[int]) -> dict[int, list[ProcessIdentity]]:
    """Every live, non-zombie process whose session id is one of sids: one scan of the process
    table for all of them; a process that vanishes meanwhile is skipped."""
    table: dict[int, list[ProcessIdentity]] = {sid: [] for sid in sids}
    if not table:
        return table
    for process in psutil.process_iter(["pid", "status"]):
        info = process.info
        if info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            sid = os.getsid(info["pid"])
        except OSError:  # gone meanwhile
            continue
        identity = identify(info["pid"]) if sid in table else None
        if identity is not None:
            table[sid].append(identity)
    return table


def session_processes(leader: ProcessIdentity) -> list[ProcessIdentity]:
    """The leader's session (the leader included), only while the leader is alive: checked
    before and after the scan, so the session id was the leader's own the whole time."""
    if not is_alive(leader):
        return []
    found = _sessions({leader.pid})[leader.pid]
    return found if is_alive(leader) else []


def live_processes(group: ReplicaGroup, token: str | None) -> list[ProcessIdentity]:
    """What of the group is alive and provably the run's (see the module's rule)."""
    return _live_of([group], token)[0]


def _live_of(groups: list[ReplicaGroup], token: str | None) -> list[list[ProcessIdentity]]:
    """live_processes of each group, from one scan of the process table."""
    leaders = [g.leader for g in groups if g.leader is not None]
    before = {leader.pid for leader in leaders if is_alive(leader)}
    table = _sessions({leader.pid for leader in leaders
                       if leader.pid in before or token is not None})
    after = {leader.pid for leader in leaders if leader.pid in before and is_alive(leader)}
    return [_live_in(group, token, table, after) for group in groups]


def _live_in(group: ReplicaGroup, token: str | None, table: dict[int, list[ProcessIdentity]],
             leaders_alive: set[int]) -> list[ProcessIdentity]:
    found: dict[int, ProcessIdentity] = {}
    leader = group.leader
    if leader is not None:
        session = table.get(leader.pid, [])
        if leader.pid not in leaders_alive:  # its session's id alone proves nothing now
            session = [p for p in session if token is not None and carries_token(p.pid, token)]
        found.update((p.pid, p) for p in session)
    for member in group.members:
        if member.pid not in found and is_alive(member):
            found[member.pid] = member
    return list(found.values())


def unproven_orphans(group: ReplicaGroup) -> list[ProcessIdentity]:
    """Processes left in a dead leader's session that no record names: never signalled (the
    session id alone does not make them the run's), but not to be called gone either — while
    any of them lives the kernel keeps that id, so nothing else has taken it; one created
    after the leader is most likely its engine's child, started after the last record."""
    leader = group.leader
    if leader is None or is_alive(leader) or psutil.pid_exists(leader.pid):
        return []  # alive, or its pid another process's now: its session is not in doubt
    recorded = {m.pid for m in group.members}
    return [p for p in _sessions({leader.pid})[leader.pid]
            if p.pid not in recorded and p.create_time >= leader.create_time]


def find_replica_processes(leader: ProcessIdentity) -> list[FoundProcess]:
    """The leader's session with names and CUDA evidence; [] when the leader is gone."""
    found = []
    for identity in session_processes(leader):
        name = process_name(identity.pid)
        if name is not None:
            found.append(FoundProcess(identity, name, cuda_evidence(identity.pid)))
    return found


def process_name(pid: int) -> str | None:
    """psutil's name() (after setproctitle e.g. VLLM::EngineCore); None once it is gone."""
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return None


def cuda_evidence(pid: int) -> str | None:
    """A device fd (cheap) or a libcuda mapping; None when neither shows or /proc is closed."""
    return _device_fd(pid) or _cuda_mapping(pid)


def is_cuda_device(path: str) -> bool:
    """/dev/nvidia-uvm or /dev/nvidiaN: what CUDA opens and NVML alone does not."""
    if path in CUDA_DEVICE_EXTRA:
        return True
    rest = path.removeprefix(CUDA_DEVICE_PREFIX)
    return rest != path and rest.isdigit()


def _device_fd(pid: int) -> str | None:
    directory = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(directory)[:FD_SCAN_LIMIT]
    except OSError:
        return None
    for fd in fds:
        try:
            target = os.readlink(f"{directory}/{fd}")
        except OSError:
            continue
        if is_cuda_device(target):
            return f"fd {fd} -> {target}"
    return None


def _cuda_mapping(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/maps", "rb") as maps:
            return mapping_evidence(maps, MAPS_READ_LIMIT)
    except OSError:
        return None


def mapping_evidence(maps: Iterable[bytes], limit: int) -> str | None:
    """The first mapped libcuda in /proc/PID/maps lines, reading at most `limit` bytes."""
    seen = 0
    for line in maps:
        seen += len(line)
        if seen > limit:
            return None
        path = line.split(maxsplit=5)[5:]
        if path and CUDA_LIBRARY in os.path.basename(path[0].decode(errors="replace")):
            return f"maps {path[0].decode(errors='replace').strip()}"
    return None


# --- stopping ---------------------------------------------------------------------------------


def _widened(group: ReplicaGroup, live: list[ProcessIdentity]) -> ReplicaGroup:
    """The group with what was seen live added to its members: a process found in the live
    leader's session stays the run's by pid + create time after the leader exits."""
    known = {m.pid: m for m in group.members}
    for identity in live:
        if identity != group.leader:
            known.setdefault(identity.pid, identity)
    return ReplicaGroup(group.leader, tuple(known.values()))


def _survey(groups: list[ReplicaGroup], token: str | None,
            reap: Iterable[subprocess.Popen]) -> tuple[list[ReplicaGroup], list[ProcessIdentity]]:
    for popen in reap:  # our own children would otherwise linger as zombies
        with contextlib.suppress(Exception):
            popen.poll()
    widened, alive = [], []
    for group, live in zip(groups, _live_of(groups, token), strict=True):
        widened.append(_widened(group, live))
        alive += live
    return widened, alive


def _wait(groups: list[ReplicaGroup], token: str | None, timeout_s: float,
          reap: Iterable[subprocess.Popen]) -> tuple[list[ReplicaGroup], list[ProcessIdentity]]:
    """Until no process of any group is left (recomputed at every poll), bounded."""
    deadline = time.monotonic() + timeout_s
    while True:
        groups, alive = _survey(groups, token, reap)
        if not alive or time.monotonic() >= deadline:
            return groups, alive
        time.sleep(POLL_S)


def _signal_group(group: ReplicaGroup, live: list[ProcessIdentity], sig: int,
                  token: str | None) -> None:
    """The leader's process group while the leader is ours; every other live process on its
    own — once: a second SIGTERM means "stop now" to an engine (omni-dp serve)."""
    leader = group.leader
    in_group: set[int] = set()
    # A stopped process (SIGSTOP, a debugger) keeps a SIGTERM pending and cannot drain: it is
    # continued too, so the stop drains it instead of waiting for the SIGKILL.
    signals = (sig, signal.SIGCONT) if sig == signal.SIGTERM else (sig,)
    if leader is not None and is_alive(leader):
        in_group = {p.pid for p in live if _pgid(p.pid) == leader.pid}
        if not all(signal_ours(leader, s, token, group=True) for s in signals):
            in_group = set()
    for identity in live:
        if identity.pid not in in_group and identity != leader:
            for s in signals:
                signal_ours(identity, s, token)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _signal_all(groups: list[ReplicaGroup], sig: int, token: str | None) -> None:
    for group, live in zip(groups, _live_of(groups, token), strict=True):
        _signal_group(group, live, sig, token)


def stop_groups(groups: list[ReplicaGroup], token: str | None, drain_s: float, *,
                grace_s: float = 5.0, reap: Iterable[subprocess.Popen] = (),
                before_kill: BeforeKill | None = None) -> list[ProcessIdentity]:
    """SIGTERM (drain ≤ drain_s), a second SIGTERM (≤ grace_s), then before_kill(survivors)
    (MPS: drop their GPU work first), then SIGKILL of what is still ours (≤ 5 s). Returns the
    survivors: none, unless the kernel would not let them go. Should before_kill raise, the
    SIGKILL is still sent, then its error propagates."""
    reap = list(reap)
    groups, _ = _survey(groups, token, reap)
    _signal_all(groups, signal.SIGTERM, token)
    groups, alive = _wait(groups, token, drain_s, reap)
    if not alive:
        return []
    _signal_all(groups, signal.SIGTERM, token)
    groups, alive = _wait(groups, token, grace_s, reap)
    if not alive:
        return []
    try:
        if before_kill is not None:
            before_kill(alive)
    finally:
        groups, _ = _survey(groups, token, reap)
        _signal_all(groups, signal.SIGKILL, token)
    return _wait(groups, token, KILL_WAIT_S, reap)[1]


def stop_replicas(state: RunState, indices: list[int], drain_s: float, *, grace_s: float = 10.0,
                  reap: Iterable[subprocess.Popen] = ()) -> list[ProcessIdentity]:
    """Stop these replicas' whole groups, MPS clients' GPU work dropped (through their own
    GPUs' daemons) before any SIGKILL."""
    groups = [ReplicaGroup.of(state.replica(i)) for i in indices]
    return stop_groups(groups, state.token, drain_s, grace_s=grace_s, reap=reap,
                       before_kill=mps_terminator(state, gpus=replica_gpus(state, indices)))


def replica_gpus(state: RunState, indices: Iterable[int]) -> set[int]:
    """The GPU slots these replicas run on: the daemons whose clients they are."""
    return {state.replica(i).gpu for i in indices}


# --- MPS: drop a client's GPU work before it is killed ------------------------------------------


def mps_terminator(state: RunState, wait_s: float = MPS_EXIT_WAIT_S, *,
                   gpus: Iterable[int] | None = None) -> BeforeKill:
    """For stop_groups' before_kill: a SIGKILLed MPS client with work in flight can wedge the
    shared server for every replica of its GPU, so the server terminates the client's work
    first. Each GPU has its own daemon: each survivor is terminated through the daemon whose
    server lists it, its own GPU's; `gpus` (the GPU slots of the replicas being stopped; None:
    every GPU) keeps the other GPUs' daemons out of it — one of them may be the faulty one. A
    no-op without a daemon; control errors go into the event, never raised."""
    wanted = None if gpus is None else set(gpus)
    daemons = [d for d in state.record.daemons if wanted is None or d.gpu in wanted]
    if not daemons:
        return lambda survivors: None

    def terminate(survivors: list[ProcessIdentity]) -> None:
        for daemon in daemons:
            alive = [s for s in survivors if is_alive(s)]
            if alive and is_alive(daemon.identity):
                _terminate_clients(state, daemon.gpu, daemon.control(), alive, wait_s)

    return terminate


def _terminate_clients(state: RunState, gpu: int, control: MpsControl,
                       survivors: list[ProcessIdentity], wait_s: float) -> None:
    try:
        servers = control.server_list()
    except MpsControlError as exc:
        state.event(Event.MPS_CLIENTS_TERMINATED, gpu=gpu, server=None, pids=[], clients=[],
                    error=str(exc))
        return
    for server in servers:
        try:
            clients = set(control.client_list(server))
        except MpsControlError as exc:
            state.event(Event.MPS_CLIENTS_TERMINATED, gpu=gpu, server=server, pids=[], clients=[],
                        error=str(exc))
            continue
        targets = [s for s in survivors if s.pid in clients]
        if targets:
            _terminate_on(state, gpu, control, server, targets, wait_s)


def _terminate_on(state: RunState, gpu: int, control: MpsControl, server: int,
                  targets: list[ProcessIdentity], wait_s: float) -> None:
    errors: dict[int, str] = {}
    for target in targets:
        if not is_alive(target):  # exited meanwhile: its pid may be someone else's by now
            continue
        try:
            control.terminate_client(server, target.pid)
        except MpsControlError as exc:
            errors[target.pid] = str(exc)
    deadline = time.monotonic() + wait_s
    while any(is_alive(t) for t in targets) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    state.event(Event.MPS_CLIENTS_TERMINATED, gpu=gpu, server=server,
                pids=[t.pid for t in targets],
                clients=[{"pid": t.pid, "went": not is_alive(t), "error": errors.get(t.pid)}
                         for t in targets], error=None)
