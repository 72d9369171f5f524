"""--register's bookkeeping (launcher/gateway_link.py) and the supervisor's router link that the
gateway follows, against an in-memory TEST STAND-IN of a gateway (the real SGLang gateway is
driven in test_launcher_gateway.py and test_engine_vllm_live.py)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from omni_dp.gateway import GatewayError, GatewayWorker
from omni_dp.launcher.bringup.gateway_link import GatewayLink
from omni_dp.launcher.planning.plan import LaunchPlanError
from omni_dp.launcher.record.state import RunState
from omni_dp.launcher.supervision import router_link
from omni_dp.launcher.supervision.crew import Crew
from omni_dp.launcher.supervision.restart_policy import RestartPolicy
from omni_dp.launcher.supervision.router_link import RouterLink
from omni_dp.procs import ProcessIdentity
from omni_dp.runfile import ReplicaState, RouterRecord

from support.plans import two_replica_plan

GATEWAY = "http://127.0.0.1:30000"


class StandinGateway:
    """TEST STAND-IN: a gateway's worker API in memory; `down` makes every call fail."""

    can_disable = False

    def __init__(self, delay_s: float = 0.0) -> None:
        self.listed: dict[str, str] = {}
        self.calls: list[tuple[str, str]] = []
        self.down = False
        self.delay_s = delay_s
        self._ids = iter(range(1, 1000))

    def describe(self) -> str:
        return f"the stand-in gateway at {GATEWAY}"

    def workers(self) -> list[GatewayWorker]:
        return [GatewayWorker(url, wid, True) for url, wid in self.listed.items()]

    def register(self, worker_url: str, *, wait_s: float) -> GatewayWorker:
        self.calls.append(("register", worker_url))
        time.sleep(self.delay_s)
        if self.down:
            raise GatewayError(f"no answer from {GATEWAY}")
        self.listed.setdefault(worker_url, f"w{next(self._ids)}")
        return GatewayWorker(worker_url, self.listed[worker_url], True)

    def deregister(self, worker_url: str) -> bool:
        self.calls.append(("deregister", worker_url))
        if self.down:
            raise GatewayError(f"no answer from {GATEWAY}")
        return self.listed.pop(worker_url, None) is not None


@pytest.fixture
def run(tmp_path) -> tuple[RunState, StandinGateway]:
    state = RunState.create(two_replica_plan(tmp_path, register=GATEWAY))
    return state, StandinGateway()


def link(state: RunState, gateway: StandinGateway) -> GatewayLink:
    return GatewayLink(state, gateway=lambda url: gateway)


def entries(state: RunState) -> list[tuple[str, int | None, str]]:
    record = state.record.gateway
    return sorted((e.target, e.replica, e.worker_id) for e in (record.entries if record else ()))


def test_every_replica_is_registered_and_recorded_with_its_gateway_id(run):
    state, gateway = run
    said: list[str] = []
    link(state, gateway).register_run(said.append)
    urls = [r.url for r in state.replicas]
    assert entries(state) == [(urls[0], 0, "w1"), (urls[1], 1, "w2")]
    assert state.record.gateway.url == GATEWAY
    assert said[0] == (f"registered replica 0 ({urls[0]}) with the stand-in gateway at "
                       f"{GATEWAY}: listed healthy as w1")


def test_a_target_is_recorded_before_the_gateway_is_asked_so_teardown_removes_it(run):
    state, gateway = run
    gateway.down = True  # the gateway may have added it before it failed to answer
    with pytest.raises(GatewayError):
        link(state, gateway).register(0)
    assert entries(state) == [(state.replica(0).url, 0, "")]
    gateway.down = False
    gateway.listed[state.replica(0).url] = "late"
    assert link(state, gateway).deregister_all() == []
    assert gateway.listed == {} and entries(state) == []


