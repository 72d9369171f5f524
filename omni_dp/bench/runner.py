"""`omni-dp bench`'s driver: a concurrency sweep against an endpoint, or for each configuration
("1", "2mps", ...) launch it, sweep it, `down` it and check that nothing of it is left.

Configurations are launched through the command line (`python -m omni_dp launch --detach`,
`status --json`, `verify-mps`, `down --json`), the contract every user has, never by importing
the launcher. A configuration that could not run is a ConfigResult "failed" with the launch's
own last lines; one whose sweep saw failed requests is "degraded", numbers kept; a failed
`down` or anything left running makes it "failed". SIGINT or SIGTERM during a configuration
downs it before run_configs returns (`interrupted` then names the signal).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil

from omni_dp.bench.load import run_point
from omni_dp.bench.results import ConfigResult, LevelSummary, PointResult
from omni_dp.bench.sampler import Sampler
from omni_dp.bench.stats import (
    DEFAULT_MAX_CONCURRENCY,
    MAX_FAILURE_SHARE,
    MIN_GAIN,
    SaturationSweep,
    summarize_level,
    summarize_point,
    verdict,
)
from omni_dp.bench.workload import Workload
from omni_dp.contract import API_KEY_ENV, RUN_IDENTITY_ENVS
from omni_dp.launcher.processes.ours import token_carriers
from omni_dp.net import port_taken
from omni_dp.procs import ProcessIdentity, is_alive
from omni_dp.rundir import run_dir as run_dir_of
from omni_dp.rundir import state_dir as default_state_dir
from omni_dp.runfile import RunFileError, RunRecord, read_run

TRIAL_INDEX_STRIDE = 1_000_000  # trial t sends requests t·stride, t·stride + 1, ...
REASON_LINES = 5  # of a failed command's output, kept as the reason
# Flags the configuration spec decides; given in the launch options they are refused.
SPEC_FLAGS = ("--replicas", "-n", "--replicas-per-gpu", "--mps", "--run-id", "--detach",
              "--dry-run")
PORT_FLAGS = ("--router-port", "--base-port")
LEFTOVER_WAIT_S = 10.0


@dataclass(frozen=True)
class BenchSettings:
    """How each configuration is measured. `concurrency` None: doubling from
    `start_concurrency` up to `max_concurrency`."""

    trials: int = 3
    duration_s: float = 20.0
    warmup_s: float = 5.0
    timeout_s: float = 60.0
    concurrency: tuple[int, ...] | None = None
    max_p99_s: float | None = None
    min_gain: float = MIN_GAIN
    seed: int = 0  # the workload's: request i is the same in every configuration
    workload: Workload = field(default_factory=Workload)
    api_key: str | None = None
    max_failure_share: float = MAX_FAILURE_SHARE
    start_concurrency: int = 1
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    launch_timeout_s: float = 900.0  # `launch --detach`: bring-up of every replica
    down_timeout_s: float = 180.0

    def __post_init__(self) -> None:
        if self.trials < 1:
            raise ValueError(f"trials must be at least 1, got {self.trials}")
        if self.duration_s <= 0 or self.warmup_s < 0 or self.timeout_s <= 0:
            raise ValueError("duration and timeout must be positive, the warm-up not negative")
        self.sweep()  # its bounds (--max-p99, --min-gain, levels) refused before any launch

    def sweep(self) -> SaturationSweep:
        return SaturationSweep(self.concurrency, start=self.start_concurrency,
                               maximum=self.max_concurrency, min_gain=self.min_gain,
                               max_p99_s=self.max_p99_s,
                               max_failure_share=self.max_failure_share)

    def to_json(self) -> dict:
        return {"trials": self.trials, "duration_s": self.duration_s,
                "warmup_s": self.warmup_s, "timeout_s": self.timeout_s,
                "concurrency": list(self.concurrency) if self.concurrency else None,
                "start_concurrency": self.start_concurrency,
                "max_concurrency": self.max_concurrency, "max_p99_s": self.max_p99_s,
                "min_gain": self.min_gain, "max_failure_share": self.max_failure_share,
                "seed": self.seed,
                "workload": replace(self.workload, seed=self.seed).describe()}


def parse_spec(spec: str) -> tuple[int, bool]:
    """`3mps` -> (3, True), `2` -> (2, False); a ValueError saying what a spec is."""
    count = spec.strip().removesuffix("mps")
    if not count.isdigit() or int(count) < 1:
        raise ValueError(f"configuration {spec!r} is not N or Nmps (replicas, with MPS or "
                         "not), e.g. 1, 2, 2mps, 3mps")
    return int(count), spec.strip().endswith("mps")


def check_launch_args(launch_args: Sequence[str]) -> None:
    """Refuse the flags each configuration sets itself (before the engine's `--`)."""
    own = list(launch_args[:launch_args.index("--")] if "--" in launch_args else launch_args)
    taken = [a for a in own if a.split("=", 1)[0] in SPEC_FLAGS]
    if taken:
        raise ValueError(f"{', '.join(taken)}: each configuration sets the replicas, --mps, "
                         "the run id and --detach itself; give the others only")


class Interrupted(Exception):
    """SIGTERM during a configuration: unwinds to its teardown."""


@dataclass
class _Launched:
    run_id: str
    run_dir: Path
    token: str | None = None
    record: RunRecord | None = None


class BenchRunner:
    """Measures configurations with `settings`; `progress` gets one line per step."""

    def __init__(self, settings: BenchSettings, progress: Callable[[str], None] = print,
                 python: str = sys.executable) -> None:
        self.settings = settings
        self.progress = progress
        self.python = python
        self.interrupted: str | None = None
        self._defer_signals = False
        self._models: dict[str, str | None] = {}  # endpoint -> the model it serves

    # --- an endpoint -------------------------------------------------------------------------

    def run_url(self, url: str, run_dir: Path | None = None, *, name: str = "url"
                ) -> ConfigResult:
        """Sweep an endpoint that is already up; `run_dir` (its run's directory, when omni-dp
        launched it) lets the sampler find its processes and GPUs."""
        replicas, mps = None, False
        if run_dir is not None:
            with contextlib.suppress(RunFileError):
                record = read_run(run_dir)[0]
                replicas, mps = len(record.replicas), record.plan.mps
        with self._signals():
            try:
                return self._measure(name, replicas, mps, url, run_dir)
            except Interrupted as exc:
                self.interrupted = str(exc)
                return ConfigResult(name, replicas, mps, "failed", f"interrupted ({exc})")

    def _measure(self, name: str, replicas: int | None, mps: bool, url: str,
                 run_dir: Path | None) -> ConfigResult:
        sweep = self.settings.sweep()
        points: list[PointResult] = []
        levels: list[LevelSummary] = []
        cores: dict[str, int] = {}
        while (concurrency := sweep.next_level()) is not None:
            trials = []
            for trial in range(self.settings.trials):
                point, cores = self._point(url, run_dir, concurrency, trial)
                trials.append(point)
                self.progress(f"{name}: concurrency {concurrency} trial {trial + 1}: "
                              f"{_point_line(point)}")
            level = summarize_level(trials)
            points += trials
            levels.append(level)
            sweep.record(level)
        self.progress(f"{name}: {sweep.stop_reason}")
        result = ConfigResult(name, replicas, mps, "ok", None, tuple(points), tuple(levels),
                              sweep.saturation, sweep.stop_reason)
        result = replace(result, verdict=verdict(result, cores))
        failed = sum(sum(p.failures.values()) for p in points)
        if failed:
            sent = sum(p.requests for p in points)
            kinds: dict[str, int] = {}
            for p in points:
                for kind, n in p.failures.items():
                    kinds[kind] = kinds.get(kind, 0) + n
            result = replace(result, status="degraded", reason=(
                f"{failed} of {sent} requests failed ("
                + ", ".join(f"{kind}: {n}" for kind, n in sorted(kinds.items())) + ")"))
        return result

    def _point(self, url: str, run_dir: Path | None, concurrency: int, trial: int
               ) -> tuple[PointResult, dict[str, int]]:
        s = self.settings
        sampler = Sampler(run_dir)

        def on_window(event: str) -> None:
            if event == "start":
                sampler.start()
            elif sampler.samples is None:
                sampler.stop()

        workload = replace(s.workload, seed=s.seed)
        if workload.kind == "completions" and workload.model is None:
            workload = replace(workload, model=self._served_model(url))
        results, window = asyncio.run(run_point(
            url, workload, concurrency, duration_s=s.duration_s, warmup_s=s.warmup_s,
            timeout_s=s.timeout_s, api_key=s.api_key,
            first_index=trial * TRIAL_INDEX_STRIDE, on_window=on_window))
        window = max(window, 1e-3)
        return (summarize_point(results, window, concurrency, trial, sampler.samples),
                sampler.cores)

    # --- configurations it launches ------------------------------------------------------------

    def _served_model(self, url: str) -> str | None:
        """The model an OpenAI endpoint serves (its first /v1/models entry), asked with the
        run's key: what a launched vLLM/sglang names the absolute model path it was given."""
        if url in self._models:
            return self._models[url]
        headers = {"Authorization": f"Bearer {self.settings.api_key}"} \
            if self.settings.api_key else {}
        request = urllib.request.Request(url.rstrip("/") + "/v1/models", headers=headers)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        model = None
        with contextlib.suppress(OSError, ValueError, KeyError, IndexError, TypeError), \
                opener.open(request, timeout=10) as answer:
            model = json.loads(answer.read())["data"][0]["id"]
        self._models[url] = model
        return model

    def run_configs(self, specs: list[str], launch_args: list[str],
                    state_dir: Path | None = None,
                    finished: Callable[[list[ConfigResult]], None] | None = None
                    ) -> list[ConfigResult]:
        """Each configuration in turn: launch, sweep, down, check nothing is left; `finished`
        is given the results so far as each configuration ends. Bad specs or launch flags the
        specs decide are refused (ValueError) before anything starts."""
        parsed = [(spec, *parse_spec(spec)) for spec in specs]
        check_launch_args(launch_args)
        results: list[ConfigResult] = []
        with self._signals():
            for spec, replicas, mps in parsed:
                results.append(self._run_config(spec, replicas, mps, launch_args, state_dir))
                if finished is not None:
                    finished(list(results))
                if self.interrupted:
                    self.progress(f"interrupted ({self.interrupted}): the configurations "
                                  "after this one were not run")
                    break
        return results

    def _run_config(self, spec: str, replicas: int, mps: bool, launch_args: list[str],
                    state_dir: Path | None) -> ConfigResult:
        root = state_dir or default_state_dir()
        run_id = f"bench-{spec}-{secrets.token_hex(4)}"
        run = _Launched(run_id, run_dir_of(root, run_id))
        env = self._env(state_dir)
        result: ConfigResult | None = None
        try:
            result = self._launch_and_measure(spec, replicas, mps, launch_args, run, env)
        except Interrupted as exc:
            self.interrupted = str(exc) or "SIGINT"
            result = ConfigResult(spec, replicas, mps, "failed",
                                  f"interrupted ({self.interrupted}); the run was torn down")
        except Exception as exc:  # the sweep broke: reported, and the run still goes down
            result = ConfigResult(spec, replicas, mps, "failed",
                                  f"the bench failed: {type(exc).__name__}: {exc}")
        finally:
            self._defer_signals = True
            try:
                problems = self._down(run, env)
            finally:
                self._defer_signals = False
        if problems:
            reason = "; ".join(problems)
            result = replace(result, status="failed",
                              reason=f"{result.reason}; {reason}" if result.reason else reason)
        self.progress(f"{spec}: {result.status}" + (f" ({result.reason})" if result.reason
                                                     else ""))
        return result

    def _launch_and_measure(self, spec: str, replicas: int, mps: bool,
                            launch_args: list[str], run: _Launched, env: dict[str, str]
                            ) -> ConfigResult:
        # over --gpus, a configuration's N is per GPU (what `omni-dp plan` counts)
        gpus = _gpu_count(launch_args)
        count = ["--replicas-per-gpu", str(replicas)] if gpus else ["--replicas", str(replicas)]
        argv = ["launch", "--detach", *count, *(["--mps"] if mps else []),
                "--run-id", run.run_id, *_ports(launch_args, replicas * max(gpus, 1)),
                *launch_args]
        self.progress(f"{spec}: omni-dp {' '.join(argv)}")
        done = self._cli(argv, env, self.settings.launch_timeout_s)
        self._remember(run)
        if done.returncode != 0:
            return ConfigResult(spec, replicas, mps, "failed",
                                f"launch exited {done.returncode}: {_last_lines(done)}")
        status = self._cli(["status", run.run_id, "--json"], env, 60)
        self._remember(run)
        try:
            report = json.loads(status.stdout)
            url = report["router"]["url"]
        except (ValueError, KeyError, TypeError):
            return ConfigResult(spec, replicas, mps, "failed",
                                f"status exited {status.returncode}: {_last_lines(status)}")
        result = self._measure(spec, replicas, mps, url, run.run_dir)
        if mps:
            verify = self._cli(["verify-mps", run.run_id], env, 120)
            if verify.returncode != 0:
                result = replace(result, status="failed", reason=(
                    f"verify-mps exited {verify.returncode}: {_last_lines(verify)}"))
        return result

    def _remember(self, run: _Launched) -> None:
        """The run's token and record, read while its directory exists (for after `down`)."""
        with contextlib.suppress(RunFileError):
            run.record, run.token = read_run(run.run_dir)

    def _down(self, run: _Launched, env: dict[str, str]) -> list[str]:
        """`down` (when anything of the run exists), then what is left of it, in words."""
        self._remember(run)
        problems = []
        if run.run_dir.exists() or run.record is not None:
            try:
                done = self._cli(["down", run.run_id, "--json"], env,
                                 self.settings.down_timeout_s)
                if done.returncode != 0:
                    problems.append(f"down exited {done.returncode}: {_last_lines(done)}")
            except subprocess.TimeoutExpired:
                problems.append(f"down did not finish in {self.settings.down_timeout_s:g} s")
        left = leftovers(run.token, run.record)
        if left:
            problems.append("left running after down: " + ", ".join(left))
        if run.run_dir.exists():
            problems.append(f"its run directory {run.run_dir} is still there")
        return problems

    # --- processes ---------------------------------------------------------------------------

    def _env(self, state_dir: Path | None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in RUN_IDENTITY_ENVS}
        if state_dir is not None:
            env["OMNI_DP_STATE_DIR"] = str(state_dir)
        if self.settings.api_key:
            env[API_KEY_ENV] = self.settings.api_key
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _cli(self, args: list[str], env: dict[str, str], timeout: float
             ) -> subprocess.CompletedProcess:
        """`python -m omni_dp ARGS` in a process group of its own, killed whole on a timeout
        or an interrupt (what it started in sessions of its own is `down`'s to stop)."""
        argv = [self.python, "-m", "omni_dp", *args]
        with subprocess.Popen(argv, env=env, text=True, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              start_new_session=True) as proc:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                out, err = proc.communicate()
                return subprocess.CompletedProcess(
                    argv, -9, out, (err or "") + f"\n{args[0]} did not finish in {timeout:g} s")
            except BaseException:
                _kill_group(proc)
                proc.communicate()
                raise
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        """SIGTERM and SIGINT raise Interrupted in the main thread, except while a run goes
        down: then they are only remembered (a second Ctrl-C must not cut `down` short)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_signal(signum: int, frame: object) -> None:
            name = signal.Signals(signum).name
            if self._defer_signals:
                self.interrupted = self.interrupted or name
                return
            raise Interrupted(name)

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def leftovers(token: str | None, record: RunRecord | None,
              wait_s: float = LEFTOVER_WAIT_S) -> list[str]:
    """What of a run still runs: processes carrying its token (every child of a launch gets
    it), and the processes its record named still alive as themselves. A process may take a
    moment to exit after `down`; each is given until `wait_s` is over."""
    deadline = time.monotonic() + wait_s
    while True:
        found = _still_running(token, record)
        if not found or time.monotonic() >= deadline:
            return [f"pid {pid} ({name})" for pid, name in sorted(found.items())]
        time.sleep(0.2)


def _still_running(token: str | None, record: RunRecord | None) -> dict[int, str]:
    me = psutil.Process()
    exempt = {me.pid, *(p.pid for p in me.parents())}
    found: dict[int, str] = {}
    if token:  # the launcher's own definition of "carries the run token"
        for ident in token_carriers(token, exclude=exempt):
            found[ident.pid] = _name(ident.pid)
    if record is not None:
        identities = list(record.identities())
        for replica in record.replicas:
            identities += [ProcessIdentity(p.pid, p.create_time) for p in replica.processes
                           if p.create_time is not None]
        for ident in identities:
            if ident.pid not in exempt and is_alive(ident):
                found.setdefault(ident.pid, _name(ident.pid))
    return found


def _name(pid: int) -> str:
    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return "?"


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _gpu_count(launch_args: Sequence[str]) -> int:
    """How many GPUs `--gpus` lists among launch's options (0 without it; `all`: as many as
    NVML sees) — for the ports a configuration needs."""
    own = list(launch_args[:list(launch_args).index("--")] if "--" in launch_args
               else launch_args)
    value = next((own[i + 1] for i, arg in enumerate(own[:-1]) if arg == "--gpus"),
                 next((arg.split("=", 1)[1] for arg in own if arg.startswith("--gpus=")), None))
    if value is None:
        return 0
    if value.strip() == "all":
        from omni_dp.gpus import query_gpus

        return max(len(query_gpus().gpus), 1)
    return len(value.split(","))


def _ports(launch_args: Sequence[str], replicas: int) -> list[str]:
    """Free loopback ports for the run (replicas, then the router after them), unless the
    launch options name them: the defaults (8000, 8100) may be taken on a shared host."""
    own = launch_args[:launch_args.index("--")] if "--" in launch_args else launch_args
    if any(a.split("=", 1)[0] in PORT_FLAGS for a in own):
        return []
    base = _free_block(replicas + 1)
    return ["--base-port", str(base), "--router-port", str(base + replicas)]


def _free_block(n: int, attempts: int = 100) -> int:
    for _ in range(attempts):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n < 65536 and not any(port_taken("127.0.0.1", base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no block of {n} free loopback ports found")


def _last_lines(done: subprocess.CompletedProcess) -> str:
    text = (done.stderr or "").strip() or (done.stdout or "").strip() or "no output"
    return " | ".join(line.strip() for line in text.splitlines()[-REASON_LINES:] if line.strip())


def _point_line(p: PointResult) -> str:
    failed = sum(p.failures.values())
    p99 = f"{p.latency_p99_s:.3f} s" if p.latency_p99_s is not None else "-"
    return (f"{p.requests_per_s:.2f} req/s, p99 {p99}, {p.ok}/{p.requests} ok"
            + (f", failures {p.failures}" if failed else ""))


