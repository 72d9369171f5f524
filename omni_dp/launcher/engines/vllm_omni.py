"""vllm-omni (`python -m vllm_omni.entrypoints.cli.main serve MODEL --omni`, checked against
vllm-omni 0.30.0, which runs vLLM 0.30 engines inside its stages).

A replica is a pipeline of stage processes (Qwen3-TTS: a talker, then a codec decoder), each a
vLLM engine that takes `gpu_memory_utilization` of the WHOLE GPU from the deploy config
(`--deploy-config FILE`, vllm_omni/deploy/*.yaml): two stages at 0.3 each hold 60 % of any GPU,
whatever the model's size (vllm-omni #2318). omni-dp reads that file to size each replica. The
KV stage (stage 0, or --engine-stage N) is pinned by bytes through `--stage-overrides`:
`kv_cache_memory_bytes` (vLLM's authoritative KV size; it derives the token count) and a
`gpu_memory_utilization` no larger than the stage's own footprint (vLLM refuses to start unless
that fraction of the GPU is free). The other stages keep their fractions: omni-dp cannot tell
from outside which of them hold a KV cache, so each is counted whole in the replica's footprint.
No endpoint reports the pools: vLLM's `GPU KV cache size: N tokens` lines are read from the
replica's log, one per stage that has a KV cache.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from omni_dp.launcher.engines.base import (
    NO_GPU,
    EngineSizing,
    EngineUnreadable,
    KvPlan,
    KvRequest,
    ReplicaLaunch,
    flag_value,
    socket_safe_tmpdir,
    split_model,
)
from omni_dp.launcher.engines.builtin import absolute_paths as _absolute_paths
from omni_dp.launcher.engines.readback import COUNT, read_tail, since_last_start
from omni_dp.launcher.engines.vllm import VllmEngine
from omni_dp.launcher.engines.vllm_omni_deploy import (
    StageMemory,
    read_deploy_stages,
    stage_overrides,
)
from omni_dp.mps.attach import DeclaredProcess
from omni_dp.sizes import GiB, format_size

# Beyond the KV stage's weights and KV: its CUDA context, activations and CUDA graphs.
# --engine-overhead replaces the estimate.
OVERHEAD_BYTES = 2 * GiB
# The stage fields the launcher sets for the KV stage (through --stage-overrides).
KV_FIELDS = ("kv_cache_memory_bytes", "gpu_memory_utilization", "num_gpu_blocks_override")
# vLLM 0.30, v1/core/kv_cache_utils.py `update_kv_cache_capacity`: logged once per stage engine.
KV_SIZE = re.compile(r"GPU KV cache size: " + COUNT + r" tokens")
KV_LINE = "`GPU KV cache size: N tokens`"
ENTRY = "vllm_omni.entrypoints.cli.main"  # the `vllm-omni` console script's module
DEFAULT_STAGE_NAME = "tts_engine"  # --engine-stage's default (sglang-omni's): stage 0 here


class VllmOmniEngine:
    name = "vllm-omni"
    external = True
    module = ENTRY
    reserved_flags = MappingProxyType({
        "--host": "omni-dp launch --host (the router's; replicas listen on 127.0.0.1)",
        "--port": "omni-dp launch --base-port",
        # vLLM's global memory flags apply to every stage and would undo the stage pin
        "--gpu-memory-utilization": "omni-dp launch --kv-cache-bytes or --max-total-tokens "
                                    "(other stages: --stage-overrides after --)",
        "--kv-cache-memory-bytes": "omni-dp launch --kv-cache-bytes",
        "--num-gpu-blocks-override": "omni-dp launch --max-total-tokens",
        "--api-server-count": "omni-dp launch --replicas",
        "--headless": "omni-dp launch (one head per replica)",
        "--stage-id": "omni-dp launch (a replica is the whole pipeline)",
        "--data-parallel-size": "omni-dp launch --replicas",
        "-dp": "omni-dp launch --replicas",
    })
    kv_profiled = True  # an unpinned stage sizes its KV from its fraction of the GPU
    tmp_per_process = True  # as vLLM's: caches are pointed into the work dir (environment)
    fixed_default_kv = False
    needs_gpu = True  # vllm-omni 0.30.0 runs only on CUDA (its CPU pull request is open)
    shares_weights = False
    cuda_processes_per_replica = 2  # one per GPU stage; Qwen3-TTS's two (the plan counts)
    start_timeout_s = 1200.0  # every stage loads, profiles and captures CUDA graphs in turn
    example = "speech"
    migration_paths: tuple[str, ...] = ()  # speech answers: no token stream to migrate

    def plan_kv(self, request: KvRequest) -> tuple[KvPlan | None, list[str]]:
        """The KV stage pinned by bytes in --stage-overrides; every stage sized from the
        deploy config as the launcher's fit check needs it."""
        read, problems = _read_stages(request)
        model = request.model
        if read is None or problems or model is None or request.gpu is None:
            return None, problems
        if request.kv_cache_bytes is None and request.max_total_tokens is None:
            return _unpinned(request, read)
        return _pinned(request, read)

    def argv(self, launch: ReplicaLaunch, engine_args: tuple[str, ...]) -> list[str]:
        model, rest = split_model(engine_args)
        if any(arg == "--stage-overrides" for arg in launch.kv_args):
            rest = without_flag(rest, "--stage-overrides")  # merged into the plan's
        return [launch.python or "python3", "-m", self.module, "serve", model or "", "--omni",
                "--host", "127.0.0.1", "--port", str(launch.port), *launch.kv_args,
                *absolute_paths(rest)]

    def environment(self, launch: ReplicaLaunch) -> dict[str, str]:
        env = VllmEngine().environment(launch)  # its stages are vLLM engines
        env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        tmp = socket_safe_tmpdir(launch.work_dir)
        if tmp is not None:
            env["TMPDIR"] = tmp
        return env

    def read_capacity(self, url: str, log: Path) -> int:
        """The KV tokens of every stage that has a KV cache, summed, in the latest start."""
        return stage_kv_tokens(log)

    def reported_processes(self, url: str) -> list[DeclaredProcess] | None:
        return None  # the stage processes are found by session


