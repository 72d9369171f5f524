from __future__ import annotations

import random
from collections.abc import Sequence

from omni_dp.router.policies.base import Policy, RequestContext
from omni_dp.router.replicas import Replica


class PowerOfTwoPolicy(Policy):
    """Two distinct random candidates; the one with fewer in flight wins (ties: the first)."""

    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(seed)
        self._rng = random.Random(seed)

    def select(self, candidates: Sequence[Replica], ctx: RequestContext) -> Replica | None:
        if len(candidates) < 2:
            return candidates[0] if candidates else None
        first, second = self._rng.sample(list(candidates), 2)
        return second if second.in_flight < first.in_flight else first
