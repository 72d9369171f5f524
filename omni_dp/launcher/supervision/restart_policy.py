"""When to restart something that died and when to stop trying: one rule for replicas, the
router and the MPS daemon. A crash loop must neither hammer the machine (backoff) nor go on
forever (a budget of restarts within a window).
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_dp.runfile import SupervisionSettings


@dataclass(frozen=True)
class Restart:
    delay: float  # seconds to wait before restarting (0 for the first within the window)
    attempt: int  # 1 for the first restart within the window
    history: tuple[float, ...]  # what to remember: the restarts within the window, and this one


@dataclass(frozen=True)
class GiveUp:
    restarts: int  # restarts within the window
    window: float

    @property
    def reason(self) -> str:
        return f"{self.restarts} restarts within {self.window:.0f} s"


@dataclass(frozen=True)
class RestartPolicy:
    budget: int  # restarts allowed within the window
    window: float  # seconds
    max_backoff: float = 30.0

    @classmethod
    def of(cls, settings: SupervisionSettings) -> RestartPolicy:
        return cls(settings.restart_budget, settings.restart_window)

    def decide(self, history: tuple[float, ...], now: float) -> Restart | GiveUp:
        """history: when each earlier restart began (time.time()); now: the same clock."""
        recent = tuple(t for t in history if now - t < self.window)  # they count against it
        n = len(recent)
        if n >= self.budget:
            return GiveUp(n, self.window)
        delay = min(2.0 ** (n - 1), self.max_backoff) if n else 0.0
        return Restart(delay, n + 1, (*recent, now))
