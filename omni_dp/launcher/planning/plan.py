"""Options + machine facts in, a validated launch plan (or every problem at once) out.

Pure: no file, socket, process or daemon is created here, so a bad launch exits 2 with nothing
left behind, and tests can plan for machines they do not have.

A pipeline of sub-planners, each `(options, facts[, earlier parts]) -> (part | None, problems)`.
A part is None when it has a problem of its own, or when an option it reads was refused
(check_options says why, once); no planner builds on a part that is None. plan_launch runs them
all, so every problem is reported at once, and builds the replicas and the router only from
complete parts.
"""

from __future__ import annotations

import math
import re
import sys
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from omni_dp.contract import REPLICA_ENV, RUN_ID_ENV, Problems
from omni_dp.files import private_dir_problem
from omni_dp.gateway import normalize_url
from omni_dp.gpus import GpuFacts
from omni_dp.launcher.engines import (
    ENGINES,
    EngineSizing,
    KvPlan,
    KvRequest,
    ReplicaLaunch,
    reserved_flag_problems,
    split_model,
)
from omni_dp.launcher.planning.facts import LaunchFacts, visible_id
from omni_dp.launcher.planning.gpus import (
    GpuGroup,
    gpu_groups,
    gpu_option_problems,
    with_gpu_replicas,
)
from omni_dp.launcher.planning.options import (
    MPS_FAULT_ACTIONS,
    REGISTER_AS,
    START_MODES,
    LaunchOptions,
    replica_ports,
)
from omni_dp.launcher.planning.share_group import LEADER, followers, share_role
from omni_dp.launcher.planning.topology import (
    format_cpu_list,
    plan_auto,
    plan_auto_gpus,
    plan_explicit,
)
from omni_dp.logs import LOG_FORMATS
from omni_dp.mps.binaries import MpsBinaries
from omni_dp.rundir import RUN_ID, engine_work_dir, mps_log_dir, mps_pipe_dir, run_dir, share_dir
from omni_dp.runfile import GpuRecord, gpu_key
from omni_dp.sizes import format_size

POLICIES = ("least_request", "round_robin", "power_of_two", "random")
STAGE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
MAX_SECONDS = 7 * 24 * 3600.0  # any timeout or interval beyond is a typo (and overflows poll())
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                    "NUMEXPR_NUM_THREADS")
SEGMENT_SLACK_BYTES = 16 * 1024**2
NO_DRY_RUN = ("the engine's dry run did not run, so the replicas' sizes are unknown; run "
              "`omni-dp serve --dry-run` with the engine arguments to see why")


class LaunchPlanError(Problems):
    """Every problem that stops this launch, before anything was started."""


