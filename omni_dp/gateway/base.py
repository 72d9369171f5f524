"""What omni-dp needs from a fleet gateway, whichever it is: list, register, deregister.

`omni-dp launch --register URL` hands each replica (or the host's router) to a gateway that
already serves a fleet, removes it on teardown, and takes it out while it restarts. Only that
much is asked of a gateway, so that another one than SGLang's can be added by writing one class.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


class GatewayError(Exception):
    """The gateway could not be reached, refused, or did not do what was asked in time; the
    message says which, in words a person can act on (with the gateway's own words)."""


@dataclass(frozen=True)
class GatewayWorker:
    """One worker as the gateway lists it.

    `healthy` and `disabled` are None where the gateway does not say (a gateway without a
    disable switch always gives None). `already_registered`: the gateway listed this URL before
    the register() call that returned it (a leftover of a killed run, or a second call);
    `replaced_id`: that earlier entry was unhealthy and register() replaced it by a fresh one.
    """

    url: str
    worker_id: str
    healthy: bool | None
    disabled: bool | None = None
    model_id: str | None = None
    already_registered: bool = False
    replaced_id: str | None = None
    raw: Mapping[str, object] = field(default_factory=dict, compare=False, hash=False,
                                      repr=False)


@runtime_checkable
class Gateway(Protocol):
    """A fleet gateway's worker API. `can_disable`: whether it can take a worker out of
    traffic without removing it (set_disabled, see DisablingGateway); without that a restarting
    replica is deregistered and registered again once it passed its gates."""

    can_disable: bool

    def describe(self) -> str:
        """The gateway in a few words, for messages ("the SGLang model gateway at URL")."""
        ...

    def workers(self) -> list[GatewayWorker]:
        """Every worker the gateway lists now."""
        ...

    def register(self, worker_url: str, *, wait_s: float) -> GatewayWorker:
        """Add worker_url and wait until the gateway lists it healthy; GatewayError if not."""
        ...

    def deregister(self, worker_url: str) -> bool:
        """Remove worker_url: True once gone, False when it was not listed."""
        ...


@runtime_checkable
class DisablingGateway(Gateway, Protocol):
    """A gateway that can hold a worker out of traffic and put it back (can_disable True)."""

    def set_disabled(self, worker_url: str, disabled: bool) -> GatewayWorker:
        ...
