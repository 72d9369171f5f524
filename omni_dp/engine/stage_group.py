"""The front's side of a split replica: it starts the stage processes, hears them, stops them.

Only `main` (the HTTP front) owns one. Each stage process is our child (Popen), in the
replica's session, started from the main thread (PR_SET_PDEATHSIG follows the thread that
forked: a child of a pool thread would die when that thread did). A thread per child waits
for its exit: an exit the front did not ask for makes the replica unhealthy at once; one
receiver thread reads main's inbox and hands every message to the front.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from omni_dp.engine import messages
from omni_dp.engine.links import Inbox, Outbox, endpoint, socket_dir
from omni_dp.engine.stage_launch import StageLaunch, TPRank
from omni_dp.placement.model import MAIN_PROCESS, Placement, ProcessPlan
from omni_dp.procs import ProcessIdentity, identify

log = logging.getLogger("omni_dp.serve")

SOCKET_DIR_PREFIX = "omni-dp-stages-"
RECV_POLL_S = 0.2  # how often the receiver looks up from the inbox to see whether to stop
STOP_TIMEOUT_S = 10.0


OWNER_FILE = "owner.json"  # in a socket directory: the front that made it


class StageStartFailed(RuntimeError):
    pass


def make_socket_dir() -> Path:
    """This front's private socket directory, with its owner recorded; the directories that
    killed fronts left behind are swept first."""
    sweep_stale_socket_dirs(Path(tempfile.gettempdir()))
    directory = socket_dir(SOCKET_DIR_PREFIX)
    me = identify(os.getpid())
    assert me is not None  # this very process
    (directory / OWNER_FILE).write_text(json.dumps(me.to_json()))
    return directory


def sweep_stale_socket_dirs(root: Path) -> list[Path]:
    """Remove the socket directories of fronts that are gone: a front killed with -9 runs no
    cleanup, so the next one of this user does it. Only directories with our prefix, owned by
    this user, whose owner record names a pid that no longer exists; anything else is left
    (a recycled pid keeps its directory: never delete a live replica's sockets on a guess)."""
    removed = []
    for path in root.glob(SOCKET_DIR_PREFIX + "*"):
        try:
            info = path.lstat()
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                continue
            owner = ProcessIdentity.from_json(json.loads((path / OWNER_FILE).read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not psutil.pid_exists(owner.pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


class StageGroup:
    def __init__(self, placement: Placement, base: dict, *,
                 on_message: Callable[[object], None], on_fatal: Callable[[str], None],
                 log_level: str, log_format: str) -> None:
        """`base`: the StageLaunch fields every process shares (model, dtype, KV pages...);
        `threads`, the replica's, is split among its processes (process_threads)."""
        from omni_dp.engine.placement_plan import process_threads

        self.placement = placement
        base = dict(base)
        self.threads = process_threads(placement, base.pop("threads"))
        self._base = base
        self._on_message = on_message
        self._on_fatal = on_fatal
        self._log = (log_level, log_format)
        self.directory = make_socket_dir()
        self.endpoints = {p.name: endpoint(self.directory, p.name) for p in placement.processes}
        self.inbox = Inbox(self.endpoints[MAIN_PROCESS])
        self.outbox = Outbox()
        self.children: dict[str, subprocess.Popen] = {}
        self.ready: dict[str, int] = {}
        self._changed = threading.Condition()
        self._failure: str | None = None
        self._abandoned = False  # abandon_start: the front stops before every stage is ready
        self._stopping = threading.Event()
        self._store = None  # the TP rendezvous, open while the group runs
        self._receiver = threading.Thread(target=self._receive, name="stage-inbox", daemon=True)

    @property
    def remote(self) -> list[ProcessPlan]:
        return [p for p in self.placement.processes if p.name != MAIN_PROCESS]

    def endpoint_of(self, stage: str) -> list[str]:
        """Where a stage's messages go: each of its processes (TP: rank 0 alone)."""
        return [self.endpoints[p.name] for p in self.placement.process_of(stage)
                if not p.tp_rank]

    # --- start ---------------------------------------------------------------------------
    def spawn(self) -> None:
        """Start every stage process. Call from the main thread (see the module's docstring)."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("stage processes are started from the main thread only")
        self._receiver.start()
        tp_port = None
        if any(p.tp_rank is not None for p in self.remote):
            from omni_dp.engine.tensor_parallel import open_store

            self._store, tp_port = open_store()
        for process in self.remote:
            spec = self._launch(process, tp_port)
            child = subprocess.Popen([sys.executable, "-m", "omni_dp.engine.stage_process",
                                      spec.argv_word(), str(os.getpid())],
                                     stdin=subprocess.DEVNULL)
            self.children[process.name] = child
            threading.Thread(target=self._watch, args=(process.name, child),
                             name=f"watch-{process.name}", daemon=True).start()
            log.info("stage process %s (pid %d): starting %s on %s", process.name, child.pid,
                     ", ".join(process.stages), process.device)

    def _launch(self, process: ProcessPlan, tp_port: int | None) -> StageLaunch:
        tp = None
        if process.tp_rank is not None:
            assert tp_port is not None
            tp = TPRank(process.tp_rank, process.tp_size, tp_port,
                        "gloo" if process.device == "cpu" else "nccl")
        return StageLaunch(
            **self._base, threads=self.threads[process.name], process=process.name,
            stages=process.stages, device=process.device,
            inbox=self.endpoints[process.name], front=self.endpoints[MAIN_PROCESS],
            vocoders=tuple(self.endpoint_of("vocoder")), log_level=self._log[0],
            log_format=self._log[1], budget_bytes=process.budget_bytes, tp=tp,
            pipeline=self.placement.pipeline.name)

    def wait_ready(self, timeout_s: float) -> None:
        """Block until every stage process said Ready; StageStartFailed when one failed or
        exited first, or the time ran out (each says which process)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while len(self.ready) < len(self.children):
                if self._failure is not None:
                    raise StageStartFailed(self._failure)
                if self._abandoned:
                    raise StageStartFailed("the replica was stopped while its stage processes "
                                           "started")
                left = deadline - time.monotonic()
                if left <= 0:
                    waiting = sorted(set(self.children) - set(self.ready))
                    raise StageStartFailed(f"stage process(es) {', '.join(waiting)} not ready "
                                           f"within {timeout_s:.0f} s")
                self._changed.wait(left)

    def abandon_start(self) -> None:
        """The front is stopping before every stage said Ready: wait_ready returns now (a
        failure after this is still a failure: it reaches on_fatal)."""
        with self._changed:
            self._abandoned = True
            self._changed.notify_all()

    # --- while serving -------------------------------------------------------------------
    def send(self, endpoint_: str, message: object) -> None:
        self.outbox.send(endpoint_, message)

    def pid_of(self, process: str) -> int | None:
        child = self.children.get(process)
        return None if child is None else child.pid

    def _receive(self) -> None:
        try:
            while not self._stopping.is_set():
                message = self.inbox.recv(RECV_POLL_S)
                if message is None:
                    continue
                if isinstance(message, messages.Ready):
                    with self._changed:
                        self.ready[message.process] = message.pid
                        self._changed.notify_all()
                elif isinstance(message, messages.StageFailed):
                    self._fail(f"stage process {message.process} failed: {message.reason}")
                else:
                    self._on_message(message)
        except Exception as exc:  # a message we cannot read is a replica we cannot trust
            self._fail(f"the front's stage inbox failed: {exc!r}")
        finally:
            self.inbox.close()

    def _watch(self, name: str, child: subprocess.Popen) -> None:
        code = child.wait()
        if not self._stopping.is_set():
            how = f"was killed by signal {-code}" if code < 0 else f"exited {code}"
            self._fail(f"stage process {name} (pid {child.pid}) {how}")

    def _fail(self, reason: str) -> None:
        with self._changed:
            first = self._failure is None
            self._failure = self._failure or reason
            self._changed.notify_all()
        if first:
            self._on_fatal(reason)

    # --- stop ----------------------------------------------------------------------------
    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop every stage process: Stop first (a TP rank 0 releases its followers), then
        SIGKILL what is left after `timeout_s`. Our children only: a child's pid cannot be
        taken by another process before it is reaped, and Popen.kill does nothing once its
        wait() has reaped it."""
        self._stopping.set()
        for process in self.remote:
            child = self.children.get(process.name)
            if child is None or child.poll() is not None:
                continue
            if process.name not in self.ready:
                child.kill()  # still starting: it holds no request, and would stop only once built
            elif not process.tp_rank:
                with contextlib.suppress(Exception):
                    self.outbox.send(self.endpoints[process.name], messages.Stop())
        deadline = time.monotonic() + timeout_s
        for name, child in self.children.items():
            try:
                child.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("stage process %s (pid %d) did not stop in %.0f s; killing it",
                            name, child.pid, timeout_s)
                child.kill()
                child.wait()
        if self._receiver.ident is not None:
            self._receiver.join(2 * RECV_POLL_S + 1)  # it closes the inbox as it ends
        else:  # stopped before spawn (a start-up that failed or was signalled first)
            self.inbox.close()
        self.outbox.close_all()
        shutil.rmtree(Path(self.directory), ignore_errors=True)
        self._store = None


def start_group(placement: Placement, launch_base: dict | None, threads: int, *,
                on_message: Callable[[object], None], on_fatal: Callable[[str], None],
                log_setup: tuple[str, str]) -> tuple[StageGroup | None, dict[str, int]]:
    """A front's stage group (None for a single-process placement) and the replica's threads
    per process: one split, the one the children run."""
    from omni_dp.engine.placement_plan import process_threads

    if placement.is_single_process:
        return None, process_threads(placement, threads)
    assert launch_base is not None, "a split placement needs its stage processes' fields"
    group = StageGroup(placement, {**launch_base, "threads": threads}, on_message=on_message,
                       on_fatal=on_fatal, log_level=log_setup[0], log_format=log_setup[1])
    return group, group.threads


async def wait_until_ready(group: StageGroup | None, stopped: asyncio.Event,
                           timeout_s: float) -> bool:
    """A front's wait for its stage processes: True once every one said Ready (at once with
    none), False when `stopped` is set first (a signal during start-up stops at once rather
    than after the stages are up); StageStartFailed when one failed."""
    if group is None:
        return True
    ready = asyncio.ensure_future(asyncio.to_thread(group.wait_ready, timeout_s))
    stop = asyncio.ensure_future(stopped.wait())
    await asyncio.wait({ready, stop}, return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if ready.done():
        ready.result()  # StageStartFailed propagates
        return True
    group.abandon_start()  # its waiting thread returns now; stop() does the rest
    with contextlib.suppress(StageStartFailed):
        await ready
    return False


def process_rows(placement: Placement, threads: dict[str, int],
                 group: StageGroup | None) -> list[dict]:
    """The `processes` of /get_server_info: every OS process of the replica, the front's
    own and its stage processes' pids, which the launcher's MPS attachment proof checks."""
    rows = []
    for process in placement.processes:
        pid = (os.getpid() if process.name == MAIN_PROCESS
               else group.pid_of(process.name) if group is not None else None)
        rows.append({"pid": pid, "role": process.name, "device": process.device,
                     "stages": list(process.stages), "threads": threads[process.name]})
    return rows
