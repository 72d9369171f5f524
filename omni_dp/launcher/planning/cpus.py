"""The replicas' CPU blocks: `--cpu-blocks auto` (whole physical cores, each GPU's replicas on
its NUMA node first), an explicit list checked against the machine, or none."""

from __future__ import annotations

from dataclasses import dataclass

from omni_dp.launcher.planning.checks import replica_count_problems
from omni_dp.launcher.planning.devices import GpuPart
from omni_dp.launcher.planning.facts import LaunchFacts
from omni_dp.launcher.planning.options import LaunchOptions
from omni_dp.launcher.planning.topology import plan_auto, plan_auto_gpus, plan_explicit


@dataclass(frozen=True)
class CpuPart:
    blocks: tuple[tuple[int, ...] | None, ...]  # one per replica; None: unpinned
    warnings: tuple[str, ...] = ()


def plan_cpus(o: LaunchOptions, facts: LaunchFacts,
              gpu: GpuPart | None = None) -> tuple[CpuPart | None, list[str]]:
    """Each replica's CPU block: whole cores, disjoint, its GPU's NUMA node first (over
    several GPUs: each GPU's replicas on that GPU's node first, no core shared)."""
    if replica_count_problems(o):
        return None, []
    if o.cpu_blocks == "none":
        return CpuPart((None,) * o.replicas), []
    groups = gpu.groups if gpu is not None and len(gpu.groups) > 1 else ()
    if o.gpus is not None and not groups and gpu is None:
        return None, []  # plan_gpus said why: no GPUs to place the blocks by
    nodes = [g.numa_node for g in groups for _ in g.replicas] or None
    if o.cpu_blocks == "auto" and groups:
        cpu_plan = plan_auto_gpus(facts.topology, [(len(g.replicas), g.numa_node)
                                                   for g in groups])
    elif o.cpu_blocks == "auto":
        cpu_plan = plan_auto(facts.topology, o.replicas, facts.numa_node)
    else:
        cpu_plan = plan_explicit(facts.topology, o.replicas, o.cpu_blocks, facts.numa_node,
                                 nodes)
    if cpu_plan.problems:
        return None, cpu_plan.problems
    return CpuPart(tuple(cpu_plan.blocks), tuple(cpu_plan.warnings)), []
