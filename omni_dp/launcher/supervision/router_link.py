"""The supervisor's side of the router: taking a replica out and back in (PUT /workers/INDEX
with the run's API key), the healthy replicas it did not take back (asked again every sweep),
and restarting a router that died. Under --register (per replica) the fleet gateway follows:
out with the router, back only once it lists the replica healthy again. A call counts as done
only on a 2xx (the gateway: listed healthy); every other outcome is said, recorded and never
reported as done.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omni_dp.blocking_http import http_json
from omni_dp.contract import API_KEY_ENV
from omni_dp.launcher.bringup.gateway_link import REGISTER_WAIT_S, GatewayLink
from omni_dp.launcher.bringup.steps import BringUpFailed, start_router
from omni_dp.launcher.record.events import Event
from omni_dp.launcher.supervision.crew import Crew
from omni_dp.launcher.supervision.hang_watch import replica_index
from omni_dp.launcher.supervision.indices import SharedIndices
from omni_dp.launcher.supervision.outcomes import Outcomes, RouterLeftOut
from omni_dp.launcher.supervision.restart_policy import GiveUp
from omni_dp.runfile import ReplicaState

RETRY_WAIT_S = 5.0  # a sweep's retry of the gateway waits this long at most


def admin_error(index: int, disabled: bool, status: int, body: object) -> str:
    """What a refused PUT /workers/INDEX means, in words (with the fix for a 401)."""
    said = body.get("error") if isinstance(body, dict) else None
    return (f"the router did not take replica {index} " + ("out" if disabled else "back")
            + f": PUT /workers/{index} answered {status or 'nothing'}"
            + (f" ({said})" if said else "")
            + (f"; the router wants an API key: launch with --api-key (or {API_KEY_ENV}) so "
               "that the supervisor sends it" if status == 401 else ""))


@dataclass(frozen=True)
class Routing:
    """What the router says of one replica it lists (GET /workers)."""

    routable: bool  # it sends that replica requests now
    why: str  # when not routable, in words: taken out, or how its own checks see it


def routing_of(worker: dict) -> Routing:
    """A GET /workers entry (one with a boolean `routable`), in words where not routable."""
    if worker["routable"]:
        return Routing(True, "")
    if worker.get("disabled"):
        return Routing(False, "taken out of the router")
    ejected = worker.get("ejected_reason")
    return Routing(False, f"the router's health checks find it {worker.get('health')}"
                   + (f" (ejected: {ejected})" if ejected else ""))


class RouterLink:
    def __init__(self, crew: Crew, *, http: Callable[..., tuple[int, object]] = http_json
                 ) -> None:
        self.crew = crew
        self.http = http
        # healthy, but the router did not take it back: the loop's (a thread's change is an
        # outcome the loop applies: left_out), the sweep reads it
        self.not_in_router = SharedIndices()
        self.outcomes: Outcomes | None = None  # the loop's queue, where a supervisor runs one
        self.gateway: GatewayLink | None = None  # --register: made when first needed
        self.restarts: tuple[float, ...] = ()  # when each router restart began

    # --- admin calls ------------------------------------------------------------------------

    def set_disabled(self, index: int, disabled: bool, *, warn: bool = True,
                     gateway_wait_s: float = REGISTER_WAIT_S) -> bool:
        """True only on a 2xx — and, under --register (per replica), once the fleet gateway
        listed the replica healthy again; any other answer is an event and, with warn, a
        warning and the replica's last_error. Taking a replica out also takes it out of the
        gateway, whatever the router answered (a dead router must not keep the gateway
        sending to a replica that restarts)."""
        state = self.crew.state
        status, body = self._put(index, disabled)
        action = "disabled" if disabled else "enabled"
        done = 200 <= status < 300
        if done:
            state.event(Event.ROUTER_DISABLED if disabled else Event.ROUTER_ENABLED,
                        replica=index, status=status)
        else:
            error = admin_error(index, disabled, status, body)
            state.event(Event.ROUTER_ADMIN_FAILED, replica=index, action=action, status=status,
                        error=error)
            if warn:
                state.update_replica(index, last_error=error)
                self.crew.say(f"warning: {error}")
        if disabled:
            self._gateway(index, True, warn, gateway_wait_s)
            return done
        return done and self._gateway(index, False, warn, gateway_wait_s)

    def _gateway(self, index: int, disabled: bool, warn: bool, wait_s: float) -> bool:
        """The gateway follows the router: out before a restart (a failure there is said, and
        the restart goes on: its health checks will see the replica gone), back after — not
        once teardown began (it removes the run's entries; a late one would outlive it)."""
        if self.gateway is None:
            self.gateway = GatewayLink(self.crew.state)
        if not self.gateway.per_replica:
            return True
        if not disabled and self.crew.gate.closed:
            return False
        error = (self.gateway.take_out(index) if disabled
                 else self.gateway.bring_back(index, wait_s))
        if error is None:
            return True
        self.crew.state.event(Event.GATEWAY_ADMIN_FAILED, replica=index,
                              action="deregister" if disabled else "register", error=error)
        if warn:
            self.crew.state.update_replica(index, last_error=error)
            self.crew.say(f"warning: {error}")
        return False

    def _put(self, index: int, disabled: bool) -> tuple[int, object]:
        router = self.crew.state.record.router
        if router is None:
            return 0, None  # no router recorded: nothing answered
        return self.http("PUT", f"{router.url}/workers/{index}", {"disabled": disabled},
                         headers=self._headers())

    def _headers(self) -> dict[str, str]:
        key = self.crew.state.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def add(self, index: int, url: str) -> str | None:
        """A new replica (a scale-up) into the router, disabled until it passed its gates
        (enable() then takes it in). None when done; else the refusal in words, said and
        recorded."""
        router = self.crew.state.record.router
        status, body = (0, None) if router is None else self.http(
            "POST", f"{router.url}/workers", {"url": url, "id": str(index), "disabled": True},
            headers=self._headers())
        return self._said("added", index, status, body)

    def remove(self, index: int) -> str | None:
        """A replica scaled away out of the router for good (its requests finish normally).
        None when done; else the refusal in words, said and recorded."""
        router = self.crew.state.record.router
        status, body = (0, None) if router is None else self.http(
            "DELETE", f"{router.url}/workers/{index}", headers=self._headers())
        return self._said("removed", index, status, body)

    def _said(self, action: str, index: int, status: int, body: object) -> str | None:
        if 200 <= status < 300:
            done = {"added": Event.ROUTER_ADDED, "removed": Event.ROUTER_REMOVED}[action]
            self.crew.state.event(done, replica=index, status=status)
            return None
        said = body.get("error") if isinstance(body, dict) else None
        verb = {"added": "add", "removed": "remove"}[action]
        error = (f"the router did not {verb} replica {index}: answered {status or 'nothing'}"
                 + (f" ({said})" if said else ""))
        self.crew.state.event(Event.ROUTER_ADMIN_FAILED, replica=index, action=action,
                              status=status, error=error)
        self.crew.say(f"warning: {error}")
        return error

    def in_flight(self, index: int) -> int | None:
        """The requests the router has in flight on this replica (None: it cannot say)."""
        router = self.crew.state.record.router
        workers = None if router is None else self.crew.probe.router_workers(
            router.url, self.crew.state.api_key)
        entry = next((w for w in workers or [] if w.get("id") == str(index)), None)
        value = entry.get("in_flight") if entry else None
        return value if isinstance(value, int) else None

    def routing(self) -> dict[int, Routing] | None:
        """Each replica the router lists, by index, routable or why not; None when the router
        did not say (none recorded, dead, restarting, or entries without `routable`): then
        only the record can."""
        router = self.crew.state.record.router
        workers = None if router is None else self.crew.probe.router_workers(
            router.url, self.crew.state.api_key)
        if workers is None or not all(isinstance(w, dict) and isinstance(w.get("routable"), bool)
                                      for w in workers):
            return None
        listed = ((replica_index(w.get("id")), w) for w in workers)
        return {index: routing_of(w) for index, w in listed if index is not None}

    def drain(self, index: int, timeout_s: float, poll_s: float = 0.1) -> bool:
        """Wait, at most timeout_s, until the router has nothing in flight on the replica (it
        was taken out first: nothing new comes); True when drained."""
        deadline = self.crew.clock() + timeout_s
        while (left := self.in_flight(index)) not in (0, None):
            if self.crew.clock() >= deadline or self.crew.stop.wait(poll_s):
                return False
        return left == 0

    def enable(self, index: int) -> bool:
        """Back in the router, or remembered as not (retried by retry_enable)."""
        back = self.set_disabled(index, False)
        self.left_out([index], out=not back)
        return back

    def left_out(self, indices: list[int], *, out: bool = True, every: bool = False) -> None:
        """Change which replicas are asked back at every sweep: from a thread, handed to the
        loop; from the loop (or with no loop), here."""
        change = RouterLeftOut(tuple(indices), out, every)
        if self.outcomes is None or not self.outcomes.handed(change):
            self.apply_left_out(change)

    def apply_left_out(self, change: RouterLeftOut) -> None:
        """The loop's side of left_out."""
        if change.every:
            self.not_in_router.clear()
        if change.out:
            self.not_in_router.update(change.indices)
        else:
            self.not_in_router.difference_update(change.indices)

    def retry_enable(self, skip: Callable[[int], bool]) -> None:
        """Put back the healthy replicas the router did not take back (skip: a restart owns
        that replica now)."""
        state = self.crew.state
        for index in self.not_in_router:  # a copy, in order
            if skip(index) or state.replica(index).state is not ReplicaState.HEALTHY:
                continue
            # a short wait for the gateway: the sweep must not stall on it; one failure ends
            # this sweep's retries (the gateway is likely down for the others too)
            if not self.set_disabled(index, False, warn=False, gateway_wait_s=RETRY_WAIT_S):
                break
            self.not_in_router.discard(index)
            state.update_replica(index, last_error=None)
            self.crew.say(f"replica {index}: back in the router"
                          + (" and the gateway" if self.gateway and self.gateway.per_replica
                             else ""))

    # --- a router that died -----------------------------------------------------------------

    def died(self, pid: int) -> float | None:
        """Say so and decide: the delay before restarting it, or None when the restart budget
        is spent (the run is stopped: nothing serves without a router)."""
        state = self.crew.state
        decision = self.crew.policy.decide(self.restarts, self.crew.clock())
        if isinstance(decision, GiveUp):
            why = f"restart budget exhausted ({decision.reason})"
            self.crew.say(f"the router died; {why}; stopping the run")
            state.event(Event.ROUTER_DIED, pid=pid)
            state.event(Event.ROUTER_FAILED, reason=why)
            self.crew.fail()
            return None
        self.crew.say("the router died; restarting it")
        state.event(Event.ROUTER_DIED, pid=pid)
        self.restarts = decision.history
        return decision.delay

    def restart(self, delay: float, reap: list) -> None:
        """The restart thread: a new router; every replica not healthy is taken out of it (a
        new router starts with every replica in)."""
        if self.crew.stop.wait(delay):
            return
        with self.crew.gate.open() as may:
            if not may:
                return
            try:
                router = start_router(self.crew.state)
            except (BringUpFailed, OSError) as exc:  # OSError: its argv cannot be run
                self.crew.state.event(Event.ROUTER_RESTART_FAILED, error=str(exc))
                first = (str(exc).splitlines() or [""])[0]
                self.crew.say(f"the router restart failed: {first}")
                return
        reap.append(router.popen)
        self.crew.say(f"router restarted (pid {router.pid}), ready")
        # The new router takes every replica in; under --register (per replica) one the
        # gateway did not take back is still out of it: kept, retry_enable asks both again.
        if self.gateway is None:
            self.gateway = GatewayLink(self.crew.state)
        if not self.gateway.per_replica:
            self.left_out([], every=True)
        for record in self.crew.state.replicas:
            if record.state is not ReplicaState.HEALTHY:
                self.set_disabled(record.index, True)
