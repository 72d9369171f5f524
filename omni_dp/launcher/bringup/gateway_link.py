"""--register: this run's replicas (or its router) in a fleet gateway, through the gateway's own
worker API (omni_dp/gateway).

"Registered" means the gateway lists the worker healthy (register() waits for it). A target is
recorded in run.json's `gateway` BEFORE the gateway is asked, so whoever tears the run down —
the supervisor, or `omni-dp down` after a kill -9 of it — removes every entry the run may have
made. The SGLang gateway has no disable switch: a restarting replica is deregistered, and
registered again once it passed its gates (the supervisor's router link does both).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from omni_dp.gateway import Gateway, GatewayError, GatewayWorker, SglangGateway
from omni_dp.launcher.planning.options import GATEWAY_KEY_ENV
from omni_dp.launcher.record.events import Event
from omni_dp.launcher.record.state import RunState
from omni_dp.runfile import GatewayEntry, GatewayRecord

REGISTER_WAIT_S = 30.0  # listed healthy within; the SGLang gateway takes 0.05-0.3 s


def connect(url: str) -> Gateway:
    """The gateway at url (the SGLang model gateway: the one kind there is), its API key from
    the environment (never from run.json)."""
    return SglangGateway(url, api_key=os.environ.get(GATEWAY_KEY_ENV))


class GatewayLink:
    def __init__(self, state: RunState,
                 gateway: Callable[[str], Gateway] = connect) -> None:
        self.state = state
        self.connect = gateway
        self.url = state.plan.register or (state.record.gateway.url if state.record.gateway
                                           else None)
        self.gateway = gateway(self.url) if self.url else None

    @property
    def per_replica(self) -> bool:
        """Each replica is a worker of the gateway (else the router is the one worker)."""
        return self.gateway is not None and self.state.plan.register_as == "replicas"

    def target(self, index: int | None) -> str:
        """The URL the gateway is given: replica index's, or (None) the router's."""
        if index is not None:
            return self.state.replica(index).url
        return self.state.plan.register_url or self.state.plan.router.url

    # --- one worker -------------------------------------------------------------------------

    def register(self, index: int | None, wait_s: float = REGISTER_WAIT_S) -> GatewayWorker:
        """Hand the target to the gateway and wait until it lists it healthy (GatewayError:
        it did not); recorded first, so a teardown removes it whatever happens next."""
        assert self.gateway is not None, "the run has no --register"
        target = self.target(index)
        self._record(GatewayEntry(target, index, worker_id=""))
        worker = self.gateway.register(target, wait_s=wait_s)
        self._record(GatewayEntry(target, index, worker.worker_id))
        self.state.event(Event.GATEWAY_REGISTERED, replica=index, target=target,
                         worker_id=worker.worker_id, already=worker.already_registered,
                         replaced=worker.replaced_id)
        return worker

    def deregister(self, index: int | None) -> bool:
        """Remove the target from the gateway and check it is no longer listed (False: it
        was not listed); GatewayError when the gateway refused or did not answer."""
        assert self.gateway is not None, "the run has no --register"
        return self._remove(self.target(index), index)

    def _remove(self, target: str, index: int | None) -> bool:
        removed = self.gateway.deregister(target)
        if self.state.record.gateway is not None:
            self.state.change_gateway(lambda record: record.without(target))
        self.state.event(Event.GATEWAY_DEREGISTERED, replica=index, target=target, listed=removed)
        return removed

    def _record(self, entry: GatewayEntry) -> None:
        self.state.change_gateway(
            lambda record: (record or GatewayRecord(self.url or "")).with_entry(entry))

    # --- the supervisor's side: a replica out of traffic and back -----------------------------

    def take_out(self, index: int) -> str | None:
        """Per-replica registration: the replica leaves the gateway (it is about to restart);
        None when done, else what went wrong, in words."""
        if not self.per_replica:
            return None
        try:
            self.deregister(index)
        except GatewayError as exc:
            return f"the gateway still lists replica {index}: {exc}"
        return None

    def bring_back(self, index: int, wait_s: float = REGISTER_WAIT_S) -> str | None:
        """The replica passed its gates: registered again (None), or why not."""
        if not self.per_replica:
            return None
        try:
            self.register(index, wait_s)
        except GatewayError as exc:
            return f"the gateway did not take replica {index} back: {exc}"
        return None

    # --- bring-up and teardown ------------------------------------------------------------

    def register_run(self, say: Callable[[str], None]) -> None:
        """Every replica (or the router), each listed healthy; GatewayError on the first
        that is not."""
        if self.gateway is None:
            return
        indices = [r.index for r in self.state.replicas] if self.per_replica else [None]
        for index in indices:
            worker = self.register(index)
            what = f"replica {index}" if index is not None else "the router"
            how = (" (it was listed already)" if worker.already_registered else
                   f" (replacing a stale entry {worker.replaced_id})" if worker.replaced_id
                   else "")
            say(f"registered {what} ({self.target(index)}) with {self.gateway.describe()}: "
                f"listed healthy as {worker.worker_id}{how}")

    def deregister_all(self) -> list[str]:
        """Remove every entry the run recorded; what the gateway may still list, in words
        (with the command that removes it), for teardown's leftovers."""
        record = self.state.record.gateway
        if record is None or not record.entries:
            return []
        if self.gateway is None:
            self.url, self.gateway = record.url, self.connect(record.url)
        left = []
        for entry in record.entries:
            try:
                self._remove(entry.target, entry.replica)
            except GatewayError as exc:
                left.append(f"the gateway {record.url} may still list {entry.target} ({exc}); "
                            f"remove it there (GET {record.url}/workers names its id, then "
                            f"DELETE {record.url}/workers/ID)")
        return left
