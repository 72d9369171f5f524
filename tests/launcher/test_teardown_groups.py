"""A replica is a process group: found through its live leader's session or its records, stopped
whole (orphans of a SIGKILLed leader included), and nothing outside it is ever signalled.

Real processes: support/orphaning_engine.py stands in for a multi-process engine (leader → core
→ worker, the children without the run token). Every process a test starts is SIGKILLed by pid
+ create time afterwards, whatever happened.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from omni_dp.contract import TOKEN_ENV
from omni_dp.launcher.processes.groups import (
    ReplicaGroup,
    cuda_evidence,
    find_replica_processes,
    is_cuda_device,
    live_processes,
    mapping_evidence,
    session_processes,
    stop_groups,
    unproven_orphans,
)
from omni_dp.launcher.record.state import RunState
from omni_dp.mps.attach import DeclaredProcess
from omni_dp.procs import ProcessIdentity, identify, is_alive
from omni_dp.runfile import ReplicaState

from support.plans import gpu_run_record, gpus_json, stored_state, two_replica_plan
from support.wait import wait_for

ENGINE = Path(__file__).resolve().parents[1] / "support" / "orphaning_engine.py"
ROLES = ("leader", "core", "worker")
LIFETIME_S = "60"  # the stand-in's own bound: nothing outlives a test by more


@dataclass
class Engine:
    popen: subprocess.Popen
    pidfile: Path
    ids: dict[str, ProcessIdentity] = field(default_factory=dict)

    def __getitem__(self, role: str) -> ProcessIdentity:
        return self.ids[role]

    def wait_up(self) -> Engine:
        def up() -> bool:
            lines = self.pidfile.read_text().split("\n") if self.pidfile.exists() else []
            pids = dict(line.split() for line in lines if line.strip())
            if set(pids) != set(ROLES):
                return False
            for role, pid in pids.items():
                self.ids[role] = identify(int(pid))
            return True

        wait_for("the stand-in engine's three processes", up, timeout=20, interval=0.05)
        return self

    def kill_leader(self) -> None:
        os.kill(self["leader"].pid, signal.SIGKILL)
        self.popen.wait(10)

    def cleanup(self) -> None:
        for identity in self.ids.values():
            if identity is not None and is_alive(identity):
                with contextlib.suppress(OSError):
                    os.kill(identity.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)


@pytest.fixture
def token() -> str:
    return secrets.token_hex(16)


@pytest.fixture
def engines(tmp_path, token):
    """Start stand-in engines (a session each, the token in the leader's environment)."""
    started: list[Engine] = []

    def start(*flags: str, run_token: str | None = None) -> Engine:
        pidfile = tmp_path / f"engine{len(started)}.pids"
        env = {**os.environ, TOKEN_ENV: run_token or token}
        popen = subprocess.Popen([sys.executable, str(ENGINE), str(pidfile), "--lifetime",
                                  LIFETIME_S, *flags], env=env, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
        engine = Engine(popen, pidfile)
        started.append(engine)
        return engine.wait_up()

    try:
        yield start
    finally:
        for engine in started:
            engine.cleanup()


@pytest.fixture
def bystanders():
    """Idle processes that are not the run's (no token, not in any replica's session)."""
    started: list[subprocess.Popen] = []

    def start(env_extra: dict[str, str] | None = None) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        popen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                 env={**env, **(env_extra or {})}, stdin=subprocess.DEVNULL)
        started.append(popen)
        wait_for("the bystander", lambda: identify(popen.pid) is not None, timeout=5)
        return popen

    try:
        yield start
    finally:
        for popen in started:
            popen.kill()
            popen.wait(10)


def running(popen: subprocess.Popen) -> bool:
    try:
        return popen.poll() is None and psutil.Process(popen.pid).status() != "zombie"
    except psutil.Error:
        return False


# --- finding -----------------------------------------------------------------------------------


def test_a_live_leaders_session_is_found_and_stopped_whole(engines, token) -> None:
    engine = engines()
    leader, core, worker = (engine[role] for role in ROLES)
    assert set(session_processes(leader)) == {leader, core, worker}
    assert set(live_processes(ReplicaGroup(leader), token)) == {leader, core, worker}
    found = {f.identity: f for f in find_replica_processes(leader)}
    assert set(found) == {leader, core, worker}
    assert (found[core].name, found[worker].name) == ("StandinCore", "StandinWorker")
    assert all(f.cuda_evidence is None for f in found.values())

    started = time.monotonic()
    assert stop_groups([ReplicaGroup(leader)], token, 5.0, grace_s=1.0,
                       reap=[engine.popen]) == []
    assert time.monotonic() - started < 4.0  # SIGTERM honoured: no waiting for the bounds
    assert not any(is_alive(i) for i in (leader, core, worker))


def test_a_stopped_group_is_continued_so_that_it_drains_instead_of_being_killed(engines,
                                                                               token) -> None:
    """A SIGSTOPped replica (a hang, a debugger) keeps SIGTERM pending: the stop continues it
    so it drains at once, rather than after the drain bound's SIGKILL."""
    engine = engines()
    members = [engine[role] for role in ROLES]
    os.killpg(members[0].pid, signal.SIGSTOP)
    wait_for("the group stopped", lambda: all(
        psutil.Process(i.pid).status() == psutil.STATUS_STOPPED for i in members), timeout=5)
    started = time.monotonic()
    assert stop_groups([ReplicaGroup(members[0])], token, 20.0, grace_s=5.0,
                       reap=[engine.popen]) == []
    assert time.monotonic() - started < 5.0  # drained on SIGTERM, not killed after 20 s
    assert not any(is_alive(i) for i in members)


def test_orphans_of_a_sigkilled_leader_are_reached_only_through_their_records(
        engines, token) -> None:
    engine = engines()
    leader, core, worker = (engine[role] for role in ROLES)
    engine.kill_leader()
    assert is_alive(core) and is_alive(worker)  # the engine's children outlive it
    assert session_processes(leader) == []
    assert live_processes(ReplicaGroup(leader), token) == []  # a bare session id proves nothing

    group = ReplicaGroup(leader, (core, worker))
    assert set(live_processes(group, token)) == {core, worker}
    assert stop_groups([group], token, 5.0, grace_s=1.0) == []
    assert not is_alive(core) and not is_alive(worker)
    assert live_processes(group, token) == []


def test_a_session_member_with_the_token_is_the_runs_without_a_record(engines, token) -> None:
    engine = engines("--token-in", "worker")
    leader, core, worker = (engine[role] for role in ROLES)
    engine.kill_leader()
    assert live_processes(ReplicaGroup(leader), token) == [worker]
    assert live_processes(ReplicaGroup(leader), secrets.token_hex(16)) == []
    assert live_processes(ReplicaGroup(leader), None) == []
    assert is_alive(core)


def test_replica_group_of_a_record_keeps_only_members_with_a_create_time(tmp_path) -> None:
    state = RunState.create(two_replica_plan(tmp_path))
    leader = ProcessIdentity(100, 1.0)
    state.update_replica(0, identity=leader, processes=(
        DeclaredProcess(100, "main", "cpu", 1.0), DeclaredProcess(101, "core", "cpu", 2.0),
        DeclaredProcess(102, "declared", "cuda:0")))
    group = ReplicaGroup.of(RunState.load(state.directory).replica(0))
    assert group == ReplicaGroup(leader, (ProcessIdentity(101, 2.0),))
    assert ReplicaGroup.of(state.replica(1)) == ReplicaGroup(None, ())


# --- never anything else -------------------------------------------------------------------------


def test_nothing_outside_the_group_is_signalled(engines, bystanders, token) -> None:
    """A process outside the session without the token, one outside it WITH the token (the
    teardown's token sweep handles those, not a replica's stop), and a recorded member whose
    create time does not match (a recycled pid) all stay untouched."""
    plain = bystanders()
    token_carrier = bystanders({TOKEN_ENV: token})
    recycled = ProcessIdentity(plain.pid, identify(plain.pid).create_time + 1.0)
    engine = engines()
    leader, core, worker = (engine[role] for role in ROLES)
    engine.kill_leader()
    group = ReplicaGroup(leader, (core, worker, recycled))
    assert set(live_processes(group, token)) == {core, worker}
    assert stop_groups([group], token, 2.0, grace_s=1.0) == []
    assert not is_alive(core) and not is_alive(worker)
    assert running(plain) and running(token_carrier)
    assert stop_groups([ReplicaGroup(recycled, (recycled,))], token, 0.5, grace_s=0.5) == []
    assert running(plain)


def test_before_kill_gets_exactly_the_survivors_that_ignored_sigterm(engines, token) -> None:
    """The core ignores SIGTERM; leader and worker go at once. Nothing recorded: the core
    seen in the live leader's session stays the run's by pid + create time after it exits."""
    engine = engines("--stubborn", "core")
    leader, core, worker = (engine[role] for role in ROLES)
    seen: list[list[ProcessIdentity]] = []
    survivors = stop_groups([ReplicaGroup(leader)], token, 0.5, grace_s=0.5,
                            reap=[engine.popen], before_kill=seen.append)
    assert seen == [[core]]
    assert survivors == []
    assert not any(is_alive(i) for i in (leader, core, worker))


def test_a_failing_before_kill_still_leaves_nothing_running(engines, token) -> None:
    engine = engines("--stubborn", "core")
    core = engine["core"]
    group = ReplicaGroup(engine["leader"], (core,))

    def broken(survivors: list[ProcessIdentity]) -> None:
        raise RuntimeError("before_kill failed")

    with pytest.raises(RuntimeError, match="before_kill failed"):
        stop_groups([group], token, 0.2, grace_s=0.2, reap=[engine.popen], before_kill=broken)
    wait_for("the stubborn core to be killed", lambda: not is_alive(core), timeout=5,
             interval=0.05)


# --- CUDA evidence -------------------------------------------------------------------------------


def test_cuda_evidence_counts_real_devices_and_libcuda_not_nvidiactl() -> None:
    assert is_cuda_device("/dev/nvidia-uvm") and is_cuda_device("/dev/nvidia0")
    assert is_cuda_device("/dev/nvidia12")
    for path in ("/dev/nvidiactl", "/dev/nvidia-modeset", "/dev/nvidia-uvm-tools",
                 "/dev/nvidia-caps/nvidia-cap1", "/tmp/dev/nvidia0", "/dev/null"):
        assert not is_cuda_device(path), path
    line = b"7f00-7f10 r-xp 00000000 08:01 42   /usr/lib/x86_64-linux-gnu/libcuda.so.550.54\n"
    other = b"7f10-7f20 r-xp 00000000 08:01 43   /usr/lib/libcudart.so.12\n"
    anon = b"7f20-7f30 rw-p 00000000 00:00 0\n"
    assert mapping_evidence([other, anon, line], 1 << 20) == \
        "maps /usr/lib/x86_64-linux-gnu/libcuda.so.550.54"
    assert mapping_evidence([other, anon], 1 << 20) is None
    assert mapping_evidence([other, line], len(other)) is None  # bounded: stops reading


def test_find_replica_processes_reports_a_mapped_libcuda(tmp_path) -> None:
    library = tmp_path / "libcuda.so.1"
    library.write_bytes(b"\0" * 4096)
    code = ("import mmap, sys, time\n"
            "f = open(sys.argv[1], 'rb')\n"
            "m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n"
            "print('up', flush=True)\n"
            "time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code, str(library)], stdout=subprocess.PIPE,
                             text=True, start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        assert child.stdout.readline().strip() == "up"
        leader = identify(child.pid)
        [found] = find_replica_processes(leader)
        assert found.identity == leader
        assert found.cuda_evidence == f"maps {library}"
    finally:
        child.kill()
        child.wait(10)
    assert cuda_evidence(child.pid) is None  # gone: no exception, no evidence
    assert find_replica_processes(leader) == []


# --- teardown ------------------------------------------------------------------------------------


def _replica_of(state: RunState, engine: Engine) -> None:
    """Record the engine as replica 0, its children as the launcher records them."""
    leader = engine["leader"]
    state.update_replica(0, identity=leader, pgid=leader.pid, state=ReplicaState.STARTING,
                         processes=tuple(DeclaredProcess(engine[r].pid, r, "cpu",
                                                         engine[r].create_time)
                                         for r in ROLES))
    state.update_replica(0, state=ReplicaState.HEALTHY)


def test_teardown_stops_the_orphans_of_a_sigkilled_replica_leader(tmp_path, engines) -> None:
    from omni_dp.launcher.teardown import teardown

    state = RunState.create(two_replica_plan(tmp_path))
    state.update(launcher=None)  # this test process: never the run's owner here
    engine = engines(run_token=state.token)
    core, worker = engine["core"], engine["worker"]
    _replica_of(state, engine)
    engine.kill_leader()

    result = teardown(state, drain_timeout=2.0, keep_state=True)
    assert result.clean, result.leftovers
    assert not is_alive(core) and not is_alive(worker)
    events = {e["event"]: e for e in state.events()}
    assert events["replicas_stopping"]["replicas"] == [
        {"index": 0, "leader": engine["leader"].pid, "leader_alive": False,
         "pids": [core.pid, worker.pid]}]
    assert events["replicas_stopped"]["survivors"] == []
    assert state.replica(0).state is ReplicaState.STOPPED


def test_a_replica_process_that_survives_is_a_leftover(tmp_path, engines, monkeypatch) -> None:
    from omni_dp.launcher import teardown as teardown_module

    state = RunState.create(two_replica_plan(tmp_path))
    state.update(launcher=None)
    engine = engines(run_token=state.token)
    _replica_of(state, engine)
    engine.kill_leader()
    core = engine["core"]
    monkeypatch.setattr(teardown_module, "stop_groups", lambda *args, **kwargs: [core])
    monkeypatch.setattr(teardown_module, "_stop_token_carriers", lambda *args: None)

    result = teardown_module.teardown(state, drain_timeout=0.5)
    assert not result.clean and not result.removed
    assert any(f"replica pid {core.pid} is still running" in line for line in result.leftovers)
    assert {e["event"]: e for e in state.events()}["replicas_stopped"]["survivors"] == [core.pid]


def test_an_orphan_never_recorded_is_named_not_signalled_and_the_teardown_is_not_clean(
        tmp_path, engines) -> None:
    """The leader died before its children were recorded (killed during start-up): the
    session id alone does not make them the run's, so nothing signals them — and teardown
    says so instead of calling the run clean."""
    from omni_dp.launcher.teardown import teardown

    state = RunState.create(two_replica_plan(tmp_path))
    state.update(launcher=None)
    engine = engines()  # its children do not carry this run's token
    leader, core, worker = (engine[role] for role in ROLES)
    state.update_replica(0, identity=leader, pgid=leader.pid, state=ReplicaState.STARTING)
    engine.kill_leader()

    assert set(unproven_orphans(ReplicaGroup(leader))) == {core, worker}
    assert unproven_orphans(ReplicaGroup(leader, (core,))) == [worker]
    result = teardown(state, drain_timeout=1.0, keep_state=True)
    assert not result.clean
    assert sum(f"pid {p.pid} is in the session of a replica's dead leader" in line
               for line in result.leftovers for p in (core, worker)) == 2
    assert is_alive(core) and is_alive(worker)  # never signalled


def test_processes_seen_while_a_replica_starts_are_recorded_and_reached_after_its_leader(
        tmp_path, engines) -> None:
    """The launcher records a starting replica's session at every /health poll, so children
    of a leader killed before it was ever healthy are the run's by record."""
    from omni_dp.launcher.bringup.replicas import ReplicaControl
    from omni_dp.launcher.teardown import teardown

    state = RunState.create(two_replica_plan(tmp_path))
    state.update(launcher=None)
    engine = engines()  # its children do not carry this run's token
    leader, core, worker = (engine[role] for role in ROLES)
    state.update_replica(0, identity=leader, pgid=leader.pid, state=ReplicaState.STARTING)
    ReplicaControl(state).remember_session(0)
    recorded = {(p.pid, p.create_time) for p in state.replica(0).processes}
    assert {(core.pid, core.create_time), (worker.pid, worker.create_time)} <= recorded
    assert {p.role for p in state.replica(0).processes} >= {"StandinCore", "StandinWorker"}

    engine.kill_leader()
    result = teardown(state, drain_timeout=2.0, keep_state=True)
    assert result.clean, result.leftovers
    assert not is_alive(core) and not is_alive(worker)


# --- teardown of a run over two GPUs: one daemon each ------------------------------------------


@pytest.fixture
def daemon_standins(bystanders, token):
    """Processes standing in for GPU slot k's MPS daemon, k = 0, 1, … (each carrying the run
    token, as a daemon the launcher started does): only a `quit` (fake_quit) ends one."""
    return lambda: bystanders({TOKEN_ENV: token})


def two_gpu_state(tmp_path: Path, token: str, daemons: list[subprocess.Popen]) -> RunState:
    """Four replicas over two GPUs (0, 1 on slot 0; 2, 3 on slot 1), none running any more,
    and each GPU's daemon (the stand-ins, by GPU slot) still up."""
    records = [{**identify(popen.pid).to_json(), "binary": "mps-control",
                "pipe_dir": str(tmp_path / f"gpu{k}" / "pipe"),
                "log_dir": str(tmp_path / f"gpu{k}" / "log"), "gpu_uuid": f"GPU-{k}",
                "server_binary": None, "gpu": k} for k, popen in enumerate(daemons)]
    data = gpu_run_record("run-gpus", [{"index": i, "gpu": i // 2} for i in range(4)],
                          gpus_json(2), records)
    return stored_state(tmp_path / "run", data, token)


@dataclass
class Quits:
    """The GPU slots whose daemon was quit, in order, and when (time.monotonic) by slot."""

    order: list[int] = field(default_factory=list)
    at: dict[int, float] = field(default_factory=dict)


def fake_quit(monkeypatch, daemons: list[subprocess.Popen],
              foreign: dict[int, list[int]]) -> Quits:
    """teardown's MpsDaemon, faked for each GPU's stand-in (known by its pipe dir): its
    clients are `foreign`'s for its GPU slot (none by default); its `quit` ends the stand-in."""
    from omni_dp.launcher import teardown as teardown_module

    quits = Quits()

    def daemon(control):
        gpu = int(Path(control.pipe_dir).parent.name.removeprefix("gpu"))

        def stop(record):
            assert record.gpu == gpu and record.identity.pid == daemons[gpu].pid
            quits.order.append(gpu)
            quits.at[gpu] = time.monotonic()
            daemons[gpu].terminate()
            daemons[gpu].wait(10)
            return True

        return SimpleNamespace(clients=lambda: {100 + gpu: foreign.get(gpu, [])}, stop=stop)

    monkeypatch.setattr(teardown_module, "MpsDaemon", daemon)
    monkeypatch.setattr(teardown_module, "CLIENTS_GONE_WAIT_S", 1.0)
    return quits


def test_teardown_stops_every_gpus_daemon(tmp_path, token, daemon_standins,
                                          monkeypatch) -> None:
    from omni_dp.launcher.teardown import teardown

    daemons = [daemon_standins(), daemon_standins()]
    state = two_gpu_state(tmp_path, token, daemons)
    quits = fake_quit(monkeypatch, daemons, {})
    said: list[str] = []
    result = teardown(state, drain_timeout=1.0, keep_state=True, say=said.append)
    assert result.clean, result.leftovers
    assert quits.order == [0, 1] and not any(running(d) for d in daemons)
    assert [line for line in said if "MPS daemon" in line] == [
        f"stopping the MPS daemon of GPU {k} (NVIDIA H200) (pid {d.pid})"
        for k, d in enumerate(daemons)]
    assert [(e["gpu"], e["pid"]) for e in state.events()
            if e["event"] == "mps_daemon_stopped"] == [(k, d.pid) for k, d in enumerate(daemons)]


def test_a_daemon_a_foreign_client_holds_is_left_and_named_and_the_other_gpus_is_stopped(
        tmp_path, token, daemon_standins, monkeypatch) -> None:
    """GPU 0's daemon keeps a client that is not the run's: it is left (never signalled,
    though it carries the run token), and named; GPU 1's daemon is stopped without waiting for
    GPU 0's to be let go of."""
    from omni_dp.launcher.teardown import teardown

    daemons = [daemon_standins(), daemon_standins()]
    state = two_gpu_state(tmp_path, token, daemons)
    quits = fake_quit(monkeypatch, daemons, {0: [4242]})
    began = time.monotonic()
    result = teardown(state, drain_timeout=1.0)
    assert quits.order == [1] and not running(daemons[1])
    assert quits.at[1] - began < 0.9  # at once: GPU 0's clients do not hold GPU 1's daemon up
    assert time.monotonic() - began >= 1.0  # GPU 0's clients were waited for, bounded
    assert running(daemons[0])  # not quit, and not stopped as a token carrier either
    assert not result.clean and not result.removed
    [left] = result.leftovers
    assert left.startswith("MPS client(s) 4242 are still attached to the run's daemon of "
                           f"GPU 0 (NVIDIA H200) (pid {daemons[0].pid})")
    assert [e["gpu"] for e in state.events() if e["event"] == "mps_daemon_stopped"] == [1]
