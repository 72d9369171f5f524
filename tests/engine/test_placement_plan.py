"""The placement as `omni-dp serve` plans it (engine/placement_plan.py, plan_serve), on the CPU.

The talker's KV pool from its budget, to the byte; every budget and option problem at once;
what the dry run prints (the serve command through click's runner, in this process); and the
StageLaunch a stage process is started with. Nothing here starts a process."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from omni_dp.cli.commands.serve import serve
from omni_dp.engine.config import PRESETS
from omni_dp.engine.kv_cache import plan_kv_cache
from omni_dp.engine.options import ServeOptions
from omni_dp.engine.placement_plan import REPLICATED, process_needs, stage_weight_bytes
from omni_dp.engine.plan import (
    CPU_OVERHEAD_BYTES,
    ServePlan,
    ServePlanError,
    plan_serve,
    plan_summary,
)
from omni_dp.engine.stage_launch import StageLaunch, TPRank
from omni_dp.sizes import GiB, format_size

CFG = PRESETS["tiny"]
DTYPE = torch.float64  # auto on the CPU
WEIGHTS = stage_weight_bytes(CFG, DTYPE)
REPLICATED_BYTES = WEIGHTS[REPLICATED]
PAGE_BYTES = plan_kv_cache(num_layers=CFG.num_layers, num_kv_heads=CFG.num_kv_heads,
                           head_dim=CFG.head_dim, dtype=DTYPE, max_total_tokens=16).bytes_per_page
BUDGET_1GIB = ("talker.gpu_memory_fraction", "0.5"), ("placement.cpu_device_memory_bytes", "2GiB")
OWN_TALKER = (("talker.process", "talker"),)


def options(*overrides: tuple[str, str], **fields) -> ServeOptions:
    fields = {"threads": 1, **fields}
    return ServeOptions(device="cpu", placement_overrides=tuple(overrides), **fields)


def plan(*overrides: tuple[str, str], **fields) -> ServePlan:
    return plan_serve(options(*overrides, **fields))


def problems(*overrides: tuple[str, str], **fields) -> list[str]:
    with pytest.raises(ServePlanError) as caught:
        plan(*overrides, **fields)
    return caught.value.problems


def whole_pages(num_bytes: int) -> int:
    return num_bytes // PAGE_BYTES * PAGE_BYTES


# --- the KV pool from the talker's budget -----------------------------------------------------
def test_the_weights_are_counted_from_the_shapes_per_stage():
    assert WEIGHTS["preprocess"] == 0
    assert WEIGHTS["talker"] > 10 * WEIGHTS["vocoder"] > 0


def test_without_a_kv_knob_the_pool_is_what_the_talkers_budget_leaves():
    served = plan(*OWN_TALKER, *BUDGET_1GIB)
    talker = served.placement.process_of("talker")[0]
    assert (talker.name, talker.budget_bytes) == ("talker", GiB)
    expected = whole_pages(GiB - WEIGHTS["talker"] - CPU_OVERHEAD_BYTES)
    assert served.kv.cache_bytes == expected
    assert served.kv.max_total_tokens == expected // served.kv.bytes_per_token
    # Exact: the process's need fits its budget, and one page more would not.
    need = WEIGHTS["talker"] + served.kv.cache_bytes + CPU_OVERHEAD_BYTES
    assert need <= GiB < need + PAGE_BYTES


def test_a_talker_sharing_main_leaves_room_for_the_vocoder_too():
    served = plan(*BUDGET_1GIB)  # every stage in main: main's budget is the talker's
    assert served.placement.is_single_process
    assert served.kv.cache_bytes == whole_pages(
        GiB - WEIGHTS["talker"] - WEIGHTS["vocoder"] - CPU_OVERHEAD_BYTES)


def test_a_kv_knob_wins_over_the_budget():
    served = plan(*OWN_TALKER, *BUDGET_1GIB, max_total_tokens=4096)
    assert served.kv.max_total_tokens == 4096


def test_an_explicit_pool_over_the_budget_names_the_process_and_its_stages():
    tokens = GiB // (PAGE_BYTES // 16)  # 1 GiB of KV alone
    need = WEIGHTS["talker"] + tokens * (PAGE_BYTES // 16) + CPU_OVERHEAD_BYTES
    assert problems(*OWN_TALKER, *BUDGET_1GIB, max_total_tokens=tokens) == [
        f"process talker (talker) needs {format_size(need)}, over its budget of 1.00 GiB "
        "(0.5 × 2.00 GiB of cpu)"]


def test_a_budget_that_leaves_no_room_says_raise_the_fraction():
    found = problems(*OWN_TALKER, ("talker.gpu_memory_fraction", "0.5"),
                     ("placement.cpu_device_memory_bytes", "256MiB"))
    assert found[0] == ("the talker's budget (128.00 MiB) leaves no room for one KV page after "
                        "its weights and overhead; raise --talker.gpu_memory_fraction")


def test_a_budget_that_leaves_no_room_is_one_problem():
    assert len(problems(*OWN_TALKER, ("talker.gpu_memory_fraction", "0.5"),
                        ("placement.cpu_device_memory_bytes", "256MiB"))) == 1


def test_a_budget_that_leaves_less_than_a_page_says_raise_the_fraction():
    # 0.9 of this total leaves 1000 bytes after the talker's weights and overhead.
    total = -(-(CPU_OVERHEAD_BYTES + WEIGHTS["talker"] + 1000) * 10 // 9)
    found = problems(*OWN_TALKER, ("talker.gpu_memory_fraction", "0.9"),
                     ("placement.cpu_device_memory_bytes", str(total)))
    assert not any("--kv-cache-bytes" in p for p in found), found
    assert any("raise --talker.gpu_memory_fraction" in p for p in found), found


def test_a_tp_talkers_pool_is_what_each_ranks_budget_leaves_times_the_ranks():
    served = plan(("talker.tp_size", "2"), ("talker.gpu_memory_fraction", "0.4"),
                  ("placement.cpu_device_memory_bytes", "2GiB"))
    ranks = served.placement.process_of("talker")
    assert [(p.name, p.tp_rank) for p in ranks] == [("talker-tp0", 0), ("talker-tp1", 1)]
    budget = int(0.4 * 2 * GiB)
    assert {p.budget_bytes for p in ranks} == {budget}
    # A rank holds the embeddings, norms and lm_head whole and half of the projections.
    rank_weights = REPLICATED_BYTES + (WEIGHTS["talker"] - REPLICATED_BYTES) // 2
    left = budget - CPU_OVERHEAD_BYTES - rank_weights
    assert served.kv.cache_bytes == whole_pages(2 * left)


def test_process_needs_of_a_tp2_talker_halves_its_projections_and_kv():
    served = plan(("talker.tp_size", "2"))
    kv = 1000 * PAGE_BYTES
    needs = process_needs(served.placement, WEIGHTS, kv, overhead=lambda device: 7)
    rank = REPLICATED_BYTES + (WEIGHTS["talker"] - REPLICATED_BYTES) // 2 + kv // 2 + 7
    assert needs == {"main": WEIGHTS["preprocess"] + WEIGHTS["vocoder"] + 7,
                     "talker-tp0": rank, "talker-tp1": rank}


def test_a_tp_ranks_planned_weights_are_what_its_shard_holds():
    from omni_dp.engine.tensor_parallel import shard_talker
    from omni_dp.engine.weights import meta_models

    served = plan(("talker.tp_size", "2"))
    needs = process_needs(served.placement, WEIGHTS, 0, overhead=lambda device: 0)
    talker = meta_models(CFG, DTYPE).talker
    for rank in (0, 1):
        shard = shard_talker(talker, rank, 2)
        held = sum(p.numel() * p.element_size() for p in shard.parameters())
        assert needs[f"talker-tp{rank}"] == held


# --- problems, all at once --------------------------------------------------------------------
def test_share_weights_with_a_split_placement_is_refused(tmp_path):
    found = problems(("vocoder.process", "vocoder"), share_weights="leader",
                     share_dir=str(tmp_path / "share"))
    assert found == ["--share-weights shares the weights of single-process replicas; this "
                     "placement starts stage processes (drop one or the other)"]


def test_placement_and_option_problems_are_reported_together():
    assert problems(("vocder.process", "v"), port=70000) == [
        "--port must be 0-65535, got 70000",
        "unknown stage 'vocder' in --vocder.process; did you mean 'vocoder'?"]


# --- the dry run's summary --------------------------------------------------------------------
def test_the_summary_carries_the_placement_and_one_overhead_per_process():
    summary = json.loads(json.dumps(plan_summary(plan(
        ("preprocess.process", "pre"), ("talker.process", "talker"),
        ("vocoder.process", "vocoder")))))
    placement = summary["placement"]
    assert [(p["name"], p["stages"]) for p in placement["processes"]] == [
        ("main", []), ("pre", ["preprocess"]), ("talker", ["talker"]),
        ("vocoder", ["vocoder"])]
    assert summary["overhead_bytes"] == 4 * CPU_OVERHEAD_BYTES
    assert placement["stages"]["talker"]["process"] == {"value": "talker",
                                                        "source": "cli (--talker.process)"}
    assert placement["stages"]["talker"]["device"] == {"value": "auto", "source": "default"}
    assert placement["placement"]["cpu_device_memory_bytes"] == {"value": None,
                                                                 "source": "default"}


def test_a_single_process_summary_has_one_overhead():
    summary = plan_summary(plan())
    assert summary["overhead_bytes"] == CPU_OVERHEAD_BYTES
    assert [p["name"] for p in summary["placement"]["processes"]] == ["main"]


# --- the serve command ------------------------------------------------------------------------
def invoke(*args: str):
    return CliRunner().invoke(serve, ["--device", "cpu", "--threads", "1", *args])


def assert_usage_error(result) -> None:
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # exit 2, no other exception
    assert "Traceback" not in result.output
    assert result.stdout == ""


def test_an_unknown_option_exits_2_with_the_close_match():
    result = invoke("--portt", "1")
    assert_usage_error(result)
    assert "no such option: --portt; did you mean --port?" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_misspelled_stage_exits_2_naming_the_stage():
    result = invoke("--vocder.process", "x")
    assert_usage_error(result)
    assert result.stderr.strip() == ("omni-dp serve: unknown stage 'vocder' in --vocder.process;"
                                     " did you mean 'vocoder'?")


def test_the_dry_run_prints_the_plan_as_json_and_the_table_on_stderr():
    result = invoke("--dry-run", "--vocoder.process", "vocoder")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)  # one JSON object, nothing else
    assert [(p["name"], p["stages"]) for p in summary["placement"]["processes"]] == [
        ("main", ["preprocess", "talker"]), ("vocoder", ["vocoder"])]
    lines = result.stderr.splitlines()
    assert lines[0] == "placement of omni-dp-tts: 2 process(es)"
    assert lines[2].split() == ["main", "preprocess,", "talker", "cpu", "undeclared"]
    assert lines[3].split() == ["vocoder", "vocoder", "cpu", "undeclared"]
    assert "vocoder.process = vocoder  (cli: --vocoder.process)" in result.stderr


# --- StageLaunch ------------------------------------------------------------------------------
LAUNCH = StageLaunch(
    process="vocoder", stages=("vocoder",), device="cpu", dtype="float64", threads=1,
    model="tiny", weight_seed=0, page_size=16, num_pages=64, max_running_requests=8,
    max_input_chars=2000, inbox="ipc://inbox-vocoder", front="ipc://inbox-main",
    vocoders=("ipc://inbox-vocoder",), log_level="info", log_format="text")


@pytest.mark.parametrize("launch", [
    LAUNCH,
    StageLaunch(**{**LAUNCH.__dict__, "process": "talker-tp1", "stages": ("talker",),
                   "vocoders": ("ipc://a", "ipc://b"), "budget_bytes": 3 * GiB,
                   "tp": TPRank(rank=1, size=2, store_port=29500, backend="gloo")}),
], ids=["plain", "tp-rank"])
def test_a_stage_launch_survives_its_json_round_trip(launch):
    text = launch.argv_word()
    assert "\n" not in text and isinstance(json.loads(text), dict)  # one argv word
    back = StageLaunch.read(text)
    assert back == launch
    assert isinstance(back.stages, tuple) and isinstance(back.vocoders, tuple)
    assert back.tp is None or isinstance(back.tp, TPRank)
    assert back.argv_word() == text


def test_threads_are_split_among_the_processes_that_run_a_model():
    from omni_dp.engine.placement_plan import process_threads

    split = plan(("preprocess.process", "pre"), ("talker.process", "talker"),
                 ("vocoder.process", "vocoder"), threads=4)
    assert process_threads(split.placement, 4) == {"main": 1, "pre": 1, "talker": 2,
                                                   "vocoder": 2}
    assert process_threads(split.placement, 1) == {"main": 1, "pre": 1, "talker": 1,
                                                   "vocoder": 1}
    assert process_threads(plan(threads=4).placement, 4) == {"main": 4}  # form ①: unchanged


def test_a_gpu_process_leaves_the_cores_to_the_cpu_model_processes():
    from omni_dp.engine.placement_plan import process_threads
    from omni_dp.placement.builtin import BUILTIN_PIPELINE
    from omni_dp.placement.config import load_placement
    from omni_dp.placement.validate import resolve

    def threads_of(*overrides):
        request = load_placement(BUILTIN_PIPELINE, None, overrides)
        placement = resolve(BUILTIN_PIPELINE, request, default_device="cuda:0", gpu_count=1,
                            gpu_total_bytes={0: 80 * GiB}, host_total_bytes=64 * GiB)
        return process_threads(placement, 4)

    assert threads_of() == {"main": 4}  # form ① on a GPU: the whole block, as before
    assert threads_of(("vocoder.process", "vocoder"), ("vocoder.device", "cpu")) == {
        "main": 1, "vocoder": 4}


def test_a_tp_size_that_does_not_split_the_heads_is_refused_before_anything_starts():
    assert problems(("talker.tp_size", "3")) == [
        "talker.tp_size 3: model 'tiny' cannot be split across 3 tensor-parallel ranks: "
        "num_heads = 4 is not divisible by 3; num_kv_heads = 2 is not divisible by 3"]


def test_only_the_talkers_own_fraction_sizes_its_pool():
    # The vocoder's fraction in main is the vocoder's room: the pool keeps its default.
    assert plan(("vocoder.gpu_memory_fraction", "0.5")).kv.max_total_tokens == 16384


def test_an_empty_placement_config_is_a_problem_not_the_default():
    assert problems(placement_config="") == [
        "--placement-config needs a file (a YAML placement); leave it out for the pipeline's "
        "default placement"]


def test_each_gpu_of_a_split_replica_is_checked_against_its_own_free_memory(monkeypatch):
    """Form ④ over two GPUs: each rank's half of the pool on its own GPU, never the whole
    pool against cuda:0's free memory."""
    from omni_dp.engine import placement_plan
    from omni_dp.placement.builtin import BUILTIN_PIPELINE
    from omni_dp.placement.config import load_placement
    from omni_dp.placement.validate import resolve

    request = load_placement(BUILTIN_PIPELINE, None, (
        ("talker.tp_size", "2"), ("talker.devices", "0,1"), ("vocoder.process", "vocoder"),
        ("vocoder.device", "1"), ("talker.gpu_memory_fraction", "0.5"),
        ("vocoder.gpu_memory_fraction", "0.1")))
    placement = resolve(BUILTIN_PIPELINE, request, default_device="cuda:0", gpu_count=2,
                        gpu_total_bytes={0: 80 * GiB, 1: 80 * GiB}, host_total_bytes=64 * GiB)
    needs = {"main": 1 * GiB, "talker-tp0": 30 * GiB, "talker-tp1": 30 * GiB,
             "vocoder": 2 * GiB}
    free = {"cuda:0": 31 * GiB, "cuda:1": 31 * GiB}
    monkeypatch.setattr(placement_plan, "_free_without_context", lambda d: free[str(d)])
    assert placement_plan.split_memory_problems(
        placement, needs, "lower --kv-cache-bytes or --max-total-tokens, or move a stage") == [
        "the processes on cuda:1 — talker-tp1 (talker), vocoder (vocoder) — need 32.00 GiB "
        "together but free memory on cuda:1 is 31.00 GiB; lower --kv-cache-bytes or "
        "--max-total-tokens, or move a stage"]
