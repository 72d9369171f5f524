"""Talker steps per second, host↔device syncs per step, and what a replica holds on the device
besides its weights and KV pool, measured in process (no server).

A full batch of decoding requests is kept running (a finished request is replaced at once), so
every timed step is the same shape: what a saturated replica's step loop does. On CUDA the
synchronising operations of each step are counted with torch's sync debug mode: the step
should have exactly one (reading the sampled codes back). On CPU there is nothing to count.

The overhead (engine/plan.py's CUDA_OVERHEAD_BYTES, assumed until measured here) is measured
with this process's CUDA context in it: the device's used memory is read by NVML BEFORE anything
makes a context (planning itself makes one: it asks torch for free memory), and again after the
steps; NVML's own figure for this process is preferred where it gives one (some MPS set-ups do
not), since the device total also moves with other processes and an MPS server starting.

    python bench/engine_steps.py --device cuda --model small --batch 32 --steps 200
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass

import torch

from omni_dp.engine.kv_cache import KVCache
from omni_dp.engine.plan import ServeOptions, plan_serve, plan_summary
from omni_dp.engine.runner import ModelRunner
from omni_dp.engine.scheduler import Scheduler, TalkerRequest
from omni_dp.engine.server import build_models
from omni_dp.gpus import nvml_gpu_memory, nvml_id_of, query_gpu

PROMPT_TOKENS = 24  # a short sentence's bytes plus the speaker and control tokens


def nvml_target(device: str, environ: dict[str, str] | None = None) -> str | None:
    """The GPU `--device` names, as NVML finds it (through CUDA_VISIBLE_DEVICES), worked out
    without a CUDA call; None off a GPU."""
    environ = os.environ if environ is None else environ
    if not device.startswith("cuda"):
        return None
    return nvml_id_of(torch.device(device).index or 0, environ.get("CUDA_VISIBLE_DEVICES"))


@dataclass(frozen=True)
class DeviceMemory:
    """What NVML says is in use on the GPU: by every process, and by this one (None where NVML
    does not say, e.g. no driver, or an MPS set-up that withholds per-process figures)."""

    device_used: int | None
    this_process: int | None


def device_memory_used(gpu: str | None) -> DeviceMemory:
    """NVML's figures for the GPU `gpu` names (nvml_target); no CUDA context is made."""
    if gpu is None:
        return DeviceMemory(None, None)
    facts, _, _ = query_gpu(gpu)
    per_process, _ = nvml_gpu_memory(gpu)
    return DeviceMemory(facts.memory_used_bytes if facts else None,
                        (per_process or {}).get(os.getpid()))


def overhead_figures(before: DeviceMemory, after: DeviceMemory, weights_bytes: int,
                     kv_bytes: int) -> dict:
    """What the process holds beyond weights and KV: by NVML's figure for it where there is
    one, else by what the whole device gained since `before` (taken before any context)."""
    gained = (after.device_used - before.device_used
              if after.device_used is not None and before.device_used is not None else None)
    held, source = after.this_process, "nvml_process"
    if held is None:
        held, source = gained, "device_used_delta"
    return {
        "baseline_used_bytes": before.device_used,
        "device_memory_bytes": gained,
        "process_memory_bytes": after.this_process,
        "measured_overhead_bytes": None if held is None else held - weights_bytes - kv_bytes,
        "overhead_source": None if held is None else source,
    }


def measure(device: str, model: str, batch: int, steps: int, warmup: int = 20,
            sync_steps: int = 10) -> dict:
    gpu = nvml_target(device)
    baseline = device_memory_used(gpu)  # before anything (planning included) makes a context
    plan = plan_serve(ServeOptions(model=model, device=device, max_running_requests=batch,
                                   max_total_tokens=batch * 512))
    dev = plan.device
    models = build_models(plan)
    kv = KVCache(plan.kv, dev)
    cfg = plan.cfg
    scheduler = Scheduler(kv.spec, end_of_audio=cfg.end_of_audio, max_running_requests=batch)
    runner = ModelRunner(models.talker, kv, dev)
    ids = itertools.count()

    def refill() -> None:
        while len(scheduler.requests) < batch:
            i = next(ids)
            prompt = [(i * 7 + k) % cfg.text_vocab_size for k in range(PROMPT_TOKENS)]
            scheduler.add_request(TalkerRequest(f"r{i}", prompt, 400, i, cfg.first_code_id))

    def step() -> int:
        refill()
        output = scheduler.schedule()
        codes = runner.execute(output)
        scheduler.update_from_output(output, codes)
        return len(output.scheduled)

    for _ in range(warmup):
        step()
    syncs = None
    if dev.type == "cuda":
        torch.cuda.synchronize()
        counts = []
        for _ in range(sync_steps):
            refill()  # outside the count: admission is host-only work
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    output = scheduler.schedule()
                    codes = runner.execute(output)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            scheduler.update_from_output(output, codes)
            counts.append(sum("synchroniz" in str(w.message) for w in caught))
        syncs = {"min": min(counts), "max": max(counts), "per_step": counts}
    rows = 0
    started = time.perf_counter()
    for _ in range(steps):
        rows += step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    summary = plan_summary(plan)
    memory = overhead_figures(baseline, device_memory_used(gpu), summary["weights_bytes"],
                              summary["kv_cache_bytes"])
    return {
        "device": str(dev), "model": cfg.name, "dtype": summary["dtype"], "batch": batch,
        "steps": steps, "steps_per_s": round(steps / elapsed, 1),
        "tokens_per_s": round(rows / elapsed, 1), "ms_per_step": round(elapsed / steps * 1e3, 3),
        "syncs_per_step": syncs, "weights_bytes": summary["weights_bytes"],
        "kv_cache_bytes": summary["kv_cache_bytes"], **memory,
        "planned_overhead_bytes": summary["overhead_bytes"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps(measure(args.device, args.model, args.batch, args.steps)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
