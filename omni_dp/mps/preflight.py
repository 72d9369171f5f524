"""Checks to run BEFORE anything is started for an MPS run.

Each check returns every problem it finds, each with what is wrong and what to do about it, so a
person can fix them all in one go. Nothing here starts the MPS daemon, creates a CUDA context or
writes a file. pynvml is imported only inside `query_gpu` and binaries.driver_version, so
importing this module is cheap.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omni_dp.mps import binaries
from omni_dp.mps.binaries import MpsBinaries
from omni_dp.mps.control import BinaryNotFound
from omni_dp.mps.daemon import MAX_SOCKET_PATH_BYTES, SOCKET_NAME

MAX_CONNECTIONS_ENV = "CUDA_DEVICE_MAX_CONNECTIONS"

# MPS clients per device (NVIDIA MPS guide; CUDA ≤ 13.0; 13.1+ raises Volta+ to 60).
CLIENT_CAP_PRE_VOLTA = 16
CLIENT_CAP_VOLTA = 48
# Volta+ MPS clients default to this many device connections; raising it lowers the cap.
DEFAULT_MPS_MAX_CONNECTIONS = 2
VOLTA = (7, 0)

NO_DRIVER_MESSAGE = (
    "no NVIDIA driver on this machine (libnvidia-ml not found): MPS needs a GPU and its driver"
)

# pynvml's values, used when an injected nvml object does not define the constants.
_COMPUTE_MODE_CONSTANTS = (
    ("NVML_COMPUTEMODE_DEFAULT", 0, "DEFAULT"),
    ("NVML_COMPUTEMODE_EXCLUSIVE_THREAD", 1, "EXCLUSIVE_THREAD"),
    ("NVML_COMPUTEMODE_PROHIBITED", 2, "PROHIBITED"),
    ("NVML_COMPUTEMODE_EXCLUSIVE_PROCESS", 3, "EXCLUSIVE_PROCESS"),
)


# The checks that need a GPU; `--no-gpu-check` skips them to exercise the daemon alone.
GPU_CHECKS = ("nvml", "gpu", "compute_mode", "mig", "capability")


@dataclass(frozen=True)
class Problem:
    """One thing that stops an MPS run: `check` is a short id, `message` says what to do."""

    check: str
    message: str


@dataclass(frozen=True)
class GpuFacts:
    """What NVML said about the chosen GPU; a field is None when NVML could not tell."""

    index: int
    uuid: str | None
    name: str | None
    compute_mode: str | None
    mig_enabled: bool | None
    capability: tuple[int, int] | None
    memory_total_bytes: int | None
    memory_used_bytes: int | None = None  # by every process, at the time of the query
    pci_bus_id: str | None = None  # e.g. 00000000:18:00.0: leads to the GPU's NUMA node


@dataclass(frozen=True)
class PreflightReport:
    problems: tuple[Problem, ...]
    gpu: GpuFacts | None
    nvml_available: bool
    binaries: MpsBinaries | None = None  # the control/server pair found (even if refused)

    @property
    def ok(self) -> bool:
        return not self.problems


# --- control binary -------------------------------------------------------------------------


def locate_control_binary(
    path: str | None, *, driver: Callable[[], str | None] | None = None,
) -> tuple[MpsBinaries | None, list[Problem]]:
    """The MPS binaries (omni_dp.mps.binaries' search) and what stops using them: none found,
    or a control binary of another release than the driver. Never runs the binary.

    `path` is the --mps-control value; when None (or empty), $OMNI_DP_MPS_CONTROL is used, and
    when that is unset too, the program is searched on PATH, in the driver's folders and next to
    nvidia-smi. A value without a slash is looked up on PATH, as a shell would. A version that
    cannot be told (no driver here, or none in the binary) is no problem.
    """
    try:
        found = binaries.locate_mps_binaries(path or None, driver=driver)
    except BinaryNotFound as exc:
        return None, [Problem("control_binary", str(exc))]
    if found.mismatch:
        return found, [Problem("control_binary", binaries.mismatch_message(found))]
    return found, []


def check_control_binary(path: str | None) -> list[Problem]:
    """locate_control_binary's problems only."""
    return locate_control_binary(path)[1]


# --- socket path ----------------------------------------------------------------------------


def check_socket_path(pipe_dir: str) -> list[Problem]:
    """The daemon's socket `<pipe_dir>/control` must fit AF_UNIX sun_path (≤ 107 bytes).

    A longer path lets the daemon start but not bind, and every later command then only says
    "Cannot find MPS control daemon process". The pipe directory must also be absolute: the
    daemon and every client must name exactly the same directory.
    """
    problems = []
    if not os.path.isabs(pipe_dir):
        problems.append(Problem(
            "socket_path",
            f"MPS pipe directory {pipe_dir!r} is not an absolute path; the daemon and every "
            "client resolve CUDA_MPS_PIPE_DIRECTORY from their own working directory, so use an "
            "absolute OMNI_DP_STATE_DIR",
        ))
    socket_path = f"{pipe_dir}/{SOCKET_NAME}"
    length = len(os.fsencode(socket_path))
    if length > MAX_SOCKET_PATH_BYTES:
        over = length - MAX_SOCKET_PATH_BYTES
        problems.append(Problem(
            "socket_path",
            f"MPS control socket path {socket_path} is {length} bytes, {over} over the "
            f"{MAX_SOCKET_PATH_BYTES}-byte limit of a Unix socket path (the daemon would start "
            "but could not listen); set OMNI_DP_STATE_DIR to a directory at least "
            f"{over} bytes shorter (e.g. /tmp/omni-dp-$(id -u))",
        ))
    return problems


# --- client limit ---------------------------------------------------------------------------


def check_client_limit(
    num_client_processes: int,
    capability: tuple[int, int] | None,
    max_connections_env: str | None = None,
) -> list[Problem]:
    """At most 16 MPS clients per device before Volta, 48 on Volta+ (CUDA ≤ 13.0).

    With `capability` unknown the Volta+ cap is used (the capability check reports pre-Volta
    GPUs on its own). `max_connections_env` is the value of $CUDA_DEVICE_MAX_CONNECTIONS, if set.
    """
    pre_volta = capability is not None and tuple(capability) < VOLTA
    cap = CLIENT_CAP_PRE_VOLTA if pre_volta else CLIENT_CAP_VOLTA
    if num_client_processes <= cap:
        return []
    if capability is None:
        gpu = "a Volta or newer GPU (compute capability unknown)"
    else:
        gpu = f"a compute capability {capability[0]}.{capability[1]} GPU"
    message = (
        f"this run needs {num_client_processes} MPS client processes on one GPU, but MPS "
        f"accepts at most {cap} per device on {gpu} (CUDA ≤ 13.0); use fewer replicas or fewer "
        "GPU processes per replica"
    )
    if max_connections_env is not None and max_connections_env.strip():
        try:
            raised = int(max_connections_env) > DEFAULT_MPS_MAX_CONNECTIONS
        except ValueError:
            raised = True
        if raised:
            message += (
                f"; also, {MAX_CONNECTIONS_ENV}={max_connections_env} is above the MPS default "
                f"of {DEFAULT_MPS_MAX_CONNECTIONS}, which lowers the cap further: unset it"
            )
    return [Problem("client_limit", message)]


# --- GPU via NVML ---------------------------------------------------------------------------


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class _NeverRaised(Exception):
    """Stands in for an NVMLError subclass that an injected nvml object does not define."""


def _error_class(nvml: Any, name: str) -> type[BaseException]:
    cls = getattr(nvml, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, BaseException) else _NeverRaised


def _compute_mode_name(nvml: Any, mode: int) -> str:
    for attr, default, name in _COMPUTE_MODE_CONSTANTS:
        if mode == getattr(nvml, attr, default):
            return name
    return f"UNKNOWN({mode})"


def _visible_gpus(nvml: Any, error: Any) -> str:
    """'NVML sees: 0 GPU-… (name), 1 …' for messages; never raises NVML errors."""
    try:
        count = nvml.nvmlDeviceGetCount()
    except error as exc:
        return f"NVML could not count the GPUs ({_text(exc)})"
    if count == 0:
        return "NVML sees no GPUs"
    entries = []
    for i in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            name = _text(nvml.nvmlDeviceGetName(handle))
            entries.append(f"{i} {uuid} ({name})")
        except error as exc:
            entries.append(f"{i} (unreadable: {_text(exc)})")
    return "NVML sees: " + ", ".join(entries)


def _find_handle(nvml: Any, gpu: str, error: Any) -> tuple[Any, int | None, Problem | None]:
    """The NVML handle and index for `gpu` (an index or a GPU UUID), or a Problem."""
    not_found = (
        _error_class(nvml, "NVMLError_NotFound"),
        _error_class(nvml, "NVMLError_InvalidArgument"),
    )
    if gpu.isdigit():
        index = int(gpu)
        try:
            count = nvml.nvmlDeviceGetCount()
        except error as exc:
            return None, None, Problem("gpu", f"NVML could not count the GPUs: {_text(exc)}")
        if index >= count:
            return None, None, Problem(
                "gpu",
                f"no GPU with index {index} (NVML numbers GPUs as nvidia-smi does, 0..{count - 1})"
                f"; {_visible_gpus(nvml, error)}; pick one of these with --gpu INDEX or UUID",
            )
        try:
            return nvml.nvmlDeviceGetHandleByIndex(index), index, None
        except error as exc:
            return None, None, Problem(
                "gpu",
                f"NVML could not open GPU {index}: {_text(exc)}; {_visible_gpus(nvml, error)}",
            )
    if gpu.startswith("GPU-"):
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(gpu)
        except not_found:
            return None, None, Problem(
                "gpu",
                f"no GPU with UUID {gpu}; {_visible_gpus(nvml, error)}; "
                "pick one of these with --gpu INDEX or UUID",
            )
        except error as exc:
            return None, None, Problem(
                "gpu",
                f"NVML could not open GPU {gpu}: {_text(exc)}; {_visible_gpus(nvml, error)}",
            )
        return handle, _index_of_uuid(nvml, gpu, error), None
    hint = " (MIG devices are out of scope for MPS runs)" if gpu.startswith("MIG-") else ""
    return None, None, Problem(
        "gpu",
        f"--gpu {gpu!r} is neither a GPU index nor a GPU UUID (GPU-…){hint}; "
        f"{_visible_gpus(nvml, error)}",
    )


def _index_of_uuid(nvml: Any, uuid: str, error: Any) -> int | None:
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            if _text(nvml.nvmlDeviceGetUUID(handle)).lower() == uuid.lower():
                return i
    except error:
        pass
    return None


def _inspect_gpu(nvml: Any, handle: Any, index: int | None, gpu: str, error: Any
                 ) -> tuple[GpuFacts, list[Problem]]:
    problems: list[Problem] = []
    label = f"GPU {index}" if index is not None else f"GPU {gpu}"
    smi = f"nvidia-smi -i {index if index is not None else gpu}"

    def read(fn_name: str, *args: Any) -> tuple[Any, BaseException | None]:
        try:
            return getattr(nvml, fn_name)(handle, *args), None
        except error as exc:
            return None, exc

    uuid, exc = read("nvmlDeviceGetUUID")
    uuid = _text(uuid) if uuid is not None else None
    if exc is not None:
        problems.append(Problem("gpu", f"NVML could not read the UUID of {label}: {_text(exc)}"))
    name, _ = read("nvmlDeviceGetName")
    name = _text(name) if name is not None else None
    if name:
        label += f" ({name})"

    mode_value, exc = read("nvmlDeviceGetComputeMode")
    compute_mode = _compute_mode_name(nvml, mode_value) if exc is None else None
    if exc is not None:
        problems.append(Problem(
            "compute_mode", f"NVML could not read the compute mode of {label}: {_text(exc)}"
        ))
    elif compute_mode == "PROHIBITED":
        problems.append(Problem(
            "compute_mode",
            f"{label} is in compute mode PROHIBITED: no process may use it for CUDA; "
            f"set DEFAULT as root: {smi} -c DEFAULT",
        ))
    elif compute_mode == "EXCLUSIVE_PROCESS":
        problems.append(Problem(
            "compute_mode",
            f"{label} is in compute mode EXCLUSIVE_PROCESS: a private, non-root MPS daemon needs "
            f"compute mode DEFAULT; EXCLUSIVE_PROCESS needs root ({smi} -c DEFAULT)",
        ))
    elif compute_mode != "DEFAULT":
        problems.append(Problem(
            "compute_mode",
            f"{label} is in compute mode {compute_mode}: a private, non-root MPS daemon needs "
            f"compute mode DEFAULT (as root: {smi} -c DEFAULT)",
        ))

    mig_enabled: bool | None
    no_mig = (
        _error_class(nvml, "NVMLError_NotSupported"),
        _error_class(nvml, "NVMLError_FunctionNotFound"),
    )
    enable = getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1)
    try:
        current, pending = nvml.nvmlDeviceGetMigMode(handle)
    except no_mig:  # this GPU (or driver) has no MIG: nothing to disable
        mig_enabled = False
    except error as exc:
        mig_enabled = None
        problems.append(Problem(
            "mig", f"NVML could not read the MIG mode of {label}: {_text(exc)}"
        ))
    else:
        mig_enabled = current == enable
        if mig_enabled:
            if pending != enable:
                todo = f"a MIG disable is pending: reset the GPU as root ({smi} -r) to apply it"
            else:
                todo = f"disable MIG as root ({smi} -mig 0, then reset the GPU: {smi} -r)"
            problems.append(Problem(
                "mig", f"MIG is enabled on {label}; MPS and MIG on one GPU are out of scope: {todo}"
            ))

    capability, exc = read("nvmlDeviceGetCudaComputeCapability")
    if exc is not None:
        capability = None
        problems.append(Problem(
            "capability", f"NVML could not read the compute capability of {label}: {_text(exc)}"
        ))
    else:
        capability = (int(capability[0]), int(capability[1]))
        if capability < VOLTA:
            problems.append(Problem(
                "capability",
                f"{label} has compute capability {capability[0]}.{capability[1]}; omni-dp's MPS "
                "mode needs Volta (7.0) or newer, where MPS clients get their own address spaces "
                f"and up to {CLIENT_CAP_VOLTA} clients per GPU; use a newer GPU or run without "
                "--mps",
            ))

    memory, exc = read("nvmlDeviceGetMemoryInfo")
    memory_total = int(memory.total) if exc is None and memory is not None else None
    memory_used = int(memory.used) if exc is None and memory is not None else None
    pci_bus_id = None
    if hasattr(nvml, "nvmlDeviceGetPciInfo"):
        pci, exc = read("nvmlDeviceGetPciInfo")
        if exc is None and pci is not None:
            pci_bus_id = _text(getattr(pci, "busId", "")) or None

    facts = GpuFacts(
        index=index if index is not None else -1,
        uuid=uuid,
        name=name,
        compute_mode=compute_mode,
        mig_enabled=mig_enabled,
        capability=capability,
        memory_total_bytes=memory_total,
        memory_used_bytes=memory_used,
        pci_bus_id=pci_bus_id,
    )
    return facts, problems


