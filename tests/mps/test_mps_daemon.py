"""The private daemon's lifecycle against the REAL nvidia-cuda-mps-control (no GPU needed)."""

from __future__ import annotations

import dataclasses
import os
import resource
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from omni_dp.files import PrivateDirError, make_private_dir, private_dir_problem
from omni_dp.mps.control import DaemonUnreachable, MpsControl
from omni_dp.mps.daemon import (
    MIN_OPEN_FILES,
    DaemonLimits,
    DaemonRecord,
    MpsDaemon,
    MpsDaemonError,
    find_daemon_pid,
    raise_open_files,
)
from omni_dp.procs import ProcessIdentity, identify, is_alive

from support.mps import daemons_under, real_control_binary


@pytest.fixture
def daemons(tmp_path):
    """Make controls under a short private dir; every daemon started is stopped by its pid."""
    binary = real_control_binary()
    started: list[DaemonRecord] = []
    base = Path(os.environ.get("TMPDIR", "/tmp"))
    counter = iter(range(1000))

    def make(sub: str | None = None) -> tuple[MpsControl, MpsDaemon]:
        root = Path(tmp_path if sub is None else base) / (sub or f"d{next(counter)}")
        control = MpsControl(binary, str(root / "pipe"), str(root / "log"), timeout_s=5)
        daemon = MpsDaemon(control)
        original = daemon.start

        def tracked_start(**kwargs):
            record = original(**kwargs)
            started.append(record)
            return record

        daemon.start = tracked_start
        return control, daemon

    yield make
    for record in started:
        if is_alive(record.identity):
            os.kill(record.identity.pid, signal.SIGKILL)  # ours: pid + create time recorded


def test_start_prove_and_quit(daemons):
    control, daemon = daemons()
    record = daemon.start(gpu_uuid=None)
    assert is_alive(record.identity)
    env = psutil.Process(record.identity.pid).environ()
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == control.pipe_dir
    assert control.server_list() == []  # no GPU: no server can start
    for directory in (control.pipe_dir, control.log_dir):
        assert os.stat(directory).st_mode & 0o777 == 0o700
    assert daemon.health(record).ok
    daemon.stop(record)
    assert not is_alive(record.identity)
    with pytest.raises(DaemonUnreachable):
        control.server_list()


def test_limits_are_applied_and_read_back(daemons, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "10")  # inherited: must not apply
    control, daemon = daemons()
    record = daemon.start(gpu_uuid=None)
    assert control.default_thread_percentage() == 100.0
    daemon.stop(record)

    control, daemon = daemons()
    record = daemon.start(gpu_uuid=None, thread_percentage=40, memory_limit_bytes=3 * 1024**3)
    assert control.default_thread_percentage() == 40.0
    assert control.default_pinned_mem_limit() == 3 * 1024**3
    assert record.limits == DaemonLimits(40.0, 3 * 1024**3)
    daemon.stop(record)


_ECHOES_WHAT_WAS_ASKED = """#!/bin/bash
# TEST STAND-IN, written by tests/mps/test_mps_daemon.py: NVIDIA's real control daemon, except
# that its thread-percentage setter applies {applied}% and echoes the percentage asked for.
if [ "$#" -gt 0 ]; then exec -a "$0" '{real}' "$@"; fi
read -r command
case "$command" in
    "set_default_active_thread_percentage "*)
        echo "set_default_active_thread_percentage {applied}" | '{real}' >/dev/null || exit
        echo "${{command#set_default_active_thread_percentage }}" ;;
    *) echo "$command" | '{real}' ;;
esac
"""


def test_the_sm_cap_is_the_real_daemons_read_back_not_the_setters_echo(daemons, tmp_path):
    """Where the setter's echo says 40 % and the real daemon holds 20 %, the start fails and
    stops the daemon: a run must never record (and report "in force") a cap its daemon does
    not give its clients."""
    control, daemon = daemons()
    front = tmp_path / "nvidia-cuda-mps-control"
    front.write_text(_ECHOES_WHAT_WAS_ASKED.format(real=control.binary, applied=20))
    front.chmod(0o755)
    daemon.control = lying = dataclasses.replace(control, binary=str(front))
    with pytest.raises(MpsDaemonError, match="could not apply the MPS limits: asked for 40% "
                                             "threads, the daemon reports 20"):
        daemon.start(gpu_uuid=None, thread_percentage=40)
    assert find_daemon_pid(lying) is None and daemons_under(tmp_path) == []


def test_a_daemon_already_answering_is_never_adopted(daemons):
    control, daemon = daemons()
    first = daemon.start(gpu_uuid=None)
    with pytest.raises(MpsDaemonError, match="never adopts"):
        MpsDaemon(control).start(gpu_uuid=None)
    assert is_alive(first.identity)  # untouched
    daemon.stop(first)


