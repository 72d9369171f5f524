"""Launcher parts on their own: run state files, the pinning wrapper, child environments, the
KV gate's verdict, the supervisor's death watch."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys
import time

import pytest

from omni_dp.contract import TOKEN_ENV
from omni_dp.launcher.bringup.gates import kv_problems
from omni_dp.launcher.planning.options import LaunchOptions
from omni_dp.launcher.processes.ours import child_env
from omni_dp.launcher.record.events import Event
from omni_dp.launcher.record.state import RunState
from omni_dp.mps.attach import DeclaredProcess
from omni_dp.procs import identify
from omni_dp.runfile import ReplicaState, RunFileError

from support.plans import two_replica_plan
from support.ports import free_port
from support.stub_http import StubHttp


def test_run_state_is_private_and_written_atomically(tmp_path) -> None:
    state = RunState.create(two_replica_plan(tmp_path))
    assert stat.S_IMODE(os.stat(state.directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(state.directory.parent.parent).st_mode) == 0o700
    for name in ("run.json", "run_token"):
        assert stat.S_IMODE(os.stat(state.directory / name).st_mode) == 0o600
    assert len(state.token) == 32 and state.token not in (state.directory / "run.json").read_text()
    state.update_replica(1, kv_tokens=1024)
    state.event(Event.KV_CHECKED, ok=True)
    again = RunState.load(state.directory)
    assert again.replica(1).kv_tokens == 1024 and again.token == state.token
    assert [e["event"] for e in again.events()] == ["kv_checked"]
    assert not [p for p in state.directory.iterdir() if p.name.startswith(".")]  # no temp files
    with pytest.raises(FileExistsError):  # a run directory is never reused
        RunState.create(two_replica_plan(tmp_path))


def test_run_state_is_readable_by_verify_mps(tmp_path) -> None:
    from omni_dp.mps.runs import pick_mps_run

    state = RunState.create(two_replica_plan(tmp_path))
    state.update_replica(0, processes=(DeclaredProcess(123, "main", "cuda:0"),))
    run = pick_mps_run("run-test", tmp_path / "state")
    assert run.run_id == "run-test" and run.token == state.token
    replicas = [r.declared() for r in run.record.replicas]
    assert replicas[0].processes[0].pid == 123 and replicas[1].processes == ()


def test_load_refuses_other_schemas(tmp_path) -> None:
    state = RunState.create(two_replica_plan(tmp_path))
    (state.directory / "run.json").write_text(json.dumps({"schema": 99}))
    with pytest.raises(RunFileError, match="schema"):
        RunState.load(state.directory)


def test_pin_wrapper_pins_before_exec() -> None:
    cpu = sorted(os.sched_getaffinity(0))[-1]
    done = subprocess.run(
        [sys.executable, "-m", "omni_dp.launcher.processes.pin", str(cpu), "--",
         sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
        capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == f"[{cpu}]"


@pytest.mark.parametrize("cpus", ["x-1", "99999"])
def test_pin_wrapper_refuses_bad_cpus(cpus: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "omni_dp.launcher.processes.pin", cpus, "--", "true"],
        capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and "cannot pin" in done.stderr


def test_child_env_drops_inherited_run_and_mps_variables(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/someone/elses/pipe")
    monkeypatch.setenv(TOKEN_ENV, "old-token")
    monkeypatch.setenv("OMP_NUM_THREADS", "64")
    env = child_env({"OMNI_DP_REPLICA": "1", "OMP_NUM_THREADS": "2"}, "new-token")
    assert "CUDA_MPS_PIPE_DIRECTORY" not in env
    assert env[TOKEN_ENV] == "new-token" and env["OMP_NUM_THREADS"] == "2"
    assert env["OMNI_DP_REPLICA"] == "1" and env["PATH"] == os.environ["PATH"]


def test_child_env_drops_inherited_mps_limits_unless_the_launch_sets_them(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "10")
    monkeypatch.setenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1G")
    env = child_env({"OMNI_DP_REPLICA": "0"}, "token")
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env
    env = child_env({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"}, "token")
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"


def test_kv_gate_names_the_replica_that_differs() -> None:
    assert kv_problems({0: 1024, 1: 1024}, 1024) == []
    [problem] = kv_problems({0: 1024, 1: 512, 2: 1024}, 1024)
    assert "replica 1: 512 tokens  ← differs" in problem
    assert "replica 0: 1024 tokens\n" in problem
    assert kv_problems({0: 512, 1: 512}, 1024)  # equal, but not what was planned


def test_death_watch_wakes_when_a_process_that_is_not_our_child_exits() -> None:
    from omni_dp.launcher.supervision.supervisor import DeathWatch

    # A grandchild (its parent exits at once), like a replica of a detached supervisor.
    launcher = subprocess.run(
        [sys.executable, "-c", "import subprocess, sys; p = subprocess.Popen(['sleep', '1']); "
                               "print(p.pid)"],
        capture_output=True, text=True, timeout=30, check=True)
    identity = identify(int(launcher.stdout))
    assert identity is not None
    watch = DeathWatch()
    try:
        started = time.monotonic()
        watch.wait([identity], timeout_s=60)
        assert time.monotonic() - started < 30  # woken by the exit, not by the 60 s timeout
    finally:
        watch.close()


def test_the_launcher_never_imports_torch() -> None:
    """status/down/launch must start fast and never touch the GPU themselves."""
    code = ("import sys, omni_dp.launcher.launch, omni_dp.launcher.supervision.supervisor, "
            "omni_dp.launcher.views.status, omni_dp.launcher.planning.facts; "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.strip() == "False"


class _InfoServer(StubHttp):
    """Answers /get_server_info with a chosen KV capacity (one server per replica)."""

    def __init__(self, tokens: int) -> None:
        body = json.dumps({"max_total_num_tokens": tokens, "processes": [
            {"pid": os.getpid(), "role": "main", "device": "cpu"}]}).encode()
        super().__init__(lambda method, path, *_: (200 if path == "/get_server_info" else 404,
                                                   body))


def test_kv_gate_fails_a_run_whose_replicas_report_different_capacities(tmp_path) -> None:
    from omni_dp.launcher.bringup.replicas import ReplicaControl
    from omni_dp.launcher.engines.replica_api import GateFailed

    state = RunState.create(two_replica_plan(tmp_path))
    servers = [_InfoServer(1024), _InfoServer(512)]
    try:
        for i, server in enumerate(servers):
            state.update_replica(i, url=server.url)
        replicas = ReplicaControl(state)
        replicas.check_kv([0])  # the planned 1024 tokens: passes
        with pytest.raises(GateFailed, match="replica 1: 512 tokens  ← differs"):
            replicas.check_kv([0, 1])
    finally:
        for server in servers:
            server.close()
    assert [r.kv_tokens for r in state.replicas] == [1024, 512]
    [passed, failed] = [e for e in state.events() if e["event"] == "kv_checked"]
    assert passed["ok"] is True and failed["ok"] is False


def test_where_the_engine_derives_the_count_a_restart_is_held_to_the_serving_replicas(
        tmp_path) -> None:
    """expected None (sglang-omni's byte pin): equal to each other; a restarted replica is
    compared with the replicas that kept serving, never with a stopped one's stale count."""
    from omni_dp.launcher.bringup.replicas import ReplicaControl
    from omni_dp.launcher.engines.replica_api import GateFailed

    plan = dataclasses.replace(two_replica_plan(tmp_path), expected_kv_tokens=None)
    state = RunState.create(plan)
    servers = [_InfoServer(1000), _InfoServer(900)]
    try:
        for i, server in enumerate(servers):
            state.update_replica(i, url=server.url)
        replicas = ReplicaControl(state)
        with pytest.raises(GateFailed, match="no count is held by most"):
            replicas.check_kv([0, 1])  # at bring-up: equal to each other, or no one is right
        state.update_replica(0, state=ReplicaState.STARTING)
        state.update_replica(0, state=ReplicaState.HEALTHY)
        with pytest.raises(GateFailed) as failed:  # replica 1 restarted: against replica 0
            replicas.check_kv([1])
        assert "most hold 1000" not in str(failed.value) and "900 tokens  ← differs" in \
            str(failed.value)
        state.update_replica(0, state=ReplicaState.STOPPED)  # no reference left: alone is fine
        replicas.check_kv([1])
    finally:
        for server in servers:
            server.close()


def test_the_engine_dry_run_gets_a_private_empty_mps_pipe_directory(tmp_path, monkeypatch):
    """Never the system default pipe (/tmp/nvidia-mps) nor an inherited one: a CUDA context
    made by the dry run must not join anyone's daemon. The directory is gone afterwards."""
    from omni_dp.launcher.engines import ENGINES, BuiltinEngine
    from omni_dp.launcher.planning import facts as facts_module

    seen = {}

    class RecordingEngine(BuiltinEngine):
        name = "recording"

        def dry_run(self, launch, engine_args, env):
            pipe = env.get("CUDA_MPS_PIPE_DIRECTORY")
            seen["pipe"] = pipe
            seen["listing"] = os.listdir(pipe)
            seen["mode"] = stat.S_IMODE(os.stat(pipe).st_mode)
            seen["limit"] = env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
            return None, ["recorded"]

    monkeypatch.setitem(ENGINES, "recording", RecordingEngine())
    monkeypatch.setenv("OMNI_DP_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", "/someone/elses/pipe")
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "10")
    found = facts_module.gather_facts(LaunchOptions(engine="recording", gpu="none"),
                                      option_problems=[])
    assert found.engine_problems == ("recorded",)
    assert seen["pipe"] not in ("/someone/elses/pipe", "/tmp/nvidia-mps", None)
    assert seen["listing"] == [] and seen["mode"] == 0o700 and seen["limit"] is None
    assert not os.path.exists(seen["pipe"])


