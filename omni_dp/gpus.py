"""The host's NVIDIA GPUs as NVML sees them: every one, read in one NVML session.

Facts only: what each GPU is and how it is set up, None where NVML could not tell (NVML's words
are kept, for a caller that must refuse the GPU for it). Whether a GPU suits a run is the
caller's to say (omni_dp.mps.preflight for MPS). pynvml is imported inside the functions that
query it, so importing this module is cheap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

NO_DRIVER = "no NVIDIA driver on this machine (libnvidia-ml not found)"
# How a --gpu value that names no GPU is refused; a caller may say more after it.
NOT_A_GPU_ID = "is neither a GPU index nor a GPU UUID (GPU-…)"
PICK_HINT = "pick one of these with --gpu INDEX or UUID"

# pynvml's values, used when an injected nvml object does not define the constants.
_COMPUTE_MODE_CONSTANTS = (
    ("NVML_COMPUTEMODE_DEFAULT", 0, "DEFAULT"),
    ("NVML_COMPUTEMODE_EXCLUSIVE_THREAD", 1, "EXCLUSIVE_THREAD"),
    ("NVML_COMPUTEMODE_PROHIBITED", 2, "PROHIBITED"),
    ("NVML_COMPUTEMODE_EXCLUSIVE_PROCESS", 3, "EXCLUSIVE_PROCESS"),
)


@dataclass(frozen=True)
class Problem:
    """One thing found wrong: `check` is a short id, `message` says what to do. Here: "nvml"
    (NVML cannot be asked) or "gpu" (no such GPU); omni_dp.mps.preflight adds its own."""

    check: str
    message: str


@dataclass(frozen=True)
class GpuFacts:
    """What NVML said about one GPU; a field is None when NVML could not tell, and `errors`
    then holds NVML's words for it by field name ("handle": the GPU could not be opened)."""

    index: int  # as NVML (and nvidia-smi) number the GPUs
    uuid: str | None
    name: str | None
    compute_mode: str | None
    mig_enabled: bool | None
    capability: tuple[int, int] | None
    memory_total_bytes: int | None
    memory_used_bytes: int | None = None  # by every process, at the time of the query
    pci_bus_id: str | None = None  # e.g. 00000000:18:00.0: leads to the GPU's NUMA node
    mig_disable_pending: bool = False  # MIG is on, and a disable waits for a GPU reset
    driver_version: str | None = None  # the loaded driver's release, read in the same session
    errors: tuple[tuple[str, str], ...] = ()

    def error(self, name: str) -> str | None:
        """NVML's words for why `name` could not be read; None when it was."""
        return dict(self.errors).get(name)

    @property
    def label(self) -> str:
        """How messages name the GPU: `GPU 0 (NVIDIA H200)`."""
        return f"GPU {self.index}" + (f" ({self.name})" if self.name else "")


@dataclass(frozen=True)
class GpuInventory:
    """Every GPU NVML numbers, in its order; or why NVML could not be asked at all
    (`nvml_problem`), or could not count them (`count_error`)."""

    gpus: tuple[GpuFacts, ...] = ()
    nvml_problem: Problem | None = None
    count_error: str | None = None
    driver_version: str | None = None

    @property
    def nvml_available(self) -> bool:
        return self.nvml_problem is None

    def visible(self) -> str:
        """`NVML sees: 0 GPU-… (name), 1 …`, for the messages that refuse a --gpu value."""
        if self.count_error is not None:
            return f"NVML could not count the GPUs ({self.count_error})"
        if not self.gpus:
            return "NVML sees no GPUs"
        return "NVML sees: " + ", ".join(_entry(gpu) for gpu in self.gpus)


def _entry(gpu: GpuFacts) -> str:
    why = gpu.error("handle") or gpu.error("uuid") or gpu.error("name")
    return f"{gpu.index} (unreadable: {why})" if why else f"{gpu.index} {gpu.uuid} ({gpu.name})"


# --- choosing one -------------------------------------------------------------------------


