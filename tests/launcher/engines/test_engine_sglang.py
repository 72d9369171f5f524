"""The sglang adapter on its own: the KV pin as `--max-total-tokens` plus one
`--mem-fraction-static` sized for the replica that starts last, the command line and
environment, and the read-back of `max_total_num_tokens` from a stand-in of sglang 0.5.22's
/server_info."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from omni_dp.launcher.engines import reserved_flag_problems
from omni_dp.launcher.engines.base import (
    EngineUnreadable,
    KvRequest,
    ModelFacts,
    ReplicaLaunch,
    flag_problems,
)
from omni_dp.launcher.engines.sglang import OVERHEAD_BYTES, SglangEngine

from support.plans import GiB, h200
from support.sglang_standin import SglangStandin, server_info

# Llama-3-8B's KV geometry in bfloat16, with 16 GiB of weights: 131072 bytes per token.
LLAMA = ModelFacts(path=Path("/models/llama"), architecture="LlamaForCausalLM",
                   weights_bytes=16 * GiB, num_layers=32, num_kv_heads=8, head_dim=128,
                   dtype="bfloat16", dtype_bytes=2, max_positions=8192)
PER_TOKEN = 2 * 32 * 8 * 128 * 2
# One replica at 100000 tokens: 16 GiB + 100000 × 131072 + 2 GiB.
FOOTPRINT = 16 * GiB + 100000 * PER_TOKEN + 2 * GiB
ENGINE = SglangEngine()


def request(**changes) -> KvRequest:
    base = KvRequest(kv_cache_bytes=None, max_total_tokens=100000, replicas=2, device="cuda",
                     gpu=h200(), model=LLAMA, engine_args=("/models/llama",))
    return dataclasses.replace(base, **changes)


def launch(**changes) -> ReplicaLaunch:
    base = ReplicaLaunch(port=31000, device="cuda", threads=None, kv_cache_bytes=None,
                         max_total_tokens=100000, python="/venvs/sgl/bin/python",
                         kv_args=("--max-total-tokens", "100000", "--mem-fraction-static",
                                  "0.273"))
    return dataclasses.replace(base, **changes)


# --- the pin ----------------------------------------------------------------------------------


def test_two_replicas_get_the_token_cap_and_a_fraction_sized_for_the_last_one():
    pin, problems = ENGINE.plan_kv(request())
    assert problems == []
    # the second starts with 141 GiB − 30.21 GiB = 110.79 GiB free; 30.21 / 110.79 = 0.27264
    assert pin.args == ("--max-total-tokens", "100000", "--mem-fraction-static", "0.273")
    assert pin.expected_tokens == 100000
    # 0: nothing shared; (): the engine reports no placement of its own processes; None: the
    # model is the directory the user named, not described further
    assert dataclasses.astuple(pin.sizing) == (16 * GiB, 100000 * PER_TOKEN, 100000,
                                               OVERHEAD_BYTES, "cuda", 0, (), None)
    assert pin.sizing.total_bytes == FOOTPRINT
    assert any("the last of 2 replicas starts with 110.79 GiB free" in n for n in pin.notes)


def test_the_fraction_grows_with_the_replicas_before_the_last_and_keeps_three_decimals():
    pin, _ = ENGINE.plan_kv(request(replicas=4))
    # 141 GiB − 3 × 30.21 GiB = 50.38 GiB free for the fourth: 30.21 / 50.38 = 0.59960 → 0.600
    assert pin.args[-1] == "0.600"
    pin, _ = ENGINE.plan_kv(request(replicas=1))
    assert pin.args[-1] == str(-(-FOOTPRINT * 1000 // (141 * GiB)) / 1000) == "0.215"


def test_memory_already_in_use_on_the_gpu_raises_the_fraction():
    pin, _ = ENGINE.plan_kv(request(gpu=h200(memory_used_bytes=10 * GiB)))
    assert pin.args[-1] == "0.300"  # 30.21 / (131 − 30.21) = 0.29969


def test_the_users_overhead_estimate_replaces_the_default():
    pin, _ = ENGINE.plan_kv(request(overhead_bytes=6 * GiB))
    assert pin.sizing.overhead_bytes == 6 * GiB
    footprint = FOOTPRINT + 4 * GiB
    assert pin.args[-1] == f"{-(-footprint * 1000 // (141 * GiB - footprint)) / 1000:.3f}"
    assert pin.args[-1] == "0.321"  # 34.21 / (141 − 34.21) = 0.32036


def test_a_byte_pin_becomes_the_whole_tokens_it_buys_and_says_so():
    pin, problems = ENGINE.plan_kv(request(max_total_tokens=None,
                                           kv_cache_bytes=100000 * PER_TOKEN + 5000))
    assert problems == []
    assert pin.args == ("--max-total-tokens", "100000", "--mem-fraction-static", "0.273")
    assert pin.expected_tokens == 100000
    assert pin.notes[0] == ("--kv-cache-bytes 12.21 GiB is 100000 tokens at 131072 bytes per "
                            "token: sglang pins tokens, not bytes")


def test_a_byte_pin_under_one_token_is_refused():
    pin, problems = ENGINE.plan_kv(request(max_total_tokens=None, kv_cache_bytes=1000))
    assert pin is None
    assert problems == ["--kv-cache-bytes 1000 is less than one token of this model's KV "
                        "(131072 bytes); pin more"]


def test_an_fp8_kv_cache_halves_the_bytes_per_token():
    pin, _ = ENGINE.plan_kv(request(engine_args=("/models/llama", "--kv-cache-dtype",
                                                 "fp8_e4m3")))
    assert pin.sizing.kv_cache_bytes == 100000 * PER_TOKEN // 2
    pin, _ = ENGINE.plan_kv(request(engine_args=("/models/llama", "--kv-cache-dtype=nvfp4")))
    assert pin.sizing.kv_cache_bytes == 100000 * PER_TOKEN  # unknown: the model's, an upper bound
    assert any("--kv-cache-dtype nvfp4" in note for note in pin.notes)


def test_a_fraction_over_095_is_refused_with_the_numbers_and_the_largest_pin_that_fits():
    pin, problems = ENGINE.plan_kv(request(replicas=5))
    assert pin is None
    assert problems == [
        "sglang: the last of 5 replicas of 30.21 GiB each (weights 16.00 GiB + KV 12.21 GiB for "
        "100000 tokens + overhead 2.00 GiB) would start with 20.17 GiB free on GPU 0 (NVIDIA "
        "H200) and need --mem-fraction-static 1.498, over 0.95 (sglang keeps the rest for "
        "activations and CUDA graphs); at most --max-total-tokens 81152 fits 5 replicas, or use "
        "fewer replicas"]


def test_the_largest_pin_named_plans_and_one_token_more_does_not():
    _, problems = ENGINE.plan_kv(request(replicas=4, max_total_tokens=10**6))
    most = int(problems[0].split("at most --max-total-tokens ")[1].split()[0])
    assert most == 137561
    pin, problems = ENGINE.plan_kv(request(replicas=4, max_total_tokens=most))
    assert problems == [] and pin.args[-1] == "0.950"
    pin, problems = ENGINE.plan_kv(request(replicas=4, max_total_tokens=most + 1))
    assert pin is None and "--mem-fraction-static 0.951, over 0.95" in problems[0]


def test_replicas_whose_others_alone_fill_the_gpu_are_refused():
    pin, problems = ENGINE.plan_kv(request(replicas=8, max_total_tokens=65536))
    assert pin is None
    assert problems == [
        "sglang: 8 replicas of 26.00 GiB each (weights 16.00 GiB + KV 8.00 GiB for 65536 tokens "
        "+ overhead 2.00 GiB) do not fit GPU 0 (NVIDIA H200): 141.00 GiB is free and the other "
        "7 alone take 182.00 GiB; even without KV, 8 replicas' weights and overhead do not fit: "
        "use fewer"]


def test_no_gpu_is_refused():
    for changes in ({"device": "cpu", "gpu": None}, {"device": "cuda", "gpu": None},
                    {"device": "cpu"}):
        pin, problems = ENGINE.plan_kv(request(**changes))
        assert pin is None
        assert problems == ["sglang needs a CUDA GPU; these engines cannot run on CPU"]


def test_a_gpu_whose_memory_nvml_could_not_read_is_refused():
    _, problems = ENGINE.plan_kv(request(gpu=h200(memory_total_bytes=None,
                                                  errors=(("memory", "Not Supported"),))))
    assert problems == ["GPU 0 (NVIDIA H200): NVML could not read its total memory (Not "
                        "Supported); sglang's KV pin is sized from it"]
    _, problems = ENGINE.plan_kv(request(gpu=h200(memory_used_bytes=None)))
    assert "could not read how much memory is in use" in problems[0]


def test_without_the_model_directory_there_is_no_plan_and_the_reader_says_why():
    assert ENGINE.plan_kv(request(model=None)) == (None, [])


def test_one_unpinned_replica_runs_with_sglangs_own_sizing():
    pin, problems = ENGINE.plan_kv(request(replicas=1, max_total_tokens=None))
    assert problems == []
    assert pin.args == () and pin.expected_tokens is None
    assert pin.sizing.kv_tokens is None and pin.sizing.kv_cache_bytes == 0
    _, problems = ENGINE.plan_kv(request(max_total_tokens=None))
    assert "needs a pinned KV size" in problems[0]


def test_an_abbreviated_reserved_flag_is_refused_argparse_would_expand_it():
    problems = reserved_flag_problems(ENGINE, (
        "/models/llama", "--mem-frac", "0.5", "--max-total=5", "--dtype", "bfloat16"))
    assert problems == [
        "engine argument --mem-frac abbreviates --mem-fraction-static, which the launcher sets "
        "for every replica; use omni-dp launch --max-total-tokens or --kv-cache-bytes (the "
        "launcher derives the fraction from the replica's footprint) instead",
        "engine argument --max-total abbreviates --max-total-tokens, which the launcher sets "
        "for every replica; use omni-dp launch --max-total-tokens instead"]


# --- the command line and environment ---------------------------------------------------------


def test_argv_is_the_module_the_model_loopback_port_pin_then_the_users_args():
    argv = ENGINE.argv(launch(), ("/models/llama", "--dtype", "bfloat16"))
    assert argv == ["/venvs/sgl/bin/python", "-m", "sglang.launch_server",
                    "--model-path", "/models/llama", "--host", "127.0.0.1", "--port", "31000",
                    "--max-total-tokens", "100000", "--mem-fraction-static", "0.273",
                    "--dtype", "bfloat16"]
    assert ENGINE.argv(launch(), ("--dtype", "bfloat16", "--model-path=/models/llama"))[3:5] \
        == ["--model-path", "/models/llama"]


def test_reserved_flags_among_the_users_args_name_the_option_to_use():
    problems = flag_problems(ENGINE.reserved_flags, (
        "/models/llama", "--port", "1", "--mem-fraction-static=0.5", "--dp-size", "2",
        "--host", "0.0.0.0", "--base-gpu-id", "1", "--dtype", "half"), ENGINE.name)
    assert [p.split()[2] for p in problems] == ["--port", "--mem-fraction-static",
                                                "--dp-size", "--host", "--base-gpu-id"]
    assert problems[2].endswith("use omni-dp launch --replicas instead")


def test_environment_turns_off_the_generating_health_check_and_keeps_ipc_files_in_the_run(
        tmp_path):
    assert ENGINE.environment(launch()) == {
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false", "HF_HUB_OFFLINE": "1"}
    env = ENGINE.environment(launch(work_dir=tmp_path / "replica_0"))
    assert env["TMPDIR"] == str(tmp_path / "replica_0" / "tmp")


def test_no_private_tmpdir_where_a_socket_path_under_it_could_not_be_bound():
    deep = Path("/" + "d" * 90) / "replica_0"
    assert "TMPDIR" not in ENGINE.environment(launch(work_dir=deep))


def test_the_adapters_declared_facts():
    assert (ENGINE.name, ENGINE.module, ENGINE.kv_profiled, ENGINE.fixed_default_kv,
            ENGINE.needs_gpu, ENGINE.cuda_processes_per_replica, ENGINE.example) == (
        "sglang", "sglang.launch_server", True, False, True, 1, "completions")
    assert ENGINE.start_timeout_s == 900.0
    assert ENGINE.reported_processes("http://127.0.0.1:1") is None


# --- reading back what a replica allocated ----------------------------------------------------


@pytest.fixture
def standin():
    made: list[SglangStandin] = []

    def make(routes: dict) -> SglangStandin:
        made.append(SglangStandin(routes))
        return made[-1]

    yield make
    for server in made:
        server.close()


def test_capacity_is_the_allocated_pool_not_the_requested_cap(standin, tmp_path):
    server = standin({"/server_info": (200, server_info(allocated=99840, requested=100000))})
    assert ENGINE.read_capacity(server.url, tmp_path / "unused.log") == 99840
    assert server.seen == [("GET", "/server_info")]


def test_an_sglang_without_server_info_is_read_on_the_deprecated_name(standin, tmp_path):
    server = standin({"/get_server_info": (200, server_info(allocated=4096))})
    assert ENGINE.read_capacity(server.url, tmp_path / "unused.log") == 4096
    assert server.seen == [("GET", "/server_info"), ("GET", "/get_server_info")]


def test_an_error_answer_is_unreadable_and_the_deprecated_name_is_not_tried(standin, tmp_path):
    server = standin({"/server_info": (503, b"")})
    with pytest.raises(EngineUnreadable, match=r"/server_info answered 503$"):
        ENGINE.read_capacity(server.url, tmp_path / "unused.log")
    assert server.seen == [("GET", "/server_info")]


def test_an_answer_without_the_allocated_count_says_the_requested_one_is_not_it(standin,
                                                                               tmp_path):
    server = standin({"/server_info": (200, server_info(allocated=None, requested=100000))})
    with pytest.raises(EngineUnreadable) as info:
        ENGINE.read_capacity(server.url, tmp_path / "unused.log")
    assert str(info.value) == (
        f"GET {server.url}/server_info has no positive whole max_total_num_tokens (got None; "
        "max_total_tokens 100000 is the request, not the pool)")


def test_a_non_json_answer_and_a_silent_port_are_unreadable(standin, tmp_path):
    server = standin({"/server_info": (200, b"<html>")})
    with pytest.raises(EngineUnreadable, match="answered 200 without a JSON object"):
        ENGINE.read_capacity(server.url, tmp_path / "unused.log")
    gone = standin({})
    gone.close()
    with pytest.raises(EngineUnreadable, match=r"/server_info answered nothing$"):
        ENGINE.read_capacity(gone.url, tmp_path / "unused.log")
