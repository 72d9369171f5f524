"""End to end: `omni-dp launch` with real CPU replicas and a real router on loopback.

Every test starts its run in its own OMNI_DP_STATE_DIR on fresh ports; the `runs` fixture
(tests/launcher/conftest.py) always runs `omni-dp down` and then SIGKILLs, by pid, whatever still
carries the run's token. Request counts are bounded; every wait has a deadline.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from omni_dp.launcher.processes.ours import signal_ours
from omni_dp.procs import ProcessIdentity, identify

from support.http_client import get, is_wav, speech
from support.launcher import (
    RESTART_TIMEOUT_S,
    SUPERVISION,
    Run,
    alive,
    cpus_allowed,
    describe,
    environ,
    kill_replica,
    token_pids,
)
from support.ports import free_port_block, free_ports, port_listening
from support.wait import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def sleepers():
    """Unrelated long-running processes (no run token); killed by pid at teardown."""
    started: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_DP_")}
        proc = subprocess.Popen(["sleep", "300"], env=env, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


# --- helpers ----------------------------------------------------------------------------------


def cpu_set(cpus: str) -> set[int]:
    out: set[int] = set()
    for part in cpus.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def replica_status(run: Run, index: int) -> dict:
    return run.status()["replicas"][index]


def assert_nothing_left(run: Run) -> None:
    """No process of the run, no recorded process alive, no port taken, no state dir."""
    assert run.token, "the run token was never read"
    assert token_pids(run.token) == [], "processes still carry the run token"
    left = run.leftover_pids()
    assert left == [], [(p, psutil.Process(p).cmdline(), os.getsid(p)) for p in left]
    assert run.recorded_alive() == [], "recorded processes are still running"
    wait_for("the run's ports to close", lambda: not run.listening_ports(), timeout=5)
    assert not run.run_dir.exists(), f"{run.run_dir} is still there"


def events_of(run: Run, index: int, since: float = 0.0) -> list[str]:
    """Names of the events about one replica, in order (kv_checked: only a check of it alone)."""
    names = []
    for e in run.events():
        if e["ts"] < since:
            continue
        if e.get("replica") == index or (e["event"] == "kv_checked"
                                         and set(e["tokens"]) == {str(index)}):
            names.append(e["event"])
    return names


def event_count(run: Run, name: str, index: int) -> int:
    return sum(1 for e in run.events() if e["event"] == name and e.get("replica") == index)


class Load:
    """A bounded client: `concurrency` threads POSTing speech through the router, each pausing
    between requests, until stop(), max_requests sent or max_seconds passed."""

    def __init__(self, url: str, *, max_requests: int = 60, max_seconds: float = 20.0,
                 concurrency: int = 2, pause: float = 0.4) -> None:
        self.url = url
        self.max_requests = max_requests
        self.pause = pause
        self.deadline = time.monotonic() + max_seconds
        self.results: list[dict] = []
        self._sent = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, daemon=True)
                         for _ in range(concurrency)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    @property
    def finished(self) -> bool:
        return self._stop.is_set() or time.monotonic() >= self.deadline or \
            self._sent >= self.max_requests

    def _work(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                if self._sent >= self.max_requests or time.monotonic() >= self.deadline:
                    return
                self._sent += 1
            start = time.time()
            status, headers, body = speech(self.url, timeout=15)
            result = {"start": start, "end": time.time(), "status": status,
                      "replica": headers.get("X-Omni-DP-Replica"),
                      "ok": status == 200 and is_wav(body)}
            with self._lock:
                self.results.append(result)
            self._stop.wait(self.pause)

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self.results)

    def successes(self, after: float = 0.0, replica: str | None = None) -> int:
        return sum(1 for r in self.snapshot() if r["ok"] and r["start"] >= after
                   and (replica is None or r["replica"] == replica))


# --- 1. the whole life of a detached run -------------------------------------------------------


def test_detached_launch_status_requests_and_down(runs):
    run = runs(2)
    result = run.launch()
    assert "detached: supervisor pid" in result.stdout
    # The summary is a block of its own (no `omni-dp: ` line before it), and the last line is
    # the one a script waits for.
    lines = result.stdout.splitlines()
    assert "omni-dp: " not in lines and "omni-dp:" not in lines, result.stdout
    assert f"endpoint   {run.router_url}" in lines, result.stdout
    assert lines[-1] == (f"omni-dp: ready: 2 replicas verified behind {run.router_url} "
                         f"(run {run.run_id}; checked: health, equal KV)"), result.stdout

    status = run.status()  # a separate process: "another shell"
    assert status["run_id"] == run.run_id
    assert status["state"] == "running"
    assert status["supervisor"]["alive"] is True
    assert status["router"]["ready"] is True
    assert status["router"]["url"] == run.router_url
    replicas = status["replicas"]
    assert [r["index"] for r in replicas] == [0, 1]
    assert [r["health"] for r in replicas] == ["healthy", "healthy"]
    assert [r["kv_tokens"] for r in replicas] == [1024, 1024]
    assert [r["port"] for r in replicas] == [run.base_port, run.base_port + 1]
    blocks = [cpu_set(r["cpus"]) for r in replicas]
    assert all(blocks) and not blocks[0] & blocks[1], f"cpu blocks overlap: {blocks}"
    assert all(r["restarts"] == 0 and r["last_error"] is None for r in replicas)

    # One request through the router: a WAV.
    code, headers, body = speech(run.router_url)
    assert code == 200, body[:500]
    assert is_wav(body), body[:64]
    assert headers.get("Content-Type", "").startswith("audio/")
    # A few more: the router spreads them over both replicas.
    served = [headers.get("X-Omni-DP-Replica")]
    for _ in range(5):
        code, headers, body = speech(run.router_url)
        assert code == 200 and is_wav(body)
        served.append(headers.get("X-Omni-DP-Replica"))
    assert set(served) == {"0", "1"}, served

    # Each replica process: pinned to its block, carrying the run's identity.
    token = run.token
    assert token and len(token) >= 16
    data = run.run_json()
    for r in replicas:
        pid = r["pid"]
        assert cpu_set(cpus_allowed(pid)) == cpu_set(r["cpus"])
        env = environ(pid)
        assert env is not None
        assert env.get("OMNI_DP_RUN_ID") == run.run_id
        assert env.get("OMNI_DP_REPLICA") == str(r["index"])
        assert env.get("OMNI_DP_RUN_TOKEN") == token
        assert env.get("OMP_NUM_THREADS") == str(len(cpu_set(r["cpus"])))
        assert os.getpgid(pid) == pid  # a process group (session) of its own
    # Every process carrying the token is one the run recorded.
    expected = {data["supervisor"]["pid"], data["router"]["pid"],
                *(r["pid"] for r in data["replicas"]),
                *(p["pid"] for r in data["replicas"] for p in r["processes"])}
    assert set(token_pids(token)) == expected

    # The state: a private directory with run.json (0600) and events.jsonl.
    assert mode(run.run_dir) == 0o700
    assert mode(run.run_dir / "logs") == 0o700
    assert mode(run.run_dir / "run.json") == 0o600
    assert mode(run.run_dir / "run_token") == 0o600
    assert (run.run_dir / "events.jsonl").is_file()
    names = [e["event"] for e in run.events()]
    for name in ("run_created", "replica_started", "replica_healthy", "kv_checked",
                 "router_ready", "run_ready", "supervisor_started"):
        assert name in names
    assert data["state"] == "running"

    started = time.monotonic()
    down = run.down()
    assert down.returncode == 0, describe(down)
    assert "nothing left behind" in down.stdout
    assert time.monotonic() - started < 30
    assert_nothing_left(run)

    # `down` of a run whose state is gone is documented as "nothing to stop": success.
    again = run.down()
    assert again.returncode == 0, describe(again)
    assert "nothing to stop" in again.stdout
    again = run.down("--json")
    assert again.returncode == 0, describe(again)
    assert json.loads(again.stdout) == {"run_id": run.run_id, "clean": True, "removed": False,
                                        "leftovers": []}
    assert not run.run_dir.exists()


# --- 2. one supervised run: a hung replica, a killed one, a spent budget, a dead router ----------
# One launch for the supervision checks, in an order where each leaves the run as the next needs
# it: the hung replica (1) is restarted while replica 0 serves; the killed replica (0) is
# restarted under traffic; killed again, past its budget of one restart, it stays failed and out
# of the router; the dead router is restarted and serves through replica 1; `down` then leaves
# nothing behind.


def test_supervision_restarts_a_hung_and_a_killed_replica_then_gives_up_and_restarts_the_router(
        runs):
    run = runs(2)
    run.launch("--restart-budget", "1", "--restart-window", "600",
               "--restart-after-failures", "2", *SUPERVISION)
    assert [r["health"] for r in run.status()["replicas"]] == ["healthy", "healthy"]
    _check_a_hung_replica_is_restarted_after_consecutive_failed_health_checks(run, 1)
    _check_a_killed_replica_is_restarted_while_traffic_continues(run, 0, other=1)
    failed_at = _check_past_the_restart_budget_the_replica_is_failed_and_out_of_the_router(
        run, 0, other=1)
    _check_a_dead_router_is_restarted_and_serves_again(run)
    # The failed replica stayed failed through all that (and at least 3 sweeps): the supervisor
    # does not try again.
    time.sleep(max(0.0, failed_at + 1.5 - time.monotonic()))
    assert replica_status(run, 0)["state"] == "failed"
    assert event_count(run, "replica_started", 0) == 2  # bring-up and the one restart

    down = run.down()
    assert down.returncode == 0, describe(down)
    assert_nothing_left(run)


def _check_a_hung_replica_is_restarted_after_consecutive_failed_health_checks(
        run: Run, index: int) -> None:
    hung = run.run_json()["replicas"][index]["pid"]
    os.kill(hung, signal.SIGSTOP)  # alive, but answers nothing
    try:
        wait_for("the hung replica's restart", lambda: event_count(
            run, "restart_completed", index) == 1, timeout=RESTART_TIMEOUT_S + 10)
    finally:
        if alive(hung):
            os.kill(hung, signal.SIGCONT)
    [started] = [e for e in run.events() if e["event"] == "restart_started"]
    assert started["replica"] == index, started
    assert "/health" in started["reason"] and "2 in a row" in started["reason"]
    assert not alive(hung)  # SIGTERM cannot reach a stopped process; SIGKILL after the bound
    r = replica_status(run, index)
    assert r["health"] == "healthy" and r["pid"] != hung and r["restarts"] == 1


def _check_a_killed_replica_is_restarted_while_traffic_continues(run: Run, index: int,
                                                                  other: int) -> None:
    name, other_name = str(index), str(other)
    old = replica_status(run, index)
    assert old["health"] == "healthy" and old["restarts"] == 0
    other_restarts = replica_status(run, other)["restarts"]

    with Load(run.router_url, max_requests=60, max_seconds=20, concurrency=2) as load:
        wait_for("traffic before the kill", lambda: load.successes() >= 4, timeout=10)
        killed_at = time.time()
        kill_replica(run, index)

        def restarted():
            r = replica_status(run, index)
            ok = r["pid"] != old["pid"] and r["restarts"] == 1 and r["health"] == "healthy"
            return r if ok else None

        wait_for(f"replica {index} to be restarted and healthy", restarted,
                 timeout=RESTART_TIMEOUT_S, interval=0.3)
        wait_for("restart_completed", lambda: event_count(run, "restart_completed", index),
                 timeout=RESTART_TIMEOUT_S)
        completed_at = time.time()
        new = replica_status(run, index)
        # Back in the router: the replica serves again (or the bounded load runs out).
        wait_for(f"replica {index} to serve again",
                 lambda: load.successes(after=completed_at, replica=name) or load.finished,
                 timeout=20)
    results = load.snapshot()
    print(f"{len(results)} requests, {sum(r['ok'] for r in results)} ok; replica {index} back "
          f"after {completed_at - killed_at:.1f} s")

    assert new["pid"] != old["pid"] and new["restarts"] == 1
    assert new["kv_tokens"] == 1024 and new["state"] == "healthy" and new["alive"] is True
    assert new["last_error"] is None  # resolved by the restart; why is in the events:
    assert [e["reason"] for e in run.events() if e["event"] == "restart_started"
            and e["replica"] == index] == [
        "its process is gone"]  # not the supervisor's child: its exit status is unknown
    assert cpu_set(cpus_allowed(new["pid"])) == cpu_set(old["cpus"])
    assert environ(new["pid"])["OMNI_DP_RUN_TOKEN"] == run.token
    assert len(results) <= 60
    ok = sum(r["ok"] for r in results)
    assert ok >= 0.9 * len(results), [(r["status"], r["replica"]) for r in results]
    # Requests kept succeeding while the replica was down and out of the router (the other).
    enabled_at = next(e["ts"] for e in run.events()
                      if e["event"] == "router_enabled" and e["replica"] == index)
    assert killed_at < enabled_at <= completed_at
    during = [r for r in results if r["ok"] and killed_at < r["start"] and r["end"] < enabled_at]
    assert len(during) >= 2, "requests did not keep succeeding during the outage"
    assert {r["replica"] for r in during} == {other_name}
    assert load.successes(after=completed_at, replica=name) >= 1, \
        f"replica {index} never served again after it was back in the router"

    assert events_of(run, index, since=killed_at - 0.05) == [
        "router_disabled", "restart_started", "replica_started", "replica_healthy",
        "replica_processes", "kv_checked", "router_enabled", "restart_completed"]
    disabled = [e for e in run.events() if e["event"] in ("router_disabled", "router_enabled")]
    assert all(e["status"] == 200 for e in disabled), disabled
    assert replica_status(run, other)["restarts"] == other_restarts  # the other one: untouched


def _check_past_the_restart_budget_the_replica_is_failed_and_out_of_the_router(
        run: Run, index: int, other: int) -> float:
    """`index` has had its one restart (--restart-budget 1): killed again, it stays failed.
    Returns when it was seen failed (time.monotonic())."""
    assert event_count(run, "restart_completed", index) == 1
    kill_replica(run, index)

    def failed():
        r = replica_status(run, index)
        return r if r["state"] == "failed" else None

    r = wait_for(f"replica {index} to be marked failed", failed, timeout=RESTART_TIMEOUT_S)
    failed_at = time.monotonic()
    assert "budget" in r["last_error"], r
    assert r["health"] == "down" and r["alive"] is False
    assert r["restarts"] == 1
    assert event_count(run, "replica_failed", index) == 1
    assert event_count(run, "restart_started", index) == 1  # no second attempt

    code, _, body = get(run.router_url + "/workers", timeout=30)
    assert code == 200, body
    workers = {w["id"]: w for w in json.loads(body)["workers"]}
    assert workers[str(index)]["disabled"] is True, workers
    assert workers[str(other)]["disabled"] is False, workers

    status = run.status()
    assert status["state"] == "degraded"
    assert status["replicas"][other]["health"] == "healthy"
    assert run.cli("status", run.run_id).returncode == 1  # not every replica healthy
    for _ in range(4):
        code, headers, body = speech(run.router_url)
        assert code == 200 and is_wav(body)
        assert headers.get("X-Omni-DP-Replica") == str(other)
    return failed_at


def _check_a_dead_router_is_restarted_and_serves_again(run: Run) -> None:
    old = run.run_json()["router"]["pid"]
    os.kill(old, signal.SIGKILL)
    wait_for("a new router", lambda: (r := run.run_json()["router"]) and r["pid"] != old
             and any(e["event"] == "router_ready" and e["pid"] == r["pid"]
                     for e in run.events()), timeout=RESTART_TIMEOUT_S)
    assert [e["event"] for e in run.events()].count("router_died") == 1
    code, _, body = speech(run.router_url)
    assert code == 200 and is_wav(body)
    assert run.status()["router"]["ready"] is True


# --- 3. list and logs; then, the supervisor SIGKILLed, `down` never signals a recycled pid ------
# One run: `list` and `logs` read it; then its supervisor is SIGKILLed (`status` says so) and
# unrelated processes take the recorded pids of a replica, the router and the supervisor, which
# `down` must not signal while still stopping the run's real processes.


def test_list_logs_then_down_after_a_sigkilled_supervisor_never_signals_a_recycled_pid(
        runs, sleepers):
    run = runs(2)
    launched = run.launch("--json", "--api-key", "e2e-key")
    _check_list_and_logs(run, launched)

    # The supervisor SIGKILLed: the run is unsupervised, and `down` still stops it all.
    status = run.status()
    supervisor = status["supervisor"]["pid"]
    assert status["supervisor"]["alive"] and status["supervisor"]["detached"]
    assert environ(supervisor)["OMNI_DP_RUN_TOKEN"] == run.token
    data = run.run_json()
    assert data["supervisor"]["pid"] == supervisor
    os.kill(supervisor, signal.SIGKILL)  # so it does not rewrite run.json
    wait_for("the supervisor to die", lambda: not alive(supervisor), timeout=10)
    after = run.status()
    assert after["supervisor"]["alive"] is False
    assert after["state"] == "unsupervised"  # live replicas, nobody watching them
    real = {"replica 0": data["replicas"][0]["pid"], "router": data["router"]["pid"]}

    # Unrelated processes now hold the recorded pids (as a recycled pid would); the recorded
    # create times stay, so they do not match.
    strangers = {"replica 0": sleepers(), "router": sleepers(), "supervisor": sleepers()}
    data = run.run_json()
    for record, stranger in ((data["replicas"][0], strangers["replica 0"]),
                             (data["router"], strangers["router"]),
                             (data["supervisor"], strangers["supervisor"])):
        assert identify(stranger.pid).create_time != record["create_time"]
        record["pid"] = stranger.pid
        if "pgid" in record:
            record["pgid"] = stranger.pid
    run.write_run_json(data)

    down = run.down()
    assert down.returncode == 0, describe(down)
    for name, stranger in strangers.items():
        assert stranger.poll() is None, f"down signalled the process at the {name}'s pid"
    # The run's real processes, no longer recorded, were found by their token and stopped.
    for name, pid in real.items():
        assert not alive(pid), f"the real {name} (pid {pid}) survived"
    assert_nothing_left(run)
    listed = run.cli("list")
    assert run.run_id not in listed.stdout


def _check_list_and_logs(run: Run, launched: subprocess.CompletedProcess) -> None:
    # --detach --json: stdout is one JSON object, the summary; what launch said is on stderr
    summary = json.loads(launched.stdout)
    assert summary["run_id"] == run.run_id and summary["endpoint"] == run.router_url
    assert [r["health"] for r in summary["replicas"]] == ["healthy", "healthy"]
    assert summary["checks"] == ["health", "equal KV"]
    assert "e2e-key" not in launched.stdout + launched.stderr  # named, never printed
    assert f"ports {run.base_port}-{run.base_port + 1}" in summary["replicas_unauthenticated"]
    assert launched.stderr.splitlines()[-1] == f"omni-dp: {summary['ready']}", launched.stderr

    listed = run.cli("list")
    assert listed.returncode == 0, describe(listed)
    line = next(x for x in listed.stdout.splitlines() if x.startswith(run.run_id))
    assert "running" in line and "2 replica(s)" in line and run.router_url in line
    listed = run.cli("list", "--json")
    rows = {r["run_id"]: r for r in json.loads(listed.stdout)["runs"]}
    assert rows[run.run_id]["state"] == "running"
    assert rows[run.run_id]["replicas"] == 2

    port0, port1 = run.base_port, run.base_port + 1
    logs = run.cli("logs", run.run_id, "--replica", "0")
    assert logs.returncode == 0, describe(logs)
    assert "starting replica 0" in logs.stdout
    assert f":{port0}" in logs.stdout, logs.stdout
    assert "starting replica 1" not in logs.stdout and f":{port1}" not in logs.stdout
    every = run.cli("logs", run.run_id)
    assert every.returncode == 0, describe(every)
    assert "[replica_0]" in every.stdout and "[replica_1]" in every.stdout
    assert "[router]" in every.stdout
    missing = run.cli("logs", run.run_id, "--replica", "7")
    assert missing.returncode == 2 and "replica_7.log" in missing.stderr


def test_signal_ours_skips_a_process_whose_create_time_differs(sleepers):
    proc = sleepers()
    me = identify(proc.pid)
    assert me is not None
    wrong = ProcessIdentity(proc.pid, me.create_time - 1000.0)
    assert signal_ours(wrong, signal.SIGKILL) is False
    assert signal_ours(wrong, signal.SIGKILL, "0" * 32, group=True) is False  # not its token
    time.sleep(0.2)
    assert proc.poll() is None and psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE
    # The right identity is signalled (so the check above is not vacuous).
    assert signal_ours(me, signal.SIGKILL) is True
    assert proc.wait(10) == -signal.SIGKILL


# --- 5. a foreground launch stops cleanly on SIGTERM ----------------------------------------------


def test_foreground_launch_tears_down_on_sigterm(runs):
    run = runs(1)  # one replica: stopping several is the same teardown (test 1, test 2)
    drain = 5.0
    proc = run.launch_foreground("--drain-timeout", str(drain), "--check-interval", "0.5")

    def supervising():
        if proc.poll() is not None:
            raise AssertionError(f"launch exited {proc.returncode}:\n{run.output()}")
        # The line, and the supervisor's own signal handlers installed (supervisor_started).
        return "supervising in the foreground" in run.output() and any(
            e["event"] == "supervisor_started" for e in run.events())

    wait_for("the foreground supervisor", supervising, timeout=90)
    assert run.status()["state"] == "running"
    assert run.status()["supervisor"]["detached"] is False

    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=drain + 40)
    elapsed = time.monotonic() - started
    assert code == 0, run.output()
    assert elapsed < drain + 15, f"teardown took {elapsed:.1f} s"
    assert "nothing left behind" in run.output()
    assert_nothing_left(run)


# A SIGTERM that lands after bring-up but before the foreground supervisor installed its handlers
# (the window is real but a few ms wide; the script below lands one there deterministically).
_SIGTERM_IN_THE_WINDOW = """
import os, signal, sys
from omni_dp import cli
from omni_dp.launcher import launch

