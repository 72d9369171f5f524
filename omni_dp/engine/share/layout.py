"""Where each tensor lies in the flat buffers: the manifest's entries, before any byte moves.

Pure arithmetic, the same for the CPU segment (one buffer) and the CUDA buffers (one per dtype:
a CUDA storage is opened whole, and one dtype per buffer keeps every view aligned for its
dtype whatever ALIGN is). Shared tensors come first, then the private ones, each in the model's
order, each at an ALIGN-aligned offset.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from omni_dp.engine.plan import dtype_name
from omni_dp.sharefile import ALIGN, TensorEntry


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def lay_out(
    shared: Sequence[tuple[str, torch.Tensor]],
    private: Sequence[tuple[str, torch.Tensor]],
    buffer_of: Callable[[torch.Tensor], str],
) -> tuple[list[int], list[TensorEntry], list[TensorEntry]]:
    """(each buffer's size in bytes, the shared entries, the private entries); `buffer_of`
    names the buffer a tensor goes in (buffers are numbered in the order first named)."""
    keys: dict[str, int] = {}
    sizes: list[int] = []

    def put(name: str, tensor: torch.Tensor) -> TensorEntry:
        index = keys.setdefault(buffer_of(tensor), len(keys))
        if index == len(sizes):
            sizes.append(0)
        offset = _align(sizes[index])
        nbytes = tensor.numel() * tensor.element_size()
        sizes[index] = offset + nbytes
        return TensorEntry(name, dtype_name(tensor.dtype), tuple(tensor.shape), index, offset,
                           nbytes)

    shared_entries = [put(name, t) for name, t in shared]
    private_entries = [put(name, t) for name, t in private]
    return sizes, shared_entries, private_entries


def one_buffer(tensor: torch.Tensor) -> str:
    return "all"


def buffer_per_dtype(tensor: torch.Tensor) -> str:
    return dtype_name(tensor.dtype)
