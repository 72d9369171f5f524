from __future__ import annotations

from collections.abc import Sequence

from omni_dp.router.policies.base import RequestContext
from omni_dp.router.policies.uniform_random import RandomPolicy
from omni_dp.router.replicas import Replica


class PowerOfTwoPolicy(RandomPolicy):
    """Two distinct random candidates; the one with fewer in flight wins (ties: the first)."""

    name = "power_of_two"

    def select(self, candidates: Sequence[Replica], ctx: RequestContext) -> Replica | None:
        if len(candidates) < 2:
            return candidates[0] if candidates else None
        first, second = self._rng.sample(list(candidates), 2)
        return second if second.in_flight < first.in_flight else first
