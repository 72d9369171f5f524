"""Placement resolution and validation: the four forms, every rule's refusal, budgets, tables.

Each rule gets a configuration that breaks it and the exact message, naming the stages; pure
(no processes, no GPU): the placements are resolved against declared device totals.
"""

from __future__ import annotations

import json

import pytest

from omni_dp.placement.builtin import BUILTIN_PIPELINE
from omni_dp.placement.config import load_placement, split_overrides
from omni_dp.placement.model import (
    EdgeSpec,
    PipelineSpec,
    Placement,
    PlacementConfig,
    PlacementError,
    PlacementRequest,
    Provenance,
    Source,
    StageConfig,
    StageSpec,
)
from omni_dp.placement.table import placement_json, render_table
from omni_dp.placement.validate import budget_problems, resolve
from omni_dp.sizes import GiB

HOST = 64 * GiB
GPU = 80 * GiB


def place(*flags: str, device: str = "cpu", gpus: int = 1,
          pipeline: PipelineSpec = BUILTIN_PIPELINE) -> Placement:
    """Resolve the dotted flags (one string, split on spaces) against `gpus` 80 GiB GPUs."""
    pairs, rest = split_overrides(" ".join(flags).split())
    assert rest == []
    return resolve(pipeline, load_placement(pipeline, None, pairs), default_device=device,
                   gpu_count=gpus, gpu_total_bytes=dict.fromkeys(range(gpus), GPU),
                   host_total_bytes=HOST)


def problems(*flags: str, **kwargs) -> list[str]:
    with pytest.raises(PlacementError) as caught:
        place(*flags, **kwargs)
    return caught.value.problems


def table(placement: Placement) -> list[tuple[str, tuple[str, ...], str]]:
    return [(p.name, p.stages, p.device) for p in placement.processes]


STAGES = ("preprocess", "talker", "vocoder")
APART = "--preprocess.process pre --talker.process talker --vocoder.process vocoder"
SHARED_GPU = "--talker.process talker --vocoder.process vocoder"
FRACTIONS = "--talker.gpu_memory_fraction 0.85 --vocoder.gpu_memory_fraction 0.05"


# --- the four forms --------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_form_one_is_the_default_every_stage_in_main(device):
    placement = place(device=device)
    assert table(placement) == [("main", STAGES, device)]
    assert placement.is_single_process
    assert placement.processes[0].budget_bytes is None


def test_form_two_one_process_per_stage_and_main_empty():
    assert table(place(APART)) == [("main", (), "cpu"), ("pre", ("preprocess",), "cpu"),
                                   ("talker", ("talker",), "cpu"),
                                   ("vocoder", ("vocoder",), "cpu")]


def test_form_three_two_processes_on_one_gpu_with_declared_fractions():
    placement = place(SHARED_GPU, FRACTIONS, device="cuda:0")
    assert table(placement) == [("main", ("preprocess",), "cpu"),
                                ("talker", ("talker",), "cuda:0"),
                                ("vocoder", ("vocoder",), "cuda:0")]
    _, talker, vocoder = placement.processes
    assert (talker.gpu_memory_fraction, talker.budget_bytes) == (0.85, int(0.85 * GPU))
    assert (vocoder.gpu_memory_fraction, vocoder.budget_bytes) == (0.05, int(0.05 * GPU))
    assert placement.device_total_bytes == {"cpu": HOST, "cuda:0": GPU}


def test_form_three_without_fractions_names_both_stages():
    assert problems(SHARED_GPU, device="cuda:0") == [
        "cuda:0 is shared by 2 processes (talker, vocoder), so every GPU stage on it must "
        "declare gpu_memory_fraction; talker, vocoder declare none"]


