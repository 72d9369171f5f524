"""A GPU process's memory budget, checked against what it measurably holds, before its KV pool.

The plan sized the talker's KV pool from its budget (a fraction of the device's TOTAL memory)
less the weights and an overhead estimate, from shapes alone: exact, so that every replica of
a run holds the same pool. Once its process has loaded its models on a GPU, the estimate meets
the measurement: NVML's figure for this process (its CUDA context, the allocator's reserve, the
weights), which must leave room for the pool inside the budget. Where NVML has no per-process
figure (some containers and MPS set-ups list no processes), the pool is checked against free
memory instead, and the log says so: a colocated budget is never trusted unchecked.

The pool is not resized to the measurement: a few MiB of difference between processes would
give replicas different page counts, which the launcher's KV equality check refuses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from omni_dp.sizes import format_size

log = logging.getLogger("omni_dp.serve")

# On top of the pool, room the fallback keeps free for activations and allocator slack.
FREE_MEMORY_MARGIN_BYTES = 256 * 1024**2


@dataclass(frozen=True)
class Held:
    """What this process holds on its device (None: unknown) and what is free there."""

    process_bytes: int | None
    free_bytes: int
    why_unknown: str | None = None


class BudgetExceeded(RuntimeError):
    pass


def check_pool(process: str, budget_bytes: int, pool_bytes: int, held: Held) -> str:
    """Raise BudgetExceeded when the pool does not fit; else say how it was checked."""
    need = format_size(pool_bytes)
    if held.process_bytes is not None:
        left = budget_bytes - held.process_bytes
        if pool_bytes > left:
            raise BudgetExceeded(
                f"process {process}: its budget is {format_size(budget_bytes)} and it holds "
                f"{format_size(held.process_bytes)} after loading (NVML), which leaves "
                f"{format_size(max(left, 0))} for a KV pool of {need}; raise its stages' "
                "gpu_memory_fraction or lower --max-total-tokens")
        return (f"process {process}: holds {format_size(held.process_bytes)} (NVML) + KV "
                f"{need} within its budget of {format_size(budget_bytes)}")
    room = held.free_bytes - FREE_MEMORY_MARGIN_BYTES
    if pool_bytes > room:
        raise BudgetExceeded(
            f"process {process}: per-process accounting is unavailable ({held.why_unknown}) "
            f"and free memory ({format_size(held.free_bytes)}) cannot take a KV pool of {need} "
            f"plus {format_size(FREE_MEMORY_MARGIN_BYTES)} of margin")
    return (f"process {process}: per-process accounting is unavailable ({held.why_unknown}); "
            f"checked the KV pool of {need} against free memory "
            f"({format_size(held.free_bytes)}) instead of its budget")


def measure_cuda(device) -> Held:
    """NVML's figure for this process on `device` (a torch CUDA device), and free memory."""
    import os

    import torch

    from omni_dp.engine.share.cuda_ipc import device_name
    from omni_dp.gpus import nvml_gpu_memory

    torch.cuda.synchronize(device)  # the weights' copies have landed
    free, _total = torch.cuda.mem_get_info(device)
    used, why = nvml_gpu_memory(device_name(device))
    mine = None if used is None else used.get(os.getpid())
    if used is not None and mine is None:
        why = "NVML does not list this process"
    return Held(mine, free, why)


def check_before_pool(process: str, budget_bytes: int | None, pool_bytes: int, device,
                      measure: Callable[[object], Held] = measure_cuda) -> None:
    """On a GPU with a declared budget: the check, logged; nothing elsewhere (on the CPU the
    plan's arithmetic is the whole check: there is no per-process device to measure)."""
    if budget_bytes is None or getattr(device, "type", "cpu") != "cuda":
        return
    held = measure(device)
    outcome = check_pool(process, budget_bytes, pool_bytes, held)
    log.log(logging.INFO if held.process_bytes is not None else logging.WARNING,
            "memory budget: %s", outcome)