@dataclass(frozen=True)
class ReplicaPlan:
    index: int
    port: int
    cpus: tuple[int, ...] | None  # None: unpinned (--cpu-blocks none)
    argv: tuple[str, ...]  # the pinning wrapper, then the engine
    env: dict[str, str]  # what the launcher sets (the run token is added at spawn, not kept)
    gpu: int = 0  # the slot of its GPU in LaunchPlan.gpus

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
    gpu_label: str  # "GPU-<uuid>" or "cpu" (comma-separated over GPUs): run.json's "gpu"
    gpu_numa_node: int | None  # the first GPU's
    start: str
    replicas: tuple[ReplicaPlan, ...]
    router_argv: tuple[str, ...]
    router_url: str
    expected_kv_tokens: int | None  # what every replica must report (None: equal to each other)
    sizing: EngineSizing
    mps_binary: str | None
    warnings: tuple[str, ...] = field(default=())
    mps_binaries: MpsBinaries | None = None  # the located pair; mps_binary is its control
    command: str = "omni-dp"  # how the user runs omni-dp, for the commands we print
    start_timeout: float = 300.0  # --start-timeout, or the engine's default
    kv_notes: tuple[str, ...] = ()  # how the engine adapter wrote the KV pin
    gpus: tuple[GpuRecord, ...] = ()  # the run's GPUs by slot (one "cpu" slot without one)

    def describe(self) -> list[str]:
        """The resolved plan, as printed before anything starts."""
        o = self.options
        s = self.sizing
        sharing = followers(o.share_weights, (r.index for r in self.replicas))
        weights = format_size(s.weights_bytes)
        if o.share_weights:
            weights += (f" ({format_size(s.shared_weights_bytes)} shared, "
                        f"{format_size(s.private_weights_bytes)} private)")
        several = len(self.gpus) > 1
        where = (f"{len(self.gpus)} GPUs" if several else self.gpu_label)
        daemon = (" under a private MPS daemon per GPU" if several
                  else " under a private MPS daemon")
        lines = [
            f"run {self.run_id}: {len(self.replicas)} replica(s) of engine {o.engine} on "
            f"{where}{daemon if o.mps else ''}",
            f"  state        {self.run_dir}",
            f"  per replica  weights {weights} + KV "
            f"{format_size(s.kv_cache_bytes)} ({self._kv_words()}) + overhead "
            f"{format_size(s.overhead_bytes)} on {s.device}",
            *(f"  kv pin       {note}" for note in self.kv_notes),
            *([f"  processes    {self._processes_words()}"] if len(s.processes) > 1 else []),
            *self._memory_lines(),
            *([f"  share        replica {LEADER} leads (loads the weights, publishes them in "
               f"{share_dir(self.run_dir)}); "
               + (f"replica(s) {', '.join(map(str, sharing))} follow "
                  "(map them), started once it published, stopped before it"
                  if sharing else "no follower")] if o.share_weights else []),
            f"  start        {self.start} (each healthy within {self.start_timeout:g} s)",
            f"  router       {self.router_url} (policy {o.policy}, {o.router_workers} "
            "worker(s))",
        ]
        for r in self.replicas:
            cpus = format_cpu_list(r.cpus) if r.cpus else "unpinned"
            on = f"  {self.gpus[r.gpu].title}" if several else ""
            lines.append(f"  replica {r.index}    {r.url}  cpus {cpus}{on}")
        lines += [f"  warning: {w}" for w in self.warnings]
        return lines

    def _memory_lines(self) -> list[str]:
        """The fit formula: the run's, or each GPU's with its share of the replicas."""
        o, s = self.options, self.sizing
        if len(self.gpus) <= 1:
            return [f"  memory       {memory_formula(s, len(self.replicas), o.share_weights)[1]}"]
        lines = []
        for gpu in self.gpus:
            mine = [r.index for r in self.replicas if r.gpu == gpu.slot]
            node = f", NUMA node {gpu.numa_node}" if gpu.numa_node is not None else ""
            lines.append(f"  {gpu.title:<12} replicas {format_cpu_list(mine)}{node}: "
                         f"{memory_formula(s, len(mine), o.share_weights)[1]}")
        return lines

    def _processes_words(self) -> str:
        """Each replica's processes by its placement, and the CUDA ones of the run."""
        s = self.sizing
        words = ", ".join(f"{name} ({device})" for name, device in s.processes) + " per replica"
        cuda = (s.cuda_processes or 0) * len(self.replicas)
        if cuda:
            words += f"; {cuda} CUDA process(es) in all, each an MPS client under --mps"
        return words

    def _kv_words(self) -> str:
        """What the KV line may claim: pinned (to what), or sized by the engine itself."""
        o, s = self.options, self.sizing
        pinned = o.kv_cache_bytes is not None or o.max_total_tokens is not None
        if not pinned and ENGINES[o.engine].fixed_default_kv:
            return f"{s.kv_tokens} tokens; pinned to the engine's fixed default"
        if not pinned:
            return "not pinned: one replica sizes its own pool, read back"
        if s.kv_tokens is None:
            return "tokens: the engine's count from the bytes, read back and compared"
        return f"{s.kv_tokens} tokens"

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
                            "health_failures": o.restart_after_failures,
                            "restart_budget": o.restart_budget,
                            "restart_window": o.restart_window,
                            "on_mps_fault": o.on_mps_fault,
                            "health_timeout": self.start_timeout,
                            "drain_timeout": o.drain_timeout},
            "log_format": o.log_format,  # the supervisor's and the replica log banners'
            "warnings": list(self.warnings),
            "command": self.command,  # for the commands the detached supervisor prints
            "api_key_set": o.api_key is not None,  # the key itself never goes to disk
            "share_weights": o.share_weights,
            "register": o.register, "register_as": o.register_as,
            "register_url": o.register_url,
            "replicas_per_gpu": o.replicas_per_gpu,
        }

    def gpus_json(self) -> list[dict]:
        """Each GPU slot with its replicas (run.json keeps them as the record's `gpus`)."""
        return [{**g.to_json(), "replicas": [r.index for r in self.replicas if r.gpu == g.slot]}
                for g in self.gpus]


# --- the options alone ----------------------------------------------------------------------
# Each check reads a few fields and returns its problems; a sub-planner that reads those fields
# asks the same check whether they were refused.


def _replica_count(o: LaunchOptions) -> list[str]:
    return [] if o.replicas >= 1 else [f"--replicas must be at least 1, got {o.replicas}"]


def _kv_pin(o: LaunchOptions) -> list[str]:
    if o.kv_cache_bytes is not None and o.max_total_tokens is not None:
        return ["--kv-cache-bytes and --max-total-tokens are exclusive: pin the KV cache by "
                "bytes OR by tokens"]
    unpinned = o.kv_cache_bytes is None and o.max_total_tokens is None
    if (o.replicas > 1 and unpinned
            and not getattr(ENGINES.get(o.engine), "fixed_default_kv", False)):
        what = (f"--gpus {o.gpus} ({o.replicas} replicas)" if o.gpus is not None
                else f"--replicas {o.replicas}")
        return [f"{what} needs a pinned KV size: give --max-total-tokens N or "
                "--kv-cache-bytes SIZE. Without one, each replica sizes its KV from the memory "
                "free when it starts, so later replicas get less"]
    return []


def _kv_sizes(o: LaunchOptions) -> list[str]:
    problems = []
    if o.kv_cache_bytes is not None and o.kv_cache_bytes <= 0:
        problems.append("--kv-cache-bytes must be positive")
    if o.max_total_tokens is not None and o.max_total_tokens <= 0:
        problems.append("--max-total-tokens must be positive")
    return problems


