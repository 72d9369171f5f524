"""`omni-dp launch --mps` end to end on CPU: the REAL MPS control daemon, real replicas, the real
router, loopback only.

No GPU here, so nothing can attach to MPS: the control binary the launcher is given is the hybrid
TEST STAND-IN of tests/support/mps_hybrid.py (the real daemon for `-d` and every other command,
faked server/client lists), and the replicas declare their accelerator stage on "cuda:0" (through
the stand-in's generated sitecustomize) so that the attachment proof has something to prove. The
run itself (MpsRun) is support/launcher.py's; the `mps_run` fixture is tests/launcher/conftest.py's.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from support.http_client import post_json
from support.launcher import LOG_ENV, PIPE_ENV, TOKEN_ENV, MpsRun, alive, environ
from support.wait import wait_for


def _assert_gone(run: MpsRun, record: dict) -> None:
    """Nothing of the run is left: daemon, replicas, router, supervisor, token carriers."""
    records = {"daemon": (record.get("mps") or {}).get("daemon"),
               "router": record.get("router"), "supervisor": record.get("supervisor")}
    records.update({f"replica {r['index']}": r for r in record["replicas"]})
    still = {what: r["pid"] for what, r in records.items()
             if r and alive(r.get("pid"), r.get("create_time"))}
    assert not still, f"still running: {still}\n{run.logs()}"
    assert run.daemons() == [], "a control daemon still serves the run's pipe dir"
    assert run.token_carriers() == [], "processes still carry the run token"


# --- the tests ------------------------------------------------------------------------------------


def test_launch_under_real_daemon_proves_attachment_serves_and_down_waits_out_a_foreign_client(
        mps_run):
    run = mps_run
    done = run.launch()
    assert done.returncode == 0, done.stdout + done.stderr + run.logs()
    assert "every CUDA process of every replica is a client" in done.stdout

    status = run.status()
    daemon_pid = status["mps"]["daemon_pid"]
    assert status["state"] == "running"
    assert status["mps"]["daemon_alive"] and alive(daemon_pid)
    assert status["mps"]["attached"] is True
    assert [r["mps_attached"] for r in status["replicas"]] == [True, True]
    assert [r["health"] for r in status["replicas"]] == ["healthy", "healthy"]
    # The recorded daemon is the REAL binary (started under the stand-in's name) on the run's
    # own pipe and log dirs.
    daemon = psutil.Process(daemon_pid)
    assert os.path.realpath(daemon.exe()) == os.path.realpath(run.real)
    assert daemon.cmdline()[0] == str(run.hybrid.binary)
    assert daemon.environ()[PIPE_ENV] == run.pipe_dir
    assert daemon.environ()[LOG_ENV] == run.log_dir
    assert run.daemons() == [daemon_pid]
    for directory in (run.pipe_dir, run.log_dir):
        info = os.lstat(directory)
        assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700, directory
        assert Path(directory).is_relative_to(run.run_dir)
    assert (Path(run.pipe_dir) / "control").is_socket()
    assert (Path(run.log_dir) / "control.log").exists()

    # Every replica carries the run's MPS dirs, token and index, and is the one client of its
    # replica in the attachment report.
    record = run.record()
    replica_pids = [r["pid"] for r in record["replicas"]]
    for r in record["replicas"]:
        env = environ(r["pid"]) or {}
        assert env[PIPE_ENV] == run.pipe_dir and env[LOG_ENV] == run.log_dir
        assert env[TOKEN_ENV] == run.token and env["OMNI_DP_REPLICA"] == str(r["index"])
        assert [p["device"] for p in r["processes"]] == ["cuda:0"]  # the stand-in's declaration
    text = (run.run_dir / "mps_attach.txt").read_text()
    assert "RESULT: PASS" in text
    report = json.loads((run.run_dir / "mps_attach.json").read_text())
    assert report["result"] == "PASS" and len(report["servers"]) == 1
    assert sorted(c["pid"] for c in report["clients"]) == sorted(replica_pids)
    assert {c["pid"]: c["replica"] for c in report["clients"]} == {
        r["pid"]: r["index"] for r in record["replicas"]}

    verify = run.cli("verify-mps", run.run_id, "--json")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert json.loads(verify.stdout)["result"] == "PASS"

    code, _, body = post_json(run.router_url + "/v1/audio/speech",
                              {"input": "Hello there.", "max_new_tokens": 20, "seed": 1},
                              timeout=60)
    assert code == 200 and len(body) > 44, body[:200]

    # "nothing left behind" must be able to fail: a client that is not the run's keeps the
    # daemon from quitting; down names it, exits 3 and keeps the state, touching the client not.
    # (The same run: a down with the supervisor alive is the daemon-fault test's.)
    os.kill(record["supervisor"]["pid"], signal.SIGKILL)  # down does the whole teardown itself
    foreign = subprocess.Popen(["sleep", "600"], env={"PATH": os.environ["PATH"]})
    try:
        run.hybrid.set_scenario(extra_clients=[foreign.pid])
        down = run.cli("down", run.run_id)
        assert down.returncode == 3, down.stdout + down.stderr
        assert f"MPS client(s) {foreign.pid} are still attached" in down.stdout
        assert "state kept" in down.stdout
        assert foreign.poll() is None  # never signalled: not the run's
        assert run.daemons() == [daemon_pid]  # not quit under a client
        assert "quit" not in run.hybrid.commands()
        assert not any(alive(r["pid"], r["create_time"]) for r in record["replicas"])
        assert run.run_dir.exists()
    finally:
        foreign.kill()
        foreign.wait()
    down = run.cli("down", run.run_id)
    assert down.returncode == 0, down.stdout + down.stderr
    _assert_gone(run, record)
    assert not run.run_dir.exists()
    assert "quit" in run.hybrid.commands()  # stopped through the protocol, not by a signal


class _KillAfterVerdict(threading.Thread):
    """Kill a foreign 'client' as soon as the verdict is written, so that the teardown that
    follows (which waits for every client to leave before it quits the daemon) can finish."""

    def __init__(self, run: MpsRun, process: subprocess.Popen) -> None:
        super().__init__(daemon=True)
        self.artifact = run.run_dir / "mps_attach.txt"
        self.process, self.stop = process, threading.Event()

    def run(self) -> None:
        artifact = self.artifact
        while not self.stop.is_set() and not artifact.exists():
            time.sleep(0.02)
        self.process.kill()
        self.process.wait()


@pytest.mark.parametrize("scenario", ["no_server", "two_servers", "foreign_client", "cpu_only"])
def test_attachment_failure_stops_everything_and_keeps_state(mps_run, scenario):
    run = mps_run
    foreign = None
    watcher = None
    if scenario == "no_server":
        run.hybrid.set_scenario(servers=0)
        expected = "expected exactly one MPS server, found 0"
    elif scenario == "two_servers":
        run.hybrid.set_scenario(servers=2)
        expected = "expected exactly one MPS server, found 2"
    elif scenario == "foreign_client":
        foreign = subprocess.Popen(["sleep", "600"], env={"PATH": os.environ["PATH"]})
        run.hybrid.set_scenario(extra_clients=[foreign.pid])
        expected = f"{foreign.pid} (no run token of this run)"
        watcher = _KillAfterVerdict(run, foreign)
        watcher.start()
    else:  # the replicas run on CPU and say so: nothing to prove, so no PASS
        run.declare_cuda = False
        expected = "declares no CUDA process"
    try:
        done = run.launch(replicas=1)
    finally:
        if watcher is not None:
            watcher.stop.set()
            watcher.join(10)
        if foreign is not None and foreign.poll() is None:
            foreign.kill()
            foreign.wait()
    output = done.stdout + done.stderr
    assert done.returncode == 3, output + run.logs()
    assert "MPS attachment verification FAILED" in output
    assert expected in output
    assert "state is kept" in output

    record = run.record()
    assert record["state"] == "failed"
    assert record["router"] is None  # the router starts only after the proof
    assert "RESULT: FAIL" in (run.run_dir / "mps_attach.txt").read_text()
    assert json.loads((run.run_dir / "mps_attach.json").read_text())["result"] == "FAIL"
    _assert_gone(run, record)
    events = run.events()
    assert "bringup_failed" in events and "mps_daemon_stopped" in events
    assert "quit" in run.hybrid.commands()

    down = run.cli("down", run.run_id)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not run.run_dir.exists()


def _daemon_pid(record: dict) -> int:
    """The pid of the run's one daemon (one GPU: run.json's only entry in mps.daemons)."""
    [daemon] = record["mps"]["daemons"]
    return daemon["pid"]


def _kill_daemon(run: MpsRun) -> tuple[dict, int]:
    record = run.record()
    old = _daemon_pid(record)
    assert run.daemons() == [old]
    os.kill(old, signal.SIGKILL)
    return record, old


def _restart_after_killing_the_daemon(run: MpsRun) -> None:
    def settled():
        events = run.events()
        assert "mps_restart_failed" not in events, run.logs()
        return "mps_restarted" in events

    wait_for("the supervisor to restart the daemon and the replicas", settled, 60, interval=0.1)


def test_daemon_fault_restarts_daemon_and_every_replica_through_the_gates_and_down_quits_it(
        mps_run):
    run = mps_run
    done = run.launch("--check-interval", "0.5")
    assert done.returncode == 0, done.stdout + done.stderr + run.logs()
    before, old_daemon = _kill_daemon(run)
    old_replicas = [r["pid"] for r in before["replicas"]]
    _restart_after_killing_the_daemon(run)
    events = run.events()
    assert events.index("mps_fault") < events.index("mps_restarted")
    assert events.count("mps_daemon_started") == 2

    record = run.record()
    new_daemon = _daemon_pid(record)
    carries_token = TOKEN_ENV in (environ(new_daemon) or {})
    assert new_daemon != old_daemon and alive(new_daemon)
    assert not alive(old_daemon)
    assert run.daemons() == [new_daemon]
    new_replicas = [r["pid"] for r in record["replicas"]]
    assert set(new_replicas).isdisjoint(old_replicas)
    assert all(alive(pid) for pid in new_replicas)
    assert not any(alive(pid) for pid in old_replicas)
    assert "RESULT: PASS" in (run.run_dir / "mps_attach.txt").read_text()

    # The sweep after the restart finds it all healthy again; the router serves.
    status = wait_for("the run to be running again",
                      lambda: (s := run.status())["state"] == "running" and s, 15, interval=0.1)
    assert status["mps"] == {"daemon_pid": new_daemon, "daemon_alive": True, "attached": True,
                             "limits": {"thread_percentage": None,  # uncapped by default
                                        "memory_limit_bytes": None}}
    assert [r["health"] for r in status["replicas"]] == ["healthy", "healthy"]
    assert [r["mps_attached"] for r in status["replicas"]] == [True, True]
    verify = run.cli("verify-mps", run.run_id, "--json")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    code, _, _ = post_json(run.router_url + "/v1/audio/speech",
                           {"input": "Again.", "max_new_tokens": 8}, timeout=60)
    assert code == 200

    # The daemon the supervisor restarted (not the one launch started) is the one down quits.
    down = run.cli("down", run.run_id)
    assert down.returncode == 0, down.stdout + down.stderr
    _assert_gone(run, record)
    assert not run.run_dir.exists()
    commands = run.hybrid.commands()
    second_start = [i for i, c in enumerate(commands) if c == "-d"][1]
    assert "quit" in commands[second_start:], commands
    assert not carries_token


def test_daemon_fault_with_on_mps_fault_fail_tears_the_run_down_and_keeps_its_state(mps_run):
    run = mps_run
    done = run.launch("--check-interval", "0.5", "--on-mps-fault", "fail", replicas=1)
    assert done.returncode == 0, done.stdout + done.stderr + run.logs()
    record, _ = _kill_daemon(run)
    supervisor = record["supervisor"]["pid"]
    wait_for("the supervisor to stop the run and exit", lambda: not alive(supervisor), 30,
             interval=0.1)
    _assert_gone(run, record)

    assert run.run_dir.exists(), "the state of the failed run was removed"
    assert run.record()["state"] == "failed"
    assert "mps_fault" in run.events()
    status = run.cli("status", run.run_id, "--json")
    assert json.loads(status.stdout)["state"] == "failed"
    down = run.cli("down", run.run_id)
    assert down.returncode == 0 and not run.run_dir.exists()


def test_daemon_restarts_are_budgeted_then_the_run_stops(mps_run):
    run = mps_run
    done = run.launch("--check-interval", "0.5", "--restart-budget", "1", replicas=1)
    assert done.returncode == 0, done.stdout + done.stderr + run.logs()
    _kill_daemon(run)
    _restart_after_killing_the_daemon(run)  # the one restart the budget allows
    record, _ = _kill_daemon(run)
    wait_for("the supervisor to exit", lambda: not alive(record["supervisor"]["pid"]), 30,
             interval=0.1)
    _assert_gone(run, record)
    assert run.events().count("mps_restarted") == 1
    assert run.record()["state"] == "failed"  # kept for diagnosis
    faults = [json.loads(line) for line in (run.run_dir / "events.jsonl").read_text()
              .splitlines() if '"mps_fault"' in line]
    assert [f["action"] for f in faults] == ["restart", "fail"]
