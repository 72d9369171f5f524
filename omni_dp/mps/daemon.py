"""A private MPS control daemon for one GPU of one run: start, prove, watch, stop.

Private means: pipe and log directories of its own (0700, inside the run's state dir), never a
daemon someone else started (one already answering on the pipe is refused, not adopted), and
only its recorded pid + create time is ever waited on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from omni_dp.files import PrivateDirError, make_private_dir
from omni_dp.mps.control import (
    PIPE_ENV,
    DaemonUnreachable,
    MpsControl,
    MpsControlError,
    socket_path_problems,
)
from omni_dp.mps.faults import fault_lines
from omni_dp.procs import ProcessIdentity, identify, is_alive, read_environ
from omni_dp.records import Record, Shape

PID_FILE = "nvidia-cuda-mps-control.pid"  # documented; Debian's 535 build writes none
CONTROL_LOG = "control.log"
# Open files an MPS server needs at least (NVIDIA's MPS guide: short of them it fails to
# "create/open SHM segment"); many hosts and containers start processes with a soft limit of
# 1024. The server is spawned by the daemon at the first client and inherits its limits.
MIN_OPEN_FILES = 16384


def raise_open_files(pid: int, wanted: int = MIN_OPEN_FILES) -> tuple[int, int]:
    """Raise process `pid`'s soft RLIMIT_NOFILE to `wanted` (no further than its hard limit,
    which an unprivileged process cannot raise); its (soft, hard) limits after."""
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft, hard


class MpsDaemonError(Exception):
    """The daemon could not be started, proved or stopped; the message says what to do."""


@dataclass(frozen=True)
class DaemonLimits(Record):
    """The client defaults the daemon was given, as it read them back (None: not set, so
    uncapped); limits are read when its server starts, so these hold for every client."""

    thread_percentage: float | None = None
    memory_limit_bytes: int | None = None  # device 0's: the one GPU the daemon sees

    @property
    def any(self) -> bool:
        return self.thread_percentage is not None or self.memory_limit_bytes is not None


@dataclass(frozen=True)
class DaemonRecord(Record):
    """What run.json keeps about the daemon."""

    # its process as "pid", "create_time"; no "gpu_uuid" or null limits in older records
    JSON_SHAPE = Shape(flat=("identity",), absent={"gpu_uuid": None},
                       null_is_absent=("limits",))

    identity: ProcessIdentity
    binary: str
    pipe_dir: str
    log_dir: str
    gpu_uuid: str | None
    server_binary: str | None = None  # records written before it was kept have none
    gpu: int = 0  # the run's GPU slot it serves (RunRecord.gpus); one daemon per GPU
    limits: DaemonLimits = DaemonLimits()

    def control(self) -> MpsControl:
        """The control client for this daemon: the same pair whoever stops, checks or
        restarts it (supervisor, teardown, verify-mps, `omni-dp mps`)."""
        return MpsControl(self.binary, self.pipe_dir, self.log_dir,
                          server_binary=self.server_binary)


@dataclass
class DaemonHealth:
    alive: bool
    reachable: bool
    servers: list[int] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)  # log lines that show MPS trouble
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.alive and self.reachable and not self.faults

    def to_json(self) -> dict:
        return {"ok": self.ok, "alive": self.alive, "reachable": self.reachable,
                "servers": self.servers, "faults": self.faults, "error": self.error}


def control_log_tail(log_dir: str, lines: int = 20) -> str:
    try:
        text = Path(log_dir, CONTROL_LOG).read_text(errors="replace")
    except OSError:
        return "(no control.log)"
    return "\n".join(text.splitlines()[-lines:])


def find_daemon_pid(control: MpsControl) -> ProcessIdentity | None:
    """The daemon serving this exact pipe dir: its pid file if live, else /proc's word."""
    pid_file = Path(control.pipe_dir, PID_FILE)
    try:
        pid = int(pid_file.read_text().strip())
        identity = identify(pid)
        if identity is not None and is_alive(identity):
            return identity
    except (OSError, ValueError):
        pass
    binary = os.path.realpath(control.binary)
    pipe = os.path.realpath(control.pipe_dir)
    for process in psutil.process_iter(["pid", "exe", "cmdline"]):
        info = process.info
        argv0 = (info.get("cmdline") or [""])[0]
        exe = info.get("exe") or ""
        if binary not in (os.path.realpath(exe) if exe else "", os.path.realpath(argv0)):
            continue
        env = read_environ(info["pid"]) or {}
        if os.path.realpath(env.get(PIPE_ENV, "")) == pipe:
            return identify(info["pid"])
    return None


