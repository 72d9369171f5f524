"""The device script (bench/gpu_run.sh) and its parts, run on CPU end to end.

A lent GPU machine gives one call of minutes and brings back only the files under $OUT, so the
script must leave exactly the files it promises — also when a step fails or times out — and
leave none of its processes running on the (warm) machine. Here it runs the same steps with
`GPU=none` and the tiny model; the MPS smoke test runs against the real control daemon.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import psutil
import pytest

from omni_dp.procs import read_environ

from support.mps import real_control_binary

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
PROMISED = {"summary.md", "probe.txt", "mps_smoke.txt", "gpu_check.txt", "share.txt", "gpus2.txt",
            "overlap.txt", "bench.txt", "scaling.txt", "scaling.md", "scaling.jsonl",
            "artifacts.tar.gz"}

sys.path.insert(0, str(BENCH))  # the bench scripts import each other as top-level modules


def processes_under(directory: str) -> list[int]:
    """Processes whose state dir or MPS pipe dir lies under `directory`."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        env = read_environ(proc.pid) or {}
        paths = (env.get("OMNI_DP_STATE_DIR", ""), env.get("CUDA_MPS_PIPE_DIRECTORY", ""))
        if any(p.startswith(directory) for p in paths):
            found.append(proc.pid)
    return found


def gpu_run(out: Path, timeout: float = 400, **knobs: str) -> tuple[int, str]:
    env = {**os.environ, "OUT": str(out), "GPU": "none", "MODEL": "tiny", "CONFIGS": "1,2",
           "CONCURRENCY": "4", "REQUESTS": "8", "BUDGET": "300", "PYTHON": sys.executable,
           "SHARE_REPLICAS": "2", "SHARE_RUNS": "shared",
           **knobs}
    done = subprocess.run(["bash", str(BENCH / "gpu_run.sh")], env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    summary = (out / "summary.md").read_text()
    work = re.search(r"work dir (\S+)", summary).group(1)
    assert not Path(work).exists(), f"work dir {work} kept: {summary}"
    assert processes_under(work) == [], "a process of the device script is still running"
    assert {p.name for p in out.iterdir()} == PROMISED
    return done.returncode, summary


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "scaling.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_the_device_script_runs_on_cpu_and_brings_back_exactly_its_files(tmp_path):
    real_control_binary()  # the smoke step drives the real daemon (fails in CI if missing)
    rc, summary = gpu_run(tmp_path / "out")
    assert rc == 0, summary
    for step in ("probe", "mps smoke", "gpu_check", "weight share", "DP table"):
        assert re.search(rf"^\| {step} \| ok \|", summary, re.M), summary
    assert "| cleanup | nothing left running |" in summary
    assert "| two GPUs | skipped (0 GPU(s) here) |" in summary  # GPU=none: not run, said
    assert "| overlap | skipped (no GPU) |" in summary
    assert "needs a GPU" in (tmp_path / "out" / "overlap.txt").read_text()
    assert [(r["config"], r["result"]) for r in rows(tmp_path / "out")] == [
        ("1", "ok"), ("2", "ok")]
    assert all(r["down_rc"] == 0 and r["left_behind"] == [] for r in rows(tmp_path / "out"))
    assert "RESULT: PASS" in (tmp_path / "out" / "gpu_check.txt").read_text()
    # the sharing run: identical audio from leader and follower, back after the leader's kill
    share = (tmp_path / "out" / "share.txt").read_text()
    assert re.search(r"^\| shared \| ok \|.*\| True \(after: True\) \| [\d.]+ \| clean \|$",
                     share, re.M), share
    table = (tmp_path / "out" / "scaling.md").read_text()
    assert re.search(r"^\| 2 \| ok \|", table, re.M)
    with tarfile.open(tmp_path / "out" / "artifacts.tar.gz") as tar:
        names = tar.getnames()
    for run in ("bench-1-", "bench-2-"):
        run_files = [n for n in names if run in n]
        assert any(n.endswith("run.json") for n in run_files), names
        assert any(n.endswith("events.jsonl") for n in run_files), names
        assert any(n.endswith("replica_0.log") for n in run_files), names
    assert not any(n.endswith("run_token") for n in names)  # the run's secret stays behind
    assert any(n.endswith("smoke/log/control.log") for n in names)


@pytest.mark.slow
def test_a_step_that_times_out_or_fails_still_leaves_every_file_and_no_process(tmp_path):
    """gpu_check and the weight-share step are killed at 3 s; the DP table's MPS configuration
    fails its preflight (no GPU) and the next one still runs."""
    real_control_binary()
    rc, summary = gpu_run(tmp_path / "out", LIMIT_CHECK="3", LIMIT_SHARE="3", CONFIGS="2mps,1")
    assert rc == 1, summary
    assert re.search(r"^\| gpu_check \| timed out after 3s \|", summary, re.M), summary
    assert re.search(r"^\| weight share \| timed out after 3s \|", summary, re.M), summary
    assert "RESULT" not in (tmp_path / "out" / "gpu_check.txt").read_text()
    results = {r["config"]: r for r in rows(tmp_path / "out")}
    assert results["2mps"]["result"] == "launch exit 2"
    assert any("--mps needs a GPU" in line for line in results["2mps"]["launch_error"])
    assert results["1"]["result"] == "ok"
    assert all(r["left_behind"] == [] for r in results.values())
    assert "| cleanup | nothing left running |" in summary


@pytest.mark.slow
def test_a_configuration_past_its_time_limit_is_a_row_and_is_torn_down(tmp_path):
    """The launch is killed at 3 s (preflight alone takes about that, bring-up longer): the
    row says so, `down` ran, and nothing of the run is left."""
    state = tmp_path / "state"
    done = subprocess.run(
        [sys.executable, str(BENCH / "launch_scaling.py"), "--configs", "2", "--gpu", "none",
         "--serve-args", "--model tiny", "--state-dir", str(state), "--out",
         str(tmp_path / "out"), "--config-timeout", "3", "--min-config-s", "1",
         "--concurrency", "4", "--requests", "8"],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=BENCH, capture_output=True,
        text=True, timeout=180, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    [row] = rows(tmp_path / "out")
    assert row["result"] == "timeout (3 s) in: launch --replicas", row
    assert row["down_rc"] == 0 and row["left_behind"] == []
    assert not list((state / "runs").glob("*")) if (state / "runs").exists() else True
    assert processes_under(str(state)) == []
    assert re.search(r"^\| 2 \| timeout \(3 s\)", (tmp_path / "out" / "scaling.md").read_text(),
                     re.M)


@pytest.mark.slow
def test_steps_past_the_budget_are_skipped_and_said_so(tmp_path):
    rc, summary = gpu_run(tmp_path / "out", BUDGET="55", TEARDOWN_RESERVE="45",
                          LIMIT_PROBE="8", SHARE_RUNS="none")
    assert rc == 1
    assert re.search(r"^\| weight share \| skipped \(SHARE_RUNS=none\) \|", summary, re.M)
    assert re.search(r"^\| probe \| (ok|timed out after \d+s) \|", summary, re.M), summary
    assert re.search(r"^\| DP table \| skipped \(budget spent\) \|", summary, re.M), summary
    assert (tmp_path / "out" / "scaling.jsonl").read_text() == ""


# --- the MPS smoke test against the real control daemon -------------------------------------


def smoke(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH / "mps_smoke.py"), "--work", str(tmp_path / "smoke"), *args],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=120, check=False)