# (flag, field, allowed values, None allowed (the default chosen later), say what was given)
_CHOICES = (
    ("--start", "start", START_MODES, True, True),
    ("--on-mps-fault", "on_mps_fault", MPS_FAULT_ACTIONS, False, False),
    ("--policy", "policy", POLICIES, False, True),
    ("--log-format", "log_format", LOG_FORMATS, False, True),
    ("--register-as", "register_as", REGISTER_AS, False, True),
)


def _choices(o: LaunchOptions) -> list[str]:
    problems = []
    for flag, name, allowed, optional, say in _CHOICES:
        value = getattr(o, name)
        if value in allowed or (optional and value is None):
            continue
        problems.append(f"{flag} must be one of {', '.join(allowed)}"
                        + (f", got {value!r}" if say else ""))
    return problems


def _router_workers(o: LaunchOptions) -> list[str]:
    return [] if o.router_workers >= 1 else ["--router-workers must be at least 1"]


def _engine(o: LaunchOptions) -> list[str]:
    engine = ENGINES.get(o.engine)
    if engine is None:
        return [f"engine {o.engine!r} is not known; known: {', '.join(ENGINES)}"]
    problems = reserved_flag_problems(engine, o.engine_args)
    if not engine.external and (o.engine_python or o.engine_overhead is not None):
        problems.append("--engine-python and --engine-overhead are for external engines; the "
                        "built-in engine runs with omni-dp's interpreter and sizes itself")
    if not STAGE_NAME.match(o.engine_stage):
        problems.append(f"--engine-stage {o.engine_stage!r} is not a stage name: letters, "
                        "digits and '_'")
    return problems


def _run_id(o: LaunchOptions) -> list[str]:
    if o.run_id is None or RUN_ID.match(o.run_id):
        return []
    return [f"--run-id {o.run_id!r} is not a run id: 1-64 letters, digits, '_', '.', '-', "
            "starting with a letter or digit (no path separators)"]


# (field, may be 0): each a number of seconds up to MAX_SECONDS
_SECONDS = (("start_timeout", False), ("check_interval", False), ("restart_window", False),
            ("drain_timeout", True))


def _seconds(o: LaunchOptions) -> list[str]:
    problems = []
    # nan passes every comparison below it (and then stops the supervisor's loop), inf too
    for name, zero_ok in _SECONDS:
        seconds = getattr(o, name)
        if seconds is None:  # --start-timeout: the engine's default
            continue
        if (math.isfinite(seconds) and (seconds >= 0 if zero_ok else seconds > 0)
                and seconds <= MAX_SECONDS):
            continue
        lowest = "0" if zero_ok else "more than 0"
        problems.append(f"--{name.replace('_', '-')} must be a number of seconds from {lowest} "
                        f"to {MAX_SECONDS:.0f} (7 days), got {seconds}")
    return problems


def _restart_counts(o: LaunchOptions) -> list[str]:
    if o.restart_after_failures < 1 or o.restart_budget < 0:
        return ["--restart-after-failures must be ≥ 1 and --restart-budget ≥ 0"]
    return []


def _memory_headroom(o: LaunchOptions) -> list[str]:
    if 0 <= o.memory_headroom < 1:
        return []
    return [f"--memory-headroom must be a fraction in [0, 1), got {o.memory_headroom}"]


def _api_key(o: LaunchOptions) -> list[str]:
    """The key travels in an HTTP header: visible ASCII only. Never echoed back."""
    key = o.api_key
    if key is None:
        return []
    if not key.strip():
        return ["--api-key (or OMNI_DP_API_KEY, or api_key in --config) must not be empty"]
    if not all(33 <= ord(c) <= 126 for c in key):
        return ["--api-key (or OMNI_DP_API_KEY, or api_key in --config) must be printable "
                "ASCII without spaces: it is sent in an HTTP header"]
    return []


def _share_weights(o: LaunchOptions) -> list[str]:
    engine = ENGINES.get(o.engine)
    if not o.share_weights or engine is None or engine.shares_weights:
        return []
    able = ", ".join(name for name, e in ENGINES.items() if e.shares_weights)
    return [f"--share-weights: engine {o.engine} cannot share weights between replicas; only "
            f"{able} can: run without --share-weights"]


def _register(o: LaunchOptions) -> list[str]:
    """--register's URLs must be http(s) URLs the gateway can be given as they are."""
    problems = []
    for flag, url in (("--register", o.register), ("--register-url", o.register_url)):
        if url is None:
            continue
        try:
            normalize_url(url)
        except ValueError as exc:
            problems.append(f"{flag}: {exc}; give http://HOST:PORT")
    if o.register_url is not None and (o.register is None or o.register_as != "router"):
        problems.append("--register-url is the router's URL for --register-as router; "
                        "replicas are registered by their own URLs")
    if (o.register is not None and o.register_as == "router" and o.register_url is None
            and not problems and not _loopback_url(o.register)):
        problems.append(f"--register-as router with the gateway {o.register} on another host: "
                        "give --register-url http://THIS_HOST:PORT, the router's address as "
                        "that gateway reaches it (and --host 0.0.0.0 so the router listens "
                        "there)")
    return problems


