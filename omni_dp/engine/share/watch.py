"""A follower serves only while its leader runs: what it maps is the leader's.

A daemon thread polls the leader's identity (pid and create time, so a recycled pid is not
mistaken for it) every `interval` seconds and calls `on_gone` once when it is gone. Polling
rather than a pidfd: the leader is not our child, and half a second is within what the
follower promises (it stops within about a second).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from omni_dp.procs import ProcessIdentity, is_alive

POLL_INTERVAL_S = 0.5


class LeaderWatch:
    def __init__(self, leader: ProcessIdentity, on_gone: Callable[[], None],
                 interval: float = POLL_INTERVAL_S,
                 alive: Callable[[ProcessIdentity], bool] = is_alive) -> None:
        self.leader = leader
        self._on_gone = on_gone
        self._interval = interval
        self._alive = alive
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="leader-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            if not self._alive(self.leader):
                self._on_gone()
                return
