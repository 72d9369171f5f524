"""`omni-dp verify-mps` on a run state, and `omni-dp mps start|status|stop`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from omni_dp.procs import identify, is_alive

from support.mps import STANDIN, real_control_binary
from support.plans import gpu_run_record, run_record

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


@pytest.mark.parametrize(("args", "why", "code"), [
    (["no-such-run"], "no run 'no-such-run'", 1),  # nothing there: as `status` and `logs`
    (["../etc"], "is not a run id", 2),
])
def test_verify_mps_cannot_check_exits_2(live_run, args, why, code):
    result = omni_dp("verify-mps", *args, env=live_run["env"])
    assert result.returncode == code
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
    assert result.returncode == 1
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


# --- a run over two GPUs: one daemon each -----------------------------------------------------

GPU_UUIDS = ("GPU-00000000-aaaa", "GPU-11111111-bbbb")


def gpu_standin(directory: Path, replies: dict) -> Path:
    """A front end of its own for one GPU's daemon: the stand-in, reading its own scenario."""
    directory.mkdir(parents=True)
    scenario = directory / "scenario.json"
    scenario.write_text(json.dumps({"replies": replies}))
    binary = directory / "nvidia-cuda-mps-control"
    binary.write_text(f'#!/bin/sh\nMPS_STANDIN_SCENARIO="{scenario}" exec "{sys.executable}" '
                      f'"{STANDIN}" "$@"\n')
    binary.chmod(0o755)
    return binary


@pytest.fixture
def two_gpus(tmp_path, spawn):
    """Run "run-2gpu": replica 0 on GPU 0, replica 1 on GPU 1, each GPU with its own daemon
    (a live process) and front end; `script(gpu, clients)` sets which pids its server lists."""
    root = tmp_path / "state"
    run_dir = root / "runs" / "run-2gpu"
    run_dir.mkdir(parents=True)
    replicas = [spawn({"OMNI_DP_RUN_TOKEN": TOKEN, "OMNI_DP_REPLICA": str(i)}) for i in (0, 1)]
    daemons = [identify(spawn()) for _ in (0, 1)]

    def script(gpu: int, clients: list[int]) -> Path:
        shutil.rmtree(tmp_path / f"front{gpu}", ignore_errors=True)
        return gpu_standin(tmp_path / f"front{gpu}", {
            "get_server_list": str(900 + gpu),
            f"get_client_list {900 + gpu}": "\n".join(map(str, clients))})

    def write(daemon_pids: list[int] | None = None) -> None:
        records = [{"pid": d.pid, "create_time": d.create_time if daemon_pids is None
                    or daemon_pids[slot] else 1.0,
                    "binary": str(tmp_path / f"front{slot}" / "nvidia-cuda-mps-control"),
                    "pipe_dir": str(run_dir / "mps" / f"gpu{slot}" / "pipe"),
                    "log_dir": str(run_dir / "mps" / f"gpu{slot}" / "log"),
                    "gpu_uuid": GPU_UUIDS[slot], "gpu": slot}
                   for slot, d in enumerate(daemons)]
        state = gpu_run_record(
            "run-2gpu",
            [{"index": i, "gpu": i, "processes": [{"pid": pid, "role": "main",
                                                   "device": "cuda:0"}]}
             for i, pid in enumerate(replicas)],
            [{"slot": s, "label": GPU_UUIDS[s], "index": s, "name": "NVIDIA H200"}
             for s in (0, 1)], records)
        (run_dir / "run.json").write_text(json.dumps(state))

    script(0, [replicas[0]])
    script(1, [replicas[1]])
    write()
    (run_dir / "run_token").write_text(TOKEN)
    return SimpleNamespace(dir=run_dir, replicas=replicas, script=script, write=write,
                           env={"OMNI_DP_STATE_DIR": str(root)})


def test_verify_mps_proves_each_gpu_against_its_own_daemon(two_gpus):
    result = omni_dp("verify-mps", "--no-nvml", env=two_gpus.env)  # the only live run
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    head0 = lines.index(next(x for x in lines if x.startswith(f"GPU 0 (NVIDIA H200) "
                                                              f"[{GPU_UUIDS[0]}], daemon pid")))
    head1 = lines.index(next(x for x in lines if x.startswith("GPU 1 (NVIDIA H200)")))
    assert lines[head0].endswith(": PASS   (mps_attach.gpu0.txt)")
    assert f"      client {two_gpus.replicas[0]} -> replica 0 (main)" in lines[head0:head1]
    assert f"      client {two_gpus.replicas[1]} -> replica 1 (main)" in lines[head1:]
    assert [x for x in lines if "RESULT" in x] == [lines[-1]]  # one verdict: the run's
    assert lines[-1].startswith("RESULT: PASS")
    for gpu in (0, 1):  # each GPU's own proof; none under the one-GPU name
        text = (two_gpus.dir / f"mps_attach.gpu{gpu}.txt").read_text()
        assert text.rstrip().endswith("RESULT: PASS")
        assert json.loads((two_gpus.dir / f"mps_attach.gpu{gpu}.json").read_text())[
            "replicas"][0]["index"] == gpu
    assert not (two_gpus.dir / "mps_attach.txt").exists()


