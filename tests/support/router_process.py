"""One real `omni-dp router` process for the router tests: its log in a file, stopped by pid
(SIGTERM to drain, or SIGKILL to it and its own worker processes)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from support.ports import LOOPBACK, free_port
from support.wait import until


class RouterProcess:
    """`omni-dp router --port PORT ARGS` (a free port unless given)."""

    def __init__(self, log_path: Path, *args: str, port: int | None = None) -> None:
        self.port = port if port is not None else free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"
        self.log_path = log_path
        self.args = ["--port", str(self.port), *args]
        self.proc: asyncio.subprocess.Process | None = None
        self._log = None

    async def start(self) -> RouterProcess:
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in kill()
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "omni_dp", "router", *self.args,
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        return self

    def log_text(self) -> str:
        return self.log_path.read_text()

    async def wait_listening(self, workers: int = 1, timeout: float = 15) -> None:
        def listening() -> bool:
            assert self.proc.returncode is None, self.log_text()
            return self.log_text().count("router listening on") >= workers

        await until(listening, timeout, f"{self.log_path.name}: {workers} listening line(s)",
                    interval=0.02)

    async def stop(self, timeout: float = 15) -> int:
        os.kill(self.proc.pid, signal.SIGTERM)
        return await asyncio.wait_for(self.proc.wait(), timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(self.proc.pid).children(recursive=True):
                    child.kill()  # our router's own workers, by pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
        if self._log is not None:
            self._log.close()

    async def killed(self, timeout: float = 10) -> None:
        """kill(), then reap it."""
        self.kill()
        if self.proc is not None:
            await asyncio.wait_for(self.proc.wait(), timeout)
