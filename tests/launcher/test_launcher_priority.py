"""`launch` tells the router to put the class into vLLM's `priority` field (--priority-field)
only when the vLLM replicas run with --scheduling-policy priority (engine args after `--`):
under its default policy vLLM refuses any priority but 0."""

from __future__ import annotations

import pytest

from omni_dp.cli import router as router_command
from omni_dp.launcher.planning.run import plan_router

from support.plans import healthy_facts, opts


def router_argv(tmp_path, **options) -> list[str]:
    part, problems = plan_router(opts(**options), healthy_facts(tmp_path))
    assert problems == [] and part is not None
    return list(part.argv)


@pytest.mark.parametrize("engine_args", [
    ("m", "--scheduling-policy", "priority"),
    ("m", "--scheduling-policy=priority"),
    ("m", "--scheduling_policy", "priority"),
])
def test_vllm_with_priority_scheduling_gets_the_priority_field(tmp_path, engine_args):
    argv = router_argv(tmp_path, engine="vllm", engine_args=engine_args)
    assert argv.count("--priority-field") == 1
    tail = argv[argv.index("router") + 1:]
    assert router_command.make_context("router", tail).params["priority_field"] is True


@pytest.mark.parametrize(("engine_args", "order"), [
    (("m", "--enable-priority-scheduling"), "high-first"),
    (("m", "--enable_priority_scheduling", "--schedule-low-priority-values-first"), "low-first"),
])
def test_sglang_with_priority_scheduling_gets_the_field_in_its_order(tmp_path, engine_args,
                                                                     order):
    argv = router_argv(tmp_path, engine="sglang", engine_args=engine_args)
    tail = argv[argv.index("router") + 1:]
    params = router_command.make_context("router", tail).params
    assert params["priority_field"] is True and params["priority_field_order"] == order


@pytest.mark.parametrize("engine, engine_args", [
    ("vllm", ("m",)),
    ("vllm", ("m", "--scheduling-policy", "fcfs")),
    ("sglang", ("m", "--scheduling-policy", "priority")),  # not vLLM's field
])
def test_no_priority_field_otherwise(tmp_path, engine, engine_args):
    assert "--priority-field" not in router_argv(tmp_path, engine=engine,
                                                 engine_args=engine_args)
