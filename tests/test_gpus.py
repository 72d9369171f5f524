"""omni_dp.gpus: every GPU NVML sees, read in one session, with no word about MPS."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pynvml
import pytest

from omni_dp.gpus import (
    NO_DRIVER,
    GpuInventory,
    Problem,
    nvml_driver_version,
    nvml_id_of,
    pick_gpu,
    query_gpu,
    query_gpus,
)
from omni_dp.launcher.planning.facts import gather_facts
from omni_dp.launcher.planning.options import LaunchOptions
from omni_dp.mps import binaries
from omni_dp.mps.preflight import NO_DRIVER_MESSAGE, lookup_gpu, run_preflight

from support.nvml import H100_UUID, L4_UUID, FakeGpu, FakeNvml

DRIVER = "580.159.03"


@dataclass
class DriverNvml(FakeNvml):
    """A fake NVML that also reports the driver's version, and may fail to open one GPU."""

    lost: int | None = None  # the index of a GPU that cannot be opened

    def nvmlSystemGetDriverVersion(self) -> str:
        self._live("nvmlSystemGetDriverVersion")
        return DRIVER

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        if index == self.lost:
            self._live("nvmlDeviceGetHandleByIndex")
            raise pynvml.NVMLError_GpuIsLost()
        return super().nvmlDeviceGetHandleByIndex(index)


def two_gpus(**changes) -> DriverNvml:
    return DriverNvml(gpus=[FakeGpu(uuid=L4_UUID, name="NVIDIA L4", cc=(8, 9), mig=None),
                            FakeGpu()], **changes)


def test_query_gpus_returns_every_gpu_in_one_session():
    nvml = two_gpus()
    inventory = query_gpus(nvml)
    assert inventory.nvml_available and inventory.driver_version == DRIVER
    assert [(g.index, g.uuid, g.name, g.capability) for g in inventory.gpus] == [
        (0, L4_UUID, "NVIDIA L4", (8, 9)), (1, H100_UUID, "NVIDIA H100 80GB HBM3", (9, 0))]
    assert all(g.driver_version == DRIVER and g.errors == () for g in inventory.gpus)
    assert nvml.calls.count("nvmlInit") == 1 and nvml.calls[-1] == "nvmlShutdown"
    assert nvml.calls.count("nvmlDeviceGetHandleByIndex") == 2


def test_a_gpu_that_cannot_be_opened_is_listed_and_refused_alone():
    inventory = query_gpus(two_gpus(lost=0))
    lost, good = inventory.gpus
    assert lost.uuid is None and "GPU is lost" in (lost.error("handle") or "")
    assert good.uuid == H100_UUID and good.error("handle") is None
    assert inventory.visible() == (f"NVML sees: 0 (unreadable: {lost.error('handle')}), "
                                   f"1 {H100_UUID} (NVIDIA H100 80GB HBM3)")
    gpu, problems = pick_gpu(inventory, "0")
    assert gpu is None and problems[0].message.startswith("NVML could not open GPU 0: ")
    assert pick_gpu(inventory, "1") == (good, [])
    assert pick_gpu(inventory, "GPU-" + H100_UUID[4:].upper()) == (good, [])


def test_an_unreadable_field_is_none_with_nvmls_words():
    nvml = DriverNvml(gpus=[FakeGpu(mode_error=pynvml.NVMLError_NoPermission)])
    gpu, problems, _ = query_gpu("0", nvml)
    assert problems == [] and gpu is not None  # found: whether it suits a run is not said here
    assert gpu.compute_mode is None and "Insufficient Permissions" in gpu.error("compute_mode")


def test_nothing_is_said_of_mps_here_and_the_mps_preflight_says_it():
    no_driver = FakeNvml(init_error=pynvml.NVMLError_LibraryNotFound())
    assert query_gpu("0", no_driver) == (None, [Problem("nvml", NO_DRIVER)], False)
    assert lookup_gpu("0", FakeNvml(init_error=pynvml.NVMLError_LibraryNotFound()))[1] == [
        Problem("nvml", NO_DRIVER_MESSAGE)]
    mig = "MIG-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"
    _, problems, _ = query_gpu(mig, FakeNvml())
    assert "MPS" not in problems[0].message and mig in problems[0].message
    _, problems, _ = lookup_gpu(mig, FakeNvml())
    assert "(GPU-…) (MIG devices are out of scope for MPS runs); NVML sees: 0" in \
        problems[0].message
    gpu, problems, _ = query_gpu("0", FakeNvml(gpus=[FakeGpu(cc=(6, 0))]))
    assert gpu is not None and gpu.capability == (6, 0) and problems == []


