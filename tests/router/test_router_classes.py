"""Priority classes, the pure part (omni_dp/router/classes.py) and their router settings: which
class a request is in, from its headers and the defaults; vLLM's `priority` field spliced into
a body; the flags' checks."""

from __future__ import annotations

import json

import pytest

from omni_dp.contract import BadPriority, Priority
from omni_dp.router.classes import PriorityRules, parse_route_priority, with_priority_field
from omni_dp.router.config import RouterConfigError, plan_router

RULES = PriorityRules(Priority.DEFAULT, {"/v1/audio/speech": Priority.INTERACTIVE})


@pytest.mark.parametrize(("headers", "path", "expected"), [
    ({}, "/v1/completions", Priority.DEFAULT),  # the router's default
    ({}, "/v1/audio/speech", Priority.INTERACTIVE),  # the route's
    ({"X-Omni-DP-Priority": "bulk"}, "/v1/audio/speech", Priority.BULK),  # named beats route
    ({"x-smg-priority": "system"}, "/x", Priority.INTERACTIVE),  # smg's system is ours
    ({"x-smg-priority": "bulk"}, "/x", Priority.BULK),
    ({"x-smg-priority": "urgent"}, "/v1/audio/speech", Priority.DEFAULT),  # as smg takes it
    ({"x-smg-priority": "bulk", "X-Omni-DP-Priority": "interactive"}, "/x",
     Priority.INTERACTIVE),  # ours wins
])
def test_a_request_class_comes_from_its_headers_then_its_route_then_the_router(
        headers, path, expected):
    assert RULES.resolve(headers, path) is expected


@pytest.mark.parametrize(("value", "expected"), [
    (" Interactive ", Priority.INTERACTIVE), ("BULK", Priority.BULK),
    ("", Priority.DEFAULT),  # empty: named none, so the route's, then the router's
])
def test_our_header_ignores_case_and_spaces_as_the_replica_does(value, expected):
    assert RULES.resolve({"X-Omni-DP-Priority": value}, "/x") is expected


@pytest.mark.parametrize("value", ["urgent", "inter active", "0"])
def test_our_header_takes_the_class_names_only(value):
    with pytest.raises(BadPriority) as caught:
        RULES.resolve({"X-Omni-DP-Priority": value}, "/x")
    assert "X-Omni-DP-Priority" in str(caught.value)
    assert "interactive, default, bulk" in str(caught.value)


def test_vllm_priority_lower_runs_first():
    assert [p.vllm_priority for p in Priority] == [-1, 0, 1]


@pytest.mark.parametrize(("body", "expected"), [
    (b'{"model": "m", "prompt": "x"}', {"model": "m", "prompt": "x", "priority": 1}),
    (b"{}", {"priority": 1}),
    (b'{ "prompt": "x" }\n', {"prompt": "x", "priority": 1}),
])
def test_the_priority_field_is_spliced_into_a_json_object(body, expected):
    out = with_priority_field(body, Priority.BULK)
    assert json.loads(out) == expected
    assert out.startswith(body.rstrip()[:-1].rstrip())  # the client's bytes stay as they were


@pytest.mark.parametrize("body", [b'{"priority": 7}', b"[1, 2]", b"not json", b""])
def test_a_client_priority_or_a_body_that_is_no_object_is_left_alone(body):
    assert with_priority_field(body, Priority.INTERACTIVE) == body


def test_an_engine_that_runs_higher_values_first_gets_them_negated():
    """sglang under --enable-priority-scheduling runs higher values first (vLLM: lower)."""
    high = [json.loads(with_priority_field(b"{}", p, low_first=False))["priority"]
            for p in Priority]
    low = [json.loads(with_priority_field(b"{}", p))["priority"] for p in Priority]
    assert high == [1, 0, -1] and low == [-1, 0, 1]


def test_route_priority_is_path_equals_class():
    assert parse_route_priority("/v1/a=b=bulk") == ("/v1/a=b", Priority.BULK)
    for bad in ("v1/x=bulk", "/v1/x", "/v1/x=urgent"):
        with pytest.raises(ValueError):
            parse_route_priority(bad)


def test_priority_settings_are_checked_all_at_once():
    with pytest.raises(RouterConfigError) as caught:
        plan_router(["http://127.0.0.1:1"], default_priority="urgent",
                    route_priorities=("/x=urgent",), reserved_interactive=2, max_inflight=2,
                    queue_timeout_bulk_s=-1.0, max_queued=-1)
    text = str(caught.value)
    for flag in ("--default-priority", "--route-priority", "--reserved-interactive",
                 "--queue-timeout-interactive, -default and -bulk", "--max-queued"):
        assert flag in text, (flag, text)


def test_the_default_settings_keep_a_full_router_refusing_default_requests_at_once():
    config = plan_router(["http://127.0.0.1:1"])
    assert config.queue_timeout(Priority.DEFAULT) == 0
    assert config.reserved_interactive == 0 and not config.priority_field
    assert config.priority_rules().resolve({}, "/v1/audio/speech") is Priority.DEFAULT


def test_each_router_worker_keeps_its_share_of_the_interactive_slots_and_the_queue():
    from omni_dp.router.workers import child_config

    config = plan_router(["http://127.0.0.1:1"], workers=2, port=8000, max_inflight=8,
                         reserved_interactive=3, max_queued=9)
    child = child_config(config)
    assert (child.max_inflight, child.reserved_interactive, child.max_queued) == (4, 2, 5)
