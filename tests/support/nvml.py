"""A fake pynvml: the functions the GPU lookup and the MPS preflight use, over a list of
FakeGpu, every call recorded (the NVML tests of tests/test_gpus.py and tests/mps/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pynvml

H100_UUID = "GPU-8f2c1a6e-3b4d-4c5e-9f60-1a2b3c4d5e6f"
L4_UUID = "GPU-01234567-89ab-cdef-0123-456789abcdef"
GIB = 1024**3


@dataclass
class FakeGpu:
    uuid: str = H100_UUID
    name: str | bytes = "NVIDIA H100 80GB HBM3"
    mode: int = pynvml.NVML_COMPUTEMODE_DEFAULT
    # (current, pending), or None for a GPU without MIG (NVMLError_NotSupported)
    mig: tuple[int, int] | None = (pynvml.NVML_DEVICE_MIG_DISABLE, pynvml.NVML_DEVICE_MIG_DISABLE)
    cc: tuple[int, int] = (9, 0)
    memory: int = 80 * GIB
    uuid_as_bytes: bool = False
    mode_error: type[pynvml.NVMLError] | None = None


@dataclass
class FakeNvml:
    """The pynvml functions preflight uses, over a list of FakeGpu; records every call."""

    gpus: list[FakeGpu] = field(default_factory=lambda: [FakeGpu()])
    init_error: pynvml.NVMLError | None = None
    calls: list[str] = field(default_factory=list)
    initialized: bool = False

    NVMLError = pynvml.NVMLError
    NVMLError_LibraryNotFound = pynvml.NVMLError_LibraryNotFound
    NVMLError_NotFound = pynvml.NVMLError_NotFound
    NVMLError_InvalidArgument = pynvml.NVMLError_InvalidArgument
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVMLError_FunctionNotFound = pynvml.NVMLError_FunctionNotFound
    NVML_COMPUTEMODE_DEFAULT = pynvml.NVML_COMPUTEMODE_DEFAULT
    NVML_COMPUTEMODE_EXCLUSIVE_THREAD = pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD
    NVML_COMPUTEMODE_PROHIBITED = pynvml.NVML_COMPUTEMODE_PROHIBITED
    NVML_COMPUTEMODE_EXCLUSIVE_PROCESS = pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    NVML_DEVICE_MIG_ENABLE = pynvml.NVML_DEVICE_MIG_ENABLE
    NVML_DEVICE_MIG_DISABLE = pynvml.NVML_DEVICE_MIG_DISABLE

    def _live(self, name: str) -> None:
        self.calls.append(name)
        if not self.initialized:
            raise pynvml.NVMLError_Uninitialized()

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.init_error is not None:
            raise self.init_error
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self._live("nvmlShutdown")
        self.initialized = False

    def nvmlDeviceGetCount(self) -> int:
        self._live("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._live("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError_InvalidArgument()
        return self.gpus[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeGpu:
        self._live("nvmlDeviceGetHandleByUUID")
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return gpu
        raise pynvml.NVMLError_NotFound()

    def nvmlDeviceGetUUID(self, handle: FakeGpu) -> str | bytes:
        self._live("nvmlDeviceGetUUID")
        return handle.uuid.encode() if handle.uuid_as_bytes else handle.uuid

    def nvmlDeviceGetName(self, handle: FakeGpu) -> str | bytes:
        self._live("nvmlDeviceGetName")
        return handle.name

    def nvmlDeviceGetComputeMode(self, handle: FakeGpu) -> int:
        self._live("nvmlDeviceGetComputeMode")
        if handle.mode_error is not None:
            raise handle.mode_error()
        return handle.mode

    def nvmlDeviceGetMigMode(self, handle: FakeGpu) -> list[int]:
        self._live("nvmlDeviceGetMigMode")
        if handle.mig is None:
            raise pynvml.NVMLError_NotSupported()
        return list(handle.mig)

    def nvmlDeviceGetCudaComputeCapability(self, handle: FakeGpu) -> tuple[int, int]:
        self._live("nvmlDeviceGetCudaComputeCapability")
        return handle.cc

    def nvmlDeviceGetMemoryInfo(self, handle: FakeGpu) -> SimpleNamespace:
        self._live("nvmlDeviceGetMemoryInfo")
        return SimpleNamespace(total=handle.memory, free=handle.memory, used=0)