def test_stale_sockets_after_sigkill_do_not_block_a_new_daemon(daemons):
    control, daemon = daemons()
    first = daemon.start(gpu_uuid=None)
    os.kill(first.identity.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while is_alive(first.identity) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (Path(control.pipe_dir) / "control").exists()  # the socket file stays behind
    assert not daemon.answers()
    second = daemon.start(gpu_uuid=None)
    assert second.identity != first.identity
    daemon.stop(second)


def test_too_long_socket_path_is_refused_before_starting(daemons, tmp_path):
    control, daemon = daemons()
    long_pipe = tmp_path / ("x" * 120) / "pipe"
    daemon.control = MpsControl(control.binary, str(long_pipe), control.log_dir)
    with pytest.raises(MpsDaemonError, match="limit of a Unix socket path"):
        daemon.start(gpu_uuid=None)
    assert not long_pipe.exists()  # refused before anything was created


@pytest.mark.parametrize("problem", ["symlink", "mode", "file", "owner"])
def test_unsafe_pipe_directory_is_refused(daemons, tmp_path, problem):
    control, daemon = daemons()
    pipe = Path(control.pipe_dir)
    pipe.parent.mkdir(parents=True, exist_ok=True)
    if problem == "symlink":
        target = tmp_path / "elsewhere"
        target.mkdir(mode=0o700)
        pipe.symlink_to(target)
    elif problem == "mode":
        pipe.mkdir(mode=0o755)
        os.chmod(pipe, 0o755)
    elif problem == "file":
        pipe.write_text("")
    else:
        if os.getuid() != 0:
            pytest.skip("only root can give a directory to another user")
        pipe.mkdir(mode=0o700)
        os.chown(pipe, 65534, 65534)
    with pytest.raises(MpsDaemonError, match={"symlink": "symlink", "mode": "755",
                                              "file": "not a directory",
                                              "owner": "not to you"}[problem]):
        daemon.start(gpu_uuid=None)
    assert find_daemon_pid(control) is None


def test_pipe_directory_of_another_user_is_refused_for_any_user(tmp_path, monkeypatch):
    """The owner check without root: the directory stays ours, and the uid we claim to run
    as is another one (the parametrized case above can only chown as root)."""
    pipe = tmp_path / "pipe"
    pipe.mkdir(mode=0o700)
    os.chmod(pipe, 0o700)
    assert private_dir_problem(pipe) is None  # private and ours: fine as it is
    owner = os.stat(pipe).st_uid
    monkeypatch.setattr(os, "getuid", lambda: owner + 1)
    problem = private_dir_problem(pipe)
    assert problem == f"{pipe} belongs to uid {owner}, not to you (uid {owner + 1})"
    with pytest.raises(PrivateDirError, match="not to you"):
        make_private_dir(pipe)


def test_stop_refuses_while_clients_are_attached(standin, spawn, tmp_path):
    # Clients cannot attach without a GPU: a scripted front end reports two, and a process
    # we started stands for the daemon.
    stand_for_daemon = identify(spawn())
    standin.set({"get_server_list": "900", "get_client_list 900": "11\n12"})
    control = MpsControl(str(standin.binary), str(tmp_path / "p"), str(tmp_path / "l"))
    record = DaemonRecord(stand_for_daemon, str(standin.binary), control.pipe_dir,
                          control.log_dir, None)
    with pytest.raises(MpsDaemonError, match="2 MPS client"):
        MpsDaemon(control).stop(record)
    assert "quit" not in standin.commands()


def test_stop_of_a_gone_daemon_is_a_no_op(standin, tmp_path):
    gone = ProcessIdentity(pid=2**22 + 7, create_time=1.0)
    control = MpsControl(str(standin.binary), str(tmp_path / "p"), str(tmp_path / "l"))
    MpsDaemon(control).stop(DaemonRecord(gone, control.binary, control.pipe_dir,
                                         control.log_dir, None))
    assert standin.commands() == []


def test_health_reports_faults_from_logs(daemons, tmp_path):
    _, daemon = daemons()
    record = daemon.start(gpu_uuid=None)
    replica_log = tmp_path / "replica_0.log"
    replica_log.write_text("ok\nRuntimeError: CUDA error: cudaErrorMpsRpcFailure\n")
    health = daemon.health(record, extra_logs=(str(replica_log),))
    assert health.alive and health.reachable
    assert not health.ok
    assert any("cudaErrorMpsRpcFailure" in fault for fault in health.faults)
    daemon.stop(record)
    assert not daemon.health(record).alive


def test_daemon_start_failure_is_reported(daemons, tmp_path):
    control, daemon = daemons()
    fake = tmp_path / "broken-control"
    fake.write_text("#!/bin/sh\necho 'cannot do that' >&2\nexit 3\n")
    fake.chmod(0o755)
    daemon.control = MpsControl(str(fake), control.pipe_dir, control.log_dir)
    with pytest.raises(MpsDaemonError, match="cannot do that"):
        daemon.start(gpu_uuid=None)


def test_the_daemon_may_open_enough_files_for_its_server(daemons):
    """Its server inherits the daemon's limits; a soft limit of 1024 (common) fails it. The
    daemon is started from a process with that limit: it inherits it."""
    _, daemon = daemons()
    ours = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, ours[0]), ours[1]))
    try:
        record = daemon.start(gpu_uuid=None)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, ours)
    soft, hard = resource.prlimit(record.identity.pid, resource.RLIMIT_NOFILE)
    wanted = MIN_OPEN_FILES if hard == resource.RLIM_INFINITY else min(MIN_OPEN_FILES, hard)
    assert soft == resource.RLIM_INFINITY or soft >= wanted
    daemon.stop(record)


def test_open_files_are_raised_to_the_floor_and_never_past_the_hard_limit():
    child = subprocess.Popen(["sleep", "60"])
    try:
        _, hard = resource.prlimit(child.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(child.pid, resource.RLIMIT_NOFILE, (256, hard))
        floor = 512 if hard == resource.RLIM_INFINITY else min(512, hard)
        assert raise_open_files(child.pid, wanted=512) == (floor, hard)
        assert resource.prlimit(child.pid, resource.RLIMIT_NOFILE) == (floor, hard)
        assert raise_open_files(child.pid, wanted=300) == (floor, hard)  # never lowered
        if hard != resource.RLIM_INFINITY:
            assert raise_open_files(child.pid, wanted=hard + 1) == (hard, hard)
    finally:
        child.kill()
        child.wait()
