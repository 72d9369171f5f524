"""`omni-dp verify-mps` on a run state, and `omni-dp mps start|status|stop`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omni_dp.procs import identify, is_alive

from support.mps import real_control_binary
from support.plans import run_record

TOKEN = "cli-run-token"


def omni_dp(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omni_dp", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})},
                          stdin=subprocess.DEVNULL)


def write_run(root: Path, run_id: str, standin, daemon_pid: int, replicas: list[dict],
              mps: bool = True) -> Path:
    """A run state as the launcher writes it (schema 1), with a stand-in daemon record."""
    run_dir = root / "runs" / run_id
    run_dir.mkdir(parents=True)
    identity = identify(daemon_pid)
    daemon = {"pid": identity.pid, "create_time": identity.create_time,
              "binary": str(standin.binary), "pipe_dir": str(run_dir / "mps" / "pipe"),
              "log_dir": str(run_dir / "mps" / "log"), "gpu_uuid": "GPU-test"}
    state = run_record(run_id, replicas, daemon if mps else None)
    (run_dir / "run.json").write_text(json.dumps(state))
    (run_dir / "run_token").write_text(TOKEN)
    return run_dir


@pytest.fixture
def live_run(tmp_path, standin, spawn):
    daemon = spawn()  # stands for the run's daemon: alive, with a recorded create time
    replica = spawn({"OMNI_DP_RUN_TOKEN": TOKEN, "OMNI_DP_REPLICA": "0"})
    replicas = [{"index": 0, "processes": [{"pid": replica, "role": "main",
                                            "device": "cuda:0"}]}]
    run_dir = write_run(tmp_path, "run-a", standin, daemon, replicas)
    return {"root": tmp_path, "dir": run_dir, "replica": replica, "daemon": daemon,
            "env": {"OMNI_DP_STATE_DIR": str(tmp_path)}}


def test_verify_mps_pass_writes_artifacts(live_run, standin):
    standin.set({"get_server_list": "900", "get_client_list 900": str(live_run["replica"])})
    result = omni_dp("verify-mps", "run-a", "--no-nvml", env=live_run["env"])
    assert result.returncode == 0, result.stderr
    assert "RESULT: PASS" in result.stdout
    assert f"client {live_run['replica']} -> replica 0 (main)" in result.stdout
    assert (live_run["dir"] / "mps_attach.txt").read_text().rstrip().endswith("RESULT: PASS")


def test_verify_mps_fail_exits_1_with_json(live_run, standin):
    standin.set({"get_server_list": "900", "get_client_list 900": ""})
    result = omni_dp("verify-mps", "--json", "--no-nvml", env=live_run["env"])  # the only run
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["result"] == "FAIL"
    assert report["run_id"] == "run-a"
    assert "not a client" in report["replicas"][0]["problems"][0]


def test_verify_mps_with_nvml_on_a_machine_without_a_driver(live_run, standin):
    standin.set({"get_server_list": "900", "get_client_list 900": str(live_run["replica"])})
    result = omni_dp("verify-mps", "run-a", "--json", env=live_run["env"])
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["nvml"].startswith("not checked: NVML unavailable")


@pytest.mark.parametrize(("args", "why"), [
    (["no-such-run"], "no run 'no-such-run'"),
    (["../etc"], "is not a run id"),
])
def test_verify_mps_cannot_check_exits_2(live_run, args, why):
    result = omni_dp("verify-mps", *args, env=live_run["env"])
    assert result.returncode == 2
    assert why in result.stderr
    assert "Traceback" not in result.stderr


def test_verify_mps_dead_daemon_or_no_mps_is_2(tmp_path, standin, spawn):
    replica = [{"index": 0, "processes": []}]
    write_run(tmp_path, "no-mps", standin, spawn(), replica, mps=False)
    env = {"OMNI_DP_STATE_DIR": str(tmp_path)}
    result = omni_dp("verify-mps", "no-mps", env=env)
    assert result.returncode == 2
    assert "without --mps" in result.stderr

    write_run(tmp_path, "dead", standin, os.getpid(), replica)  # then make its pid stale:
    state = json.loads((tmp_path / "runs" / "dead" / "run.json").read_text())
    state["mps"]["daemon"]["create_time"] = 1.0
    (tmp_path / "runs" / "dead" / "run.json").write_text(json.dumps(state))
    result = omni_dp("verify-mps", "dead", env=env)
    assert result.returncode == 2
    assert "is not running" in result.stderr


def test_verify_mps_without_run_id_lists_several_live_runs(live_run, standin, spawn):
    write_run(live_run["root"], "run-b", standin, spawn(), [{"index": 0, "processes": []}])
    result = omni_dp("verify-mps", env=live_run["env"])
    assert result.returncode == 2
    assert "2 live runs (run-a, run-b)" in result.stderr


def test_verify_mps_with_no_state_at_all(tmp_path):
    result = omni_dp("verify-mps", env={"OMNI_DP_STATE_DIR": str(tmp_path)})
    assert result.returncode == 2
    assert "no live run" in result.stderr


def test_mps_start_refuses_without_a_gpu_and_says_why(tmp_path):
    result = omni_dp("mps", "start", "--state-dir", str(tmp_path / "s"))
    assert result.returncode == 2
    assert "no NVIDIA driver on this machine" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "s").exists()  # nothing created


def test_mps_start_status_stop_with_the_real_daemon(tmp_path):
    binary = real_control_binary()
    state = tmp_path / "s"
    started = omni_dp("mps", "start", "--state-dir", str(state), "--mps-control", binary,
                      "--no-gpu-check", "--mps-thread-percentage", "50", "--json")
    assert started.returncode == 0, started.stderr
    record = json.loads(started.stdout)
    identity = identify(record["pid"])
    try:
        assert identity is not None and is_alive(identity)
        status = omni_dp("mps", "status", "--state-dir", str(state), "--json")
        assert status.returncode == 0, status.stdout
        assert json.loads(status.stdout)["reachable"] is True
        again = omni_dp("mps", "start", "--state-dir", str(state), "--mps-control", binary,
                        "--no-gpu-check")
        assert again.returncode == 2
        assert "mps stop" in again.stderr
        stopped = omni_dp("mps", "stop", "--state-dir", str(state))
        assert stopped.returncode == 0, stopped.stderr
        assert not is_alive(identity)
        gone = omni_dp("mps", "status", "--state-dir", str(state))
        assert gone.returncode == 2
        assert "no daemon recorded" in gone.stderr
    finally:
        if identity is not None and is_alive(identity):
            os.kill(identity.pid, 9)


def test_mps_stop_of_a_daemon_that_already_died_does_not_claim_it_stopped(tmp_path):
    binary = real_control_binary()
    state = tmp_path / "s"
    started = omni_dp("mps", "start", "--state-dir", str(state), "--mps-control", binary,
                      "--no-gpu-check", "--json")
    assert started.returncode == 0, started.stderr
    pid = json.loads(started.stdout)["pid"]
    os.kill(pid, 9)
    stopped = omni_dp("mps", "stop", "--state-dir", str(state))
    assert stopped.returncode == 0, stopped.stderr
    assert f"pid {pid} was not running" in stopped.stdout and "stopped" not in stopped.stdout
    assert not (state / "mps" / "daemon.json").exists()
