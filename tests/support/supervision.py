"""The supervisor's fakes, shared by its unit tests (tests/launcher/test_supervision_units.py,
test_change_runner.py): a fake clock, a fake world (process table, /health, ports, the MPS
daemon), a fake replica set and a fake router; no process is started."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from omni_dp.launcher.engines.replica_api import GateFailed
from omni_dp.launcher.record.state import RunState
from omni_dp.launcher.supervision.crew import Probe
from omni_dp.launcher.supervision.supervisor import Supervisor
from omni_dp.mps.daemon import DaemonHealth, DaemonRecord
from omni_dp.procs import ProcessIdentity
from omni_dp.runfile import (
    GpuRecord,
    PlanRecord,
    ReplicaRecord,
    ReplicaState,
    RouterPlan,
    RouterRecord,
    RunPhase,
    RunRecord,
    ShareRecord,
    SupervisionSettings,
)

H = ReplicaState.HEALTHY
NOW = 1_000_000.0


def daemon_of(tmp_path, gpu: int) -> DaemonRecord:
    """GPU slot gpu's daemon as bring-up records it: pid 800 + gpu, its own pipe and log dirs
    (a one-GPU run's: pipe, mpslog)."""
    suffix = str(gpu) if gpu else ""
    return DaemonRecord(ProcessIdentity(800 + gpu, 1.0), "mps-control",
                        str(tmp_path / f"pipe{suffix}"), str(tmp_path / f"mpslog{suffix}"),
                        None, gpu=gpu)


def gpu_records(gpus: int) -> tuple[GpuRecord, ...]:
    """A one-GPU run on the CPU ("cpu", slot 0), or `gpus` H200s by index."""
    if gpus == 1:
        return (GpuRecord(0, "cpu"),)
    return tuple(GpuRecord(k, f"GPU-{k}", k, k, "NVIDIA H200") for k in range(gpus))


def make_state(tmp_path, *, replicas: int = 2, mps: bool = False, budget: int = 3,
               window: float = 600.0, failures: int = 3, on_mps_fault: str = "restart",
               restarts: tuple[float, ...] = (), share: bool = False,
               gpus: int = 1) -> RunState:
    """A running run; with gpus > 1 the replicas are spread over the GPUs in blocks (4 over
    2: replicas 0, 1 on GPU slot 0, replicas 2, 3 on slot 1), one daemon per GPU under mps."""
    settings = SupervisionSettings(
        check_interval=0.5, restart_after_failures=failures, restart_budget=budget,
        restart_window=window, on_mps_fault=on_mps_fault, start_timeout=5.0,
        drain_timeout=1.0)
    plan = PlanRecord(
        replicas=replicas, engine="stub", engine_args=(), config_file=None, device="cpu",
        gpu="cpu", gpu_numa_node=None, mps=mps, start="parallel", cpu_blocks="none",
        kv_cache_bytes=None, max_total_tokens=1024, expected_kv_tokens=1024,
        router=RouterPlan("http://router.test", "least_inflight", 1, ()),
        supervision=settings, log_format="text", warnings=(), command="omni-dp",
        api_key_set=False, share_weights=share)
    record = RunRecord(
        run_id="run-units", created_at=NOW, state=RunPhase.RUNNING, gpu="cpu", device="cpu",
        plan=plan, launcher=None,
        replicas=tuple(ReplicaRecord(
            index=i, port=41000 + i, url=f"http://replica-{i}.test", cpus=None,
            argv=("serve",), env={}, log=f"replica_{i}.log",
            identity=ProcessIdentity(1000 + i, 1.0), pgid=1000 + i, state=H,
            restarts=restarts, gpu=i * gpus // replicas) for i in range(replicas)),
        router=RouterRecord(ProcessIdentity(900, 1.0), 900, "http://router.test", (),
                            "router.log"),
        daemons=tuple(daemon_of(tmp_path, k) for k in range(gpus)) if mps else (),
        gpus=gpu_records(gpus))
    directory = tmp_path / "run"
    (directory / "logs").mkdir(parents=True)
    for k in range(gpus):
        Path(daemon_of(tmp_path, k).log_dir).mkdir()
    state = RunState(directory, record, "token")
    state.save()
    return state


class FakeWorld(Probe):
    """The process table (live pids), /health answers by url, taken ports, the daemons."""

    def __init__(self, live: set[int]) -> None:
        self.live = set(live)
        self.health_of: dict[str, int] = {}
        self.taken: set[int] = set()
        self.daemon = DaemonHealth(alive=True, reachable=True)  # every daemon's, unless…
        self.daemon_of: dict[int, DaemonHealth] = {}  # …one of its own, by GPU slot
        self.daemon_checks = 0
        self.checked: list[int] = []  # the GPU slot of each daemon checked
        self.workers: list[dict] = []  # the router's GET /workers entries

    def alive(self, identity):
        return identity is not None and identity.pid in self.live

    def health(self, url, timeout_s):
        return self.health_of.get(url, 200)

    def port_taken(self, port):
        return port in self.taken

    def router_workers(self, url, api_key):
        return self.workers

    def daemon_health(self, record):
        self.daemon_checks += 1
        self.checked.append(record.gpu)
        health = self.daemon_of.get(record.gpu, self.daemon)
        return replace(health, faults=list(health.faults))


class FakeReplicas:
    """ReplicaControl's interface; each call makes the state change the real one makes."""

    def __init__(self, state: RunState, world: FakeWorld, *, healthy: bool = True) -> None:
        self.state, self.world, self.healthy = state, world, healthy
        self.attached = True  # what verify_attachment finds
        self.share_fails: set[int] = set()  # whose share gate fails
        self.unhealthy: set[int] = set()  # whose health gate fails (all: healthy=False)
        self.popens: dict = {}
        self.calls: list[tuple] = []
        self.sharing = state.plan.share_weights
        self._next_pid = 5000

    def start(self, index):
        self.calls.append(("start", index))
        self._next_pid += 1
        self.world.live.add(self._next_pid)
        self.state.update_replica(index, identity=ProcessIdentity(self._next_pid, 2.0),
                                  state=ReplicaState.STARTING)

    def wait_healthy(self, index, timeout_s):
        self.calls.append(("wait_healthy", index))
        if not self.healthy or index in self.unhealthy:
            raise GateFailed("not healthy within 5 s (last /health: 503); last lines of x:\n  y")

    def record_processes(self, index):
        self.calls.append(("record_processes", index))

    def check_kv(self, indices):
        self.calls.append(("check_kv", *indices))

    def share_gate(self, index):
        """As the real gate: the leader's share recorded, a follower added to it (or
        GateFailed for those in share_fails)."""
        if not self.state.plan.share_weights:
            return
        self.calls.append(("share_gate", index))
        if index in self.share_fails:
            raise GateFailed(f"replica {index} (a weight-share follower): it reports "
                             "weight_share None: it is not sharing")
        leader = self.state.replica(0)
        if index == 0:
            self.state.update(share=ShareRecord(
                leader=0, followers=(), directory="share", policy="p/1", shared_bytes=1024,
                private_bytes=32, tensors=1, leader_pid=leader.pid))
        else:
            self.state.add_follower(index, leader.pid)

    def measure_memory(self, indices):
        self.calls.append(("measure_memory", *indices))

    def verify_attachment(self, gpu):
        self.calls.append(("verify_attachment", gpu))
        return SimpleNamespace(passed=self.attached, problems=[], replicas=[])

    def stop(self, indices, timeout_s):
        self.calls.append(("stop", *indices))
        for i in indices:
            self.world.live.discard(self.state.replica(i).pid)
            self.state.update_replica(i, state=ReplicaState.STOPPED)

    def url(self, index):
        return self.state.replica(index).url


class FakeRouter:
    """The router's admin API: answers (status, body) per enable/disable, records the calls."""

    def __init__(self, status: int = 200, body: object = None) -> None:
        self.answer = {True: (status, body), False: (status, body)}  # by "disabled"
        self.calls: list[tuple[str, bool, dict]] = []

    def __call__(self, method, url, body=None, timeout=3.0, headers=None):
        assert method == "PUT"
        self.calls.append((url, body["disabled"], headers or {}))
        return self.answer[body["disabled"]]


class FakeStop:
    """The stop event, without the waiting: records each backoff."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self._set = False

    def wait(self, timeout=None):
        self.waits.append(timeout)
        return self._set

    def is_set(self):
        return self._set

    def set(self):
        self._set = True


class Clock:
    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class TickingStop(FakeStop):
    """The stop event whose waits pass on the fake clock, without sleeping: each wait moves
    the clock on by its timeout, then runs what the test scheduled for that moment (another
    replica back to healthy, the router taking it in again)."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock
        self.scheduled: list[tuple[float, Callable[[], None]]] = []

    def after(self, seconds: float, happen: Callable[[], None]) -> None:
        """`happen` once the clock has passed NOW + seconds."""
        self.scheduled.append((NOW + seconds, happen))

    def wait(self, timeout=None):
        self.clock.now += timeout or 0.0
        for entry in [e for e in self.scheduled if e[0] <= self.clock.now]:
            self.scheduled.remove(entry)
            entry[1]()
        return super().wait(timeout)


def supervisor(state: RunState, *, router: FakeRouter | None = None,
               healthy: bool = True) -> tuple[Supervisor, FakeWorld, list[str]]:
    world = FakeWorld({r.pid for r in state.replicas} | {900}
                      | {d.identity.pid for d in state.record.daemons})
    said: list[str] = []
    sup = Supervisor(state, FakeReplicas(state, world, healthy=healthy), detached=True,
                     say=said.append)
    sup.crew.probe = world
    sup.crew.clock = Clock()
    sup.router.http = router or FakeRouter()
    return sup, world, said


def events(state: RunState) -> list[dict]:
    return state.events()


def names(state: RunState) -> list[str]:
    return [e["event"] for e in state.events()]