def test_form_four_tensor_parallel_ranks_on_the_cpu():
    placement = place("--talker.tp_size 2 --talker.devices cpu,cpu")
    assert table(placement) == [("main", ("preprocess", "vocoder"), "cpu"),
                                ("talker-tp0", ("talker",), "cpu"),
                                ("talker-tp1", ("talker",), "cpu")]
    assert [(p.tp_rank, p.tp_size) for p in placement.process_of("talker")] == [(0, 2), (1, 2)]
    assert table(place("--talker.tp_size 2")) == table(placement)  # the CPU's default devices


def test_tp_ranks_on_gpus_and_named_after_an_explicit_process():
    placement = place("--talker.tp_size 2 --talker.devices 0,1 --talker.process tts", gpus=2)
    assert [(p.name, p.device) for p in placement.process_of("talker")] == [
        ("tts-tp0", "cuda:0"), ("tts-tp1", "cuda:1")]


# --- fusion and replicas ---------------------------------------------------------------------
def test_fused_stages_share_the_first_stages_process_and_off_restores_the_names():
    split = "--talker.process a --vocoder.process b"
    fused = place(split, "--placement.fused_stages talker,vocoder")
    assert table(fused) == [("main", ("preprocess",), "cpu"), ("a", ("talker", "vocoder"), "cpu")]
    assert fused.processes[1].provenance == Provenance(Source.DERIVED,
                                                       "fused_stages [talker, vocoder]")
    assert table(place(split)) == [("main", ("preprocess",), "cpu"), ("a", ("talker",), "cpu"),
                                   ("b", ("vocoder",), "cpu")]


def test_replicas_each_get_a_process():
    placement = place("--vocoder.process vocoder --vocoder.replicas 2")
    assert [(p.name, p.replica) for p in placement.process_of("vocoder")] == [
        ("vocoder-r0", 0), ("vocoder-r1", 1)]


# --- edges -----------------------------------------------------------------------------------
LOCAL = PipelineSpec("local", stages=(StageSpec("a", accelerator=False, replicable=True),
                                      StageSpec("b", accelerator=False, replicable=True)),
                     edges=(EdgeSpec("a", "b", "a registry of live objects",
                                     process_local=True),))
LOCAL_SPLIT = ("edge a → b carries a registry of live objects, which lives in process memory; "
               "keep a and b in one process")


def test_a_process_local_edge_may_not_cross_processes():
    assert table(place("--a.process x --b.process x", pipeline=LOCAL)) == [
        ("main", (), "cpu"), ("x", ("a", "b"), "cpu")]
    assert problems("--b.process x", pipeline=LOCAL) == [LOCAL_SPLIT]
    assert problems("--a.process x --b.process x --b.replicas 2", pipeline=LOCAL) == [
        "b.replicas is 2, so b needs a process of its own; its process 'x' also holds a",
        LOCAL_SPLIT]


# --- the rules, each broken ------------------------------------------------------------------
def test_every_non_tp_stage_names_a_process():
    request = PlacementRequest({"talker": StageConfig(process="")}, PlacementConfig())
    with pytest.raises(PlacementError) as caught:
        resolve(BUILTIN_PIPELINE, request, default_device="cpu", gpu_count=0,
                gpu_total_bytes={}, host_total_bytes=HOST)
    assert caught.value.problems == ["talker names no process; give talker.process"]


def test_a_process_spans_at_most_one_gpu():
    assert problems("--talker.device 0 --vocoder.device 1", gpus=2) == [
        "process 'main' would span several GPUs (preprocess on cpu, talker on cuda:0, vocoder "
        "on cuda:1); a process holds any number of CPU stages but at most one GPU"]


def test_main_counts_as_a_process_sharing_the_gpu():
    assert problems("--vocoder.process v --vocoder.gpu_memory_fraction 0.1",
                    device="cuda:0") == [
        "cuda:0 is shared by 2 processes (main, v), so every GPU stage on it must declare "
        "gpu_memory_fraction; talker declares none"]


