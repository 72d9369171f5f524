"""Engine adapters: how the launcher starts one replica of a given engine and sizes it.

The supervisor never looks inside an engine: it runs the argv an adapter builds and talks to the
replica over the HTTP contract in docs/contracts.md (/health, /get_server_info with
`max_total_num_tokens` and `processes`). Adding an external engine (sglang-omni, sglang, vLLM)
means one more adapter class here and one entry in ENGINES; nothing else changes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class EngineSizing:
    """What one replica will hold, from the engine's own dry run (never guessed here)."""

    weights_bytes: int
    kv_cache_bytes: int
    kv_tokens: int
    overhead_bytes: int
    device: str

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.overhead_bytes


@dataclass(frozen=True)
class ReplicaLaunch:
    """The launcher-owned settings of one replica; the adapter turns them into an argv."""

    port: int
    device: str  # "cpu" or "cuda"
    threads: int | None
    kv_cache_bytes: int | None
    max_total_tokens: int | None
    log_format: str = "text"  # text | json (omni_dp/logs.py)


class EngineAdapter(Protocol):
    name: str
    # Engine flags the launcher sets itself; the same flag among the user's engine args is an
    # error (it would silently fight the launcher's value).
    reserved_flags: tuple[str, ...]
    # True when the engine's KV size without a knob is a fixed number (not profiled from the
    # memory free at start-up): then replicas started with no knob still get equal KV.
    fixed_default_kv: bool

    def argv(self, launch: ReplicaLaunch, engine_args: tuple[str, ...]) -> list[str]: ...

    def dry_run(self, launch: ReplicaLaunch, engine_args: tuple[str, ...],
                env: dict[str, str]) -> tuple[EngineSizing | None, list[str]]: ...


class BuiltinEngine:
    """`omni-dp serve`: the built-in TTS pipeline, run with this interpreter."""

    name = "builtin"
    reserved_flags = ("--host", "--port", "--device", "--threads", "--kv-cache-bytes",
                      "--max-total-tokens", "--dry-run", "--log-format")
    fixed_default_kv = True  # 16384 tokens unless told otherwise

    def argv(self, launch: ReplicaLaunch, engine_args: tuple[str, ...]) -> list[str]:
        argv = [sys.executable, "-m", "omni_dp", "serve", "--host", "127.0.0.1",
                "--port", str(launch.port), "--device", launch.device]
        if launch.threads is not None:
            argv += ["--threads", str(launch.threads)]
        if launch.kv_cache_bytes is not None:
            argv += ["--kv-cache-bytes", str(launch.kv_cache_bytes)]
        if launch.max_total_tokens is not None:
            argv += ["--max-total-tokens", str(launch.max_total_tokens)]
        return [*argv, "--log-format", launch.log_format, *engine_args]

    def dry_run(self, launch: ReplicaLaunch, engine_args: tuple[str, ...],
                env: dict[str, str]) -> tuple[EngineSizing | None, list[str]]:
        """Ask the engine to validate its options and say what it would allocate."""
        argv = [*self.argv(launch, engine_args), "--dry-run"]
        try:
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120,
                                  check=False)
        except subprocess.TimeoutExpired:
            return None, ["the engine's dry run (omni-dp serve --dry-run) took over 120 s"]
        if done.returncode != 0:
            lines = [line.removeprefix("omni-dp serve: ")
                     for line in done.stderr.strip().splitlines()]
            return None, [f"engine: {line}" for line in lines[-10:]] or [
                f"the engine's dry run exited {done.returncode} without saying why"]
        try:
            plan = json.loads(done.stdout)
            return EngineSizing(
                weights_bytes=int(plan["weights_bytes"]),
                kv_cache_bytes=int(plan["kv_cache_bytes"]),
                kv_tokens=int(plan["max_total_num_tokens"]),
                overhead_bytes=int(plan["overhead_bytes"]),
                device=str(plan["device"]),
            ), []
        except (ValueError, KeyError, TypeError) as exc:
            return None, [f"the engine's dry run printed no plan ({exc!r}): {done.stdout[:200]}"]


ENGINES: dict[str, EngineAdapter] = {"builtin": BuiltinEngine()}


def reserved_flag_problems(engine: EngineAdapter, engine_args: tuple[str, ...]) -> list[str]:
    problems = []
    for arg in engine_args:
        flag = arg.split("=", 1)[0]
        if flag in engine.reserved_flags:
            launch_flag = {"--host": "--host (the router's)", "--port": "--base-port",
                           "--device": "--gpu", "--threads": "--cpu-blocks"}.get(flag, flag)
            problems.append(
                f"engine argument {flag} is set by the launcher for every replica; use "
                f"omni-dp launch {launch_flag} instead"
            )
    return problems
