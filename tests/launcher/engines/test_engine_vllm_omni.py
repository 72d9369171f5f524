"""The vllm-omni adapter on its own: a replica sized from a real model directory and a deploy
config in vllm-omni's format (both written here), the KV stage pinned through
--stage-overrides, the command line, and the read-back of vLLM's per-stage KV lines.
Checked against vllm-omni's own loader in test_engine_vllm_omni_contract.py."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import pytest

from omni_dp.launcher.engines import ENGINES, EngineUnreadable, KvRequest, reserved_flag_problems
from omni_dp.launcher.engines.base import ReplicaLaunch
from omni_dp.launcher.engines.model_dir import read_model
from omni_dp.launcher.engines.readback import start_banner
from omni_dp.launcher.engines.vllm_omni import OVERHEAD_BYTES, VllmOmniEngine
from omni_dp.launcher.engines.vllm_omni_deploy import read_deploy_stages

from support.plans import GiB, h200, healthy_facts, plan, problems_of
from support.plans import opts as base_opts

# Qwen3-TTS's deploy config as vllm-omni 0.30.0 ships it (vllm_omni/deploy/qwen3_tts.yaml),
# cut to what sizing reads: two stages on device 0 at 0.3 of the GPU each.
DEPLOY = """\
model_runner: v2
async_chunk: true
stages:
  - stage_id: 0
    max_num_seqs: 64
    gpu_memory_utilization: 0.3
    max_model_len: 4096
    devices: "0"
    output_connectors:
      to_stage_1: connector_of_shared_memory
  - stage_id: 1
    dtype: bfloat16
    gpu_memory_utilization: 0.3
    devices: "0"
    input_connectors:
      from_stage_0: connector_of_shared_memory
