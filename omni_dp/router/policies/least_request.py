from __future__ import annotations

from collections.abc import Sequence

from omni_dp.router.policies.base import RequestContext
from omni_dp.router.policies.round_robin import RoundRobinPolicy
from omni_dp.router.replicas import Replica


class LeastRequestPolicy(RoundRobinPolicy):
    """Fewest in-flight requests; ties take turns (round robin over the least loaded), so a
    fresh router does not herd onto replica 0."""

    name = "least_request"

    def select(self, candidates: Sequence[Replica], ctx: RequestContext) -> Replica | None:
        if not candidates:
            return None
        fewest = min(r.in_flight for r in candidates)
        return super().select([r for r in candidates if r.in_flight == fewest], ctx)
