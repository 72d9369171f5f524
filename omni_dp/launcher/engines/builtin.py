"""`omni-dp serve`: the built-in TTS pipeline, run with this interpreter.

Its KV is a fixed size (16384 tokens unless pinned), and its own dry run says exactly what a
replica will hold; it reports its processes and capacity on /get_server_info
(docs/contracts.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType

from omni_dp.launcher.engines.base import (
    EngineSizing,
    EngineUnreadable,
    KvPlan,
    KvRequest,
    ReplicaLaunch,
)
from omni_dp.launcher.engines.replica_api import GateFailed, server_info
from omni_dp.mps.attach import DeclaredProcess

DRY_RUN_TIMEOUT_S = 120


class BuiltinEngine:
    name = "builtin"
    external = False
    module = None
    reserved_flags = MappingProxyType({
        "--host": "omni-dp launch --host (the router's)",
        "--port": "omni-dp launch --base-port", "--device": "omni-dp launch --gpu",
        "--threads": "omni-dp launch --cpu-blocks",
        "--kv-cache-bytes": "omni-dp launch --kv-cache-bytes",
        "--max-total-tokens": "omni-dp launch --max-total-tokens",
        "--dry-run": "omni-dp launch --dry-run", "--log-format": "omni-dp launch --log-format",
        "--share-weights": "omni-dp launch --share-weights",
        "--share-dir": "omni-dp launch --share-weights (the run's share/ directory)",
        "--otlp-traces-endpoint": "omni-dp launch --otlp-traces-endpoint",
    })
    kv_profiled = False
    tmp_per_process = False  # no work directory of its own
    fixed_default_kv = True
    needs_gpu = False
    shares_weights = True  # --share-weights: one copy of the weights per run
    cuda_processes_per_replica = 1
    start_timeout_s = 300.0
    example = "speech"
    # no token stream: its audio is resumed by byte (the router's --resumes)
    migration_paths: tuple[str, ...] = ()

    def argv(self, launch: ReplicaLaunch, engine_args: tuple[str, ...]) -> list[str]:
        argv = [launch.python or sys.executable, "-m", "omni_dp", "serve", "--host",
                "127.0.0.1", "--port", str(launch.port), "--device", launch.device]
        if launch.threads is not None:
            argv += ["--threads", str(launch.threads)]
        if launch.kv_args:  # the plan's pin (plan_kv)
            argv += launch.kv_args
        else:  # the dry run: the options as given
            if launch.kv_cache_bytes is not None:
                argv += ["--kv-cache-bytes", str(launch.kv_cache_bytes)]
            if launch.max_total_tokens is not None:
                argv += ["--max-total-tokens", str(launch.max_total_tokens)]
        if launch.share_role is not None:
            argv += ["--share-weights", launch.share_role, "--share-dir", str(launch.share_dir)]
        return [*argv, "--log-format", launch.log_format, *absolute_paths(engine_args)]

    def environment(self, launch: ReplicaLaunch) -> dict[str, str]:
        return {}

    def plan_kv(self, request: KvRequest) -> tuple[KvPlan | None, list[str]]:
        """The dry run's sizes; a token pin must be what the engine allocates (whole pages).
        Unpinned, the fixed default is pinned explicitly, so every replica (and restart) is
        started with the very number the dry run reported."""
        sizing = request.sizing
        if sizing is None:
            return None, []  # the dry run said why (facts.engine_problems)
        if request.max_total_tokens is not None and sizing.kv_tokens != request.max_total_tokens:
            return None, [f"--max-total-tokens {request.max_total_tokens}: the engine would "
                          f"allocate {sizing.kv_tokens} tokens (whole KV pages); ask for "
                          f"{sizing.kv_tokens}"]
        if request.kv_cache_bytes is not None:
            args = ("--kv-cache-bytes", str(request.kv_cache_bytes))
        else:
            args = ("--max-total-tokens", str(request.max_total_tokens or sizing.kv_tokens))
        return KvPlan(args, sizing, sizing.kv_tokens), []

    def dry_run(self, launch: ReplicaLaunch, engine_args: tuple[str, ...],
                env: dict[str, str]) -> tuple[EngineSizing | None, list[str]]:
        """Ask the engine to validate its options and say what it would allocate."""
        argv = [*self.argv(launch, engine_args), "--dry-run"]
        try:
            done = subprocess.run(argv, env=env, capture_output=True, text=True,
                                  timeout=DRY_RUN_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            return None, [f"the engine's dry run (omni-dp serve --dry-run) took over "
                          f"{DRY_RUN_TIMEOUT_S} s"]
        if done.returncode != 0:
            lines = [line.removeprefix("omni-dp serve: ")
                     for line in done.stderr.strip().splitlines()]
            return None, [f"engine: {line}" for line in lines[-10:]] or [
                f"the engine's dry run exited {done.returncode} without saying why"]
        try:
            plan = json.loads(done.stdout)
            sizing = EngineSizing(
                weights_bytes=int(plan["weights_bytes"]),
                kv_cache_bytes=int(plan["kv_cache_bytes"]),
                kv_tokens=int(plan["max_total_num_tokens"]),
                overhead_bytes=int(plan["overhead_bytes"]),
                device=str(plan["device"]),
                # what sharing would keep once; an engine that predates it shares nothing
                shared_weights_bytes=int(plan.get("shared_weights_bytes", 0)),
                processes=tuple((str(p["name"]), str(p["device"]))
                                for p in plan.get("placement", {}).get("processes", ())),
                model=model_words(plan),
            )
            role = plan.get("share_weights")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return None, [f"the engine's dry run printed no plan ({exc!r}): {done.stdout[:200]}"]
        return sizing, share_problems(sizing, launch.share_role, role)

    def read_capacity(self, url: str, log: Path) -> int:
        try:
            return int(server_info(url)["max_total_num_tokens"])
        except GateFailed as exc:
            raise EngineUnreadable(str(exc)) from None

    def reported_processes(self, url: str) -> list[DeclaredProcess] | None:
        try:
            info = server_info(url)
            return [DeclaredProcess.from_json(p, f"processes[{i}]")
                    for i, p in enumerate(info["processes"])]
        except GateFailed as exc:
            raise EngineUnreadable(str(exc)) from None
        except (KeyError, TypeError, ValueError) as exc:  # a malformed list is no list
            raise EngineUnreadable(f"GET {url}/get_server_info: its processes list is "
                                     f"malformed ({exc!r}); see docs/contracts.md") from None


PATH_FLAGS = ("--placement-config",)  # serve's flags whose value is a file path


def absolute_paths(engine_args: tuple[str, ...],
                   path_flags: tuple[str, ...] = PATH_FLAGS) -> list[str]:
    """The engine arguments with the value of each path flag made absolute: a replica (and a
    restart by the detached supervisor) must read the file the preflight read, whatever its
    working directory. (`--model` is left as given: its value is a preset name before it is
    a directory, and which names are presets is the engine's to say.)"""
    args, out = list(engine_args), []
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if eq and flag in path_flags:
            out.append(f"{flag}={_absolute(value)}")
        elif i > 0 and args[i - 1] in path_flags:
            out.append(_absolute(arg))
        else:
            out.append(arg)
    return out


def _absolute(value: str) -> str:
    return os.path.abspath(value) if value and os.path.exists(value) else value


def share_problems(sizing: EngineSizing, asked: str | None, said: object) -> list[str]:
    """The dry run must have taken --share-weights as asked, and its shared bytes must be a
    part of the weights: a plan is never made on sizes that do not add up."""
    if asked is not None and said != asked:
        return [f"engine: the dry run was asked --share-weights {asked} and reports "
                f"share_weights {said!r}: this omni-dp serve does not share weights"]
    if not 0 <= sizing.shared_weights_bytes <= sizing.weights_bytes:
        return [f"engine: the dry run's shared_weights_bytes {sizing.shared_weights_bytes} is "
                f"not within its weights_bytes {sizing.weights_bytes}"]
    return []


def model_words(plan: dict) -> str | None:
    """`joe (a trained voice)`, `tiny (seeded random weights: a test vehicle, its audio is
    noise)`, or a model directory as the dry run named it."""
    model = plan.get("model")
    if not isinstance(model, str):
        return None
    if isinstance(plan.get("voice"), dict):
        return f"{model} (a trained voice)"
    if plan.get("weights") == "seeded":
        return f"{model} (seeded random weights: a test vehicle, its audio is noise)"
    return model
