"""The launch preflight: a pure plan, every problem at once, BEFORE any resource exists.

Most tests plan for a machine described by hand (LaunchFacts with a fake CPU topology, GPU and
engine sizing), so they run anywhere. A few run the real `omni-dp launch` command line and check
that a bad launch exits 2 with every problem, no traceback, no state directory and no process left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from types import MappingProxyType

import psutil
import pytest

from omni_dp.contract import Problems
from omni_dp.launcher.engines import ENGINES, BuiltinEngine, ReplicaLaunch
from omni_dp.launcher.planning.checks import OPTION_CHECKS, check_options
from omni_dp.launcher.planning.cpus import plan_cpus
from omni_dp.launcher.planning.devices import plan_gpus, plan_mps
from omni_dp.launcher.planning.facts import KnownRun, LaunchFacts, known_runs
from omni_dp.launcher.planning.gpus import CPU_SLOT
from omni_dp.launcher.planning.memory import plan_kv, plan_memory
from omni_dp.launcher.planning.options import FIELDS, LaunchOptions, load_config_file, merge_options
from omni_dp.launcher.planning.plan import THREAD_VARIABLES, LaunchPlanError
from omni_dp.launcher.planning.run import plan_ports, plan_router, plan_run
from omni_dp.launcher.planning.topology import Core, CpuTopology, read_topology
from omni_dp.net import port_taken

from support.plans import (
    GPU_UUID,
    GiB,
    MiB,
    gpu_slots,
    h200,
    healthy_facts,
    opts,
    plan,
    problems_of,
    sizing,
)
from support.ports import free_port_block

PIN = [sys.executable, "-m", "omni_dp.launcher.processes.pin"]


# --- a machine described by hand (its parts: support/plans.py) --------------------------------


@pytest.fixture
def facts(tmp_path) -> LaunchFacts:
    """A healthy machine: one H200 on NUMA node 1, free ports, no earlier runs."""
    return healthy_facts(tmp_path)


@pytest.fixture
def cpu_facts(facts) -> LaunchFacts:
    """The same machine with no GPU (NVML has no driver): the replicas run on CPU."""
    return dataclasses.replace(
        facts, slots=(CPU_SLOT,),
        gpu_problems=("no NVIDIA driver on this machine (libnvidia-ml not found)",),
        sizing=sizing(device="cpu"),
    )


class ProfilingEngine(BuiltinEngine):
    """An engine that sizes its KV from the memory free when it starts (as vLLM and SGLang do
    without a knob): N replicas of it need a pinned KV size."""

    name = "profiling"
    reserved_flags = MappingProxyType({"--port": "--base-port",
                                       "--max-total-tokens": "--max-total-tokens"})
    fixed_default_kv = False
    kv_profiled = True

    def argv(self, launch: ReplicaLaunch, engine_args: tuple[str, ...]) -> list[str]:
        argv = ["profiling-engine", "--port", str(launch.port)]
        if launch.max_total_tokens is not None:
            argv += ["--max-total-tokens", str(launch.max_total_tokens)]
        return argv + list(engine_args)

    def dry_run(self, launch, engine_args, env):
        raise AssertionError("planning never runs an engine")


@pytest.fixture
def profiling(monkeypatch) -> str:
    monkeypatch.setitem(ENGINES, "profiling", ProfilingEngine())
    return "profiling"


def only_problem(options: LaunchOptions, facts: LaunchFacts) -> str:
    problems = problems_of(options, facts)
    assert len(problems) == 1, problems
    return problems[0]


def find(lines, *needles: str) -> str:
    """The one line that contains every needle."""
    hits = [line for line in lines if all(needle in line for needle in needles)]
    assert len(hits) == 1, f"{needles} in {list(lines)}"
    return hits[0]


# --- the valid plan ----------------------------------------------------------------------------


def test_a_valid_plan_gives_each_replica_its_env_pinned_argv_and_a_router_entry(facts):
    p = plan(opts(base_port=8200, router_port=8300), facts)
    assert p.run_id == "run-test-0001"
    assert p.run_dir == facts.state_root / "runs" / "run-test-0001"
    assert p.device == "cuda" and p.gpu_label == GPU_UUID
    assert p.expected_kv_tokens == 1024
    assert p.start == "parallel"
    assert [r.index for r in p.replicas] == [0, 1]
    assert [r.port for r in p.replicas] == [8200, 8201]
    # Auto blocks: whole cores, siblings together, the GPU's node (1) first.
    assert [r.cpus for r in p.replicas] == [(2, 3, 6, 7), (0, 1, 4, 5)]
    for r, cpulist in zip(p.replicas, ["2-3,6-7", "0-1,4-5"], strict=True):
        assert r.env["OMNI_DP_RUN_ID"] == "run-test-0001"
        assert r.env["OMNI_DP_REPLICA"] == str(r.index)
        assert r.env["CUDA_VISIBLE_DEVICES"] == GPU_UUID
        for name in THREAD_VARIABLES:
            assert r.env[name] == "4"
        assert not any(name.startswith("CUDA_MPS") for name in r.env)  # no --mps
        assert list(r.argv[:5]) == [*PIN, cpulist, "--"]
        engine = list(r.argv[5:])
        assert engine[:4] == [sys.executable, "-m", "omni_dp", "serve"]
        assert engine[engine.index("--port") + 1] == str(r.port)
        assert engine[engine.index("--host") + 1] == "127.0.0.1"
        assert engine[engine.index("--device") + 1] == "cuda"
        assert engine[engine.index("--threads") + 1] == "4"
        assert engine[engine.index("--max-total-tokens") + 1] == "1024"
        assert r.url == f"http://127.0.0.1:{r.port}"
    assert "OMP_NUM_THREADS" in THREAD_VARIABLES
    router = list(p.router_argv)
    assert router[:4] == [sys.executable, "-m", "omni_dp", "router"]
    assert router[router.index("--port") + 1] == "8300"
    replicas = [router[i + 1] for i, arg in enumerate(router) if arg == "--replica"]
    assert replicas == ["0=http://127.0.0.1:8200", "1=http://127.0.0.1:8201"]
    assert p.router_url == "http://127.0.0.1:8300"
    # The run token is made at spawn time; the plan (printed, kept in run.json) never has it.
    text = repr(p) + json.dumps(p.to_json()) + "\n".join(p.describe())
    assert "TOKEN" not in text
    assert all("OMNI_DP_RUN_TOKEN" not in r.env for r in p.replicas)
    assert p.warnings == ("block 1 is on NUMA node 0, the GPU on 1",)


def test_mps_gives_replicas_the_private_pipe_and_log_dirs_of_the_run(facts):
    p = plan(opts(mps=True, run_id="mine"), dataclasses.replace(facts, mps_binary="/x/mps"))
    run_dir = facts.state_root / "runs" / "mine"
    assert p.run_dir == run_dir and p.mps_binary == "/x/mps"
    for r in p.replicas:
        assert r.env["CUDA_MPS_PIPE_DIRECTORY"] == str(run_dir / "mps" / "pipe")
        assert r.env["CUDA_MPS_LOG_DIRECTORY"] == str(run_dir / "mps" / "log")


def test_on_cpu_the_replicas_see_no_gpu(cpu_facts):
    p = plan(opts(), cpu_facts)
    assert p.device == "cpu" and p.gpu_label == "cpu"
    for r in p.replicas:
        assert r.env["CUDA_VISIBLE_DEVICES"] == ""
        assert r.argv[r.argv.index("--device") + 1] == "cpu"


def test_numactl_binds_memory_only_for_a_block_on_the_gpus_node(facts):
    p = plan(opts(), dataclasses.replace(facts, numactl="/usr/bin/numactl"))
    near, far = p.replicas
    assert list(near.argv[:8]) == [*PIN, "2-3,6-7", "--", "/usr/bin/numactl", "--membind=1",
                                   "--"]
    assert "/usr/bin/numactl" not in far.argv
    assert list(far.argv[5:7]) == [sys.executable, "-m"]


def test_a_gpu_without_a_uuid_is_still_visible_to_the_replicas(facts):
    p = plan(opts(), dataclasses.replace(facts, slots=gpu_slots(h200(uuid=None, index=2))))
    assert p.device == "cuda" and p.gpu_label == "2"
    assert all(r.env["CUDA_VISIBLE_DEVICES"] == "2" for r in p.replicas)


# --- replicas and the KV pin ------------------------------------------------------------------


@pytest.mark.parametrize("replicas", [0, -1])
def test_replicas_must_be_at_least_one(facts, replicas):
    problem = only_problem(opts(replicas=replicas), facts)
    assert problem == f"--replicas must be at least 1, got {replicas}"


def test_several_replicas_of_an_engine_that_profiles_kv_need_a_pinned_kv_size(facts,
                                                                              profiling):
    problem = only_problem(opts(engine=profiling, max_total_tokens=None), facts)
    assert problem.startswith("--replicas 2 needs a pinned KV size")
    assert "--max-total-tokens" in problem and "--kv-cache-bytes" in problem
    assert "later replicas get less" in problem
    # One replica may size its KV from free memory; pinned, several may run.
    assert plan(opts(engine=profiling, replicas=1, max_total_tokens=None), facts).replicas
    p = plan(opts(engine=profiling), facts)
    assert all(r.argv[-2:] == ("--max-total-tokens", "1024") for r in p.replicas)


def test_builtin_engines_fixed_default_kv_is_pinned_explicitly(facts):
    """The built-in engine's KV without a knob is a fixed 16384 tokens, not profiled: several
    replicas are fine, and each gets the dry run's number on its command line."""
    facts = dataclasses.replace(facts, sizing=sizing(kv_tokens=16384))
    p = plan(opts(max_total_tokens=None), facts)
    assert p.expected_kv_tokens == 16384
    for r in p.replicas:
        assert r.argv[r.argv.index("--max-total-tokens") + 1] == "16384"
    find(p.describe(), "16384 tokens; pinned to the engine's fixed default")


