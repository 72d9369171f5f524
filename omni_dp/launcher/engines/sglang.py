"""SGLang (`python -m sglang.launch_server`, checked against sglang 0.5.22).

SGLang has no exact KV knob: `--max-total-tokens T` is only an upper bound, and the pool is
min(T, what profiling finds). Profiling gives the pool F × (memory free when the process
started) − weights, F being `--mem-fraction-static`; so a replica started while others already
hold their memory finds less, and with one F for all, later replicas get smaller pools. The pin
is therefore T plus one F large enough that even the last replica, started when the other N − 1
hold their whole footprint, profiles at least T; every replica then allocates exactly T (whole
KV pages), which /server_info reports as `max_total_num_tokens`.
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

from omni_dp.blocking_http import http_json
from omni_dp.gpus import GpuFacts
from omni_dp.launcher.engines.base import (
    NO_GPU,
    EngineSizing,
    EngineUnreadable,
    KvPlan,
    KvRequest,
    ModelFacts,
    ReplicaLaunch,
    flag_value,
    socket_safe_tmpdir,
    split_model,
)
from omni_dp.mps.attach import DeclaredProcess
from omni_dp.sizes import GiB, format_size

# Beyond weights and KV on the GPU: the scheduler's CUDA context, CUDA graphs and activations
# (sglang's own default keeps several GiB out of its static fraction for them on a large GPU).
# It also pads the fraction: what loading costs besides the weights counts against F.
# --engine-overhead replaces the estimate.
OVERHEAD_BYTES = 2 * GiB
# The largest --mem-fraction-static planned: sglang keeps (1 − F) of the memory free at its
# start for activations and CUDA graph capture, which fails with less than ~5 %.
MAX_FRACTION_MILLI = 950
# --kv-cache-dtype values whose bytes per element are known; others (fp4 recipes with scales)
# fall back to the model's dtype, an upper bound.
KV_DTYPE_BYTES = {"fp8_e5m2": 1, "fp8_e4m3": 1, "bf16": 2, "bfloat16": 2}


class SglangEngine:
    name = "sglang"
    external = True
    module = "sglang.launch_server"
    reserved_flags = MappingProxyType({
        "--host": "omni-dp launch --host (the router's; replicas listen on 127.0.0.1)",
        "--port": "omni-dp launch --base-port",
        "--max-total-tokens": "omni-dp launch --max-total-tokens",
        "--mem-fraction-static": "omni-dp launch --max-total-tokens or --kv-cache-bytes (the "
                                 "launcher derives the fraction from the replica's footprint)",
        "--base-gpu-id": "omni-dp launch --gpu", "--gpu-id-step": "omni-dp launch --gpu",
        "--device": "omni-dp launch --gpu",
        "--dp-size": "omni-dp launch --replicas",
        "--data-parallel-size": "omni-dp launch --replicas",
    })
    kv_profiled = True  # the pool depends on what was free when each replica started
    tmp_per_process = False  # its TMPDIR may hold compile caches (torch's inductor, by default)
    fixed_default_kv = False
    needs_gpu = True
    shares_weights = False
    cuda_processes_per_replica = 1  # the scheduler; the HTTP and detokenizer processes hold none
    start_timeout_s = 900.0  # weights, then CUDA graph capture and JIT kernels on a cold cache
    example = "completions"
    # token ids on streamed completions; streamed chat refuses return_token_ids (0.5.22)
    migration_paths: tuple[str, ...] = ("/v1/completions",)

    def plan_kv(self, request: KvRequest) -> tuple[KvPlan | None, list[str]]:
        """`--max-total-tokens T --mem-fraction-static F`, F sized for the last replica."""
        problems = gpu_problems(request, self.name)
        model = request.model
        if problems or model is None:  # no model: reading the model directory said why
            return None, problems
        gpu = request.gpu
        assert gpu is not None and gpu.memory_total_bytes is not None  # gpu_problems
        assert gpu.memory_used_bytes is not None
        _, rest = split_model(request.engine_args)
        per_token, notes = kv_bytes_per_token(model, rest)
        overhead = (request.overhead_bytes if request.overhead_bytes is not None
                    else OVERHEAD_BYTES)
        tokens, problems = pinned_tokens(request, per_token, notes)
        if problems:
            return None, problems
        if tokens is None:  # one replica, unpinned (the plan refuses more): sglang's own sizing
            sizing = EngineSizing(model.weights_bytes, 0, None, overhead, "cuda")
            return KvPlan((), sizing, None, notes=(
                "sglang KV unpinned: one replica sizes its pool from its default "
                "--mem-fraction-static; the allocated count is read back",)), []
        sizing = EngineSizing(model.weights_bytes, tokens * per_token, tokens, overhead, "cuda")
        milli, problems = fraction_for_last(gpu, request.replicas, sizing, per_token)
        if problems:
            return None, problems
        fraction = f"{milli / 1000:.3f}"
        free = gpu.memory_total_bytes - gpu.memory_used_bytes
        worst = free - (request.replicas - 1) * sizing.total_bytes
        notes.append(
            f"sglang KV: --max-total-tokens {tokens} --mem-fraction-static {fraction}: the last "
            f"of {request.replicas} replicas starts with {format_size(worst)} free, and "
            f"{fraction} of it covers weights {format_size(sizing.weights_bytes)} + KV "
            f"{format_size(sizing.kv_cache_bytes)} + overhead {format_size(overhead)}")
        notes.append(f"sglang rounds --max-total-tokens down to whole KV pages: with a page "
                     f"size that does not divide {tokens}, the KV check reports fewer tokens")
        args = ("--max-total-tokens", str(tokens), "--mem-fraction-static", fraction)
        return KvPlan(args, sizing, tokens, notes=tuple(notes)), []

    def argv(self, launch: ReplicaLaunch, engine_args: tuple[str, ...]) -> list[str]:
        model, rest = split_model(engine_args)
        head = [launch.python or "python3", "-m", self.module]
        if model is not None:
            head += ["--model-path", model]
        return [*head, "--host", "127.0.0.1", "--port", str(launch.port), *launch.kv_args,
                *rest]

    def environment(self, launch: ReplicaLaunch) -> dict[str, str]:
        env = {
            # /health otherwise runs a one-token generation per probe (up to 20 s when busy);
            # without it, /health is 503 until warm-up is done and 200 after (0.5.22,
            # srt/entrypoints/http_server.py; srt/environ.py reads true/false/1/0/yes/no).
            "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false",
            "HF_HUB_OFFLINE": "1",  # the pin needs a local model directory: never a hub lookup
        }
        tmp = socket_safe_tmpdir(launch.work_dir)
        if tmp is not None:
            env["TMPDIR"] = tmp
        return env

    def read_capacity(self, url: str, log: Path) -> int:
        """`max_total_num_tokens` at the top of /server_info: the pool the scheduler allocated
        (the server args inside it hold the *requested* `max_total_tokens`)."""
        status, info = http_json("GET", url + "/server_info", timeout=10.0)
        path = "/server_info"
        if status == 404:  # older sglang: only the deprecated name
            path = "/get_server_info"
            status, info = http_json("GET", url + path, timeout=10.0)
        return allocated_tokens(status, info, url + path)

    def reported_processes(self, url: str) -> list[DeclaredProcess] | None:
        return None  # sglang lists no processes: the launcher finds them by session


def gpu_problems(request: KvRequest, engine: str) -> list[str]:
    """A CUDA GPU whose memory NVML could read, or why the plan cannot size against it."""
    gpu = request.gpu
    if request.device != "cuda" or gpu is None:
        return [NO_GPU.format(engine=engine)]
    if gpu.memory_total_bytes is None:
        return [f"{gpu.label}: NVML could not read its total memory "
                f"({gpu.error('memory') or 'no reason given'}); {engine}'s KV pin is sized "
                "from it"]
    if gpu.memory_used_bytes is None:
        return [f"{gpu.label}: NVML could not read how much memory is in use; {engine}'s KV "
                "pin is sized from what is free"]
    return []


def kv_bytes_per_token(model: ModelFacts, engine_args: tuple[str, ...]) -> tuple[int, list[str]]:
    """K and V, every layer, at the KV dtype sglang will use (the model's unless
    --kv-cache-dtype says otherwise); a note when only an upper bound is known."""
    dtype = flag_value(engine_args, "--kv-cache-dtype")
    if dtype is None or dtype == "auto":
        return model.kv_bytes_per_token, []
    if dtype in KV_DTYPE_BYTES:
        return model.kv_bytes_per_token_at(KV_DTYPE_BYTES[dtype]), []
    return model.kv_bytes_per_token, [
        f"--kv-cache-dtype {dtype}: its bytes per token are not known here; the sizes assume "
        f"the model's {model.dtype}, more than it needs"]


def pinned_tokens(request: KvRequest, per_token: int,
                  notes: list[str]) -> tuple[int | None, list[str]]:
    """The token count every replica must hold: the token pin, or the whole tokens a byte pin
    buys (sglang has no byte knob); None unpinned. Appends how a byte pin was translated."""
    if request.max_total_tokens is not None:
        return request.max_total_tokens, []
    if request.kv_cache_bytes is None:
        if request.replicas > 1:
            return None, [f"--replicas {request.replicas} needs a pinned KV size for sglang: "
                          "give --max-total-tokens N or --kv-cache-bytes SIZE"]
        return None, []
    tokens = request.kv_cache_bytes // per_token
    if tokens < 1:
        return None, [f"--kv-cache-bytes {request.kv_cache_bytes} is less than one token of "
                      f"this model's KV ({per_token} bytes); pin more"]
    notes.append(f"--kv-cache-bytes {format_size(request.kv_cache_bytes)} is {tokens} tokens "
                 f"at {per_token} bytes per token: sglang pins tokens, not bytes")
    return tokens, []


def fraction_for_last(gpu: GpuFacts, replicas: int, sizing: EngineSizing,
                      per_token: int) -> tuple[int, list[str]]:
    """--mem-fraction-static in thousandths, rounded up, for the replica that starts last:
    what it must hold over what is free once the others hold theirs."""
    assert gpu.memory_total_bytes is not None and gpu.memory_used_bytes is not None
    free = gpu.memory_total_bytes - gpu.memory_used_bytes
    footprint = sizing.total_bytes
    others = (replicas - 1) * footprint
    worst = free - others
    each = (f"{format_size(footprint)} each (weights {format_size(sizing.weights_bytes)} + KV "
            f"{format_size(sizing.kv_cache_bytes)} for {sizing.kv_tokens} tokens + overhead "
            f"{format_size(sizing.overhead_bytes)})")
    hint = fit_hint(free, replicas, sizing, per_token)
    if worst <= 0:
        return 0, [f"sglang: {replicas} replicas of {each} do not fit {gpu.label}: "
                   f"{format_size(free)} is free and the other {replicas - 1} alone take "
                   f"{format_size(others)}; {hint}"]
    milli = -(-footprint * 1000 // worst)  # ceil without floats
    if milli > MAX_FRACTION_MILLI:
        return 0, [f"sglang: the last of {replicas} replicas of {each} would start with "
                   f"{format_size(worst)} free on {gpu.label} and need --mem-fraction-static "
                   f"{milli / 1000:.3f}, over {MAX_FRACTION_MILLI / 1000:.2f} (sglang keeps the "
                   f"rest for activations and CUDA graphs); {hint}"]
    return milli, []


def fit_hint(free: int, replicas: int, sizing: EngineSizing, per_token: int) -> str:
    """The largest token pin that plans for this many replicas, or that none does."""
    # F ≤ 0.95 ⇔ footprint × 1000 ≤ 950 × (free − (N − 1) × footprint)
    most = MAX_FRACTION_MILLI * free // (1000 + MAX_FRACTION_MILLI * (replicas - 1))
    tokens = (most - sizing.weights_bytes - sizing.overhead_bytes) // per_token
    if tokens >= 1:
        return (f"at most --max-total-tokens {tokens} fits {replicas} replicas, or use fewer "
                "replicas")
    return f"even without KV, {replicas} replicas' weights and overhead do not fit: use fewer"


def allocated_tokens(status: int, info: object, where: str) -> int:
    """The top-level `max_total_num_tokens` of a server-info answer, or why there is none."""
    if status != 200 or not isinstance(info, dict):
        raise EngineUnreadable(f"GET {where} answered {status or 'nothing'}"
                                 + ("" if status != 200 else " without a JSON object"))
    tokens = info.get("max_total_num_tokens")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        requested = info.get("max_total_tokens")
        raise EngineUnreadable(
            f"GET {where} has no positive whole max_total_num_tokens (got {tokens!r}"
            + (f"; max_total_tokens {requested!r} is the request, not the pool"
               if requested is not None else "") + ")")
    return tokens



def sglang_priority_order(engine_args: tuple[str, ...]) -> str | None:
    """How sglang orders a request's `priority` when it runs with --enable-priority-scheduling
    (None when it does not: then it honours none): higher values first, unless
    --schedule-low-priority-values-first (sglang/srt/managers/scheduler.py
    `_set_or_validate_priority`; the flags in srt/server_args.py)."""
    flags = {arg.split("=", 1)[0].replace("_", "-") for arg in engine_args if arg.startswith("--")}
    if "--enable-priority-scheduling" not in flags:
        return None
    return "low-first" if "--schedule-low-priority-values-first" in flags else "high-first"