def test_an_entry_the_gateway_may_still_list_is_a_leftover_with_what_removes_it(run):
    state, gateway = run
    link(state, gateway).register_run(lambda line: None)
    gateway.down = True
    left = link(state, gateway).deregister_all()
    assert len(left) == 2
    assert left[0].startswith(f"the gateway {GATEWAY} may still list {state.replica(0).url}")
    assert f"DELETE {GATEWAY}/workers/ID" in left[0]
    assert len(entries(state)) == 2  # kept: a later `down` tries again


def test_two_restarts_registering_at_once_keep_both_entries(run):
    state, gateway = run
    gateway.delay_s = 0.05  # both read the record, then both write it
    shared = link(state, gateway)
    threads = [threading.Thread(target=shared.register, args=(i,)) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [e[1] for e in entries(state)] == [0, 1]


# --- the router link: the gateway follows the router ---------------------------------------------


def crew_link(state: RunState, gateway: StandinGateway, router_status: int) -> RouterLink:
    crew = Crew(state, replicas=None, say=lambda line: None, stop=threading.Event(),
                fail=lambda: None, policy=RestartPolicy.of(state.supervision))
    state.update(router=RouterRecord(ProcessIdentity(900, 1.0), 900, "http://router.test", (),
                                     "router.log"))
    router = RouterLink(crew, http=lambda *a, **k: (router_status, None))
    router.gateway = link(state, gateway)
    return router


def test_a_replica_taken_out_leaves_the_gateway_even_when_the_router_does_not_answer(run):
    state, gateway = run
    link(state, gateway).register_run(lambda line: None)
    router = crew_link(state, gateway, router_status=0)  # the router is dead
    assert router.set_disabled(1, True) is False  # not done at the router: said so
    assert state.replica(1).url not in gateway.listed  # but out of the gateway
    assert ("deregister", state.replica(1).url) in gateway.calls


def test_back_in_the_router_is_back_only_once_the_gateway_lists_it_and_never_after_teardown(run):
    state, gateway = run
    router = crew_link(state, gateway, router_status=200)
    for state_now in (ReplicaState.STARTING, ReplicaState.HEALTHY):  # retried when healthy
        state.update_replica(0, state=state_now)
    gateway.down = True
    assert router.enable(0) is False and 0 in router.not_in_router
    gateway.down = False
    router.retry_enable(skip=lambda index: False)
    assert router.not_in_router == set() and state.replica(0).url in gateway.listed
    router.crew.gate.close()  # teardown began: a late registration would outlive it
    calls = len(gateway.calls)
    assert router.set_disabled(1, False) is False
    assert gateway.calls[calls:] == []


# --- the plan: what --register can and cannot do, said before anything starts -----------------


def test_a_remote_gateway_registering_the_router_needs_the_routers_address(tmp_path):
    with pytest.raises(LaunchPlanError) as info:
        two_replica_plan(tmp_path, register="http://gateway.example:30000", register_as="router")
    assert "give --register-url http://THIS_HOST:PORT" in str(info.value)
    plan = two_replica_plan(tmp_path, register="http://gateway.example:30000",
                            register_as="router", register_url="http://host-a:8000")
    assert plan.to_json()["register_url"] == "http://host-a:8000"


def test_registering_speech_replicas_or_a_remote_gateway_is_warned_about(tmp_path):
    plan = two_replica_plan(tmp_path, register="http://gateway.example:30000")
    warnings = "\n".join(plan.warnings)
    assert "does not proxy /v1/audio/speech" in warnings
    assert "the replicas listen on 127.0.0.1, so that gateway must run on this host" in warnings
    with pytest.raises(LaunchPlanError) as info:
        two_replica_plan(tmp_path, register_url="http://host-a:8000")
    assert "--register-url is the router's URL for --register-as router" in str(info.value)


def test_a_router_restart_keeps_asking_for_a_replica_the_gateway_did_not_take_back(
        run, monkeypatch):
    state, gateway = run
    monkeypatch.setattr(router_link, "start_router",
                        lambda state: SimpleNamespace(pid=901, popen=None))
    router = crew_link(state, gateway, router_status=200)
    router.not_in_router.add(1)  # its registration failed before the router died
    router.restart(0.0, [])
    assert router.not_in_router == {1}  # the new router has it; the gateway still does not
