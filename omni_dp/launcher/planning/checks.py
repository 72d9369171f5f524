"""What is wrong with `omni-dp launch`'s options alone, whatever the machine: one small check per
concern, run in order by check_options, every problem reported. Each check reads a few fields
and returns its problems; a sub-planner that reads those fields asks the same check whether they
were refused."""

from __future__ import annotations

import math
import re
import urllib.parse
from collections.abc import Callable

from omni_dp.contract import PRIORITY_NAMES
from omni_dp.gateway import normalize_url
from omni_dp.launcher.engines import ENGINES, reserved_flag_problems
from omni_dp.launcher.planning.gpus import gpu_option_problems
from omni_dp.launcher.planning.options import (
    MPS_FAULT_ACTIONS,
    REGISTER_AS,
    START_MODES,
    LaunchOptions,
)
from omni_dp.logs import LOG_FORMATS
from omni_dp.rundir import RUN_ID
from omni_dp.tracing import endpoint_problem

POLICIES = ("least_request", "round_robin", "power_of_two", "random")


STAGE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


MAX_SECONDS = 7 * 24 * 3600.0  # any timeout or interval beyond is a typo (and overflows poll())


def replica_count_problems(o: LaunchOptions) -> list[str]:
    return [] if o.replicas >= 1 else [f"--replicas must be at least 1, got {o.replicas}"]


def kv_pin_problems(o: LaunchOptions) -> list[str]:
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


def kv_size_problems(o: LaunchOptions) -> list[str]:
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


def router_worker_problems(o: LaunchOptions) -> list[str]:
    return [] if o.router_workers >= 1 else ["--router-workers must be at least 1"]


def migration_problems(o: LaunchOptions) -> list[str]:
    """--migration-limit and --migration-max-seq-len, passed to the router: in range, and for
    an engine whose streams carry token ids."""
    problems = []
    if o.migration_limit is not None and o.migration_limit < 0:
        problems.append(f"--migration-limit must be 0 or more, got {o.migration_limit}")
    if o.migration_max_seq_len is not None and o.migration_max_seq_len < 1:
        problems.append(f"--migration-max-seq-len must be at least 1, got "
                        f"{o.migration_max_seq_len}")
    engine = ENGINES.get(o.engine)
    if (o.migration_limit or 0) > 0 and engine is not None and not engine.migration_paths:
        problems.append(f"--migration-limit: engine {o.engine} streams no token ids to go on "
                        "from; migration is for vllm and sglang (the built-in engine's audio "
                        "streams are resumed by byte: the router's --resumes)")
    return problems


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


def run_id_problems(o: LaunchOptions) -> list[str]:
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


# The router's options passed through (None: its default), checked as it checks them.
_ROUTER_COUNTS = ("retries", "resumes", "reserved_interactive")
_ROUTER_SECONDS = ("first_byte_timeout", "stall_timeout", "replica_wait")
_ROUTER_OTHERS = ("max_ejection_percent", "default_priority")


def _router_faults(o: LaunchOptions) -> list[str]:
    problems = [f"--{name.replace('_', '-')} must be 0 or more, got {getattr(o, name)}"
                for name in _ROUTER_COUNTS
                if getattr(o, name) is not None and getattr(o, name) < 0]
    percent = o.max_ejection_percent
    if percent is not None and not 1 <= percent <= 100:
        problems.append(f"--max-ejection-percent must be from 1 to 100, got {percent}")
    if o.default_priority is not None and o.default_priority not in PRIORITY_NAMES:
        problems.append(f"--default-priority must be interactive, default or bulk, got "
                        f"{o.default_priority!r}")
    for name in _ROUTER_SECONDS:
        seconds = getattr(o, name)
        zero = "no wait" if name == "replica_wait" else "no limit"
        if seconds is not None and not (math.isfinite(seconds) and 0 <= seconds <= MAX_SECONDS):
            problems.append(f"--{name.replace('_', '-')} must be a number of seconds from 0 "
                            f"({zero}) to {MAX_SECONDS:.0f}, got {seconds}")
    return problems


def router_fault_args(o: LaunchOptions) -> list[str]:
    """The router's flags for the options given (the others keep the router's default)."""
    args = []
    for name in (*_ROUTER_COUNTS, *_ROUTER_SECONDS, *_ROUTER_OTHERS):
        if getattr(o, name) is not None:
            args += [f"--{name.replace('_', '-')}", str(getattr(o, name))]
    return args


