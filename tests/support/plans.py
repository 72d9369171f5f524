"""Machines, launch plans and run records built by hand, so that planning and run-state tests
run anywhere: a fake CPU topology, an H200 and an engine sizing; plans for CPU replicas; a whole
run.json as the launcher writes it."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from omni_dp.gpus import GpuFacts
from omni_dp.launcher.engines import EngineSizing
from omni_dp.launcher.planning.facts import LaunchFacts
from omni_dp.launcher.planning.gpus import GpuSlot
from omni_dp.launcher.planning.options import LaunchOptions
from omni_dp.launcher.planning.plan import LaunchPlanError, plan_launch
from omni_dp.launcher.planning.topology import Core, CpuTopology
from omni_dp.launcher.record.state import RunState
from omni_dp.runfile import RunRecord

KiB, MiB, GiB = 1024, 1024**2, 1024**3
GPU_UUID = "GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"


# --- a machine described by hand --------------------------------------------------------------


def smt_topology() -> CpuTopology:
    """4 physical cores × 2 SMT threads (siblings N and N+4); cores 0-1 on node 0, 2-3 on 1."""
    cores = (Core((0, 4), 0), Core((1, 5), 0), Core((2, 6), 1), Core((3, 7), 1))
    return CpuTopology(cores, frozenset(range(8)))


def h200(**changes) -> GpuFacts:
    gpu = GpuFacts(index=0, uuid=GPU_UUID, name="NVIDIA H200", compute_mode="DEFAULT",
                   mig_enabled=False, capability=(9, 0), memory_total_bytes=141 * GiB,
                   memory_used_bytes=0, pci_bus_id="00000000:18:00.0")
    return dataclasses.replace(gpu, **changes)


def sizing(**changes) -> EngineSizing:
    base = EngineSizing(weights_bytes=1 * GiB, kv_cache_bytes=2 * GiB, kv_tokens=1024,
                        overhead_bytes=512 * MiB, device="cuda")
    return dataclasses.replace(base, **changes)


def gpu_slots(*gpus: GpuFacts, nodes: tuple[int | None, ...] | None = None
              ) -> tuple[GpuSlot, ...]:
    """A machine's GPU slots as the lookup reads them: one per GPU, each on NUMA node 1 (the
    H200's in healthy_facts) unless told."""
    nodes = nodes if nodes is not None else (1,) * len(gpus)
    return tuple(GpuSlot(k, g, g.index, node)
                 for k, (g, node) in enumerate(zip(gpus, nodes, strict=True)))


def unchecked_slots(*indices: int) -> tuple[GpuSlot, ...]:
    """GPUs taken as given (--mps --no-gpu-check where NVML sees none)."""
    return tuple(GpuSlot(k, None, index, None) for k, index in enumerate(indices))


def healthy_facts(tmp_path: Path) -> LaunchFacts:
    """A healthy machine: one H200 on NUMA node 1, free ports, no earlier runs."""
    return LaunchFacts(
        state_root=tmp_path / "state",
        new_run_id="run-test-0001",
        topology=smt_topology(),
        slots=gpu_slots(h200()),
        gpu_problems=(),
        mps_binary=None,
        mps_problems=(),
        taken_ports=frozenset(),
        runs=(),
        sizing=sizing(),
        engine_problems=(),
        host_memory_available=64 * GiB,
        numactl=None,
    )


def opts(**changes) -> LaunchOptions:
    """Valid options for two replicas unless changed."""
    return LaunchOptions(**{"replicas": 2, "max_total_tokens": 1024, **changes})


# --- planning ---------------------------------------------------------------------------------


def _tree(root: Path) -> set[Path]:
    return set(root.rglob("*")) if root.exists() else set()


def plan(options: LaunchOptions, facts: LaunchFacts):
    """plan_launch, checking that planning created nothing (the state root stays absent)."""
    existed = facts.state_root.exists()
    before = _tree(facts.state_root.parent)
    try:
        return plan_launch(options, facts)
    finally:
        assert facts.state_root.exists() == existed, "planning created the state directory"
        assert _tree(facts.state_root.parent) == before, "planning created files"


def problems_of(options: LaunchOptions, facts: LaunchFacts) -> list[str]:
    with pytest.raises(LaunchPlanError) as info:
        plan(options, facts)
    problems = info.value.problems
    assert problems
    assert str(info.value) == "\n".join(problems)
    return problems


