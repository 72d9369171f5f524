"""`omni-dp serve --model joe|VOICE_DIR`: the voice's plan and its dry-run sizes.

A Piper voice keeps no KV cache: its plan holds an empty pool (0 tokens, 0 bytes), accepts a
pin of 0 (what `launch` passes on for an engine with a fixed default) and refuses any other pin,
saying why, rather than sizing memory nobody uses. The memory fit counts the graph's bytes (its
float32 weights, held once by onnxruntime) and the device's overhead.
"""

from __future__ import annotations

from collections.abc import Callable

import psutil
import torch

from omni_dp.engine.kv_cache import KVCacheSpec
from omni_dp.engine.options import ServeOptions
from omni_dp.engine.voice.model import VoiceError, find_voice, runtime_problem
from omni_dp.engine.voice.phonemes import espeak_problem
from omni_dp.sizes import format_size

NO_KV = "none: a Piper voice keeps no KV cache, so a replica of it needs no KV pin"
# The voice's stages; both run in the replica's one process (docs/voice.md says what is left).
VOICE_PLACEMENT_PROBLEM = ("--placement-config and dotted placement options place the seeded "
                           "presets' stages; a Piper voice runs its two stages (preprocess, "
                           "voice) in the replica's one process")


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
    if options.placement_config or options.placement_overrides:
        problems.append(VOICE_PLACEMENT_PROBLEM)
    return problems


def plan_voice(options: ServeOptions, device: torch.device | None, threads: int,
               problems: list[str], overhead_of: Callable[[torch.device], int]) -> dict | None:
    """ServePlan's fields for a voice, or None with the reasons added to `problems`."""
    problems += _option_problems(options)
    try:
        voice = find_voice(options.model)
    except VoiceError as exc:
        problems.append(str(exc))
        voice = None
    for problem in (espeak_problem(),
                    runtime_problem(str(device)) if device is not None else None):
        if problem:
            problems.append(problem)
    if voice is None or device is None:
        return None
    need = voice.weights_bytes + overhead_of(device)
    if device.type == "cuda":
        free, where = torch.cuda.mem_get_info(device)[0], f"free memory on {device}"
    else:
        free, where = psutil.virtual_memory().available, "available host memory"
    if need > free:
        problems.append(f"the voice needs {format_size(need)} (graph + overhead) but {where} "
                        f"is {format_size(free)}")
    return {
        "options": options, "cfg": None, "model_dir": voice.source, "device": device,
        "dtype": torch.float32, "threads": threads, "kv": empty_pool(options.page_size),
        "served_model_name": options.served_model_name or f"omni-dp-{voice.name}",
        "voice": voice,
    }


def voice_summary(plan, overhead: int) -> dict:
    """`serve --dry-run`'s JSON for a voice: the fields a launcher reads, KV all zero."""
    voice = plan.voice
    return {
        "model": voice.name, "device": str(plan.device), "dtype": "float32",
        "threads": plan.threads, "weights_bytes": voice.weights_bytes,
        "max_total_num_tokens": 0, "kv_cache_bytes": 0, "kv_bytes_per_token": 0,
        "page_size": plan.kv.page_size, "overhead_bytes": overhead,
        "share_weights": None, "shared_weights_bytes": 0,
        "private_weights_bytes": voice.weights_bytes, "kv": NO_KV,
        "voice": {"source": voice.source, "sample_rate": voice.sample_rate,
                  "espeak_voice": voice.espeak_voice, "speakers": voice.num_speakers,
                  "reproducible": False},
    }
