"""omni_dp/engine/share/cuda_ipc.py's export and open, on the CPU: torch's CUDA sharing calls
are replaced by TEST STAND-INS that return what torch 2.11's hand out (`_share_cuda_`: eight
values, the handle prefixed with its version and kind) and record what they are given, so the
plumbing around them is checked here, before a GPU ever runs it."""

from __future__ import annotations

import contextlib

import pytest
import torch

from omni_dp.engine.share import ShareError, cuda_ipc
from omni_dp.sharefile import CudaIpcHandle

IPC_HANDLE = bytes(range(64))  # a cudaIpcMemHandle_t's 64 bytes
EVENT_HANDLE = bytes(range(64, 128))
CUDA_MALLOC = b"\x02c" + IPC_HANDLE  # torch >= 2.5: version 2, kind c (a cudaMalloc block)
EXPANDABLE = b"\x02e" + bytes(40)  # kind e: an expandable segment (pid + fd, for pidfd_getfd)


class StandinStorage:
    """TEST STAND-IN for a CUDA storage: `_share_cuda_` answers as torch's does."""

    def __init__(self, handle: bytes, event_handle: bytes | None = EVENT_HANDLE) -> None:
        self.shared = (3, handle, 4096, 512, b"/torch_123_456_0", 7, event_handle,
                       event_handle is not None)

    def _share_cuda_(self) -> tuple:
        return self.shared


class StandinBuffer:
    """TEST STAND-IN for the flat CUDA buffer export() is given."""

    def __init__(self, storage: StandinStorage) -> None:
        self.storage = storage

    def untyped_storage(self) -> StandinStorage:
        return self.storage


def test_export_keeps_torchs_eight_values():
    ipc = cuda_ipc.export(StandinBuffer(StandinStorage(CUDA_MALLOC)))
    assert ipc == CudaIpcHandle(3, CUDA_MALLOC, 4096, 512, b"/torch_123_456_0", 7, EVENT_HANDLE,
                                True)
    bare = cuda_ipc.export(StandinBuffer(StandinStorage(IPC_HANDLE, event_handle=None)))
    assert bare.handle == IPC_HANDLE and bare.event_handle == b""
    assert bare.event_sync_required is False


def test_a_leader_whose_allocator_hands_out_expandable_segments_refuses_to_publish():
    """Set in code, not by the environment exportable_problem reads: followers would fail
    with pidfd_getfd: Operation not permitted."""
    with pytest.raises(ShareError, match=r"expandable segments.*pidfd_getfd"):
        cuda_ipc.export(StandinBuffer(StandinStorage(EXPANDABLE)))
    with pytest.raises(ShareError, match=r"unknown kind \(b'x'\)"):
        cuda_ipc.export(StandinBuffer(StandinStorage(b"\x02x" + IPC_HANDLE)))


@pytest.fixture
def opened(monkeypatch):
    """torch's opening calls replaced: (the args _new_shared_cuda got, the devices entered)."""
    calls: list[tuple] = []
    devices: list[torch.device] = []

    def new_shared_cuda(*args):
        calls.append(args)
        return torch.UntypedStorage(args[2])  # a CPU storage of the buffer's size

    @contextlib.contextmanager
    def on_device(device):
        devices.append(device)
        yield

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", staticmethod(new_shared_cuda))
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch.cuda, "device", on_device)
    return calls, devices


def test_open_names_the_gpu_by_this_process_index_not_the_leaders(opened):
    """Under CUDA_VISIBLE_DEVICES=<UUID> the leader's GPU is its 0 and ours too; in general
    the two numberings differ, and the manifest matched the GPU by UUID already."""
    calls, devices = opened
    ipc = CudaIpcHandle(3, CUDA_MALLOC, 4096, 512, b"/torch_123_456_0", 7, EVENT_HANDLE, True)
    flat = cuda_ipc.open_buffer(ipc, torch.device("cuda", 0))
    assert calls == [(0, CUDA_MALLOC, 4096, 512, b"/torch_123_456_0", 7, EVENT_HANDLE, True)]
    assert [type(a) for a in calls[0]] == [int, bytes, int, int, bytes, int, bytes, bool]
    assert devices == [torch.device("cuda", 0)]
    assert flat.dtype == torch.uint8 and flat.numel() == 4096


def test_open_refuses_an_event_handle_torch_would_fail_on_without_a_word(opened):
    calls, _ = opened
    ipc = CudaIpcHandle(0, CUDA_MALLOC, 4096, 0, b"/torch_1_2_0", 0, b"", True)
    with pytest.raises(ShareError, match="event handle is 0 bytes, not 64"):
        cuda_ipc.open_buffer(ipc, torch.device("cuda", 0))
    assert calls == []
    no_wait = CudaIpcHandle(0, CUDA_MALLOC, 4096, 0, b"/torch_1_2_0", 0, b"", False)
    assert cuda_ipc.open_buffer(no_wait, torch.device("cuda", 0)).numel() == 4096


def test_a_failed_open_is_a_share_error_with_torchs_words(opened, monkeypatch):
    def refused(*args):
        raise RuntimeError("CUDA error: invalid device context")

    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", staticmethod(refused))
    ipc = CudaIpcHandle(0, CUDA_MALLOC, 4096, 0, b"/torch_1_2_0", 0, EVENT_HANDLE, True)
    with pytest.raises(ShareError, match="cannot open the leader's CUDA buffer: CUDA error: "
                                         "invalid device context"):
        cuda_ipc.open_buffer(ipc, torch.device("cuda", 0))