def test_verify_mps_fails_naming_the_gpu_whose_replica_is_not_its_daemons_client(two_gpus):
    two_gpus.script(1, [])  # GPU 1's server has no client: replica 1 time-slices GPU 1
    result = omni_dp("verify-mps", "run-2gpu", "--no-nvml", env=two_gpus.env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1].startswith("RESULT: FAIL on GPU 1 (NVIDIA H200)")
    assert next(x for x in result.stdout.splitlines()
                if x.startswith("GPU 1")).endswith(": FAIL   (mps_attach.gpu1.txt)")
    report = json.loads(omni_dp("verify-mps", "run-2gpu", "--no-nvml", "--json",
                                env=two_gpus.env).stdout)
    assert report["result"] == "FAIL" and "replicas" not in report  # no one GPU's at the top
    assert [(g["gpu"], g["index"], g["label"], g["result"]) for g in report["gpus"]] == [
        (0, 0, GPU_UUIDS[0], "PASS"), (1, 1, GPU_UUIDS[1], "FAIL")]
    assert "not a client" in report["gpus"][1]["replicas"][0]["problems"][0]

    only0 = omni_dp("verify-mps", "run-2gpu", "--gpu", "0", "--no-nvml", "--json",
                    env=two_gpus.env)
    assert only0.returncode == 0, only0.stdout + only0.stderr
    report = json.loads(only0.stdout)
    assert [g["gpu"] for g in report["gpus"]] == [0]
    assert report["result"] == "PASS" and report["replicas"][0]["index"] == 0  # one GPU: on top
    by_uuid = omni_dp("verify-mps", "run-2gpu", "--gpu", GPU_UUIDS[1].lower(), "--no-nvml",
                      env=two_gpus.env)
    assert by_uuid.returncode == 1 and "GPU 0" not in by_uuid.stdout


def test_a_replicas_process_on_another_gpus_daemon_fails_that_gpu_too(two_gpus):
    two_gpus.script(0, two_gpus.replicas)  # replica 1 reached GPU 0's daemon, not its own
    two_gpus.script(1, [])
    report = json.loads(omni_dp("verify-mps", "run-2gpu", "--no-nvml", "--json",
                                env=two_gpus.env).stdout)
    assert [g["result"] for g in report["gpus"]] == ["FAIL", "FAIL"]
    [problem] = report["gpus"][0]["problems"]
    assert problem == (f"MPS client {two_gpus.replicas[1]} belongs to replica 1, which runs on "
                       "GPU 1 (NVIDIA H200): it reached this GPU's daemon, not its own GPU's")
    assert problem in (two_gpus.dir / "mps_attach.gpu0.txt").read_text()  # the proof says so


def test_verify_mps_of_a_gpu_not_in_the_run_exits_2_naming_the_runs_gpus(two_gpus):
    result = omni_dp("verify-mps", "--gpu", "7", env=two_gpus.env)
    assert result.returncode == 2
    assert (f"run run-2gpu has no GPU '7'; its GPUs: 0 ({GPU_UUIDS[0]}), 1 ({GPU_UUIDS[1]})"
            in result.stderr)
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_a_gpu_whose_daemon_is_gone_cannot_be_checked_unless_another_failed(two_gpus):
    two_gpus.write(daemon_pids=[True, False])  # GPU 1's daemon: a stale record
    result = omni_dp("verify-mps", "run-2gpu", "--no-nvml", env=two_gpus.env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "GPU 0 (NVIDIA H200)" in result.stdout  # what could be checked is shown
    assert "the MPS daemon of GPU 1 (NVIDIA H200) of run run-2gpu" in result.stderr
    assert result.stdout.splitlines()[-1].startswith("RESULT: CANNOT_CHECK: the MPS daemon "
                                                     "of GPU 1")
    report = json.loads(omni_dp("verify-mps", "run-2gpu", "--no-nvml", "--json",
                                env=two_gpus.env).stdout)
    assert report["result"] == "CANNOT_CHECK" and "GPU 1" in report["reason"]
    assert [g["result"] for g in report["gpus"]] == ["PASS", "CANNOT_CHECK"]
    two_gpus.script(0, [])  # and now GPU 0 fails: that is the verdict
    result = omni_dp("verify-mps", "run-2gpu", "--no-nvml", env=two_gpus.env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1].endswith("; not checked: GPU 1 (NVIDIA H200)")