def test_the_fractions_on_a_gpu_must_fit_the_limit_replicas_counted_each():
    assert problems("--talker.process t --talker.gpu_memory_fraction 0.4",
                    "--vocoder.process v --vocoder.replicas 2 --vocoder.gpu_memory_fraction 0.3",
                    device="cuda:0") == [
        "cuda:0: gpu_memory_fraction sums to 1 over t (talker) 0.4, v-r0 (vocoder) 0.3, "
        "v-r1 (vocoder) 0.3, above placement.max_total_gpu_memory_fraction_per_gpu 0.9"]


def test_one_process_alone_over_the_limit_is_refused():
    assert problems("--talker.gpu_memory_fraction 0.95", device="cuda:0") == [
        "cuda:0: gpu_memory_fraction sums to 0.95 over main (preprocess+talker+vocoder) 0.95, "
        "above placement.max_total_gpu_memory_fraction_per_gpu 0.9"]
    place("--talker.gpu_memory_fraction 0.95 --placement.max_total_gpu_memory_fraction_per_gpu 1",
          device="cuda:0")


def test_on_the_cpu_fractions_are_optional_but_must_fit_when_given():
    place(APART)  # several CPU processes, no fraction: fine
    assert problems("--talker.tp_size 2 --talker.gpu_memory_fraction 0.5") == [
        "cpu: gpu_memory_fraction sums to 1 over talker-tp0 (talker) 0.5, talker-tp1 (talker) "
        "0.5, above placement.max_total_gpu_memory_fraction_per_gpu 0.9"]


def test_tp_rank_names_never_collide_with_another_process():
    assert problems("--talker.tp_size 2 --vocoder.process talker-tp1") == [
        "process name 'talker-tp1' is taken twice: talker's TP rank 1 and the process of "
        "vocoder; rename one (its stage's process)"]


def test_a_tp_stage_keeps_its_processes_to_itself():
    assert problems("--talker.tp_size 2 --talker.process main") == [
        "talker has tp_size 2, so it runs in rank processes of its own; it cannot be in main"]
    assert problems("--talker.tp_size 2 --vocoder.process talker") == [
        "talker has tp_size 2, so it shares its process with no other stage; vocoder names "
        "process 'talker'"]


FUSED_TALKER_VOCODER = "placement.fused_stages group 1 (talker+vocoder)"


@pytest.mark.parametrize(("flags", "expected"), [
    ("--placement.fused_stages preprocess,vocoder",
     ["placement.fused_stages group 1 (preprocess+vocoder): fused stages must be adjacent and "
      "in pipeline order (preprocess → talker → vocoder)"]),
    ("--placement.fused_stages vocoder,talker",
     ["placement.fused_stages group 1 (vocoder+talker): fused stages must be adjacent and in "
      "pipeline order (preprocess → talker → vocoder)"]),
    ("--placement.fused_stages talker,vocder",
     ["unknown stage 'vocder' in placement.fused_stages group 1 (talker+vocder); did you mean "
      "'vocoder'?"]),
    ("--placement.fused_stages preprocess,talker;talker,vocoder",
     ["talker is in placement.fused_stages groups 1 and 2; a stage fuses into one group"]),
    ("--placement.fused_stages talker,vocoder --talker.tp_size 2",
     [f"{FUSED_TALKER_VOCODER}: talker has tp_size 2; a TP stage runs in rank processes of its "
      "own and cannot be fused"]),
    ("--placement.fused_stages talker,vocoder --talker.process t --talker.device 0 "
     "--vocoder.process v --vocoder.device 1",
     [f"{FUSED_TALKER_VOCODER} spans 2 GPUs (talker on cuda:0, vocoder on cuda:1); fused "
      "stages share one process, which holds at most one GPU"]),
])
def test_fusion_is_adjacent_ordered_linear_non_tp_and_on_one_gpu(flags, expected):
    assert problems(flags, gpus=2) == expected


