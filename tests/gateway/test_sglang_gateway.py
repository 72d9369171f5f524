"""omni_dp.gateway.SglangGateway against the REAL SGLang model gateway (sglang-router 0.3.2,
scripts/setup-gateway), with stand-in workers (support/gateway_standin.py) that count the
requests the gateway routes to them.

One gateway serves the module (its start costs a second or two); every test removes what it
registered. The gateway's flags keep each test bounded (support/sglang_gateway.py).
"""

from __future__ import annotations

import json
import time

import pytest

from omni_dp.gateway import Gateway, GatewayError, SglangGateway, normalize_url

from support.gateway_standin import GatewayWorkerStandin
from support.http_client import request
from support.ports import LOOPBACK, free_port
from support.sglang_gateway import STARTUP_GIVE_UP_S, SglangGatewayProcess, smg_path
from support.wait import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gateway_process(tmp_path_factory):
    process = SglangGatewayProcess(smg_path(), tmp_path_factory.mktemp("gateway") / "smg.log")
    try:
        yield process.wait_ready()
    finally:
        process.stop()


@pytest.fixture
def gateway(gateway_process):
    """A client of the module's gateway; whatever a test left registered is removed after it."""
    client = SglangGateway(gateway_process.url, timeout_s=5.0)
    yield client
    for worker in client.workers():
        client.deregister(worker.url)
    assert client.workers() == []


@pytest.fixture
def standins():
    """Start stand-in workers by name; all are closed after the test."""
    started: list[GatewayWorkerStandin] = []

    def start(name: str, *, healthy: bool = True) -> GatewayWorkerStandin:
        started.append(GatewayWorkerStandin(name, healthy=healthy))
        return started[-1]

    yield start
    for standin in started:
        standin.close()


@pytest.fixture(scope="module")
def sick_standins():
    """Stand-ins that never turn healthy, kept open until the module's end: a registration the
    client gave up on goes on in the gateway for STARTUP_GIVE_UP_S, and a port closed under it
    could be reused by another test's stand-in, which that job would then register."""
    started: list[GatewayWorkerStandin] = []

    def start(name: str) -> GatewayWorkerStandin:
        started.append(GatewayWorkerStandin(name, healthy=False))
        return started[-1]

    yield start
    for standin in started:
        standin.close()


def complete(gateway_url: str, prompt: str = "hello") -> tuple[int, dict | bytes]:
    """One /v1/completions through the gateway: (status, parsed body or the raw bytes)."""
    status, _, body = request("POST", gateway_url + "/v1/completions",
                              {"model": "standin", "prompt": prompt, "max_tokens": 2},
                              timeout=10.0)
    try:
        return status, json.loads(body)
    except ValueError:
        return status, body


def listed(gateway: SglangGateway, url: str) -> list:
    return [w for w in gateway.workers() if normalize_url(w.url) == normalize_url(url)]


def test_register_waits_until_listed_healthy_and_then_traffic_reaches_the_worker(
        gateway, gateway_process, standins):
    a = standins("a")
    started = time.monotonic()
    worker = gateway.register(a.url, wait_s=10)
    took = time.monotonic() - started

    assert isinstance(gateway, Gateway) and not gateway.can_disable
    assert (worker.url, worker.healthy, worker.disabled) == (a.url, True, None)
    assert not worker.already_registered and worker.replaced_id is None
    assert worker.model_id == "a"  # from the stand-in's served_model_name: no model hub asked
    assert took < 5, f"registration took {took:.2f} s"
    assert [w.worker_id for w in listed(gateway, a.url)] == [worker.worker_id]
    # what registration probed: health, the info endpoints, and its gRPC detection (HTTP/2)
    assert a.hits["/health"] >= 1 and a.hits["/server_info"] == 1
    assert a.hits["/model_info"] == 1 and a.http2_probes >= 1

    status, body = complete(gateway_process.url)
    assert status == 200, body
    assert body["choices"][0]["text"] == " from a"
    assert a.completions == 1


def test_registering_a_listed_url_again_returns_that_entry_and_leaves_one(gateway, standins):
    a = standins("a")
    first = gateway.register(a.url, wait_s=10)
    posts_before = a.hits["/server_info"]

    again = gateway.register(a.url + "/", wait_s=10)  # the same worker, spelled otherwise

    assert again.already_registered and again.worker_id == first.worker_id
    assert again.replaced_id is None and again.healthy
    assert len(listed(gateway, a.url)) == 1
    assert a.hits["/server_info"] == posts_before  # nothing was posted: no second probe


