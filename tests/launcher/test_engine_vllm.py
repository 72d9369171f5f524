"""The vLLM adapter on its own: the KV pin in vLLM's knobs, the command line and environment,
and the read-back of what a replica allocated from the `vllm:cache_config_info` labels that
vLLM 0.32 serves on /metrics. And the plan of a vLLM launch from a hand-built machine."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from omni_dp.cpulist import format_cpu_list
from omni_dp.launcher.engines import (
    ENGINES,
    EngineUnreadable,
    KvRequest,
    ModelFacts,
    reserved_flag_problems,
)
from omni_dp.launcher.engines.base import ReplicaLaunch, split_model
from omni_dp.launcher.engines.vllm import BLOCK_SIZE, VllmEngine, cache_config_tokens
from omni_dp.launcher.planning.gpus import CPU_SLOT
from omni_dp.launcher.planning.options import ENGINE_NAMES

from support.plans import GiB, MiB, h200, healthy_facts, plan, problems_of
from support.plans import opts as base_opts

# A tiny Llama as scripts/make-tiny-llama builds it: 2 layers, 2 KV heads of 32, bfloat16.
TINY = ModelFacts(path=Path("/models/tiny-llama"), architecture="LlamaForCausalLM",
                  weights_bytes=3 * MiB, num_layers=2, num_kv_heads=2, head_dim=32,
                  dtype="bfloat16", dtype_bytes=2, max_positions=512)
PER_TOKEN = 2 * 2 * 2 * 32 * 2  # K and V × layers × KV heads × head dim × bytes


def request(**changes) -> KvRequest:
    base = KvRequest(kv_cache_bytes=None, max_total_tokens=1024, replicas=2, device="cpu",
                     gpu=None, model=TINY)
    return dataclasses.replace(base, **changes)


def test_the_option_list_of_engines_is_the_adapters():
    assert set(ENGINE_NAMES) == set(ENGINES)


def test_a_token_pin_becomes_exact_blocks_and_their_bytes():
    pin, problems = VllmEngine().plan_kv(request())
    assert problems == []
    assert pin.expected_tokens == 1024
    assert pin.args == ("--block-size", "32", "--num-gpu-blocks-override", "32",
                        "--kv-cache-memory-bytes", str(1024 * PER_TOKEN))
    assert pin.sizing.kv_cache_bytes == 1024 * PER_TOKEN == 524288
    assert pin.sizing.weights_bytes == 3 * MiB and pin.sizing.device == "cpu"


def test_a_token_pin_that_vllm_would_round_is_refused_with_the_two_nearest():
    pin, problems = VllmEngine().plan_kv(request(max_total_tokens=1000))
    assert pin is None
    assert problems == ["--max-total-tokens 1000: vLLM allocates whole blocks of 32 tokens, so "
                        "it would round; ask for 992 or 1024"]
    _, problems = VllmEngine().plan_kv(request(max_total_tokens=20))
    assert "ask for 32" in problems[0]


def test_a_byte_pin_becomes_whole_blocks_and_says_how_many_tokens():
    pin, problems = VllmEngine().plan_kv(request(max_total_tokens=None,
                                                 kv_cache_bytes=1024 * PER_TOKEN + 100))
    assert problems == []
    assert pin.expected_tokens == 1024  # the 100 bytes left over hold no whole block
    assert pin.args[3] == "32" and pin.args[5] == str(1024 * PER_TOKEN)
    assert "32 blocks × 32 tokens = 1024 tokens" in pin.notes[0]
    _, problems = VllmEngine().plan_kv(request(max_total_tokens=None, kv_cache_bytes=10))
    assert "one vLLM block of 32 tokens takes 16384 bytes" in problems[0]


def test_no_pin_is_refused_even_for_one_replica():
    _, problems = VllmEngine().plan_kv(request(max_total_tokens=None, replicas=1))
    assert "engine vllm needs a KV pin" in problems[0]


def test_a_pool_shorter_than_the_models_length_needs_max_model_len():
    """vLLM refuses to start when its pool, less its null block, cannot hold one request of
    max_model_len (measured: 16 blocks of 32 for a 512-token model → 'maximum model length is
    480')."""
    _, problems = VllmEngine().plan_kv(request(max_total_tokens=512))
    assert "512 tokens, 480 of them for requests" in problems[0]
    assert "pin at least 544 tokens" in problems[0] and "--max-model-len 480" in problems[0]
    assert VllmEngine().plan_kv(request(max_total_tokens=544))[1] == []
    pin, problems = VllmEngine().plan_kv(request(
        max_total_tokens=256, engine_args=("/m", "--max-model-len", "224")))
    assert problems == [] and pin.expected_tokens == 256


def test_a_max_model_len_after_dashes_is_held_to_the_pin_too():
    _, problems = VllmEngine().plan_kv(request(
        max_total_tokens=544, engine_args=("/m", "--max-model-len=4096")))
    assert "--max-model-len 4096 after --" in problems[0]
    assert "pin at least 4128 tokens or lower it to 512" in problems[0]
    _, problems = VllmEngine().plan_kv(request(
        max_total_tokens=544, engine_args=("/m", "--max_model_len", "1k")))
    assert "pin at least 1056 tokens" in problems[0]
    assert VllmEngine().plan_kv(request(
        max_total_tokens=544, engine_args=("/m", "--max-model-len", "512")))[1] == []


@pytest.mark.parametrize(("flag", "reserved"), [
    ("--gpu_memory_utilization", "--gpu-memory-utilization"),
    ("--num-gpu-blocks", "--num-gpu-blocks-override"),
    ("--kv-cache-mem", "--kv-cache-memory-bytes"),
])
def test_reserved_flags_are_refused_as_argparse_would_read_them(flag, reserved):
    problems = reserved_flag_problems(VllmEngine(), ("/m", flag, "3"))
    assert len(problems) == 1 and reserved in problems[0], problems


@pytest.mark.parametrize(("args", "per_token"), [
    ((), PER_TOKEN),  # the checkpoint's bfloat16
    (("--dtype", "float32"), 2 * PER_TOKEN),
    (("--dtype=half",), PER_TOKEN),
    (("--kv-cache-dtype", "fp8_e4m3"), PER_TOKEN // 2),
])
def test_bytes_per_token_follow_the_dtype_vllm_serves(args, per_token):
    pin, problems = VllmEngine().plan_kv(request(engine_args=("/m", *args)))
    assert problems == []
    assert pin.sizing.kv_cache_bytes == 1024 * per_token
    assert pin.args[-1] == str(1024 * per_token)


def test_on_a_gpu_utilization_is_the_replicas_own_footprint():
    """vLLM's start check wants free ≥ total × utilization even with a byte pin: asking for
    the footprint lets a co-resident replica start whenever it fits."""
    gpu = h200()
    pin, problems = VllmEngine().plan_kv(request(device="cuda", gpu=gpu))
    assert problems == []
    utilization = float(pin.args[pin.args.index("--gpu-memory-utilization") + 1])
    assert pin.sizing.total_bytes <= utilization * gpu.memory_total_bytes
    assert (utilization - 0.001) * gpu.memory_total_bytes < pin.sizing.total_bytes
    cpu, _ = VllmEngine().plan_kv(request())
    assert "--gpu-memory-utilization" not in cpu.args


def test_argv_puts_the_model_and_loopback_port_first_then_the_pin_and_the_rest():
    launch = ReplicaLaunch(port=8101, device="cpu", threads=1, kv_cache_bytes=None,
                           max_total_tokens=1024, python="/venv/bin/python",
                           kv_args=("--block-size", "32"))
    argv = VllmEngine().argv(launch, ("/models/m", "--enforce-eager", "--dtype", "bfloat16"))
    assert argv == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server",
                    "--model", "/models/m", "--host", "127.0.0.1", "--port", "8101",
                    "--block-size", "32", "--enforce-eager", "--dtype", "bfloat16"]


def test_environment_binds_omp_threads_to_the_block_and_keeps_files_in_the_run(tmp_path):
    launch = ReplicaLaunch(port=8101, device="cpu", threads=2, kv_cache_bytes=None,
                           max_total_tokens=None, cpus=(2, 3), work_dir=tmp_path / "w")
    env = VllmEngine().environment(launch)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "2-3"
    assert env["TMPDIR"] == str(tmp_path / "w" / "tmp")
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "w" / "cache")
    assert env["VLLM_HOST_IP"] == "127.0.0.1"
    unpinned = VllmEngine().environment(dataclasses.replace(launch, cpus=None))
    assert unpinned["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


@pytest.mark.parametrize(("args", "model", "rest"), [
    (("/m", "--enforce-eager"), "/m", ("--enforce-eager",)),
    (("--model", "/m", "--dtype", "half"), "/m", ("--dtype", "half")),
    (("--model-path=/m",), "/m", ()),
    (("--dtype", "half", "/m"), "/m", ("--dtype", "half")),
    (("--enforce-eager",), None, ("--enforce-eager",)),
])
def test_the_model_is_found_among_the_engine_args(args, model, rest):
    assert split_model(args) == (model, rest)


METRICS = """# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",hash_block_size="None",\
kv_cache_memory_bytes="524288",kv_cache_size_tokens="1024",mamba_block_size="None",\
num_gpu_blocks="32",num_gpu_blocks_override="32"} 1.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="/m"} 0.0
"""


def test_capacity_is_blocks_times_block_size_from_whole_label_names():
    assert cache_config_tokens(METRICS) == 1024
    rounded = METRICS.replace('num_gpu_blocks="32"', 'num_gpu_blocks="31"')
    with pytest.raises(EngineUnreadable, match="kv_cache_size_tokens says 1024"):
        cache_config_tokens(rounded)


def test_metrics_without_the_cache_info_say_so():
    with pytest.raises(EngineUnreadable, match="no vllm:cache_config_info"):
        cache_config_tokens("# TYPE up gauge\nup 1.0\n")
    with pytest.raises(EngineUnreadable, match="no whole num_gpu_blocks"):
        cache_config_tokens('vllm:cache_config_info{block_size="32"} 1.0\n')


# --- a vLLM launch planned on a hand-built machine --------------------------------------------


def vllm_facts(tmp_path, **changes):
    facts = dataclasses.replace(healthy_facts(tmp_path), slots=(CPU_SLOT,),
                                sizing=None, model=TINY, engine_python="/venv/bin/python")
    return dataclasses.replace(facts, **changes)


def opts(**changes):
    return base_opts(**{"engine": "vllm", "gpu": "none",
                        "engine_args": ("/models/tiny-llama", "--enforce-eager"), **changes})


def test_a_vllm_launch_plans_every_replica_with_the_pin_and_its_own_directory(tmp_path):
    p = plan(opts(), vllm_facts(tmp_path))
    assert p.expected_kv_tokens == 1024 and p.start == "parallel"
    assert p.start_timeout == VllmEngine.start_timeout_s
    for r in p.replicas:
        engine = r.argv[r.argv.index("--") + 1:]  # after the pinning wrapper
        assert engine[:3] == ("/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server")
        assert "--num-gpu-blocks-override" in engine and engine[-1] == "--enforce-eager"
        assert r.env["TMPDIR"] == str(p.run_dir / "engines" / f"replica_{r.index}" / "tmp")
        assert r.env["VLLM_CPU_OMP_THREADS_BIND"] == format_cpu_list(r.cpus)
    assert any("vLLM KV: 32 blocks" in line for line in p.describe())


def test_a_vllm_launch_without_a_pin_or_model_or_with_a_reserved_flag_exits_2(tmp_path):
    facts = vllm_facts(tmp_path)
    problems = problems_of(opts(max_total_tokens=None), facts)
    assert any(p.startswith("--replicas 2 needs a pinned KV size") for p in problems)
    problems = problems_of(opts(engine_args=("/m", "--block-size", "16")), facts)
    assert problems == ["engine argument --block-size is set by the launcher for every "
                        "replica; use omni-dp launch --max-total-tokens (whole blocks of 32 "
                        "tokens) instead"]
    problems = problems_of(opts(max_total_tokens=1000), facts)
    assert problems == ["--max-total-tokens 1000: vLLM allocates whole blocks of 32 tokens, "
                        "so it would round; ask for 992 or 1024"]


def test_vllm_replicas_must_fit_in_host_memory(tmp_path):
    facts = vllm_facts(tmp_path, host_memory_available=3 * GiB)
    problems = problems_of(opts(), facts)
    assert len(problems) == 1 and problems[0].startswith("host memory: 2 × (weights")
    assert "overhead 2.00 GiB" in problems[0]
    assert plan(opts(engine_overhead=256 * MiB), facts).replicas  # the user's estimate wins


def test_block_size_is_a_multiple_of_32():
    assert BLOCK_SIZE % 32 == 0