def test_kv_pins_by_bytes_and_by_tokens_are_exclusive(facts):
    problem = only_problem(opts(kv_cache_bytes=2 * GiB), facts)
    assert "--kv-cache-bytes and --max-total-tokens are exclusive" in problem


def test_kv_pinned_by_bytes_plans(facts):
    p = plan(opts(max_total_tokens=None, kv_cache_bytes=2 * GiB), facts)
    argv = p.replicas[0].argv
    assert argv[argv.index("--kv-cache-bytes") + 1] == str(2 * GiB)
    assert "--max-total-tokens" not in argv


def test_max_total_tokens_must_be_what_the_engine_allocates(facts):
    problem = only_problem(opts(max_total_tokens=1000), dataclasses.replace(
        facts, sizing=sizing(kv_tokens=992)))
    assert problem.startswith("--max-total-tokens 1000")
    assert "would allocate 992 tokens" in problem and "ask for 992" in problem


# --- CPU blocks -------------------------------------------------------------------------------


def test_auto_blocks_are_disjoint_whole_cores_gpu_node_first(facts):
    p = plan(opts(replicas=4), facts)
    blocks = [r.cpus for r in p.replicas]
    assert blocks == [(2, 6), (3, 7), (0, 4), (1, 5)]  # node 1 (the GPU's) first
    for block in blocks:  # whole cores only: every CPU's SMT sibling is in the same block
        assert all(set(facts.topology.core_of(cpu).cpus) <= set(block) for cpu in block)
    assert sorted(cpu for block in blocks for cpu in block) == list(range(8))  # disjoint
    assert all(r.env["OMP_NUM_THREADS"] == "2" for r in p.replicas)


def test_auto_blocks_prefer_node_0_when_the_gpu_is_there(facts):
    p = plan(opts(), dataclasses.replace(facts, slots=gpu_slots(h200(), nodes=(0,))))
    assert [r.cpus for r in p.replicas] == [(0, 1, 4, 5), (2, 3, 6, 7)]
    assert p.warnings == ("block 1 is on NUMA node 1, the GPU on 0",)


def test_too_few_cores_for_auto_blocks_names_cpu_blocks_none(facts):
    problem = only_problem(opts(replicas=5), facts)
    assert "5 replicas need 5 physical cores" in problem
    assert "may use 4 (0-7)" in problem
    assert "--cpu-blocks none" in problem


def test_cpu_blocks_none_runs_replicas_unpinned(facts):
    p = plan(opts(replicas=5, cpu_blocks="none", base_port=9000, router_port=9100), facts)
    assert len(p.replicas) == 5
    for r in p.replicas:
        assert r.cpus is None
        assert "omni_dp.launcher.processes.pin" not in r.argv
        assert list(r.argv[:4]) == [sys.executable, "-m", "omni_dp", "serve"]
        assert r.env["OMP_NUM_THREADS"] == "1"  # 8 allowed CPUs // 5 replicas
    assert "unpinned" in "\n".join(p.describe())


def test_explicit_blocks_are_used_as_given(facts):
    p = plan(opts(cpu_blocks="2-3,6-7 0,4"), facts)
    assert [r.cpus for r in p.replicas] == [(2, 3, 6, 7), (0, 4)]
    assert [r.env["OMP_NUM_THREADS"] for r in p.replicas] == ["4", "2"]
    assert list(p.replicas[1].argv[:5]) == [*PIN, "0,4", "--"]


@pytest.mark.parametrize("blocks", ["0-7", "0,4 1,5 2,6", ""])
def test_explicit_blocks_must_be_one_per_replica(facts, blocks):
    problem = only_problem(opts(cpu_blocks=blocks), facts)
    count = len(blocks.split())
    assert problem.startswith(f"--cpu-blocks gives {count} block(s) for 2 replicas")
    assert "exactly one CPU list per replica" in problem


def test_explicit_blocks_must_not_overlap(facts):
    problem = only_problem(opts(cpu_blocks="0-1,4-5 1"), facts)
    assert problem.startswith("CPU 1 is in block 0 and block 1")
    assert "must not overlap" in problem


def test_explicit_blocks_must_use_allowed_cpus(facts):
    facts = dataclasses.replace(facts, topology=CpuTopology(
        (Core((0, 4), 0), Core((1, 5), 0)), frozenset({0, 1, 4, 5})))
    problem = only_problem(opts(cpu_blocks="0,4 8-9"), facts)
    assert "block 1 (8-9) uses CPU(s) 8-9 that this process may not run on" in problem
    assert "(allowed: 0-1,4-5)" in problem


def test_explicit_blocks_must_not_split_smt_siblings(facts):
    problem = only_problem(opts(cpu_blocks="0-1,5 4"), facts)
    assert problem.startswith("SMT siblings 0,4 share one physical core but are split between "
                              "blocks 0, 1")
    assert "keep them in one block" in problem
    # Two split cores: one line for each.
    problems = problems_of(opts(cpu_blocks="0-1 4-5"), facts)
    assert sorted(p.split(" share")[0] for p in problems) == ["SMT siblings 0,4",
                                                               "SMT siblings 1,5"]


