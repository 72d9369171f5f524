"""MPS preflight: control binary, NVML GPU facts (real pynvml and a fake), limits, report text."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

from omni_dp.gpus import GpuFacts, Problem
from omni_dp.mps import binaries
from omni_dp.mps.preflight import (
    NO_DRIVER_MESSAGE,
    PreflightReport,
    check_client_limit,
    check_socket_path,
    format_report,
    locate_control_binary,
    lookup_gpu,
    run_preflight,
)

from support.nvml import GIB, H100_UUID, L4_UUID, FakeGpu, FakeNvml


def _real_driver_present() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def _executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in nvidia-cuda-mps-control (never run), given as an explicit path."""
    monkeypatch.delenv("OMNI_DP_MPS_CONTROL", raising=False)
    monkeypatch.setattr(binaries, "DRIVER_DIRS", ())  # not the real driver's, where there is one
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    return _executable(bindir / "nvidia-cuda-mps-control")


def _checks(problems) -> list[str]:
    return [p.check for p in problems]


# --- NVML: the real library on this machine ---------------------------------------------------


def test_real_pynvml_without_a_driver_reports_it() -> None:
    if _real_driver_present():
        facts, problems, available = lookup_gpu("0")
        assert available is True
        assert all(p.check != "nvml" for p in problems)
        return
    facts, problems, available = lookup_gpu("0")
    assert facts is None
    assert available is False
    assert problems == [Problem("nvml", NO_DRIVER_MESSAGE)]
    assert "no NVIDIA driver on this machine" in problems[0].message


def test_real_pynvml_run_preflight_does_not_raise(control: Path, tmp_path: Path) -> None:
    if _real_driver_present():
        pytest.skip("an NVIDIA driver is present; the no-driver report cannot be observed")
    report = run_preflight(
        control_binary=str(control), gpu="0", pipe_dir=str(tmp_path / "pipe"),
        num_client_processes=3,
    )
    assert report.nvml_available is False
    assert report.gpu is None
    assert not report.ok
    assert _checks(report.problems) == ["nvml"]
    assert format_report(report) == f"✗ nvml: {NO_DRIVER_MESSAGE}"


def test_importing_preflight_loads_neither_pynvml_nor_torch() -> None:
    code = (
        "import sys, omni_dp.mps.preflight\n"
        "print(sorted(m for m in ('pynvml', 'torch', 'omni_dp.launcher', 'omni_dp.router',"
        " 'omni_dp.engine') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
    )
    assert out.stdout.strip() == "[]"


# --- NVML: a fake ------------------------------------------------------------------------------


def test_good_h100_passes_and_reports_its_facts() -> None:
    nvml = FakeNvml()
    facts, problems, available = lookup_gpu("0", nvml)
    assert problems == []
    assert available is True
    assert facts == GpuFacts(
        index=0, uuid=H100_UUID, name="NVIDIA H100 80GB HBM3", compute_mode="DEFAULT",
        mig_enabled=False, capability=(9, 0), memory_total_bytes=80 * GIB, memory_used_bytes=0,
    )
    assert nvml.calls[0] == "nvmlInit"
    assert nvml.calls[-1] == "nvmlShutdown"
    assert nvml.initialized is False


def test_gpu_by_uuid_finds_its_index() -> None:
    nvml = FakeNvml(gpus=[FakeGpu(uuid=L4_UUID, name="NVIDIA L4", cc=(8, 9)), FakeGpu()])
    facts, problems, available = lookup_gpu(f"  {H100_UUID} ", nvml)
    assert problems == []
    assert available is True
    assert facts is not None
    assert (facts.index, facts.uuid, facts.name) == (1, H100_UUID, "NVIDIA H100 80GB HBM3")
    assert nvml.calls.count("nvmlDeviceGetHandleByIndex") == 2  # every GPU read, then matched


def test_bytes_from_older_pynvml_are_decoded() -> None:
    nvml = FakeNvml(gpus=[FakeGpu(name=b"Tesla V100-SXM2-32GB", cc=(7, 0), uuid_as_bytes=True)])
    facts, problems, _ = lookup_gpu("0", nvml)
    assert problems == []
    assert facts is not None
    assert facts.name == "Tesla V100-SXM2-32GB"
    assert facts.uuid == H100_UUID


