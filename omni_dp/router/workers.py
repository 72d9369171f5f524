"""Running the router: one process, or K processes on one port (SO_REUSEPORT).

With K > 1 a small parent owns the children (gunicorn-style: it only spawns, relays and stops)
and relays admin changes: a `/workers` change lands on whichever child accepted the
connection; that child applies it, answers, and tells the parent, which passes it to every
other child over their pipes (milliseconds). Each child checks health and counts its own
in-flight requests; the in-flight bounds are split evenly between the children. Their metrics
are one view: prometheus-client's multiprocess mode over a directory the parent makes and
removes (metrics.py), so a scrape answered by any child reads the sums over all.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import multiprocessing
import os
import shutil
import signal
import tempfile
from multiprocessing.connection import Connection, wait

from omni_dp.contract import ExitCode
from omni_dp.logs import LogSetup, setup_logging
from omni_dp.logs import current as current_logs
from omni_dp.net import bind_listening
from omni_dp.router.app import Router, serve_router
from omni_dp.router.config import RouterConfig
from omni_dp.router.metrics import MULTIPROC_ENV

log = logging.getLogger("omni_dp.router")



def use_uvloop() -> None:
    with contextlib.suppress(ImportError):
        import uvloop  # optional: faster event loop when installed

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def run_router(config: RouterConfig, drain_s: float = 30.0) -> int:
    """Serve until SIGTERM/SIGINT; return the exit code."""
    try:
        sock = bind_listening(config.host, config.port, backlog=4096,
                              reuse_port=config.workers > 1)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s; pick another --port",
                  config.host, config.port, exc.strerror or exc)
        return ExitCode.USAGE
    if config.workers == 1:
        use_uvloop()
        asyncio.run(serve_router(config, sock, drain_s))
        return ExitCode.OK
    sock.close()  # proved the port is free; each child binds its own SO_REUSEPORT socket
    return _run_children(config, drain_s)


def child_config(config: RouterConfig) -> RouterConfig:
    """One child's share of the bounds (rounded up, so the sum is at least the whole; the
    slots kept for interactive requests too, as each child keeps its own)."""
    bound, readers, workers = config.max_inflight, config.max_body_readers, config.workers
    queued = config.max_queued
    return dataclasses.replace(
        config,
        workers=1,
        max_inflight=None if bound is None else math.ceil(bound / workers),
        max_inflight_per_replica=math.ceil(config.max_inflight_per_replica / workers),
        max_body_readers=None if readers is None else math.ceil(readers / workers),
        reserved_interactive=math.ceil(config.reserved_interactive / workers),
        max_queued=None if queued is None else math.ceil(queued / workers),
    )


def _child_main(config: RouterConfig, conn: Connection, index: int, drain_s: float,
                logs: LogSetup, metrics_dir: str) -> None:
    setup_logging(logs.level, logs.fmt, worker=index)  # the parent's, each line naming index
    use_uvloop()
    sock = bind_listening(config.host, config.port, backlog=4096, reuse_port=True)

    def attach(router: Router) -> None:
        router.on_change = conn.send
        loop = asyncio.get_running_loop()
        pending: set[asyncio.Task] = set()  # strong references until each change is applied

        def receive() -> None:
            try:
                change = conn.recv()
            except EOFError:  # the parent is gone: stop serving
                loop.remove_reader(conn.fileno())
                os.kill(os.getpid(), signal.SIGTERM)
                return
            task = loop.create_task(router.apply_change(change))
            pending.add(task)
            task.add_done_callback(pending.discard)

        loop.add_reader(conn.fileno(), receive)

    asyncio.run(serve_router(config, sock, drain_s, attach=attach, metrics_dir=metrics_dir))


def _run_children(config: RouterConfig, drain_s: float) -> int:
    ctx = multiprocessing.get_context("spawn")
    share = child_config(config)
    children: list[tuple[multiprocessing.process.BaseProcess, Connection]] = []
    metrics_dir = tempfile.mkdtemp(prefix="omni-dp-router-metrics-")
    # prometheus-client picks its value class when a process imports it: the children see
    # this in the environment they are spawned with (the parent's own metrics stay as they are).
    previous_env = os.environ.get(MULTIPROC_ENV)
    os.environ[MULTIPROC_ENV] = metrics_dir
    try:
        for index in range(config.workers):
            parent_end, child_end = ctx.Pipe()
            process = ctx.Process(
                target=_child_main, name=f"omni-dp-router-{index}",
                args=(share, child_end, index, drain_s, current_logs(), metrics_dir),
            )
            process.start()
            child_end.close()
            children.append((process, parent_end))
    except BaseException:  # a worker that cannot start: stop those that did, keep nothing
        for process, conn in children:
            process.kill()
            process.join()
            conn.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        raise
    finally:
        if previous_env is None:
            os.environ.pop(MULTIPROC_ENV, None)
        else:
            os.environ[MULTIPROC_ENV] = previous_env
    log.info("router: %d worker processes on %s:%d (pids %s)", config.workers, config.host,
             config.port, ", ".join(str(p.pid) for p, _ in children))

    stopping = False

    def on_signal(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    exit_code = ExitCode.OK
    try:
        while not stopping:
            ready = wait([c for _, c in children] + [p.sentinel for p, _ in children], 0.5)
            for item in ready:
                dead = next((p for p, _ in children if p.sentinel == item), None)
                if dead is not None:
                    log.error("router worker %s (pid %d) exited with %s; stopping the router",
                              dead.name, dead.pid, dead.exitcode)
                    stopping, exit_code = True, ExitCode.RUNTIME
                    break
                _relay(item, children)
    finally:
        for process, _ in children:
            if process.is_alive():
                os.kill(process.pid, signal.SIGTERM)  # our own child: pid from Process
        for process, conn in children:
            process.join(drain_s + 5)
            if process.is_alive():
                process.kill()
                process.join()
            conn.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return exit_code


def _relay(source: Connection, children) -> None:
    try:
        change = source.recv()
    except EOFError:
        return  # that child is exiting; its sentinel reports it
    for _, conn in children:
        if conn is not source:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(change)