def _loopback_url(url: str) -> bool:
    host = urllib.parse.urlsplit(normalize_url(url)).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


def _no_gpu_check(o: LaunchOptions) -> list[str]:
    return ["--no-gpu-check only applies to --mps"] if o.no_gpu_check and not o.mps else []


def _replica_ports(o: LaunchOptions) -> list[str]:
    if _replica_count(o):  # no replica ports to place
        return []
    last = o.base_port + o.replicas - 1
    if o.base_port < 1 or last > 65535:
        return [f"--base-port {o.base_port}: replica ports {o.base_port}-{last} must lie within "
                "1-65535"]
    return []


def _router_port(o: LaunchOptions) -> list[str]:
    if not 1 <= o.router_port <= 65535:
        return [f"--router-port must be 1-65535, got {o.router_port}"]
    if _replica_count(o):
        return []
    last = o.base_port + o.replicas - 1
    if o.base_port <= o.router_port <= last:
        return [f"--router-port {o.router_port} falls in the replica port range "
                f"{o.base_port}-{last}; move one of them"]
    return []


OPTION_CHECKS: tuple[Callable[[LaunchOptions], list[str]], ...] = (
    _replica_count, _kv_pin, _kv_sizes, _choices, _router_workers, _engine, _run_id, _seconds,
    _restart_counts, _memory_headroom, _api_key, _no_gpu_check, _replica_ports, _router_port,
    _share_weights, gpu_option_problems, _register,
)


def check_options(o: LaunchOptions) -> list[str]:
    """What is wrong with the options alone, whatever the machine."""
    return [problem for check in OPTION_CHECKS for problem in check(o)]


# --- the parts of a plan --------------------------------------------------------------------


@dataclass(frozen=True)
class GpuPart:
    gpu: GpuFacts | None  # the first GPU (the only one without --gpus); None: on the CPU
    device: str  # "cpu" or "cuda"
    label: str  # "GPU-<uuid>" (or the index), or "cpu"; comma-separated over GPUs
    warnings: tuple[str, ...] = ()
    groups: tuple[GpuGroup, ...] = ()  # one per GPU slot, with its replicas

    def group_of(self, index: int) -> GpuGroup:
        return next(g for g in self.groups if index in g.replicas)


@dataclass(frozen=True)
class MpsPart:
    binary: str | None  # the control binary; None without --mps
    binaries: MpsBinaries | None


@dataclass(frozen=True)
class RunPart:
    run_id: str
    directory: Path


@dataclass(frozen=True)
class RouterPart:
    url: str
    argv: tuple[str, ...]  # without the --replica entries


@dataclass(frozen=True)
class CpuPart:
    blocks: tuple[tuple[int, ...] | None, ...]  # one per replica; None: unpinned
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class KvPart:
    pin: KvPlan  # the engine adapter's: its arguments, what every replica holds and reports
    per_gpu: tuple[KvPlan, ...] = ()  # each GPU slot's pin (its own size); () with one GPU

    @property
    def sizing(self) -> EngineSizing:
        return self.pin.sizing

    def of(self, slot: int) -> KvPlan:
        """GPU slot's pin: the same tokens everywhere, the engine's knobs per GPU."""
        return self.per_gpu[slot] if self.per_gpu else self.pin


def plan_gpu(o: LaunchOptions, facts: LaunchFacts) -> tuple[GpuPart | None, list[str]]:
    """Which device the replicas use, and what --mps needs of it."""
    gpu = facts.gpu
    problems = []
    if o.gpu not in ("auto", "none") and gpu is None:
        problems += facts.gpu_problems or [f"--gpu {o.gpu}: no such GPU"]
    problems += _mps_gpu_problems(o, facts)
    engine = ENGINES.get(o.engine)
    if engine is not None and engine.needs_gpu and (gpu is None or o.gpu == "none"):
        on_cpu = ", ".join(name for name, e in ENGINES.items() if not e.needs_gpu)
        problems.append(f"engine {o.engine} needs a CUDA GPU and there is none to use"
                        + (" (--gpu none)" if o.gpu == "none" else "")
                        + f"; it cannot serve on the CPU (these can: {on_cpu})")
    if problems:
        return None, problems
    warnings = ()
    if o.mps and gpu is None:  # --no-gpu-check
        warnings = ("--no-gpu-check: no GPU, the replicas run on CPU; the MPS daemon runs but "
                    "no process can attach to it, so attach verification will fail",)
    # the replicas' indices only once their count is valid (10**30 of them must not be made)
    count = 0 if _replica_count(o) or _replica_ports(o) else o.replicas
    groups = (GpuGroup(0, gpu, gpu.index if gpu is not None else None, facts.gpu_numa_node,
                       tuple(range(count))),)
    return GpuPart(gpu, "cuda" if gpu is not None else "cpu", visible_id(gpu) or "cpu",
                   warnings, groups), []


