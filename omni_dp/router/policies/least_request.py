from __future__ import annotations

import itertools
from collections.abc import Sequence

from omni_dp.router.policies.base import Policy, RequestContext
from omni_dp.router.replicas import Replica


class LeastRequestPolicy(Policy):
    """Fewest in-flight requests; ties rotate, so a fresh router does not herd onto replica 0."""

    name = "least_request"

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(seed)
        self._counter = itertools.count()

    def select(self, candidates: Sequence[Replica], ctx: RequestContext) -> Replica | None:
        if not candidates:
            return None
        fewest = min(r.in_flight for r in candidates)
        tied = [r for r in candidates if r.in_flight == fewest]
        return tied[next(self._counter) % len(tied)]
