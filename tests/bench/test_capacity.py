"""`omni-dp plan`'s counting on machines built by hand: an H200, an 8-GPU node, a 2-core VM.

Each limit is checked by value and by its formula's numbers; the memory limit against the
launcher's own fit check (what plan says fits, launch accepts; one more, it refuses).
"""

from __future__ import annotations

import dataclasses

import pytest

from omni_dp.bench.capacity import client_cap, config_names, plan_capacity
from omni_dp.bench.probe import probe_capacity
from omni_dp.launcher.engines import EngineSizing
from omni_dp.launcher.planning.gpus import CPU_SLOT
from omni_dp.launcher.planning.options import LaunchOptions
from omni_dp.launcher.planning.topology import Core, CpuTopology
from omni_dp.mps.preflight import CLIENT_CAP_PRE_VOLTA, CLIENT_CAP_VOLTA

from support.plans import GiB, MiB, gpu_slots, h200, healthy_facts, opts, plan, problems_of


def cores(count: int, smt: bool = False, nodes: int = 1) -> CpuTopology:
    """`count` physical cores (with SMT: siblings N and N+count), spread over NUMA nodes."""
    per_node = count // nodes
    made = tuple(Core((i, i + count) if smt else (i,), i // per_node) for i in range(count))
    allowed = frozenset(range(2 * count if smt else count))
    return CpuTopology(made, allowed)


def model(**changes) -> EngineSizing:
    """10 GiB of weights (8 GiB shareable) + 4 GiB KV + 2 GiB overhead = 16 GiB per replica."""
    base = EngineSizing(weights_bytes=10 * GiB, kv_cache_bytes=4 * GiB, kv_tokens=65536,
                        overhead_bytes=2 * GiB, device="cuda", shared_weights_bytes=8 * GiB,
                        processes=(("main", "cuda:0"),))
    return dataclasses.replace(base, **changes)


def on_h200(sizing: EngineSizing | None = None, **kwargs):
    args = {"headroom": 0.05, "shares_weights": True, "cuda_processes_per_replica": 1,
            "bench_args": ("--gpu", "0", "--max-total-tokens", "65536"),
            "engine_args": ("--model", "small"), **kwargs}
    gpu = args.pop("gpu", h200())
    return plan_capacity(sizing or model(), gpu, args.pop("topology", cores(16, smt=True)),
                         **args)


def limit(capacity, name: str):
    return next(limit for limit in capacity.limits if limit.name == name)


def test_an_h200_fits_what_its_memory_holds_and_says_the_numbers():
    c = on_h200()
    # 141 GiB × 0.95 = 133.95 GiB usable; 16 GiB each → 8 (9 would need 144 GiB)
    assert c.n_memory == 8
    assert c.n_cores == 16 and c.n_mps_clients == 48
    assert c.n_fits == 8 and c.limiting == ("memory",)
    formula = limit(c, "memory").formula
    assert "GPU 0 (NVIDIA H200) 141.00 GiB × (1 − 5% headroom) − 0 B in use = 133.95 GiB" \
        in formula
    assert ("8 × (weights 10.00 GiB + KV 4.00 GiB + overhead 2.00 GiB) = 128.00 GiB fits; "
            "9 would need 144.00 GiB") in formula
    assert limit(c, "cpu cores").formula.startswith(
        "16 physical cores this process may use (0-31) ÷ 1 per replica = 16")
    assert c.candidates == ("1", "2mps", "3mps", "4mps", "5mps", "6mps", "7mps", "8mps")
    assert c.bench_command == ("omni-dp bench --configs 1,2mps,3mps,4mps,5mps,6mps,7mps,8mps "
                               "-- --gpu 0 --max-total-tokens 65536 -- --model small")
    assert any(note.startswith("fits, not faster") for note in c.notes)
    assert not any("faster" in note.replace("not faster", "") for note in c.notes)


def test_sharing_weights_raises_the_memory_limit():
    c = on_h200()
    # 8 GiB held once: (133.95 − 8) GiB / (2 + 4 + 2) GiB each = 15
    assert c.n_memory_shared == 15 > c.n_memory
    assert c.n_fits_shared == 15 and c.n_fits == 8
    assert "shared weights 8.00 GiB + 15 × (private weights 2.00 GiB" in limit(
        c, "memory (shared)").formula
    assert any(note.startswith("with --share-weights 15 fit") for note in c.notes)
    plain = on_h200(shares_weights=False)
    assert plain.n_memory_shared is None and plain.n_fits_shared is None
    assert [limit.name for limit in plain.limits] == ["memory", "cpu cores", "mps clients"]


def test_memory_in_use_on_the_gpu_counts_against_the_fit():
    c = on_h200(gpu=h200(memory_used_bytes=40 * GiB))
    assert c.usable_memory_bytes == int(141 * GiB * 0.95) - 40 * GiB
    assert c.n_memory == 5  # 93.95 GiB / 16 GiB


@pytest.mark.parametrize("replicas", [8, 9])
def test_what_plan_says_fits_the_launchers_fit_check_accepts(tmp_path, replicas):
    facts = dataclasses.replace(healthy_facts(tmp_path), sizing=model(kv_tokens=1024),
                                topology=cores(16))
    fits = on_h200().n_memory  # 8
    options = opts(replicas=replicas, cpu_blocks="none")
    if replicas <= fits:
        plan(options, facts)
    else:
        assert any(p.startswith("GPU memory: 9 × ") for p in problems_of(options, facts))


def test_the_mps_client_limit_divides_by_the_cuda_processes_of_a_replica():
    small = model(weights_bytes=1 * GiB, shared_weights_bytes=0, kv_cache_bytes=1 * GiB,
                  overhead_bytes=1 * GiB)
    c = on_h200(small, cuda_processes_per_replica=3, topology=cores(64))
    assert c.n_mps_clients == 16 and c.n_fits == 16 and c.limiting == ("mps clients",)
    assert limit(c, "mps clients").formula == (
        "MPS admits 48 clients per GPU (compute capability 9.0, CUDA ≤ 13.0) ÷ 3 CUDA "
        "process(es) per replica = 16")
    assert client_cap((9, 0)) == CLIENT_CAP_VOLTA == 48
    assert client_cap((6, 1)) == CLIENT_CAP_PRE_VOLTA == 16
    assert client_cap(None) == CLIENT_CAP_VOLTA


def test_an_8_gpu_node_counts_per_gpu_and_in_all():
    # 64 physical cores over 2 NUMA nodes, 2 cores a replica: 32 blocks, 4 per GPU
    c = on_h200(topology=cores(64, smt=True, nodes=2), cores_per_replica=2, gpus=8,
                bench_args=("--gpus", "all", "--max-total-tokens", "65536"))
    assert c.gpu_count == 8
    assert c.n_memory == 8 and c.n_cores == 4 and c.n_mps_clients == 48
    assert c.n_fits == 4 and c.n_fits_total == 32 and c.limiting == ("cpu cores",)
    assert limit(c, "cpu cores").formula.endswith(
        "÷ 2 per replica = 32 in all, ÷ 8 GPUs = 4 per GPU")
    assert c.bench_command == ("omni-dp bench --configs 1,2mps,3mps,4mps -- --gpus all "
                               "--max-total-tokens 65536 -- --model small")
    assert "N is per GPU: 4 on each of 8 GPUs, 32 in all" in c.notes
    assert c.to_json()["n_fits_total"] == 32


def test_a_2_core_vm_is_limited_by_its_cores():
    cpu = model(weights_bytes=26 * MiB, shared_weights_bytes=25 * MiB, kv_cache_bytes=8 * MiB,
                kv_tokens=1024, overhead_bytes=256 * MiB, device="cpu",
                processes=(("main", "cpu"),))
    c = plan_capacity(cpu, None, cores(2), headroom=0.05, shares_weights=True,
                      cuda_processes_per_replica=0, host_memory=8 * GiB,
                      bench_args=("--gpu", "none", "--max-total-tokens", "1024"),
                      engine_args=("--model", "tiny"))
    assert c.n_mps_clients is None and "mps clients" not in [x.name for x in c.limits]
    assert c.n_memory == 28  # 8 GiB host memory (no GPU headroom) / 290 MiB
    assert limit(c, "memory").formula.startswith("host memory available 8.00 GiB: 28 × ")
    assert c.n_cores == 2 and c.n_fits == 2 and c.limiting == ("cpu cores",)
    assert c.candidates == ("1", "2")  # no MPS on the CPU
    assert c.bench_command == ("omni-dp bench --configs 1,2 -- --gpu none --max-total-tokens "
                               "1024 -- --model tiny")


def test_when_not_even_one_replica_fits_there_is_nothing_to_bench():
    c = on_h200(model(weights_bytes=150 * GiB, shared_weights_bytes=0))
    assert c.n_memory == 0 and c.n_fits == 0
    assert c.candidates == () and c.bench_command is None
    assert "not even one replica fits" in limit(c, "memory").formula
    assert any(note.startswith("not even one replica fits") for note in c.notes)


def test_more_cores_per_replica_than_the_machine_has_fits_none():
    c = on_h200(topology=cores(2), cores_per_replica=4)
    assert c.n_cores == 0 and c.n_fits == 0 and c.bench_command is None


def test_config_names():
    assert config_names(3, mps=True) == ("1", "2mps", "3mps")
    assert config_names(3, mps=False) == ("1", "2", "3")
    assert config_names(0, mps=True) == ()


def test_probe_plans_an_8_gpu_node_with_the_launchers_gpu_planner(tmp_path, monkeypatch):
    """probe_capacity on hand-built facts: --gpus all takes every GPU's facts, the one dry
    run's sizing, and puts the run's flags in the bench command."""
    gpus = tuple(h200(index=i, uuid=f"GPU-{i:08d}-0000-0000-0000-000000000000")
                 for i in range(8))
    facts = dataclasses.replace(
        healthy_facts(tmp_path), topology=cores(64, smt=True, nodes=2),
        slots=gpu_slots(*gpus, nodes=(0,) * 4 + (1,) * 4), sizing=model(kv_tokens=1024),
        command="omni-dp")
    seen = []

    def gather(options, *, option_problems):
        seen.append(options)
        return facts

    monkeypatch.setattr("omni_dp.bench.probe.gather_facts", gather)
    planned = probe_capacity(LaunchOptions(gpus="all", max_total_tokens=1024,
                                           engine_args=("--model", "small")),
                             cores_per_replica=2)
    assert seen[0].replicas == 1 and not seen[0].mps
    c = planned.capacity
    assert len(planned.gpus) == 8 and c.gpu_count == 8
    assert c.n_fits == 4 and c.n_fits_total == 32
    assert c.bench_command == ("omni-dp bench --configs 1,2mps,3mps,4mps -- --gpus all "
                               "--max-total-tokens 1024 -- --model small")
    data = planned.to_json()
    assert data["n_fits"] == 4 and data["physical_cores"] == 64 and data["kv_pinned"]
    text = "\n".join(planned.describe())
    assert "= 4 per GPU (set by cpu cores); 32 in all" in text


def test_probe_plans_one_h200_as_launch_would(tmp_path, monkeypatch):
    """--gpu auto on an H200: the GPU found is the one planned for and named in the bench
    command; its replica's three CUDA processes (the dry run's placement) set the MPS limit."""
    three = model(kv_tokens=1024, weights_bytes=1 * GiB, shared_weights_bytes=0,
                  kv_cache_bytes=1 * GiB, overhead_bytes=1 * GiB,
                  processes=(("talker", "cuda:0"), ("vocoder", "cuda:0"), ("front", "cuda:0")))
    facts = dataclasses.replace(healthy_facts(tmp_path), topology=cores(32), sizing=three,
                                command="omni-dp")
    monkeypatch.setattr("omni_dp.bench.probe.gather_facts", lambda options, **_: facts)
    planned = probe_capacity(LaunchOptions(max_total_tokens=1024))
    c = planned.capacity
    assert planned.device == "cuda" and [g.index for g in planned.gpus] == [0]
    assert c.n_mps_clients == 16 and c.n_fits == 16 and c.limiting == ("mps clients",)
    assert c.bench_command.startswith("omni-dp bench --configs 1,2mps,") and \
        c.bench_command.endswith("16mps -- --gpu 0 --max-total-tokens 1024")
    text = "\n".join(planned.describe())
    assert "mps clients    N ≤ 16: MPS admits 48 clients per GPU" in text
    assert "but this replica has none to share" in text


def test_probe_says_the_launchers_problems(tmp_path, monkeypatch):
    from omni_dp.bench.probe import CapacityPlanError

    facts = dataclasses.replace(healthy_facts(tmp_path), slots=(CPU_SLOT,),
                                gpu_problems=("--gpu 3: no such GPU (GPUs: 0)",))
    monkeypatch.setattr("omni_dp.bench.probe.gather_facts", lambda options, **_: facts)
    with pytest.raises(CapacityPlanError) as info:
        probe_capacity(LaunchOptions(gpu="3", max_total_tokens=1000))
    assert info.value.problems[0] == "--gpu 3: no such GPU (GPUs: 0)"
    assert any("--max-total-tokens 1000: the engine would allocate 1024 tokens" in p
               for p in info.value.problems)