def query_gpu(gpu: str, nvml: Any = None) -> tuple[GpuFacts | None, list[Problem], bool]:
    """Ask NVML about `gpu` (an index as nvidia-smi numbers them, or a "GPU-…" UUID).

    `nvml` is a pynvml-like object (default: the real pynvml). Returns (facts, problems,
    nvml_available); facts is None when NVML is unavailable or the GPU was not found.
    """
    if nvml is None:
        try:
            import pynvml as nvml  # lazy: keeps importing this module cheap
        except ImportError as exc:
            return None, [Problem(
                "nvml",
                f"the Python package nvidia-ml-py (module pynvml) is not installed ({exc}); "
                "install omni-dp's dependencies (pip install nvidia-ml-py)",
            )], False

    error = getattr(nvml, "NVMLError", None) or Exception
    library_not_found = _error_class(nvml, "NVMLError_LibraryNotFound")
    try:
        nvml.nvmlInit()
    except library_not_found:
        return None, [Problem("nvml", NO_DRIVER_MESSAGE)], False
    except error as exc:
        return None, [Problem(
            "nvml",
            f"NVML could not start: {_text(exc)} ({type(exc).__name__}); check that the NVIDIA "
            "driver is loaded and matches its libraries (nvidia-smi shows the same error)",
        )], False

    gpu = gpu.strip()
    try:
        handle, index, problem = _find_handle(nvml, gpu, error)
        if problem is not None:
            return None, [problem], True
        facts, problems = _inspect_gpu(nvml, handle, index, gpu, error)
        return facts, problems, True
    finally:
        with contextlib.suppress(error):
            nvml.nvmlShutdown()


