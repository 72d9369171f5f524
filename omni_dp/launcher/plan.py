"""Options + machine facts in, a validated launch plan (or every problem at once) out.

Pure: no file, socket, process or daemon is created here, so a bad launch exits 2 with nothing
left behind, and tests can plan for machines they do not have.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from omni_dp.launcher.engines import ENGINES, EngineSizing, ReplicaLaunch, reserved_flag_problems
from omni_dp.launcher.facts import LaunchFacts, visible_id
from omni_dp.launcher.options import (
    MPS_FAULT_ACTIONS,
    START_MODES,
    LaunchOptions,
    replica_ports,
)
from omni_dp.launcher.topology import CpuPlan, format_cpu_list, plan_auto, plan_explicit
from omni_dp.logs import LOG_FORMATS
from omni_dp.mps.binaries import MpsBinaries
from omni_dp.mps.daemon import private_dir_problem
from omni_dp.rundir import RUN_ID, mps_log_dir, mps_pipe_dir, run_dir
from omni_dp.sizes import format_size

POLICIES = ("least_request", "round_robin", "power_of_two", "random")
MAX_SECONDS = 7 * 24 * 3600.0  # any timeout or interval beyond is a typo (and overflows poll())
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                    "NUMEXPR_NUM_THREADS")


class LaunchPlanError(ValueError):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class ReplicaPlan:
    index: int
    port: int
    cpus: tuple[int, ...] | None  # None: unpinned (--cpu-blocks none)
    argv: tuple[str, ...]  # the pinning wrapper, then the engine
    env: dict[str, str]  # what the launcher sets (the run token is added at spawn, not kept)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_name(self) -> str:
        return f"replica_{self.index}.log"


@dataclass(frozen=True)
class LaunchPlan:
    options: LaunchOptions
    run_id: str
    run_dir: Path
    device: str  # "cpu" or "cuda"
    gpu_label: str  # "GPU-<uuid>" or "cpu": what run.json's "gpu" holds
    gpu_numa_node: int | None
    start: str
    replicas: tuple[ReplicaPlan, ...]
    router_argv: tuple[str, ...]
    router_url: str
    expected_kv_tokens: int  # what every replica must report
    sizing: EngineSizing
    mps_binary: str | None
    warnings: tuple[str, ...] = field(default=())
    mps_binaries: MpsBinaries | None = None  # the located pair; mps_binary is its control
    command: str = "omni-dp"  # how the user runs omni-dp, for the commands we print

    def describe(self) -> list[str]:
        """The resolved plan, as printed before anything starts."""
        o = self.options
        s = self.sizing
        lines = [
            f"run {self.run_id}: {len(self.replicas)} replica(s) of engine {o.engine} on "
            f"{self.gpu_label}{' under a private MPS daemon' if o.mps else ''}",
            f"  state        {self.run_dir}",
            f"  per replica  weights {format_size(s.weights_bytes)} + KV "
            f"{format_size(s.kv_cache_bytes)} ({s.kv_tokens} tokens) + overhead "
            f"{format_size(s.overhead_bytes)} on {s.device}"
            + ("" if o.kv_cache_bytes or o.max_total_tokens else
               f"; KV pinned to the engine's fixed default of {s.kv_tokens} tokens"),
            f"  start        {self.start}",
            f"  router       {self.router_url} (policy {o.policy}, {o.router_workers} "
            "worker(s))",
        ]
        for r in self.replicas:
            cpus = format_cpu_list(r.cpus) if r.cpus else "unpinned"
            lines.append(f"  replica {r.index}    {r.url}  cpus {cpus}")
        lines += [f"  warning: {w}" for w in self.warnings]
        return lines

    def to_json(self) -> dict:
        o = self.options
        return {
            "replicas": len(self.replicas), "engine": o.engine, "engine_args": list(o.engine_args),
            "config_file": o.config_file,
            "device": self.device, "gpu": self.gpu_label, "gpu_numa_node": self.gpu_numa_node,
            "mps": o.mps, "start": self.start, "cpu_blocks": o.cpu_blocks,
            "kv_cache_bytes": o.kv_cache_bytes, "max_total_tokens": o.max_total_tokens,
            "expected_kv_tokens": self.expected_kv_tokens,
            "router": {"url": self.router_url, "policy": o.policy, "workers": o.router_workers,
                       "argv": list(self.router_argv)},
            "supervision": {"check_interval": o.check_interval,
                            "health_failures": o.health_failures,
                            "restart_budget": o.restart_budget,
                            "restart_window": o.restart_window,
                            "on_mps_fault": o.on_mps_fault,
                            "health_timeout": o.health_timeout,
                            "drain_timeout": o.drain_timeout},
            "log_format": o.log_format,  # the supervisor's and the replica log banners'
            "warnings": list(self.warnings),
            "command": self.command,  # for the commands the detached supervisor prints
            "api_key_set": o.api_key is not None,  # the key itself never goes to disk
        }


def check_options(o: LaunchOptions) -> list[str]:
    """What is wrong with the options alone, whatever the machine."""
    problems = []
    if o.replicas < 1:
        problems.append(f"--replicas must be at least 1, got {o.replicas}")
    if o.kv_cache_bytes is not None and o.max_total_tokens is not None:
        problems.append("--kv-cache-bytes and --max-total-tokens are exclusive: pin the KV "
                        "cache by bytes OR by tokens")
    elif (o.replicas > 1 and o.kv_cache_bytes is None and o.max_total_tokens is None
          and not getattr(ENGINES.get(o.engine), "fixed_default_kv", False)):
        problems.append(
            f"--replicas {o.replicas} needs a pinned KV size: give --max-total-tokens N or "
            "--kv-cache-bytes SIZE. Without one, each replica sizes its KV from the memory free "
            "when it starts, so later replicas get less"
        )
    if o.kv_cache_bytes is not None and o.kv_cache_bytes <= 0:
        problems.append("--kv-cache-bytes must be positive")
    if o.max_total_tokens is not None and o.max_total_tokens <= 0:
        problems.append("--max-total-tokens must be positive")
    if o.start is not None and o.start not in START_MODES:
        problems.append(f"--start must be one of {', '.join(START_MODES)}, got {o.start!r}")
    if o.on_mps_fault not in MPS_FAULT_ACTIONS:
        problems.append(f"--on-mps-fault must be one of {', '.join(MPS_FAULT_ACTIONS)}")
    if o.policy not in POLICIES:
        problems.append(f"--policy must be one of {', '.join(POLICIES)}, got {o.policy!r}")
    if o.log_format not in LOG_FORMATS:
        problems.append(f"--log-format must be one of {', '.join(LOG_FORMATS)}, got "
                        f"{o.log_format!r}")
    if o.router_workers < 1:
        problems.append("--router-workers must be at least 1")
    engine = ENGINES.get(o.engine)
    if engine is None:
        problems.append(f"engine {o.engine!r} is not known; known: {', '.join(ENGINES)}")
    else:
        problems += reserved_flag_problems(engine, o.engine_args)
    if o.run_id is not None and not RUN_ID.match(o.run_id):
        problems.append(f"--run-id {o.run_id!r} is not a run id: 1-64 letters, digits, '_', "
                        "'.', '-', starting with a letter or digit (no path separators)")
    # nan passes every comparison below it (and then stops the supervisor's loop), inf too
    for name, zero_ok in (("health_timeout", False), ("check_interval", False),
                          ("restart_window", False), ("drain_timeout", True)):
        seconds = getattr(o, name)
        if not (math.isfinite(seconds) and (seconds >= 0 if zero_ok else seconds > 0)
                and seconds <= MAX_SECONDS):
            lowest = "0" if zero_ok else "more than 0"
            problems.append(f"--{name.replace('_', '-')} must be a number of seconds from "
                            f"{lowest} to {MAX_SECONDS:.0f} (7 days), got {seconds}")
    if o.health_failures < 1 or o.restart_budget < 0:
        problems.append("--health-failures must be ≥ 1 and --restart-budget ≥ 0")
    if not 0 <= o.memory_headroom < 1:
        problems.append(f"--memory-headroom must be a fraction in [0, 1), got "
                        f"{o.memory_headroom}")
    problems += _api_key_problems(o.api_key)
    if o.no_gpu_check and not o.mps:
        problems.append("--no-gpu-check only applies to --mps")
    problems += _port_range_problems(o)
    return problems


def _api_key_problems(key: str | None) -> list[str]:
    """The key travels in an HTTP header: visible ASCII only. Never echoed back."""
    if key is None:
        return []
    if not key.strip():
        return ["--api-key (or OMNI_DP_API_KEY, or api_key in --config) must not be empty"]
    if not all(33 <= ord(c) <= 126 for c in key):
        return ["--api-key (or OMNI_DP_API_KEY, or api_key in --config) must be printable "
                "ASCII without spaces: it is sent in an HTTP header"]
    return []


def _port_range_problems(o: LaunchOptions) -> list[str]:
    problems = []
    last = o.base_port + max(o.replicas, 1) - 1
    if o.base_port < 1 or last > 65535:
        problems.append(f"--base-port {o.base_port}: replica ports {o.base_port}-{last} must "
                        "lie within 1-65535")
    if not 1 <= o.router_port <= 65535:
        problems.append(f"--router-port must be 1-65535, got {o.router_port}")
    elif o.base_port <= o.router_port <= last:
        problems.append(f"--router-port {o.router_port} falls in the replica port range "
                        f"{o.base_port}-{last}; move one of them")
    return problems


def plan_launch(o: LaunchOptions, facts: LaunchFacts, *,
                earlier_problems: tuple[str, ...] | list[str] = ()) -> LaunchPlan:
    """earlier_problems: found before planning (the --config file's); reported with the
    plan's. The engine's dry run is skipped while any exist, so no plan can be made then."""
    problems = [*earlier_problems, *check_options(o)]
    warnings: list[str] = []
    run_id = o.run_id or facts.new_run_id
    directory = run_dir(facts.state_root, run_id)

    # GPU: which device the replicas use.
    gpu = facts.gpu
    if o.gpu not in ("auto", "none") and gpu is None:
        problems += facts.gpu_problems or [f"--gpu {o.gpu}: no such GPU"]
    if o.mps and gpu is None and not o.no_gpu_check:
        why = "; ".join(facts.gpu_problems) or "NVML sees no GPU here"
        problems.append(f"--mps needs a GPU, and there is none to use ({why}); run without "
                        "--mps to use the CPU")
    if o.mps and gpu is None and o.no_gpu_check:
        warnings.append("--no-gpu-check: no GPU, the replicas run on CPU; the MPS daemon runs "
                        "but no process can attach to it, so attach verification will fail")
    if o.mps and gpu is not None and not gpu.uuid:
        problems.append(
            f"--mps: NVML could not read the UUID of GPU {gpu.index}; the MPS daemon and its "
            "clients must name the GPU by UUID (a client's CUDA_VISIBLE_DEVICES index is "
            "renumbered under MPS and names the right GPU only by chance); check "
            f"`nvidia-smi -L` and the driver, or run without --mps")
    device = "cuda" if gpu is not None else "cpu"
    gpu_label = visible_id(gpu) or "cpu"
    problems += facts.mps_problems

    # Run id and state.
    for run in facts.runs:
        if run.run_id == run_id:
            problems.append(
                f"run {run_id} is still running; pick another --run-id or stop it: "
                f"{facts.command} down {run_id}" if run.live else
                f"the state of an earlier run {run_id} is kept at {run.directory}; remove it "
                f"with `{facts.command} down {run_id}` or pick another --run-id")
        elif not run.live and run.gpu == gpu_label:
            warnings.append(f"stale state of run {run.run_id} (same GPU) is kept at "
                            f"{run.directory}; `{facts.command} down {run.run_id}` removes "
                            "it")
        elif run.live and run.gpu == gpu_label and gpu is not None:
            warnings.append(f"run {run.run_id} is live on the same GPU; both runs will share it")
    root_problem = private_dir_problem(facts.state_root)
    if root_problem:
        problems.append(f"state directory: {root_problem} (set OMNI_DP_STATE_DIR to use "
                        "another)")

    # Ports.
    for port in replica_ports(o):
        if port in facts.taken_ports:
            problems.append(f"port {port} (replica {port - o.base_port}) is in use; pick "
                            "another --base-port")
    if facts.host_problem:
        problems.append(facts.host_problem)
    if o.router_port in facts.taken_ports:
        problems.append(f"port {o.router_port} on {o.host} (router) is in use; pick another "
                        "--router-port")

    cpus = len(facts.topology.allowed)
    if o.router_workers > max(cpus, 1):  # a typo here would fork that many routers
        problems.append(f"--router-workers {o.router_workers}: more router processes than the "
                        f"{cpus} CPU(s) this process may use gain nothing; use at most {cpus}")

    # CPU blocks.
    cpu_plan = _plan_cpus(o, facts)
    problems += cpu_plan.problems
    warnings += cpu_plan.warnings

    # The engine's own word on its options and sizes, and whether N of them fit.
    problems += facts.engine_problems
    sizing = facts.sizing
    if sizing is not None:
        if o.max_total_tokens is not None and sizing.kv_tokens != o.max_total_tokens:
            problems.append(
                f"--max-total-tokens {o.max_total_tokens}: the engine would allocate "
                f"{sizing.kv_tokens} tokens (whole KV pages); ask for {sizing.kv_tokens}")
        problems += _memory_problems(o, facts, sizing, device)

    start = o.start or "parallel"  # every engine adapter here sizes KV to a fixed size
    if problems:
        raise LaunchPlanError(problems)
    if sizing is None:  # no dry run, and nothing said why: never plan without the engine's word
        raise LaunchPlanError(["the engine's dry run did not run, so the replicas' sizes are "
                               "unknown; run `omni-dp serve --dry-run` with the engine "
                               "arguments to see why"])

    engine = ENGINES[o.engine]
    replicas = []
    for i in range(o.replicas):
        cpus = cpu_plan.blocks[i] if cpu_plan.blocks else None
        threads = len(cpus) if cpus else max(1, len(facts.topology.allowed) // o.replicas)
        port = o.base_port + i
        env = {"OMNI_DP_RUN_ID": run_id, "OMNI_DP_REPLICA": str(i),
               "CUDA_VISIBLE_DEVICES": visible_id(gpu),
               **{name: str(threads) for name in THREAD_VARIABLES}}
        if o.mps:
            env["CUDA_MPS_PIPE_DIRECTORY"] = str(mps_pipe_dir(directory))
            env["CUDA_MPS_LOG_DIRECTORY"] = str(mps_log_dir(directory))
        # No knob given: pin the engine's fixed default explicitly, so every replica (and every
        # restart) is started with the very number the dry run reported.
        tokens = o.max_total_tokens
        if o.kv_cache_bytes is None and o.max_total_tokens is None:
            tokens = sizing.kv_tokens
        argv = engine.argv(ReplicaLaunch(port, device, threads, o.kv_cache_bytes, tokens,
                                         log_format=o.log_format), o.engine_args)
        replicas.append(ReplicaPlan(i, port, cpus, tuple(_pinned(argv, cpus, facts)), env))

    router_url = f"http://{_url_host(o.host)}:{o.router_port}"
    router_argv = [sys.executable, "-m", "omni_dp", "router", "--host", o.host,
                   "--port", str(o.router_port), "--policy", o.policy,
                   "--workers", str(o.router_workers), "--drain-timeout", str(o.drain_timeout),
                   "--log-format", o.log_format]
    for r in replicas:
        router_argv += ["--replica", f"{r.index}={r.url}"]
    return LaunchPlan(
        options=o, run_id=run_id, run_dir=directory, device=device, gpu_label=gpu_label,
        gpu_numa_node=facts.gpu_numa_node, start=start, replicas=tuple(replicas),
        router_argv=tuple(router_argv), router_url=router_url,
        expected_kv_tokens=sizing.kv_tokens, sizing=sizing, mps_binary=facts.mps_binary,
        mps_binaries=facts.mps_binaries,
        warnings=tuple(warnings), command=facts.command,
    )


def _plan_cpus(o: LaunchOptions, facts: LaunchFacts) -> CpuPlan:
    if o.replicas < 1 or o.cpu_blocks == "none":
        return CpuPlan()
    if o.cpu_blocks == "auto":
        return plan_auto(facts.topology, o.replicas, facts.gpu_numa_node)
    return plan_explicit(facts.topology, o.replicas, o.cpu_blocks, facts.gpu_numa_node)


def _memory_problems(o: LaunchOptions, facts: LaunchFacts, sizing: EngineSizing,
                     device: str) -> list[str]:
    need = o.replicas * sizing.total_bytes
    each = (f"{o.replicas} × (weights {format_size(sizing.weights_bytes)} + KV "
            f"{format_size(sizing.kv_cache_bytes)} + overhead {format_size(sizing.overhead_bytes)})"
            f" = {format_size(need)}")
    if device == "cuda" and facts.gpu is not None and facts.gpu.memory_total_bytes:
        total = facts.gpu.memory_total_bytes
        used = facts.gpu.memory_used_bytes or 0
        usable = int(total * (1 - o.memory_headroom)) - used
        if need > usable:
            return [f"GPU memory: {each} does not fit: the GPU has {format_size(total)}, "
                    f"{format_size(used)} already in use, {o.memory_headroom:.0%} kept as "
                    f"headroom → {format_size(max(usable, 0))} usable; lower the KV size or "
                    "the replica count"]
    elif device == "cpu" and need > facts.host_memory_available:
        return [f"host memory: {each} does not fit in the "
                f"{format_size(facts.host_memory_available)} available; lower the KV size or "
                "the replica count"]
    return []


def _pinned(argv: list[str], cpus: tuple[int, ...] | None, facts: LaunchFacts) -> list[str]:
    """Pin before the engine executes anything: our exec wrapper sets the affinity, then (when
    numactl is there and the block is on the GPU's node) numactl binds memory to that node."""
    if not cpus:
        return argv
    prefix = [sys.executable, "-m", "omni_dp.launcher.pin", format_cpu_list(cpus), "--"]
    node = facts.gpu_numa_node
    nodes = {core.node for core in facts.topology.cores if set(core.cpus) & set(cpus)}
    if facts.numactl and node is not None and nodes == {node}:
        prefix += [facts.numactl, f"--membind={node}", "--"]
    return prefix + argv


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host