def test_malformed_explicit_block_is_a_problem(facts):
    problem = only_problem(opts(cpu_blocks="0,4 x-y"), facts)
    assert problem.startswith("block 1: ") and "not a CPU list" in problem


def test_explicit_blocks_off_the_gpus_node_are_only_a_warning(facts):
    p = plan(opts(cpu_blocks="0,4 1-2,5-6"), facts)
    assert [r.cpus for r in p.replicas] == [(0, 4), (1, 2, 5, 6)]
    assert set(p.warnings) == {"block 0 is on NUMA node 0, the GPU on 1",
                               "block 1 spans NUMA nodes [0, 1]"}
    assert any(w in line for w in p.warnings for line in p.describe())


# --- ports ------------------------------------------------------------------------------------


def test_a_taken_replica_port_is_a_problem(facts):
    facts = dataclasses.replace(facts, taken_ports=frozenset({8101}))
    problem = only_problem(opts(), facts)
    assert problem == "port 8101 (replica 1) is in use; pick another --base-port"


def test_a_taken_router_port_is_a_problem(facts):
    facts = dataclasses.replace(facts, taken_ports=frozenset({8000}))
    problem = only_problem(opts(host="0.0.0.0"), facts)
    assert problem == "port 8000 on 0.0.0.0 (router) is in use; pick another --router-port"


def test_router_port_inside_the_replica_range_is_a_problem(facts):
    problem = only_problem(opts(replicas=3, base_port=8100, router_port=8102), facts)
    assert problem.startswith("--router-port 8102 falls in the replica port range 8100-8102")
    # Just past the range is fine.
    assert plan(opts(replicas=3, base_port=8100, router_port=8103), facts).router_url.endswith(
        ":8103")


@pytest.mark.parametrize(("base_port", "replicas", "last"), [(65535, 2, 65536), (0, 1, 0),
                                                             (65530, 10, 65539)])
def test_replica_ports_must_lie_within_the_port_range(facts, base_port, replicas, last):
    options = opts(base_port=base_port, replicas=replicas, cpu_blocks="none")
    problem = only_problem(options, facts)
    assert problem.startswith(f"--base-port {base_port}: replica ports {base_port}-{last} must "
                              "lie within 1-65535")


@pytest.mark.parametrize("port", [0, 65536])
def test_router_port_must_lie_within_the_port_range(facts, port):
    assert only_problem(opts(router_port=port), facts) == \
        f"--router-port must be 1-65535, got {port}"


# --- MPS and the GPU --------------------------------------------------------------------------


def test_mps_preflight_problems_are_reported(facts):
    facts = dataclasses.replace(facts, mps_problems=(
        "--mps: nvidia-cuda-mps-control was not found; install it",
        "--mps: compute mode is EXCLUSIVE_THREAD; set DEFAULT or EXCLUSIVE_PROCESS",
    ))
    assert problems_of(opts(mps=True), facts) == list(facts.mps_problems)


def test_mps_without_a_gpu_is_a_problem(cpu_facts):
    problem = only_problem(opts(mps=True), cpu_facts)
    assert problem.startswith("--mps needs a GPU")
    assert "no NVIDIA driver on this machine" in problem  # why NVML saw none
    assert "run without --mps" in problem


def test_mps_without_a_gpu_is_one_line_wherever_its_binaries_were_looked_for(cpu_facts):
    facts = dataclasses.replace(cpu_facts, mps_problems=(
        "--mps: nvidia-cuda-mps-control not found on PATH (searched /usr/bin, …)",))
    problem = only_problem(opts(mps=True), facts)
    assert problem == ("--mps needs a GPU, and there is none to use (no NVIDIA driver on this "
                       "machine (libnvidia-ml not found)); run without --mps to use the CPU")
    # with --no-gpu-check the daemon does run: where its binary is matters again
    assert any("not found on PATH" in p for p in problems_of(
        opts(mps=True, no_gpu_check=True), facts))


def test_mps_without_a_gpu_but_no_gpu_check_plans_on_cpu_with_a_warning(cpu_facts):
    p = plan(opts(mps=True, no_gpu_check=True), cpu_facts)
    assert p.device == "cpu"
    assert all("CUDA_MPS_PIPE_DIRECTORY" in r.env for r in p.replicas)
    find(p.warnings, "--no-gpu-check", "attach verification will fail")


def test_mps_needs_the_gpus_uuid(facts):
    facts = dataclasses.replace(facts, slots=gpu_slots(h200(uuid=None, index=2)),
                                mps_binary="/x/mps")
    problem = only_problem(opts(mps=True), facts)
    assert problem.startswith("--mps: NVML could not read the UUID of GPU 2")
    assert "run without --mps" in problem
    plan(opts(), facts)  # without MPS an index is fine (tested above)


def test_no_gpu_check_without_mps_is_a_problem(facts):
    assert only_problem(opts(no_gpu_check=True), facts) == \
        "--no-gpu-check only applies to --mps"


def test_an_explicit_gpu_that_is_not_there_is_a_problem(cpu_facts):
    facts = dataclasses.replace(cpu_facts, gpu_problems=("GPU 3 not found: this machine has 1",))
    assert problems_of(opts(gpu="3"), facts) == ["GPU 3 not found: this machine has 1"]


# --- memory fit -------------------------------------------------------------------------------


def test_replicas_that_do_not_fit_in_gpu_memory_are_a_problem_with_the_numbers(facts):
    facts = dataclasses.replace(
        facts, slots=gpu_slots(h200(memory_total_bytes=16 * GiB, memory_used_bytes=2 * GiB)),
        sizing=sizing(weights_bytes=2 * GiB, kv_cache_bytes=2 * GiB, overhead_bytes=1 * GiB))
    problem = only_problem(opts(replicas=3, cpu_blocks="none"), facts)
    assert problem.startswith("GPU memory: 3 × (weights 2.00 GiB + KV 2.00 GiB + overhead "
                              "1.00 GiB) = 15.00 GiB does not fit")
    assert "the GPU has 16.00 GiB, 2.00 GiB already in use, 5% kept as headroom" in problem
    assert "13.20 GiB usable" in problem  # 16 × 0.95 − 2
    assert "lower the KV size or the replica count" in problem
    # Two of them fit.
    assert len(plan(opts(replicas=2), facts).replicas) == 2


def test_gpu_fit_counts_headroom_and_used_memory_to_the_byte(facts):
    def fits(used: int, headroom: float) -> bool:
        f = dataclasses.replace(facts, slots=gpu_slots(h200(memory_total_bytes=20 * GiB,
                                                memory_used_bytes=used)))
        try:
            plan(opts(memory_headroom=headroom, kv_cache_bytes=None), f)
        except LaunchPlanError as exc:
            assert exc.problems[0].startswith("GPU memory:"), exc.problems
            return False
        return True

    # Each replica: 1 GiB + 2 GiB + 512 MiB = 3.5 GiB → 2 need exactly 7 GiB.
    need = 7 * GiB
    assert fits(used=20 * GiB - need, headroom=0)
    assert not fits(used=20 * GiB - need + 1, headroom=0)
    assert not fits(used=20 * GiB - need, headroom=0.05)
    assert fits(used=0, headroom=0.6)  # 20 GiB × 0.4 = 8 GiB usable
    assert not fits(used=0, headroom=0.7)  # 6 GiB usable


