"""Load-balancing policies: small objects with one `select` method, found by `name`.

A policy only ranks: the router has already filtered the candidates to routable replicas with
room under their in-flight bound, and turns `None` into a 503. Policies never do I/O. Adding one
is a new module and a line in POLICIES.
"""

from __future__ import annotations

from omni_dp.router.policies.base import Policy, RequestContext
from omni_dp.router.policies.least_request import LeastRequestPolicy
from omni_dp.router.policies.power_of_two import PowerOfTwoPolicy
from omni_dp.router.policies.round_robin import RoundRobinPolicy
from omni_dp.router.policies.uniform_random import RandomPolicy

POLICIES: dict[str, type[Policy]] = {
    policy.name: policy
    for policy in (LeastRequestPolicy, RoundRobinPolicy, PowerOfTwoPolicy, RandomPolicy)
}


def make_policy(name: str, seed: int | None = None) -> Policy:
    try:
        return POLICIES[name](seed=seed)
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None


__all__ = ["POLICIES", "Policy", "RequestContext", "make_policy"]