# vllm-omni's flags whose value is a file: the replica runs in a working directory of its own,
# so they are made absolute (the preflight read them where the launch was given).
PATH_FLAGS = ("--deploy-config", "--strategy-config", "--forced-aligner-config")


def absolute_paths(args: tuple[str, ...]) -> list[str]:
    return _absolute_paths(args, PATH_FLAGS)


def kv_stage_id(given: str | None) -> tuple[int | None, list[str]]:
    if given in (None, DEFAULT_STAGE_NAME):
        return 0, []
    if given.isdigit():
        return int(given), []
    return None, [f"--engine-stage {given!r}: vllm-omni's stages are numbered by stage_id; "
                  "give the KV stage's number (0 for Qwen3-TTS's talker)"]


def stage_problems(stages: tuple[StageMemory, ...], kv_stage: int,
                   overrides: dict[str, dict]) -> list[str]:
    problems = []
    if kv_stage not in {s.stage_id for s in stages}:
        problems.append(f"--engine-stage {kv_stage}: the deploy config has stages "
                        f"{[s.stage_id for s in stages]}")
    for s in stages:
        if s.devices not in (None, "0"):
            problems.append(f"stage {s.stage_id} is on devices {s.devices!r}: a replica runs on "
                            "one GPU (its CUDA_VISIBLE_DEVICES); set devices \"0\"")
        if s.tensor_parallel_size != 1:
            problems.append(f"stage {s.stage_id} has tensor_parallel_size "
                            f"{s.tensor_parallel_size}: omni-dp runs one GPU per replica")
        if s.fraction is None and s.stage_id != kv_stage:
            problems.append(f"stage {s.stage_id} has no gpu_memory_utilization: vLLM's default "
                            "would take 90 % of the GPU; set it in the deploy config or by "
                            "--stage-overrides after --")
    for name in KV_FIELDS:
        if name in overrides.get(str(kv_stage), {}):
            problems.append(f"--stage-overrides sets {name} for the KV stage {kv_stage}: the "
                            "launcher sets it for every replica; use omni-dp launch "
                            "--kv-cache-bytes or --max-total-tokens instead")
    return problems


