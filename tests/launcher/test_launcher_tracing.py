"""`launch --otlp-traces-endpoint URL` hands the URL to the router and to each replica of an
engine that takes it (builtin, vLLM: the flag has the same name in both); a bad URL is a
problem naming the flag, before anything starts."""

from __future__ import annotations

from omni_dp.cli import router as router_command
from omni_dp.cli.commands.serve import serve as serve_command
from omni_dp.launcher.planning.checks import check_options
from omni_dp.launcher.planning.plan import plan_launch

from support.plans import healthy_facts, opts

URL = "http://127.0.0.1:4318/v1/traces"


def tail_after(argv, word: str) -> list[str]:
    return list(argv[list(argv).index(word) + 1:])


def test_the_router_and_each_builtin_replica_get_the_endpoint(tmp_path):
    plan = plan_launch(opts(otlp_traces_endpoint=URL), healthy_facts(tmp_path))
    router = router_command.make_context("router", tail_after(plan.router_argv, "router"))
    assert router.params["otlp_traces_endpoint"] == URL
    assert len(plan.replicas) == 2
    for replica in plan.replicas:
        serve = serve_command.make_context("serve", tail_after(replica.argv, "serve"))
        assert serve.params["otlp_traces_endpoint"] == URL


def test_without_it_nobody_traces(tmp_path):
    plan = plan_launch(opts(), healthy_facts(tmp_path))
    argvs = [plan.router_argv, *(r.argv for r in plan.replicas)]
    assert not [argv for argv in argvs if "--otlp-traces-endpoint" in argv]


def test_a_bad_endpoint_is_a_problem_naming_the_flag():
    problems = check_options(opts(otlp_traces_endpoint="127.0.0.1:4318"))
    assert [p for p in problems if p.startswith("--otlp-traces-endpoint must be an http")]