def test_replicas_that_do_not_fit_in_host_memory_are_a_problem(cpu_facts):
    facts = dataclasses.replace(cpu_facts, host_memory_available=int(1.5 * GiB) - 1,
                                sizing=sizing(device="cpu", weights_bytes=256 * MiB,
                                              kv_cache_bytes=256 * MiB, overhead_bytes=256 * MiB))
    problem = only_problem(opts(), facts)
    assert problem.startswith("host memory: 2 × (weights 256.00 MiB + KV 256.00 MiB + overhead "
                              "256.00 MiB) = 1.50 GiB does not fit")
    problem = only_problem(opts(replicas=3, cpu_blocks="none"), facts)
    assert "= 2.25 GiB does not fit in the 1.50 GiB available" in problem
    assert "lower the KV size or the replica count" in problem


# --- run id and earlier runs ------------------------------------------------------------------


@pytest.mark.parametrize("run_id", ["../x", "a/b", "", "..", ".hidden", "/abs", "x" * 65,
                                    "sp ace"])
def test_run_ids_that_are_not_plain_names_are_rejected(facts, run_id):
    problem = only_problem(opts(run_id=run_id), facts)
    assert problem.startswith(f"--run-id {run_id!r} is not a run id")
    assert "no path separators" in problem


def test_a_run_id_with_a_trailing_newline_is_rejected(facts):
    problem = only_problem(opts(run_id="run\n"), facts)
    assert "is not a run id" in problem


def test_a_live_run_with_the_same_id_is_a_problem_naming_omni_dp_down(facts):
    live = KnownRun("mine", facts.state_root / "runs" / "mine", GPU_UUID, live=True)
    problem = only_problem(opts(run_id="mine"), dataclasses.replace(facts, runs=(live,)))
    assert "run mine is still running" in problem
    assert "omni-dp down mine" in problem and "--run-id" in problem


def test_stale_state_with_the_same_id_is_a_problem(facts):
    stale = KnownRun("mine", facts.state_root / "runs" / "mine", GPU_UUID, live=False)
    problem = only_problem(opts(run_id="mine"), dataclasses.replace(facts, runs=(stale,)))
    assert f"earlier run mine is kept at {stale.directory}" in problem
    assert "`omni-dp down mine`" in problem


def test_stale_state_with_the_generated_id_is_a_problem(facts):
    stale = KnownRun("run-test-0001", facts.state_root / "runs" / "run-test-0001", None, False)
    problem = only_problem(opts(), dataclasses.replace(facts, runs=(stale,)))
    assert "omni-dp down run-test-0001" in problem


def test_stale_run_of_another_id_on_the_same_gpu_is_only_a_warning(facts):
    runs = (KnownRun("old-run", facts.state_root / "runs" / "old-run", GPU_UUID, live=False),
            KnownRun("other-gpu", facts.state_root / "runs" / "other-gpu", "GPU-other", False))
    p = plan(opts(run_id="new"), dataclasses.replace(facts, runs=runs))
    assert p.run_id == "new"
    warning = find(p.warnings, "old-run")
    assert "`omni-dp down old-run`" in warning
    assert not any("other-gpu" in w for w in p.warnings)


def test_live_run_of_another_id_on_the_same_gpu_is_only_a_warning(facts):
    live = KnownRun("busy", facts.state_root / "runs" / "busy", GPU_UUID, live=True)
    p = plan(opts(run_id="new"), dataclasses.replace(facts, runs=(live,)))
    find(p.warnings, "run busy is live on the same GPU")


def test_a_state_root_others_can_read_is_a_problem(facts):
    facts.state_root.mkdir(mode=0o755)
    os.chmod(facts.state_root, 0o755)
    problem = only_problem(opts(), facts)
    assert problem.startswith("state directory: ") and "OMNI_DP_STATE_DIR" in problem
    os.chmod(facts.state_root, 0o700)
    assert plan(opts(), facts).run_dir == facts.state_root / "runs" / "run-test-0001"
    assert not (facts.state_root / "runs").exists()


def test_known_runs_read_from_the_state_root_feed_the_plan(facts):
    from omni_dp.launcher.record.state import RunState
    from omni_dp.procs import ProcessIdentity, identify
    from omni_dp.runfile import SupervisorRecord

    runs_dir = facts.state_root / "runs"
    me = identify(os.getpid())
    recycled = ProcessIdentity(os.getpid(), 1.0)  # same pid, another process
    alive = RunState.create(plan(opts(run_id="alive"), facts))
    alive.update(launcher=None, supervisor=SupervisorRecord(me, detached=True))
    dead = RunState.create(plan(opts(run_id="dead"), facts))
    dead.update(launcher=None)
    dead.update_replica(0, identity=recycled)
    assert alive.record.gpu == dead.record.gpu == GPU_UUID
    (runs_dir / "broken").mkdir()
    os.chmod(facts.state_root, 0o700)
    runs = known_runs(facts.state_root)
    assert [(r.run_id, r.gpu, r.live) for r in runs] == [
        ("alive", GPU_UUID, True), ("broken", None, False), ("dead", GPU_UUID, False)]
    facts = dataclasses.replace(facts, runs=runs)
    find(problems_of(opts(run_id="alive"), facts), "run alive is still running")
    find(problems_of(opts(run_id="broken"), facts), "earlier run broken", "omni-dp down broken")
    p = plan(opts(run_id="fresh"), facts)
    find(p.warnings, "run alive is live on the same GPU")
    find(p.warnings, "`omni-dp down dead`")


def test_port_taken_sees_a_listening_socket():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert port_taken("127.0.0.1", port)
    assert not port_taken("127.0.0.1", port)
    assert not port_taken("127.0.0.1", 0) and not port_taken("127.0.0.1", 70000)


# --- engine arguments -------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "flag", "use"), [
    (("--port", "9000"), "--port", "--base-port"),
    (("--device=cuda",), "--device", "--gpu"),
    (("--model", "small", "--threads", "3"), "--threads", "--cpu-blocks"),
    (("--host", "0.0.0.0"), "--host", "--host (the router's)"),
    (("--max-total-tokens=2048",), "--max-total-tokens", "--max-total-tokens"),
    (("--dry-run",), "--dry-run", "--dry-run"),
])
def test_engine_args_the_launcher_sets_are_a_problem(facts, args, flag, use):
    problem = only_problem(opts(engine_args=args), facts)
    assert problem == (f"engine argument {flag} is set by the launcher for every replica; use "
                       f"omni-dp launch {use} instead")


def test_other_engine_args_reach_every_replica(facts):
    p = plan(opts(engine_args=("--model", "small", "--page-size", "32")), facts)
    for r in p.replicas:
        assert list(r.argv[-4:]) == ["--model", "small", "--page-size", "32"]


def test_engine_dry_run_problems_are_reported(facts):
    facts = dataclasses.replace(facts, sizing=None, engine_problems=(
        "engine: --model '/nope' is neither a preset (tiny, small) nor a directory",))
    assert problems_of(opts(), facts) == list(facts.engine_problems)


def test_unknown_engine_is_a_problem(facts):
    problem = only_problem(opts(engine="tensorrt"), facts)
    assert "engine 'tensorrt' is not known" in problem
    assert all(name in problem for name in ("builtin", "vllm", "sglang", "sglang-omni"))