def _restart_counts(o: LaunchOptions) -> list[str]:
    if o.restart_after_failures < 1 or o.restart_budget < 0:
        return ["--restart-after-failures must be ≥ 1 and --restart-budget ≥ 0"]
    return []


def memory_headroom_problems(o: LaunchOptions) -> list[str]:
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
            and not problems and not is_loopback_url(o.register)):
        problems.append(f"--register-as router with the gateway {o.register} on another host: "
                        "give --register-url http://THIS_HOST:PORT, the router's address as "
                        "that gateway reaches it (and --host 0.0.0.0 so the router listens "
                        "there)")
    return problems


def is_loopback_url(url: str) -> bool:
    host = urllib.parse.urlsplit(normalize_url(url)).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


MIB, GIB = 1024**2, 1024**3


def mps_limit_problems(o: LaunchOptions) -> list[str]:
    """The MPS caps: the daemon's to enforce (so --mps), a share of the SMs, and a memory
    limit the daemon can keep exactly (it keeps whole MiB, and whole GiB from 1 GiB up: any
    other size would be read back smaller than asked, silently)."""
    problems = []
    given = [flag for flag, value in (("--mps-thread-percentage", o.mps_thread_percentage),
                                      ("--mps-memory-limit", o.mps_memory_limit))
             if value is not None]
    if given and not o.mps:
        problems.append(f"{' and '.join(given)} {'need' if len(given) > 1 else 'needs'} "
                        "--mps: the caps are the MPS daemon's to enforce; add --mps, or drop "
                        "the cap")
    percent = o.mps_thread_percentage
    if percent is not None and not (math.isfinite(percent) and 1 <= percent <= 100):
        problems.append(f"--mps-thread-percentage must be a percentage of the GPU's SMs from "
                        f"1 to 100, got {percent}")
    elif percent is not None and round(percent, 1) != percent:
        # the daemon keeps one decimal: 12.35 is read back as 12.3, and the launch would fail
        # only once the daemon ran (its read-back must equal what was asked)
        problems.append(f"--mps-thread-percentage {percent}: the MPS daemon keeps one decimal; "
                        f"give e.g. {math.floor(percent * 10) / 10} or "
                        f"{math.ceil(percent * 10) / 10}")
    limit = o.mps_memory_limit
    if limit is not None and (limit < MIB or limit % (GIB if limit >= GIB else MIB)):
        problems.append(f"--mps-memory-limit {limit} bytes: the MPS daemon keeps whole MiB "
                        "from 1MiB, and whole GiB from 1GiB up; give e.g. 512MiB or 8GiB")
    return problems


def _no_gpu_check(o: LaunchOptions) -> list[str]:
    return ["--no-gpu-check only applies to --mps"] if o.no_gpu_check and not o.mps else []


def replica_port_problems(o: LaunchOptions) -> list[str]:
    if replica_count_problems(o):  # no replica ports to place
        return []
    last = o.base_port + o.replicas - 1
    if o.base_port < 1 or last > 65535:
        return [f"--base-port {o.base_port}: replica ports {o.base_port}-{last} must lie within "
                "1-65535"]
    return []


def router_port_problems(o: LaunchOptions) -> list[str]:
    if not 1 <= o.router_port <= 65535:
        return [f"--router-port must be 1-65535, got {o.router_port}"]
    if replica_count_problems(o):
        return []
    last = o.base_port + o.replicas - 1
    if o.base_port <= o.router_port <= last:
        return [f"--router-port {o.router_port} falls in the replica port range "
                f"{o.base_port}-{last}; move one of them"]
    return []


def tracing_problems(o: LaunchOptions) -> list[str]:
    problem = endpoint_problem(o.otlp_traces_endpoint)
    return [problem] if problem is not None else []


OPTION_CHECKS: tuple[Callable[[LaunchOptions], list[str]], ...] = (
    replica_count_problems, kv_pin_problems, kv_size_problems, _choices,
    router_worker_problems, _engine, run_id_problems, _seconds, _restart_counts,
    memory_headroom_problems, _api_key, _no_gpu_check, replica_port_problems,
    router_port_problems, _share_weights, gpu_option_problems, _register, _router_faults,
    mps_limit_problems, migration_problems, tracing_problems,
)


def check_options(o: LaunchOptions) -> list[str]:
    """What is wrong with the options alone, whatever the machine."""
    return [problem for check in OPTION_CHECKS for problem in check(o)]