def test_an_empty_fused_group_is_refused(tmp_path):
    path = tmp_path / "placement.yaml"
    path.write_text("placement: {fused_stages: [[]]}\n")
    with pytest.raises(PlacementError) as caught:
        resolve(BUILTIN_PIPELINE, load_placement(BUILTIN_PIPELINE, path, []),
                default_device="cpu", gpu_count=0, gpu_total_bytes={}, host_total_bytes=HOST)
    assert caught.value.problems == ["placement.fused_stages group 1 (empty) is empty"]


@pytest.mark.parametrize(("flags", "expected"), [
    ("--talker.process t --talker.replicas 2",
     "talker.replicas is 2, but talker keeps state across requests (its KV cache); scale it "
     "with DP replicas: omni-dp launch --replicas"),
    ("--vocoder.process main --vocoder.replicas 2",
     "vocoder.replicas is 2, so vocoder needs processes of its own, but vocoder.process is "
     "main, the replica's HTTP front; name another process, or leave vocoder.process unset "
     "(vocoder-r0, vocoder-r1, ...)"),
    ("--vocoder.replicas 2 --vocoder.process v --talker.process v",
     "vocoder.replicas is 2, so vocoder needs a process of its own; its process 'v' also holds "
     "talker"),
])
def test_replicas_only_for_a_replicable_stage_in_a_process_of_its_own(flags, expected):
    assert problems(flags) == [expected]


@pytest.mark.parametrize(("flags", "expected"), [
    ("--vocoder.tp_size 2",
     "vocoder.tp_size is 2, but vocoder cannot be split across ranks; only talker can"),
    ("--talker.tp_size 2 --talker.devices cpu",
     "talker.devices lists 1 device(s) for tp_size 2; give one per rank"),
    ("--talker.tp_size 2 --talker.devices 0,0",
     "talker's TP ranks share a GPU (cuda:0, cuda:0): NCCL needs one GPU per rank"),
    ("--talker.tp_size 2 --talker.devices 0,cpu",
     "talker's TP ranks mix the CPU and GPUs (cuda:0, cpu); put every rank on the CPU, or each "
     "on its own GPU"),
    ("--talker.tp_size 2 --talker.device 0",
     "talker.tp_size is 2 on cuda:0: give talker.devices, one GPU per rank (e.g. 0,1)"),
    ("--talker.device 1", "talker's device is cuda:1, but only 1 GPU(s) visible"),
    ("--talker.tp_size 2 --talker.devices 0,1",
     "talker's rank 1 device is cuda:1, but only 1 GPU(s) visible"),
    ("--preprocess.device 0", "preprocess runs on the CPU only; its device 0 would put it on "
                              "cuda:0"),
    ("--talker.devices 0", "talker.devices is for tp_size > 1 (one device per rank); talker "
                           "has tp_size 1: use talker.device"),
])
def test_devices_and_tensor_parallel_rules(flags, expected):
    assert problems(flags) == [expected]


def test_three_broken_rules_are_three_problems_at_once():
    found = problems("--vocoder.tp_size 2 --preprocess.device 0 --talker.process t",
                     "--talker.replicas 2")
    assert found == [
        "preprocess runs on the CPU only; its device 0 would put it on cuda:0",
        "vocoder.tp_size is 2, but vocoder cannot be split across ranks; only talker can",
        "talker.replicas is 2, but talker keeps state across requests (its KV cache); scale it "
        "with DP replicas: omni-dp launch --replicas",
    ]


# --- budgets and tables ----------------------------------------------------------------------
def test_budget_problems_name_the_process_its_stages_and_both_sizes():
    placement = place(SHARED_GPU, FRACTIONS, device="cuda:0")
    assert budget_problems(placement, {"talker": 60 * GiB, "vocoder": 5 * GiB, "main": GiB}) == [
        "process vocoder (vocoder) needs 5.00 GiB, over its budget of 4.00 GiB "
        "(0.05 × 80.00 GiB of cuda:0)"]


