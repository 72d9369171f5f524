"""Checks to run BEFORE anything is started for an MPS run.

Each check returns every problem it finds, each with what is wrong and what to do about it, so a
person can fix them all in one go. Nothing here starts the MPS daemon, creates a CUDA context or
writes a file. What NVML says about the GPU is omni_dp.gpus' (one session, pynvml imported
there only, so importing this module is cheap); here is what MPS needs of it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from omni_dp.gpus import NO_DRIVER, NOT_A_GPU_ID, GpuFacts, Problem, query_gpu
from omni_dp.mps import binaries
from omni_dp.mps.binaries import MpsBinaries
from omni_dp.mps.control import BinaryNotFound, socket_path_problems

MAX_CONNECTIONS_ENV = "CUDA_DEVICE_MAX_CONNECTIONS"

# MPS clients per device (NVIDIA MPS guide; CUDA ≤ 13.0; 13.1+ raises Volta+ to 60).
CLIENT_CAP_PRE_VOLTA = 16
CLIENT_CAP_VOLTA = 48
# Volta+ MPS clients default to this many device connections; raising it lowers the cap.
DEFAULT_MPS_MAX_CONNECTIONS = 2
VOLTA = (7, 0)

NO_DRIVER_MESSAGE = f"{NO_DRIVER}: MPS needs a GPU and its driver"
MIG_HINT = " (MIG devices are out of scope for MPS runs)"

# The checks that need a GPU; `--no-gpu-check` skips them to exercise the daemon alone.
GPU_CHECKS = ("nvml", "gpu", "compute_mode", "mig", "capability")


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


# --- socket path ----------------------------------------------------------------------------


def check_socket_path(pipe_dir: str) -> list[Problem]:
    """The control socket's path (omni_dp.mps.control.socket_path_problems), as problems."""
    return [Problem("socket_path", message) for message in socket_path_problems(pipe_dir)]


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
    if _raised(max_connections_env):
        message += (
            f"; also, {MAX_CONNECTIONS_ENV}={max_connections_env} is above the MPS default "
            f"of {DEFAULT_MPS_MAX_CONNECTIONS}, which lowers the cap further: unset it"
        )
    return [Problem("client_limit", message)]


def _raised(max_connections_env: str | None) -> bool:
    """Is $CUDA_DEVICE_MAX_CONNECTIONS set above the MPS default (or to no number)?"""
    if max_connections_env is None or not max_connections_env.strip():
        return False
    try:
        return int(max_connections_env) > DEFAULT_MPS_MAX_CONNECTIONS
    except ValueError:
        return True


# --- the GPU --------------------------------------------------------------------------------


def in_mps_words(problem: Problem, wanted: str) -> Problem:
    """A GPU lookup's problem (omni_dp.gpus) as an MPS run says it: MPS needs the driver, and
    a MIG device's UUID is refused because MPS runs take whole GPUs."""
    if problem.message == NO_DRIVER:
        return Problem(problem.check, NO_DRIVER_MESSAGE)
    if problem.check == "gpu" and wanted.strip().startswith("MIG-"):
        return Problem(problem.check,
                       problem.message.replace(NOT_A_GPU_ID, NOT_A_GPU_ID + MIG_HINT, 1))
    return problem


def _smi(gpu: GpuFacts) -> str:
    return f"nvidia-smi -i {gpu.index}"


def _uuid_problems(gpu: GpuFacts) -> list[Problem]:
    why = gpu.error("uuid")
    if why is None:
        return []
    return [Problem("gpu", f"NVML could not read the UUID of GPU {gpu.index}: {why}")]


def _compute_mode_problems(gpu: GpuFacts) -> list[Problem]:
    label, smi, mode = gpu.label, _smi(gpu), gpu.compute_mode
    why = gpu.error("compute_mode")
    if why is not None:
        message = f"NVML could not read the compute mode of {label}: {why}"
    elif mode == "PROHIBITED":
        message = (f"{label} is in compute mode PROHIBITED: no process may use it for CUDA; "
                   f"set DEFAULT as root: {smi} -c DEFAULT")
    elif mode == "EXCLUSIVE_PROCESS":
        message = (f"{label} is in compute mode EXCLUSIVE_PROCESS: a private, non-root MPS "
                   f"daemon needs compute mode DEFAULT; EXCLUSIVE_PROCESS needs root ({smi} -c "
                   "DEFAULT)")
    elif mode not in ("DEFAULT", None):
        message = (f"{label} is in compute mode {mode}: a private, non-root MPS daemon needs "
                   f"compute mode DEFAULT (as root: {smi} -c DEFAULT)")
    else:
        return []
    return [Problem("compute_mode", message)]