@pytest.mark.parametrize("gpu", ["2", "GPU-00000000-0000-0000-0000-000000000000", "cuda:0"])
def test_unknown_gpu_lists_the_visible_ones(gpu: str) -> None:
    nvml = FakeNvml(gpus=[FakeGpu(), FakeGpu(uuid=L4_UUID, name="NVIDIA L4", cc=(8, 9))])
    facts, problems, available = lookup_gpu(gpu, nvml)
    assert facts is None
    assert available is True
    assert _checks(problems) == ["gpu"]
    message = problems[0].message
    assert gpu in message
    assert f"0 {H100_UUID} (NVIDIA H100 80GB HBM3)" in message
    assert f"1 {L4_UUID} (NVIDIA L4)" in message
    assert nvml.calls[-1] == "nvmlShutdown"


def test_no_gpus_visible() -> None:
    facts, problems, available = lookup_gpu("0", FakeNvml(gpus=[]))
    assert facts is None
    assert available is True
    assert _checks(problems) == ["gpu"]
    assert "NVML sees no GPUs" in problems[0].message


def test_prohibited_compute_mode() -> None:
    nvml = FakeNvml(gpus=[FakeGpu(mode=pynvml.NVML_COMPUTEMODE_PROHIBITED)])
    facts, problems, _ = lookup_gpu("0", nvml)
    assert facts is not None
    assert facts.compute_mode == "PROHIBITED"
    assert _checks(problems) == ["compute_mode"]
    assert "PROHIBITED" in problems[0].message
    assert "nvidia-smi -i 0 -c DEFAULT" in problems[0].message


def test_exclusive_process_compute_mode_needs_root() -> None:
    nvml = FakeNvml(gpus=[FakeGpu(mode=pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)])
    facts, problems, _ = lookup_gpu("0", nvml)
    assert facts is not None
    assert facts.compute_mode == "EXCLUSIVE_PROCESS"
    assert _checks(problems) == ["compute_mode"]
    message = problems[0].message
    assert "a private, non-root MPS daemon needs compute mode DEFAULT" in message
    assert "EXCLUSIVE_PROCESS needs root" in message
    assert "nvidia-smi -i 0 -c DEFAULT" in message


def test_unreadable_compute_mode_is_a_problem() -> None:
    nvml = FakeNvml(gpus=[FakeGpu(mode_error=pynvml.NVMLError_NoPermission)])
    facts, problems, _ = lookup_gpu("0", nvml)
    assert facts is not None
    assert facts.compute_mode is None
    assert _checks(problems) == ["compute_mode"]
    assert "Insufficient Permissions" in problems[0].message


def test_mig_enabled() -> None:
    on = pynvml.NVML_DEVICE_MIG_ENABLE
    facts, problems, _ = lookup_gpu("0", FakeNvml(gpus=[FakeGpu(mig=(on, on))]))
    assert facts is not None
    assert facts.mig_enabled is True
    assert _checks(problems) == ["mig"]
    assert "nvidia-smi -i 0 -mig 0" in problems[0].message


def test_mig_enabled_with_disable_pending_says_reset() -> None:
    mig = (pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_DISABLE)
    _, problems, _ = lookup_gpu("0", FakeNvml(gpus=[FakeGpu(mig=mig)]))
    assert _checks(problems) == ["mig"]
    assert "pending" in problems[0].message
    assert "nvidia-smi -i 0 -r" in problems[0].message


def test_mig_not_supported_counts_as_disabled() -> None:
    facts, problems, _ = lookup_gpu("0", FakeNvml(gpus=[FakeGpu(name="NVIDIA L4", mig=None)]))
    assert problems == []
    assert facts is not None
    assert facts.mig_enabled is False


def test_pre_volta_capability() -> None:
    nvml = FakeNvml(gpus=[FakeGpu(name="Tesla P40", cc=(6, 1))])
    facts, problems, _ = lookup_gpu("0", nvml)
    assert facts is not None
    assert facts.capability == (6, 1)
    assert _checks(problems) == ["capability"]
    assert "6.1" in problems[0].message
    assert "Volta (7.0)" in problems[0].message


def test_other_init_error_is_reported_with_its_text() -> None:
    nvml = FakeNvml(init_error=pynvml.NVMLError_DriverNotLoaded())
    facts, problems, available = lookup_gpu("0", nvml)
    assert facts is None
    assert available is False
    assert _checks(problems) == ["nvml"]
    assert "Driver Not Loaded" in problems[0].message
    assert NO_DRIVER_MESSAGE not in problems[0].message
    assert nvml.calls == ["nvmlInit"]  # no shutdown without a successful init