# --- every problem at once --------------------------------------------------------------------


def test_every_problem_is_reported_at_once(cpu_facts, profiling):
    facts = dataclasses.replace(
        cpu_facts, taken_ports=frozenset({8100}), sizing=None,
        mps_problems=("--mps: nvidia-cuda-mps-control was not found",),
        engine_problems=("engine: bad model",))
    options = LaunchOptions(replicas=3, engine=profiling, mps=True, run_id="../x",
                            base_port=8100, router_port=8101, cpu_blocks="0 0 1",
                            engine_args=("--port", "1"))
    problems = problems_of(options, facts)
    for needles in [
        ("--replicas 3 needs a pinned KV size",),
        ("is not a run id",),
        ("--mps needs a GPU",),  # and no word on where its binaries were looked for
        ("port 8100 (replica 0) is in use",),
        ("--router-port 8101 falls in the replica port range",),
        ("CPU 0 is in block 0 and block 1",),
        ("engine argument --port",),
        ("engine: bad model",),
    ]:
        find(problems, *needles)
    assert not [p for p in problems if "nvidia-cuda-mps-control" in p], problems
    assert len(problems) == 8, problems


# --- the sub-planners: a part that failed is never built on -----------------------------------


def test_plan_errors_are_the_shared_problems_type(facts):
    with pytest.raises(Problems) as info:
        plan(opts(replicas=0), facts)
    assert isinstance(info.value, LaunchPlanError)
    assert info.value.problems == ["--replicas must be at least 1, got 0"]


def test_a_refused_replica_count_is_not_planned_with(facts):
    """No CPU blocks, ports or memory fit are worked out for 0 replicas: the one problem is the
    count (a taken port and a block list that could only fit N replicas say nothing)."""
    facts = dataclasses.replace(facts, taken_ports=frozenset({8100}))
    assert problems_of(opts(replicas=0, cpu_blocks="0 1 2"), facts) == [
        "--replicas must be at least 1, got 0"]
    for planner in (plan_cpus, plan_ports):
        assert planner(opts(replicas=0), facts) == (None, [])
    assert plan_memory(opts(replicas=0), facts, *_parts(facts)) == (None, [])


def _parts(facts):
    gpu, _ = plan_gpus(opts(), facts)
    kv, _ = plan_kv(opts(), facts)
    assert gpu is not None and kv is not None
    return gpu, kv


def test_the_memory_fit_waits_for_the_gpu_and_the_engine(cpu_facts):
    """With --mps and no GPU the device is unknown, so the host-memory fit that would fail on
    the CPU is not checked; nor with an engine whose sizes are wrong."""
    small = dataclasses.replace(cpu_facts, host_memory_available=1)
    assert any(p.startswith("host memory:") for p in problems_of(opts(), small))  # it would
    problems = problems_of(opts(mps=True), small)
    assert len(problems) == 1 and problems[0].startswith("--mps needs a GPU"), problems
    mismatch = dataclasses.replace(small, sizing=sizing(device="cpu", kv_tokens=992))
    problems = problems_of(opts(), mismatch)
    assert len(problems) == 1 and problems[0].startswith("--max-total-tokens 1024")
    gpu, _ = plan_gpus(opts(mps=True), small)
    assert gpu is None
    assert plan_memory(opts(), small, gpu, plan_kv(opts(), small)[0]) == (None, [])


def test_a_router_port_among_the_replicas_still_checks_the_replica_ports(facts):
    facts = dataclasses.replace(facts, taken_ports=frozenset({8101}))
    problems = problems_of(opts(base_port=8100, router_port=8100), facts)
    assert problems == ["--router-port 8100 falls in the replica port range 8100-8101; move one "
                        "of them", "port 8101 (replica 1) is in use; pick another --base-port"]
    assert plan_router(opts(base_port=8100, router_port=8100), facts) == (None, [])
    ports, found = plan_ports(opts(base_port=8100, router_port=8100), facts)
    assert ports is None and found == [problems[1]]


def test_replica_ports_out_of_range_are_not_probed(facts):
    facts = dataclasses.replace(facts, taken_ports=frozenset({65535}))
    options = opts(base_port=65535, cpu_blocks="none")
    assert problems_of(options, facts) == [
        "--base-port 65535: replica ports 65535-65536 must lie within 1-65535"]
    assert plan_ports(options, facts) == (None, [])


def test_an_unusable_run_id_is_not_looked_up_among_the_runs(facts):
    runs = (KnownRun("../x", facts.state_root / "x", GPU_UUID, live=True),)
    facts = dataclasses.replace(facts, runs=runs)
    assert plan_run(opts(run_id="../x"), facts) == (None, [])
    assert len(problems_of(opts(run_id="../x"), facts)) == 1  # the id's, not "still running"


def test_each_sub_planner_hands_a_part_to_the_plan(facts):
    """The parts of a good plan are what the plan is built from."""
    o = opts(mps=True, run_id="mine")
    facts = dataclasses.replace(facts, mps_binary="/x/mps")
    gpu, _ = plan_gpus(o, facts)
    run, _ = plan_run(o, facts)
    cpus, _ = plan_cpus(o, facts)
    router, _ = plan_router(o, facts)
    p = plan(o, facts)
    assert (p.device, p.gpu_label) == (gpu.device, gpu.label) == ("cuda", GPU_UUID)
    assert (p.run_id, p.run_dir) == (run.run_id, run.directory)
    assert tuple(r.cpus for r in p.replicas) == cpus.blocks
    assert p.router_argv[:len(router.argv)] == router.argv and p.router_url == router.url
    assert plan_mps(o, facts)[0].binary == p.mps_binary == "/x/mps"


def test_check_options_reports_in_the_order_of_its_table():
    problems = check_options(LaunchOptions(replicas=0, policy="fastest", run_id="a/b",
                                           router_port=0, api_key=" "))
    assert [p.split(" ")[0] for p in problems] == [
        "--replicas", "--policy", "--run-id", "--api-key", "--router-port"]
    assert len(OPTION_CHECKS) >= 10 and check_options(LaunchOptions()) == []


# --- options and the YAML config file ---------------------------------------------------------


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "launch.yaml"
    path.write_text(text)
    return str(path)


def test_config_file_accepts_dashes_and_underscores(tmp_path):
    problems: list[str] = []
    values = load_config_file(write(tmp_path, (
        "replicas: 3\n"
        "max-total-tokens: 2048\n"
        "cpu_blocks: '0-1 2-3 4-5'\n"
        "mps: true\n"
        "memory-headroom: 0\n"
        "router_port: 9000\n"
        "gpu: 1\n"
        "engine-args: [--model, small, --page-size, 32]\n"
        "start: sequential\n"
    )), problems)
    assert problems == []
    assert values == {"replicas": 3, "max_total_tokens": 2048, "cpu_blocks": "0-1 2-3 4-5",
                      "mps": True, "memory_headroom": 0.0, "router_port": 9000, "gpu": "1",
                      "engine_args": ("--model", "small", "--page-size", "32"),
                      "start": "sequential"}
    assert isinstance(values["memory_headroom"], float)


def test_config_engine_args_may_be_one_string(tmp_path):
    problems: list[str] = []
    values = load_config_file(write(tmp_path, "engine_args: --model small\n"), problems)
    assert problems == [] and values == {"engine_args": ("--model", "small")}


