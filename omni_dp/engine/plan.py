"""`omni-dp serve` options in, a validated plan (or every problem at once) out.

Planning reads facts (is CUDA there, how much memory is free, the model directory's config) but
creates nothing: a bad command line exits 2 before a socket is bound or a byte allocated.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
import torch

from omni_dp.contract import Problems
from omni_dp.engine.config import ModelConfig, ModelConfigError, resolve_model
from omni_dp.engine.kv_cache import KVCacheSpec, KVSizingError, plan_kv_cache
from omni_dp.engine.options import DTYPE_NAMES, ServeOptions
from omni_dp.engine.placement_plan import (
    budget_check,
    kv_bytes_from_budget,
    on_device,
    plan_placement,
    process_needs,
    split_memory_problems,
    stage_weight_bytes,
    talker_process,
    tp_problems,
)
from omni_dp.engine.voice.default import resolve_default_model
from omni_dp.engine.voice.model import VoiceModel, is_voice_spec
from omni_dp.engine.voice.plan import plan_voice, voice_summary
from omni_dp.files import private_dir_problem
from omni_dp.placement.model import Placement
from omni_dp.placement.table import placement_json
from omni_dp.sizes import format_size
from omni_dp.tracing import endpoint_problem

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
# What a replica holds besides its weights and KV pool; used only to refuse a plan that cannot
# fit, never to size anything. On CPU: activations and allocator slack. On a GPU the CUDA
# context itself (~0.5 GiB on Hopper with lazy module loading), cuBLAS workspaces, activations
# and the caching allocator's slack come on top: 1 GiB, assumed until bench/engine_steps.py
# (run by bench/gpu_check.py) measures it: NVML's figure for its process, the context included
# (its baseline is read before planning makes the context), minus weights and KV.
CPU_OVERHEAD_BYTES = 256 * 1024**2
CUDA_OVERHEAD_BYTES = 1024**3


def overhead_bytes(device: torch.device) -> int:
    return CUDA_OVERHEAD_BYTES if device.type == "cuda" else CPU_OVERHEAD_BYTES


def _overhead_of(device: str) -> int:
    """overhead_bytes of a placement's device string (cpu, cuda:N)."""
    return overhead_bytes(torch.device(device))


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16": the names of DTYPES (and of --dtype)."""
    return str(dtype).removeprefix("torch.")


class ServePlanError(Problems):
    """Every problem of a serve command line; nothing was started."""


@dataclass(frozen=True)
class WeightSizes:
    """A plan's models, by their shapes and dtypes, and what its share policy makes of them."""

    weights_bytes: int  # every parameter, in the dtype the replica holds it
    shared_bytes: int  # the tensors the share policy shares; 0 where no policy fits
    share_problem: str | None  # why this model cannot share (no policy, or one that misfits)


@dataclass(frozen=True)
class ServePlan:
    options: ServeOptions
    cfg: ModelConfig
    model_dir: str | None
    device: torch.device
    dtype: torch.dtype
    threads: int
    kv: KVCacheSpec
    served_model_name: str
    # Sharing (--share-weights): the sizes of cfg and dtype that planning computed to check the
    # policy; the dry run's summary reuses them rather than building the meta models again.
    weights: WeightSizes | None = None
    # The stages on processes and devices (omni_dp/placement); None only in plans built by
    # hand in tests, which run form ① (every stage in this process).
    placement: Placement | None = None
    # A Piper voice (engine/voice/): then `cfg` is None, `kv` holds no page and `dtype` is the
    # graph's float32; the talker's fields above do not apply.
    voice: VoiceModel | None = None

    @property
    def sample_rate(self) -> int:
        return self.voice.sample_rate if self.voice is not None else self.cfg.sample_rate

    @property
    def model_name(self) -> str:
        return self.voice.name if self.voice is not None else self.cfg.name


def weight_sizes(cfg: ModelConfig, dtype: torch.dtype) -> WeightSizes:
    """Shapes only, nothing allocated (the meta device); the dtypes as build_models holds them
    (weights.place); split by the architecture's share policy."""
    from omni_dp.engine.config import ARCHITECTURE
    from omni_dp.engine.share.policy import PolicyError, policy_for
    from omni_dp.engine.share.tensors import named_tensors
    from omni_dp.engine.weights import meta_models

    models = meta_models(cfg, dtype)
    weights_bytes = sum(p.numel() * p.element_size()
                        for module in (models.talker, models.vocoder) for p in module.parameters())
    tensors = named_tensors(models)
    try:
        shared, _ = policy_for(ARCHITECTURE).split(tensors)
    except PolicyError as exc:  # no policy, or one that does not fit: nothing is shared
        return WeightSizes(weights_bytes, 0, str(exc))
    return WeightSizes(weights_bytes,
                       sum(tensors[n].numel() * tensors[n].element_size() for n in shared), None)


