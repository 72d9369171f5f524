"""`omni-dp serve --model joe|VOICE_DIR`: the voice's plan and its dry-run sizes.

A Piper voice keeps no KV cache: its plan holds an empty pool (0 tokens, 0 bytes), accepts a
pin of 0 (what `launch` passes on for an engine with a fixed default) and refuses any other pin,
saying why, rather than sizing memory nobody uses. Its two stages are placed as the seeded
pipeline's are (placement/builtin.py's VOICE_PIPELINE: `--voice.process`, `--voice.replicas`,
`--voice.device`, budgets); every process that runs the voice stage holds its own onnxruntime
copy of the graph (float32), and the memory fit counts each, with one overhead per process.
"""

from __future__ import annotations

from collections.abc import Callable

import psutil
import torch

from omni_dp.engine.kv_cache import KVCacheSpec
from omni_dp.engine.options import ServeOptions
from omni_dp.engine.placement_plan import (
    budget_check,
    on_device,
    plan_placement,
    process_needs,
    split_memory_problems,
)
from omni_dp.engine.voice.model import VoiceError, VoiceModel, find_voice, runtime_problem
from omni_dp.engine.voice.phonemes import espeak_problem
from omni_dp.placement.builtin import VOICE_PIPELINE
from omni_dp.placement.model import Placement
from omni_dp.placement.table import placement_json
from omni_dp.sizes import format_size

NO_KV = "none: a Piper voice keeps no KV cache, so a replica of it needs no KV pin"


def empty_pool(page_size: int) -> KVCacheSpec:
    return KVCacheSpec(num_layers=0, num_kv_heads=0, head_dim=0, dtype=torch.float32,
                       page_size=max(1, page_size), num_pages=0)


def _option_problems(options: ServeOptions) -> list[str]:
    """The seeded presets' options that mean nothing for a voice, each refused by name."""
    problems = []
    for flag, value in (("--kv-cache-bytes", options.kv_cache_bytes),
                        ("--max-total-tokens", options.max_total_tokens)):
        if value:
            problems.append(f"{flag} {value}: {NO_KV} (omit it, or pin 0)")
    if options.dtype not in ("auto", "float32"):
        problems.append(f"--dtype {options.dtype}: a Piper voice's graph is float32")
    if options.share_weights or options.share_dir:
        problems.append("--share-weights: a Piper voice has no share policy (onnxruntime holds "
                        "its own copy of the graph)")
    return problems


def stage_bytes(voice: VoiceModel) -> dict[str, int]:
    """What each stage's process holds of the model: the graph where the voice speaks."""
    return {"preprocess": 0, "voice": voice.weights_bytes}


def plan_voice(options: ServeOptions, device: torch.device | None, threads: int,
               problems: list[str], overhead_of: Callable[[str], int]) -> dict | None:
    """ServePlan's fields for a voice, or None with the reasons added to `problems`.
    `overhead_of`: a process's overhead on a device (cpu, cuda:N)."""
    problems += _option_problems(options)
    try:
        voice = find_voice(options.model)
    except VoiceError as exc:
        problems.append(str(exc))
        voice = None
    placement = (plan_placement(options, device, problems, VOICE_PIPELINE)
                 if device is not None else None)
    speaking = sorted({p.device for p in placement.process_of("voice")}) if placement else []
    for problem in (espeak_problem(), *(runtime_problem(d) for d in speaking)):
        if problem:
            problems.append(problem)
    if voice is None or device is None or placement is None:
        return None
    problems += budget_check(placement, stage_bytes(voice), 0, overhead_of)
    problems += _fit_problems(voice, device, placement, overhead_of)
    return {
        "options": options, "cfg": None, "model_dir": voice.source, "device": device,
        "dtype": torch.float32, "threads": threads, "kv": empty_pool(options.page_size),
        "served_model_name": options.served_model_name or f"omni-dp-{voice.name}",
        "voice": voice, "placement": placement,
    }


def _fit_problems(voice: VoiceModel, device: torch.device, placement: Placement,
                  overhead_of: Callable[[str], int]) -> list[str]:
    """Whether the graph and the overhead fit where the replica runs (one process), or each
    device's processes together (a split replica)."""
    if not placement.is_single_process:
        needs = process_needs(placement, stage_bytes(voice), 0, overhead_of)
        return split_memory_problems(placement, needs)
    need = voice.weights_bytes + overhead_of(str(device))
    if device.type == "cuda":
        free, where = torch.cuda.mem_get_info(device)[0], f"free memory on {device}"
    else:
        free, where = psutil.virtual_memory().available, "available host memory"
    if need > free:
        return [f"the voice needs {format_size(need)} (graph + overhead) but {where} is "
                f"{format_size(free)}"]
    return []


def voice_summary(plan, overhead_of: Callable[[str], int]) -> dict:
    """`serve --dry-run`'s JSON for a voice: the fields a launcher reads, KV all zero. Weights
    and overhead as the seeded engine counts them: those of the processes on the replica's
    kind of device (a GPU replica's CPU processes hold host memory, not the GPU's)."""
    voice, placement = plan.voice, plan.placement
    here = on_device(placement, plan.device)
    weights = voice.weights_bytes * sum("voice" in p.stages for p in here)
    return {
        "model": voice.name, "weights": "loaded", "device": str(plan.device),
        "dtype": "float32", "threads": plan.threads, "weights_bytes": weights,
        "max_total_num_tokens": 0, "kv_cache_bytes": 0, "kv_bytes_per_token": 0,
        "page_size": plan.kv.page_size,
        "overhead_bytes": sum(overhead_of(p.device) for p in here),
        "share_weights": None, "shared_weights_bytes": 0, "private_weights_bytes": weights,
        "kv": NO_KV,
        "voice": {"source": voice.source, "sample_rate": voice.sample_rate,
                  "espeak_voice": voice.espeak_voice, "speakers": voice.num_speakers,
                  "reproducible": False},
        "placement": placement_json(placement),
    }
