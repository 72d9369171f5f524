"""Process identity: a pid alone is not a process.

A pid is recycled by the kernel; omni-dp only ever signals or trusts a process whose pid AND
create time match what it recorded, or whose environment carries the run's token.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    create_time: float  # psutil's, seconds since the epoch

    def to_json(self) -> dict:
        return {"pid": self.pid, "create_time": self.create_time}

    @classmethod
    def from_json(cls, data: dict) -> ProcessIdentity:
        return cls(int(data["pid"]), float(data["create_time"]))


def identify(pid: int) -> ProcessIdentity | None:
    try:
        return ProcessIdentity(pid, psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def is_alive(identity: ProcessIdentity) -> bool:
    """The recorded process still exists (not a recycled pid) and is not a zombie."""
    try:
        process = psutil.Process(identity.pid)
        return (
            process.create_time() == identity.create_time
            and process.status() != psutil.STATUS_ZOMBIE
        )
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def open_pidfd(pid: int) -> int:
    """os.pidfd_open (Linux ≥ 5.3); OSError(ENOSYS) where Python has none (not Linux, or built
    without it), as where the kernel has none."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        raise OSError(errno.ENOSYS, "os.pidfd_open is not available")
    return opener(pid)


def pidfd_of(identity: ProcessIdentity, *,
             alive: Callable[[ProcessIdentity], bool] = is_alive,
             pidfd_open: Callable[[int], int] = open_pidfd) -> int | None:
    """A pidfd of the recorded process (readable once it exits; it works for processes that are
    not our children), or None when that process is gone: no such pid, or the pid now names
    another process. The identity is checked once, right after the fd is taken, which rules out
    a pid recycled before the fd named it; from then on the fd names that one process, so the
    caller compares nothing again. The caller closes the fd.

    OSError other than ESRCH (no pidfd_open here, seccomp, ...) propagates: each caller has its
    own fallback. So does whatever `alive` raises (the fd closed first)."""
    try:
        fd = pidfd_open(identity.pid)
    except ProcessLookupError:  # ESRCH: no such pid, gone already
        return None
    try:
        if alive(identity):
            return fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)  # the pid was recycled before the fd named it
    return None


def read_environ(pid: int) -> dict[str, str] | None:
    """The environment a process started with, or None when it is gone or not ours to read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env
