"""Waking the supervision loop the moment a watched process exits or a signal arrives."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading

from omni_dp.procs import ProcessIdentity, pidfd_of

# What a thread's wake writes into the pipe (a signal writes its number)
SWEEP = b"!"
WRITE = b"."


class DeathWatch:
    """Wakes the loop the moment a watched process exits or a signal arrives, else after the
    sweep interval. pidfds (Linux ≥ 5.3) work for processes that are not our children, which
    the replicas of a detached supervisor are not; without them the interval bounds detection.
    """

    def __init__(self) -> None:
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        signal.set_wakeup_fd(self._wake_w)  # the signal handlers run in the main thread
        self._closing = threading.Lock()  # a wake from a thread never writes a closed fd
        self._closed = False

    def wait(self, identities: list[ProcessIdentity], timeout_s: float) -> bool:
        """Until a watched process exits, a signal or a thread's outcome arrives, or timeout_s
        passed: True then (a sweep is due); False when only a thread's record write woke it
        (the loop applies it and waits on, so that writes do not add sweeps)."""
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        fds = []
        woke = b""
        try:
            for identity in identities:
                try:
                    fd = pidfd_of(identity)
                except OSError:  # no pidfd here: the interval bounds detection
                    continue
                if fd is None:  # gone already, or its pid recycled: wake the loop now
                    return True
                fds.append(fd)
                poller.register(fd, select.POLLIN)
            ready = poller.poll(timeout_s * 1000)
        finally:
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(BlockingIOError):
                while chunk := os.read(self._wake_r, 64):
                    woke += chunk
        exited = any(fd != self._wake_r for fd, _ in ready)
        return not ready or exited or woke.strip(WRITE) != b""

    def wake(self, sweep: bool = True) -> None:
        """Wake the loop now (from any thread): a thread reported an outcome (sweep), or made
        a record write for the loop to apply (not sweep)."""
        with self._closing, contextlib.suppress(BlockingIOError):  # full: it wakes anyway
            if not self._closed:
                os.write(self._wake_w, SWEEP if sweep else WRITE)

    def close(self) -> None:
        with self._closing:
            self._closed = True
        signal.set_wakeup_fd(-1)
        os.close(self._wake_r)
        os.close(self._wake_w)