class MpsDaemon:
    def __init__(self, control: MpsControl) -> None:
        self.control = control

    def answers(self) -> bool:
        try:
            self.control.server_list()
            return True
        except DaemonUnreachable:
            return False

    def start(
        self,
        *,
        gpu_uuid: str | None,
        gpu: int = 0,
        thread_percentage: float | None = None,
        memory_limit_bytes: int | None = None,
        ready_timeout_s: float = 10.0,
    ) -> DaemonRecord:
        control = self.control
        problems = socket_path_problems(control.pipe_dir)
        if problems:
            raise MpsDaemonError("; ".join(problems))
        try:
            for directory in (control.pipe_dir, control.log_dir):
                make_private_dir(Path(directory))
        except PrivateDirError as exc:
            raise MpsDaemonError(str(exc)) from None
        if self.answers():
            raise MpsDaemonError(
                f"an MPS control daemon already answers on {control.pipe_dir}; omni-dp never "
                "adopts a daemon it did not start — stop that run first (omni-dp down)"
            )
        env = control.env()
        if gpu_uuid:
            env["CUDA_VISIBLE_DEVICES"] = gpu_uuid
        done = subprocess.run(
            [control.binary, "-d"], env=env, capture_output=True, text=True,
            timeout=control.timeout_s, check=False,
        )
        if done.returncode != 0:
            raise MpsDaemonError(
                f"{control.binary} -d failed ({done.returncode}): "
                f"{(done.stdout + done.stderr).strip()}"
            )
        self._wait_ready(ready_timeout_s)
        identity = find_daemon_pid(control)
        if identity is None:
            raise MpsDaemonError(
                "the daemon answers but no process of its binary holds this pipe directory; "
                f"control.log:\n{control_log_tail(control.log_dir)}"
            )
        with contextlib.suppress(OSError):  # gone meanwhile: the health checks say so
            raise_open_files(identity.pid)  # before any client makes it spawn its server
        record = DaemonRecord(identity, control.binary, control.pipe_dir, control.log_dir,
                              gpu_uuid, control.server_binary, gpu)
        try:
            limits = DaemonLimits(
                control.set_default_thread_percentage(thread_percentage)
                if thread_percentage is not None else None,
                control.set_default_pinned_mem_limit(memory_limit_bytes)
                if memory_limit_bytes is not None else None)
        except MpsControlError as exc:
            self.stop(record, force=True)
            raise MpsDaemonError(f"could not apply the MPS limits: {exc}") from None
        return dataclasses.replace(record, limits=limits)

    def _wait_ready(self, timeout_s: float) -> None:
        """`-d` returns before the socket accepts: poll a harmless query (bounded)."""
        deadline = time.monotonic() + timeout_s
        delay = 0.02
        while True:
            try:
                self.control.default_thread_percentage()
                return
            except DaemonUnreachable as exc:
                if time.monotonic() > deadline:
                    raise MpsDaemonError(
                        f"the daemon did not answer within {timeout_s:.0f}s ({exc}); "
                        f"control.log:\n{control_log_tail(self.control.log_dir)}"
                    ) from None
            time.sleep(delay)
            delay = min(delay * 2, 0.25)

    def clients(self) -> dict[int, list[int]]:
        return {server: self.control.client_list(server) for server in self.control.server_list()}

    def stop(self, record: DaemonRecord, *, force: bool = False, timeout_s: float = 10.0) -> bool:
        """`quit`, then wait for the recorded process to exit (quit's status is unreliable).
        Returns False when it was not running."""
        if not is_alive(record.identity):
            return False
        if not force:
            try:
                attached = {s: c for s, c in self.clients().items() if c}
            except DaemonUnreachable:
                attached = {}
            if attached:
                pids = sorted(p for c in attached.values() for p in c)
                raise MpsDaemonError(
                    f"{len(pids)} MPS client(s) still attached ({', '.join(map(str, pids))}): "
                    "stop the replicas first; quitting under live clients can wedge the server"
                )
        with contextlib.suppress(DaemonUnreachable):  # socket gone: the pid tells the rest
            self.control.quit()
        deadline = time.monotonic() + timeout_s
        while is_alive(record.identity):
            if time.monotonic() > deadline:
                raise MpsDaemonError(
                    f"the MPS daemon (pid {record.identity.pid}) is still running "
                    f"{timeout_s:.0f}s after quit; control.log:\n{control_log_tail(record.log_dir)}"
                )
            time.sleep(0.05)
        return True

    def health(self, record: DaemonRecord, extra_logs: tuple[str, ...] = ()) -> DaemonHealth:
        health = DaemonHealth(alive=is_alive(record.identity), reachable=False)
        try:
            health.servers = self.control.server_list()
            health.reachable = True
        except MpsControlError as exc:
            health.error = str(exc)
        for path in (os.path.join(record.log_dir, CONTROL_LOG), *extra_logs):
            try:
                text = Path(path).read_text(errors="replace")
            except OSError:
                continue
            health.faults += fault_lines(os.path.basename(path), text)
        return health
