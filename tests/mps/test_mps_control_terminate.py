"""`terminate_client <server PID> <client PID>`: the command, its replies, and the teardown's
use of it (replica_groups.mps_terminator) before any SIGKILL of an MPS client.

The scripted front end stands in for a server with clients (none can start without a GPU); the
real control daemon proves it knows the command and its arity.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from omni_dp.launcher.processes.groups import mps_terminator
from omni_dp.launcher.record.state import RunState
from omni_dp.mps.control import CommandRejected, MalformedOutput, MpsControl
from omni_dp.mps.daemon import DaemonRecord, MpsDaemon
from omni_dp.procs import ProcessIdentity, identify, is_alive

from support.mps import daemons_under, real_control_binary
from support.plans import gpu_run_record, gpus_json, stored_state, two_replica_plan


def control_for(standin, tmp_path) -> MpsControl:
    return MpsControl(str(standin.binary), str(tmp_path / "pipe"), str(tmp_path / "log"),
                      timeout_s=5)


@pytest.mark.parametrize("reply", ["", "0"])
def test_terminate_client_names_the_server_then_the_client(standin, tmp_path, reply) -> None:
    standin.set({"terminate_client 101 202": reply})
    control_for(standin, tmp_path).terminate_client(101, 202)
    assert standin.commands() == ["terminate_client 101 202"]


@pytest.mark.parametrize(("reply", "error"), [
    ("Server 101 not found\nServer 101 not found!\n1", CommandRejected),  # the real daemon's
    ("Invalid process 202!\n1", CommandRejected),
    ("1", CommandRejected),
    ("terminated, maybe", MalformedOutput),
])
def test_terminate_client_failures_are_errors(standin, tmp_path, reply, error) -> None:
    standin.set({"terminate_client 101 202": reply})
    with pytest.raises(error):
        control_for(standin, tmp_path).terminate_client(101, 202)


# --- mps_terminator ------------------------------------------------------------------------------


@pytest.fixture
def run_state(tmp_path) -> RunState:
    return RunState.create(two_replica_plan(tmp_path))


def with_daemon(state: RunState, binary: str, pipe_dir: str, log_dir: str,
                identity: ProcessIdentity | None = None) -> None:
    """Record an MPS daemon for the run; its identity must be alive (default: this process,
    standing in for a daemon the scripted front end has none of)."""
    identity = identity or identify(os.getpid())
    state.set_daemon(DaemonRecord(identity, binary, pipe_dir, log_dir, None))


def terminated_events(state: RunState) -> list[dict]:
    return [e for e in state.events() if e["event"] == "mps_clients_terminated"]


def test_survivors_that_are_clients_have_their_work_terminated(standin, tmp_path, run_state,
                                                               spawn) -> None:
    """Only survivors the server lists are named; the event says which went."""
    goes, stays, not_a_client = spawn(), spawn(), spawn()
    standin.set({"get_server_list": "101", "get_client_list 101": f"{goes}\n{stays}\n4242",
                 f"terminate_client 101 {goes}": "", f"terminate_client 101 {stays}": ""})
    with_daemon(run_state, str(standin.binary), str(tmp_path / "pipe"), str(tmp_path / "log"))

    def kill_goes_once_asked() -> None:  # the server's part: the client's work fails, it exits
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if f"terminate_client 101 {goes}" in standin.commands():
                os.kill(goes, signal.SIGKILL)
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=kill_goes_once_asked, daemon=True)
    watcher.start()
    survivors = [identify(pid) for pid in (goes, stays, not_a_client)]
    mps_terminator(run_state, wait_s=1.0)(survivors)
    watcher.join(10)

    assert f"terminate_client 101 {not_a_client}" not in standin.commands()
    [event] = terminated_events(run_state)
    assert event["server"] == 101 and event["pids"] == [goes, stays]
    assert event["clients"] == [{"pid": goes, "went": True, "error": None},
                                {"pid": stays, "went": False, "error": None}]
    assert is_alive(survivors[1]) and is_alive(survivors[2])


def test_control_errors_are_recorded_never_raised(standin, tmp_path, run_state, spawn) -> None:
    client = spawn()
    with_daemon(run_state, str(standin.binary), str(tmp_path / "pipe"), str(tmp_path / "log"))
    standin.set({"get_server_list": "101", "get_client_list 101": str(client),
                 f"terminate_client 101 {client}": f"Invalid process {client}!\n1"})
    terminate = mps_terminator(run_state, wait_s=0.2)
    terminate([identify(client)])
    standin.set(unreachable=True)
    terminate([identify(client)])

    rejected, unreachable = terminated_events(run_state)
    assert rejected["clients"][0]["went"] is False
    assert f"Invalid process {client}!" in rejected["clients"][0]["error"]
    assert unreachable["server"] is None
    assert "Cannot find MPS control daemon" in unreachable["error"]


def test_without_a_daemon_it_does_nothing(standin, tmp_path, run_state, spawn) -> None:
    client = identify(spawn())
    mps_terminator(run_state)([client])  # no daemon recorded
    gone = ProcessIdentity(os.getpid(), 0.0)  # this pid, another create time: not running
    with_daemon(run_state, str(standin.binary), str(tmp_path / "pipe"), str(tmp_path / "log"),
                gone)
    mps_terminator(run_state)([client])  # recorded, but no longer running
    assert standin.commands() == [] and terminated_events(run_state) == []


def gpu_front_end(standin, directory: Path, replies: dict) -> tuple[str, Path]:
    """A front end of its own for one GPU's daemon: the stand-in, reading its own scenario;
    (its binary, the log of the commands it received)."""
    directory.mkdir()
    scenario, log = directory / "scenario.json", directory / "commands.log"
    scenario.write_text(json.dumps({"replies": replies, "log": str(log)}))
    binary = directory / "nvidia-cuda-mps-control"
    binary.write_text(f"#!/bin/sh\nMPS_STANDIN_SCENARIO='{scenario}' exec '{standin.binary}' "
                      '"$@"\n')
    binary.chmod(0o755)
    return str(binary), log


def commands(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_over_two_gpus_each_survivor_is_terminated_through_its_own_gpus_daemon(
        standin, tmp_path, spawn) -> None:
    """GPU 0's server (101) serves one survivor, GPU 1's (202) another: each daemon is told to
    terminate only its own client; the third, nobody's client, is named to neither. Stopping
    GPU 1's replicas alone leaves GPU 0's daemon unasked."""
    on0, on1, nobodys = spawn(), spawn(), spawn()
    front = [gpu_front_end(standin, tmp_path / f"gpu{k}", {
        "get_server_list": str(server), f"get_client_list {server}": str(client),
        f"terminate_client {server} {client}": ""}) for k, (server, client)
        in enumerate([(101, on0), (202, on1)])]
    me = identify(os.getpid())  # alive: stands in for each daemon's process
    daemons = [{**me.to_json(), "binary": binary, "pipe_dir": str(tmp_path / f"gpu{k}" / "p"),
                "log_dir": str(tmp_path / f"gpu{k}" / "l"), "gpu_uuid": None,
                "server_binary": None, "gpu": k} for k, (binary, _) in enumerate(front)]
    state = stored_state(tmp_path / "run", gpu_run_record(
        "run-gpus", [{"index": i, "gpu": i // 2} for i in range(4)], gpus_json(2), daemons))
    survivors = [identify(pid) for pid in (on0, on1, nobodys)]

    mps_terminator(state, wait_s=0.2)(survivors)
    (_, log0), (_, log1) = front
    assert [c for c in commands(log0) if c.startswith("terminate")] == [
        f"terminate_client 101 {on0}"]
    assert [c for c in commands(log1) if c.startswith("terminate")] == [
        f"terminate_client 202 {on1}"]
    assert [(e["gpu"], e["server"], e["pids"]) for e in terminated_events(state)] == [
        (0, 101, [on0]), (1, 202, [on1])]

    log0.unlink()
    mps_terminator(state, wait_s=0.2, gpus={1})(survivors)  # GPU 1's replicas stopping
    assert commands(log0) == []
    assert f"terminate_client 202 {on1}" in commands(log1)


# --- the real control daemon ------------------------------------------------------------------


def test_the_real_daemon_knows_terminate_client(run_state, spawn) -> None:
    """Without a GPU no server runs, so the daemon answers "Server N not found" — not
    "Unknown command": the name and the two arguments are what it expects. Its empty server
    list leaves the terminator nothing to do."""
    binary = real_control_binary()
    root = Path(tempfile.mkdtemp(prefix="odp", dir="/tmp"))  # the socket path must be short
    control = MpsControl(binary, str(root / "pipe"), str(root / "log"), timeout_s=5)
    daemon = MpsDaemon(control)
    record = None
    try:
        record = daemon.start(gpu_uuid=None)
        with pytest.raises(CommandRejected, match="Server 1 not found"):
            control.terminate_client(1, 2)
        run_state.set_daemon(record)
        mps_terminator(run_state)([identify(spawn())])
        assert terminated_events(run_state) == []
        assert daemon.stop(record)
    finally:
        if record is not None and is_alive(record.identity):
            os.kill(record.identity.pid, signal.SIGKILL)  # ours: pid + create time recorded
        # The root conftest's guard only looks under tmp_path: any daemon on this pipe dir is
        # this test's, and is stopped, and fails the test (one was once left running in CI).
        _, leaked = psutil.wait_procs(daemons_under(root), timeout=3)
        for process in leaked:
            process.kill()
        shutil.rmtree(root, ignore_errors=True)
        assert not leaked, f"MPS control daemon(s) {[p.pid for p in leaked]} left running"