def test_cpu_budgets_are_fractions_of_the_declared_cpu_memory():
    placement = place(APART, "--talker.gpu_memory_fraction 0.5",
                      "--placement.cpu_device_memory_bytes 8GiB")
    assert placement.process_of("talker")[0].budget_bytes == 4 * GiB
    assert budget_problems(placement, {"talker": 5 * GiB}) == [
        "process talker (talker) needs 5.00 GiB, over its budget of 4.00 GiB "
        "(0.5 × 8.00 GiB of cpu)"]


def test_placement_json_is_serialisable_with_every_source():
    data = json.loads(json.dumps(placement_json(
        place("--talker.tp_size 2 --talker.devices cpu,cpu"))))
    assert data["pipeline"] == "omni-dp-tts"
    assert data["processes"][1] == {"name": "talker-tp0", "stages": ["talker"], "device": "cpu",
                                    "gpu_memory_fraction": None, "budget_bytes": None,
                                    "tp_rank": 0, "tp_size": 2, "replica": None,
                                    "source": "derived (talker.tp_size 2)"}
    assert data["stages"]["talker"]["devices"] == {"value": ["cpu", "cpu"],
                                                   "source": "cli (--talker.devices)"}
    assert data["placement"]["fused_stages"] == {"value": [], "source": "default"}


def test_render_table_shows_budgets_and_where_values_came_from():
    text = render_table(place(SHARED_GPU, FRACTIONS, device="cuda:0"))
    assert text.splitlines() == [
        "placement of omni-dp-tts: 3 process(es)",
        "  process  stages      device  memory budget",
        "  main     preprocess  cpu     undeclared",
        "  talker   talker      cuda:0  0.85 × 80.00 GiB = 68.00 GiB",
        "  vocoder  vocoder     cuda:0  0.05 × 80.00 GiB = 4.00 GiB",
        "set:",
        "  talker.gpu_memory_fraction = 0.85  (cli: --talker.gpu_memory_fraction)",
        "  talker.process = talker  (cli: --talker.process)",
        "  vocoder.gpu_memory_fraction = 0.05  (cli: --vocoder.gpu_memory_fraction)",
        "  vocoder.process = vocoder  (cli: --vocoder.process)",
    ]


def test_the_default_device_must_be_resolved_by_the_caller():
    with pytest.raises(ValueError, match="default_device must be 'cpu' or 'cuda:N', got 'cuda'"):
        place(device="cuda")


# --- replicas named after their stage; fusion refuses them -----------------------------------
def test_a_replicated_stage_is_named_after_itself_by_default():
    placement = place("--vocoder.replicas 2")
    assert table(placement) == [("main", ("preprocess", "talker"), "cpu"),
                                ("vocoder-r0", ("vocoder",), "cpu"),
                                ("vocoder-r1", ("vocoder",), "cpu")]
    assert {p.provenance for p in placement.process_of("vocoder")} == {
        Provenance(Source.DERIVED, "vocoder.replicas 2")}


def test_a_replicated_stage_is_not_fused_and_the_problem_names_the_group():
    expected = (f"{FUSED_TALKER_VOCODER}: vocoder has replicas 2; a replicated stage runs in "
                "processes of its own and cannot be fused")
    assert problems("--vocoder.replicas 2 --placement.fused_stages talker,vocoder") == [expected]
    assert problems("--talker.process t --vocoder.process v --vocoder.replicas 2",
                    "--placement.fused_stages talker,vocoder") == [expected]


def test_an_unknown_fused_stage_is_quoted_briefly():
    long = "x" * 100_000
    [problem] = problems(f"--placement.fused_stages talker,{long}")
    assert problem == (f"unknown stage '{'x' * 17}...{'x' * 18}' in placement.fused_stages "
                       f"group 1 (talker+{'x' * 50}...); the stages are preprocess, talker, "
                       "vocoder")