def pick_gpu(inventory: GpuInventory, wanted: str) -> tuple[GpuFacts | None, list[Problem]]:
    """The GPU `wanted` names (an index as nvidia-smi numbers them, or a "GPU-…" UUID), or
    the one problem that says why there is none, listing the GPUs there are."""
    if inventory.nvml_problem is not None:
        return None, [inventory.nvml_problem]
    wanted = wanted.strip()
    if wanted.isdigit():
        return _by_index(inventory, int(wanted))
    if wanted.startswith("GPU-"):
        return _by_uuid(inventory, wanted)
    return None, [Problem("gpu", f"--gpu {wanted!r} {NOT_A_GPU_ID}; {inventory.visible()}")]


def _by_index(inventory: GpuInventory, index: int) -> tuple[GpuFacts | None, list[Problem]]:
    if inventory.count_error is not None:
        return None, [Problem("gpu", f"NVML could not count the GPUs: {inventory.count_error}")]
    count = len(inventory.gpus)
    if index >= count:
        return None, [Problem(
            "gpu", f"no GPU with index {index} (NVML numbers GPUs as nvidia-smi does, "
            f"0..{count - 1}); {inventory.visible()}; {PICK_HINT}")]
    gpu = inventory.gpus[index]
    unopened = gpu.error("handle")
    if unopened is not None:
        return None, [Problem(
            "gpu", f"NVML could not open GPU {index}: {unopened}; {inventory.visible()}")]
    return gpu, []


def _by_uuid(inventory: GpuInventory, uuid: str) -> tuple[GpuFacts | None, list[Problem]]:
    for gpu in inventory.gpus:
        if gpu.uuid is not None and gpu.uuid.lower() == uuid.lower():
            return gpu, []
    return None, [Problem("gpu", f"no GPU with UUID {uuid}; {inventory.visible()}; {PICK_HINT}")]


def nvml_id_of(torch_index: int, visible: str | None) -> str | None:
    """The GPU a process numbers `torch_index`, as NVML names it ("GPU-…"/"MIG-…" or an NVML
    index), read from that process's CUDA_VISIBLE_DEVICES (`visible`) without touching CUDA.

    CUDA numbers only the devices the variable lists, in its order, so index 0 of a process
    given `GPU-…` (as omni-dp gives every replica) or `2` is that GPU, not NVML's GPU 0; NVML
    ignores the variable. Unset, CUDA numbers every GPU as NVML does on a one-GPU machine (on
    several, only with CUDA_DEVICE_ORDER=PCI_BUS_ID). None: the index names no GPU."""
    if torch_index < 0:
        return None
    if visible is None:
        return str(torch_index)
    entries = [entry.strip() for entry in visible.split(",")]
    if torch_index >= len(entries) or not entries[torch_index]:
        return None
    return entries[torch_index]


def query_gpu(wanted: str, nvml: Any = None) -> tuple[GpuFacts | None, list[Problem], bool]:
    """The GPU a launch asked for: query_gpus, then pick_gpu. Returns (facts, problems,
    nvml_available); facts is None when NVML is unavailable or there is no such GPU."""
    inventory = query_gpus(nvml)
    gpu, problems = pick_gpu(inventory, wanted)
    return gpu, problems, inventory.nvml_available


# --- asking NVML ----------------------------------------------------------------------------


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class _NeverRaised(Exception):
    """Stands in for an NVMLError subclass that an injected nvml object does not define."""


def _error_class(nvml: Any, name: str) -> type[BaseException]:
    cls = getattr(nvml, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, BaseException) else _NeverRaised


def _nvml_error(nvml: Any) -> type[BaseException]:
    return getattr(nvml, "NVMLError", None) or Exception


def _import_nvml() -> tuple[Any, Problem | None]:
    try:
        import pynvml  # lazy: keeps importing this module cheap
    except ImportError as exc:
        return None, Problem(
            "nvml", f"the Python package nvidia-ml-py (module pynvml) is not installed ({exc}); "
            "install omni-dp's dependencies (pip install nvidia-ml-py)")
    return pynvml, None