def two_replica_plan(tmp_path, **options):
    """A plan for two CPU replicas on two cores (run id "run-test"), options changed."""
    facts = LaunchFacts(
        state_root=tmp_path / "state", new_run_id="run-test", topology=CpuTopology(
            (Core((0,), 0), Core((1,), 0)), frozenset({0, 1})),
        gpu_problems=(), mps_binary=None,
        mps_problems=(), taken_ports=frozenset(), runs=(),
        sizing=EngineSizing(weights_bytes=1, kv_cache_bytes=8192 * 1024, kv_tokens=1024,
                            overhead_bytes=1, device="cpu"),
        engine_problems=(), host_memory_available=1 << 34, numactl=None,
    )
    return plan_launch(LaunchOptions(**{"replicas": 2, "max_total_tokens": 1024, **options}),
                       facts)


def one_replica_plan(tmp_path: Path, **options):
    """A plan for one unpinned CPU replica on one core (run id "run-hardening", launched as
    `omni-dp`), options changed."""
    facts = LaunchFacts(
        state_root=tmp_path / "state", new_run_id="run-hardening", topology=CpuTopology(
            (Core((0,), 0),), frozenset({0})),
        gpu_problems=(), mps_binary=None, mps_problems=(),
        taken_ports=frozenset(), runs=(), sizing=EngineSizing(
            weights_bytes=1, kv_cache_bytes=8192 * 1024, kv_tokens=1024, overhead_bytes=1,
            device="cpu"),
        engine_problems=(), host_memory_available=1 << 34, numactl=None, command="omni-dp")
    return plan_launch(LaunchOptions(**{"replicas": 1, "max_total_tokens": 1024,
                                        "cpu_blocks": "none", **options}), facts)


# --- a run's record ---------------------------------------------------------------------------


def gpus_json(count: int) -> list[dict]:
    """`count` H200s as run.json's "gpus" lists them (for gpu_run_record): slot k is GPU index
    k, on NUMA node k."""
    return [{"slot": k, "label": f"GPU-{k}", "index": k, "numa_node": k, "name": "NVIDIA H200"}
            for k in range(count)]


def run_record(run_id: str, replicas: list[dict], daemon: dict | None = None,
               gpu: str = "GPU-test") -> dict:
    """A whole run.json (schema 1) as the launcher writes it; `replicas` holds what differs
    per replica (index and processes at least)."""
    device = "cuda" if daemon else "cpu"
    return {
        "schema": 1, "run_id": run_id, "created_at": time.time(), "state": "running",
        "gpu": gpu, "device": device,
        "plan": {
            "replicas": len(replicas), "engine": "builtin", "engine_args": [],
            "config_file": None, "device": device, "gpu": gpu, "gpu_numa_node": None,
            "mps": daemon is not None, "start": "parallel", "cpu_blocks": "none",
            "kv_cache_bytes": None, "max_total_tokens": 1024, "expected_kv_tokens": 1024,
            "router": {"url": "http://127.0.0.1:1", "policy": "least_request", "workers": 1,
                       "argv": []},
            "supervision": {"check_interval": 2.0, "health_failures": 3, "restart_budget": 5,
                            "restart_window": 600.0, "on_mps_fault": "restart",
                            "health_timeout": 300.0, "drain_timeout": 30.0},
            "log_format": "text", "warnings": [], "command": "omni-dp", "api_key_set": False,
        },
        "launcher": None, "supervisor": None, "router": None,
        "mps": {"daemon": daemon} if daemon else None,
        "replicas": [{"port": 1 + r["index"], "url": f"http://127.0.0.1:{1 + r['index']}",
                      "cpus": None, "argv": [], "env": {}, "log": f"replica_{r['index']}.log",
                      "pid": None, "create_time": None, "pgid": None, "processes": [],
                      "state": "healthy", "kv_tokens": 1024, "mps_attached": None,
                      "restarts": [], "last_error": None, **r} for r in replicas],
    }


def gpu_run_record(run_id: str, replicas: list[dict], gpus: list[dict],
                   daemons: list[dict] | None = None) -> dict:
    """A whole run.json (schema 2) of a run over several GPUs, built on run_record: `gpus` the
    GPUs' records (slot, label, index; numa_node and name optional), `daemons` one daemon
    record per GPU slot (its "gpu"), each replica its GPU slot as "gpu" (default 0)."""
    data = run_record(run_id, replicas, daemons[0] if daemons else None,
                      gpu=",".join(g["label"] for g in gpus))
    data["schema"] = 2
    data["gpus"] = [{"numa_node": None, "name": None, **g} for g in gpus]
    data["mps"] = {"daemons": daemons} if daemons else None
    for replica in data["replicas"]:
        replica.setdefault("gpu", 0)
    return data


def stored_state(directory: Path, data: dict, token: str = "token") -> RunState:
    """A run directory holding this run.json (run_record) and token, as the launcher leaves
    it: its RunState, built without a plan."""
    directory.mkdir(parents=True)
    (directory / "logs").mkdir()
    state = RunState(directory, RunRecord.from_json(data), token)
    state.save()
    (directory / "run_token").write_text(token + "\n")
    return state