def test_with_share_weights_the_dry_run_is_a_leaders_naming_the_runs_share_dir(tmp_path,
                                                                            monkeypatch):
    """So that an architecture without a share policy is refused before anything starts (the
    directory is named, not made: a dry run creates nothing)."""
    from omni_dp.launcher.engines import ENGINES, BuiltinEngine
    from omni_dp.launcher.planning import facts as facts_module

    seen = []

    class RecordingEngine(BuiltinEngine):
        name = "recording"

        def dry_run(self, launch, engine_args, env):
            seen.append(self.argv(launch, engine_args))
            return None, ["recorded"]

    monkeypatch.setitem(ENGINES, "recording", RecordingEngine())
    monkeypatch.setenv("OMNI_DP_STATE_DIR", str(tmp_path / "state"))
    for share in (True, False):
        facts_module.gather_facts(LaunchOptions(engine="recording", gpu="none", run_id="r",
                                                share_weights=share), option_problems=[])
    shared, plain = seen
    share_dir = str(tmp_path / "state" / "runs" / "r" / "share")
    assert shared[shared.index("--share-weights") + 1] == "leader"
    assert shared[shared.index("--share-dir") + 1] == share_dir
    assert "--share-weights" not in plain and not os.path.exists(share_dir)


def test_the_facts_give_the_free_room_of_the_state_roots_filesystem_before_it_exists(
        tmp_path, monkeypatch):
    """A CPU weight-share segment is written there (plan_share_room checks it)."""
    from types import SimpleNamespace

    from omni_dp.launcher.planning import facts as facts_module

    root = tmp_path / "not" / "yet" / "state"
    assert facts_module.free_bytes(root) > 0
    asked = []
    monkeypatch.setattr(facts_module.shutil, "disk_usage",
                        lambda path: asked.append(path) or SimpleNamespace(free=12345))
    assert facts_module.free_bytes(root) == 12345 and asked == [tmp_path]
    assert not (tmp_path / "not").exists()  # read, not made

    def refused(path):
        raise PermissionError(path)

    monkeypatch.setattr(facts_module.shutil, "disk_usage", refused)
    assert facts_module.free_bytes(root) is None


