"""The replica's placement, planned: the torch-free placement model (omni_dp/placement) fed
with this machine's devices and this model's sizes.

Budgets are fractions of a device's TOTAL memory (vLLM's meaning), never of what is free now:
stages load one after another, and what is free depends on who loaded first. A talker with a
budget and no KV knob gets the KV pool its budget leaves after its weights and overhead, worked
out here from the shapes, so the pool is exact before anything loads (the launcher compares it
across replicas); on a GPU the talker's process checks it against what it measurably holds
once it has loaded (engine/budget.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import psutil
import torch

from omni_dp.engine.config import ModelConfig
from omni_dp.engine.options import ServeOptions
from omni_dp.placement.builtin import BUILTIN_PIPELINE
from omni_dp.placement.config import load_placement
from omni_dp.placement.model import (
    MAIN_PROCESS,
    PipelineSpec,
    Placement,
    PlacementError,
    PlacementRequest,
    ProcessPlan,
)
from omni_dp.placement.validate import budget_problems, resolve
from omni_dp.sizes import format_size

# The talker's projections tensor_parallel.shard_talker splits evenly across the ranks; every
# other talker parameter (embeddings, norms, lm_head) a rank holds whole.
_SPLIT = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
REPLICATED = "talker (replicated under TP)"  # its key in stage_weight_bytes


def stage_weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of each stage's weights as a replica holds them (shapes only: the meta device),
    and of the talker's that a TP rank holds whole."""
    from omni_dp.engine.weights import meta_models

    models = meta_models(cfg, dtype)
    talker = dict(models.talker.named_parameters())
    return {
        "preprocess": 0,
        "talker": sum(p.numel() * p.element_size() for p in talker.values()),
        "vocoder": sum(p.numel() * p.element_size() for p in models.vocoder.parameters()),
        REPLICATED: sum(p.numel() * p.element_size() for name, p in talker.items()
                        if not set(name.split(".")) & set(_SPLIT)),
    }


def held_weights(weights: dict[str, int], stage: str, tp_size: int) -> int:
    """A stage's weights in one of its processes: a TP rank holds the replicated part whole
    and its share of the rest."""
    if tp_size == 1 or stage != "talker":
        return weights[stage]
    replicated = weights[REPLICATED]
    return replicated + (weights["talker"] - replicated) // tp_size


def plan_placement(options: ServeOptions, device: torch.device, problems: list[str],
                   pipeline: PipelineSpec = BUILTIN_PIPELINE) -> Placement | None:
    """Defaults, then --placement-config, then the dotted overrides; resolved and validated."""
    if options.placement_config == "":
        problems.append("--placement-config needs a file (a YAML placement); leave it out for "
                        "the pipeline's default placement")
        return None
    file = Path(options.placement_config) if options.placement_config else None
    try:
        request = load_placement(pipeline, file, options.placement_overrides)
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.type == "cuda":  # the replica's own device: found by the plan already
            count = max(count, (device.index or 0) + 1)
        placement = resolve(pipeline, request, default_device=str(device),
                            gpu_count=count, gpu_total_bytes=gpu_totals(request, count),
                            host_total_bytes=psutil.virtual_memory().total)
    except PlacementError as exc:
        problems.extend(exc.problems)
        return None
    if options.share_weights is not None and not placement.is_single_process:
        problems.append("--share-weights shares the weights of single-process replicas; this "
                        "placement starts stage processes (drop one or the other)")
    return placement


def gpu_totals(request: PlacementRequest, count: int) -> dict[int, int]:
    """Each visible GPU's total memory, which budgets are fractions of; asked only when a
    stage declares a fraction (torch's device query sets up CUDA in this process)."""
    if all(stage.gpu_memory_fraction is None for stage in request.stages.values()):
        return {}
    return {i: torch.cuda.get_device_properties(i).total_memory for i in range(count)}


def talker_process(placement: Placement) -> ProcessPlan:
    """The process whose budget the KV pool comes out of (a TP group: rank 0's, all alike)."""
    return placement.process_of("talker")[0]


def process_needs(placement: Placement, weights: dict[str, int], kv_bytes: int,
                  overhead: Callable[[str], int]) -> dict[str, int]:
    """What each process will hold: its stages' weights (a TP rank: its share of the
    talker's) and the KV pool (a TP rank: its share), plus one overhead each."""
    needs = {}
    for process in placement.processes:
        held = 0
        for stage in process.stages:
            held += held_weights(weights, stage, process.tp_size)
            if stage == "talker":
                held += kv_bytes // process.tp_size  # a rank holds its KV heads only
        needs[process.name] = held + overhead(process.device)
    return needs


def kv_bytes_from_budget(placement: Placement, weights: dict[str, int],
                         overhead: Callable[[str], int]) -> int | None:
    """The talker's budget less everything else its process holds; None unless the talker
    declares a fraction (another stage's fraction in its process is that stage's room, not an
    order to size the pool)."""
    process = talker_process(placement)
    if placement.request.stages["talker"].gpu_memory_fraction is None:
        return None
    if process.budget_bytes is None:
        return None
    others = sum(weights[s] for s in process.stages if s != "talker")
    talker_share = held_weights(weights, "talker", process.tp_size)
    left = process.budget_bytes - overhead(process.device) - others - talker_share
    return left * process.tp_size  # the pool over all ranks; each holds 1/tp_size of it


