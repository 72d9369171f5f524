"""`launch --gpus`: one run over several GPUs, planned for machines described by hand (2- and
8-GPU hosts, NUMA layouts, a GPU in MIG or exclusive mode) — pure, nothing created."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from omni_dp.gpus import GpuFacts, query_gpus
from omni_dp.launcher.planning import facts as facts_module
from omni_dp.launcher.planning.facts import LaunchFacts, _mps_preflight, look_up_gpus
from omni_dp.launcher.planning.gpus import CPU_SLOT, parse_gpu_list, spread, with_gpu_replicas
from omni_dp.launcher.planning.topology import Core, CpuTopology, plan_auto_gpus

from support.nvml import FakeGpu, FakeNvml
from support.plans import (
    GiB,
    gpu_slots,
    h200,
    healthy_facts,
    opts,
    plan,
    problems_of,
    unchecked_slots,
)

UUIDS = [f"GPU-{k:08x}-0000-4000-8000-00000000000{k:x}" for k in range(8)]


def numa_topology(cores_per_node: int, nodes: int = 2) -> CpuTopology:
    """`nodes` NUMA nodes of `cores_per_node` cores each, no SMT; CPUs numbered by node."""
    cores = tuple(Core((n * cores_per_node + c,), n)
                  for n in range(nodes) for c in range(cores_per_node))
    return CpuTopology(cores, frozenset(cpu for core in cores for cpu in core.cpus))


def gpu(k: int, **changes) -> GpuFacts:
    return h200(index=k, uuid=UUIDS[k], pci_bus_id=f"00000000:{0x18 + k:02x}:00.0", **changes)


def host(tmp_path: Path, gpus: int, nodes: list[int], cores_per_node: int) -> LaunchFacts:
    """A host with `gpus` H200s, GPU k on NUMA node nodes[k]."""
    listed = tuple(gpu(k) for k in range(gpus))
    return dataclasses.replace(
        healthy_facts(tmp_path), topology=numa_topology(cores_per_node, max(nodes) + 1),
        slots=gpu_slots(*listed, nodes=tuple(nodes)))


def node_of(facts: LaunchFacts, cpus: tuple[int, ...]) -> set[int]:
    return {core.node for core in facts.topology.cores if set(core.cpus) & set(cpus)}


# --- a 2-GPU host ------------------------------------------------------------------------------


def test_two_gpus_each_get_their_replicas_daemon_pipe_and_numa_local_cores(tmp_path):
    facts = host(tmp_path, 2, [0, 1], cores_per_node=4)
    p = plan(opts(gpus="all", replicas_per_gpu=2, mps=True, replicas=1), facts)
    assert [r.gpu for r in p.replicas] == [0, 0, 1, 1]
    run = p.run_dir
    for r in p.replicas:
        assert r.env["CUDA_VISIBLE_DEVICES"] == UUIDS[r.gpu]  # its own GPU only, by UUID
        assert r.env["CUDA_MPS_PIPE_DIRECTORY"] == str(run / "mps" / f"gpu{r.gpu}" / "pipe")
        assert r.env["CUDA_MPS_LOG_DIRECTORY"] == str(run / "mps" / f"gpu{r.gpu}" / "log")
        assert node_of(facts, r.cpus) == {r.gpu}  # GPU k is on node k
    blocks = [set(r.cpus) for r in p.replicas]
    assert all(len(b) == 2 for b in blocks)
    assert len(set().union(*blocks)) == 8  # disjoint: no core serves two replicas (or GPUs)
    assert [g.label for g in p.gpus] == UUIDS[:2]
    data = p.to_json()
    assert [(g["slot"], g["index"], g["numa_node"], g["replicas"]) for g in p.gpus_json()] == [
        (0, 0, 0, [0, 1]), (1, 1, 1, [2, 3])]
    assert data["replicas"] == 4 and data["replicas_per_gpu"] == 2
    text = "\n".join(p.describe())
    assert "4 replica(s) of engine builtin on 2 GPUs under a private MPS daemon per GPU" in text
    assert "GPU 1 (NVIDIA H200) replicas 2-3, NUMA node 1: 2 ×" in text
    assert not any("NUMA" in w for w in p.warnings)


def test_replicas_spread_evenly_and_gpus_alone_put_one_on_each(tmp_path):
    facts = host(tmp_path, 2, [0, 1], cores_per_node=4)
    assert [r.gpu for r in plan(opts(gpus="0,1", replicas=3), facts).replicas] == [0, 0, 1]
    assert [r.gpu for r in plan(opts(gpus="1,0", replicas=1), facts).replicas] == [0, 1]
    # look_up_gpus keeps the order given (tested below): slot 0 is GPU 1 here
    given = dataclasses.replace(facts, slots=gpu_slots(gpu(1), gpu(0), nodes=(1, 0)))
    swapped = plan(opts(gpus="1,0", replicas=1), given)
    assert [g.index for g in swapped.gpus] == [1, 0]  # slots in the order given
    assert swapped.replicas[0].env["CUDA_VISIBLE_DEVICES"] == UUIDS[1]
    assert spread(5, 2) == [(0, 1, 2), (3, 4)]
    assert spread(2, 2) == [(0,), (1,)]


def test_the_count_and_the_gpus_must_agree(tmp_path):
    facts = host(tmp_path, 2, [0, 1], cores_per_node=4)
    [problem] = problems_of(opts(gpus="all", replicas=3, replicas_per_gpu=2), facts)
    assert "--replicas 3 and --replicas-per-gpu 2 disagree over 2 GPU(s) (4 replicas)" in problem
    facts3 = host(tmp_path, 3, [0, 0, 1], cores_per_node=4)
    [problem] = problems_of(opts(gpus="all", replicas=2), facts3)
    assert "--replicas 2 over 3 GPUs would leave 1 GPU(s) idle" in problem


def test_gpu_options_that_cannot_go_together_are_refused_at_once(tmp_path):
    facts = host(tmp_path, 2, [0, 1], cores_per_node=4)
    problems = problems_of(opts(gpus="0,1", gpu="0", replicas_per_gpu=0), facts)
    assert any("--gpu 0 and --gpus 0,1 are exclusive" in p for p in problems)
    assert any("--replicas-per-gpu must be from 1 to 65535, got 0" in p for p in problems)
    [problem] = problems_of(opts(replicas_per_gpu=2), healthy_facts(tmp_path))
    assert problem.startswith("--replicas-per-gpu needs --gpus")
    shared = problems_of(opts(gpus="all", share_weights=True), facts)
    assert any(p.startswith("--share-weights shares one copy") for p in shared)


@pytest.mark.parametrize("text, words", [
    ("0,,1", "an empty entry"), ("all,0", "`all` stands alone"), ("0,1,0", "GPU 0 is listed twice"),
])
def test_a_malformed_gpu_list_is_refused(text, words):
    entries, problems = parse_gpu_list(text)
    assert entries == [] and any(words in p for p in problems)
    assert parse_gpu_list("all") == (["all"], [])


def test_the_memory_fit_is_per_gpu_and_names_the_gpu(tmp_path):
    facts = host(tmp_path, 2, [0, 1], cores_per_node=4)
    busy = gpu(1, memory_used_bytes=138 * GiB)
    facts = dataclasses.replace(facts, slots=gpu_slots(gpu(0), busy, nodes=(0, 1)))
    [problem] = problems_of(opts(gpus="all", replicas=1, replicas_per_gpu=2), facts)
    assert problem.startswith("GPU memory of GPU 1 (NVIDIA H200): 2 × (weights")
    assert "138.00 GiB already in use" in problem


# --- an 8-GPU node, two NUMA nodes --------------------------------------------------------------


def test_an_eight_gpu_node_keeps_every_gpus_replicas_on_its_numa_node(tmp_path):
    facts = host(tmp_path, 8, [0, 0, 0, 0, 1, 1, 1, 1], cores_per_node=16)
    p = plan(opts(gpus="all", replicas=1, replicas_per_gpu=2, cpu_blocks="auto"), facts)
    assert len(p.replicas) == 16 and len(p.gpus) == 8
    for r in p.replicas:
        assert len(r.cpus) == 2
        assert node_of(facts, r.cpus) == {0 if r.gpu < 4 else 1}
    assert not p.warnings


def test_too_few_cores_for_every_gpus_replicas_is_one_error_with_the_numbers(tmp_path):
    facts = host(tmp_path, 8, [0, 0, 0, 0, 1, 1, 1, 1], cores_per_node=4)
    [problem] = problems_of(opts(gpus="all", replicas=1, replicas_per_gpu=2), facts)
    assert problem.startswith("16 replicas over 8 GPUs need 16 physical cores for disjoint CPU "
                              "blocks, but this process may use 8 (0-7)")


def test_a_gpu_whose_node_is_short_of_cores_borrows_and_is_warned_about():
    topology = numa_topology(cores_per_node=2)  # node 0: CPUs 0-1, node 1: CPUs 2-3
    cpu_plan = plan_auto_gpus(topology, [(3, 0), (1, 1)])  # 3 replicas want node 0's 2 cores
    assert not cpu_plan.problems
    blocks = cpu_plan.blocks
    assert len(set().union(*map(set, blocks))) == 4
    assert blocks[0] == (0,) and blocks[1] == (1,)
    assert "block 2 is on NUMA node 1, the GPU on 0" in cpu_plan.warnings


# --- facts: looking the GPUs up, MPS preflight per GPU -----------------------------------------


def _fake_inventory(monkeypatch, gpus: list[FakeGpu]) -> None:
    monkeypatch.setattr(facts_module, "query_gpus", lambda: query_gpus(FakeNvml(gpus=gpus)))


def test_gpus_are_looked_up_by_index_uuid_or_all(monkeypatch):
    _fake_inventory(monkeypatch, [FakeGpu(uuid=UUIDS[0]), FakeGpu(uuid=UUIDS[1])])
    found, problems = look_up_gpus(opts(gpus="all"))
    assert [s.gpu.uuid for s in found] == UUIDS[:2] and not problems
    assert [s.slot for s in found] == [0, 1]
    found, problems = look_up_gpus(opts(gpus=f"{UUIDS[1]},0"))
    assert [s.index for s in found] == [1, 0] and not problems
    found, problems = look_up_gpus(opts(gpus=f"0,{UUIDS[0]}"))
    assert [s.index for s in found] == [0]
    assert problems == [f"--gpus 0,{UUIDS[0]} names GPU 0 (NVIDIA H100 80GB HBM3) twice "
                        f"({UUIDS[0]} is GPU 0, listed before)"]
    _, problems = look_up_gpus(opts(gpus="0,5"))
    assert problems[0].startswith("no GPU with index 5")


def test_one_gpu_is_the_one_slot_case_of_the_same_lookup(monkeypatch):
    """--gpu X reads one slot through the lookup --gpus uses; --gpu none and a GPU that is not
    there leave the one CPU slot (the plan says why with the lookup's words)."""
    _fake_inventory(monkeypatch, [FakeGpu(uuid=UUIDS[0]), FakeGpu(uuid=UUIDS[1])])
    [slot], problems = look_up_gpus(opts(gpu="1"))
    assert (slot.slot, slot.index, slot.label, problems) == (0, 1, UUIDS[1], [])
    [slot], _ = look_up_gpus(opts())  # auto: the first GPU
    assert slot.index == 0
    assert look_up_gpus(opts(gpu="none")) == ((CPU_SLOT,), [])
    slots, problems = look_up_gpus(opts(gpu="5"))
    assert slots == (CPU_SLOT,) and problems[0].startswith("no GPU with index 5")


def test_without_nvml_gpus_is_refused_unless_mps_no_gpu_check_takes_indices(monkeypatch):
    _fake_inventory(monkeypatch, [])
    _, problems = look_up_gpus(opts(gpus="0,1"))
    assert problems == ["--gpus 0,1: NVML sees no GPUs; run without --gpus to use the CPU"]
    found, problems = look_up_gpus(opts(gpus="0,1", mps=True, no_gpu_check=True))
    assert (found, problems) == (unchecked_slots(0, 1), [])
    _, problems = look_up_gpus(opts(gpus="all", mps=True, no_gpu_check=True))
    assert "with --no-gpu-check, --gpus takes GPU indices (not UUIDs or all)" in problems[0]


def test_unchecked_gpus_plan_a_daemon_each_and_cpu_replicas(tmp_path):
    facts = dataclasses.replace(healthy_facts(tmp_path), slots=unchecked_slots(0, 1))
    p = plan(opts(gpus="0,1", replicas=1, mps=True, no_gpu_check=True), facts)
    assert p.device == "cpu" and [g.label for g in p.gpus] == ["0", "1"]
    pipes = {r.env["CUDA_MPS_PIPE_DIRECTORY"] for r in p.replicas}
    assert pipes == {str(p.run_dir / "mps" / f"gpu{k}" / "pipe") for k in (0, 1)}
    assert all(r.env["CUDA_VISIBLE_DEVICES"] == "" for r in p.replicas)  # no GPU: on the CPU
    assert any("taken unchecked" in w for w in p.warnings)


def test_unchecked_gpus_still_fit_the_replicas_in_host_memory(tmp_path):
    facts = dataclasses.replace(healthy_facts(tmp_path), slots=unchecked_slots(0, 1),
                                host_memory_available=1 * GiB)
    [problem] = problems_of(opts(gpus="0,1", replicas=1, mps=True, no_gpu_check=True), facts)
    assert problem.startswith("host memory: 2 × (weights") and "1.00 GiB available" in problem


def test_mps_preflight_names_each_gpu_that_cannot_serve(tmp_path):
    mig = gpu(0, mig_enabled=True)
    exclusive = gpu(1, compute_mode="EXCLUSIVE_PROCESS")
    fine = gpu(2)
    options = opts(gpus="all", replicas=3, mps=True, mps_control="/nonexistent/control")
    _, problems = _mps_preflight(options, gpu_slots(mig, exclusive, fine), tmp_path / "run",
                                 None)
    mig_problems = [p for p in problems if "MIG" in p]
    mode_problems = [p for p in problems if "EXCLUSIVE_PROCESS" in p]
    assert mig_problems and all("GPU 0 (NVIDIA H200)" in p for p in mig_problems)
    assert mode_problems and all("GPU 1 (NVIDIA H200)" in p for p in mode_problems)
    assert not any("GPU 2" in p for p in problems)
    binary = [p for p in problems if "/nonexistent/control" in p]
    assert len(binary) == 1  # the same binaries for every GPU: said once
    assert all(p.startswith("--mps: ") for p in problems)


def test_with_gpu_replicas_leaves_a_one_gpu_run_alone():
    o = opts(replicas=3)
    assert with_gpu_replicas(o, 0) == (o, [])
    assert with_gpu_replicas(o, 4) == (o, [])  # no --gpus: --replicas is the count
