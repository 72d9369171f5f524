"""Starting the run's processes and signalling them — only ever the run's own.

A process is the run's if its pid AND create time match a record, or if its environment carries
the run token (a replica's processes beyond its leader: groups.py). Everything that
signals goes through `signal_ours`, which re-checks that at the moment of signalling; a recycled
pid is skipped, never signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from omni_dp.contract import API_KEY_ENV, RUN_IDENTITY_ENVS, TOKEN_ENV
from omni_dp.launcher.planning.options import GATEWAY_KEY_ENV
from omni_dp.launcher.planning.plan import THREAD_VARIABLES
from omni_dp.launcher.record.state import append_private
from omni_dp.mps.control import LIMIT_ENVS
from omni_dp.procs import ProcessIdentity, identify, is_alive, read_environ

# Inherited values of these would attach a replica to someone else's run or MPS daemon, or
# silently cap its share of the GPU (an MPS client's limit variables only ever lower what the
# daemon gives; one replica capped by a stray export breaks the "equal replicas" premise).
# What the launch itself sets (the plan's env) is applied after and wins.
_NOT_INHERITED = (*RUN_IDENTITY_ENVS, API_KEY_ENV, GATEWAY_KEY_ENV, "CUDA_MPS_PIPE_DIRECTORY",
                  "CUDA_MPS_LOG_DIRECTORY", "CUDA_VISIBLE_DEVICES", *LIMIT_ENVS,
                  *THREAD_VARIABLES)


@dataclass
class Started:
    identity: ProcessIdentity
    popen: subprocess.Popen

    @property
    def pid(self) -> int:
        return self.identity.pid


def child_env(extra: Mapping[str, str], token: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
    env.update(extra)
    env[TOKEN_ENV] = token
    env.setdefault("PYTHONUNBUFFERED", "1")  # log lines reach the log file as they happen
    return env


def spawn(argv: Sequence[str], env: dict[str, str], log_path: Path,
          cwd: Path | None = None) -> Started:
    """Start argv in a session of its own (pgid = pid), output appended to log_path."""
    with append_private(log_path) as log:
        popen = subprocess.Popen(list(argv), env=env, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True,
                                 close_fds=True, cwd=cwd)
    identity = identify(popen.pid)
    if identity is None:  # exited (and was reaped) at once: keep the pid for the record
        identity = ProcessIdentity(popen.pid, 0.0)
    return Started(identity, popen)


def carries_token(pid: int, token: str) -> bool:
    env = read_environ(pid)
    return env is not None and env.get(TOKEN_ENV) == token


def is_ours(identity: ProcessIdentity, token: str | None = None) -> bool:
    """pid + create time match the record (alive, not a zombie), or it carries the token."""
    if is_alive(identity):
        return True
    return token is not None and carries_token(identity.pid, token) and _not_zombie(identity.pid)


def _not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def signal_ours(identity: ProcessIdentity, sig: int, token: str | None = None, *,
                group: bool = False) -> bool:
    """Send sig if the process is still ours; to its whole group when it leads one. Returns
    whether a signal was sent."""
    if not is_ours(identity, token):
        return False
    try:
        if group and os.getpgid(identity.pid) == identity.pid:
            os.killpg(identity.pid, sig)
        else:
            os.kill(identity.pid, sig)
        return True
    except (ProcessLookupError, PermissionError):  # gone, or became another user's (setuid)
        return False


def token_carriers(token: str, *, exclude: set[int] = frozenset()) -> list[ProcessIdentity]:
    """Every live process of this user whose environment carries the run token."""
    uid = os.getuid()
    found = []
    for process in psutil.process_iter(["pid", "uids", "status"]):
        info = process.info
        if info["pid"] in exclude or info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if info["uids"] is None or info["uids"].real != uid:
            continue
        identity = identify(info["pid"]) if carries_token(info["pid"], token) else None
        if identity is not None:
            found.append(identity)
    return found


def wait_gone(identities: list[ProcessIdentity], timeout_s: float,
              reap: list[subprocess.Popen] = ()) -> list[ProcessIdentity]:
    """Wait until none is alive (bounded); returns the survivors."""
    deadline = time.monotonic() + timeout_s
    while True:
        for popen in reap:  # our own children would otherwise linger as zombies
            with contextlib.suppress(Exception):
                popen.poll()
        alive = [i for i in identities if is_alive(i)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def stop_processes(identities: list[ProcessIdentity], token: str | None, drain_s: float, *,
                   grace_s: float = 5.0, reap: list[subprocess.Popen] = ()
                   ) -> list[ProcessIdentity]:
    """SIGTERM each group (drain), after drain_s a second SIGTERM (stop without waiting, for
    those that honour it, as `omni-dp serve` does), after grace_s more SIGKILL of what is still
    ours. Returns the survivors (none, unless the kernel would not let them go)."""
    for identity in identities:
        signal_ours(identity, signal.SIGTERM, token, group=True)
    survivors = wait_gone(identities, drain_s, reap)
    for identity in survivors:
        signal_ours(identity, signal.SIGTERM, token, group=True)
    survivors = wait_gone(survivors, grace_s, reap)
    for identity in survivors:
        signal_ours(identity, signal.SIGKILL, token, group=True)
    return wait_gone(survivors, 5.0, reap)
