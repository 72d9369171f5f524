"""The policy protocol and what a policy may know about a request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from omni_dp.router.replicas import Replica


@dataclass(frozen=True)
class RequestContext:
    """Inputs a policy may use. New inputs become fields here, never new parameters.

    `tried` holds the (id, generation) of the replicas this request was already sent to: the
    router leaves them out of the candidates of a retry or a resume, so no policy ever picks
    one again. A replica restarted since (a new generation: Replica.readmitted) is a new
    process, and may be tried.
    """

    path: str
    request_id: str
    tried: set[tuple[str, int]] = field(default_factory=set)

    def note_tried(self, replica: Replica) -> None:
        self.tried.add((replica.id, replica.generation))

    def has_tried(self, replica: Replica) -> bool:
        return (replica.id, replica.generation) in self.tried


class Policy:
    name = "base"

    def __init__(self, seed: int | None = None) -> None:
        """`seed` fixes the draws of the policies that draw at random; the others ignore it."""

    def select(self, candidates: Sequence[Replica], ctx: RequestContext) -> Replica | None:
        raise NotImplementedError
