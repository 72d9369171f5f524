"""The MPS control protocol: one command per call of `nvidia-cuda-mps-control`, parsed strictly.

The front end's exit status only says whether the daemon was reachable (1 and "Cannot find MPS
control daemon process" on stderr when not); a rejected command still exits 0 with its message
on stdout. So every reply is parsed against what the command must return, and anything else is
an error rather than silently dropped.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

from omni_dp.contract import RUN_IDENTITY_ENVS

BINARY_NAME = "nvidia-cuda-mps-control"
BINARY_ENV = "OMNI_DP_MPS_CONTROL"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
# Inherited limits that would silently apply to the run's daemon; set through the protocol
# instead, and only when asked for.
LIMIT_ENVS = ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")

SOCKET_NAME = "control"  # the daemon's socket, inside the pipe directory
MAX_SOCKET_PATH_BYTES = 107  # sizeof(sun_path) - 1 on Linux

_REJECTIONS = (
    re.compile(r"^Unknown command"),
    re.compile(r"^Server \d+ not found"),
    re.compile(r"^A user id \(UID\) is required"),
    re.compile(r"^An instance of this daemon is already running"),
)
_PID = re.compile(r"^\d+$")
_INVALID_PROCESS = re.compile(r"^Invalid process -?\d+!?$")
_PERCENT = re.compile(r"^\d+(\.\d+)?$")
_MEM_LIMIT = re.compile(r"^(\d+)([MG]?)$")


class MpsControlError(Exception):
    """Base of every failure to get an answer from the control daemon."""


class BinaryNotFound(MpsControlError):
    pass


class DaemonUnreachable(MpsControlError):
    pass


class CommandRejected(MpsControlError):
    pass


class ControlTimeout(MpsControlError):
    pass


class MalformedOutput(MpsControlError):
    pass


def parse_pid_list(text: str) -> list[int]:
    """PIDs, one per line; an empty reply is an empty list; any other line is an error."""
    pids = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if not _PID.match(line):
            raise MalformedOutput(f"expected one PID per line, got {line!r}")
        pids.append(int(line))
    return pids


def parse_percentage(text: str) -> float:
    value = text.strip()
    if not _PERCENT.match(value) or not 0 < float(value) <= 100:
        raise MalformedOutput(f"expected a thread percentage in (0, 100], got {value!r}")
    return float(value)


def parse_mem_limit(text: str) -> int:
    """`2G`, `512M` or plain bytes → bytes. The daemon rounds ≥ 1 GiB down to whole GiB."""
    match = _MEM_LIMIT.match(text.strip())
    if match is None:
        raise MalformedOutput(f"expected a memory limit like 512M or 2G, got {text.strip()!r}")
    unit = {"": 1, "M": 1024**2, "G": 1024**3}[match.group(2)]
    return int(match.group(1)) * unit


def check_terminate_reply(text: str, command: str) -> None:
    """`terminate_client`'s reply: empty or ending in status 0 is success; any other status,
    or "Invalid process N!", is a rejection; anything else is unexpected."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if any(_INVALID_PROCESS.match(line) for line in lines):
        raise CommandRejected(f"{command!r} rejected: {text.strip()}")
    if not lines or lines[-1] == "0":
        return
    if _PID.match(lines[-1]):
        raise CommandRejected(f"{command!r} failed with status {lines[-1]}: {text.strip()}")
    raise MalformedOutput(f"unexpected reply to {command!r}: {text.strip()!r}")


def socket_path_problems(pipe_dir: str) -> list[str]:
    """Why the daemon could not listen on `<pipe_dir>/control` (none: it can).

    The path must fit AF_UNIX sun_path (≤ 107 bytes): a longer one lets the daemon start but
    not bind, and every later command then only says "Cannot find MPS control daemon process".
    The pipe directory must also be absolute: the daemon and every client must name exactly the
    same directory.
    """
    problems = []
    if not os.path.isabs(pipe_dir):
        problems.append(
            f"MPS pipe directory {pipe_dir!r} is not an absolute path; the daemon and every "
            "client resolve CUDA_MPS_PIPE_DIRECTORY from their own working directory, so use an "
            "absolute OMNI_DP_STATE_DIR")
    socket_path = f"{pipe_dir}/{SOCKET_NAME}"
    length = len(os.fsencode(socket_path))
    if length > MAX_SOCKET_PATH_BYTES:
        over = length - MAX_SOCKET_PATH_BYTES
        problems.append(
            f"MPS control socket path {socket_path} is {length} bytes, {over} over the "
            f"{MAX_SOCKET_PATH_BYTES}-byte limit of a Unix socket path (the daemon would start "
            "but could not listen); set OMNI_DP_STATE_DIR to a directory at least "
            f"{over} bytes shorter (e.g. /tmp/omni-dp-$(id -u))")
    return problems


