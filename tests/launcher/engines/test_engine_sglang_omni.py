"""The sglang-omni adapter on its own: the KV pin as the KV stage's dotted engine overrides, the
`serve` command line and environment, and the read-back of the pool from the replica's log
(sglang 0.5.22's allocation lines, as sglang-omni 0.1.9's engine stage logs them)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from omni_dp.launcher.engines.base import (
    EngineUnreadable,
    KvRequest,
    ModelFacts,
    ReplicaLaunch,
    flag_problems,
)
from omni_dp.launcher.engines.sglang_omni import OVERHEAD_BYTES, SglangOmniEngine
from omni_dp.logs import json_line

from support.plans import GiB, MiB, h200

# A Qwen3-sized TTS backbone in bfloat16: 28 layers, 8 KV heads of 128.
HIGGS = ModelFacts(path=Path("/models/higgs"),
                   architecture="HiggsMultimodalQwen3ForConditionalGeneration",
                   weights_bytes=12 * GiB, num_layers=28, num_kv_heads=8, head_dim=128,
                   dtype="bfloat16", dtype_bytes=2)
PER_TOKEN = 2 * 28 * 8 * 128 * 2
ENGINE = SglangOmniEngine()


def request(**changes) -> KvRequest:
    base = KvRequest(kv_cache_bytes=2 * GiB, max_total_tokens=None, replicas=2, device="cuda",
                     gpu=h200(), model=HIGGS, engine_stage="tts_engine",
                     engine_args=("/models/higgs",))
    return dataclasses.replace(base, **changes)


def launch(**changes) -> ReplicaLaunch:
    base = ReplicaLaunch(port=32000, device="cuda", threads=None, kv_cache_bytes=2 * GiB,
                         max_total_tokens=None, python="/venvs/omni/bin/python",
                         kv_args=("--tts_engine.engine.kv_cache_bytes", str(2 * GiB),
                                  "--tts_engine.engine.mem_fraction_static", "null"))
    return dataclasses.replace(base, **changes)


# --- the pin ----------------------------------------------------------------------------------


def test_a_byte_pin_is_the_stages_kv_cache_bytes_with_its_fraction_cleared():
    pin, problems = ENGINE.plan_kv(request())
    assert problems == []
    assert pin.args == ("--tts_engine.engine.kv_cache_bytes", "2147483648",
                        "--tts_engine.engine.mem_fraction_static", "null")
    assert pin.expected_tokens is None  # the engine derives the count: equal is what is checked
    # 0: nothing shared; (): the engine reports no placement of its own processes; None: the
    # model is the directory the user named, not described further
    assert dataclasses.astuple(pin.sizing) == (12 * GiB, 2 * GiB, None, OVERHEAD_BYTES, "cuda",
                                               0, (), None)


def test_a_token_pin_is_written_as_its_bytes_since_the_token_knob_is_only_a_cap():
    """A cap gives a replica started beside others fewer tokens; the byte knob does not."""
    pin, problems = ENGINE.plan_kv(request(kv_cache_bytes=None, max_total_tokens=16384))
    assert problems == []
    assert pin.args == ("--tts_engine.engine.kv_cache_bytes", str(16384 * PER_TOKEN),
                        "--tts_engine.engine.mem_fraction_static", "null")
    assert pin.expected_tokens is None  # equal across replicas is what is checked
    assert pin.sizing.kv_cache_bytes == 16384 * PER_TOKEN and pin.sizing.kv_tokens is None
    assert "pinned by bytes" in pin.notes[0] and "upper bound" in pin.notes[0]


def test_the_kv_stage_is_the_requests_and_tts_engine_by_default():
    pin, _ = ENGINE.plan_kv(request(engine_stage="talker_ar"))
    assert pin.args[0] == "--talker_ar.engine.kv_cache_bytes"
    pin, _ = ENGINE.plan_kv(request(engine_stage=None))
    assert pin.args[0] == "--tts_engine.engine.kv_cache_bytes"


def test_the_users_overhead_estimate_replaces_the_default():
    pin, _ = ENGINE.plan_kv(request(overhead_bytes=512 * MiB))
    assert pin.sizing.overhead_bytes == 512 * MiB


def test_the_kv_stages_engine_fields_are_reserved_other_stages_are_the_users():
    _, problems = ENGINE.plan_kv(request(engine_args=(
        "/models/higgs", "--tts_engine.engine.kv_cache_bytes=1GiB",
        "--tts_engine.engine.max_total_tokens", "5", "--tts_engine.engine.mem_fraction_static",
        "0.5", "--vocoder.factory.max_concurrency", "8", "--tts_engine.engine.page_size", "16")))
    assert problems == [
        f"engine argument --tts_engine.engine.{field} is set by the launcher for the KV stage "
        "tts_engine of every replica; use omni-dp launch --kv-cache-bytes or --max-total-tokens "
        "instead" for field in ("kv_cache_bytes", "max_total_tokens", "mem_fraction_static")]
    _, problems = ENGINE.plan_kv(request(engine_stage="talker_ar", engine_args=(
        "/models/higgs", "--tts_engine.engine.max_total_tokens", "5")))
    assert problems == []


def test_no_gpu_is_refused():
    pin, problems = ENGINE.plan_kv(request(device="cpu", gpu=None))
    assert pin is None
    assert problems == ["sglang-omni needs a CUDA GPU; these engines cannot run on CPU"]


def test_unpinned_one_replica_runs_with_the_stages_own_sizing_more_need_a_pin():
    pin, problems = ENGINE.plan_kv(request(kv_cache_bytes=None, replicas=1))
    assert problems == [] and pin.args == () and pin.expected_tokens is None
    pin, problems = ENGINE.plan_kv(request(kv_cache_bytes=None))
    assert pin is None and "needs a pinned KV size" in problems[0]


def test_without_the_model_directory_there_is_no_plan_and_the_reader_says_why():
    assert ENGINE.plan_kv(request(model=None)) == (None, [])


# --- the command line and environment ---------------------------------------------------------


def test_argv_is_serve_the_model_loopback_port_mps_off_the_pin_then_the_users_args():
    argv = ENGINE.argv(launch(), ("/models/higgs", "--vocoder.factory.max_concurrency", "8"))
    assert argv == ["/venvs/omni/bin/python", "-m", "sglang_omni.cli", "serve",
                    "--model-path", "/models/higgs", "--host", "127.0.0.1", "--port", "32000",
                    "--mps", "off", "--tts_engine.engine.kv_cache_bytes", "2147483648",
                    "--tts_engine.engine.mem_fraction_static", "null",
                    "--vocoder.factory.max_concurrency", "8"]


def test_reserved_flags_among_the_users_args_name_the_option_to_use():
    problems = flag_problems(ENGINE.reserved_flags, (
        "/models/higgs", "--host", "0.0.0.0", "--port=8000", "--mps", "on"), ENGINE.name)
    assert [p.split()[2] for p in problems] == ["--host", "--port", "--mps"]


def test_environment_makes_the_port_strict_and_leaves_the_cpu_block_alone(tmp_path):
    assert ENGINE.environment(launch()) == {"SGLANG_OMNI_STRICT_PORT": "1",
                                            "SGLANG_OMNI_BIND_GPU_LOCAL_CPUS": "0"}
    env = ENGINE.environment(launch(work_dir=tmp_path / "replica_1"))
    assert env["TMPDIR"] == str(tmp_path / "replica_1" / "tmp")


def test_the_adapters_declared_facts():
    assert (ENGINE.name, ENGINE.module, ENGINE.kv_profiled, ENGINE.needs_gpu,
            ENGINE.cuda_processes_per_replica, ENGINE.start_timeout_s, ENGINE.example) == (
        "sglang-omni", "sglang_omni.cli", True, True, 4, 1200.0, "speech")
    assert ENGINE.reported_processes("http://127.0.0.1:1") is None


# --- reading back what a replica allocated, from its log --------------------------------------

# What the engine stage prints (sglang-omni's stage format, then sglang's own).
STAGE = "2026-12-01 12:00:03,101 [INFO] sglang.srt.mem_cache.memory_pool: "
SGL = "[2026-12-01 12:00:03] "


def allocated(tokens: str, prefix: str = STAGE) -> str:
    return (f"{prefix}KV Cache is allocated. dtype: torch.bfloat16, #tokens: {tokens}, KV size: "
            "1.91 GB")


def write_log(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def banner(index: int = 0) -> str:
    return f"--- omni-dp: starting replica {index} at 2026-12-01 12:00:00 ---"


def test_the_latest_starts_allocation_line_is_the_capacity_an_older_start_is_ignored(
        tmp_path):
    log = write_log(tmp_path / "replica_0.log", banner(), allocated("65536"),
                    "Traceback (most recent call last):", banner(),
                    f"{STAGE}Load weight end. type=HiggsAudio, avail mem=120.10 GB",
                    allocated("58240"), "INFO:     Uvicorn running on http://127.0.0.1:32000")
    assert ENGINE.read_capacity("http://127.0.0.1:32000", log) == 58240


def test_after_post_capture_sizing_its_later_line_is_the_pool(tmp_path):
    log = write_log(tmp_path / "replica_0.log", banner(),
                    f"{SGL}KV Cache VA upper bound. dtype: torch.bfloat16, #tokens: 900000, KV "
                    "size: 96.13 GB",
                    f"{SGL}Post-capture KV sizing: full_layer_tokens=58112, swa_layer_tokens=0",
                    f"{SGL}Post-capture KV sizing: KV cache allocated. dtype: torch.bfloat16, "
                    "#tokens: 58112, KV size: 6.21 GB, avail mem=20.02 GB",
                    f"{SGL}Post-capture KV sizing: draft KV cache allocated. dtype: "
                    "torch.bfloat16, #tokens: 4096, KV size: 0.44 GB")
    assert ENGINE.read_capacity("http://127.0.0.1:32000", log) == 58112


def test_labelled_pools_of_hybrid_models_are_not_the_count(tmp_path):
    log = write_log(tmp_path / "replica_0.log", banner(), allocated("40000", SGL),
                    f"{SGL}SWA KV Cache is allocated. dtype: torch.bfloat16, #tokens: 9000, "
                    "KV size: 1.00 GB",
                    f"{SGL}Full KV Cache is allocated. dtype: torch.bfloat16, #tokens: 8000, K "
                    "size: 0.50 GB, V size: 0.50 GB")
    assert ENGINE.read_capacity("http://127.0.0.1:32000", log) == 40000


def test_a_json_log_starts_at_the_launchers_json_banner(tmp_path):
    log = write_log(tmp_path / "replica_0.log", json_line("omni_dp.launch", "starting replica 0"),
                    allocated("1,024"), json_line("omni_dp.launch", "starting replica 0"),
                    allocated("2,048"))
    assert ENGINE.read_capacity("http://127.0.0.1:32000", log) == 2048


def test_a_start_that_logged_no_allocation_yet_is_unreadable_not_the_older_count(tmp_path):
    log = write_log(tmp_path / "replica_0.log", banner(), allocated("65536"), banner(),
                    f"{STAGE}Load weight begin.")
    with pytest.raises(EngineUnreadable) as info:
        ENGINE.read_capacity("http://127.0.0.1:32000", log)
    assert str(info.value).startswith(
        f"no `KV Cache is allocated. … #tokens: N` line in {log} since the replica's last start")


def test_a_missing_log_is_unreadable(tmp_path):
    with pytest.raises(EngineUnreadable, match="cannot read the replica's log"):
        ENGINE.read_capacity("http://127.0.0.1:32000", tmp_path / "absent.log")
