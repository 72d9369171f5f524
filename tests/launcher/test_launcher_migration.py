"""`launch --migration-limit / --migration-max-seq-len`: passed to the router only when given
(each default lives in the router's RouterConfig), with the engine's migration endpoints, and
refused (exit 2, by name) when out of range or for an engine without token streams."""

from __future__ import annotations

import pytest

from omni_dp.cli import router as router_command
from omni_dp.launcher.planning.checks import check_options
from omni_dp.launcher.planning.options import LaunchOptions
from omni_dp.launcher.planning.run import plan_router
from omni_dp.router.config import RouterConfig

from support.plans import healthy_facts, opts


def router_argv(tmp_path, **options) -> list[str]:
    part, problems = plan_router(opts(**options), healthy_facts(tmp_path))
    assert problems == [] and part is not None
    return list(part.argv)


def flags(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == flag]


def test_nothing_is_passed_unless_given(tmp_path):
    argv = router_argv(tmp_path, engine="vllm")
    assert not [a for a in argv if a.startswith("--migration")]
    assert RouterConfig().migration_limit == 0  # the router's default: off


@pytest.mark.parametrize("engine, paths", [
    ("vllm", ["/v1/completions", "/v1/chat/completions"]),
    ("sglang", ["/v1/completions"]),  # sglang refuses token ids on streamed chat
])
def test_the_router_gets_the_limit_and_the_engines_endpoints(tmp_path, engine, paths):
    argv = router_argv(tmp_path, engine=engine, migration_limit=2, migration_max_seq_len=4096)
    assert flags(argv, "--migration-limit") == ["2"]
    assert flags(argv, "--migration-path") == paths
    assert flags(argv, "--migration-max-seq-len") == ["4096"]
    # and the router's own command line takes them as given
    tail = argv[argv.index("router") + 1:]
    params = router_command.make_context("router", tail).params
    assert (params["migration_limit"], params["migration_max_seq_len"]) == (2, 4096)
    assert params["migration_paths"] == tuple(paths)


@pytest.mark.parametrize("options, problem", [
    ({"migration_limit": -1}, "--migration-limit must be 0 or more, got -1"),
    ({"migration_max_seq_len": 0}, "--migration-max-seq-len must be at least 1, got 0"),
    ({"migration_limit": 1}, "--migration-limit: engine builtin streams no token ids"),
    ({"migration_limit": 1, "engine": "sglang-omni"},
     "--migration-limit: engine sglang-omni streams no token ids"),
])
def test_bad_values_are_refused_by_name(tmp_path, options, problem):
    problems = check_options(LaunchOptions(**options))
    assert [p for p in problems if p.startswith(problem)], problems
    assert plan_router(opts(**options), healthy_facts(tmp_path)) == (None, [])


def test_limit_0_is_passed_for_any_engine(tmp_path):
    assert check_options(LaunchOptions(migration_limit=0)) == []
    assert flags(router_argv(tmp_path, migration_limit=0), "--migration-limit") == ["0"]
