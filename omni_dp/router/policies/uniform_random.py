from __future__ import annotations

import random
from collections.abc import Sequence

from omni_dp.router.policies.base import Policy, RequestContext
from omni_dp.router.replicas import Replica


class RandomPolicy(Policy):
    """A uniformly random candidate."""

    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(seed)
        self._rng = random.Random(seed)

    def select(self, candidates: Sequence[Replica], ctx: RequestContext) -> Replica | None:
        return self._rng.choice(list(candidates)) if candidates else None