# --- all together ---------------------------------------------------------------------------


def run_preflight(
    *,
    control_binary: str | None,
    gpu: str,
    pipe_dir: str,
    num_client_processes: int,
    nvml: Any = None,
    driver: Callable[[], str | None] | None = None,
) -> PreflightReport:
    """Every check above; reports environment problems, never raises for them. `driver` reads
    the driver's version (default: binaries.driver_version)."""
    found, problems = locate_control_binary(control_binary, driver=driver)
    facts, gpu_problems, nvml_available = query_gpu(gpu, nvml)
    problems += gpu_problems
    problems += check_client_limit(
        num_client_processes,
        facts.capability if facts is not None else None,
        os.environ.get(MAX_CONNECTIONS_ENV),
    )
    problems += check_socket_path(pipe_dir)
    return PreflightReport(problems=tuple(problems), gpu=facts, nvml_available=nvml_available,
                           binaries=found)


def format_report(report: PreflightReport) -> str:
    """One "✗ check: message" line per problem, or one "✓ …" line when all passed."""
    if not report.ok:
        return "\n".join(f"✗ {p.check}: {p.message}" for p in report.problems)
    g = report.gpu
    if g is None:
        return "✓ MPS preflight passed"
    cc = f"{g.capability[0]}.{g.capability[1]}" if g.capability else "unknown"
    return (
        f"✓ MPS preflight passed (GPU {g.index} {g.uuid} {g.name}, cc {cc}, "
        f"mode {g.compute_mode})"
    )