@dataclass(frozen=True)
class MpsControl:
    """Talks to the daemon that serves `pipe_dir`."""

    binary: str
    pipe_dir: str
    log_dir: str
    timeout_s: float = 10.0
    # The daemon starts the server found first on ITS PATH: this one's folder goes first.
    server_binary: str | None = None

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        if self.server_binary:
            first = os.path.dirname(os.path.abspath(self.server_binary))
            rest = env.get("PATH", os.defpath).split(os.pathsep)
            env["PATH"] = os.pathsep.join([first, *(d for d in rest if d and d != first)])
        # No limit variables (they would cap the daemon itself), and no run identity: a run's
        # teardown signals the processes carrying its token, and the daemon must only ever be
        # stopped through `quit` once its clients are gone.
        for name in (*LIMIT_ENVS, *RUN_IDENTITY_ENVS):
            env.pop(name, None)
        env[PIPE_ENV] = self.pipe_dir
        env[LOG_ENV] = self.log_dir
        return env

    def run(self, command: str) -> str:
        """Send one command; return its stdout. Raises a typed MpsControlError."""
        try:
            done = subprocess.run(
                [self.binary], input=command + "\n", capture_output=True, text=True,
                env=self.env(), timeout=self.timeout_s, check=False,
            )
        except subprocess.TimeoutExpired:
            raise ControlTimeout(
                f"{command!r} got no answer in {self.timeout_s:.0f}s from the daemon on "
                f"{self.pipe_dir}"
            ) from None
        except OSError as exc:
            raise BinaryNotFound(f"cannot run {self.binary}: {exc}") from None
        out = done.stdout.strip()
        if done.returncode != 0:
            detail = (done.stderr.strip() or out or f"exit status {done.returncode}")
            raise DaemonUnreachable(f"no MPS control daemon answers on {self.pipe_dir}: {detail}")
        first = out.splitlines()[0] if out else ""
        if any(pattern.match(first) for pattern in _REJECTIONS):
            raise CommandRejected(f"{command!r} rejected: {out}")
        return out

    # --- queries with strict replies ----------------------------------------------------
    def server_list(self) -> list[int]:
        return parse_pid_list(self.run("get_server_list"))

    def client_list(self, server_pid: int) -> list[int]:
        return parse_pid_list(self.run(f"get_client_list {server_pid}"))

    def default_thread_percentage(self) -> float:
        return parse_percentage(self.run("get_default_active_thread_percentage"))

    def set_default_thread_percentage(self, percent: float) -> float:
        """Set, then read back; the percentage the daemon now gives new clients."""
        echoed = parse_percentage(self.run(f"set_default_active_thread_percentage {percent:g}"))
        if abs(echoed - percent) > 1e-6:
            raise MalformedOutput(f"asked for {percent:g}% threads, daemon answered {echoed:g}")
        actual = self.default_thread_percentage()
        if abs(actual - percent) > 1e-6:
            raise MalformedOutput(f"asked for {percent:g}% threads, the daemon reports "
                                  f"{actual:g}")
        return actual

    def default_pinned_mem_limit(self, device: int = 0) -> int:
        return parse_mem_limit(self.run(f"get_default_device_pinned_mem_limit {device}"))

    def set_default_pinned_mem_limit(self, num_bytes: int, device: int = 0) -> int:
        """Set, then read back: the setter answers nothing, so only the read proves it."""
        mib = max(1, num_bytes // 1024**2)
        reply = self.run(f"set_default_device_pinned_mem_limit {device} {mib}M")
        if reply:
            raise MalformedOutput(f"unexpected reply to setting the memory limit: {reply!r}")
        expected = mib * 1024**2
        if expected >= 1024**3:
            expected -= expected % 1024**3  # the daemon keeps whole GiB from 1 GiB up
        actual = self.default_pinned_mem_limit(device)
        if actual != expected:
            raise MalformedOutput(f"asked for a {mib} MiB memory limit, the daemon reports "
                                  f"{actual} bytes")
        return actual

    def terminate_client(self, server_pid: int, client_pid: int) -> None:
        """Have the server drop one client's outstanding GPU work, so that killing the client
        afterwards cannot leave the shared context wedged (`terminate_client <server PID>
        <client PID>`, man nvidia-cuda-mps-control). The reply is not documented: nothing, or
        a final status line "0", is success; the daemon's "Server N not found" (what it
        answers when there is no such server) and "Invalid process N!" are rejections."""
        out = self.run(f"terminate_client {server_pid} {client_pid}")
        check_terminate_reply(out, f"terminate_client {server_pid} {client_pid}")

    def quit(self) -> None:
        """Ask the daemon to exit; its exit status is unreliable, so callers watch the pid."""
        self.run("quit")
