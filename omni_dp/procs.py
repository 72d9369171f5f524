"""Process identity: a pid alone is not a process.

A pid is recycled by the kernel; omni-dp only ever signals or trusts a process whose pid AND
create time match what it recorded, or whose environment carries the run's token.

The create time is the kernel's own: /proc/<pid>/stat's starttime, clock ticks after boot,
which no clock step moves. psutil's create_time() adds the boot time the kernel derives from the
wall clock at each read, so after an NTP step the same process reads a different time in
another process, and a live replica would pass for dead (it happened on a CI machine).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from omni_dp.records import Record

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# A create time above this is seconds since the epoch (31 years of uptime is none): a record
# written before omni-dp read starttime. Such a time is compared as it was then, to the second.
EPOCH_FLOOR = 1e9


@dataclass(frozen=True)
class ProcessIdentity(Record):
    pid: int
    create_time: float  # seconds after boot (start_of); in older records, since the epoch


def _stat(pid: int) -> tuple[str, float] | None:
    """(state letter, start in seconds after boot) of a process, None when there is none.
    Hand-read: psutil has no public call for a start that ignores the wall clock."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:  # no such pid (or no /proc)
        return None
    fields = raw[raw.rindex(b")") + 2:].split()  # after "pid (comm) ", comm may hold spaces
    return fields[0].decode(), int(fields[19]) / CLOCK_TICKS  # fields 3 and 22 of proc(5)


def start_of(pid: int) -> float | None:
    """When the process started, in seconds after boot; None when there is no such pid."""
    stat = _stat(pid)
    return stat[1] if stat else None


def identify(pid: int) -> ProcessIdentity | None:
    started = start_of(pid)
    return None if started is None else ProcessIdentity(pid, started)


def is_alive(identity: ProcessIdentity) -> bool:
    """The recorded process still exists (not a recycled pid) and is not a zombie."""
    stat = _stat(identity.pid)
    if stat is None or stat[0] in ("Z", "X"):
        return False
    if identity.create_time > EPOCH_FLOOR:  # an older record's time: psutil's, to the second
        try:
            return abs(psutil.Process(identity.pid).create_time() - identity.create_time) < 1
        except psutil.Error:
            return False
    return stat[1] == identity.create_time


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
