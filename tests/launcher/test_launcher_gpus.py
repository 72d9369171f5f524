"""`omni-dp launch --gpus` end to end on CPU: one REAL MPS control daemon per GPU, real replicas,
the real router, loopback only.

No GPU here: `--mps --no-gpu-check --gpus 0,1` takes the two GPU indices unchecked, so the run has
two GPU slots, each with its own daemon (the real binary, started through the hybrid TEST
STAND-IN of tests/support/mps_hybrid.py, which fakes only the client lists: a process is listed
as a client of the daemon whose pipe directory it carries). The replicas run on the CPU.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from support.http_client import post_json
from support.launcher import PIPE_ENV, MpsRun, alive, daemon_pids, environ
from support.wait import wait_for

pytestmark = pytest.mark.slow


def _pipe(run: MpsRun, k: int) -> str:
    return str(run.run_dir / "mps" / f"gpu{k}" / "pipe")


def _daemon_pids(run: MpsRun) -> dict[int, int]:
    return {d["gpu"]: d["pid"] for d in run.record()["mps"]["daemons"]}


def _assert_gone(run: MpsRun, record: dict) -> None:
    pids = [d["pid"] for d in record["mps"]["daemons"]] + [r["pid"] for r in record["replicas"]]
    assert not [pid for pid in pids if alive(pid)], run.logs()
    assert daemon_pids(run.real, _pipe(run, 0)) == [] == daemon_pids(run.real, _pipe(run, 1))
    assert run.token_carriers() == []


def _events(run: MpsRun) -> list[dict]:
    return [json.loads(line) for line in (run.run_dir / "events.jsonl").read_text().splitlines()]


def _caps_in_force(run: MpsRun, k: int) -> tuple[str, str]:
    """What GPU k's daemon gives new clients, asked of the real daemon now."""
    env = {**os.environ, PIPE_ENV: _pipe(run, k)}
    answers = [subprocess.run([run.real], input=command + "\n", capture_output=True, text=True,
                              env=env, timeout=10, check=True).stdout.strip()
               for command in ("get_default_active_thread_percentage",
                               "get_default_device_pinned_mem_limit 0")]
    return answers[0], answers[1]


