"""Where a run lives and listens: its id and directory, the state root, the replicas' ports, the
router's URL and command line."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from omni_dp.files import private_dir_problem
from omni_dp.launcher.engines import ENGINES
from omni_dp.launcher.engines.sglang import sglang_priority_order
from omni_dp.launcher.engines.vllm import schedules_by_priority
from omni_dp.launcher.planning.checks import (
    migration_problems,
    replica_count_problems,
    replica_port_problems,
    router_fault_args,
    router_port_problems,
    router_worker_problems,
    run_id_problems,
)
from omni_dp.launcher.planning.facts import LaunchFacts
from omni_dp.launcher.planning.options import (
    LaunchOptions,
    replica_ports,
)
from omni_dp.rundir import run_dir


@dataclass(frozen=True)
class RunPart:
    run_id: str
    directory: Path


@dataclass(frozen=True)
class RouterPart:
    url: str
    argv: tuple[str, ...]  # without the --replica entries


def plan_run(o: LaunchOptions, facts: LaunchFacts) -> tuple[RunPart | None, list[str]]:
    """The run's id and directory: an id no earlier run's state still holds."""
    if run_id_problems(o):
        return None, []
    run_id = o.run_id or facts.new_run_id
    problems = []
    for run in facts.runs:
        if run.run_id != run_id:
            continue
        problems.append(
            f"run {run_id} is still running; pick another --run-id or stop it: "
            f"{facts.command} down {run_id}" if run.live else
            f"the state of an earlier run {run_id} is kept at {run.directory}; remove it "
            f"with `{facts.command} down {run_id}` or pick another --run-id")
    if problems:
        return None, problems
    return RunPart(run_id, run_dir(facts.state_root, run_id)), []


def plan_state_root(facts: LaunchFacts) -> tuple[Path | None, list[str]]:
    """The state root must be ours alone (or not exist yet): it holds every run's token."""
    problem = private_dir_problem(facts.state_root)
    if problem:
        return None, [f"state directory: {problem} (set OMNI_DP_STATE_DIR to use another)"]
    return facts.state_root, []


def plan_ports(o: LaunchOptions, facts: LaunchFacts) -> tuple[tuple[int, ...] | None, list[str]]:
    """One free loopback port per replica."""
    if replica_count_problems(o) or replica_port_problems(o):
        return None, []
    ports = tuple(replica_ports(o))
    problems = [f"port {port} (replica {port - o.base_port}) is in use; pick another "
                "--base-port" for port in ports if port in facts.taken_ports]
    return (None, problems) if problems else (ports, [])


def plan_router(o: LaunchOptions, facts: LaunchFacts) -> tuple[RouterPart | None, list[str]]:
    """Where the router listens, and how many worker processes it forks."""
    problems = [facts.host_problem] if facts.host_problem else []
    if o.router_port in facts.taken_ports:
        problems.append(f"port {o.router_port} on {o.host} (router) is in use; pick another "
                        "--router-port")
    cpus = len(facts.topology.allowed)
    if o.router_workers > cpus:  # a typo here would fork that many routers
        problems.append(f"--router-workers {o.router_workers}: more router processes than the "
                        f"{cpus} CPU(s) this process may use gain nothing; use at most {cpus}")
    if problems or router_port_problems(o) or router_worker_problems(o) \
            or migration_problems(o):
        return None, problems
    argv = (sys.executable, "-m", "omni_dp", "router", "--host", o.host,
            "--port", str(o.router_port), "--policy", o.policy,
            "--workers", str(o.router_workers), "--drain-timeout", str(o.drain_timeout),
            "--log-format", o.log_format, *router_fault_args(o))
    argv += migration_argv(o) + priority_argv(o) + tracing_argv(o)
    return RouterPart(f"http://{url_host(o.host)}:{o.router_port}", argv), []


# Engines that take --otlp-traces-endpoint URL: ours, and vLLM's flag of that very name.
TRACED_ENGINES = ("builtin", "vllm")


def tracing_argv(o: LaunchOptions) -> tuple[str, ...]:
    """--otlp-traces-endpoint for the router, and for each replica of an engine that has it."""
    if o.otlp_traces_endpoint is None:
        return ()
    return ("--otlp-traces-endpoint", o.otlp_traces_endpoint)


def migration_argv(o: LaunchOptions) -> tuple[str, ...]:
    """The router's migration flags, only those given (each default lives in the router), and
    the endpoints whose streams the engine gives token ids for."""
    argv: tuple[str, ...] = ()
    if o.migration_limit is not None:
        argv += ("--migration-limit", str(o.migration_limit))
        for path in ENGINES[o.engine].migration_paths:
            argv += ("--migration-path", path)
    if o.migration_max_seq_len is not None:
        argv += ("--migration-max-seq-len", str(o.migration_max_seq_len))
    return argv


def priority_argv(o: LaunchOptions) -> tuple[str, ...]:
    """--priority-field for vLLM replicas run with --scheduling-policy priority, or sglang ones
    run with --enable-priority-scheduling (given after `--`): the router then tells the engine
    each request's class in its `priority` field, in the engine's order. Never otherwise:
    vLLM refuses a priority other than 0 under its default policy, and sglang may abort one."""
    if o.engine == "vllm" and schedules_by_priority(o.engine_args):
        return ("--priority-field",)
    if o.engine == "sglang":
        order = sglang_priority_order(o.engine_args)
        if order is not None:
            return ("--priority-field", "--priority-field-order", order)
    return ()


def url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host