"""
# The talker's geometry: 4 layers, 8 KV heads of 64, bfloat16 → 8192 bytes of KV per token.
CONFIG = {"architectures": ["Qwen3TTSForConditionalGeneration"], "num_hidden_layers": 4,
          "num_attention_heads": 8, "num_key_value_heads": 8, "hidden_size": 512,
          "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
PER_TOKEN = 2 * 4 * 8 * 64 * 2
WEIGHT_BYTES = 1000 * 512 * 2


def write_model(root: Path) -> Path:
    """config.json and one model.safetensors (a header and zero bytes)."""
    directory = root / "qwen3-tts-tiny"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(CONFIG))
    header = json.dumps({"embed": {"dtype": "BF16", "shape": [1000, 512],
                                   "data_offsets": [0, WEIGHT_BYTES]}}).encode()
    (directory / "model.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header + bytes(WEIGHT_BYTES))
    return directory


@pytest.fixture
def model(tmp_path):
    facts, problems = read_model(str(write_model(tmp_path)))
    assert problems == []
    return facts


@pytest.fixture
def deploy(tmp_path) -> Path:
    path = tmp_path / "qwen3_tts.yaml"
    path.write_text(DEPLOY)
    return path


def request(model, deploy, *args: str, **changes) -> KvRequest:
    base = KvRequest(kv_cache_bytes=None, max_total_tokens=8192, replicas=2, device="cuda",
                     gpu=h200(), model=model, engine_stage="tts_engine",
                     engine_args=(str(model.path), "--deploy-config", str(deploy), *args))
    return dataclasses.replace(base, **changes)


def overrides_of(args: tuple[str, ...]) -> dict:
    return json.loads(args[args.index("--stage-overrides") + 1])


def test_a_token_pin_is_the_kv_stages_bytes_and_its_fraction_lowered_to_its_own_footprint(
        model, deploy):
    pin, problems = VllmOmniEngine().plan_kv(request(model, deploy))
    assert problems == []
    kv_bytes = 8192 * PER_TOKEN
    fraction = -(-1000 * (WEIGHT_BYTES + kv_bytes + OVERHEAD_BYTES) // (141 * GiB)) / 1000
    assert overrides_of(pin.args) == {"0": {"kv_cache_memory_bytes": kv_bytes,
                                            "gpu_memory_utilization": fraction}}
    assert fraction < 0.3  # the talker no longer takes 30 % of the GPU
    # stage 1 keeps its 0.3 of the GPU, counted whole in the footprint
    assert pin.sizing.kv_cache_bytes == kv_bytes and pin.sizing.weights_bytes == WEIGHT_BYTES
    assert pin.sizing.overhead_bytes == OVERHEAD_BYTES + -(-3 * 141 * GiB // 10)
    assert pin.sizing.cuda_processes == 2 and pin.expected_tokens is None
    assert "not pinned: stage 1 0.3 of the GPU" in pin.notes[1]


def test_the_users_stage_overrides_are_merged_and_may_lower_the_other_stages(model, deploy):
    pin, problems = VllmOmniEngine().plan_kv(request(
        model, deploy, "--stage-overrides", '{"1": {"gpu_memory_utilization": 0.05}}'))
    assert problems == []
    merged = overrides_of(pin.args)
    assert merged["1"] == {"gpu_memory_utilization": 0.05}
    assert set(merged["0"]) == {"kv_cache_memory_bytes", "gpu_memory_utilization"}
    assert pin.sizing.overhead_bytes == OVERHEAD_BYTES + -(-5 * 141 * GiB // 100)


def test_the_kv_stages_fields_among_the_users_overrides_are_refused(model, deploy):
    _, problems = VllmOmniEngine().plan_kv(request(
        model, deploy, "--stage-overrides", '{"0": {"kv_cache_memory_bytes": 5}}'))
    assert problems == ["--stage-overrides sets kv_cache_memory_bytes for the KV stage 0: the "
                        "launcher sets it for every replica; use omni-dp launch "
                        "--kv-cache-bytes or --max-total-tokens instead"]


def test_a_byte_pin_is_written_as_given(model, deploy):
    pin, problems = VllmOmniEngine().plan_kv(request(model, deploy, max_total_tokens=None,
                                                     kv_cache_bytes=GiB))
    assert problems == [] and overrides_of(pin.args)["0"]["kv_cache_memory_bytes"] == GiB


def test_the_kv_stage_is_engine_stage_by_number(model, deploy):
    pin, _ = VllmOmniEngine().plan_kv(request(model, deploy, engine_stage="1"))
    assert set(overrides_of(pin.args)) == {"1"}
    _, problems = VllmOmniEngine().plan_kv(request(model, deploy, engine_stage="talker"))
    assert "--engine-stage 'talker': vllm-omni's stages are numbered" in problems[0]
    _, problems = VllmOmniEngine().plan_kv(request(model, deploy, engine_stage="7"))
    assert problems == ["--engine-stage 7: the deploy config has stages [0, 1]"]


def test_unpinned_one_replica_holds_every_stages_whole_fraction_more_need_a_pin(model, deploy):
    pin, problems = VllmOmniEngine().plan_kv(request(model, deploy, max_total_tokens=None,
                                                     replicas=1))
    assert problems == [] and pin.args == ()
    assert pin.sizing.total_bytes == 2 * -(-3 * 141 * GiB // 10)  # 60 % of the H200
    _, problems = VllmOmniEngine().plan_kv(request(model, deploy, max_total_tokens=None))
    assert problems[0].startswith("--replicas 2 needs a pinned KV size for vllm-omni")


def test_without_a_deploy_config_or_a_gpu_there_is_no_plan_and_it_says_why(model, deploy):
    _, problems = VllmOmniEngine().plan_kv(dataclasses.replace(
        request(model, deploy), engine_args=(str(model.path),)))
    assert "give the deploy config after --: --deploy-config FILE" in problems[0]
    _, problems = VllmOmniEngine().plan_kv(request(model, deploy, device="cpu", gpu=None))
    assert problems == ["vllm-omni needs a CUDA GPU; these engines cannot run on CPU"]


def test_a_stage_on_another_device_or_split_by_tensor_parallelism_is_refused(model, tmp_path):
    path = tmp_path / "two-gpus.yaml"
    path.write_text(DEPLOY.replace('devices: "0"\n    input', 'devices: "1"\n    input')
                    .replace("  - stage_id: 0\n", "  - stage_id: 0\n    tensor_parallel_size: 2\n"))
    _, problems = VllmOmniEngine().plan_kv(request(model, path))
    assert problems == [
        "stage 0 has tensor_parallel_size 2: omni-dp runs one GPU per replica",
        "stage 1 is on devices '1': a replica runs on one GPU (its CUDA_VISIBLE_DEVICES); "
        "set devices \"0\""]


def test_the_deploy_reader_follows_base_config_engine_args_and_runtime(tmp_path):
    (tmp_path / "base.yaml").write_text(DEPLOY)
    (tmp_path / "over.yaml").write_text(
        "base_config: base.yaml\nstages:\n  - stage_id: 1\n    engine_args:\n"
        "      gpu_memory_utilization: 0.1\n    runtime:\n      devices: \"0\"\n")
    stages, problems = read_deploy_stages(str(tmp_path / "over.yaml"))
    assert problems == []
    assert [(s.stage_id, s.fraction, s.devices) for s in stages] == [(0, 0.3, "0"),
                                                                   (1, 0.1, "0")]
    stages, _ = read_deploy_stages(str(tmp_path / "over.yaml"),
                                   {"0": {"gpu_memory_utilization": 0.2}})
    assert stages[0].fraction == 0.2
    (tmp_path / "bad.yaml").write_text("stages:\n  - stage_id: 0\n    gpu_memory_utilization: 3\n")
    _, problems = read_deploy_stages(str(tmp_path / "bad.yaml"))
    assert "gpu_memory_utilization 3 is not a fraction in (0, 1]" in problems[0]


def test_argv_is_the_omni_serve_with_the_model_loopback_port_and_one_merged_override():
    launch = ReplicaLaunch(port=8100, device="cuda", threads=None, kv_cache_bytes=None,
                           max_total_tokens=None, python="/venv/bin/python",
                           kv_args=("--stage-overrides", '{"0":{}}'))
    argv = VllmOmniEngine().argv(launch, ("/m", "--stage-overrides", '{"1": {}}',
                                          "--deploy-config", "/d.yaml"))
    assert argv == ["/venv/bin/python", "-m", "vllm_omni.entrypoints.cli.main", "serve", "/m",
                    "--omni", "--host", "127.0.0.1", "--port", "8100", "--stage-overrides",
                    '{"0":{}}', "--deploy-config", "/d.yaml"]


def test_the_launchers_flags_among_the_users_name_the_option_to_use():
    problems = reserved_flag_problems(VllmOmniEngine(), ("--gpu-memory-utilization", "0.5",
                                                         "--port", "1", "--headless"))
    assert len(problems) == 3
    assert "use omni-dp launch --kv-cache-bytes or --max-total-tokens" in problems[0]


def test_environment_keeps_vllms_sockets_and_caches_in_the_work_dir(tmp_path):
    launch = ReplicaLaunch(port=1, device="cuda", threads=None, kv_cache_bytes=None,
                           max_total_tokens=None, work_dir=tmp_path / "r0")
    env = VllmOmniEngine().environment(launch)
    assert env["VLLM_HOST_IP"] == "127.0.0.1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "r0" / "cache")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env


def test_the_read_back_sums_the_stages_kv_lines_of_the_latest_start(tmp_path):
    log = tmp_path / "replica-0.log"
    old = "(EngineCore pid=1) INFO [kv_cache_utils.py:1] GPU KV cache size: 99,999 tokens, x"
    lines = [start_banner(0, "text"), old, start_banner(0, "text"),
             "INFO [kv_cache_utils.py:2396] GPU KV cache size: 36,864 tokens, Maximum "
             "concurrency for 4,096 tokens per request: 9.00x",
             "INFO [kv_cache_utils.py:2396] GPU KV cache size: 2,048 tokens, Maximum x"]
    log.write_text("\n".join(lines) + "\n")
    assert VllmOmniEngine().read_capacity("http://x", log) == 36864 + 2048
    log.write_text("\n".join([*lines[:3]]) + "\n")
    with pytest.raises(EngineUnreadable, match="no `GPU KV cache size: N tokens` line"):
        VllmOmniEngine().read_capacity("http://x", log)


# --- the plan: what `omni-dp launch --engine vllm-omni --dry-run` prints ----------------------


def opts(model, deploy, *args, **changes):
    return base_opts(engine="vllm-omni", cpu_blocks="none",
                     engine_args=(str(model.path), "--deploy-config", str(deploy), *args),
                     **{"max_total_tokens": 8192, **changes})


def test_the_dry_run_plan_sizes_each_replica_from_the_model_and_the_deploy_config(
        tmp_path, model, deploy):
    facts = dataclasses.replace(healthy_facts(tmp_path), model=model)
    p = plan(opts(model, deploy, replicas=2), facts)
    described = "\n".join(p.describe())
    assert "vllm-omni KV: stage 0 holds 8192 tokens × 8192 bytes" in described
    for r in p.replicas:
        argv = list(r.argv)
        assert argv[argv.index("--deploy-config") + 1] == str(deploy)
        assert "kv_cache_memory_bytes" in argv[argv.index("--stage-overrides") + 1]
    assert p.to_json()["expected_kv_tokens"] is None  # vLLM derives it: read back, compared


def test_deploy_fractions_that_hold_too_much_are_refused_and_lowering_them_fits(
        tmp_path, model, deploy):
    """vllm-omni #2318's arithmetic: stage 1 at 0.3 of a 141 GiB H200 is 42.3 GiB in every
    replica, whatever the model's size; four of them do not fit, at 0.05 they do."""
    facts = dataclasses.replace(healthy_facts(tmp_path), model=model)
    problems = problems_of(opts(model, deploy, replicas=4), facts)
    assert any(p.startswith("GPU memory: 4 × (weights") and "does not fit" in p
               for p in problems), problems
    plan(opts(model, deploy, "--stage-overrides", '{"1": {"gpu_memory_utilization": 0.05}}',
              replicas=4), facts)


