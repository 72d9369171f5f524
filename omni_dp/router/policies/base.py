"""The policy protocol and what a policy may know about a request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from omni_dp.router.replicas import Replica


@dataclass(frozen=True)
class RequestContext:
    """Inputs a policy may use. New inputs become fields here, never new parameters.

    `tried` holds the ids of the replicas this request was already sent to: the router leaves
    them out of the candidates of a retry or a resume, so no policy ever picks one again.
    """

    path: str
    request_id: str
    tried: set[str] = field(default_factory=set)


class Policy:
    name = "base"

    def __init__(self, seed: int | None = None) -> None:
        """`seed` fixes the draws of the policies that draw at random; the others ignore it."""

    def select(self, candidates: Sequence[Replica], ctx: RequestContext) -> Replica | None:
        raise NotImplementedError