def _start(nvml: Any) -> Problem | None:
    """nvmlInit; why it failed, or None."""
    error = _nvml_error(nvml)
    try:
        nvml.nvmlInit()
    except _error_class(nvml, "NVMLError_LibraryNotFound"):
        return Problem("nvml", NO_DRIVER)
    except error as exc:
        return Problem(
            "nvml", f"NVML could not start: {_text(exc)} ({type(exc).__name__}); check that the "
            "NVIDIA driver is loaded and matches its libraries (nvidia-smi shows the same error)")
    return None


def _session(nvml: Any, ask: Callable[[Any], Any], unavailable: Callable[[Problem], Any]) -> Any:
    """ask(nvml) between nvmlInit and nvmlShutdown; unavailable(problem) when NVML is not
    there (nvml None: the real pynvml)."""
    if nvml is None:
        nvml, problem = _import_nvml()
        if problem is not None:
            return unavailable(problem)
    problem = _start(nvml)
    if problem is not None:
        return unavailable(problem)
    try:
        return ask(nvml)
    finally:
        with contextlib.suppress(_nvml_error(nvml)):
            nvml.nvmlShutdown()


def query_gpus(nvml: Any = None) -> GpuInventory:
    """Every GPU NVML sees, with the driver's version: one NVML session. `nvml` is a
    pynvml-like object (default: the real pynvml)."""
    return _session(nvml, _inventory, lambda problem: GpuInventory(nvml_problem=problem))


def _inventory(nvml: Any) -> GpuInventory:
    error = _nvml_error(nvml)
    driver = _driver_version(nvml)
    try:
        count = nvml.nvmlDeviceGetCount()
    except error as exc:
        return GpuInventory(count_error=_text(exc), driver_version=driver)
    gpus = tuple(_read_gpu(nvml, index, driver) for index in range(count))
    return GpuInventory(gpus, driver_version=driver)


def _driver_version(nvml: Any) -> str | None:
    if not hasattr(nvml, "nvmlSystemGetDriverVersion"):
        return None
    try:
        return _text(nvml.nvmlSystemGetDriverVersion()) or None
    except _nvml_error(nvml):
        return None


class _Reader:
    """Reads one GPU's attributes, keeping NVML's words for each one it could not read."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml, self.handle = nvml, handle
        self.errors: list[tuple[str, str]] = []

    def read(self, function: str, name: str) -> Any:
        if not hasattr(self.nvml, function):  # an older pynvml, or a fake without it
            return None
        try:
            return getattr(self.nvml, function)(self.handle)
        except _nvml_error(self.nvml) as exc:
            self.errors.append((name, _text(exc)))
            return None

    def text(self, function: str, name: str) -> str | None:
        value = self.read(function, name)
        return _text(value) if value is not None else None

    def mig(self) -> tuple[bool | None, bool]:
        """(enabled, disable pending); a GPU or driver without MIG has it off."""
        no_mig = (_error_class(self.nvml, "NVMLError_NotSupported"),
                  _error_class(self.nvml, "NVMLError_FunctionNotFound"))
        enable = getattr(self.nvml, "NVML_DEVICE_MIG_ENABLE", 1)
        try:
            current, pending = self.nvml.nvmlDeviceGetMigMode(self.handle)
        except no_mig:
            return False, False
        except _nvml_error(self.nvml) as exc:
            self.errors.append(("mig", _text(exc)))
            return None, False
        return current == enable, current == enable and pending != enable


def _compute_mode_name(nvml: Any, mode: int | None) -> str | None:
    if mode is None:
        return None
    for attr, default, name in _COMPUTE_MODE_CONSTANTS:
        if mode == getattr(nvml, attr, default):
            return name
    return f"UNKNOWN({mode})"


def _read_gpu(nvml: Any, index: int, driver: str | None) -> GpuFacts:
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
    except _nvml_error(nvml) as exc:
        return GpuFacts(index, None, None, None, None, None, None, driver_version=driver,
                        errors=(("handle", _text(exc)),))
    reader = _Reader(nvml, handle)
    uuid = reader.text("nvmlDeviceGetUUID", "uuid")
    name = reader.text("nvmlDeviceGetName", "name")
    mode = _compute_mode_name(nvml, reader.read("nvmlDeviceGetComputeMode", "compute_mode"))
    mig_enabled, mig_pending = reader.mig()
    capability = reader.read("nvmlDeviceGetCudaComputeCapability", "capability")
    memory = reader.read("nvmlDeviceGetMemoryInfo", "memory")
    pci = reader.read("nvmlDeviceGetPciInfo", "pci")
    return GpuFacts(
        index=index, uuid=uuid, name=name, compute_mode=mode, mig_enabled=mig_enabled,
        capability=(int(capability[0]), int(capability[1])) if capability is not None else None,
        memory_total_bytes=int(memory.total) if memory is not None else None,
        memory_used_bytes=int(memory.used) if memory is not None else None,
        pci_bus_id=(_text(getattr(pci, "busId", "")) or None) if pci is not None else None,
        mig_disable_pending=mig_pending, driver_version=driver, errors=tuple(reader.errors),
    )


def nvml_driver_version(nvml: Any = None) -> str | None:
    """The loaded driver's release as NVML reports it; None where NVML cannot say."""
    return _session(nvml, _driver_version, lambda _problem: None)