def test_the_engine_is_known_to_the_launcher():
    assert isinstance(ENGINES["vllm-omni"], VllmOmniEngine)


def test_a_relative_deploy_config_reaches_the_replica_absolute(tmp_path, monkeypatch, deploy):
    """A replica runs in a working directory of its own: the file the plan read must be the
    one it reads."""
    monkeypatch.chdir(tmp_path)
    launch = ReplicaLaunch(port=1, device="cuda", threads=None, kv_cache_bytes=None,
                           max_total_tokens=None)
    argv = VllmOmniEngine().argv(launch, ("/m", "--deploy-config", deploy.name))
    assert argv[argv.index("--deploy-config") + 1] == str(deploy)
    argv = VllmOmniEngine().argv(launch, ("/m", f"--deploy-config={deploy.name}"))
    assert f"--deploy-config={deploy}" in argv


def test_a_pin_smaller_than_one_request_of_the_kv_stages_length_is_refused(model, deploy):
    """vLLM refuses to start when its pool cannot hold one request of max_model_len (stage 0's
    4096 in Qwen3-TTS's deploy file)."""
    for tokens in (1024, 4096):  # 4096: one block short, vLLM's null block
        _, problems = VllmOmniEngine().plan_kv(request(model, deploy, max_total_tokens=tokens))
        assert problems == [
            f"the KV pin holds {tokens} tokens, not more than one request of stage 0's "
            "max_model_len (4096): vLLM would refuse to start (it keeps one block of the pool "
            "as its null block); pin more than 4096 tokens or lower max_model_len by "
            "--stage-overrides after --"]
    pin, problems = VllmOmniEngine().plan_kv(request(
        model, deploy, "--stage-overrides", '{"0": {"max_model_len": 512}}',
        max_total_tokens=1024))
    assert problems == [] and overrides_of(pin.args)["0"]["max_model_len"] == 512
