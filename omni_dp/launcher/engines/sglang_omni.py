"""sglang-omni (`python -m sglang_omni.cli serve`, checked against sglang-omni 0.1.9, which runs
sglang 0.5.22 inside its engine stages).

A pipeline is several stage processes; one engine stage holds the KV cache (its name is the
model's: `tts_engine` for Higgs TTS, --engine-stage). Its KV is pinned with that stage's dotted
overrides: `engine.kv_cache_bytes` is authoritative (the pool is those bytes, whatever is free;
the engine derives the token count), `engine.max_total_tokens` only an upper bound. No HTTP
endpoint reports the pool, so it is read from the replica's log, where the engine stage logs
sglang's allocation line. sglang-omni's own MPS handling stays off: the run's daemon serves it.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import MappingProxyType

from omni_dp.launcher.engines.base import (
    NO_GPU,
    EngineSizing,
    KvPlan,
    KvRequest,
    ReplicaLaunch,
    socket_safe_tmpdir,
    split_model,
)
from omni_dp.launcher.engines.readback import COUNT, kv_tokens_from_log
from omni_dp.mps.attach import DeclaredProcess
from omni_dp.sizes import GiB, format_size

# The KV stage's engine fields the launcher sets (`--<stage>.engine.<field>`).
KV_FIELDS = ("kv_cache_bytes", "max_total_tokens", "mem_fraction_static")
# Beyond the model's weights and KV on the GPU: a CUDA context per stage process (four for
# Higgs: preprocessing, audio encoder, TTS engine, vocoder), the audio models' activations and
# the engine's CUDA graphs. --engine-overhead replaces the estimate.
OVERHEAD_BYTES = 4 * GiB
# sglang 0.5.22, srt/mem_cache/memory_pool.py: `KV Cache is allocated. dtype: …, #tokens: N,
# …` (labelled pools of hybrid models log `Full KV Cache …` / `SWA KV Cache …`: not the
# count). With SGLANG_ENABLE_POST_CAPTURE_KV_SIZING on, that line reads `VA upper bound`
# instead, and srt/model_executor/model_runner_components/kv_pool_runtime.py logs the pool
# after CUDA graph capture: `Post-capture KV sizing: KV cache allocated. dtype: …, #tokens: N`.
ALLOCATED = re.compile(r"(?<!Full )(?<!SWA )KV Cache is allocated\. .*?#tokens: " + COUNT)
POST_CAPTURE = re.compile(r"Post-capture KV sizing: KV cache allocated\. .*?#tokens: " + COUNT)
KV_LINE = "`KV Cache is allocated. … #tokens: N`"


DEFAULT_ENGINE_STAGE = "tts_engine"  # sglang-omni's KV stage in Higgs TTS's pipeline

class SglangOmniEngine:
    name = "sglang-omni"
    external = True
    module = "sglang_omni.cli"
    reserved_flags = MappingProxyType({
        "--host": "omni-dp launch --host (the router's; replicas listen on 127.0.0.1)",
        "--port": "omni-dp launch --base-port",
        "--mps": "omni-dp launch --mps (the run's own MPS daemon serves every replica; "
                 "sglang-omni's must stay off)",
    })
    kv_profiled = True  # unpinned, each engine stage sizes its KV from what is free
    tmp_per_process = False  # its TMPDIR may hold compile caches (torch's inductor, by default)
    fixed_default_kv = False
    needs_gpu = True
    shares_weights = False
    cuda_processes_per_replica = 4  # one per GPU stage process; an upper estimate for Higgs
    start_timeout_s = 1200.0  # loading, CUDA graphs, then warm-up (SGLANG_OMNI_WARMUP_TIMEOUT)
    example = "speech"
    # speech and omni answers: no token stream to migrate
    migration_paths: tuple[str, ...] = ()

    def plan_kv(self, request: KvRequest) -> tuple[KvPlan | None, list[str]]:
        """The KV stage's `engine.kv_cache_bytes` (with its `mem_fraction_static` cleared:
        the engine refuses both) or `engine.max_total_tokens`."""
        stage = request.engine_stage or DEFAULT_ENGINE_STAGE
        problems = stage_flag_problems(stage, request.engine_args)
        if request.device != "cuda" or request.gpu is None:
            problems.append(NO_GPU.format(engine=self.name))
        model = request.model
        if problems or model is None:  # no model: reading the model directory said why
            return None, problems
        overhead = (request.overhead_bytes if request.overhead_bytes is not None
                    else OVERHEAD_BYTES)
        field = f"--{stage}.engine."
        if request.kv_cache_bytes is not None:
            kv_bytes = request.kv_cache_bytes
            sizing = EngineSizing(model.weights_bytes, kv_bytes, None, overhead, "cuda")
            return KvPlan(
                (field + "kv_cache_bytes", str(kv_bytes), field + "mem_fraction_static", "null"),
                sizing, None, notes=(
                    f"sglang-omni KV: stage {stage} holds {format_size(kv_bytes)} of KV, "
                    "whatever is free; the engine derives the token count from it, read from "
                    "each replica's log and compared across replicas",)), []
        tokens = request.max_total_tokens
        if tokens is None:
            if request.replicas > 1:
                return None, [f"--replicas {request.replicas} needs a pinned KV size for "
                              "sglang-omni: give --kv-cache-bytes SIZE or --max-total-tokens N"]
            sizing = EngineSizing(model.weights_bytes, 0, None, overhead, "cuda")
            return KvPlan((), sizing, None, notes=(
                f"sglang-omni KV unpinned: stage {stage} sizes its own pool; the allocated count "
                "is read back",)), []
        # The token knob is only a cap (whole pages, and no more than the stage profiles at
        # its start, which depends on what the other replicas already hold): N replicas would
        # differ. The byte knob is authoritative, so a token pin is written as its bytes.
        kv_bytes = tokens * model.kv_bytes_per_token
        sizing = EngineSizing(model.weights_bytes, kv_bytes, None, overhead, "cuda")
        return KvPlan(
            (field + "kv_cache_bytes", str(kv_bytes), field + "mem_fraction_static", "null"),
            sizing, None, notes=(
                f"sglang-omni KV: {tokens} tokens × {model.kv_bytes_per_token} bytes = "
                f"{format_size(kv_bytes)} for stage {stage}, pinned by bytes (its token cap "
                "is an upper bound that later replicas may not reach); the engine derives the "
                "count from the bytes, read from each replica's log and compared",)), []

    def argv(self, launch: ReplicaLaunch, engine_args: tuple[str, ...]) -> list[str]:
        model, rest = split_model(engine_args)
        head = [launch.python or "python3", "-m", self.module, "serve"]
        if model is not None:
            head += ["--model-path", model]
        return [*head, "--host", "127.0.0.1", "--port", str(launch.port), "--mps", "off",
                *launch.kv_args, *rest]

    def environment(self, launch: ReplicaLaunch) -> dict[str, str]:
        env = {
            # A busy port otherwise falls back to a random one, and the replica serves where
            # no one looks (0.1.9, serve/launcher.py: find_available_port).
            "SGLANG_OMNI_STRICT_PORT": "1",
            # Otherwise each GPU stage narrows its affinity to the GPU-local CPUs, overriding
            # the replica's CPU block (0.1.9, utils/cpu.py: gpu_local_affinity).
            "SGLANG_OMNI_BIND_GPU_LOCAL_CPUS": "0",
        }
        tmp = socket_safe_tmpdir(launch.work_dir)
        if tmp is not None:
            env["TMPDIR"] = tmp
        return env

    def read_capacity(self, url: str, log: Path) -> int:
        """The engine stage's KV line in the replica's latest start (no endpoint reports it)."""
        return kv_tokens_from_log(log, (ALLOCATED, POST_CAPTURE), KV_LINE)

    def reported_processes(self, url: str) -> list[DeclaredProcess] | None:
        return None  # the stage processes are found by session


def stage_flag_problems(stage: str, engine_args: tuple[str, ...]) -> list[str]:
    """The KV stage's engine fields among the user's arguments: they would fight the pin
    (reserved per stage, so not in the static reserved_flags)."""
    taken = {f"--{stage}.engine.{name}" for name in KV_FIELDS}
    problems = []
    for arg in engine_args:
        flag = arg.split("=", 1)[0]
        if flag in taken:
            problems.append(f"engine argument {flag} is set by the launcher for the KV stage "
                            f"{stage} of every replica; use omni-dp launch --kv-cache-bytes or "
                            "--max-total-tokens instead")
    return problems