def test_a_leftover_entry_gone_unhealthy_is_replaced_by_a_fresh_healthy_one(gateway, standins):
    """As after a kill -9: the gateway still lists the URL, and its health checks have seen
    the worker gone. Waiting for them to believe in it again would take their success
    threshold times their interval; register() replaces the entry instead."""
    a = standins("a")
    stale = gateway.register(a.url, wait_s=10)
    a.healthy = False
    wait_for("the gateway to see the stand-in unhealthy",
             lambda: listed(gateway, a.url)[0].healthy is False, timeout=10, interval=0.1)
    a.healthy = True

    fresh = gateway.register(a.url, wait_s=10)

    assert fresh.healthy and fresh.already_registered
    assert fresh.replaced_id == stale.worker_id
    assert [w.healthy for w in listed(gateway, a.url)] == [True]


def test_deregister_removes_the_worker_and_traffic_stops_reaching_it(
        gateway, gateway_process, standins):
    a, b = standins("a"), standins("b")
    gateway.register(a.url, wait_s=10)
    gateway.register(b.url, wait_s=10)
    for i in range(4):
        assert complete(gateway_process.url, f"before {i}")[0] == 200
    assert (a.completions, b.completions) == (2, 2)  # round robin: both take traffic

    assert gateway.deregister(a.url) is True

    assert listed(gateway, a.url) == [] and len(listed(gateway, b.url)) == 1
    for i in range(4):
        status, body = complete(gateway_process.url, f"after {i}")
        assert status == 200 and body["choices"][0]["text"] == " from b", body
    assert (a.completions, b.completions) == (2, 6)
    assert gateway.deregister(a.url) is False  # a second time: nothing listed


def test_deregistering_a_url_never_registered_is_false(gateway):
    assert gateway.deregister(f"http://{LOOPBACK}:{free_port()}") is False


def test_a_worker_that_never_turns_healthy_times_out_naming_url_and_job(gateway, sick_standins):
    sick = sick_standins("sick")
    started = time.monotonic()
    with pytest.raises(GatewayError) as caught:
        gateway.register(sick.url, wait_s=1.5)
    took = time.monotonic() - started

    message = str(caught.value)
    assert took < 1.5 + 1.0, f"register() waited {took:.2f} s"
    assert sick.url in message and "within 1.5 s" in message
    assert "its job " in message and "processing" in message
    assert "reachable from the gateway" in message
    assert listed(gateway, sick.url) == []
    assert sick.hits["/health"] >= 1 and sick.hits["/server_info"] == 0


def test_a_registration_the_gateway_gives_up_fails_with_the_gateways_words(
        gateway, sick_standins):
    sick = sick_standins("sick-too")
    started = time.monotonic()
    with pytest.raises(GatewayError) as caught:
        gateway.register(sick.url, wait_s=STARTUP_GIVE_UP_S + 10)
    took = time.monotonic() - started

    message = str(caught.value)
    assert took < STARTUP_GIVE_UP_S + 5, f"register() took {took:.2f} s"
    assert f"could not register {sick.url}" in message
    assert "failed" in message and "health" in message.lower()


def test_an_unreachable_gateway_is_a_gateway_error_that_says_so():
    """No gateway needed: nothing listens on the port."""
    url = f"http://{LOOPBACK}:{free_port()}"
    gateway = SglangGateway(url, timeout_s=2.0)
    for call in (gateway.workers, lambda: gateway.register("http://127.0.0.1:1", wait_s=1),
                 lambda: gateway.deregister("http://127.0.0.1:1")):
        with pytest.raises(GatewayError) as caught:
            call()
        message = str(caught.value)
        assert f"no answer from the SGLang model gateway at {url}" in message
        assert "connection refused" in message and "is it running" in message


def test_a_gateway_that_wants_a_key_says_so_and_takes_it(tmp_path, standins):
    admin = "k1:omni-dp tests:admin:s3cret"
    with SglangGatewayProcess(smg_path(), tmp_path / "smg.log",
                              "--control-plane-api-keys", admin) as process:
        process.wait_ready()
        with pytest.raises(GatewayError) as caught:
            SglangGateway(process.url, timeout_s=5.0).workers()
        message = str(caught.value)
        assert "refused GET /workers: 401" in message
        assert "Missing or invalid Authorization header" in message  # the gateway's words
        assert "API key" in message

        keyed = SglangGateway(process.url, timeout_s=5.0, api_key="s3cret")
        a = standins("a")
        assert keyed.register(a.url, wait_s=10).healthy
        assert keyed.deregister(a.url) is True


def test_urls_are_normalized_the_way_the_gateway_must_be_given_them():
    assert normalize_url("127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert normalize_url(" HTTP://LocalHost:8000/ ") == "http://localhost:8000"
    assert normalize_url("http://[::1]:8000//") == "http://[::1]:8000"
    assert normalize_url("https://gw.example/prefix/") == "https://gw.example/prefix"
    for bad in ("ftp://h:1", "http://", "http://h:1/?x=1"):
        with pytest.raises(ValueError):
            normalize_url(bad)
    with pytest.raises(GatewayError, match="--register"):
        SglangGateway("ftp://h:1")
