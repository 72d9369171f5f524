"""Proof that every GPU process of every replica is a client of the run's one MPS server.

A replica process that misses the pipe directory silently time-slices instead of sharing the
GPU, so "one attached process per replica" is not enough. PASS needs all of:
- exactly one MPS server on the run's daemon;
- every declared process of every replica whose device is CUDA is a client of it;
- every client belongs to a replica (run token + replica index in /proc/PID/environ);
- no declared process uses the GPU without being a client (NVML cross-check, when NVML works).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from omni_dp.contract import REPLICA_ENV, TOKEN_ENV
from omni_dp.files import atomic_write
from omni_dp.mps.control import MpsControl, MpsControlError
from omni_dp.procs import ProcessIdentity, is_alive, read_environ
from omni_dp.records import Record, Shape

TEXT_ARTIFACT = "mps_attach.txt"
JSON_ARTIFACT = "mps_attach.json"


@dataclass(frozen=True)
class DeclaredProcess(Record):
    JSON_SHAPE = Shape(omit_none=("create_time",))  # absent in a run.json from before it

    pid: int
    role: str
    device: str  # "cpu" or "cuda:N"
    # When the launcher found the process in the replica's session: with the pid, what makes
    # it the run's even after its session leader is gone (omni_dp/launcher/processes.py).
    create_time: float | None = None

    @property
    def uses_cuda(self) -> bool:
        return self.device.startswith("cuda")


@dataclass(frozen=True)
class ReplicaProcesses:
    index: int
    processes: tuple[DeclaredProcess, ...]


@dataclass
class ClientMatch:
    server: int
    pid: int
    replica: int | None  # None: UNMATCHED
    role: str | None
    why: str


@dataclass
class ReplicaVerdict:
    index: int
    passed: bool
    attached: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


@dataclass
class AttachReport:
    passed: bool
    servers: list[int]
    clients: list[ClientMatch]
    replicas: list[ReplicaVerdict]
    problems: list[str]  # run-wide: daemon unreachable, server count, unmatched clients
    nvml: str  # "checked" or why the cross-check could not run

    @property
    def result(self) -> str:
        return "PASS" if self.passed else "FAIL"

    def to_json(self) -> dict:
        return {"result": self.result, **asdict(self)}


# NVML's compute + MPS process lists of the run's GPU: (pids, None) or (None, why not).
GpuPids = Callable[[], tuple[set[int] | None, str | None]]


def verify_attachment(
    replicas: list[ReplicaProcesses],
    run_token: str,
    control: MpsControl,
    *,
    gpu_pids: GpuPids | None = None,
    environ: Callable[[int], dict[str, str] | None] = read_environ,
) -> AttachReport:
    try:
        servers = control.server_list()
        clients_of = {server: control.client_list(server) for server in servers}
    except MpsControlError as exc:
        return _unanswered(replicas, exc)
    problems = _server_count_problems(servers)
    declared = {p.pid: (r.index, p) for r in replicas for p in r.processes}
    matches = [_match(server, pid, run_token, declared, environ)
               for server, pids in clients_of.items() for pid in pids]
    problems += _unmatched_problems(matches)

    nvml_pids, nvml_why = gpu_pids() if gpu_pids else (None, "NVML cross-check not requested")
    # A declared process is attached only as a client proven to be this replica's (by token,
    # or by its session record): a client whose pid merely equals a recycled record is not.
    proven = {(m.replica, m.pid) for m in matches if m.replica is not None}
    attached_pids = set(clients_of[servers[0]]) if len(servers) == 1 else set()
    verdicts = [_verdict(replica, {pid for pid in attached_pids
                                   if (replica.index, pid) in proven}, nvml_pids)
                for replica in replicas]
    passed = not problems and all(v.passed for v in verdicts)
    nvml = "checked" if nvml_pids is not None else f"not checked: {nvml_why}"
    return AttachReport(passed, servers, matches, verdicts, problems, nvml)


def _unanswered(replicas: list[ReplicaProcesses], exc: MpsControlError) -> AttachReport:
    return AttachReport(False, [], [], [ReplicaVerdict(r.index, False, [],
                        ["not checked: the daemon gave no answer"]) for r in replicas],
                        [f"MPS control query failed: {exc}"], "not checked")


def _server_count_problems(servers: list[int]) -> list[str]:
    if len(servers) == 1:
        return []
    return [f"expected exactly one MPS server, found {len(servers)}"
            + ("" if servers else ": no replica process ever reached the daemon")]


def _unmatched_problems(matches: list[ClientMatch]) -> list[str]:
    unmatched = [m for m in matches if m.replica is None]
    if not unmatched:
        return []
    return [f"{len(unmatched)} MPS client(s) belong to no replica of this run: "
            + ", ".join(f"{m.pid} ({m.why})" for m in unmatched)]


def _verdict(replica: ReplicaProcesses, attached_pids: set[int],
             nvml_pids: set[int] | None) -> ReplicaVerdict:
    """One replica: every CUDA process a client of the one server, none on the GPU outside."""
    verdict = ReplicaVerdict(replica.index, True)
    for process in replica.processes:
        is_client = process.pid in attached_pids
        if is_client:
            verdict.attached.append(process.pid)
        elif process.uses_cuda:
            verdict.problems.append(
                f"{process.role} (pid {process.pid}, {process.device}) is not a client of the "
                "run's MPS server: it would time-slice the GPU"
            )
        if nvml_pids is not None and process.pid in nvml_pids and not is_client:
            verdict.problems.append(
                f"{process.role} (pid {process.pid}) uses the GPU (NVML) without being an MPS "
                "client"
            )
    if not any(p.uses_cuda for p in replica.processes):
        verdict.problems.append("declares no CUDA process: nothing to prove")
    verdict.passed = not verdict.problems
    return verdict


def _match(server, pid, run_token, declared, environ) -> ClientMatch:
    """Whose client this is: by the run token in its environment, or, for a process whose
    environment no longer shows it (engines that rename themselves overwrite it), by having
    been found in the replica's session, pid and create time recorded."""
    env = environ(pid)
    if env is None or TOKEN_ENV not in env:
        return _match_by_session(server, pid, declared, env)
    if env.get(TOKEN_ENV) != run_token:
        return ClientMatch(server, pid, None, None, "no run token of this run")
    try:
        index = int(env.get(REPLICA_ENV, ""))
    except ValueError:
        return ClientMatch(server, pid, None, None, f"{REPLICA_ENV} missing or not a number")
    if pid in declared and declared[pid][0] != index:
        return ClientMatch(server, pid, None, None,
                           f"claims replica {index} but replica {declared[pid][0]} declared it")
    role = declared[pid][1].role if pid in declared else "undeclared"
    return ClientMatch(server, pid, index, role, "run token")


