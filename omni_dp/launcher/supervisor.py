"""The supervisor: one object owns the supervision loop and its signals (gunicorn's arbiter).

Every sweep it checks each replica (process alive by pid + create time, GET /health), the router
and, with --mps, the daemon. A dead replica, or one failing /health K sweeps in a row, is
restarted through the same gates as bring-up, in its own thread so the others stay watched:
router disables it → its group is stopped → its port is free → started again with the same
block and environment → health → KV equal to the plan → (--mps) attachment → router enables it.
Attempts back off exponentially and are budgeted (N within a window); past the budget the
replica is marked failed and stays out of the router. SIGTERM/SIGINT: orderly teardown.

Run in the foreground by `omni-dp launch`, or detached as
`python -m omni_dp.launcher.supervisor RUN_DIR` (what `launch --detach` leaves behind).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from omni_dp.launcher.bringup import (
    BringUpFailed,
    start_daemon,
    start_replicas,
    start_router,
)
from omni_dp.launcher.facts import port_taken
from omni_dp.launcher.gates import GateFailed, describe_exit, http_json
from omni_dp.launcher.processes import API_KEY_ENV, stop_processes
from omni_dp.launcher.replicas import ReplicaSet
from omni_dp.launcher.state import RunState, StateError, identity_of
from omni_dp.launcher.teardown import teardown
from omni_dp.logs import setup_logging
from omni_dp.mps.daemon import (
    CONTROL_LOG,
    FAULT_LINE,
    DaemonRecord,
    MpsDaemon,
    MpsDaemonError,
)
from omni_dp.procs import ProcessIdentity, identify, is_alive

WATCHED = ("healthy", "unhealthy", "down")  # states the sweep checks (not restarting/failed)


class DeathWatch:
    """Wakes the loop the moment a watched process exits or a signal arrives, else after the
    sweep interval. pidfds (Linux ≥ 5.3) work for processes that are not our children, which
    the replicas of a detached supervisor are not; without them the interval bounds detection.
    """

    def __init__(self) -> None:
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        signal.set_wakeup_fd(self._wake_w)  # the signal handlers run in the main thread

    def wait(self, identities: list[ProcessIdentity], timeout_s: float) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        fds = []
        try:
            for identity in identities:
                try:
                    fd = os.pidfd_open(identity.pid)
                except (OSError, AttributeError):
                    continue
                fds.append(fd)
                if not is_alive(identity):  # the pid was recycled before we opened it
                    return
                poller.register(fd, select.POLLIN)
            poller.poll(timeout_s * 1000)
        finally:
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wake_r, 64):
                    pass

    def close(self) -> None:
        signal.set_wakeup_fd(-1)
        os.close(self._wake_r)
        os.close(self._wake_w)


def _stamped(line: str) -> None:
    print(f"{time.strftime('%F %T')} {line}", flush=True)


class Supervisor:
    def __init__(self, state: RunState, replicas: ReplicaSet, *, detached: bool,
                 say: Callable[[str], None] = _stamped, reap: list | None = None,
                 stop_requested: threading.Event | None = None) -> None:
        self.state = state
        self.replicas = replicas
        self.detached = detached
        self.say = say
        self.reap = reap if reap is not None else []
        s = state.plan["supervision"]
        self.interval = float(s["check_interval"])
        self.failure_threshold = int(s["health_failures"])
        self.budget = int(s["restart_budget"])
        self.window = float(s["restart_window"])
        self.on_mps_fault = s["on_mps_fault"]
        self.health_timeout = float(s["health_timeout"])
        self.drain_timeout = float(s["drain_timeout"])
        self.failures: dict[int, int] = {}
        self.mps_restarts: list[float] = []  # times of daemon restarts, budgeted like replicas
        self.log_offsets: dict[Path, int] = {}
        self.busy: dict[int, threading.Thread] = {}  # replica index (-1: the whole run)
        self.stop_requested = stop_requested or threading.Event()
        self.exit_code = 0
        # Held while spawning; teardown takes it so no replica starts after teardown began.
        self.spawn_lock = threading.Lock()
        self.stopping = False
        self.command = state.plan.get("command") or "omni-dp"  # for the commands it prints
        # Healthy replicas the router did not take back (a failed admin call): retried each
        # sweep until it answers 2xx.
        self.not_in_router: set[int] = set()

    # --- the loop -------------------------------------------------------------------------

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop_requested.set())
        me = identify(os.getpid())
        assert me is not None
        self.state.update(supervisor={**me.to_json(), "detached": self.detached})
        self.state.event("supervisor_started", pid=me.pid, detached=self.detached)
        watch = DeathWatch()
        try:
            supervising = False
            while not self.stop_requested.is_set():
                try:
                    self.sweep()
                except Exception as exc:  # a sweep must never take the supervisor down
                    self.state.event("supervisor_check_failed", error=repr(exc))
                if not supervising:  # what `launch --detach` waits for before it says so
                    supervising = True
                    self._record_supervising()
                watch.wait(self._watched(), self.interval)
        except Exception as exc:  # the loop itself: never leave the run unsupervised silently
            self.exit_code = 3
            self.state.event("supervisor_failed", error=repr(exc))
            self.say(f"the supervision loop failed ({exc!r}); tearing the run down")
        finally:
            watch.close()
        return self.shutdown()

    def _record_supervising(self) -> None:
        """The heartbeat: the loop has run a whole sweep and is watching."""
        record = self.state.data.get("supervisor") or {}
        self.state.update(supervisor={**record, "supervising_since": time.time()})
        self.state.event("supervisor_supervising", pid=os.getpid())

    def _watched(self) -> list[ProcessIdentity]:
        """The live processes whose exit should wake the loop at once."""
        records = [r for r in self.state.replicas
                   if r["state"] in WATCHED and r["index"] not in self.busy]
        records += [self.state.data.get("router"), (self.state.data.get("mps") or {}).get(
            "daemon")]
        identities = [identity_of(r) for r in records if r]
        return [i for i in identities if i is not None and is_alive(i)]

    def shutdown(self) -> int:
        self.say("tearing the run down")
        with self.spawn_lock:
            self.stopping = True
        failed = self.exit_code != 0  # stopped by a fault: keep the state for diagnosis
        if failed:
            self.state.update(state="failed")
        # `omni-dp down --drain-timeout S` wrote its bound before it signalled us
        drain = self.state.requested_drain(self.drain_timeout)
        result = teardown(self.state, drain_timeout=drain, say=self.say,
                          keep_state=failed,
                          reap=self.reap + list(self.replicas.popens.values()))
        for line in result.leftovers:
            self.say(f"left behind: {line}")
        if failed:
            self.say(f"run stopped after a failure; its state is kept in {self.state.directory}"
                     f" (events.jsonl, logs/); `{self.command} down {self.state.run_id}` "
                     "removes it")
        elif result.clean:
            self.say("run stopped; nothing left behind")
        return self.exit_code if result.clean else 3

    def sweep(self) -> None:
        if self.state.removed:
            self.say(f"the run directory {self.state.directory} was removed; tearing the run "
                     "down from memory")
            self.stop_requested.set()
            return
        if -1 not in self.busy:
            for record in self.state.replicas:
                if record["index"] not in self.busy and record["state"] in WATCHED:
                    self._check_replica(record)
            self._check_router()
            self._check_daemon()
            self._retry_router_enable()
        states = {r["state"] for r in self.state.replicas}
        run_state = "running" if states == {"healthy"} else "degraded"
        if self.state.data["state"] != run_state:
            self.state.update(state=run_state)

    def _check_replica(self, record: dict) -> None:
        i = record["index"]
        identity = identity_of(record)
        if identity is None or not is_alive(identity):
            popen = self.replicas.popens.get(i)
            code = popen.poll() if popen else None
            # Not our child (started by `launch`): its exit status is not ours to read.
            self._begin_restart(i, f"its process {describe_exit(code)}" if code is not None
                                else "its process is gone")
            return
        status, _ = http_json("GET", record["url"] + "/health", timeout=min(2.0, self.interval))
        if status == 200:
            self.failures[i] = 0
            if record["state"] != "healthy":  # recovered: the /health error is resolved
                resolved = {} if i in self.not_in_router else {"last_error": None}
                self.state.update_replica(i, state="healthy", **resolved)
            return
        self.failures[i] = self.failures.get(i, 0) + 1
        error = f"/health answered {status or 'nothing'} ({self.failures[i]} in a row)"
        self.state.update_replica(i, state="unhealthy", last_error=error)
        if self.failures[i] >= self.failure_threshold:
            self._begin_restart(i, error)

    # --- restarting one replica -------------------------------------------------------------

    def _begin_restart(self, index: int, reason: str) -> None:
        self.say(f"replica {index}: {reason}; restarting")
        self.state.update_replica(index, state="restarting", last_error=reason)
        thread = threading.Thread(target=self._restart, args=(index, reason),
                                  name=f"restart-{index}", daemon=True)
        self.busy[index] = thread
        thread.start()

    def _restart(self, index: int, reason: str) -> None:
        try:
            self._restart_through_gates(index, reason)
        except Exception as exc:
            if not self.stopping:  # once teardown began, a restart failing midway is expected
                self.state.update_replica(index, state="down", last_error=repr(exc))
                self.state.event("restart_failed", replica=index, error=repr(exc))
        finally:
            self.busy.pop(index, None)

    def _restart_through_gates(self, index: int, reason: str) -> None:
        record = self.state.replica(index)
        now = time.time()
        recent = [t for t in record["restarts"] if now - t < self.window]
        self._set_disabled(index, True)
        if len(recent) >= self.budget:
            why = (f"restart budget exhausted ({len(recent)} restarts within "
                   f"{self.window:.0f} s); last: {reason}")
            self.replicas.stop([index], self.drain_timeout)
            self.state.update_replica(index, state="failed", last_error=why)
            self.state.event("replica_failed", replica=index, reason=why)
            self.say(f"replica {index}: {why}; it stays out of the router")
            return
        delay = min(2.0 ** (len(recent) - 1), 30.0) if recent else 0.0
        self.state.update_replica(index, restarts=[*recent, now])
        self.state.event("restart_started", replica=index, reason=reason,
                         attempt=len(recent) + 1, backoff_s=delay)
        if self.stop_requested.wait(delay):
            return
        self.replicas.stop([index], self.drain_timeout)
        if not self._wait_port_free(record["port"], 60.0):
            self._restart_failed(index, f"port {record['port']} still busy after 60 s")
            return
        with self.spawn_lock:
            if self.stopping:
                return
            self.replicas.start(index)
        try:
            self.replicas.wait_healthy(index, self.health_timeout)
            self.replicas.check_kv([index])
            if self.state.data["mps"]:
                report = self.replicas.verify_attachment()
                if not report.passed:
                    raise GateFailed("MPS attachment FAILED: " + "; ".join(
                        report.problems + [p for v in report.replicas for p in v.problems]))
        except GateFailed as exc:
            self.replicas.stop([index], self.drain_timeout)
            self._restart_failed(index, str(exc))
            return
        self.failures[index] = 0
        # The reason for the restart is resolved (it stays in events.jsonl, restart_started).
        self.state.update_replica(index, state="healthy", last_error=None)
        back = self._set_disabled(index, False)
        pid = self.state.replica(index)["pid"]
        self.state.event("restart_completed", replica=index, pid=pid, in_router=back)
        if back:
            self.not_in_router.discard(index)
            self.say(f"replica {index}: restarted (pid {pid}), passed health and KV checks, "
                     "back in the router")
        else:
            self.not_in_router.add(index)
            self.say(f"replica {index}: restarted (pid {pid}), passed health and KV checks, "
                     "but NOT back in the router (above); retrying at every sweep")

    def _restart_failed(self, index: int, error: str) -> None:
        first = error.splitlines()[0]
        self.state.update_replica(index, state="down", last_error=first)
        self.state.event("restart_failed", replica=index, error=error)
        self.say(f"replica {index}: restart failed: {first}")

    def _wait_port_free(self, port: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while port_taken("127.0.0.1", port):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def _set_disabled(self, index: int, disabled: bool, *, warn: bool = True) -> bool:
        """PUT /workers/INDEX on the router, with the run's API key. True only on a 2xx; any
        other answer is a warning (log, event, the replica's last_error), never a success."""
        router = self.state.data.get("router")
        headers = {"Authorization": f"Bearer {self.state.api_key}"} if self.state.api_key else {}
        status, body = (http_json("PUT", f"{router['url']}/workers/{index}",
                                  {"disabled": disabled}, headers=headers)
                        if router else (0, None))  # no router recorded: nothing answered
        action = "disabled" if disabled else "enabled"
        if 200 <= status < 300:
            self.state.event("router_" + action, replica=index, status=status)
            return True
        said = body.get("error") if isinstance(body, dict) else None
        error = (f"the router did not take replica {index} "
                 + ("out" if disabled else "back")
                 + f": PUT /workers/{index} answered {status or 'nothing'}"
                 + (f" ({said})" if said else "")
                 + ("; the router wants an API key: launch with --api-key (or "
                    "OMNI_DP_API_KEY) so that the supervisor sends it" if status == 401 else ""))
        self.state.event("router_admin_failed", replica=index, action=action, status=status,
                         error=error)
        if warn:
            self.state.update_replica(index, last_error=error)
            self.say(f"warning: {error}")
        return False

    def _retry_router_enable(self) -> None:
        """Put back in the router the healthy replicas it did not take back."""
        for index in sorted(self.not_in_router):
            record = self.state.replica(index)
            if index in self.busy or record["state"] != "healthy":
                continue
            if self._set_disabled(index, False, warn=False):
                self.not_in_router.discard(index)
                self.state.update_replica(index, last_error=None)
                self.say(f"replica {index}: back in the router")

    # --- the router and the MPS daemon ------------------------------------------------------

    def _check_router(self) -> None:
        identity = identity_of(self.state.data.get("router"))
        if identity is None or is_alive(identity):
            return
        self.say("the router died; restarting it")
        self.state.event("router_died", pid=identity.pid)
        with self.spawn_lock:
            if self.stopping:
                return
            try:
                router = start_router(self.state)
            except BringUpFailed as exc:
                self.state.event("router_restart_failed", error=str(exc))
                return
        self.reap.append(router.popen)
        self.say(f"router restarted (pid {router.pid}), ready")
        self.not_in_router.clear()  # a new router starts with every replica enabled
        for record in self.state.replicas:
            if record["state"] != "healthy":
                self._set_disabled(record["index"], True)

    def _check_daemon(self) -> None:
        mps = self.state.data.get("mps")
        if not mps:
            return
        record = DaemonRecord.from_json(mps["daemon"])
        daemon = MpsDaemon(record.control())
        health = daemon.health(record)  # control.log: small, read whole
        health.faults += self._new_fault_lines()
        if health.ok:
            return
        fault = ("the MPS daemon is gone" if not health.alive else
                 f"the MPS daemon does not answer ({health.error})" if not health.reachable else
                 "MPS faults in the logs: " + "; ".join(health.faults[:3]))
        now = time.time()
        self.mps_restarts = [t for t in self.mps_restarts if now - t < self.window]
        over_budget = len(self.mps_restarts) >= self.budget
        action = "fail" if over_budget else self.on_mps_fault
        self.state.event("mps_fault", detail=fault, action=action,
                         restarts_in_window=len(self.mps_restarts))
        self.say(f"{fault}: every replica is suspect")
        if action == "fail":
            if over_budget:
                self.say(f"{len(self.mps_restarts)} MPS restarts within {self.window:.0f} s: "
                         "the restart budget is spent; stopping the run")
            self.exit_code = 3
            self.stop_requested.set()
            return
        self.mps_restarts.append(now)
        thread = threading.Thread(target=self._restart_all, args=(daemon, record, fault),
                                  name="mps-restart", daemon=True)
        self.busy[-1] = thread
        thread.start()

    def _new_fault_lines(self) -> list[str]:
        """MPS errors a replica logged since the last sweep (its log is read incrementally: it
        grows with traffic)."""
        faults = []
        for r in self.state.replicas:
            path = self.state.logs / r["log"]
            try:
                with open(path, "rb") as f:
                    offset = self.log_offsets.get(path, 0)
                    if os.fstat(f.fileno()).st_size < offset:
                        offset = 0  # rotated
                    f.seek(offset)
                    chunk = f.read()
            except OSError:
                continue
            self.log_offsets[path] = offset + len(chunk)
            faults += [f"{path.name}: {line.strip()}"
                       for line in chunk.decode(errors="replace").splitlines()
                       if FAULT_LINE.search(line)]
        return faults

    def _restart_all(self, daemon: MpsDaemon, record: DaemonRecord, fault: str) -> None:
        """A daemon fault taints every client: new daemon, every replica through the gates."""
        try:
            indices = [r["index"] for r in self.state.replicas]
            for i in indices:
                self._set_disabled(i, True)
                self.state.update_replica(i, state="restarting", last_error=fault)
            self.replicas.stop(indices, self.drain_timeout)
            try:
                daemon.stop(record, force=True)
            except MpsDaemonError:
                stop_processes([record.identity], None, 5.0)
            log = Path(record.log_dir, CONTROL_LOG)
            if log.exists():  # old faults must not condemn the new daemon
                log.rename(log.with_name(f"{CONTROL_LOG}.{int(time.time())}"))
            for r in self.state.replicas:
                r_log = self.state.logs / r["log"]
                if r_log.exists():
                    r_log.rename(r_log.with_name(f"{r_log.name}.{int(time.time())}"))
            with self.spawn_lock:
                if self.stopping:
                    return
                start_daemon(self.state, record.binary, record.gpu_uuid, record.server_binary)
            start_replicas(self.state, self.replicas, indices,
                           sequential=self.state.plan["start"] == "sequential",
                           timeout_s=self.health_timeout, say=self.say)
            report = self.replicas.verify_attachment()
            if not report.passed:
                raise BringUpFailed("MPS attachment FAILED after the daemon restart")
            for i in indices:  # the fault is resolved for every replica
                self.state.update_replica(i, last_error=None)
            out = [i for i in indices if not self._set_disabled(i, False)]
            self.not_in_router.update(out)
            self.state.event("mps_restarted", not_in_router=out)
            self.say("MPS daemon and every replica restarted and verified"
                     + (f"; replica(s) {', '.join(map(str, out))} NOT back in the router "
                        "(above), retried at every sweep" if out else "; all back in the router"))
        except (BringUpFailed, GateFailed, MpsDaemonError) as exc:
            self.state.event("mps_restart_failed", error=str(exc))
            self.say(f"restarting after the MPS fault failed: {exc}; stopping the run")
            self.exit_code = 3
            self.stop_requested.set()
        finally:
            self.busy.pop(-1, None)


def main(argv: list[str]) -> int:
    """Entry of the detached supervisor: `python -m omni_dp.launcher.supervisor RUN_DIR`."""
    try:
        state = RunState.load(Path(argv[0]))
    except (IndexError, StateError) as exc:
        print(f"omni-dp supervisor: {exc}", file=sys.stderr)
        return 2
    # The router's key comes by environment (`launch` set it): never from run.json or argv.
    state.api_key = os.environ.get(API_KEY_ENV) if state.plan.get("api_key_set") else None
    say = _stamped
    if state.plan.get("log_format") == "json":  # as `launch --log-format json` asked
        setup_logging("info", "json", stream=sys.stdout)
        say = logging.getLogger("omni_dp.supervisor").info
    if state.plan.get("api_key_set") and state.api_key is None:
        say(f"warning: the run's router wants an API key but {API_KEY_ENV} is not set here: "
            "the router will refuse this supervisor's admin calls")
    return Supervisor(state, ReplicaSet(state), detached=True, say=say).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