def plan_gpus(o: LaunchOptions, facts: LaunchFacts) -> tuple[GpuPart | None, list[str]]:
    """--gpus: one slot per GPU, the replicas spread over them (o.replicas is the total)."""
    problems = list(facts.gpu_problems)
    if gpu_option_problems(o) or _replica_count(o) or _replica_ports(o):
        return None, problems
    listed = [(g, g.index, node) for g, node in zip(facts.gpus, facts.gpu_nodes, strict=True)]
    listed += [(None, index, None) for index in facts.unchecked_gpus]
    if not listed and not problems:
        problems.append(f"--gpus {o.gpus}: no GPU to use")
    if o.mps:
        problems += [_no_uuid(g) for g, _, _ in listed if g is not None and not g.uuid]
    engine = ENGINES.get(o.engine)
    if engine is not None and engine.needs_gpu and facts.unchecked_gpus:
        problems.append(f"engine {o.engine} needs CUDA GPUs; --no-gpu-check runs the replicas "
                        "on the CPU")
    if o.share_weights and len(listed) > 1:
        problems.append("--share-weights shares one copy of the weights on one GPU; with "
                        "--gpus over several GPUs each GPU would need its own leader, which "
                        "omni-dp does not do yet: run one launch per GPU, or without "
                        "--share-weights")
    if listed and o.replicas < len(listed):  # with_gpu_replicas said why
        return None, problems
    if problems:
        return None, problems
    groups = gpu_groups(listed, o.replicas)
    warnings: tuple[str, ...] = ()
    if facts.unchecked_gpus:
        warnings = (f"--no-gpu-check: GPUs {o.gpus} taken unchecked (NVML sees none): one MPS "
                    "daemon per GPU runs, the replicas run on the CPU and nothing can attach, "
                    "so attach verification will fail",)
    first = facts.gpus[0] if facts.gpus else None
    return GpuPart(first, "cuda" if first is not None else "cpu",
                   ",".join(g.label for g in groups), warnings, groups), []


def _no_uuid(gpu: GpuFacts) -> str:
    return (f"--mps: NVML could not read the UUID of GPU {gpu.index}; its MPS daemon and "
            "clients must name the GPU by UUID; check `nvidia-smi -L` and the driver, or run "
            "without --mps")


def _mps_gpu_problems(o: LaunchOptions, facts: LaunchFacts) -> list[str]:
    gpu = facts.gpu
    if not o.mps:
        return []
    if gpu is None and not o.no_gpu_check:
        why = "; ".join(facts.gpu_problems) or "NVML sees no GPU here"
        return [f"--mps needs a GPU, and there is none to use ({why}); run without --mps to "
                "use the CPU"]
    if gpu is not None and not gpu.uuid:
        return [f"--mps: NVML could not read the UUID of GPU {gpu.index}; the MPS daemon and "
                "its clients must name the GPU by UUID (a client's CUDA_VISIBLE_DEVICES index "
                "is renumbered under MPS and names the right GPU only by chance); check "
                "`nvidia-smi -L` and the driver, or run without --mps"]
    return []


def plan_mps(o: LaunchOptions, facts: LaunchFacts) -> tuple[MpsPart | None, list[str]]:
    """The MPS binaries the run uses, and the MPS preflight's word (read with the facts)."""
    if facts.mps_problems:
        return None, list(facts.mps_problems)
    return MpsPart(facts.mps_binary, facts.mps_binaries), []


def plan_run(o: LaunchOptions, facts: LaunchFacts) -> tuple[RunPart | None, list[str]]:
    """The run's id and directory: an id no earlier run's state still holds."""
    if _run_id(o):
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
    if _replica_count(o) or _replica_ports(o):
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
    if problems or _router_port(o) or _router_workers(o):
        return None, problems
    argv = (sys.executable, "-m", "omni_dp", "router", "--host", o.host,
            "--port", str(o.router_port), "--policy", o.policy,
            "--workers", str(o.router_workers), "--drain-timeout", str(o.drain_timeout),
            "--log-format", o.log_format)
    return RouterPart(f"http://{_url_host(o.host)}:{o.router_port}", argv), []


def plan_cpus(o: LaunchOptions, facts: LaunchFacts,
              gpu: GpuPart | None = None) -> tuple[CpuPart | None, list[str]]:
    """Each replica's CPU block: whole cores, disjoint, its GPU's NUMA node first (over
    several GPUs: each GPU's replicas on that GPU's node first, no core shared)."""
    if _replica_count(o):
        return None, []
    if o.cpu_blocks == "none":
        return CpuPart((None,) * o.replicas), []
    groups = gpu.groups if gpu is not None and len(gpu.groups) > 1 else ()
    if o.gpus is not None and not groups and gpu is None:
        return None, []  # plan_gpus said why: no GPUs to place the blocks by
    nodes = [g.numa_node for g in groups for _ in g.replicas] or None
    if o.cpu_blocks == "auto" and groups:
        cpu_plan = plan_auto_gpus(facts.topology, [(len(g.replicas), g.numa_node)
                                                   for g in groups])
    elif o.cpu_blocks == "auto":
        cpu_plan = plan_auto(facts.topology, o.replicas, facts.gpu_numa_node)
    else:
        cpu_plan = plan_explicit(facts.topology, o.replicas, o.cpu_blocks, facts.gpu_numa_node,
                                 nodes)
    if cpu_plan.problems:
        return None, cpu_plan.problems
    return CpuPart(tuple(cpu_plan.blocks), tuple(cpu_plan.warnings)), []


