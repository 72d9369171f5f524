"""CPU topology and the replicas' CPU blocks: read /sys once, then plan with no side effects.

Each replica gets its own block of whole physical cores (SMT siblings stay together, never split
between replicas), taken from the CPUs this process may use, preferring the GPU's NUMA node.
Bounding a replica's host work to a fixed core set is what made same-GPU DP pay in the public
reference (unpinned: ~40% of pinned throughput); NUMA locality made no measurable difference
there, so a block off the GPU's node is a warning, not an error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from omni_dp.cpulist import format_cpu_list, parse_cpu_list


@dataclass(frozen=True)
class Core:
    """One physical core: the logical CPUs (SMT siblings) that share it."""

    cpus: tuple[int, ...]
    node: int  # NUMA node, 0 where the machine reports none


@dataclass(frozen=True)
class CpuTopology:
    cores: tuple[Core, ...]  # every core that has at least one allowed CPU
    allowed: frozenset[int]  # the CPUs this process may run on

    def core_of(self, cpu: int) -> Core | None:
        return next((core for core in self.cores if cpu in core.cpus), None)


def read_topology(sysfs: str | Path = "/sys", allowed: set[int] | None = None) -> CpuTopology:
    """Cores (sibling groups restricted to the allowed CPUs) and their NUMA nodes."""
    root = Path(sysfs) / "devices" / "system"
    if allowed is None:
        allowed = set(os.sched_getaffinity(0))
    node_of: dict[int, int] = {}
    for node_dir in sorted((root / "node").glob("node[0-9]*")):
        node = int(node_dir.name[4:])
        try:
            cpulist = (node_dir / "cpulist").read_text().strip()
        except OSError:
            continue
        if not cpulist:
            continue  # a memory-only node (CXL, HBM): it has no CPUs to place
        for cpu in parse_cpu_list(cpulist):
            node_of[cpu] = node
    seen: set[int] = set()
    cores = []
    for cpu in sorted(allowed):
        if cpu in seen:
            continue
        siblings_file = root / "cpu" / f"cpu{cpu}" / "topology" / "thread_siblings_list"
        try:
            siblings = parse_cpu_list(siblings_file.read_text())
        except (OSError, ValueError):
            siblings = [cpu]  # no topology exposed: each CPU is its own core
        group = tuple(c for c in siblings if c in allowed)
        seen.update(siblings)
        cores.append(Core(group, node_of.get(cpu, 0)))
    return CpuTopology(tuple(cores), frozenset(allowed))


@dataclass
class CpuPlan:
    blocks: list[tuple[int, ...]] = field(default_factory=list)  # one per replica; empty: none
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def describe(self) -> list[str]:
        return [format_cpu_list(block) for block in self.blocks]


def plan_auto(topology: CpuTopology, replicas: int, gpu_node: int | None) -> CpuPlan:
    """N ≥ 1 disjoint blocks of equally many whole cores, the GPU's NUMA node first (the plan
    refuses fewer replicas before it asks for blocks)."""
    plan = CpuPlan()
    cores = sorted(topology.cores,
                   key=lambda core: (core.node != gpu_node, core.node, core.cpus[0]))
    per_block = len(cores) // replicas
    if per_block == 0:
        plan.problems.append(
            f"{replicas} replicas need {replicas} physical cores for disjoint CPU blocks, but "
            f"this process may use {len(cores)} ({format_cpu_list(topology.allowed)}); use "
            "fewer replicas, or --cpu-blocks none to run them unpinned (expect lower "
            "throughput)"
        )
        return plan
    for i in range(replicas):
        chunk = cores[i * per_block:(i + 1) * per_block]
        plan.blocks.append(tuple(sorted(cpu for core in chunk for cpu in core.cpus)))
        _warn_numa(plan, i, chunk, gpu_node)
    spare = len(cores) - per_block * replicas
    if spare:
        plan.warnings.append(f"{spare} core(s) left unused so that every block is the same size")
    return plan


def plan_auto_gpus(topology: CpuTopology, groups: list[tuple[int, int | None]]) -> CpuPlan:
    """Blocks for replicas spread over GPUs: `groups` is (replicas, NUMA node) per GPU, in
    replica order. Every block has the same number of whole cores; each GPU's replicas take
    cores of that GPU's node first, then what is left elsewhere; no core serves two GPUs."""
    plan = CpuPlan()
    total = sum(count for count, _ in groups)
    cores = sorted(topology.cores, key=lambda core: (core.node, core.cpus[0]))
    per_block = len(cores) // total if total else 0
    if per_block == 0:
        plan.problems.append(
            f"{total} replicas over {len(groups)} GPUs need {total} physical cores for "
            f"disjoint CPU blocks, but this process may use {len(cores)} "
            f"({format_cpu_list(topology.allowed)}); use fewer replicas per GPU, or "
            "--cpu-blocks none to run them unpinned (expect lower throughput)")
        return plan
    free = list(cores)
    taken: list[list[Core]] = []
    for count, node in groups:  # first pass: each GPU from its own node
        want = count * per_block
        mine = [core for core in free if core.node == node][:want]
        taken.append(mine)
        free = [core for core in free if core not in mine]
    for (count, _), mine in zip(groups, taken, strict=True):  # then what is left, in order
        short = count * per_block - len(mine)
        mine += free[:short]
        free = free[short:]
    index = 0
    for (count, node), mine in zip(groups, taken, strict=True):
        mine.sort(key=lambda core: (core.node != node, core.node, core.cpus[0]))
        for k in range(count):
            chunk = mine[k * per_block:(k + 1) * per_block]
            plan.blocks.append(tuple(sorted(cpu for core in chunk for cpu in core.cpus)))
            _warn_numa(plan, index, chunk, node)
            index += 1
    if free:
        plan.warnings.append(f"{len(free)} core(s) left unused so that every block is the same "
                             "size")
    return plan