class SignalledSupervisor(launch.Supervisor):
    def __init__(self, state, *args, **kwargs):
        print("RUN-TOKEN", state.token, flush=True)  # the state dir is gone afterwards
        os.kill(os.getpid(), signal.SIGTERM)
        args = (state, *args)
        super().__init__(*args, **kwargs)

launch.Supervisor = SignalledSupervisor
sys.argv = ["omni-dp", *sys.argv[1:]]
cli.main()
"""


def test_foreground_sigterm_right_after_bringup_still_tears_down(runs):
    run = runs(1)  # one replica: stopping several is the same teardown (test 1, test 2)
    result = subprocess.run(
        [sys.executable, "-c", _SIGTERM_IN_THE_WINDOW,
         *run.launch_argv("--drain-timeout", "5", detach=False)],
        env=run.env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    run.recorded()  # learn the token and pids while the state is there
    tokens = [line.split()[1] for line in result.stdout.splitlines()
              if line.startswith("RUN-TOKEN ")]
    assert len(tokens) == 1, describe(result)
    run._token = tokens[0]
    assert "supervising in the foreground" in result.stdout, describe(result)
    assert run.leftover_pids() == [], "the run's processes were orphaned"
    assert result.returncode in (0, 130), describe(result)
    assert_nothing_left(run)


# --- 7. a failed bring-up keeps the state for diagnosis, and nothing else ----------------------


def test_failed_bringup_exits_3_and_keeps_only_the_state_private(runs):
    run = runs(2)
    result = run.launch("--start-timeout", "0.05", "--json", check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 3, describe(result)
    assert "FAILED" in output
    # nothing claims the run: no summary JSON on stdout, no summary, no ready line
    assert result.stdout == "", describe(result)
    assert "ready: " not in output and "endpoint   " not in output, output
    assert str(run.run_dir) in output
    assert f"omni-dp down {run.run_id}" in output

    assert run.run_dir.is_dir()
    data = run.run_json()
    assert data["state"] == "failed"
    assert any(e["event"] == "bringup_failed" for e in run.events())
    assert run.token and token_pids(run.token) == []
    assert run.leftover_pids() == []
    assert run.recorded_alive() == []
    assert not run.listening_ports()
    assert run.status()["state"] == "failed"

    # Every file of the state kept is private, whatever the umask.
    old_umask = os.umask(0)
    os.umask(old_umask)
    assert old_umask & 0o077 != 0o077, "the test needs a umask that leaves files readable"
    files = [p for p in run.run_dir.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"run.json", "run_token", "events.jsonl",
                                       "replica_0.log"}
    modes = {str(p.relative_to(run.run_dir)): oct(mode(p)) for p in files}
    assert all(m == oct(0o600) for m in modes.values()), modes

    down = run.down()
    assert down.returncode == 0, describe(down)
    assert not run.run_dir.exists()


# --- the helpers themselves --------------------------------------------------------------------


def test_port_helpers():
    ports = free_ports(3)
    assert len(set(ports)) == 3
    base = free_port_block(4)
    assert not any(port_listening(p) for p in range(base, base + 4))


# --- sequential start; removing the run directory ----------------------------------------------


def test_sequential_start_waits_for_each_replica_and_removing_the_run_directory_tears_it_down(
        runs):
    run = runs(2)
    run.launch("--start", "sequential", *SUPERVISION)
    names = [(e["event"], e.get("replica")) for e in run.events()]
    assert names.index(("replica_healthy", 0)) < names.index(("replica_started", 1))
    assert run.run_json()["plan"]["start"] == "sequential"

    # The run directory removed: the supervisor tears the run down.
    recorded = run.recorded()  # token and pids, read before the directory goes
    assert run.token and len(recorded) >= 4  # launcher, supervisor, router, replicas
    shutil.rmtree(run.run_dir)
    wait_for("every process of the run to stop", lambda: not run.leftover_pids(), timeout=60)
    assert run.recorded_alive() == []
    wait_for("the run's ports to close", lambda: not run.listening_ports(), timeout=5)
    assert not run.run_dir.exists()  # not recreated


_SLOW_GATES = """
import sys, time
from omni_dp import cli
from omni_dp.launcher.bringup import replicas

def wait_healthy(self, index, timeout_s):  # bring-up stalls here, replicas running
    time.sleep(120)

replicas.ReplicaControl.wait_healthy = wait_healthy
sys.argv = ["omni-dp", *sys.argv[1:]]
cli.main()
"""


def test_down_during_bring_up_stops_the_launch_and_everything_it_started(runs):
    run = runs(2)
    launcher = subprocess.Popen(
        [sys.executable, "-c", _SLOW_GATES, *run.launch_argv(detach=False)], env=run.env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    try:
        # run.json, not the directory: it is made first, the record written just after
        wait_for("both replicas to start", lambda: (run.run_dir / "run.json").exists() and all(
            r["pid"] for r in run.run_json()["replicas"]), timeout=60)
        replica_pids = [r["pid"] for r in run.run_json()["replicas"]]
        assert run.run_json()["launcher"]["pid"] == launcher.pid
        down = run.down()
        assert down.returncode == 0, describe(down)
        assert f"stopping the launcher (pid {launcher.pid})" in down.stdout
        out, _ = launcher.communicate(timeout=60)
        assert launcher.returncode == 130, out
        assert "bring-up interrupted" in out
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
    assert not any(alive(pid) for pid in replica_pids)
    assert_nothing_left(run)