def plan_kv(o: LaunchOptions, facts: LaunchFacts,
            gpu: GpuPart | None = None) -> tuple[KvPart | None, list[str]]:
    """The KV pin in the engine's own knobs, from the engine's word on its sizes (the builtin
    engine's dry run, an external engine's model directory)."""
    engine = ENGINES.get(o.engine)
    if engine is None or _kv_pin(o) or _kv_sizes(o):
        return None, list(facts.engine_problems)
    if engine.needs_gpu and gpu is None:  # plan_gpu said why; a pin needs the GPU's size
        return None, list(facts.engine_problems)
    device = gpu.device if gpu is not None else ("cuda" if facts.gpu is not None else "cpu")
    groups = gpu.groups if gpu is not None and len(gpu.groups) > 1 else ()
    if not groups:
        request = _kv_request(o, facts, device, gpu.gpu if gpu is not None else facts.gpu,
                              o.replicas)
        pin, problems = engine.plan_kv(request)
        problems = [*facts.engine_problems, *problems]
        if pin is None or problems:
            return None, problems
        return KvPart(pin), []
    # One pin per GPU (its knobs may depend on the GPU's size), one token count for all.
    pins, problems = [], list(facts.engine_problems)
    for group in groups:
        pin, found = engine.plan_kv(_kv_request(o, facts, device, group.gpu,
                                                len(group.replicas)))
        problems += [p if group.title in p else f"{group.title}: {p}" for p in found]
        pins.append(pin)
    if problems or any(pin is None for pin in pins):
        return None, problems
    tokens = {group.title: pin.expected_tokens for group, pin in zip(groups, pins, strict=True)}
    if len(set(tokens.values())) > 1:
        return None, ["the GPUs' KV pins differ: " + ", ".join(
            f"{title} {count} tokens" for title, count in tokens.items())
            + "; every replica must hold the same KV: pin it by --max-total-tokens, or list "
            "GPUs of one model in --gpus"]
    return KvPart(pins[0], tuple(pins)), []


def _kv_request(o: LaunchOptions, facts: LaunchFacts, device: str, gpu: GpuFacts | None,
                replicas: int) -> KvRequest:
    return KvRequest(
        kv_cache_bytes=o.kv_cache_bytes, max_total_tokens=o.max_total_tokens,
        replicas=replicas, device=device, gpu=gpu, sizing=facts.sizing, model=facts.model,
        overhead_bytes=o.engine_overhead, engine_stage=o.engine_stage,
        engine_args=o.engine_args)


def plan_memory(o: LaunchOptions, facts: LaunchFacts, gpu: GpuPart | None,
                kv: KvPart | None) -> tuple[int | None, list[str]]:
    """Whether N replicas fit in the device's memory; the part is the bytes they need."""
    if gpu is None or kv is None or _replica_count(o) or _memory_headroom(o):
        return None, []
    need, each = memory_formula(kv.sizing, o.replicas, o.share_weights)
    if len(gpu.groups) > 1:  # each GPU holds its own replicas
        problems, total = [], 0
        for group in gpu.groups:
            mine, words = memory_formula(kv.of(group.slot).sizing, len(group.replicas),
                                         o.share_weights)
            total += mine
            if group.gpu is not None:
                problems += _gpu_memory_problems(o, group.gpu, mine, words, named=True)
        if gpu.device == "cpu" and total > facts.host_memory_available:  # GPUs unchecked
            problems.append(f"host memory: {each} does not fit in the "
                            f"{format_size(facts.host_memory_available)} available; lower the "
                            "KV size or the replica count")
        return (None, problems) if problems else (total, [])
    if gpu.gpu is not None:
        problems = _gpu_memory_problems(o, gpu.gpu, need, each)
    elif need > facts.host_memory_available:
        problems = [f"host memory: {each} does not fit in the "
                    f"{format_size(facts.host_memory_available)} available; lower the KV size or "
                    "the replica count"]
    else:
        problems = []
    return (None, problems) if problems else (need, [])


def plan_share_room(o: LaunchOptions, facts: LaunchFacts, gpu: GpuPart | None,
                    kv: KvPart | None) -> tuple[int | None, list[str]]:
    """--share-weights on the CPU: the leader writes every weight, shared and private, as one
    segment file into the run's share/ directory, on the state root's filesystem (by default
    under $XDG_RUNTIME_DIR, often a small tmpfs). The part is the segment's bytes."""
    if not o.share_weights or gpu is None or gpu.device != "cpu" or kv is None:
        return None, []
    # + the manifest, alignment padding and buffers beside the parameters: a slack, not a size
    need, free = kv.sizing.weights_bytes + SEGMENT_SLACK_BYTES, facts.state_root_free
    if free is None or need <= free:
        return need, []
    return None, [f"--share-weights on the CPU: the leader writes its weights "
                  f"({format_size(kv.sizing.weights_bytes)}, shared and private; "
                  f"{format_size(need)} with the manifest and padding) as one segment into the run "
                  f"directory under {facts.state_root}, whose filesystem has "
                  f"{format_size(free)} free; set OMNI_DP_STATE_DIR to a directory on a "
                  "filesystem with room for it, or run without --share-weights"]


