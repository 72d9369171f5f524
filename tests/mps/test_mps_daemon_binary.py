"""Smoke test of NVIDIA's real MPS control daemon (Debian's non-free `nvidia-cuda-mps`).

`scripts/test` installs it with `scripts/install-mps-control` and exports OMNI_DP_MPS_CONTROL;
under CI it also exports OMNI_DP_REQUIRE_MPS=1, which turns a missing binary into a failure.
No GPU is needed: the control daemon starts and answers; only the MPS server needs libcuda.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import psutil
import pytest

NAME = "nvidia-cuda-mps-control"
TIMEOUT = 10.0


def _control_binary() -> str:
    configured = os.environ.get("OMNI_DP_MPS_CONTROL", "")
    path = configured or shutil.which(NAME)
    if path and os.path.isfile(path) and os.access(path, os.X_OK):
        return path
    if configured or os.environ.get("OMNI_DP_REQUIRE_MPS") == "1":
        pytest.fail(
            f"{NAME} is required but missing (OMNI_DP_MPS_CONTROL={configured!r}, "
            f"OMNI_DP_REQUIRE_MPS={os.environ.get('OMNI_DP_REQUIRE_MPS')!r}, "
            f"not on PATH either); run scripts/install-mps-control"
        )
    pytest.skip(
        f"{NAME} not found: set OMNI_DP_MPS_CONTROL (scripts/install-mps-control prints the "
        f"path; scripts/test does this) or put it on PATH"
    )


def _find_daemon(binary: str, pipe_dir: str) -> psutil.Process | None:
    """The control daemon for this pipe dir: its exe or argv[0] is `binary`, its environ holds
    exactly CUDA_MPS_PIPE_DIRECTORY=pipe_dir (there is no PID file)."""
    real = os.path.realpath(binary)
    for proc in psutil.process_iter():
        names = []
        for read in (proc.exe, lambda p=proc: p.cmdline()[0]):
            with contextlib.suppress(psutil.Error, IndexError, OSError):
                names.append(os.path.realpath(read()))
        if real not in names:
            continue
        try:
            if proc.environ().get("CUDA_MPS_PIPE_DIRECTORY") == pipe_dir:
                return proc
        except psutil.Error:
            continue
    return None


def _alive(proc: psutil.Process) -> bool:
    try:  # is_running() also checks the create time, so a reused pid is not "alive"
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_real_mps_control_daemon_starts_answers_and_quits(tmp_path: Path) -> None:
    binary = _control_binary()
    pipe_dir, log_dir = tmp_path / "pipe", tmp_path / "log"
    for folder in (pipe_dir, log_dir):
        folder.mkdir()
        folder.chmod(0o700)
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir),
           "CUDA_MPS_LOG_DIRECTORY": str(log_dir)}

    def control(command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([binary], input=command + "\n", env=env, capture_output=True,
                              text=True, timeout=TIMEOUT)

    def log() -> str:
        path = log_dir / "control.log"
        return path.read_text(errors="replace") if path.exists() else "(no control.log)"

    daemon: psutil.Process | None = None
    try:
        with open(tmp_path / "start.out", "w") as out:  # a file, not a pipe the daemon could hold
            started = subprocess.run([binary, "-d"], env=env, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, timeout=TIMEOUT)
        assert started.returncode == 0, (tmp_path / "start.out").read_text()

        deadline, reply = time.monotonic() + TIMEOUT, None
        while time.monotonic() < deadline:
            daemon = daemon or _find_daemon(binary, str(pipe_dir))
            reply = control("get_default_active_thread_percentage")
            if daemon and reply.returncode == 0 and reply.stdout.strip() == "100.0":
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"daemon not ready (pid {daemon and daemon.pid}, last reply {reply}):\n"
                        + log())

        servers = control("get_server_list")
        assert (servers.returncode, servers.stdout.strip()) == (0, ""), (servers, log())
        unknown = control("no_such_command")
        assert unknown.returncode == 0, (unknown, log())
        assert unknown.stdout.strip() == 'Unknown command "no_such_command"', (unknown, log())

        control("quit")  # its rc is unreliable (see the notes): watch the process instead
        deadline = time.monotonic() + TIMEOUT
        while _alive(daemon) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(daemon), f"daemon {daemon.pid} still running after quit:\n{log()}"
    finally:
        daemon = daemon or _find_daemon(binary, str(pipe_dir))
        if daemon is not None and _alive(daemon):
            daemon.kill()  # exactly this pid (psutil checks it is still the same process)