def test_nvml_that_cannot_count_says_so_for_every_pick():
    class Uncountable(FakeNvml):
        def nvmlDeviceGetCount(self) -> int:
            self._live("nvmlDeviceGetCount")
            raise pynvml.NVMLError_Unknown()

    inventory = query_gpus(Uncountable())
    assert inventory.nvml_available and inventory.gpus == ()
    assert pick_gpu(inventory, "0")[1][0].message.startswith("NVML could not count the GPUs: ")
    assert "NVML could not count the GPUs (" in pick_gpu(inventory, H100_UUID)[1][0].message


@pytest.mark.parametrize("wanted", ["0", H100_UUID, "x"])
def test_without_nvml_every_pick_is_the_nvml_problem(wanted):
    inventory = GpuInventory(nvml_problem=Problem("nvml", NO_DRIVER))
    assert pick_gpu(inventory, wanted) == (None, [Problem("nvml", NO_DRIVER)])
    assert not inventory.nvml_available


def test_the_driver_version_is_read_in_a_session_of_its_own_when_asked_alone():
    nvml = DriverNvml()
    assert nvml_driver_version(nvml) == DRIVER
    assert nvml.calls == ["nvmlInit", "nvmlSystemGetDriverVersion", "nvmlShutdown"]
    assert nvml_driver_version(FakeNvml(init_error=pynvml.NVMLError_DriverNotLoaded())) is None


def test_importing_gpus_loads_no_pynvml():
    code = "import sys, omni_dp.gpus\nprint('pynvml' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "False"


# --- a launch asks NVML once ----------------------------------------------------------------


@pytest.fixture
def control_binary(tmp_path, monkeypatch) -> str:
    """A stand-in nvidia-cuda-mps-control (never run), with no version in it."""
    monkeypatch.delenv("OMNI_DP_MPS_CONTROL", raising=False)
    monkeypatch.setattr(binaries, "DRIVER_DIRS", ())
    path = tmp_path / "bin" / "nvidia-cuda-mps-control"
    path.parent.mkdir()
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return str(path)


def test_a_launch_under_mps_asks_nvml_once(control_binary, tmp_path, monkeypatch):
    """The GPU lookup, the MPS preflight's GPU checks and the driver's version for the
    control binary's check all come from one NVML session."""
    nvml = DriverNvml(gpus=[FakeGpu(mode=pynvml.NVML_COMPUTEMODE_PROHIBITED)])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)  # what `import pynvml` gives now
    monkeypatch.setenv("OMNI_DP_STATE_DIR", str(tmp_path / "state"))
    options = LaunchOptions(mps=True, replicas=2, mps_control=control_binary)
    facts = gather_facts(options, option_problems=["skip the engine's dry run"])
    assert nvml.calls.count("nvmlInit") == 1, nvml.calls
    assert nvml.calls.count("nvmlShutdown") == 1
    assert facts.first_gpu is not None and facts.first_gpu.uuid == H100_UUID
    assert facts.mps_binaries is not None and facts.mps_binaries.driver_version == DRIVER
    assert [p for p in facts.mps_problems if "compute mode PROHIBITED" in p] == [
        "--mps: GPU 0 (NVIDIA H100 80GB HBM3) is in compute mode PROHIBITED: no process may "
        "use it for CUDA; set DEFAULT as root: nvidia-smi -i 0 -c DEFAULT"]


def test_the_mps_preflight_asks_nvml_once_too(control_binary, tmp_path, monkeypatch):
    nvml = DriverNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    report = run_preflight(control_binary=control_binary, gpu="0",
                           pipe_dir=str(tmp_path / "pipe"), num_client_processes=2)
    assert report.ok and report.binaries is not None
    assert report.binaries.driver_version == DRIVER
    assert nvml.calls.count("nvmlInit") == 1, nvml.calls


@pytest.mark.parametrize(("index", "visible", "expected"), [
    (0, None, "0"),
    (1, None, "1"),
    (0, H100_UUID, H100_UUID),  # every replica's variable: its GPU by UUID
    (0, "MIG-2f0c9a43-1b1e-5b0f-9c1e-6f1d2a3b4c5d", "MIG-2f0c9a43-1b1e-5b0f-9c1e-6f1d2a3b4c5d"),
    (0, "2", "2"),  # torch's 0 is NVML's 2
    (1, f"3, {L4_UUID}", L4_UUID),
    (1, "3", None),
    (0, "", None),  # no GPU visible
    (-1, None, None),
])
def test_a_torch_index_is_found_in_nvml_through_cuda_visible_devices(index, visible, expected):
    assert nvml_id_of(index, visible) == expected