def budget_check(placement: Placement, weights: dict[str, int], kv_bytes: int,
                 overhead: Callable[[str], int]) -> list[str]:
    return budget_problems(placement, process_needs(placement, weights, kv_bytes, overhead))


def main_of(placement: Placement) -> ProcessPlan:
    return next(p for p in placement.processes if p.name == MAIN_PROCESS)


def default_placement(device: torch.device,
                      pipeline: PipelineSpec = BUILTIN_PIPELINE) -> Placement:
    """The pipeline's own placement (form ①, every stage in `main`) on `device`."""
    request = load_placement(pipeline, None, ())
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return resolve(pipeline, request, default_device=str(device), gpu_count=count,
                   gpu_total_bytes={}, host_total_bytes=psutil.virtual_memory().total)


def on_device(placement: Placement, device: torch.device) -> list[ProcessPlan]:
    """The processes whose memory the launcher fits on the replica's device: those on a GPU
    for a GPU replica, those on the CPU for a CPU one."""
    on_cpu = device.type == "cpu"
    return [p for p in placement.processes if (p.device == "cpu") == on_cpu]


def runs_a_model(placement: Placement, process: ProcessPlan) -> bool:
    """Whether a process runs one of its pipeline's model stages (those that may use a GPU:
    the talker and vocoder, a voice), rather than only the front or a CPU preprocess."""
    return any(placement.pipeline.stage(s).accelerator for s in process.stages)


def process_threads(placement: Placement, threads: int) -> dict[str, int]:
    """Torch threads per process. The replica's `threads` (its CPU block) are split evenly
    among the processes that run a model on the CPU, at least one each: each running every
    thread of the block would oversubscribe it as many times over as there are processes. A
    process that runs its model on a GPU needs the CPU little: one thread where CPU model
    processes need the block, else the block (form ① on a GPU: unchanged). The others (the
    front without a model, a preprocess process) get one."""
    models = {p.name for p in placement.processes if runs_a_model(placement, p)}
    on_cpu = [p.name for p in placement.processes if p.name in models and p.device == "cpu"]
    share = max(1, threads // len(on_cpu)) if on_cpu else threads
    gpu_share = 1 if on_cpu else threads
    return {p.name: (share if p.name in on_cpu else gpu_share if p.name in models else 1)
            for p in placement.processes}


def tp_problems(placement: Placement, cfg: ModelConfig) -> list[str]:
    """A TP talker must split the model's heads evenly: refused here, not once its ranks
    have started."""
    size = talker_process(placement).tp_size
    if size == 1:
        return []
    from omni_dp.engine.tensor_parallel import check_shardable

    try:
        check_shardable(cfg, size)
    except ValueError as exc:
        return [f"talker.tp_size {size}: {exc}"]
    return []


def _free_without_context(device: torch.device) -> int | None:
    """Free memory on a GPU as NVML sees it (no CUDA context made); None if NVML cannot say."""
    from omni_dp.engine.share.cuda_ipc import device_name
    from omni_dp.gpus import query_gpu

    gpu, _, _ = query_gpu(device_name(device))
    if gpu is None or gpu.memory_total_bytes is None or gpu.memory_used_bytes is None:
        return None
    return gpu.memory_total_bytes - gpu.memory_used_bytes


def split_memory_problems(placement: Placement, needs: dict[str, int],
                          fix: str = "move a stage") -> list[str]:
    """A split replica: what its processes on each device need together, against what is
    free there now (`fix`: what the user can do about it). A GPU is
    asked through NVML, so that a front that runs no stage on it does not become a CUDA (and
    MPS) client the placement does not declare; through torch only where NVML cannot say and
    this process runs a stage on that GPU anyway."""
    problems = []
    main = main_of(placement)
    for device in sorted({p.device for p in placement.processes}):
        on_it = [p for p in placement.processes if p.device == device]
        need = sum(needs[p.name] for p in on_it)
        if device == "cpu":
            free, where = psutil.virtual_memory().available, "available host memory"
        else:
            free = _free_without_context(torch.device(device))
            if free is None and main.device == device:
                free = torch.cuda.mem_get_info(torch.device(device))[0]
            if free is None:
                # Unchecked here (NVML cannot say, and asking torch would make this process
                # a CUDA client): an allocation that does not fit fails its stage process's
                # start, and so the replica's (exit 3, the reason in its log).
                continue
            where = f"free memory on {device}"
        if need > free:
            names = ", ".join(f"{p.name} ({', '.join(p.stages) or 'front'})" for p in on_it)
            problems.append(f"the processes on {device} — {names} — need {format_size(need)} "
                            f"together but {where} is {format_size(free)}; {fix}")
    return problems
