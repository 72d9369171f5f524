"""Helpers for end-to-end tests of `omni-dp launch` and the commands around a run.

Every run lives under its own state directory (OMNI_DP_STATE_DIR=a pytest tmp dir), listens on
loopback ports that were free a moment before, and is cleaned up by `Run.cleanup()`: it always
runs `omni-dp down`, then SIGKILLs, by pid, every process still carrying the run's token (read
from /proc/PID/environ) or, failing a token, the run's id under the same state directory. So a
failing test never leaves processes behind. `MpsRun` is a run under --mps, on the real control
daemon behind support/mps_hybrid.py's front end. Their fixtures (`runs`, `mps_run`) are
tests/launcher/conftest.py's.

    with Run(tmp_path) as run:
        run.launch("--replicas", "2")       # --detach, ports and --run-id filled in
        status = run.status()                # `omni-dp status --json`, another process
        run.down()
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil

from omni_dp.engine.options import DEFAULT_MODEL_ENV  # the seeded default's pin: kept
from omni_dp.procs import ProcessIdentity, is_alive, start_of
from omni_dp.procs import read_environ as environ

from support.mps import real_control_binary
from support.mps_hybrid import Hybrid
from support.ports import free_port, free_port_block, port_listening
from support.wait import wait_for

ROOT = Path(__file__).resolve().parents[2]
CLI_TIMEOUT_S = 120.0
TOKEN_ENV = "OMNI_DP_RUN_TOKEN"
STATE_ENV = "OMNI_DP_STATE_DIR"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
RESTART_TIMEOUT_S = 30.0
SUPERVISION = ("--check-interval", "0.5", "--drain-timeout", "5")
_CONSOLE_SCRIPT = Path(sys.executable).with_name("omni-dp")
OMNI_DP = [str(_CONSOLE_SCRIPT)] if _CONSOLE_SCRIPT.exists() else [sys.executable, "-m",
                                                                   "omni_dp"]


# --- processes ------------------------------------------------------------------------------


def alive(pid: int | None, create_time: float | None = None) -> bool:
    """The pid exists (with this create time, when given: not a recycled pid) and is not a
    zombie (a daemon's exit waits for a late reaper)."""
    if pid is None:
        return False
    if create_time is not None:
        return is_alive(ProcessIdentity(pid, create_time))
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def matching_pids(predicate: Callable[[dict[str, str]], bool]) -> list[int]:
    """Live (non-zombie) processes of this user whose environment satisfies predicate."""
    me, uid, found = os.getpid(), os.getuid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        try:
            if entry.stat().st_uid != uid:
                continue
        except OSError:
            continue
        env = environ(pid)
        if env is not None and predicate(env) and alive(pid):
            found.append(pid)
    return sorted(found)


def token_pids(token: str) -> list[int]:
    return matching_pids(lambda env: env.get(TOKEN_ENV) == token)


def cpus_allowed(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no Cpus_allowed_list in /proc/{pid}/status")


# --- a run ------------------------------------------------------------------------------------


class Run:
    """One run of `omni-dp launch` in its own state directory, on fresh loopback ports."""

    def __init__(self, tmp_path: Path, replicas: int = 2, run_id: str | None = None) -> None:
        self.state_root = tmp_path / "state"
        self.run_id = run_id or f"e2e-{uuid.uuid4().hex[:8]}"
        self.replicas = replicas
        self.router_port = free_port()
        self.base_port = free_port_block(replicas, avoid=(self.router_port,))
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.out_path = tmp_path / f"launch-{self.run_id}.out"
        self.foreground: subprocess.Popen | None = None
        self._out_file = None
        self._token: str | None = None
        self._recorded: dict[int, float] = {}  # pid -> create time, from every run.json seen
        self._leaders: dict[int, float] = {}  # replicas' session leaders, from every run.json

    # --- paths and recorded state ---------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if (not k.startswith("OMNI_DP_") or k == DEFAULT_MODEL_ENV) and k != TOKEN_ENV}
        env["OMNI_DP_STATE_DIR"] = str(self.state_root)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    @property
    def run_dir(self) -> Path:
        return self.state_root / "runs" / self.run_id

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    @property
    def ports(self) -> list[int]:
        return [self.router_port, *range(self.base_port, self.base_port + self.replicas)]

    @property
    def token(self) -> str | None:
        """The run's token (read once from run_token, so still known after `down`)."""
        return self._read_token()

    def run_json(self) -> dict:
        data = json.loads((self.run_dir / "run.json").read_text())
        self._remember(data)
        return data

    def write_run_json(self, data: dict) -> None:
        path = self.run_dir / "run.json"
        tmp = path.with_name(".run.json.test")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)

    def events(self) -> list[dict]:
        try:
            lines = (self.run_dir / "events.jsonl").read_text().splitlines()
        except OSError:
            return []
        return [json.loads(line) for line in lines if line.strip()]

    def recorded(self) -> dict[int, float]:
        """pid -> create time of every process any run.json of this run recorded (as seen by
        this helper: it reads run.json at every command)."""
        with contextlib.suppress(OSError, ValueError):
            self.run_json()
        return dict(self._recorded)

    def recorded_alive(self) -> list[int]:
        """Recorded processes still running as themselves (a recycled pid does not count)."""
        return sorted(pid for pid, created in self._recorded.items()
                      if alive(pid, created))

    def _remember(self, data: dict) -> None:
        records = [data.get("supervisor"), data.get("router"),
                   *(data.get("mps") or {}).get("daemons", ()), *data.get("replicas", [])]
        for record in records:
            if record and record.get("pid") and record.get("create_time"):
                self._recorded.setdefault(int(record["pid"]), float(record["create_time"]))
        for replica in data.get("replicas", []):
            if replica.get("pid") and replica.get("create_time"):
                self._leaders.setdefault(int(replica["pid"]), float(replica["create_time"]))
            for process in replica.get("processes") or ():  # found in its session
                if process.get("create_time"):
                    self._recorded.setdefault(int(process["pid"]), float(process["create_time"]))
        self._read_token()

    def _read_token(self) -> str | None:
        if self._token is None:
            with contextlib.suppress(OSError):
                self._token = (self.run_dir / "run_token").read_text().strip() or None
        return self._token

    # --- commands -------------------------------------------------------------------------

    def cli(self, *args: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
        """`omni-dp ARGS` in a fresh process ("another shell") with this run's state dir."""
        return subprocess.run([*OMNI_DP, *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)

    def launch_argv(self, *args: str, detach: bool = True) -> list[str]:
        argv = ["launch", "--replicas", str(self.replicas), "--run-id", self.run_id,
                "--router-port", str(self.router_port), "--base-port", str(self.base_port)]
        if "--max-total-tokens" not in args and "--kv-cache-bytes" not in args:
            argv += ["--max-total-tokens", "1024"]
        if detach:
            argv.append("--detach")
        return [*argv, *args]

    def launch(self, *args: str, check: bool = True,
               timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
        """`omni-dp launch --detach ...`; with check, assert exit 0 (showing the output)."""
        result = self.cli(*self.launch_argv(*args), timeout=timeout)
        with contextlib.suppress(OSError, ValueError):
            self.run_json()
        if check:
            assert result.returncode == 0, describe(result)
        return result

    def launch_foreground(self, *args: str) -> subprocess.Popen:
        """`omni-dp launch ...` without --detach; its output goes to self.out_path."""
        self._out_file = open(self.out_path, "w")  # noqa: SIM115 - closed in cleanup()
        self.foreground = subprocess.Popen(
            [*OMNI_DP, *self.launch_argv(*args, detach=False)], env=self.env,
            stdout=self._out_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return self.foreground

    def output(self) -> str:
        try:
            return self.out_path.read_text()
        except OSError:
            return ""

    def status(self, timeout: float = CLI_TIMEOUT_S) -> dict:
        """`omni-dp status RUN --json` (exit 0: all healthy, 1: not; both print the JSON)."""
        result = self.cli("status", self.run_id, "--json", timeout=timeout)
        assert result.returncode in (0, 1), describe(result)
        data = json.loads(result.stdout)
        with contextlib.suppress(OSError, ValueError):
            self.run_json()
        return data

    def down(self, *args: str, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
        with contextlib.suppress(OSError, ValueError):
            self.run_json()
        return self.cli("down", self.run_id, *args, timeout=timeout)

    # --- what is left -------------------------------------------------------------------

    def leftover_pids(self) -> list[int]:
        """Processes of this run still running: they carry its token, or (when no token was
        ever read) its run id under this state directory."""
        token, root = self.token, str(self.state_root)

        def ours(env: dict[str, str]) -> bool:
            if token is not None and env.get(TOKEN_ENV) == token:
                return True
            return (env.get("OMNI_DP_STATE_DIR") == root
                    and env.get("OMNI_DP_RUN_ID") == self.run_id)

        return sorted(set(matching_pids(ours)) | set(self.session_pids())
                      | set(self.recorded_alive()))

    def session_pids(self) -> list[int]:
        """Processes in the session of a replica this run started (an engine's children drop
        the token from their environment), created after that session's leader."""
        # A session whose leader's pid now belongs to another process is not the run's.
        sessions = {pid: created for pid, created in self._leaders.items()
                    if alive(pid, created) or not psutil.pid_exists(pid)}
        found = []
        for pid in psutil.pids():
            with contextlib.suppress(OSError):
                created, started = sessions.get(os.getsid(pid)), start_of(pid)
                if created is not None and started is not None and started >= created \
                        and alive(pid):
                    found.append(pid)
        return sorted(found)

    def listening_ports(self) -> list[int]:
        return [p for p in self.ports if port_listening(p)]

    def cleanup(self) -> list[int]:
        """Always: `omni-dp down`, then SIGKILL whatever of the run survived. Returns the pids
        that had to be killed here (empty when the product cleaned up after itself)."""
        if self.foreground is not None and self.foreground.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.foreground.send_signal(signal.SIGTERM)
            try:
                self.foreground.wait(60)
            except subprocess.TimeoutExpired:
                self.foreground.kill()
                self.foreground.wait(10)
        if self.run_dir.exists():
            self._read_token()  # before down removes it
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                self.down(timeout=90)
        killed = self.leftover_pids()
        for pid in killed:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while killed and any(alive(p) for p in killed) and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._out_file is not None:
            self._out_file.close()
        return killed

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()


def describe(result: subprocess.CompletedProcess) -> str:
    return (f"exit {result.returncode} from {' '.join(map(str, result.args))}\n"
            f"--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}")


def kill_replica(run: Run, index: int) -> int:
    """SIGKILL replica `index` of the run (checking it carries the run's token); its pid."""
    pid = run.run_json()["replicas"][index]["pid"]
    assert run.token is not None and environ(pid)["OMNI_DP_RUN_TOKEN"] == run.token
    os.kill(pid, signal.SIGKILL)
    wait_for(f"replica {index} (pid {pid}) to die", lambda: not alive(pid), timeout=10,
             interval=0.05)
    return pid


# --- a run under --mps ----------------------------------------------------------------------------


INSTALLED_MPS_CONTROL = ROOT / ".cache" / "mps" / "usr" / "bin" / "nvidia-cuda-mps-control"


def real_mps_binary() -> str:
    """scripts/install-mps-control's binary when nothing else is configured, else the shared
    lookup (which skips, or fails under OMNI_DP_REQUIRE_MPS=1)."""
    if not os.environ.get("OMNI_DP_MPS_CONTROL") and os.access(INSTALLED_MPS_CONTROL, os.X_OK):
        return str(INSTALLED_MPS_CONTROL)
    found = real_control_binary()
    assert found is not None
    return found


def daemon_pids(real: str, pipe_dir: str) -> list[int]:
    """Live control daemons (`-d`) of the real binary serving this pipe dir. The short-lived
    front ends of a concurrent query (same binary, same pipe dir, no `-d`) are not counted."""
    real = os.path.realpath(real)
    pids = []
    for pid in matching_pids(lambda env: env.get(PIPE_ENV) == pipe_dir):
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(pid)
            if os.path.realpath(process.exe()) == real and "-d" in process.cmdline()[1:]:
                pids.append(pid)
    return pids


class MpsRun:
    """One `omni-dp launch --mps` run: its short state dir, ports, hybrid front end and CLI
    (tests/launcher/conftest.py's `mps_run` makes one and cleans up after it)."""

    def __init__(self, state_dir: Path, hybrid: Hybrid, real: str, run_id: str) -> None:
        self.state_dir = state_dir
        self.hybrid = hybrid
        self.real = real
        self.run_id = run_id
        self.run_dir = state_dir / "runs" / run_id
        self.pipe_dir = str(self.run_dir / "mps" / "pipe")
        self.log_dir = str(self.run_dir / "mps" / "log")
        self.token: str | None = None
        self.router_url = ""
        self.declare_cuda = True

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("OMNI_DP_", "CUDA_MPS_", "MPS_HYBRID_"))
               or k == DEFAULT_MODEL_ENV}
        env.update(self.hybrid.env(declare_cuda=self.declare_cuda))
        env[STATE_ENV] = str(self.state_dir)
        return env

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "omni_dp", *args], env=self.env(),
                              capture_output=True, text=True, timeout=timeout, check=False,
                              stdin=subprocess.DEVNULL)

    def launch(self, *extra: str, replicas: int = 2) -> subprocess.CompletedProcess:
        base = free_port_block(replicas + 1)
        self.router_url = f"http://127.0.0.1:{base + replicas}"
        done = self.cli("launch", "--replicas", str(replicas), "--max-total-tokens", "1024",
                        "--mps", "--no-gpu-check", "--mps-control", str(self.hybrid.binary),
                        "--detach", "--run-id", self.run_id, "--base-port", str(base),
                        "--router-port", str(base + replicas), "--drain-timeout", "5",
                        *extra)
        with contextlib.suppress(OSError):
            self.token = (self.run_dir / "run_token").read_text().strip()
        return done

    def record(self) -> dict:
        return json.loads((self.run_dir / "run.json").read_text())

    def events(self) -> list[str]:
        path = self.run_dir / "events.jsonl"
        return [json.loads(line)["event"] for line in path.read_text().splitlines()] \
            if path.exists() else []

    def status(self) -> dict:
        done = self.cli("status", self.run_id, "--json")
        assert done.stdout, done.stderr
        return json.loads(done.stdout)

    def token_carriers(self) -> list[int]:
        token = self.token
        return matching_pids(lambda env: token is not None and env.get(TOKEN_ENV) == token)

    def daemons(self) -> list[int]:
        return daemon_pids(self.real, self.pipe_dir)

    def leftovers(self) -> list[int]:
        """Every live process of this run: token carriers, daemons, anything else started with
        this state dir in its environment."""
        state = str(self.state_dir)
        return sorted(set(self.token_carriers()) | set(
            matching_pids(lambda env: env.get(STATE_ENV) == state
                          or env.get(PIPE_ENV, "").startswith(state + os.sep))))

    def logs(self) -> str:
        """For assertion messages: the run's logs and the stand-in's commands."""
        parts = []
        for path in sorted(self.run_dir.glob("logs/*.log*")) if self.run_dir.exists() else []:
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}")
        parts.append(f"--- hybrid commands: {self.hybrid.commands()}")
        return "\n".join(parts)