def nvml_gpu_pids(gpu: str, nvml: Any = None) -> tuple[set[int] | None, str | None]:
    """PIDs NVML sees on the GPU (an index or a GPU-/MIG- UUID): its compute process list and,
    where the driver has one, its MPS list; or (None, why NVML cannot say)."""
    return _session(nvml, lambda nvml: _gpu_pids(nvml, gpu),
                    lambda problem: (None, f"NVML unavailable ({problem.message})"))


def _gpu_processes(nvml: Any, gpu: str) -> tuple[list[Any] | None, str | None]:
    """NVML's compute process list of the GPU and, where the driver has one, its MPS list."""
    error = _nvml_error(nvml)
    try:
        handle = (nvml.nvmlDeviceGetHandleByUUID(gpu) if gpu.startswith(("GPU-", "MIG-"))
                  else nvml.nvmlDeviceGetHandleByIndex(int(gpu)))
        processes = list(nvml.nvmlDeviceGetComputeRunningProcesses(handle))
        with contextlib.suppress(error):  # older drivers: the compute list alone
            processes += list(nvml.nvmlDeviceGetMPSComputeRunningProcesses(handle))
        return processes, None
    except (error, ValueError) as exc:
        return None, f"NVML could not list GPU processes ({_text(exc)})"


def _gpu_pids(nvml: Any, gpu: str) -> tuple[set[int] | None, str | None]:
    processes, why = _gpu_processes(nvml, gpu)
    return (None, why) if processes is None else ({p.pid for p in processes}, None)


def nvml_gpu_memory(gpu: str, nvml: Any = None) -> tuple[dict[int, int] | None, str | None]:
    """The GPU memory NVML says each process uses on the GPU (an index or a GPU-/MIG- UUID),
    pid -> bytes, from its compute and (where the driver has one) MPS process lists; a process
    whose figure NVML does not have (None under some MPS setups) is left out, never guessed.
    (None, why) when NVML cannot say."""
    return _session(nvml, lambda nvml: _gpu_memory(nvml, gpu),
                    lambda problem: (None, f"NVML unavailable ({problem.message})"))


def _gpu_memory(nvml: Any, gpu: str) -> tuple[dict[int, int] | None, str | None]:
    processes, why = _gpu_processes(nvml, gpu)
    if processes is None:
        return None, why
    used: dict[int, int] = {}
    for p in processes:
        value = getattr(p, "usedGpuMemory", None)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63:
            used[p.pid] = max(used.get(p.pid, 0), value)
    return used, None