def fraction_bytes(stage: StageMemory, total: int) -> int:
    return math.ceil((stage.fraction or 0.0) * total)


def stage_processes(stages: tuple[StageMemory, ...]) -> tuple[tuple[str, str], ...]:
    """One CUDA process per stage (a vLLM engine core with its worker in it, TP 1)."""
    return tuple((f"stage-{s.stage_id}", "cuda") for s in stages)


def overrides_args(overrides: dict[str, dict]) -> tuple[str, ...]:
    if not overrides:
        return ()
    return ("--stage-overrides", json.dumps(overrides, sort_keys=True, separators=(",", ":")))


def without_flag(args: tuple[str, ...], flag: str) -> tuple[str, ...]:
    """The arguments without `flag` and its value (`--flag V` or `--flag=V`)."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        name, eq, _ = arg.partition("=")
        if name.replace("_", "-") == flag:
            skip = not eq
            continue
        out.append(arg)
    return tuple(out)


def stage_kv_tokens(log: Path) -> int:
    """Sum of the `GPU KV cache size: N tokens` lines after the latest start banner."""
    try:
        lines = since_last_start(read_tail(log))
    except OSError as exc:
        raise EngineUnreadable(f"the replica's log {log} cannot be read: {exc}") from None
    counts = [int(m.group(1).replace(",", "")) for line in lines
              if (m := KV_SIZE.search(line))]
    if not counts:
        raise EngineUnreadable(f"{log}: no {KV_LINE} line since the replica's latest start")
    return sum(counts)


@dataclass(frozen=True)
class _Stages:
    """What a request's deploy config and flags say, read before any sizing."""

    stages: list[StageMemory]
    overrides: dict[str, dict]
    kv_stage: int


def _read_stages(request: KvRequest) -> tuple[_Stages | None, list[str]]:
    """The deploy config's stages with --stage-overrides over them, and the KV stage; every
    problem with them (or None and the problems)."""
    problems: list[str] = []
    if request.device != "cuda" or request.gpu is None:
        problems.append(NO_GPU.format(engine=VllmOmniEngine.name))
    overrides, found = stage_overrides(request.engine_args)
    problems += found
    kv_stage, found = kv_stage_id(request.engine_stage)
    problems += found
    deploy = flag_value(request.engine_args, "--deploy-config")
    if deploy is None:
        problems.append("engine vllm-omni: give the deploy config after --: "
                        "--deploy-config FILE (vllm-omni's own are in its package, "
                        "vllm_omni/deploy/<model>.yaml); omni-dp sizes each replica from "
                        "its stages' gpu_memory_utilization")
        return None, problems
    stages, found = read_deploy_stages(deploy, overrides)
    problems += found
    if stages and kv_stage is not None:
        problems += stage_problems(stages, kv_stage, overrides)
    if kv_stage is None:
        return None, problems
    return _Stages(stages, overrides, kv_stage), problems