def test_config_gpus_may_be_a_list_or_one_string(tmp_path):
    problems: list[str] = []
    values = load_config_file(write(tmp_path, "gpus: [0, GPU-ab]\n"), problems)
    assert problems == [] and values == {"gpus": "0,GPU-ab"}
    assert load_config_file(write(tmp_path, "gpus: all\n"), problems) == {"gpus": "all"}
    load_config_file(write(tmp_path, "gpus: [true]\n"), problems)
    assert problems == [f"--config {tmp_path / 'launch.yaml'}: gpus must be all, or GPU indices "
                        "or UUIDs (a list, or separated by commas)"]


@pytest.mark.parametrize(("text", "expected"), [
    ("kv-cache-bytes: 2GiB", 2 * GiB),
    ("kv_cache_bytes: 512MiB", 512 * MiB),
    ("kv_cache_bytes: 1.5GB", 1_500_000_000),
    ("kv_cache_bytes: 4096", 4096),
])
def test_config_sizes_are_parsed(tmp_path, text, expected):
    problems: list[str] = []
    assert load_config_file(write(tmp_path, text), problems) == {"kv_cache_bytes": expected}
    assert problems == []


def test_config_unknown_key_is_a_problem_listing_the_known_ones(tmp_path):
    problems: list[str] = []
    path = write(tmp_path, "replicas: 2\nreplica_count: 2\n")
    assert load_config_file(path, problems) == {"replicas": 2}
    assert len(problems) == 1
    assert problems[0].startswith(f"--config {path}: unknown setting 'replica_count' (known: ")
    known = problems[0].split("(known: ")[1]
    listed = {name.strip(" )") for name in known.split(",")}
    assert listed == {name.replace("_", "-") for name in FIELDS}
    assert "max-total-tokens" in listed and "cpu-blocks" in listed
    assert {"engine", "engine-args", "engine-python", "engine-stage"} <= listed


@pytest.mark.parametrize(("text", "message"), [
    ("replicas: '2'", "replicas must be an integer"),
    ("replicas: true", "replicas must be an integer"),
    ("base-port: 8100.5", "base-port must be an integer"),
    ("mps: 'yes'", "mps must be true or false"),
    ("detach: 1", "detach must be true or false"),
    ("memory_headroom: lots", "memory-headroom must be a number"),
    ("start-timeout: true", "start-timeout must be a number"),
    ("engine_args: {model: small}", "engine-args must be a list of strings"),
    ("host: [a, b]", "host must be a string"),
    ("kv_cache_bytes: lots", "kv-cache-bytes must be 'lots' is not a size"),
])
def test_config_wrong_types_are_problems(tmp_path, text, message):
    problems: list[str] = []
    path = write(tmp_path, text)
    assert load_config_file(path, problems) == {text.split(":")[0].replace("-", "_"): None}
    assert len(problems) == 1
    assert problems[0].startswith(f"--config {path}: {message}")


def test_config_every_problem_of_a_file_is_reported(tmp_path):
    problems: list[str] = []
    load_config_file(write(tmp_path, "replicas: x\nmps: 2\nnope: 1\n"), problems)
    assert len(problems) == 3


def test_config_missing_file_is_a_problem(tmp_path):
    problems: list[str] = []
    path = str(tmp_path / "absent.yaml")
    assert load_config_file(path, problems) == {}
    assert problems == [f"--config {path}: no such file"]


@pytest.mark.parametrize("text", ["- replicas\n- 2\n", "just text\n", "42\n"])
def test_config_top_level_must_be_a_mapping(tmp_path, text):
    problems: list[str] = []
    path = write(tmp_path, text)
    assert load_config_file(path, problems) == {}
    assert problems == [f"--config {path}: the top level must be a mapping of settings"]


def test_config_that_is_not_yaml_is_a_problem(tmp_path):
    problems: list[str] = []
    path = write(tmp_path, "replicas: [1\n")
    assert load_config_file(path, problems) == {}
    assert len(problems) == 1 and problems[0].startswith(f"--config {path}: cannot read it")


def test_config_empty_file_is_no_settings(tmp_path):
    problems: list[str] = []
    assert load_config_file(write(tmp_path, ""), problems) == {}
    assert problems == []


def test_flags_override_the_file_and_the_file_overrides_defaults():
    options = merge_options(
        {"replicas": 2, "base_port": 9000, "mps": True, "run_id": None},
        {"replicas": 3, "policy": "round_robin"},
        "launch.yaml",
    )
    assert options.replicas == 3  # the flag
    assert options.base_port == 9000 and options.mps is True  # the file
    assert options.policy == "round_robin"
    assert options.router_port == 8000 and options.run_id is None  # defaults
    assert options.config_file == "launch.yaml"


# --- the command line, for real ---------------------------------------------------------------

MARKER = "OMNI_DP_TEST_LAUNCH_MARKER"


def _processes_with(marker: str) -> list[psutil.Process]:
    """Every process that inherited this marker (the launch and whatever it started)."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(MARKER) == marker:
                found.append(proc)
    return found


def launch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`omni-dp launch ARGS`, checking it left no process, no state dir and no traceback."""
    state = tmp_path / "state"
    marker = uuid.uuid4().hex
    env = {**os.environ, "OMNI_DP_STATE_DIR": str(state), MARKER: marker}
    me = psutil.Process()
    children = {p.pid for p in me.children(recursive=True)}
    try:
        done = subprocess.run([sys.executable, "-m", "omni_dp", "launch", *args], env=env,
                              capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL, check=False)
    finally:  # should a bad launch be accepted after all, stop what it started
        leftovers = _processes_with(marker)
        for proc in leftovers:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(leftovers, timeout=10)
    assert leftovers == [], "launch left a process behind"
    assert {p.pid for p in me.children(recursive=True)} <= children
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    assert not state.exists(), "launch created the state directory"
    return done


def problem_lines(done: subprocess.CompletedProcess) -> list[str]:
    return [line.removeprefix("omni-dp launch: ") for line in done.stderr.splitlines()
            if line.startswith("omni-dp launch: ") and "preflight" not in line]


@pytest.mark.parametrize(("args", "needles"), [
    (["--replicas", "2", "--kv-cache-bytes", "1GiB", "--max-total-tokens", "1024"],
     ["--kv-cache-bytes and --max-total-tokens are exclusive"]),
    (["--replicas", "0"], ["--replicas must be at least 1, got 0"]),
    (["--run-id", "../evil"], ["--run-id '../evil' is not a run id"]),
    (["--", "--port", "1"], ["engine argument --port is set by the launcher",
                             "omni-dp launch --base-port"]),
    (["--migration-limit", "-1"], ["--migration-limit must be 0 or more, got -1"]),
    (["--migration-limit", "1"], ["--migration-limit: engine builtin streams no token ids"]),
    (["--migration-max-seq-len", "0"], ["--migration-max-seq-len must be at least 1"]),
], ids=["two-kv-pins", "no-replicas", "run-id-path", "reserved-engine-arg",
        "negative-migration-limit", "migration-for-builtin", "migration-max-seq-len-0"])
def test_cli_bad_options_exit_2_and_leave_nothing(tmp_path, args, needles):
    ports = free_port_block(3)
    done = launch(tmp_path, "--base-port", str(ports), "--router-port", str(ports + 2), *args)
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    line = find(problem_lines(done), *needles)
    assert line