# --- bounds, for a request built by hand too -------------------------------------------------
def resolve_request(request: PlacementRequest) -> Placement:
    return resolve(BUILTIN_PIPELINE, request, default_device="cpu", gpu_count=0,
                   gpu_total_bytes={}, host_total_bytes=HOST)


@pytest.mark.parametrize(("stages", "placement", "expected"), [
    ({"talker": StageConfig(tp_size=10**23)}, PlacementConfig(),
     "talker.tp_size must be 1-64, got 100000000000000000000000"),
    ({"vocoder": StageConfig(process="v", replicas=10**23)}, PlacementConfig(),
     "vocoder.replicas must be 1-64, got 100000000000000000000000"),
    ({"vocoder": StageConfig(replicas=0)}, PlacementConfig(), "vocoder.replicas must be 1-64, "
                                                              "got 0"),
    ({}, PlacementConfig(cpu_device_memory_bytes=0),
     "placement.cpu_device_memory_bytes must be 1 byte to 1 EiB (2**60 bytes), or None for the "
     "host's memory; got 0"),
    ({}, PlacementConfig(cpu_device_memory_bytes=10**400),
     "placement.cpu_device_memory_bytes must be 1 byte to 1 EiB (2**60 bytes), or None for the "
     "host's memory; got <an integer of 1329 bits>"),
])
def test_a_hand_built_request_out_of_bounds_is_a_problem_not_an_overflow(stages, placement,
                                                                          expected):
    with pytest.raises(PlacementError) as caught:
        resolve_request(PlacementRequest(stages, placement))
    assert caught.value.problems == [expected]


def test_the_host_memory_is_the_cpu_total_only_where_none_is_declared():
    declared = resolve_request(PlacementRequest({}, PlacementConfig(cpu_device_memory_bytes=1)))
    assert declared.device_total_bytes == {"cpu": 1}
    assert resolve_request(PlacementRequest({}, PlacementConfig())).device_total_bytes == {
        "cpu": HOST}


# --- derived processes say so ----------------------------------------------------------------
def test_a_fused_groups_process_says_fusion_put_the_stages_there():
    placement = place("--talker.process t --vocoder.process v",
                      "--placement.fused_stages talker,vocoder")
    data = json.loads(json.dumps(placement_json(placement)))
    assert [(p["name"], p["stages"], p["source"]) for p in data["processes"]] == [
        ("main", ["preprocess"], "default"),
        ("t", ["talker", "vocoder"], "derived (fused_stages [talker, vocoder])")]
    assert data["stages"]["vocoder"]["process"] == {"value": "v",
                                                    "source": "cli (--vocoder.process)"}
    text = render_table(placement).splitlines()
    assert text[text.index("derived:") + 1] == "  t ← fused_stages [talker, vocoder]"


def test_fusion_into_main_marks_main_and_a_no_op_fusion_marks_nothing():
    into_main = place("--vocoder.process v --placement.fused_stages talker,vocoder")
    assert [(p.name, p.provenance) for p in into_main.processes] == [
        ("main", Provenance(Source.DERIVED, "fused_stages [talker, vocoder]"))]
    no_op = place("--talker.process a --vocoder.process a --placement.fused_stages talker,vocoder")
    assert no_op.processes[1].provenance == Provenance(Source.CLI, "--talker.process")
    assert "derived:" not in render_table(no_op)


def test_the_table_lists_derived_processes_once_per_derivation():
    placement = place("--talker.tp_size 2 --vocoder.replicas 2")
    lines = render_table(placement).splitlines()
    assert lines[lines.index("derived:") + 1:lines.index("set:")] == [
        "  talker-tp0, talker-tp1 ← talker.tp_size 2",
        "  vocoder-r0, vocoder-r1 ← vocoder.replicas 2"]
    assert [p["source"] for p in placement_json(placement)["processes"]] == [
        "default", "derived (talker.tp_size 2)", "derived (talker.tp_size 2)",
        "derived (vocoder.replicas 2)", "derived (vocoder.replicas 2)"]
