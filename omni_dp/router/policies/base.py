"""The policy protocol and what a policy may know about a request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from omni_dp.router.replicas import Replica


@dataclass(frozen=True)
class RequestContext:
    """Inputs a policy may use. New inputs become fields here, never new parameters."""

    path: str
    request_id: str


class Policy:
    name = "base"

    def __init__(self, seed: int | None = None) -> None:
        """`seed` fixes the draws of the policies that draw at random; the others ignore it."""

    def select(self, candidates: Sequence[Replica], ctx: RequestContext) -> Replica | None:
        raise NotImplementedError
