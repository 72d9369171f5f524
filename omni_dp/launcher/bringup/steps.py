"""Bring a planned run up, step by step, recording every step in run.json and events.jsonl.

state dir → (--mps) one private daemon per GPU → replicas pinned to their blocks
(--share-weights: the leader first, its manifest checked, then its followers, their attachment
checked) → health → equal KV → (--mps) attachment of every CUDA process, GPU by GPU, to its
GPU's daemon → router → (--register) every replica, or the router, listed healthy by the fleet
gateway → ready. Raises BringUpFailed on
the first failure; the caller tears down what was started and keeps the state for diagnosis.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from omni_dp.blocking_http import http_json
from omni_dp.contract import API_KEY_ENV, RUN_ID_ENV
from omni_dp.gateway import GatewayError
from omni_dp.launcher.bringup.gates import describe_exit, log_tail
from omni_dp.launcher.bringup.gateway_link import GatewayLink
from omni_dp.launcher.bringup.replicas import ReplicaControl
from omni_dp.launcher.engines.replica_api import GateFailed
from omni_dp.launcher.planning.plan import LaunchPlan
from omni_dp.launcher.planning.share_group import LEADER, followers, start_waves
from omni_dp.launcher.processes.ours import Started, child_env, spawn, stop_processes
from omni_dp.launcher.record.events import Event
from omni_dp.launcher.record.state import RunState
from omni_dp.mps.attach import format_text
from omni_dp.mps.control import MpsControl, MpsControlError
from omni_dp.mps.daemon import DaemonLimits, DaemonRecord, MpsDaemon, MpsDaemonError
from omni_dp.procs import is_alive
from omni_dp.rundir import attach_stem, mps_log_dir, mps_pipe_dir
from omni_dp.runfile import ReplicaState, RouterRecord, RunPhase
from omni_dp.sizes import format_size

ROUTER_READY_TIMEOUT_S = 30.0


class BringUpFailed(Exception):
    """A step failed after something was created; the message says which and why."""


class StartProgress(Protocol):
    """Told what each replica bring-up waits on is doing, so a long wait is never silent
    (views/progress.py's StartBoard shows it)."""

    def begin(self, index: int, log: Path, phase: str) -> None: ...

    def phase(self, index: int, phase: str) -> None: ...

    def end(self, index: int) -> None: ...


class NoProgress:
    def begin(self, index: int, log: Path, phase: str) -> None:
        pass

    def phase(self, index: int, phase: str) -> None:
        pass

    def end(self, index: int) -> None:
        pass


def start_daemon(state: RunState, slot: int, binary: str,
                 server_binary: str | None = None) -> DaemonRecord:
    """The private daemon of GPU slot `slot`: its own pipe and log directories, the GPU's
    UUID in its CUDA_VISIBLE_DEVICES (none on the CPU, --no-gpu-check)."""
    record = state.record
    gpu, key = record.gpu_record(slot), record.gpu_key(slot)
    control = MpsControl(binary, str(mps_pipe_dir(state.directory, key)),
                         str(mps_log_dir(state.directory, key)), server_binary=server_binary)
    uuid = gpu.label if record.device == "cuda" else None
    try:
        daemon = MpsDaemon(control).start(
            gpu_uuid=uuid, gpu=slot, thread_percentage=record.plan.mps_thread_percentage,
            memory_limit_bytes=record.plan.mps_memory_limit)
    except (MpsDaemonError, MpsControlError) as exc:
        raise BringUpFailed(f"the MPS daemon for {gpu.title} did not start: {exc}") from None
    state.set_daemon(daemon)
    state.event(Event.MPS_DAEMON_STARTED, gpu=slot, pid=daemon.identity.pid,
                pipe_dir=daemon.pipe_dir, binary=daemon.binary,
                server_binary=daemon.server_binary, limits=daemon.limits.to_json())
    return daemon


def limits_words(limits: DaemonLimits) -> str:
    """`40% of the SMs, 2GiB pinned` — the caps a daemon read back."""
    words = []
    if limits.thread_percentage is not None:
        words.append(f"{limits.thread_percentage:g}% of the SMs")
    if limits.memory_limit_bytes is not None:
        words.append(f"{format_size(limits.memory_limit_bytes)} of pinned memory")
    return " and ".join(words)


def start_router(state: RunState) -> Started:
    router = state.plan.router
    log = state.logs / "router.log"
    extra = {RUN_ID_ENV: state.run_id}
    if state.api_key is not None:  # by environment: argv is readable by every user
        extra[API_KEY_ENV] = state.api_key
    started = spawn(router.argv, child_env(extra, state.token), log)
    state.update(router=RouterRecord(started.identity, pgid=started.pid, url=router.url,
                                     argv=router.argv, log=log.name))
    deadline = time.monotonic() + ROUTER_READY_TIMEOUT_S
    while True:
        code = started.popen.poll()
        if code is not None or not is_alive(started.identity):
            raise BringUpFailed(f"the router {describe_exit(code)} before it was ready; last "
                                f"lines of {log}:\n{log_tail(log)}")
        status, _ = http_json("GET", router.url + "/ready", timeout=2.0)
        if status == 200:
            state.event(Event.ROUTER_READY, pid=started.pid, url=router.url)
            return started
        if time.monotonic() > deadline:
            # Stopped, not left running: recorded as alive, it would never be restarted.
            stop_processes([started.identity], state.token, 5.0, reap=[started.popen])
            raise BringUpFailed(f"the router was not ready within {ROUTER_READY_TIMEOUT_S:.0f} s"
                                f" (last /ready: {status or 'no answer'}); it was stopped; last "
                                f"lines of {log}:\n{log_tail(log)}")
        time.sleep(0.1)


def start_replicas(state: RunState, replicas: ReplicaControl, indices: list[int], *,
                   sequential: bool, timeout_s: float, say: Callable[[str], None],
                   progress: StartProgress | None = None) -> None:
    """Start these replicas wave by wave (share_group.start_waves: a weight-sharing leader
    before its followers) and pass each wave through health, KV and the share checks before
    the next starts (not attachment); then measure what each holds."""
    progress = progress or NoProgress()
    for wave in start_waves(state.record, indices):
        try:
            _start_wave(state, replicas, wave, sequential=sequential, timeout_s=timeout_s,
                        say=say, progress=progress)
        finally:
            for i in wave:
                progress.end(i)
    replicas.measure_memory(sorted(indices))


def _start_wave(state: RunState, replicas: ReplicaControl, wave: list[int], *, sequential: bool,
                timeout_s: float, say: Callable[[str], None], progress: StartProgress) -> None:
    def start(i: int) -> None:
        replicas.start(i)
        progress.begin(i, state.logs / state.replica(i).log, "starting, waiting for /health")

    def healthy(i: int) -> None:
        try:
            check = replicas.wait_healthy(i, timeout_s)
            replicas.record_processes(i)
        except GateFailed as exc:
            state.update_replica(i, state=ReplicaState.FAILED,
                                 last_error=str(exc).splitlines()[0])
            raise BringUpFailed(f"replica {i} {exc}") from None
        progress.phase(i, "healthy, waiting for the KV read-back")
        say(f"replica {i} healthy on {replicas.url(i)}" + (
            f"; its BF16 GEMM check passed under its MPS caps (relative error "
            f"{check['relative_error']:.4f})" if check else ""))

    if sequential or len(wave) == 1:
        for i in wave:
            start(i)
            healthy(i)
    else:
        for i in wave:
            start(i)
        say(f"started {len(wave)} replica(s) in parallel; waiting for /health")
        for i in wave:
            healthy(i)
    try:
        replicas.check_kv(wave)
        for i in wave:
            if replicas.sharing:
                progress.phase(i, "checking its weight sharing")
            replicas.share_gate(i)
    except GateFailed as exc:
        raise BringUpFailed(str(exc)) from None
    share = state.record.share
    if replicas.sharing and LEADER in wave and share is not None:
        say(f"replica {LEADER} published {format_size(share.shared_bytes)} of weights "
            f"({share.tensors} tensors, policy {share.policy}) in {share.directory}")
    # from the proof each share gate recorded, not from the plan
    attached = [i for i in followers(replicas.sharing, wave) if share and i in share.followers]
    if attached:
        say(f"replica(s) {', '.join(map(str, attached))} attached to the leader's weights "
            f"(replica {LEADER}, pid {state.replica(LEADER).pid})")
    for i in wave:
        state.update_replica(i, state=ReplicaState.HEALTHY)


def verify_attachment(state: RunState, replicas: ReplicaControl,
                      say: Callable[[str], None] = lambda line: None,
                      progress: StartProgress | None = None) -> None:
    """Every GPU's replicas against that GPU's daemon; the first GPU that fails stops it."""
    record = state.record
    progress = progress or NoProgress()
    for daemon in record.daemons:
        on_gpu = [r.index for r in record.replicas_on(daemon.gpu)]
        for i in on_gpu:
            progress.begin(i, state.logs / state.replica(i).log, "checking its MPS attachment")
        try:
            report = replicas.verify_attachment(daemon.gpu)
        finally:
            for i in on_gpu:
                progress.end(i)
        stem = attach_stem(record.gpu_key(daemon.gpu))
        title = record.gpu_record(daemon.gpu).title
        if not report.passed:
            raise BringUpFailed(f"MPS attachment verification FAILED on {title} ({stem}.txt):"
                                f"\n{format_text(report)}")
        if len(record.daemons) > 1:
            say(f"MPS on {title}: every CUDA process of its {len(report.replicas)} replica(s) "
                f"is a client of its one server ({stem}.txt)")


@dataclass(frozen=True)
class RunUp:
    """What bring_up leaves: the router process (a child of this process, to reap) and the
    gates it passed, in order, each named when it passed (the ready line says them)."""

    router: Started
    checks: tuple[str, ...]


def bring_up(plan: LaunchPlan, state: RunState, replicas: ReplicaControl,
             say: Callable[[str], None], progress: StartProgress | None = None) -> RunUp:
    o = plan.options
    if o.mps:
        found = plan.mps_binaries
        for gpu in plan.gpus:
            say(f"starting the private MPS control daemon for {gpu.title}"
                + (f": {found.describe()}" if found else ""))
            daemon = start_daemon(state, gpu.slot, plan.mps_binary or "nvidia-cuda-mps-control",
                                  found.server if found else None)
            if daemon.limits.any:
                say(f"MPS caps in force for each client on {gpu.title}: "
                    f"{limits_words(daemon.limits)} (set, and read back from the daemon)")
    say(f"starting {len(plan.replicas)} replica(s), {plan.start}"
        + (f" (--share-weights: replica {LEADER} leads, the others follow once it published)"
           if o.share_weights else ""))
    start_replicas(state, replicas, [r.index for r in plan.replicas],
                   sequential=plan.start == "sequential", timeout_s=plan.start_timeout, say=say,
                   progress=progress)
    checks = ["health"]  # start_replicas passed every replica's health gate, then the KV one
    tokens = state.record.replicas[0].kv_tokens
    if tokens == 0:
        say("no KV cache on any replica: the model keeps none (read back from each: 0 tokens)")
        checks.append("no KV cache")
    else:
        say(f"KV capacity equal: {tokens} tokens on every replica (read back from each"
            + (")" if plan.expected_kv_tokens is not None else "; the engine derives the count)"))
        checks.append("equal KV")
    if replicas.sharing:
        checks.append("weight sharing")  # each follower's share gate, in start_replicas
    if o.mps:
        verify_attachment(state, replicas, say, progress)
        say("MPS: every CUDA process of every replica is a client of the run's one server"
            if len(plan.gpus) == 1 else
            f"MPS: on each of the {len(plan.gpus)} GPUs, every CUDA process of its replicas "
            "is a client of that GPU's one server")
        checks.append("MPS attachment")
    say(f"starting the router on {plan.router_url}")
    router = start_router(state)
    if o.register:
        try:
            GatewayLink(state).register_run(say)
        except GatewayError as exc:
            raise BringUpFailed(f"--register: {exc}") from None
    state.set_phase(RunPhase.RUNNING)
    state.event(Event.RUN_READY)
    return RunUp(router, tuple(checks))