def memory_formula(sizing: EngineSizing, replicas: int, share: bool) -> tuple[int, str]:
    """What N replicas need, and the formula with its numbers: N × (weights + KV + overhead),
    or with --share-weights W + N × (private weights + KV + overhead), W the shared weights
    held once (beside it, what the same replicas would need without sharing)."""
    s = sizing
    plain = replicas * s.total_bytes
    plain_text = (f"{replicas} × (weights {format_size(s.weights_bytes)} + KV "
                  f"{format_size(s.kv_cache_bytes)} + overhead {format_size(s.overhead_bytes)})"
                  f" = {format_size(plain)}")
    if not share:
        return plain, plain_text
    need = s.shared_weights_bytes + replicas * (
        s.private_weights_bytes + s.kv_cache_bytes + s.overhead_bytes)
    return need, (f"shared weights {format_size(s.shared_weights_bytes)} + {replicas} × "
                  f"(private weights {format_size(s.private_weights_bytes)} + KV "
                  f"{format_size(s.kv_cache_bytes)} + overhead {format_size(s.overhead_bytes)})"
                  f" = {format_size(need)} (without --share-weights: {plain_text})")


def _gpu_memory_problems(o: LaunchOptions, gpu: GpuFacts, need: int, each: str,
                         named: bool = False) -> list[str]:
    total = gpu.memory_total_bytes
    if not total:  # NVML could not tell: nothing to check against
        return []
    used = gpu.memory_used_bytes or 0
    usable = int(total * (1 - o.memory_headroom)) - used
    if need <= usable:
        return []
    where = f" of {gpu.label}" if named else ""
    return [f"GPU memory{where}: {each} does not fit: the GPU has {format_size(total)}, "
            f"{format_size(used)} already in use, {o.memory_headroom:.0%} kept as headroom → "
            f"{format_size(max(usable, 0))} usable; lower the KV size or the replica count"]


# --- the plan -------------------------------------------------------------------------------

T = TypeVar("T")


def _take(planned: tuple[T | None, list[str]], problems: list[str]) -> T | None:
    """A sub-planner's part; its problems join the plan's."""
    part, found = planned
    problems.extend(found)
    return part


def plan_launch(o: LaunchOptions, facts: LaunchFacts, *,
                earlier_problems: tuple[str, ...] | list[str] = ()) -> LaunchPlan:
    """earlier_problems: found before planning (the --config file's); reported with the
    plan's. The engine's dry run is skipped while any exist, so no plan can be made then."""
    o, spread_problems = with_gpu_replicas(o, len(facts.gpus) or len(facts.unchecked_gpus))
    problems = [*earlier_problems, *check_options(o), *spread_problems]
    gpu = _take(plan_gpu(o, facts) if o.gpus is None else plan_gpus(o, facts), problems)
    mps = _take(plan_mps(o, facts), problems)
    run = _take(plan_run(o, facts), problems)
    _take(plan_state_root(facts), problems)
    ports = _take(plan_ports(o, facts), problems)
    router = _take(plan_router(o, facts), problems)
    if facts.gateway_problem:
        problems.append(facts.gateway_problem)
    cpus = _take(plan_cpus(o, facts, gpu), problems)
    kv = _take(plan_kv(o, facts, gpu), problems)
    _take(plan_memory(o, facts, gpu, kv), problems)
    _take(plan_share_room(o, facts, gpu, kv), problems)
    if problems:
        raise LaunchPlanError(problems)
    if kv is None:  # no dry run, and nothing said why: never plan without the engine's word
        raise LaunchPlanError([NO_DRY_RUN])
    # Without a problem every part is there: a part is None only with a problem of its own or
    # one of check_options'.
    parts = (gpu, mps, run, ports, router, cpus)
    assert all(part is not None for part in parts), "a part failed without saying why"
    replicas = plan_replicas(o, facts, run, gpu, ports, cpus, kv)
    router_argv = [*router.argv]
    for r in replicas:
        router_argv += ["--replica", f"{r.index}={r.url}"]
    engine = ENGINES[o.engine]
    # An engine that sizes KV from the memory free at its start sees the others' footprint
    # only once they are up: one after another. A fixed size can start together.
    start = o.start or ("sequential" if engine.kv_profiled else "parallel")
    return LaunchPlan(
        options=o, run_id=run.run_id, run_dir=run.directory, device=gpu.device,
        gpu_label=gpu.label, gpu_numa_node=facts.gpu_numa_node, start=start,
        replicas=replicas, router_argv=tuple(router_argv), router_url=router.url,
        expected_kv_tokens=kv.pin.expected_tokens, sizing=kv.sizing, mps_binary=mps.binary,
        mps_binaries=mps.binaries,
        warnings=(*gpu.warnings, *_neighbour_warnings(run, gpu, facts), *cpus.warnings,
                  *_share_warnings(o), *_register_warnings(o, router.url)),
        command=facts.command,
        start_timeout=o.start_timeout if o.start_timeout is not None else engine.start_timeout_s,
        kv_notes=kv.pin.notes, gpus=tuple(g.record() for g in gpu.groups),
    )