def plan_summary(plan: ServePlan) -> dict:
    """What `serve --dry-run --json` prints: the numbers a launcher needs before starting."""
    if plan.voice is not None:
        return voice_summary(plan, _overhead_of)
    sizes = plan.weights or weight_sizes(plan.cfg, plan.dtype)
    weights_bytes, shared_bytes = sizes.weights_bytes, sizes.shared_bytes
    # One overhead per OS process on the replica's device (a CUDA context each on a GPU):
    # what a split costs there. A CPU process of a GPU replica holds host memory, not the
    # GPU's that the launcher fits this figure into.
    overhead = (sum(_overhead_of(p.device) for p in on_device(plan.placement, plan.device))
                if plan.placement else overhead_bytes(plan.device))
    summary = {
        "model": plan.cfg.name,
        # a preset's weights are drawn from a seed (a test vehicle: its audio is noise); a
        # model directory's are loaded (trained, or saved presets)
        "weights": "loaded" if plan.model_dir else "seeded",
        "device": str(plan.device),
        "dtype": dtype_name(plan.dtype),
        "threads": plan.threads,
        "weights_bytes": weights_bytes,
        "max_total_num_tokens": plan.kv.max_total_tokens,
        "kv_cache_bytes": plan.kv.cache_bytes,
        "kv_bytes_per_token": plan.kv.bytes_per_token,
        "page_size": plan.kv.page_size,
        "overhead_bytes": overhead,
        "share_weights": plan.options.share_weights,
        # What --share-weights would hold once for the whole run, and per replica.
        "shared_weights_bytes": shared_bytes,
        "private_weights_bytes": weights_bytes - shared_bytes,
    }
    if plan.placement is not None:
        summary["placement"] = placement_json(plan.placement)
    return summary


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def plan_serve(options: ServeOptions) -> ServePlan:
    """The replica's plan from its options, or ServePlanError with every problem at once."""
    problems: list[str] = []
    options = replace(options, model=resolve_default_model(options.model)[0])
    if is_voice_spec(options.model):
        device = _resolve_device(options.device, problems)
        threads = options.threads if options.threads is not None else available_cpus()
        problems += _limit_problems(options, threads)
        plan = plan_voice(options, device, threads, problems, _overhead_of)
        if problems or plan is None:
            raise ServePlanError(problems)
        return ServePlan(**plan)
    cfg: ModelConfig | None = None
    model_dir = None
    try:
        cfg, path = resolve_model(options.model)
        model_dir = str(path) if path else None
    except ModelConfigError as exc:
        problems.append(str(exc))
    device = _resolve_device(options.device, problems)
    dtype = _resolve_dtype(options.dtype, device, problems)
    threads = options.threads if options.threads is not None else available_cpus()
    problems += _limit_problems(options, threads)
    weights = _check_share(options, cfg, device, dtype, problems)
    placement = plan_placement(options, device, problems) if device is not None else None
    if placement is not None and cfg is not None:
        problems += tp_problems(placement, cfg)
    kv = _plan_kv(options, cfg, dtype, placement, problems) \
        if cfg is not None and dtype is not None else None
    if kv is not None and device is not None:
        problems += _fit_problems(kv, device, placement, cfg, dtype)
    if problems:
        raise ServePlanError(problems)
    assert cfg is not None and kv is not None and device is not None and dtype is not None
    return ServePlan(
        options=options, cfg=cfg, model_dir=model_dir, device=device, dtype=dtype,
        threads=threads, kv=kv,
        served_model_name=options.served_model_name or f"omni-dp-{cfg.name}", weights=weights,
        placement=placement,
    )