def plan_explicit(topology: CpuTopology, replicas: int, text: str,
                  gpu_node: int | None, block_nodes: list[int | None] | None = None) -> CpuPlan:
    """Check user-given blocks (`"0-3 4-7"`, one cpulist per replica) against the machine;
    `block_nodes`: each block's GPU's NUMA node where the run spans GPUs (else gpu_node)."""
    plan = CpuPlan()
    specs = text.split()
    if len(specs) != replicas:
        plan.problems.append(
            f"--cpu-blocks gives {len(specs)} block(s) for {replicas} replicas; give exactly one "
            "CPU list per replica, separated by spaces (e.g. \"0-3 4-7\")"
        )
        return plan
    owner: dict[int, int] = {}  # CPU → the first block that holds it
    for i, spec in enumerate(specs):
        block = _explicit_block(topology, i, spec, owner, plan.problems)
        if block is not None:
            plan.blocks.append(block)
    plan.problems += _split_cores(topology, owner)
    for i, block in enumerate(plan.blocks):
        chunk = [core for core in topology.cores if set(core.cpus) & set(block)]
        _warn_numa(plan, i, chunk, block_nodes[i] if block_nodes else gpu_node)
    if plan.problems:
        plan.blocks = []
    return plan


def _explicit_block(topology: CpuTopology, index: int, spec: str, owner: dict[int, int],
                    problems: list[str]) -> tuple[int, ...] | None:
    """Block `index` as given (None if it is no CPU list); its CPUs join `owner`, and what is
    wrong with it (CPUs not allowed, or in an earlier block) joins `problems`."""
    try:
        block = parse_cpu_list(spec)
    except ValueError as exc:
        problems.append(f"block {index}: {exc}")
        return None
    outside = [cpu for cpu in block if cpu not in topology.allowed]
    if outside:
        problems.append(
            f"block {index} ({spec}) uses CPU(s) {format_cpu_list(outside)} that this process "
            f"may not run on (allowed: {format_cpu_list(topology.allowed)})"
        )
    for cpu in block:
        if cpu in owner:
            problems.append(f"CPU {cpu} is in block {owner[cpu]} and block {index}: "
                            "blocks must not overlap")
        owner.setdefault(cpu, index)
    return tuple(block)


def _split_cores(topology: CpuTopology, owner: dict[int, int]) -> list[str]:
    """SMT siblings must stay in one block: they share one core's execution units."""
    problems = []
    for core in topology.cores:
        holders = {owner[cpu] for cpu in core.cpus if cpu in owner}
        if len(holders) > 1:
            problems.append(
                f"SMT siblings {format_cpu_list(core.cpus)} share one physical core but are "
                f"split between blocks {', '.join(map(str, sorted(holders)))}; keep them in one "
                "block"
            )
    return problems


def _warn_numa(plan: CpuPlan, index: int, cores, gpu_node: int | None) -> None:
    nodes = sorted({core.node for core in cores})
    if len(nodes) > 1:
        plan.warnings.append(f"block {index} spans NUMA nodes {nodes}")
    elif gpu_node is not None and nodes and nodes[0] != gpu_node:
        plan.warnings.append(f"block {index} is on NUMA node {nodes[0]}, the GPU on {gpu_node}")


def gpu_numa_node(pci_bus_id: str, sysfs: str | Path = "/sys") -> int | None:
    """NUMA node of a PCI device (`00000000:18:00.0` as NVML writes it); None if unknown."""
    bus = pci_bus_id.lower()
    if len(bus.split(":")[0]) == 8:  # NVML's 8-digit domain → sysfs's 4 digits
        bus = bus[4:]
    try:
        node = int((Path(sysfs) / "bus" / "pci" / "devices" / bus / "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