def test_library_not_found_from_an_injected_nvml() -> None:
    nvml = FakeNvml(init_error=pynvml.NVMLError_LibraryNotFound())
    assert lookup_gpu("0", nvml) == (None, [Problem("nvml", NO_DRIVER_MESSAGE)], False)
    assert nvml.calls == ["nvmlInit"]


def test_shutdown_follows_every_successful_init() -> None:
    for gpu in ("0", "7", H100_UUID, "GPU-nope", "x"):
        nvml = FakeNvml()
        lookup_gpu(gpu, nvml)
        assert nvml.calls.count("nvmlInit") == 1, gpu
        assert nvml.calls.count("nvmlShutdown") == 1, gpu
        assert nvml.calls[-1] == "nvmlShutdown", gpu
        assert nvml.initialized is False, gpu


def test_several_problems_are_reported_together(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNI_DP_MPS_CONTROL", raising=False)
    on = pynvml.NVML_DEVICE_MIG_ENABLE
    gpu = FakeGpu(name="Tesla P100", mode=pynvml.NVML_COMPUTEMODE_PROHIBITED, mig=(on, on),
                  cc=(6, 0))
    report = run_preflight(
        control_binary=str(tmp_path / "missing" / "nvidia-cuda-mps-control"),
        gpu="0",
        pipe_dir="/" + "p" * 120,
        num_client_processes=17,
        nvml=FakeNvml(gpus=[gpu]),
    )
    assert not report.ok
    assert report.nvml_available is True
    assert report.gpu is not None
    assert report.gpu.capability == (6, 0)
    assert sorted(_checks(report.problems)) == sorted(
        ["control_binary", "compute_mode", "mig", "capability", "client_limit", "socket_path"]
    )
    lines = format_report(report).splitlines()
    assert len(lines) == 6
    assert all(line.startswith("✗ ") for line in lines)
    assert any(line.startswith("✗ client_limit: ") and " 16 " in line for line in lines)


# --- the control binary ------------------------------------------------------------------------


def _assert_install_hint(message: str) -> None:
    assert "nvidia-cuda-mps" in message
    assert "non-free" in message
    assert "--mps-control" in message
    assert "OMNI_DP_MPS_CONTROL" in message


def test_control_binary_valid_executable(control: Path) -> None:
    assert locate_control_binary(str(control))[1] == []


def test_control_binary_missing_path(control: Path) -> None:
    missing = control.parent / "nope"
    problems = locate_control_binary(str(missing))[1]
    assert _checks(problems) == ["control_binary"]
    assert str(missing) in problems[0].message
    assert "does not exist" in problems[0].message
    _assert_install_hint(problems[0].message)


def test_control_binary_not_executable(control: Path) -> None:
    control.chmod(0o644)
    problems = locate_control_binary(str(control))[1]
    assert _checks(problems) == ["control_binary"]
    assert "not executable" in problems[0].message
    assert str(control) in problems[0].message


def test_control_binary_is_a_directory(control: Path) -> None:
    problems = locate_control_binary(str(control.parent))[1]
    assert _checks(problems) == ["control_binary"]
    assert "is a directory" in problems[0].message


def test_control_binary_broken_symlink(control: Path) -> None:
    link = control.parent / "dangling"
    link.symlink_to(control.parent / "gone")
    problems = locate_control_binary(str(link))[1]
    assert _checks(problems) == ["control_binary"]
    assert "broken symbolic link" in problems[0].message


def test_control_binary_found_on_path(control: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", f"{control.parent.parent}{os.pathsep}{control.parent}")
    assert locate_control_binary(None)[1] == []


def test_control_binary_not_on_path_names_where_it_looked(
    control: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    problems = locate_control_binary(None)[1]
    assert _checks(problems) == ["control_binary"]
    assert "not found on PATH" in problems[0].message
    assert str(empty) in problems[0].message
    _assert_install_hint(problems[0].message)


def test_control_binary_on_path_but_not_executable(
    control: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    control.chmod(0o644)
    monkeypatch.setenv("PATH", str(control.parent))
    problems = locate_control_binary(None)[1]
    assert _checks(problems) == ["control_binary"]
    assert f"{control} is not executable" in problems[0].message


def test_control_binary_env_override(
    control: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing there
    monkeypatch.setenv("OMNI_DP_MPS_CONTROL", str(control))
    assert locate_control_binary(None)[1] == []

    monkeypatch.setenv("OMNI_DP_MPS_CONTROL", str(tmp_path / "elsewhere"))
    problems = locate_control_binary(None)[1]
    assert _checks(problems) == ["control_binary"]
    assert f"OMNI_DP_MPS_CONTROL={tmp_path / 'elsewhere'}" in problems[0].message

    # An explicit path wins over the environment.
    assert locate_control_binary(str(control))[1] == []


def test_control_binary_bare_name_is_looked_up_on_path(
    control: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    _executable(control.parent / "my-mps-control")
    monkeypatch.setenv("PATH", str(control.parent))
    assert locate_control_binary("my-mps-control")[1] == []
    problems = locate_control_binary("other-mps-control")[1]
    assert _checks(problems) == ["control_binary"]
    assert "other-mps-control" in problems[0].message


def test_control_binary_is_not_run(control: Path) -> None:
    marker = control.parent / "ran"
    control.write_text(f"#!/bin/sh\ntouch {marker}\n")
    assert locate_control_binary(str(control))[1] == []
    assert not marker.exists()
    assert stat.S_IMODE(control.stat().st_mode) == 0o755


# --- the socket path ---------------------------------------------------------------------------


def _pipe_dir_for_socket_length(n: int) -> str:
    pipe_dir = "/" + "d" * (n - len("/control") - 1)
    assert len(f"{pipe_dir}/control".encode()) == n
    return pipe_dir


def test_socket_path_of_107_bytes_is_fine() -> None:
    assert check_socket_path(_pipe_dir_for_socket_length(107)) == []


def test_socket_path_of_108_bytes_fails_and_says_its_length() -> None:
    problems = check_socket_path(_pipe_dir_for_socket_length(108))
    assert _checks(problems) == ["socket_path"]
    assert "108 bytes" in problems[0].message
    assert "OMNI_DP_STATE_DIR" in problems[0].message


def test_socket_path_counts_bytes_not_characters() -> None:
    pipe_dir = "/" + "é" * 50  # 51 characters, 101 bytes
    problems = check_socket_path(pipe_dir)
    assert _checks(problems) == ["socket_path"]
    assert "109 bytes" in problems[0].message


def test_socket_path_must_be_absolute() -> None:
    problems = check_socket_path("run/mps/pipe")
    assert _checks(problems) == ["socket_path"]
    assert "absolute" in problems[0].message


# --- the client limit --------------------------------------------------------------------------


def test_client_limit_volta_and_newer() -> None:
    assert check_client_limit(48, (9, 0)) == []
    problems = check_client_limit(49, (9, 0))
    assert _checks(problems) == ["client_limit"]
    assert "49" in problems[0].message
    assert "at most 48" in problems[0].message


def test_client_limit_before_volta() -> None:
    assert check_client_limit(16, (6, 0)) == []
    problems = check_client_limit(17, (6, 0))
    assert _checks(problems) == ["client_limit"]
    assert "at most 16" in problems[0].message


def test_client_limit_unknown_capability_uses_the_volta_cap() -> None:
    assert check_client_limit(48, None) == []
    assert _checks(check_client_limit(49, None)) == ["client_limit"]


def test_client_limit_mentions_raised_max_connections() -> None:
    message = check_client_limit(49, (9, 0), "8")[0].message
    assert "CUDA_DEVICE_MAX_CONNECTIONS=8" in message
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in check_client_limit(49, (9, 0), "2")[0].message
    assert check_client_limit(10, (9, 0), "32") == []


def test_run_preflight_reads_max_connections_from_the_environment(
    control: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "16")
    report = run_preflight(
        control_binary=str(control), gpu="0", pipe_dir=str(tmp_path / "pipe"),
        num_client_processes=60, nvml=FakeNvml(),
    )
    assert _checks(report.problems) == ["client_limit"]
    assert "CUDA_DEVICE_MAX_CONNECTIONS=16" in report.problems[0].message


# --- the report ----------------------------------------------------------------------------------


def test_format_report_pass(control: Path, tmp_path: Path) -> None:
    report = run_preflight(
        control_binary=str(control), gpu=H100_UUID, pipe_dir=str(tmp_path / "pipe"),
        num_client_processes=5, nvml=FakeNvml(),
    )
    assert report.ok
    assert report.problems == ()
    assert format_report(report) == (
        f"✓ MPS preflight passed (GPU 0 {H100_UUID} NVIDIA H100 80GB HBM3, cc 9.0, mode DEFAULT)"
    )


def test_format_report_fail() -> None:
    report = PreflightReport(
        problems=(Problem("nvml", "no driver"), Problem("socket_path", "too long")),
        gpu=None, nvml_available=False,
    )
    assert not report.ok
    assert format_report(report) == "✗ nvml: no driver\n✗ socket_path: too long"