@pytest.mark.slow
def test_mps_smoke_without_a_gpu_reports_that_no_server_could_start(tmp_path):
    real_control_binary()
    done = smoke(tmp_path, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    facts = json.loads(done.stdout)
    assert facts["binaries"]["control"] and facts["binaries"]["server"]
    assert facts["daemon"]["path_first"] == os.path.dirname(facts["binaries"]["server"])
    assert facts["daemon"]["before_any_client"] == {"servers": [], "clients": {}}
    assert "libcuda" in facts["after_cuinit"]["client"]["error"]
    assert not facts["after_context"]["client_listed"]
    assert facts["after_context"]["daemon"]["servers"] == []
    by_hand = facts["start_server_by_hand"]
    assert by_hand["daemon"]["servers"] == []
    assert any("Starting new server" in line for line in by_hand["control_log"])
    assert any(re.search(r"Server \d+ exited with status [1-9]", line)
               for line in by_hand["control_log"])
    assert facts["quit"] == {"stopped": True, "alive_after": False}
    assert processes_under(str(tmp_path)) == []


@pytest.mark.slow
def test_mps_smoke_cleanup_quits_the_daemon_a_killed_run_left(tmp_path):
    real_control_binary()
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / "mps_smoke.py"), "--work", str(tmp_path / "smoke")],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "smoke" / "daemon.json").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "no daemon record"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)  # the smoke test and its client, not the daemon
        proc.wait(10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    record = json.loads((tmp_path / "smoke" / "daemon.json").read_text())
    assert psutil.pid_exists(record["pid"]), "the daemon should outlive the killed smoke test"
    done = smoke(tmp_path, "--cleanup")
    assert done.returncode == 0 and "stopped" in done.stdout, done.stdout
    assert processes_under(str(tmp_path)) == []
    assert "nothing to stop" in smoke(tmp_path, "--cleanup").stdout or \
        "already gone" in smoke(tmp_path, "--cleanup").stdout


# --- launch_scaling's pieces ------------------------------------------------------------------


def test_the_router_port_lies_outside_the_replicas_range():
    from launch_scaling import free_port_block

    base = free_port_block(4)  # 3 replicas, then the router
    replicas, router = range(base, base + 3), base + 3
    assert router not in replicas and router == replicas[-1] + 1


def test_artifacts_are_copied_without_the_token_sockets_or_fifos(tmp_path):
    import socket

    from launch_scaling import copy_artifacts

    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "mps" / "pipe").mkdir(parents=True)
    (run / "run.json").write_text("{}")
    (run / "run_token").write_text("secret")
    (run / "logs" / "replica_0.log").write_text("x" * 100)
    os.mkfifo(run / "mps" / "pipe" / "log")  # opening it to read would block forever
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(run / "mps" / "pipe" / "control"))
        copied = copy_artifacts(run, tmp_path / "copy")
    assert sorted(copied) == ["logs/replica_0.log", "run.json"]
    assert (tmp_path / "copy" / "logs" / "replica_0.log").read_text() == "x" * 100


def test_a_misspelled_configuration_is_refused_before_anything_runs():
    from launch_scaling import parse_args, parse_config

    assert parse_config("3mps") == (3, True) and parse_config("2") == (2, False)
    for bad in ("mps", "0", "2MPS", "x2"):
        with pytest.raises(ValueError, match="is not N or Nmps"):
            parse_config(bad)
    with pytest.raises(ValueError):
        parse_args(["--configs", "1,2mps,3pms", "--state-dir", "/nonexistent"])
