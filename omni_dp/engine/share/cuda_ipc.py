"""The CUDA buffers: exported by the leader, opened by its followers, by CUDA IPC handle.

torch's own primitives, as torch.multiprocessing uses them (torch/multiprocessing/reductions.py:
`reduce_tensor` calls `_share_cuda_()`, `rebuild_cuda_tensor` calls `_new_shared_cuda`), without
its pickling: the eight values travel in the manifest (sharefile.CudaIpcHandle). A buffer is one
caching-allocator allocation; its handle names the whole cudaMalloc block and the buffer's offset
in it. The buffers are never released: the leader keeps every one for its lifetime
(export._KEEP). torch's per-export ref counter (`ref_counter_handle`, which its own sharing
uses to decide when the exporter may free a block) is decremented by each follower's exit too,
so it is not meaningful here; it does not need to be, since nothing is ever freed while the
leader runs.

Not testable without a GPU; every device-agnostic step around it (layout, views, checks) is
tested on the CPU.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import torch

from omni_dp.engine.share import ShareError
from omni_dp.sharefile import CudaIpcHandle

ALLOC_CONF_ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
CUDA_IPC_HANDLE_BYTES = 64  # a cudaIpcMemHandle_t, as torch before 2.5 handed it out bare
# torch ≥ 2.5 prefixes the handle with a version byte and its kind: b"c" a cudaMalloc block
# (cudaIpcOpenMemHandle), b"e" an expandable segment (cuMem* and pidfd_getfd).
_CUDA_MALLOC_KIND = b"c"
_EXPANDABLE_SEGMENT_KIND = b"e"


def device_name(device: torch.device) -> str:
    """The manifest's `device`: "cpu", or the GPU by UUID (indices differ between processes
    that see different CUDA_VISIBLE_DEVICES; a UUID does not)."""
    if device.type != "cuda":
        return "cpu"
    return "GPU-" + str(torch.cuda.get_device_properties(device).uuid)


def _alloc_settings(value: str) -> dict[str, str]:
    """`key:value,key:value` as torch parses PYTORCH_CUDA_ALLOC_CONF, lowercased."""
    settings = {}
    for item in value.replace(" ", "").lower().split(","):
        key, _, setting = item.partition(":")
        if key:
            settings[key] = setting
    return settings


def exportable_problem(environ: Mapping[str, str] = os.environ) -> str | None:
    """Why the allocator this environment configures gives no cudaIpc handles, or None.

    Expandable segments map memory with the cuMem* API, whose IPC export needs pidfd_getfd
    (and a kernel and ptrace rules to allow it); the cudaMallocAsync backend allocates from a
    stream-ordered pool, which cudaIpcGetMemHandle does not export. torch's cudaIpc handles
    are available for neither: refuse rather than hand followers a handle that will not open.
    Reads only the environment (no GPU needed): plan_serve checks it before anything starts,
    in the process and environment that then publishes."""
    for env in ALLOC_CONF_ENVS:
        settings = _alloc_settings(environ.get(env, ""))
        if settings.get("expandable_segments") == "true":
            return (f"{env} enables expandable_segments; a sharing leader needs cudaMalloc'd "
                    "buffers for CUDA IPC: unset it (or set expandable_segments:False)")
        if settings.get("backend") == "cudamallocasync":
            return (f"{env} selects backend:cudaMallocAsync, whose pool allocations have no "
                    "CUDA IPC handles; a sharing leader needs the native caching allocator: "
                    "unset it (or set backend:native)")
    return None


def handle_problem(handle: bytes) -> str | None:
    """Why followers could not open this handle, or None for a cudaMalloc block's.

    The allocator can be switched to expandable segments in code as well as by the environment
    exportable_problem reads (torch.cuda.memory._set_allocator_settings, a library, a future
    default); its handles then need pidfd_getfd, which ptrace rules refuse to another process
    ("pidfd_getfd: Operation not permitted"). Refused at the leader, with the reason, rather
    than in every follower."""
    if len(handle) == CUDA_IPC_HANDLE_BYTES:
        return None
    kind = handle[1:2]
    if kind == _CUDA_MALLOC_KIND:
        return None
    if kind == _EXPANDABLE_SEGMENT_KIND:
        return ("the caching allocator uses expandable segments (set in code or by the "
                "environment), whose IPC handles need pidfd_getfd in each follower; a sharing "
                "leader needs cudaMalloc'd buffers: set expandable_segments:False")
    return f"torch handed out an IPC handle of an unknown kind ({kind!r})"


def new_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A flat uint8 buffer from the caching allocator: one allocation, exported whole."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def export(buffer: torch.Tensor) -> CudaIpcHandle:
    """The buffer's IPC handle as the manifest holds it; ShareError where followers could not
    open it."""
    (device, handle, storage_size, storage_offset, ref_counter_handle, ref_counter_offset,
     event_handle, event_sync_required) = buffer.untyped_storage()._share_cuda_()
    problem = handle_problem(bytes(handle))
    if problem:
        raise ShareError(f"cannot export the leader's CUDA buffer: {problem}")
    return CudaIpcHandle(
        device=int(device), handle=bytes(handle), storage_size=int(storage_size),
        storage_offset=int(storage_offset), ref_counter_handle=bytes(ref_counter_handle),
        ref_counter_offset=int(ref_counter_offset),
        # 64 bytes, zeros when no wait is needed (None from some torch versions): never read
        # unless event_sync_required.
        event_handle=bytes(event_handle or b""),
        event_sync_required=bool(event_sync_required),
    )


def open_buffer(ipc: CudaIpcHandle, device: torch.device) -> torch.Tensor:
    """The leader's buffer as a flat uint8 tensor on `device` (this process's index of the
    GPU the manifest names by UUID: the leader's index is in its own numbering); waits for the
    leader's copies when the handle says so."""
    if ipc.event_sync_required and len(ipc.event_handle) != CUDA_IPC_HANDLE_BYTES:
        # torch would fail without an exception set (SystemError), naming nothing
        raise ShareError(f"the manifest's event handle is {len(ipc.event_handle)} bytes, not "
                         f"{CUDA_IPC_HANDLE_BYTES}: not one the leader's torch handed out")
    args = dataclasses.replace(ipc, device=device.index or 0).args()
    torch.cuda._lazy_init()  # as rebuild_cuda_tensor does before opening a handle
    with torch.cuda.device(device):
        try:
            storage = torch.UntypedStorage._new_shared_cuda(*args)
        except RuntimeError as exc:
            raise ShareError(f"cannot open the leader's CUDA buffer: {exc}") from None
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    flat.set_(storage)
    return flat
