"""Talker steps per second, and host↔device syncs per step, measured in process (no server).

A full batch of decoding requests is kept running (a finished request is replaced at once), so
every timed step is the same shape: what a saturated replica's step loop does. On CUDA the
synchronising operations of each step are counted with torch's sync debug mode: the step
should have exactly one (reading the sampled codes back). On CPU there is nothing to count.

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

import torch

from omni_dp.engine.kv_cache import KVCache
from omni_dp.engine.plan import ServeOptions, plan_serve, plan_summary
from omni_dp.engine.runner import ModelRunner
from omni_dp.engine.scheduler import Scheduler, TalkerRequest
from omni_dp.engine.server import build_models

PROMPT_TOKENS = 24  # a short sentence's bytes plus the speaker and control tokens


def device_memory_used(device: torch.device) -> int | None:
    """What the whole device has in use (NVML), or None off a GPU / without NVML."""
    if device.type != "cuda":
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            uuid = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            handle = (pynvml.nvmlDeviceGetHandleByUUID(uuid) if uuid.startswith("GPU-")
                      else pynvml.nvmlDeviceGetHandleByIndex(device.index or 0))
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def measure(device: str, model: str, batch: int, steps: int, warmup: int = 20,
            sync_steps: int = 10) -> dict:
    plan = plan_serve(ServeOptions(model=model, device=device, max_running_requests=batch,
                                   max_total_tokens=batch * 512))
    dev = plan.device
    baseline = device_memory_used(dev)  # before this process makes a CUDA context
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
    used = device_memory_used(dev)
    overhead = None
    if used is not None and baseline is not None:
        overhead = used - baseline - summary["weights_bytes"] - summary["kv_cache_bytes"]
    return {
        "device": str(dev), "model": cfg.name, "dtype": summary["dtype"], "batch": batch,
        "steps": steps, "steps_per_s": round(steps / elapsed, 1),
        "tokens_per_s": round(rows / elapsed, 1), "ms_per_step": round(elapsed / steps * 1e3, 3),
        "syncs_per_step": syncs,
        "device_memory_bytes": None if used is None or baseline is None else used - baseline,
        "measured_overhead_bytes": overhead, "planned_overhead_bytes": summary["overhead_bytes"],
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
