"""A follower serves only while its leader runs: what it maps is the leader's.

A daemon thread waits on a pidfd of the leader (Linux ≥ 5.3; `pidfd_open` works for any
process we may see, our child or not) and calls `on_gone` once, the moment the pidfd turns
readable: the leader exited. Right after the fd is taken the leader's identity (pid and create
time) is checked once more (procs.pidfd_of), which rules out a pid recycled before the fd named
it; from then on the fd names that one process, so nothing is compared again (psutil's create
time is derived from the wall clock's boot time and moves when the clock is stepped: a repeated
exact comparison would see every leader "gone" after a step).

Where `pidfd_open` is unavailable (an older kernel, seccomp: OSError), the thread polls the
identity every `interval` seconds instead (which a clock step can trip: then the follower
stops, exit 4, and is restarted; never the other way round).

Fail closed: an unexpected error in the watch is logged and counts as the leader gone. Once
`stop()` has returned, `on_gone` is never called (a clean stop keeps its exit 0).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from collections.abc import Callable

from omni_dp.procs import ProcessIdentity, is_alive, open_pidfd, pidfd_of

log = logging.getLogger("omni_dp.serve")

POLL_INTERVAL_S = 0.5  # the fallback's, without a pidfd


class LeaderWatch:
    def __init__(self, leader: ProcessIdentity, on_gone: Callable[[], None],
                 interval: float = POLL_INTERVAL_S,
                 alive: Callable[[ProcessIdentity], bool] = is_alive,
                 pidfd_open: Callable[[int], int] = open_pidfd) -> None:
        self.leader = leader
        self._on_gone = on_gone
        self._interval = interval
        self._alive = alive
        self._pidfd_open = pidfd_open
        self.mode: str | None = None  # "pidfd" or "poll", once the thread has chosen
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._fired = False
        self._wake_r, self._wake_w = os.pipe()  # stop() wakes a thread blocked on the pidfd
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="leader-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No `on_gone` after this returns (unless it was already being called)."""
        with self._lock:
            if self._stopped.is_set():
                return
            self._stopped.set()
            if self._wake_w >= 0:
                with contextlib.suppress(OSError):
                    os.write(self._wake_w, b"x")

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self._wait()
        except Exception:  # fail closed: a watch that cannot watch says the leader is gone
            log.exception("weight share: watching the leader (pid %d) failed; taking it as "
                          "gone", self.leader.pid)
        finally:
            with self._lock:
                for fd in (self._wake_r, self._wake_w):
                    os.close(fd)
                self._wake_r = self._wake_w = -1
        self._fire()

    def _fire(self) -> None:
        with self._lock:
            if self._stopped.is_set() or self._fired:
                return
            self._fired = True
        try:
            self._on_gone()
        except Exception:
            log.exception("weight share: stopping after the leader's exit failed")

    def _wait(self) -> None:
        """Returns when the leader is gone, or stop() was called."""
        try:
            pidfd = pidfd_of(self.leader, alive=self._alive, pidfd_open=self._pidfd_open)
        except OSError as exc:
            log.info("weight share: no pidfd for the leader (%s); polling it every %.1f s",
                     exc, self._interval)
            self.mode = "poll"
            self._poll()
            return
        self.mode = "pidfd"
        if pidfd is None:  # no such pid, or it was recycled before the fd named it: gone
            return
        try:
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            poller.register(self._wake_r, select.POLLIN)
            while not poller.poll():  # no timeout: readable = the leader exited, or stop()
                pass
        finally:
            os.close(pidfd)

    def _poll(self) -> None:
        while not self._stopped.is_set():
            if not self._alive(self.leader):
                return
            self._stopped.wait(self._interval)