def _unpinned(request: KvRequest, read: _Stages) -> tuple[KvPlan | None, list[str]]:
    """One replica with every stage at its own fraction of the GPU (no pin asked for)."""
    model, total = request.model, request.gpu.memory_total_bytes
    if request.replicas > 1:
        return None, [f"--replicas {request.replicas} needs a pinned KV size for "
                      "vllm-omni: give --kv-cache-bytes SIZE or --max-total-tokens N "
                      f"(unpinned, stage {read.kv_stage} takes its whole fraction)"]
    unset = [s.stage_id for s in read.stages if s.fraction is None]
    if unset:
        return None, [f"stage(s) {unset} have no gpu_memory_utilization: vLLM's "
                      "default would take 90 % of the GPU; set it in the deploy "
                      "config, or pin the KV stage by --kv-cache-bytes"]
    stage_bytes = sum(fraction_bytes(s, total) for s in read.stages)
    sizing = EngineSizing(model.weights_bytes, 0, None,
                          max(stage_bytes - model.weights_bytes, 0), "cuda",
                          processes=stage_processes(read.stages))
    return KvPlan(overrides_args(read.overrides), sizing, None, notes=(
        "vllm-omni unpinned: every stage takes its gpu_memory_utilization of the GPU, "
        f"{format_size(stage_bytes)} in all; the KV counts are read back",)), []


def _kv_pin(request: KvRequest) -> tuple[int, str]:
    """The KV stage's bytes, and how they were given (for the plan's note)."""
    model = request.model
    if request.kv_cache_bytes is not None:
        return request.kv_cache_bytes, format_size(request.kv_cache_bytes)
    tokens = request.max_total_tokens or 0
    kv_bytes = tokens * model.kv_bytes_per_token
    return kv_bytes, (f"{tokens} tokens × {model.kv_bytes_per_token} bytes = "
                      f"{format_size(kv_bytes)}, pinned by bytes")


def _pinned(request: KvRequest, read: _Stages) -> tuple[KvPlan | None, list[str]]:
    """The KV stage pinned by bytes, its fraction lowered to its own footprint; the other
    stages counted whole, as the deploy config and any --stage-overrides say."""
    model, total, kv_stage = request.model, request.gpu.memory_total_bytes, read.kv_stage
    kv_bytes, how = _kv_pin(request)
    length = next(s.max_model_len for s in read.stages if s.stage_id == kv_stage)
    if length is not None and kv_bytes // model.kv_bytes_per_token <= length:
        return None, [f"the KV pin holds {kv_bytes // model.kv_bytes_per_token} tokens, "
                      f"not more than one request of stage {kv_stage}'s max_model_len "
                      f"({length}): vLLM would refuse to start (it keeps one block of the "
                      f"pool as its null block); pin more than {length} tokens or lower "
                      "max_model_len by --stage-overrides after --"]
    overhead = request.overhead_bytes if request.overhead_bytes is not None else OVERHEAD_BYTES
    own = model.weights_bytes + kv_bytes + overhead
    fraction = math.ceil(1000 * own / total) / 1000
    if fraction > 1:
        return None, [f"stage {kv_stage} of one vllm-omni replica needs "
                      f"{format_size(own)}, more than the GPU has"]
    overrides = read.overrides
    pinned = {**overrides, str(kv_stage): {**overrides.get(str(kv_stage), {}),
                                           "kv_cache_memory_bytes": kv_bytes,
                                           "gpu_memory_utilization": fraction}}
    others = [s for s in read.stages if s.stage_id != kv_stage]
    sizing = EngineSizing(model.weights_bytes, kv_bytes, None,
                          overhead + sum(fraction_bytes(s, total) for s in others), "cuda",
                          processes=stage_processes(read.stages))
    notes = [f"vllm-omni KV: stage {kv_stage} holds {how} (kv_cache_memory_bytes), its "
             f"gpu_memory_utilization lowered to {fraction:.3f} (its own weights, KV and "
             "overhead); vLLM derives the token count, read from each replica's log and "
             "compared"]
    if others:
        others_words = ", ".join(f"stage {s.stage_id} {s.fraction:g} of the GPU "
                                 f"({format_size(fraction_bytes(s, total))})" for s in others)
        notes.append(f"not pinned: {others_words}, as the deploy config and any "
                     "--stage-overrides say: each is counted whole in the replica's "
                     "footprint (lower them by --stage-overrides after --)")
    return KvPlan(overrides_args(pinned), sizing, None, notes=tuple(notes)), []
