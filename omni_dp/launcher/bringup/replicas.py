"""Start, gate and stop one replica of a run, from its record in run.json.

Bring-up and the supervisor's restarts both go through `ReplicaControl`, so a restarted replica
gets the same argv, environment, CPU block and port, and passes the same gates. What it records
are writes (record/writes.py): applied at once during `launch`, by the supervisor's loop when a
restart's thread makes them (the thread waits for each).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import psutil

from omni_dp.files import make_private_dir
from omni_dp.gpus import nvml_gpu_memory, nvml_gpu_pids
from omni_dp.launcher.bringup.gates import kv_problems, wait_healthy
from omni_dp.launcher.engines import ENGINES
from omni_dp.launcher.engines.base import EngineAdapter, EngineUnreadable
from omni_dp.launcher.engines.readback import start_banner
from omni_dp.launcher.engines.replica_api import GateFailed, server_info
from omni_dp.launcher.planning.share_group import (
    LEADER,
    follower_problem,
    manifest_problem,
    segment_mapping_problem,
    share_record,
    stop_waves,
)
from omni_dp.launcher.processes.groups import (
    FoundProcess,
    find_replica_processes,
    process_name,
    session_processes,
    stop_replicas,
)
from omni_dp.launcher.processes.ours import child_env, spawn
from omni_dp.launcher.record.events import Event
from omni_dp.launcher.record.state import RunState, append_private
from omni_dp.launcher.record.writes import ReplicaStarted
from omni_dp.mps.attach import AttachReport, DeclaredProcess
from omni_dp.mps.runs import verify_and_record
from omni_dp.procs import ProcessIdentity, is_alive
from omni_dp.rundir import attach_stem, engine_work_dir, numeric_check_file, share_dir
from omni_dp.runfile import ReplicaState
from omni_dp.sharefile import ShareFileError, read_manifest, segment_path

# The replicas whose processes are up (their attachment is proven with the others')
RUNNING = (ReplicaState.STARTING, ReplicaState.HEALTHY, ReplicaState.UNHEALTHY,
           ReplicaState.RESTARTING)
# An external engine's own directory per replica, its working directory: TMPDIR, caches, and
# IPC sockets named relative to it (see the adapters)
WORK_SUBDIRS = ("tmp", "cache", "rpc")
# What of it belongs to one process of an engine whose caches are elsewhere
# (EngineAdapter.tmp_per_process): emptied before each start, when none of the replica runs,
# so that restarts do not pile up dead processes' files (vLLM leaves a vllm_dist_<uuid> file
# in its TMPDIR per process). cache/ stays.
PER_PROCESS_SUBDIRS = ("tmp", "rpc")


class ReplicaControl:
    """A run's replicas as processes: started, gated, measured and stopped by index."""

    def __init__(self, state: RunState) -> None:
        self.state = state
        self.popens: dict[int, subprocess.Popen] = {}  # children of this process, to reap

    def url(self, index: int) -> str:
        return self.state.replica(index).url

    @property
    def engine(self) -> EngineAdapter:
        return ENGINES[self.state.plan.engine]

    @property
    def sharing(self) -> bool:
        return self.state.plan.share_weights

    @property
    def share_dir(self) -> Path:
        return share_dir(self.state.directory)

    def start(self, index: int) -> None:
        record = self.state.replica(index)
        log = self.state.logs / record.log
        banner = start_banner(index, self.state.plan.log_format)
        with append_private(log) as f:
            f.write(banner.encode() + b"\n")
        work = None
        if self.engine.external:
            work = engine_work_dir(self.state.directory, index)
            for path in (work.parent, work, *(work / name for name in WORK_SUBDIRS)):
                make_private_dir(path)
            for name in PER_PROCESS_SUBDIRS if self.engine.tmp_per_process else ():
                empty_dir(work / name)
        if self.sharing and index == LEADER:
            # The directory it publishes in, private before it exists; what an earlier leader
            # published is no proof of this one's (its manifest is checked against this pid).
            make_private_dir(self.share_dir)
            self.state.update(share=None)
        if self.capped:  # a check an earlier start recorded proves nothing about this one
            numeric_check_file(self.state.directory, index).unlink(missing_ok=True)
        started = spawn(record.argv, child_env(record.env, self.state.token), log, cwd=work)
        self.popens[index] = started.popen
        self.state.write(ReplicaStarted(index, started.identity, started.pid))

    def wait_healthy(self, index: int, timeout_s: float) -> dict | None:
        """Healthy, and under an SM cap its numeric check passed: that check's facts."""
        record = self.state.replica(index)
        assert record.identity is not None, "start() first"
        popen = self.popens.get(index)
        seconds = wait_healthy(record.url, record.identity, self.state.logs / record.log,
                               timeout_s, exit_code=popen.poll if popen else lambda: None,
                               on_poll=lambda: self.remember_session(index))
        self.state.event(Event.REPLICA_HEALTHY, replica=index, seconds=round(seconds, 2))
        return self.numeric_check(index) if self.capped else None

    @property
    def capped(self) -> bool:
        """Under an MPS SM cap every replica passes a BF16 GEMM check before it starts."""
        return self.state.plan.mps_thread_percentage is not None

    def numeric_check(self, index: int) -> dict:
        """What the replica's numeric gate recorded before its engine started: healthy with no
        passed check on record is no proof that its cap gives right answers."""
        path = numeric_check_file(self.state.directory, index)
        try:
            facts = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise GateFailed(f"is healthy but its BF16 GEMM check under the MPS caps left no "
                             f"record ({path}: {exc}); it must not serve") from None
        if not isinstance(facts, dict) or facts.get("passed") is not True:
            raise GateFailed(f"is healthy but its BF16 GEMM check did not pass ({path}); it "
                             "must not serve")
        self.state.event(Event.REPLICA_NUMERIC_CHECK, replica=index, **{
            key: facts.get(key) for key in ("device", "relative_error", "threshold", "sm_count",
                                            "mem_get_info", "caps")})
        return facts

    def remember_session(self, index: int) -> None:
        """Record, while it starts, every process that appears in the replica's session: an
        engine's children outlive a leader killed during start-up, and are the run's only by
        this record once it is gone. Their devices are settled by record_processes."""
        record = self.state.replica(index)
        if record.identity is None:
            return
        known = {p.pid for p in record.processes}
        new = [identity for identity in session_processes(record.identity)
               if identity.pid not in known]
        if new:
            self.state.update_replica(index, processes=(*record.processes, *(
                DeclaredProcess(i.pid, process_name(i.pid) or "gone", "cpu", i.create_time)
                for i in new)))

    def read_kv(self, index: int) -> int:
        """Record the replica's KV capacity, read back the engine's way."""
        record = self.state.replica(index)
        try:
            tokens = self.engine.read_capacity(record.url, self.state.logs / record.log)
        except EngineUnreadable as exc:
            raise GateFailed(f"replica {index}: its KV capacity cannot be read back: {exc}"
                             ) from None
        self.state.update_replica(index, kv_tokens=tokens)
        return tokens

    def record_processes(self, index: int) -> tuple[DeclaredProcess, ...]:
        """Find the healthy replica's processes in its session and record them (pid + create
        time: what makes an orphan the run's once its leader is gone). The engine's own list,
        where it keeps one, is cross-checked against the session."""
        processes = tuple(self.find_processes(index))
        self.state.update_replica(index, processes=processes)
        self.state.event(Event.REPLICA_PROCESSES, replica=index,
                         processes=[{"pid": p.pid, "role": p.role, "device": p.device}
                                    for p in processes])
        return processes

    def find_processes(self, index: int) -> list[DeclaredProcess]:
        record = self.state.replica(index)
        assert record.identity is not None, "start() first"
        found = {p.identity.pid: p for p in find_replica_processes(record.identity)}
        if not found:
            raise GateFailed(f"replica {index}: no process of its session is alive")
        try:
            reported = self.engine.reported_processes(record.url)
        except EngineUnreadable as exc:
            raise GateFailed(f"replica {index}: {exc}") from None
        on_gpu = self._gpu_pids(record.gpu) if self.state.plan.device == "cuda" else set()
        declared = []
        for process in reported or ():
            session = found.pop(process.pid, None)
            if session is None:
                raise GateFailed(
                    f"replica {index} reports process {process.pid} ({process.role}), which is "
                    "not in its session: a replica's processes are the ones it started")
            # Its own word on its device, unless the CPU side shows a CUDA context it did not
            # declare (such a process must then be proven an MPS client too).
            device = process.device
            if not process.uses_cuda and self._on_cuda(session, on_gpu):
                device = "cuda:0"
            declared.append(DeclaredProcess(process.pid, process.role, device,
                                            session.identity.create_time))
        declared += [self._declared(p, on_gpu) for p in found.values()]
        return declared

    def _declared(self, process: FoundProcess, on_gpu: set[int]) -> DeclaredProcess:
        """A process the engine did not list: on CUDA if NVML or its mappings say so."""
        return DeclaredProcess(process.identity.pid, process.name,
                               "cuda:0" if self._on_cuda(process, on_gpu) else "cpu",
                               process.identity.create_time)

    def _on_cuda(self, process: FoundProcess, on_gpu: set[int]) -> bool:
        """A CUDA run's process holds a context: NVML lists it, or its mappings show one."""
        return self.state.plan.device == "cuda" and (
            process.identity.pid in on_gpu or process.cuda_evidence is not None)

    def _gpu_pids(self, slot: int) -> set[int]:
        """The PIDs NVML lists on the replica's own GPU."""
        pids, _ = nvml_gpu_pids(self.state.record.gpu_record(slot).label)
        return pids or set()

    def check_kv(self, indices: list[int]) -> None:
        """Each replica's read-back capacity against the plan's, or, where the engine derives
        the count itself, against every other replica's (a restarted one against those that
        kept serving)."""
        expected = self.state.plan.expected_kv_tokens
        tokens = {i: self.read_kv(i) for i in indices}
        if expected is None:
            # The reference is what the serving replicas hold; a failed or stopped one holds
            # nothing and is no reference.
            serving = [r.kv_tokens for r in self.state.replicas if r.index not in tokens
                       and r.state == ReplicaState.HEALTHY and r.kv_tokens is not None]
            if serving:
                expected = Counter(serving).most_common(1)[0][0]
        problems = kv_problems(tokens, expected)
        self.state.event(Event.KV_CHECKED, tokens={str(i): t for i, t in tokens.items()},
                         expected=expected, ok=not problems)
        if problems:
            raise GateFailed(problems[0])

    def share_gate(self, index: int) -> None:
        """--share-weights: the leader's manifest, published by the leader now running, is
        recorded as the run's share; a follower must be attached to that leader through the
        run's share directory. GateFailed naming the replica otherwise."""
        if not self.sharing:
            return
        if index == LEADER:
            self._check_published()
        else:
            self._check_attached(index)

    def _check_published(self) -> None:
        leader = self.state.replica(LEADER)
        what = f"replica {LEADER} (the weight-share leader)"
        try:
            manifest = read_manifest(self.share_dir)
        except ShareFileError as exc:
            raise GateFailed(f"{what}: {exc}") from None
        problem = manifest_problem(manifest, leader.identity, self.state.run_id,
                                   self.state.record.gpu)
        if problem:
            raise GateFailed(f"{what}: {problem}")
        self._check_mapped(LEADER, what)
        # No follower is proven attached to this leader yet: each is added by its own gate.
        record = share_record(manifest, self.share_dir)
        self.state.update(share=record)
        self.state.event(Event.SHARE_PUBLISHED, replica=LEADER, pid=manifest.leader.pid,
                         bytes=record.shared_bytes, private_bytes=record.private_bytes,
                         tensors=record.tensors, policy=record.policy)

    def _check_attached(self, index: int) -> None:
        record = self.state.replica(index)
        leader = self.state.replica(LEADER).identity
        what = f"replica {index} (a weight-share follower)"
        try:
            info = server_info(record.url)
        except GateFailed as exc:
            raise GateFailed(f"{what}: {exc}") from None
        problem = follower_problem(info.get("weight_share"), leader, self.share_dir)
        if problem:
            raise GateFailed(f"{what}: {problem}")
        assert leader is not None
        self._check_mapped(index, what)
        if not self.state.add_follower(index, leader.pid):
            raise GateFailed(f"{what}: the run records no share published by the leader it is "
                             f"attached to (pid {leader.pid})")
        self.state.event(Event.SHARE_ATTACHED, replica=index, leader_pid=leader.pid)

    def _check_mapped(self, index: int, what: str) -> None:
        """On the CPU, see for ourselves that the replica's process maps the run's segment
        read-only (CUDA IPC memory shows in no CPU mapping: there the replica's word stands)."""
        if self.state.plan.device != "cpu":
            return
        pid = self.state.replica(index).pid
        problem = (segment_mapped_problem(pid, segment_path(self.share_dir)) if pid is not None
                   else "it has no recorded process")
        if problem:
            raise GateFailed(f"{what}: {problem}")

    def measure_memory(self, indices: list[int]) -> None:
        """Record each replica's private memory as measured now (never guessed)."""
        record = self.state.record
        on_gpu: dict[int, dict[int, int] | None] = {}  # GPU slot -> NVML's pid -> bytes
        if self.state.plan.device == "cuda":
            for slot in sorted({record.replicas[i].gpu for i in indices}):
                on_gpu[slot], _ = nvml_gpu_memory(record.gpu_record(slot).label)
        measured = {}
        for i in indices:
            replica = self.state.replica(i)
            value = replica_memory(replica.processes, self.state.plan.device,
                                   on_gpu.get(replica.gpu))
            self.state.update_replica(i, memory_bytes=value)
            measured[str(i)] = value
        self.state.event(Event.MEMORY_MEASURED, device=self.state.plan.device, bytes=measured)

    def verify_attachment(self, slot: int) -> AttachReport:
        """Every CUDA process of every started replica on GPU slot `slot` must be a client of
        that GPU's one server (its proof: attach_stem's files in the run directory)."""
        record = self.state.record
        daemon = record.daemon(slot)
        assert daemon is not None, f"GPU slot {slot} has no MPS daemon to verify against"
        started = [r for r in record.replicas_on(slot) if r.processes and r.state in RUNNING]
        # a process of another GPU's replica among this daemon's clients fails this GPU too
        elsewhere = {r.index: record.gpu_record(r.gpu).title for r in record.replicas
                     if r.gpu != slot}
        report = verify_and_record(daemon, [r.declared() for r in started], self.state.token,
                                   record.gpu_record(slot).label, self.state.directory,
                                   stem=attach_stem(record.gpu_key(slot)), elsewhere=elsewhere)
        verdicts = {v.index: v for v in report.replicas}
        for r in started:
            verdict = verdicts.get(r.index)
            self.state.update_replica(r.index, mps_attached=bool(
                report.passed and verdict is not None and verdict.passed))
        self.state.event(Event.MPS_VERIFIED, gpu=slot, result=report.result,
                         problems=report.problems)
        return report

    def stop(self, indices: list[int], timeout_s: float) -> None:
        """Stop these replicas' processes: each session (drain on SIGTERM), MPS clients let go
        through the daemon, then SIGKILL; orphans of a dead leader found by their record.
        A process that survives even SIGKILL is still recorded (teardown still owes it a stop),
        and GateFailed says so: nothing is started beside it."""
        reap = [self.popens[i] for i in indices if i in self.popens]
        survivors: set[int] = set()
        for wave in stop_waves(self.state.record, indices):  # followers before their leader
            survivors |= {s.pid for s in stop_replicas(self.state, wave, timeout_s, reap=reap)}
        left = []
        for i in indices:
            record = self.state.replica(i)
            if record.identity is not None and record.identity.pid in survivors:
                left.append(f"replica {i}: pid {record.identity.pid}")
            left += [f"replica {i}: pid {p.pid} ({p.role})" for p in record.processes
                     if p.pid in survivors and p.pid != record.pid]
            # Its record stays as it was (processes, last KV and attachment verdicts): what
            # survived is still found by it, and the others are dead by pid + create time.
            self.state.update_replica(i, state=ReplicaState.STOPPED)
        if left:
            self.state.event(Event.REPLICA_STOP_INCOMPLETE, survivors=left)
            raise GateFailed("still running after SIGKILL: " + ", ".join(left)
                             + " (inspect: ps -o pid,stat,wchan,args -p PID)")