def test_cli_config_problems_are_reported_with_the_plans(tmp_path):
    config = tmp_path / "launch.yaml"
    config.write_text("replicas: 2\nmax-total-tokens: 1024\nreplica_count: 2\n")
    done = launch(tmp_path, "--config", str(config), "--run-id", "../evil")
    assert done.returncode == 2
    lines = problem_lines(done)
    find(lines, "unknown setting 'replica_count'", "known:", "max-total-tokens")
    find(lines, "--run-id '../evil' is not a run id")


def test_cli_flags_override_the_config_file(tmp_path):
    config = tmp_path / "launch.yaml"
    config.write_text("replicas: 2\nmax_total_tokens: 1024\n")
    ports = free_port_block(3)
    done = launch(tmp_path, "--config", str(config), "--replicas", "0",
                  "--base-port", str(ports), "--router-port", str(ports + 2))
    assert done.returncode == 2
    assert problem_lines(done) == ["--replicas must be at least 1, got 0"]


def test_cli_reports_machine_problems_together_and_leaves_nothing(tmp_path):
    """CPU blocks that overlap, a replica port held by a listening socket and a model the
    engine's dry run rejects: three problems, one exit 2, nothing started or created."""
    ports = free_port_block(3)
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports))
        held.listen()
        done = launch(tmp_path, "--replicas", "2", "--max-total-tokens", "1024", "--gpu", "none",
                      "--cpu-blocks", "0 0", "--base-port", str(ports),
                      "--router-port", str(ports + 2), "--", "--model", "/nonexistent-dir")
    assert done.returncode == 2, done.stderr
    lines = problem_lines(done)
    find(lines, "CPU 0 is in block 0 and block 1", "must not overlap")
    find(lines, f"port {ports} (replica 0) is in use", "--base-port")
    find(lines, "engine: --model '/nonexistent-dir' is neither a preset")


def test_cli_dry_run_prints_the_plan_as_json_and_creates_nothing(tmp_path):
    ports = free_port_block(3)
    pinned = len(read_topology().cores) >= 2
    done = launch(tmp_path, "--dry-run", "--json", "--replicas", "2", "--max-total-tokens",
                  "1024", "--gpu", "none", "--cpu-blocks", "auto" if pinned else "none",
                  "--base-port", str(ports), "--router-port", str(ports + 2))
    assert done.returncode == 0, done.stderr
    plan_json = json.loads(done.stdout)
    assert plan_json["replicas"] == 2 and plan_json["device"] == "cpu"
    assert plan_json["expected_kv_tokens"] == 1024
    assert plan_json["run_id"].startswith("run-")
    assert plan_json["router"]["url"] == f"http://127.0.0.1:{ports + 2}"
    router = plan_json["router"]["argv"]
    assert [router[i + 1] for i, arg in enumerate(router) if arg == "--replica"] == \
        [f"0=http://127.0.0.1:{ports}", f"1=http://127.0.0.1:{ports + 1}"]
    replicas = plan_json["replica_plans"]
    assert [r["index"] for r in replicas] == [0, 1]
    assert [r["port"] for r in replicas] == [ports, ports + 1]
    for r in replicas:
        argv = r["argv"]
        assert argv[argv.index("--port") + 1] == str(r["port"])
        assert argv[argv.index("--max-total-tokens") + 1] == "1024"
        if pinned:
            assert argv[:3] == PIN and argv[4] == "--"
    if pinned:
        a, b = (set(r["cpus"]) for r in replicas)
        assert a and b and not a & b
    assert "TOKEN" not in done.stdout


def test_config_key_spelled_both_ways_is_a_problem(tmp_path):
    problems: list[str] = []
    load_config_file(write(tmp_path, "max-total-tokens: 1024\nmax_total_tokens: 2048\n"),
                     problems)
    assert problems == [f"--config {tmp_path / 'launch.yaml'}: max-total-tokens is set twice "
                        "(as 'max-total-tokens' and 'max_total_tokens'); keep one"]


def test_an_address_the_router_cannot_listen_on_is_named():
    from omni_dp.launcher.planning.facts import host_problem

    assert host_problem("127.0.0.1") is None
    problem = host_problem("no-such-host.invalid")
    assert problem is not None and "--host 'no-such-host.invalid'" in problem
    assert not port_taken("no-such-host.invalid", 8000)  # not reported as a busy port


# --- --share-weights ----------------------------------------------------------------------------


def share_facts(facts, **gpu):
    """The H200 machine, its engine sharing 3.5 of 4 GiB of weights (KV 1 GiB, overhead ½)."""
    return dataclasses.replace(
        facts, slots=gpu_slots(h200(**gpu)),
        sizing=sizing(weights_bytes=4 * GiB, shared_weights_bytes=int(3.5 * GiB),
                      kv_cache_bytes=1 * GiB, overhead_bytes=512 * MiB))


@pytest.mark.parametrize("engine", ["vllm", "sglang", "sglang-omni"])
def test_share_weights_with_an_external_engine_is_a_problem_naming_it(facts, engine):
    problems = problems_of(opts(engine=engine, share_weights=True,
                                engine_args=("/models/m",)), facts)
    assert (f"--share-weights: engine {engine} cannot share weights between replicas; only "
            "builtin can: run without --share-weights") in problems


def test_share_weights_gives_replica_0_the_leaders_argv_and_the_others_the_followers(facts):
    p = plan(opts(replicas=3, cpu_blocks="none", share_weights=True), share_facts(facts))
    share = str(p.run_dir / "share")
    for r in p.replicas:
        argv = list(r.argv)
        role = argv[argv.index("--share-weights") + 1]
        assert role == ("leader" if r.index == 0 else "follower")
        assert argv[argv.index("--share-dir") + 1] == share
    assert p.to_json()["share_weights"] is True
    assert find(p.describe(), "  share        replica 0 leads").endswith(
        "replica(s) 1, 2 follow (map them), started once it published, stopped before it")
    assert p.warnings == ()
    plain = plan(opts(replicas=3, cpu_blocks="none"), share_facts(facts))
    assert not any("--share" in arg for r in plain.replicas for arg in r.argv)
    assert plain.to_json()["share_weights"] is False


def test_replicas_that_fit_only_when_sharing_weights_plan_with_the_formula(facts):
    """16 GiB, 5% headroom → 15.20 GiB usable: 3 × 5.5 GiB does not fit, 3.5 + 3 × 2 does."""
    f = share_facts(facts, memory_total_bytes=16 * GiB)
    problem = only_problem(opts(replicas=3, cpu_blocks="none"), f)
    assert problem.startswith("GPU memory: 3 × (weights 4.00 GiB + KV 1.00 GiB + overhead "
                              "512.00 MiB) = 16.50 GiB does not fit")
    p = plan(opts(replicas=3, cpu_blocks="none", share_weights=True), f)
    assert find(p.describe(), "memory ") == (
        "  memory       shared weights 3.50 GiB + 3 × (private weights 512.00 MiB + KV 1.00 GiB "
        "+ overhead 512.00 MiB) = 9.50 GiB (without --share-weights: 3 × (weights 4.00 GiB + "
        "KV 1.00 GiB + overhead 512.00 MiB) = 16.50 GiB)")
    assert "weights 4.00 GiB (3.50 GiB shared, 512.00 MiB private)" in find(p.describe(),
                                                                           "per replica")
    # Sharing is no licence: 8 of them (3.5 + 8 × 2 = 19.5 GiB) still do not fit, in its words.
    problem = only_problem(opts(replicas=8, cpu_blocks="none", share_weights=True), f)
    assert problem.startswith("GPU memory: shared weights 3.50 GiB + 8 × (private weights "
                              "512.00 MiB + KV 1.00 GiB + overhead 512.00 MiB) = 19.50 GiB")


