"""CPU blocks for replicas: planned from a fake /sys tree, then checked like a user's input."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from omni_dp.cpulist import format_cpu_list, parse_cpu_list
from omni_dp.launcher.planning.topology import (
    gpu_numa_node,
    plan_auto,
    plan_explicit,
    read_topology,
)


def fake_sysfs(root: Path, nodes: dict[int, str], siblings: dict[int, str]) -> Path:
    """A /sys with NUMA nodes (node → cpulist) and SMT sibling lists (cpu → cpulist)."""
    for node, cpulist in nodes.items():
        node_dir = root / "devices/system/node" / f"node{node}"
        node_dir.mkdir(parents=True)
        (node_dir / "cpulist").write_text(cpulist + "\n")
    for cpu, sibs in siblings.items():
        topo = root / "devices/system/cpu" / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "thread_siblings_list").write_text(sibs + "\n")
    return root


@pytest.fixture
def two_node_smt(tmp_path):
    """2 NUMA nodes × 4 cores × 2 threads; siblings are N and N+8 (the common Linux layout)."""
    siblings = {cpu: f"{cpu % 8},{cpu % 8 + 8}" for cpu in range(16)}
    return fake_sysfs(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15"}, siblings)


def test_cpu_list_round_trip():
    assert parse_cpu_list("0-3,8,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpu_list([11, 10, 8, 3, 2, 1, 0]) == "0-3,8,10-11"
    for bad in ("", "a-b", "3-1", "1,,2"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_topology_groups_siblings_and_nodes(two_node_smt):
    topo = read_topology(two_node_smt, allowed=set(range(16)))
    assert len(topo.cores) == 8
    assert topo.core_of(9).cpus == (1, 9)
    assert topo.core_of(13).node == 1


def test_auto_blocks_are_disjoint_whole_cores_on_the_gpu_node_first(two_node_smt):
    topo = read_topology(two_node_smt, allowed=set(range(16)))
    plan = plan_auto(topo, 2, gpu_node=1)
    assert not plan.problems
    assert plan.describe() == ["4-7,12-15", "0-3,8-11"]  # the GPU's node fills block 0
    assert plan.warnings == ["block 1 is on NUMA node 0, the GPU on 1"]
    plan3 = plan_auto(topo, 3, gpu_node=1)
    assert plan3.describe() == ["4-5,12-13", "6-7,14-15", "0-1,8-9"]
    plan4 = plan_auto(topo, 4, gpu_node=0)
    blocks = [set(b) for b in plan4.blocks]
    assert all(len(b) == 4 for b in blocks)
    assert set().union(*blocks) == set(range(16)) and sum(map(len, blocks)) == 16
    for block in blocks:  # no core split between blocks
        assert all({c % 8, c % 8 + 8} <= block for c in block)
    assert any("NUMA node 1, the GPU on 0" in w for w in plan4.warnings)


def test_auto_respects_the_allowed_cpus(two_node_smt):
    topo = read_topology(two_node_smt, allowed={0, 8, 1, 9, 2})
    plan = plan_auto(topo, 2, gpu_node=0)
    assert plan.describe() == ["0,8", "1,9"]
    assert any("left unused" in w for w in plan.warnings)


def test_auto_with_too_few_cores_names_cpu_blocks_none(two_node_smt):
    topo = read_topology(two_node_smt, allowed={0, 8})
    plan = plan_auto(topo, 2, gpu_node=None)
    assert plan.blocks == []
    assert "--cpu-blocks none" in plan.problems[0]
    assert "may use 1" in plan.problems[0]


def test_machine_without_topology_files_treats_each_cpu_as_a_core(tmp_path):
    topo = read_topology(tmp_path, allowed={0, 1, 2, 3})
    assert plan_auto(topo, 2, gpu_node=None).describe() == ["0-1", "2-3"]


@pytest.mark.parametrize(("text", "message"), [
    ("0-3", "gives 1 block(s) for 2 replicas"),
    ("0-3 3-4", "CPU 3 is in block 0 and block 1"),
    ("0-3 4-7,99", "may not run on"),
    ("0-2 3,8-11", "share one physical core but are split"),
    ("0-3 x", "is not a CPU list"),
])
def test_explicit_blocks_are_checked(two_node_smt, text, message):
    topo = read_topology(two_node_smt, allowed=set(range(16)))
    plan = plan_explicit(topo, 2, text, gpu_node=0)
    assert any(message in p for p in plan.problems), plan.problems
    assert plan.blocks == []


def test_explicit_blocks_accepted_with_numa_warning(two_node_smt):
    topo = read_topology(two_node_smt, allowed=set(range(16)))
    plan = plan_explicit(topo, 2, "0-1,8-9 4-5,12-13", gpu_node=0)
    assert not plan.problems
    assert plan.describe() == ["0-1,8-9", "4-5,12-13"]
    assert plan.warnings == ["block 1 is on NUMA node 1, the GPU on 0"]
    spanning = plan_explicit(topo, 1, "3-4,11-12", gpu_node=None)
    assert spanning.warnings == ["block 0 spans NUMA nodes [0, 1]"]


def test_gpu_numa_node_from_the_pci_bus_id(tmp_path):
    device = tmp_path / "bus/pci/devices/0000:18:00.0"
    device.mkdir(parents=True)
    (device / "numa_node").write_text("1\n")
    assert gpu_numa_node("00000000:18:00.0", tmp_path) == 1
    assert gpu_numa_node("0000:18:00.0", tmp_path) == 1
    (device / "numa_node").write_text("-1\n")
    assert gpu_numa_node("00000000:18:00.0", tmp_path) is None
    assert gpu_numa_node("00000000:19:00.0", tmp_path) is None


def test_this_machine_can_be_read():
    topo = read_topology()
    assert topo.allowed == frozenset(os.sched_getaffinity(0))
    assert {cpu for core in topo.cores for cpu in core.cpus} == set(topo.allowed)


def test_a_memory_only_numa_node_is_skipped(tmp_path):
    """A node with memory and no CPUs (CXL, HBM) has an empty cpulist: no crash, and CPU 0 is
    not credited to it."""
    siblings = {cpu: str(cpu) for cpu in range(4)}
    root = fake_sysfs(tmp_path, {0: "0-1", 1: "2-3", 2: ""}, siblings)
    topo = read_topology(root, allowed={0, 1, 2, 3})
    assert [(core.cpus, core.node) for core in topo.cores] == [
        ((0,), 0), ((1,), 0), ((2,), 1), ((3,), 1)]