def test_a_router_that_never_became_ready_is_stopped_not_left_recorded_as_alive(
        tmp_path, monkeypatch) -> None:
    """Left running, a router that failed its /ready gate stays "alive" in run.json, so the
    supervisor never restarts it and teardown is the only thing that would ever stop it."""
    from omni_dp.launcher.bringup import steps as bringup
    from omni_dp.launcher.processes.ours import stop_processes
    from omni_dp.procs import is_alive

    state = RunState.create(two_replica_plan(tmp_path, router_port=free_port()))
    monkeypatch.setattr(bringup, "ROUTER_READY_TIMEOUT_S", 1.0)
    monkeypatch.setattr(bringup, "http_json", lambda *args, **kwargs: (503, None))
    try:
        with pytest.raises(bringup.BringUpFailed, match="not ready within 1 s"):
            bringup.start_router(state)
        router = state.record.router
        assert router is not None  # recorded: what was started stays named in the state
        assert not is_alive(router.identity)
    finally:
        if state.record.router is not None:
            stop_processes([state.record.router.identity], state.token, 5.0)


def test_an_owner_that_survives_its_sigkill_is_a_leftover_and_the_state_is_kept(
        tmp_path, monkeypatch) -> None:
    """Teardown may call a run clean, and remove its state, only once the process in charge
    is confirmed gone; one the kernel would not let go is named instead."""
    from omni_dp.launcher import teardown as teardown_module
    from omni_dp.runfile import RunPhase, SupervisorRecord

    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        state = RunState.create(two_replica_plan(tmp_path))
        state.set_phase(RunPhase.RUNNING)
        state.update(launcher=None, supervisor=SupervisorRecord(identify(owner.pid),
                                                                detached=True))
        # the owner ignores every signal and never goes: nothing is sent, nothing is gone
        monkeypatch.setattr(teardown_module, "signal_ours", lambda *args, **kwargs: None)
        monkeypatch.setattr(teardown_module, "wait_gone", lambda identities, *_: identities)
        result = teardown_module.teardown(state, drain_timeout=0.0)
        assert not result.clean and not result.removed
        assert any(f"supervisor pid {owner.pid} is still running" in line
                   for line in result.leftovers)
        assert state.directory.is_dir()
    finally:
        owner.kill()
        owner.wait()