def _limit_problems(options: ServeOptions, threads: int) -> list[str]:
    """The counts, the drain timeout and the port: each a number in its range."""
    problems = []
    if threads < 1:
        problems.append(f"--threads must be at least 1, got {threads}")
    for name in ("max_running_requests", "max_input_chars", "max_body_bytes"):
        if getattr(options, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be at least 1")
    if options.max_queued_requests < 0:
        problems.append("--max-queued-requests must not be negative")
    if options.priority_share_every < 2:
        problems.append(f"--priority-share-every must be at least 2 (1 would put bulk first), "
                        f"got {options.priority_share_every}")
    for name in ("voice_lookahead", "voice_first_piece_chars"):
        if getattr(options, name) < 0:
            problems.append(f"--{name.replace('_', '-')} must not be negative")
    if not math.isfinite(options.drain_timeout):  # nan passes `< 0`, then breaks the drain
        problems.append(f"--drain-timeout must be a finite number, got "
                        f"{options.drain_timeout}")
    elif options.drain_timeout < 0:
        problems.append("--drain-timeout must not be negative")
    if not 0 <= options.port <= 65535:
        problems.append(f"--port must be 0-65535, got {options.port}")
    if (endpoint := endpoint_problem(options.otlp_traces_endpoint)) is not None:
        problems.append(endpoint)
    return problems


def _plan_kv(options: ServeOptions, cfg: ModelConfig, dtype: torch.dtype,
             placement: Placement | None, problems: list[str]) -> KVCacheSpec | None:
    """The KV pool: the size asked for, or (a placement with budgets and no KV knob) what the
    talker's budget leaves after its weights and overhead; checked against the budgets."""
    stage_bytes = stage_weight_bytes(cfg, dtype)
    kv_cache_bytes = options.kv_cache_bytes
    if placement is not None and kv_cache_bytes is None and options.max_total_tokens is None:
        kv_cache_bytes = kv_bytes_from_budget(placement, stage_bytes, _overhead_of)
        page = (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
                * options.page_size)
        if kv_cache_bytes is not None and kv_cache_bytes < page:
            problems.append(
                f"the talker's budget ({format_size(talker_process(placement).budget_bytes)})"
                " leaves no room for one KV page after its weights and overhead; raise "
                "--talker.gpu_memory_fraction")
            return None
    try:
        kv = plan_kv_cache(
            num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, dtype=dtype, page_size=options.page_size,
            kv_cache_bytes=kv_cache_bytes, max_total_tokens=options.max_total_tokens,
        )
    except KVSizingError as exc:
        problems.append(str(exc))
        return None
    if placement is not None:
        problems += budget_check(placement, stage_bytes, kv.cache_bytes, _overhead_of)
    return kv


def _fit_problems(kv: KVCacheSpec, device: torch.device, placement: Placement | None,
                  cfg: ModelConfig | None, dtype: torch.dtype | None) -> list[str]:
    """Whether the pool (one process) or each process's share (a split replica) fits."""
    if placement is None or placement.is_single_process:
        problems: list[str] = []
        _check_memory(kv, device, problems)
        return problems
    assert cfg is not None and dtype is not None
    needs = process_needs(placement, stage_weight_bytes(cfg, dtype), kv.cache_bytes,
                          _overhead_of)
    return split_memory_problems(placement, needs,
                                 "lower --kv-cache-bytes or --max-total-tokens, or move "
                                 "a stage")


def _check_share(options: ServeOptions, cfg: ModelConfig | None, device: torch.device | None,
                 dtype: torch.dtype | None, problems: list[str]) -> WeightSizes | None:
    """--share-weights and --share-dir go together; the directory is private if it exists
    (the leader creates it); a CUDA leader's allocator can export IPC handles (read from the
    environment: no GPU touched); the architecture has a share policy that fits the model.
    Returns the sizes it computed for that last check, if it got that far."""
    role, directory = options.share_weights, options.share_dir
    if role is None and directory is None:
        return None
    if role == "leader" and device is not None and device.type == "cuda":
        from omni_dp.engine.share.cuda_ipc import exportable_problem

        problem = exportable_problem()
        if problem:
            problems.append(f"--share-weights leader: {problem}")
    if role is None:
        problems.append("--share-dir needs --share-weights leader|follower")
    if directory is None:
        problems.append(f"--share-weights {role} needs --share-dir DIR (where the leader "
                        "publishes its weights and the followers read them)")
    else:
        problem = private_dir_problem(Path(directory))
        if problem:
            problems.append(f"--share-dir: {problem}")
    if role is None or cfg is None or dtype is None:
        return None
    sizes = weight_sizes(cfg, dtype)
    if sizes.share_problem:
        problems.append(sizes.share_problem)
    return sizes


def _resolve_device(name: str, problems: list[str]) -> torch.device | None:
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        problems.append(f"--device {name!r} is not a device; use auto, cpu, cuda or cuda:N")
        return None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            problems.append(
                f"--device {name}: CUDA is not available here (no GPU, no driver, or a CPU-only "
                "torch build); use --device cpu"
            )
            return None
        index = device.index or 0
        if index >= torch.cuda.device_count():
            problems.append(f"--device {name}: only {torch.cuda.device_count()} GPU(s) visible")
            return None
        return torch.device("cuda", index)
    if device.type != "cpu":
        problems.append(f"--device {name!r} is not supported; use auto, cpu, cuda or cuda:N")
        return None
    return device


def _resolve_dtype(
    name: str, device: torch.device | None, problems: list[str]
) -> torch.dtype | None:
    if name == "auto":
        # float64 on CPU: batch composition then changes logits by ~1e-13 instead of ~1e-5,
        # so a request's samples do not depend on what it was batched with.
        if device is None or device.type == "cpu":
            return torch.float64
        return torch.bfloat16
    if name not in DTYPES:
        problems.append(f"--dtype {name!r} is not supported; use auto, {', '.join(DTYPES)}")
        return None
    return DTYPES[name]


def _check_memory(kv: KVCacheSpec, device: torch.device, problems: list[str]) -> None:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        where = f"free memory on {device}"
    else:
        free = psutil.virtual_memory().available
        where = "available host memory"
    overhead = overhead_bytes(device)
    if kv.cache_bytes + overhead > free:
        problems.append(
            f"the KV pool needs {format_size(kv.cache_bytes)} (+{format_size(overhead)} "
            f"overhead) but {where} is {format_size(free)}; lower --kv-cache-bytes or "
            "--max-total-tokens"
        )
