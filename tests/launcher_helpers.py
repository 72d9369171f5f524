"""Helpers for end-to-end tests of `omni-dp launch` and the commands around a run.

Every run lives under its own state directory (OMNI_DP_STATE_DIR=a pytest tmp dir), listens on
loopback ports that were free a moment before, and is cleaned up by `Run.cleanup()`: it always
runs `omni-dp down`, then SIGKILLs, by pid, every process still carrying the run's token (read
from /proc/PID/environ) or, failing a token, the run's id under the same state directory. So a
failing test never leaves processes behind.

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
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil

from omni_dp.procs import read_environ as environ

from conftest import request

CLI_TIMEOUT_S = 120.0
TOKEN_ENV = "OMNI_DP_RUN_TOKEN"
_CONSOLE_SCRIPT = Path(sys.executable).with_name("omni-dp")
OMNI_DP = [str(_CONSOLE_SCRIPT)] if _CONSOLE_SCRIPT.exists() else [sys.executable, "-m",
                                                                   "omni_dp"]


# --- ports ----------------------------------------------------------------------------------


def free_ports(n: int) -> list[int]:
    """n distinct loopback ports that were free a moment ago (bound to port 0 together)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port_block(n: int, avoid: tuple[int, ...] = (), attempts: int = 200) -> int:
    """A base port such that base .. base+n-1 are all free on loopback (and not in avoid)."""
    for _ in range(attempts):
        base = free_ports(1)[0]
        if base + n - 1 > 65535:
            continue
        block = range(base, base + n)
        if any(p in avoid for p in block):
            continue
        if all(port_free(p) for p in block):
            return base
    raise RuntimeError(f"no block of {n} free loopback ports found")


def port_free(port: int) -> bool:
    """Nothing listens on 127.0.0.1:port and it can be bound."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return not port_listening(port)


def port_listening(port: int, timeout: float = 0.5) -> bool:
    """Something accepts connections on 127.0.0.1:port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout):
            return True
    except OSError:
        return False


# --- HTTP -----------------------------------------------------------------------------------


def http(method: str, url: str, body: dict | None = None,
         timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body); status 0 when there was no HTTP answer at all."""
    return request(method, url, json.dumps(body).encode() if body is not None else None,
                   timeout=timeout)


def speech(base_url: str, text: str = "Hello there.",
           timeout: float = 30.0) -> tuple[int, dict[str, str], bytes]:
    return http("POST", base_url + "/v1/audio/speech", {"input": text}, timeout=timeout)


def is_wav(body: bytes) -> bool:
    return len(body) > 44 and body[:4] == b"RIFF" and body[8:12] == b"WAVE"


# --- processes ------------------------------------------------------------------------------


def alive(pid: int | None) -> bool:
    """The pid exists and is not a zombie."""
    if pid is None:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def alive_as(pid: int | None, create_time: float | None) -> bool:
    """That very process (pid and create time) is still running."""
    if pid is None or create_time is None:
        return False
    try:
        process = psutil.Process(pid)
        return (process.create_time() == create_time
                and process.status() != psutil.STATUS_ZOMBIE)
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


def wait_for(what: str, check: Callable[[], object], timeout: float,
             interval: float = 0.2) -> object:
    """Poll check() until it returns something truthy; AssertionError naming `what` if not."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} "
                                 f"(last: {last!r})")
        time.sleep(interval)


# --- a run ------------------------------------------------------------------------------------


class Run:
    """One run of `omni-dp launch` in its own state directory, on fresh loopback ports."""

    def __init__(self, tmp_path: Path, replicas: int = 2, run_id: str | None = None) -> None:
        self.state_root = tmp_path / "state"
        self.run_id = run_id or f"e2e-{uuid.uuid4().hex[:8]}"
        self.replicas = replicas
        self.router_port = free_ports(1)[0]
        self.base_port = free_port_block(replicas, avoid=(self.router_port,))
        tmp_path.mkdir(parents=True, exist_ok=True)
        self.out_path = tmp_path / f"launch-{self.run_id}.out"
        self.foreground: subprocess.Popen | None = None
        self._out_file = None
        self._token: str | None = None
        self._recorded: dict[int, float] = {}  # pid -> create time, from every run.json seen

    # --- paths and recorded state ---------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("OMNI_DP_") and k != TOKEN_ENV}
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
                      if alive_as(pid, created))

    def _remember(self, data: dict) -> None:
        records = [data.get("supervisor"), data.get("router"),
                   (data.get("mps") or {}).get("daemon"), *data.get("replicas", [])]
        for record in records:
            if record and record.get("pid") and record.get("create_time"):
                self._recorded.setdefault(int(record["pid"]), float(record["create_time"]))
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

        return matching_pids(ours)

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