# A replica that leaves a file of its own in its TMPDIR (as vLLM leaves vllm_dist_<uuid>)
_LEAVES_A_FILE = ("import os, time; open(os.path.join('tmp', str(os.getpid())), 'w').close(); "
                  "time.sleep(60)")


@pytest.mark.parametrize("per_process", [True, False])
def test_an_external_replica_starts_without_what_its_last_process_left_in_its_tmp(
        tmp_path, monkeypatch, per_process):
    """Found by bench/soak.py: every restart of a vLLM replica left the dead process's
    vllm_dist_* file in its TMPDIR (engines/replica_<i>/tmp) for as long as the run lived. An
    engine whose TMPDIR is one process's (tmp_per_process) starts with tmp/ and rpc/ empty;
    its cache/ stays, and so does the TMPDIR of one that may keep caches there."""
    from omni_dp.launcher.bringup.replicas import ReplicaControl
    from omni_dp.launcher.engines import ENGINES, BuiltinEngine
    from omni_dp.rundir import engine_work_dir

    class External(BuiltinEngine):
        external = True
        tmp_per_process = per_process

    monkeypatch.setitem(ENGINES, "builtin", External())
    state = RunState.create(two_replica_plan(tmp_path))
    state.update_replica(0, argv=(sys.executable, "-c", _LEAVES_A_FILE))
    control = ReplicaControl(state)
    work = engine_work_dir(state.directory, 0)

    def start() -> subprocess.Popen:
        control.start(0)
        popen = control.popens[0]
        deadline = time.monotonic() + 30
        while not (work / "tmp" / str(popen.pid)).exists():
            assert time.monotonic() < deadline and popen.poll() is None
            time.sleep(0.05)
        return popen

    first = start()
    first.kill()  # by its own pid: this test's child
    first.wait()
    (work / "cache" / "compiled").write_text("kept")
    (work / "rpc" / "stale.sock").write_text("")
    second = start()
    try:
        left = {p.name for p in (work / "tmp").iterdir()}
        assert left == ({str(second.pid)} if per_process else {str(first.pid), str(second.pid)})
        assert (work / "cache" / "compiled").read_text() == "kept"
        assert (work / "rpc" / "stale.sock").exists() is not per_process
    finally:
        second.kill()
        second.wait()