def _match_by_session(server, pid, declared, env) -> ClientMatch:
    found = declared.get(pid)
    if found is not None and found[1].create_time is not None:
        identity = ProcessIdentity(pid, found[1].create_time)
        if is_alive(identity):
            return ClientMatch(server, pid, found[0], found[1].role,
                               "found in the replica's session")
        return ClientMatch(server, pid, None, None,
                           "recorded in a replica's session, but that process is gone")
    if env is None:
        return ClientMatch(server, pid, None, None, "environment unreadable (gone or not ours)")
    return ClientMatch(server, pid, None, None, "no run token of this run")


def format_text(report: AttachReport) -> str:
    lines = []
    if not report.servers:
        lines.append("no MPS server")
    for server in report.servers:
        lines.append(f"mps_server {server}")
        for match in (m for m in report.clients if m.server == server):
            if match.replica is None:
                lines.append(f"  client {match.pid} -> UNMATCHED ({match.why})")
            else:
                lines.append(f"  client {match.pid} -> replica {match.replica} ({match.role})")
    lines.append("")
    for verdict in report.replicas:
        state = "attached" if verdict.passed else "NOT PROVEN"
        pids = ", ".join(map(str, verdict.attached)) or "none"
        lines.append(f"replica {verdict.index}: {state}; clients: {pids}")
        lines += [f"  - {problem}" for problem in verdict.problems]
    lines += [f"problem: {problem}" for problem in report.problems]
    lines.append(f"nvml: {report.nvml}")
    lines.append(f"RESULT: {report.result}")
    return "\n".join(lines) + "\n"


def write_artifacts(report: AttachReport, directory: str | Path,
                    stem: str = "mps_attach") -> None:
    """STEM.txt and STEM.json (mps_attach: one daemon's proof), each replaced atomically."""
    directory = Path(directory)
    atomic_write(directory / f"{stem}.txt", format_text(report))
    atomic_write(directory / f"{stem}.json", json.dumps(report.to_json(), indent=2) + "\n")