def test_sharing_on_the_cpu_needs_room_for_the_weights_segment_under_the_state_root(cpu_facts):
    """The CPU leader writes every weight (shared and private: weights_bytes) into the run
    directory, under the state root, by default on a tmpfs that may be small."""
    share = dataclasses.replace(cpu_facts, sizing=sizing(
        device="cpu", weights_bytes=4 * GiB, shared_weights_bytes=int(3.5 * GiB)))
    options = opts(replicas=3, cpu_blocks="none", share_weights=True)
    small = dataclasses.replace(share, state_root_free=1 * GiB)
    assert only_problem(options, small) == (
        "--share-weights on the CPU: the leader writes its weights (4.00 GiB, shared and "
        "private; 4.02 GiB with the manifest and padding) as one segment into the run "
        f"directory under {share.state_root}, whose "
        "filesystem has 1.00 GiB free; set OMNI_DP_STATE_DIR to a directory on a filesystem "
        "with room for it, or run without --share-weights")
    plan(options, dataclasses.replace(share, state_root_free=5 * GiB))  # room enough
    with pytest.raises(LaunchPlanError):  # the weights exactly: no room for the rest
        plan(options, dataclasses.replace(share, state_root_free=4 * GiB))
    plan(options, dataclasses.replace(share, state_root_free=None))  # unknown: not refused
    plan(dataclasses.replace(options, share_weights=False), small)  # nothing is written
    # on a GPU the weights are shared in device memory: nothing goes to the state root
    plan(options, dataclasses.replace(share_facts(cpu_facts), state_root_free=1 * GiB))


def test_sharing_weights_with_one_replica_is_a_warning(facts):
    p = plan(opts(replicas=1, cpu_blocks="none", share_weights=True), share_facts(facts))
    assert p.warnings == ("--share-weights with one replica: replica 0 leads and shares with "
                          "nobody (its weights are published all the same)",)
    assert find(p.describe(), "  share        replica 0 leads").endswith("no follower")


def test_share_weights_is_a_config_setting_and_its_engine_flags_are_the_launchers(tmp_path,
                                                                                 facts):
    problems: list[str] = []
    values = load_config_file(write(tmp_path, "share-weights: true\n"), problems)
    assert problems == [] and merge_options(values, {}, None).share_weights is True
    problem = only_problem(opts(engine_args=("--share-weights", "follower")), facts)
    assert problem == ("engine argument --share-weights is set by the launcher for every "
                       "replica; use omni-dp launch --share-weights instead")


def test_a_dry_run_that_did_not_take_the_share_flags_is_a_problem():
    from omni_dp.launcher.engines.builtin import share_problems

    shared = sizing(weights_bytes=4 * GiB, shared_weights_bytes=3 * GiB)
    assert share_problems(shared, "leader", "leader") == []
    assert share_problems(sizing(), None, None) == []
    [problem] = share_problems(shared, "leader", None)
    assert "does not share weights" in problem
    [problem] = share_problems(sizing(shared_weights_bytes=2 * GiB), None, None)
    assert "shared_weights_bytes 2147483648 is not within its weights_bytes" in problem


def test_the_routers_fault_options_are_passed_on_only_when_given(facts):
    """--retries/--resumes/--first-byte-timeout/--stall-timeout go to `omni-dp router` as
    given; left out, the router keeps its own defaults (one home for each)."""
    fault_flags = ("--retries", "--resumes", "--first-byte-timeout", "--stall-timeout")
    plain = list(plan(opts(), facts).router_argv)
    assert not set(fault_flags) & set(plain)
    given = list(plan(opts(retries=0, resumes=2, first_byte_timeout=1.5, stall_timeout=0.0),
                      facts).router_argv)
    assert [given[given.index(flag) + 1] for flag in fault_flags] == ["0", "2", "1.5", "0.0"]
    class_flags = ("--replica-wait", "--max-ejection-percent", "--default-priority",
                   "--reserved-interactive")
    assert not set(class_flags) & set(plain)
    given = list(plan(opts(replica_wait=0.0, max_ejection_percent=34, default_priority="bulk",
                           reserved_interactive=2), facts).router_argv)
    assert [given[given.index(flag) + 1] for flag in class_flags] == ["0.0", "34", "bulk", "2"]


@pytest.mark.parametrize(("changes", "words"), [
    ({"retries": -1}, "--retries must be 0 or more"),
    ({"resumes": -2}, "--resumes must be 0 or more"),
    ({"first_byte_timeout": float("nan")}, "--first-byte-timeout must be a number of seconds"),
    ({"stall_timeout": -1.0}, "--stall-timeout must be a number of seconds"),
    ({"replica_wait": -1.0}, "--replica-wait must be a number of seconds from 0 (no wait)"),
    ({"max_ejection_percent": 0}, "--max-ejection-percent must be from 1 to 100, got 0"),
    ({"max_ejection_percent": 101}, "--max-ejection-percent must be from 1 to 100, got 101"),
    ({"reserved_interactive": -1}, "--reserved-interactive must be 0 or more"),
    ({"default_priority": "urgent"}, "--default-priority must be interactive, default or bulk"),
])
def test_a_bad_router_fault_option_is_refused_by_name(facts, changes, words):
    with pytest.raises(LaunchPlanError) as refused:
        plan(opts(**changes), facts)
    assert any(words in problem for problem in refused.value.problems)


def test_the_launch_help_says_the_routers_own_defaults():
    """The launcher may not import the router (its rooms' rule): the defaults it quotes in
    its help are checked against the router's own here."""
    from omni_dp.launcher.planning.options import FIELDS
    from omni_dp.router.config import RouterConfig

    router = RouterConfig()
    quoted = {"retries": router.retries, "resumes": router.resumes,
              "first_byte_timeout": router.first_byte_timeout_s,
              "stall_timeout": router.stall_timeout_s, "replica_wait": router.replica_wait_s,
              "max_ejection_percent": router.health.max_ejection_percent,
              "reserved_interactive": router.reserved_interactive}
    for name, default in quoted.items():
        assert f"[default: the router's, {default:g}]" in FIELDS[name].metadata["help"], name
    assert f"[default: the router's, {router.default_priority}]" in \
        FIELDS["default_priority"].metadata["help"]


def test_the_plan_names_the_model_and_says_when_it_keeps_no_kv(facts):
    from omni_dp.launcher.engines.builtin import model_words

    seeded = plan(opts(replicas=2), dataclasses.replace(facts, sizing=sizing(
        model=model_words({"model": "tiny", "weights": "seeded"}))))
    assert find(seeded.describe(), "  model        ").endswith(
        "tiny (seeded random weights: a test vehicle, its audio is noise)")
    voice = plan(opts(replicas=2, max_total_tokens=None), dataclasses.replace(facts, sizing=sizing(
        kv_tokens=0, kv_cache_bytes=0,
        model=model_words({"model": "joe", "weights": "seeded", "voice": {}}))))
    assert "  model        joe (a trained voice)" in voice.describe()
    assert "KV 0 B (none: the model keeps no KV cache, so there is nothing to pin)" in find(
        voice.describe(), "  per replica  ")
    assert model_words({"model": "mine", "weights": "loaded"}) == "mine"
    assert model_words({}) is None
