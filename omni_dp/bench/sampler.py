"""What the run's processes and GPUs did during a measured window, sampled beside the load.

From the run's run.json (read by omni_dp.runfile, the one reader): each replica's recorded
processes (its pid and those it declared), the router, and its GPUs. Every ~0.2 s a thread
reads their CPU times and, on a GPU, NVML's utilisation and used memory; at the end each role's
CPU utilisation (1.0 = one core busy) over the window, the GPUs' mean utilisation (0..1) and
their peak used memory. A process that exits mid-window (a killed replica) keeps what it used
until then. Without a run directory (an endpoint omni-dp did not launch) nothing is sampled,
and `note` says so.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from omni_dp.bench.stats import CLIENT as CLIENT_ROLE
from omni_dp.cpulist import parse_cpu_list
from omni_dp.procs import ProcessIdentity, is_alive
from omni_dp.runfile import GpuRecord, RunFileError, RunRecord, read_run

INTERVAL_S = 0.2
NO_RUN = ("no run directory: nothing sampled (an endpoint omni-dp did not launch: its "
          "processes and GPUs are unknown here)")


@dataclass(frozen=True)
class Samples:
    """A window's sampled values, as PointResult keeps them; `note` says what was not
    sampled and why (None when everything was)."""

    cpu_util: dict[str, float] | None = None
    gpu_sm_util: float | None = None
    gpu_memory_bytes: int | None = None
    note: str | None = None


@dataclass(frozen=True)
class Watched:
    """What a run's record names: processes (pid, create time or None) by role, the cores each
    replica may run on, and the run's GPUs (none on the CPU)."""

    processes: dict[str, tuple[tuple[int, float | None], ...]]
    cores: dict[str, int]
    gpus: tuple[GpuRecord, ...] = ()


def watched(record: RunRecord) -> Watched:
    """Roles "replica N" (its pid and declared processes) and "router", from the record."""
    processes: dict[str, tuple[tuple[int, float | None], ...]] = {}
    cores: dict[str, int] = {}
    for replica in record.replicas:
        found: dict[int, float | None] = {}
        if replica.identity is not None:
            found[replica.identity.pid] = replica.identity.create_time
        for process in replica.processes:
            found.setdefault(process.pid, process.create_time)
        role = f"replica {replica.index}"
        processes[role] = tuple(found.items())
        cores[role] = count_cpus(replica.cpus) or os.cpu_count() or 1
    if record.router is not None:
        processes["router"] = ((record.router.identity.pid, record.router.identity.create_time),)
    gpus = () if record.device == "cpu" else tuple(g for g in record.gpus if g.label != "cpu")
    return Watched(processes, cores, gpus)


def count_cpus(cpus: str | None) -> int | None:
    """How many CPUs a list such as "0-3,8" names (the launcher's syntax); None for none
    (unpinned) or one that does not parse."""
    if not cpus:
        return None
    try:
        return len(parse_cpu_list(cpus)) or None
    except ValueError:
        return None


class _CpuTracker:
    """One role's processes: their CPU seconds at the first and the latest reading."""

    def __init__(self, processes: tuple[tuple[int, float | None], ...]) -> None:
        self.handles: list[psutil.Process] = []
        for pid, created in processes:
            with contextlib.suppress(psutil.Error):
                handle = psutil.Process(pid)
                if created is None or is_alive(ProcessIdentity(pid, created)):
                    self.handles.append(handle)
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}

    def read(self) -> None:
        for handle in self.handles:
            with contextlib.suppress(psutil.Error):
                times = handle.cpu_times()
                used = times.user + times.system
                self.first.setdefault(handle.pid, used)
                self.last[handle.pid] = used

    def used(self) -> float:
        return sum(self.last[pid] - self.first[pid] for pid in self.last)


class Sampler:
    """Start it as a window begins, stop it as it ends (or use it as a context manager and
    read `samples`). `nvml` replaces pynvml (tests)."""

    def __init__(self, run_dir: Path | None, *, interval_s: float = INTERVAL_S,
                 nvml: Any = None) -> None:
        self.interval_s = interval_s
        self.samples: Samples | None = None
        self._nvml = nvml
        self._watched: Watched | None = None
        self._notes: list[str] = []
        if run_dir is None:
            self._notes.append(NO_RUN)
        else:
            try:
                self._watched = watched(read_run(run_dir)[0])
            except RunFileError as exc:
                self._notes.append(f"nothing sampled: {exc}")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cpu: dict[str, _CpuTracker] = {}
        self._gpus: list[Any] = []
        self._nvml_open = False
        self._util: list[float] = []
        self._memory: list[int] = []
        self._started = 0.0

    @property
    def cores(self) -> dict[str, int]:
        """The cores each replica may use (its CPU block; every CPU when unpinned)."""
        return dict(self._watched.cores) if self._watched else {}

    @property
    def note(self) -> str | None:
        return "; ".join(self._notes) or None

    def start(self) -> None:
        if self._watched is not None:
            self._cpu = {role: _CpuTracker(procs)
                         for role, procs in self._watched.processes.items()}
            self._cpu[CLIENT_ROLE] = _CpuTracker(((os.getpid(), None),))
            self._open_gpus(self._watched.gpus)
        self._started = time.perf_counter()
        self._tick()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="bench-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> Samples:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval_s + 1)
        self._tick()
        wall = max(time.perf_counter() - self._started, 1e-9)
        self._close_gpus()
        cpu = ({role: round(t.used() / wall, 4) for role, t in self._cpu.items()}
               if self._watched is not None else None)
        self.samples = Samples(
            cpu, round(sum(self._util) / len(self._util), 4) if self._util else None,
            max(self._memory) if self._memory else None, self.note)
        return self.samples

    def __enter__(self) -> Sampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- the readings -----------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._tick()

    def _tick(self) -> None:
        for tracker in self._cpu.values():
            tracker.read()
        if not self._gpus:
            return
        nvml = self._nvml
        try:
            util = [nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100 for h in self._gpus]
            used = [int(nvml.nvmlDeviceGetMemoryInfo(h).used) for h in self._gpus]
        except nvml.NVMLError as exc:
            self._notes.append(f"NVML stopped answering: {exc}")
            self._gpus = []
            return
        self._util.append(sum(util) / len(util))
        self._memory.append(sum(used))

    def _open_gpus(self, gpus: tuple[GpuRecord, ...]) -> None:
        if not gpus:
            self._notes.append("no GPU in the run: GPU activity not sampled")
            return
        if self._nvml is None:
            import pynvml  # only where a run has a GPU

            self._nvml = pynvml
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            self._notes.append(f"NVML cannot be asked ({exc}): GPU activity not sampled")
            return
        self._nvml_open = True
        for gpu in gpus:
            try:
                if gpu.label.startswith(("GPU-", "MIG-")):
                    self._gpus.append(nvml.nvmlDeviceGetHandleByUUID(gpu.label))
                else:
                    index = gpu.index if gpu.index is not None else int(gpu.label)
                    self._gpus.append(nvml.nvmlDeviceGetHandleByIndex(index))
            except (nvml.NVMLError, ValueError) as exc:
                self._notes.append(f"GPU {gpu.label} not sampled: {exc}")

    def _close_gpus(self) -> None:
        if self._nvml_open:
            with contextlib.suppress(self._nvml.NVMLError):
                self._nvml.nvmlShutdown()
        self._nvml_open = False
        self._gpus = []