def plan_replicas(o: LaunchOptions, facts: LaunchFacts, run: RunPart, gpu: GpuPart,
                  ports: tuple[int, ...], cpus: CpuPart, kv: KvPart) -> tuple[ReplicaPlan, ...]:
    """Each replica's port, CPU block, environment and command line, from complete parts."""
    engine = ENGINES[o.engine]
    external = engine.external
    engine_args = o.engine_args
    if external and facts.model is not None:  # the directory as read (absolute: see facts)
        engine_args = (str(facts.model.path), *split_model(o.engine_args)[1])
    replicas = []
    for i, (port, block) in enumerate(zip(ports, cpus.blocks, strict=True)):
        group = gpu.group_of(i)
        threads = len(block) if block else max(1, len(facts.topology.allowed) // o.replicas)
        launch = ReplicaLaunch(
            port, gpu.device, threads, o.kv_cache_bytes, o.max_total_tokens,
            log_format=o.log_format,
            python=facts.engine_python if external else None, kv_args=kv.of(group.slot).args,
            cpus=block, work_dir=engine_work_dir(run.directory, i) if external else None,
            share_role=share_role(o.share_weights, i),
            share_dir=share_dir(run.directory) if o.share_weights else None)
        argv = engine.argv(launch, engine_args)
        env = {**_replica_env(o, run, gpu, group, i, threads), **engine.environment(launch)}
        pinned = _pinned(argv, block, facts, group.numa_node)
        replicas.append(ReplicaPlan(i, port, block, tuple(pinned), env, group.slot))
    return tuple(replicas)


def _replica_env(o: LaunchOptions, run: RunPart, gpu: GpuPart, group: GpuGroup, index: int,
                 threads: int) -> dict[str, str]:
    """Its GPU alone visible (by UUID; an unchecked GPU is none: the replica runs on the
    CPU), and under --mps its GPU's daemon's pipe."""
    env = {RUN_ID_ENV: run.run_id, REPLICA_ENV: str(index),
           "CUDA_VISIBLE_DEVICES": visible_id(group.gpu),
           **{name: str(threads) for name in THREAD_VARIABLES}}
    if o.mps:
        key = gpu_key(len(gpu.groups), group.index, group.slot)
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(mps_pipe_dir(run.directory, key))
        env["CUDA_MPS_LOG_DIRECTORY"] = str(mps_log_dir(run.directory, key))
    return env


def _register_warnings(o: LaunchOptions, router_url: str) -> list[str]:
    """What a gateway will not do with what --register hands it."""
    if o.register is None:
        return []
    warnings = []
    if ENGINES[o.engine].example != "completions":
        warnings.append(f"--register: the SGLang model gateway does not proxy "
                        f"/v1/audio/speech; engine {o.engine}'s speech goes through this host's "
                        f"router ({router_url}) only, the gateway lists the replicas")
    if o.register_as == "replicas" and not _loopback_url(o.register):
        warnings.append(f"--register {o.register}: the replicas listen on 127.0.0.1, so that "
                        "gateway must run on this host; from elsewhere register the router "
                        "(--register-as router --register-url http://THIS_HOST:PORT, --host "
                        "0.0.0.0)")
    return warnings


def _share_warnings(o: LaunchOptions) -> list[str]:
    if o.share_weights and o.replicas == 1:
        return ["--share-weights with one replica: replica 0 leads and shares with nobody "
                "(its weights are published all the same)"]
    return []


def _neighbour_warnings(run: RunPart, gpu: GpuPart, facts: LaunchFacts) -> list[str]:
    """Other runs on the same GPU: stale state to remove, or a live run to share it with."""
    warnings = []
    mine = set(gpu.label.split(","))
    for other in facts.runs:
        if other.run_id == run.run_id or not mine & set((other.gpu or "").split(",")):
            continue
        if not other.live:
            warnings.append(f"stale state of run {other.run_id} (same GPU) is kept at "
                            f"{other.directory}; `{facts.command} down {other.run_id}` "
                            "removes it")
        elif gpu.gpu is not None:
            warnings.append(f"run {other.run_id} is live on the same GPU; both runs will "
                            "share it")
    return warnings


def _pinned(argv: list[str], cpus: tuple[int, ...] | None, facts: LaunchFacts,
            node: int | None) -> list[str]:
    """Pin before the engine executes anything: our exec wrapper sets the affinity, then (when
    numactl is there and the block is on its GPU's node) numactl binds memory to that node."""
    if not cpus:
        return argv
    prefix = [sys.executable, "-m", "omni_dp.launcher.processes.pin", format_cpu_list(cpus), "--"]
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