def test_two_gpus_two_daemons_each_replica_on_its_own_and_a_fault_restarts_only_its_gpu(
        mps_run):
    """And per-replica MPS caps: each daemon given them and read back (again after its
    restart), each replica's client environment, each replica's BF16 GEMM check passed."""
    run = mps_run
    done = run.launch("--gpus", "0,1", "--check-interval", "0.5", "--mps-thread-percentage",
                      "40", "--mps-memory-limit", "2GiB", replicas=2)
    assert done.returncode == 0, done.stdout + done.stderr + run.logs()
    assert "on each of the 2 GPUs, every CUDA process of its replicas" in done.stdout
    for title in ("GPU 0", "GPU 1"):
        assert (f"MPS caps in force for each client on {title}: 40% of the SMs and 2.00 GiB "
                "of pinned memory (set, and read back from the daemon)") in done.stdout
    assert done.stdout.count("its BF16 GEMM check passed under its MPS caps") == 2
    assert [_caps_in_force(run, k) for k in (0, 1)] == [("40.0", "2G")] * 2

    record = run.record()
    assert record["schema"] == 2
    assert [(g["slot"], g["label"]) for g in record["gpus"]] == [(0, "0"), (1, "1")]
    assert [r["gpu"] for r in record["replicas"]] == [0, 1]
    daemons = _daemon_pids(run)
    assert sorted(daemons) == [0, 1] and daemons[0] != daemons[1]
    for k in (0, 1):  # each daemon serves its own pipe dir; each replica is on its GPU's
        assert daemon_pids(run.real, _pipe(run, k)) == [daemons[k]]
        replica = record["replicas"][k]
        assert (environ(replica["pid"]) or {}).get(PIPE_ENV) == _pipe(run, k)
        proof = run.run_dir / f"mps_attach.gpu{k}.txt"
        assert "RESULT: PASS" in proof.read_text()
        assert json.loads((run.run_dir / f"mps_attach.gpu{k}.json").read_text())["replicas"][0][
            "index"] == k
    status = run.status()
    assert [g["replicas"] for g in status["gpus"]] == [[0], [1]]
    assert status["mps_caps"] == {"thread_percentage": 40, "memory_limit_bytes": 2 * 1024**3}
    assert [g["mps"]["limits"] for g in status["gpus"]] == [
        {"thread_percentage": 40.0, "memory_limit_bytes": 2 * 1024**3}] * 2
    for replica in record["replicas"]:
        env = environ(replica["pid"]) or {}
        assert env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") == "40", env
        assert env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") == "0=2048M"
    checks = [e for e in _events(run) if e["event"] == "replica_numeric_check"]
    assert sorted(e["replica"] for e in checks) == [0, 1]
    assert all(e["relative_error"] < 0.01 and e["device"] == "cpu" for e in checks)
    text = run.cli("status", run.run_id)
    assert "caps per client: 40% SMs, 2.00 GiB pinned" in text.stdout, text.stdout
    verify = run.cli("verify-mps", run.run_id)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    code, _, _ = post_json(run.router_url + "/v1/audio/speech",
                           {"input": "Two GPUs.", "max_new_tokens": 8}, timeout=60)
    assert code == 200

    # GPU 1's daemon dies: only GPU 1's replica restarts; GPU 0's keeps serving, untouched.
    kept = record["replicas"][0]["pid"]
    os.kill(daemons[1], signal.SIGKILL)
    wait_for("GPU 1's daemon and replica to be restarted",
             lambda: "mps_restarted" in run.events(), 60, interval=0.1)
    after = run.record()
    assert after["replicas"][0]["pid"] == kept and alive(kept)
    assert after["replicas"][1]["pid"] != record["replicas"][1]["pid"]
    new = _daemon_pids(run)
    assert new[0] == daemons[0] and new[1] != daemons[1] and alive(new[1])
    lines = [json.loads(line) for line in (run.run_dir / "events.jsonl").read_text().splitlines()]
    taken_out = {e["replica"] for e in lines if e["event"] == "router_disabled"}
    assert taken_out == {1}, taken_out  # replica 0 was never taken out of the router
    assert [e["gpu"] for e in lines if e["event"] == "mps_daemon_started"] == [0, 1, 1]
    wait_for("the run to be running again", lambda: run.status()["state"] == "running", 15,
             interval=0.1)
    # the new daemon got the caps too, and the restarted replica passed its check again
    assert _caps_in_force(run, 1) == ("40.0", "2G")
    assert [e["replica"] for e in _events(run) if e["event"] == "replica_numeric_check"] \
        == [0, 1, 1]

    down = run.cli("down", run.run_id)
    assert down.returncode == 0, down.stdout + down.stderr
    _assert_gone(run, after)
    assert not run.run_dir.exists()


def test_one_gpu_whose_replica_does_not_attach_fails_the_launch_naming_it(mps_run):
    run = mps_run
    run.hybrid.set_scenario(not_clients=[1])  # replica 1 (on GPU 1) never attaches
    done = run.launch("--gpus", "0,1", replicas=2)
    assert done.returncode == 3, done.stdout + done.stderr
    out = done.stdout + done.stderr
    assert "MPS attachment verification FAILED on GPU 1 (mps_attach.gpu1.txt)" in out
    assert "MPS on GPU 0: every CUDA process of its 1 replica(s) is a client" in out
    assert "FAIL" in (run.run_dir / "mps_attach.gpu1.txt").read_text()
    record = run.record()
    _assert_gone(run, record)  # both daemons stopped; the state kept for diagnosis
    assert run.run_dir.exists()
