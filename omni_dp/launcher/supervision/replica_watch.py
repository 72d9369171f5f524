"""Whether one replica needs a restart, decided from what the sweep saw (is its process alive,
what did GET /health answer): no I/O here, so the threshold of consecutive /health failures and
the healthy ⇄ unhealthy transitions are tested without processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_dp.launcher.bringup.gates import describe_exit
from omni_dp.runfile import ReplicaState


@dataclass(frozen=True)
class Seen:
    """What one sweep saw of a replica."""

    alive: bool
    exit_code: int | None = None  # when dead and our child: its exit status
    health: int = 0  # when alive: GET /health's status, 0 when nothing answered


@dataclass(frozen=True)
class Verdict:
    state: ReplicaState | None = None  # to record (None: as it is)
    error: str | None = None  # the last_error recorded with UNHEALTHY
    restart: str | None = None  # a restart is due, for this reason


class ReplicaWatch:
    def __init__(self, threshold: int) -> None:
        self.threshold = threshold  # consecutive failed /health before a restart
        self.failures = 0

    def observe(self, state: ReplicaState, seen: Seen) -> Verdict:
        if not seen.alive:
            # Not our child (started by `launch`): its exit status is not ours to read.
            return Verdict(restart=f"its process {describe_exit(seen.exit_code)}"
                           if seen.exit_code is not None else "its process is gone")
        if seen.health == 200:
            self.failures = 0
            return Verdict() if state is ReplicaState.HEALTHY else Verdict(ReplicaState.HEALTHY)
        self.failures += 1
        error = f"/health answered {seen.health or 'nothing'} ({self.failures} in a row)"
        due = self.failures >= self.threshold
        return Verdict(ReplicaState.UNHEALTHY, error, error if due else None)

    def reset(self) -> None:
        """A restart passed every gate: counting starts again."""
        self.failures = 0
