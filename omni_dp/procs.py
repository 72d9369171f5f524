"""Process identity: a pid alone is not a process.

A pid is recycled by the kernel; omni-dp only ever signals or trusts a process whose pid AND
create time match what it recorded, or whose environment carries the run's token.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    create_time: float  # psutil's, seconds since the epoch

    def to_json(self) -> dict:
        return {"pid": self.pid, "create_time": self.create_time}

    @classmethod
    def from_json(cls, data: dict) -> ProcessIdentity:
        return cls(int(data["pid"]), float(data["create_time"]))


def identify(pid: int) -> ProcessIdentity | None:
    try:
        return ProcessIdentity(pid, psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def is_alive(identity: ProcessIdentity) -> bool:
    """The recorded process still exists (not a recycled pid) and is not a zombie."""
    try:
        process = psutil.Process(identity.pid)
        return (
            process.create_time() == identity.create_time
            and process.status() != psutil.STATUS_ZOMBIE
        )
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def read_environ(pid: int) -> dict[str, str] | None:
    """The environment a process started with, or None when it is gone or not ours to read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env