def _mig_problems(gpu: GpuFacts) -> list[Problem]:
    why = gpu.error("mig")
    if why is not None:
        return [Problem("mig", f"NVML could not read the MIG mode of {gpu.label}: {why}")]
    if not gpu.mig_enabled:
        return []
    smi = _smi(gpu)
    if gpu.mig_disable_pending:
        todo = f"a MIG disable is pending: reset the GPU as root ({smi} -r) to apply it"
    else:
        todo = f"disable MIG as root ({smi} -mig 0, then reset the GPU: {smi} -r)"
    return [Problem(
        "mig", f"MIG is enabled on {gpu.label}; MPS and MIG on one GPU are out of scope: {todo}")]


def _capability_problems(gpu: GpuFacts) -> list[Problem]:
    why = gpu.error("capability")
    if why is not None:
        return [Problem("capability",
                        f"NVML could not read the compute capability of {gpu.label}: {why}")]
    capability = gpu.capability
    if capability is None or capability >= VOLTA:
        return []
    return [Problem(
        "capability",
        f"{gpu.label} has compute capability {capability[0]}.{capability[1]}; omni-dp's MPS mode "
        "needs Volta (7.0) or newer, where MPS clients get their own address spaces and up to "
        f"{CLIENT_CAP_VOLTA} clients per GPU; use a newer GPU or run without --mps",
    )]


_GPU_CHECKS = (_uuid_problems, _compute_mode_problems, _mig_problems, _capability_problems)


def check_gpu(gpu: GpuFacts) -> list[Problem]:
    """What a private, non-root MPS daemon needs of the GPU found: a readable UUID, compute mode
    DEFAULT, MIG off, Volta or newer."""
    return [problem for check in _GPU_CHECKS for problem in check(gpu)]


def lookup_gpu(gpu: str, nvml: Any = None) -> tuple[GpuFacts | None, list[Problem], bool]:
    """omni_dp.gpus.query_gpu in an MPS run's words, with check_gpu's problems of the GPU found:
    (facts, problems, nvml_available)."""
    facts, problems, available = query_gpu(gpu, nvml)
    problems = [in_mps_words(problem, gpu) for problem in problems]
    if facts is not None:
        problems += check_gpu(facts)
    return facts, problems, available


# --- all together ---------------------------------------------------------------------------


def _driver_of(gpu: GpuFacts | None) -> Callable[[], str | None] | None:
    """The driver's version NVML read with the GPU, as locate_mps_binaries asks for it; None
    (binaries.driver_version then asks NVML and /proc) where it is unknown."""
    if gpu is None or not gpu.driver_version:
        return None
    version = gpu.driver_version
    return lambda: version


def check_preflight(
    *,
    control_binary: str | None,
    gpu: GpuFacts | None,
    pipe_dir: str,
    num_client_processes: int,
    driver: Callable[[], str | None] | None = None,
    lookup_problems: Sequence[Problem] = (),
    nvml_available: bool = True,
) -> PreflightReport:
    """Every check, for a GPU already looked up (None: none found; `lookup_problems` say why):
    NVML is not asked again. The driver's version is the one NVML read with the GPU; `driver`
    (default: binaries.driver_version) is asked only where that is unknown."""
    found, problems = locate_control_binary(control_binary, driver=driver or _driver_of(gpu))
    problems += lookup_problems
    problems += check_gpu(gpu) if gpu is not None else []
    problems += check_client_limit(
        num_client_processes,
        gpu.capability if gpu is not None else None,
        os.environ.get(MAX_CONNECTIONS_ENV),
    )
    problems += check_socket_path(pipe_dir)
    return PreflightReport(problems=tuple(problems), gpu=gpu, nvml_available=nvml_available,
                           binaries=found)


def run_preflight(
    *,
    control_binary: str | None,
    gpu: str,
    pipe_dir: str,
    num_client_processes: int,
    nvml: Any = None,
    driver: Callable[[], str | None] | None = None,
) -> PreflightReport:
    """Every check above, asking NVML once about `gpu` (an index or a GPU UUID); reports
    environment problems, never raises for them. `driver` reads the driver's version (default:
    NVML's answer with the GPU, else binaries.driver_version)."""
    facts, problems, available = query_gpu(gpu, nvml)
    return check_preflight(
        control_binary=control_binary, gpu=facts, pipe_dir=pipe_dir,
        num_client_processes=num_client_processes, driver=driver,
        lookup_problems=[in_mps_words(problem, gpu) for problem in problems],
        nvml_available=available)


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