def replica_memory(processes: tuple[DeclaredProcess, ...], device: str,
                   on_gpu: dict[int, int] | None) -> int | None:
    """A replica's private memory: on CPU the USS (pages no other process maps) summed over its
    recorded processes; on CUDA the GPU memory NVML says they use. None when it cannot be read
    (a process gone or not ours, NVML without per-process figures) — also when NVML has a
    figure for some of its CUDA processes only (MPS may withhold one client's): a part of the
    replica is not its memory."""
    live = [p for p in processes if p.create_time is not None
            and is_alive(ProcessIdentity(p.pid, p.create_time))]
    if not live:
        return None
    if device == "cuda":
        if on_gpu is None or any(p.uses_cuda and p.pid not in on_gpu for p in live):
            return None
        figures = [on_gpu[p.pid] for p in live if p.pid in on_gpu]
        return sum(figures) if figures else None
    total = 0
    for p in live:
        try:
            total += psutil.Process(p.pid).memory_full_info().uss
        except (psutil.Error, AttributeError):  # gone meanwhile, or no USS on this system
            return None
    return total


def segment_mapped_problem(pid: int, segment: Path) -> str | None:
    """Why process pid does not map the segment read-only and shared (share_group's check on
    its /proc/PID/maps); None when it does."""
    try:
        info = os.stat(segment)
        # surrogateescape: a mapped file's path need not be UTF-8
        maps = Path(f"/proc/{pid}/maps").read_bytes().decode("utf-8", "surrogateescape")
    except OSError as exc:
        return f"its mappings cannot be checked: {exc}"
    return segment_mapping_problem(maps, (os.major(info.st_dev), os.minor(info.st_dev)),
                                   info.st_ino, segment)


def empty_dir(path: Path) -> None:
    """Remove what is in `path` (links themselves, never what they point to); keep `path`."""
    for entry in path.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
