from __future__ import annotations

import itertools
from collections.abc import Sequence

from omni_dp.router.policies.base import Policy, RequestContext
from omni_dp.router.replicas import Replica


class RoundRobinPolicy(Policy):
    """Each candidate in turn."""

    name = "round_robin"

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(seed)
        self._counter = itertools.count()

    def select(self, candidates: Sequence[Replica], ctx: RequestContext) -> Replica | None:
        if not candidates:
            return None
        return candidates[next(self._counter) % len(candidates)]
