"""Per-replica MPS caps (--mps-thread-percentage, --mps-memory-limit): planned, refused where
they cannot hold, given to each replica as its MPS client environment, and an SM-capped
replica's BF16 GEMM check run before its engine — which never starts when the check fails.

The live side (the real control daemon given the caps and reading them back, after a daemon
restart too; the replicas' environment; the check's event) is in test_launcher_gpus.py, in
its one two-GPU launch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omni_dp.launcher.planning.plan import LaunchPlanError
from omni_dp.launcher.processes import bf16_gemm_check
from omni_dp.mps.daemon import DaemonLimits, DaemonRecord
from omni_dp.procs import ProcessIdentity

from support.plans import GiB, MiB, healthy_facts, opts, plan, problems_of

GATE = [sys.executable, "-m", "omni_dp.launcher.processes.numeric_gate"]
# A TEST STAND-IN for an engine interpreter whose GEMM is wrong under its cap: it prints what
# bf16_gemm_check.py prints for a wrong answer (sglang-omni's H200 figure) and exits 1.
WRONG_GEMM = (Path(__file__).parent.parent / "support" / "wrong_gemm_python.sh").resolve()


@pytest.fixture
def facts(tmp_path):
    return dataclasses.replace(healthy_facts(tmp_path), mps_binary="/x/mps")


# --- the plan ---------------------------------------------------------------------------------

def test_caps_are_each_replicas_mps_client_environment_and_the_sm_cap_is_gated(facts):
    p = plan(opts(mps=True, mps_thread_percentage=40.0, mps_memory_limit=4 * GiB), facts)
    for r in p.replicas:
        assert r.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
        assert r.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"  # by index, in MiB
        gate = r.argv.index("omni_dp.launcher.processes.numeric_gate")
        tail = list(r.argv[gate + 1:])
        assert tail[:6] == ["--python", sys.executable, "--device", "cuda", "--record",
                            str(p.run_dir / "logs" / f"replica_{r.index}.numeric_check.json")]
        assert tail[6] == "--" and tail[8:11] == ["-m", "omni_dp", "serve"]  # then the engine
    record = p.to_json()
    assert (record["mps_thread_percentage"], record["mps_memory_limit"]) == (40.0, 4 * GiB)
    assert record["options"]["mps_thread_percentage"] == 40.0  # a restart or scale keeps them
    assert any(line.strip().startswith("mps caps     40% of the SMs and 4.00 GiB of pinned memory "
                                       "per replica process; each replica passes a BF16 GEMM "
                                       "check") for line in p.describe())


def test_uncapped_by_default_and_a_memory_cap_alone_needs_no_numeric_check(facts):
    for r in plan(opts(mps=True), facts).replicas:
        assert not {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"} \
            & set(r.env)
        assert "omni_dp.launcher.processes.numeric_gate" not in r.argv
    for r in plan(opts(mps=True, mps_memory_limit=512 * MiB * 8), facts).replicas:
        assert r.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
        assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in r.env
        assert "omni_dp.launcher.processes.numeric_gate" not in r.argv  # kernels unchanged


def test_caps_need_mps_and_sane_values_every_problem_at_once(facts):
    problems = problems_of(opts(mps_thread_percentage=0.5, mps_memory_limit=1536 * MiB), facts)
    assert problems[0] == ("--mps-thread-percentage and --mps-memory-limit need --mps: the "
                           "caps are the MPS daemon's to enforce; add --mps, or drop the cap")
    assert "--mps-thread-percentage must be a percentage of the GPU's SMs from 1 to 100, got " \
           "0.5" in problems
    assert any(p.startswith(f"--mps-memory-limit {1536 * MiB} bytes: the MPS daemon keeps "
                            "whole MiB") for p in problems)
    for bad in (101.0, math.nan, -3.0):
        assert any("from 1 to 100" in p for p in problems_of(
            opts(mps=True, mps_thread_percentage=bad), facts))
    # P × N over 100 is MPS's design, not a problem
    plan(opts(mps=True, mps_thread_percentage=100.0), facts)


def test_a_thread_percentage_finer_than_the_daemon_keeps_is_refused_before_anything_starts(
        facts):
    """The real daemon keeps one decimal (12.35 is read back as 12.3, tests/mps): refused at
    plan time with the two nearest it keeps, not at the daemon's start."""
    assert problems_of(opts(mps=True, mps_thread_percentage=12.35), facts) == [
        "--mps-thread-percentage 12.35: the MPS daemon keeps one decimal; give e.g. 12.3 or "
        "12.4"]
    for kept in (12.3, 40.0, 1.0):
        plan(opts(mps=True, mps_thread_percentage=kept), facts)


def test_a_memory_cap_below_a_replicas_footprint_is_refused(facts):
    # support/plans.py's replica: weights 1GiB + KV 2GiB + overhead 512MiB = 3.5GiB
    with pytest.raises(LaunchPlanError) as refused:
        plan(opts(mps=True, mps_memory_limit=3 * GiB), facts)
    assert refused.value.problems == [
        "--mps-memory-limit 3.00 GiB is below one replica's planned footprint: weights 1.00 GiB "
        "+ KV 2.00 GiB + overhead 512.00 MiB = 3.50 GiB; raise the limit to at least that, or "
        "lower the KV size"]
    plan(opts(mps=True, mps_memory_limit=4 * GiB), facts)


def test_the_daemons_read_back_limits_round_trip_and_an_old_record_is_uncapped():
    record = DaemonRecord(ProcessIdentity(42, 1.5), "/x/mps", "/p", "/l", None, None, 1,
                          DaemonLimits(40.0, 2 * GiB))
    assert DaemonRecord.from_json(json.loads(json.dumps(record.to_json()))) == record
    old = record.to_json()
    del old["limits"]
    assert DaemonRecord.from_json(old).limits == DaemonLimits() and not DaemonLimits().any


# --- the check and its gate -------------------------------------------------------------------

def test_the_bf16_gemm_check_passes_an_accurate_gemm_and_fails_a_wrong_one():
    right = bf16_gemm_check.check(torch, "cpu")
    assert right["passed"] and 0 < right["relative_error"] < 0.01
    assert right["shape"] == [512, 1024, 1024]

    def wrong(a, b):  # what a defective kernel does: most of the output off
        out = torch.matmul(a, b)
        out[:, : out.shape[1] // 2] = 0
        return out

    failed = bf16_gemm_check.check(torch, "cpu", matmul=wrong)
    assert not failed["passed"] and failed["relative_error"] > 0.5


def _off_by(fraction: float):
    """A GEMM whose every output is `fraction` too large: its relative error is about
    `fraction` (plus the accurate GEMM's own, near 0.003)."""
    def matmul(a, b):
        return torch.matmul(a, b).float() * (1 + fraction)
    return matmul


@pytest.mark.parametrize(("fraction", "passed"), [(0.0, True), (0.005, True), (0.02, False),
                                                  (0.05, False)])
def test_the_check_fails_an_error_a_few_times_an_accurate_gemms(fraction, passed):
    """The limit is 0.01, about three times an accurate BF16 GEMM's error (0.003): an error
    of 2 or 5 % is a wrong kernel, not rounding, and must stop the replica; a limit loosened
    tenfold would let it serve."""
    facts = bf16_gemm_check.check(torch, "cpu", matmul=_off_by(fraction))
    assert abs(facts["relative_error"] - fraction) < 0.004  # the error is the one made
    assert facts["passed"] is passed, facts["relative_error"]
    assert facts["threshold"] == 0.01  # and the record says the limit that judged it


def test_the_gate_runs_the_check_then_becomes_the_engine(tmp_path):
    record = tmp_path / "check.json"
    engine = [sys.executable, "-c", "import os; print('engine pid', os.getpid())"]
    done = subprocess.run([*GATE, "--python", sys.executable, "--device", "cpu", "--record",
                           str(record), "--", *engine], capture_output=True, text=True,
                          timeout=120, env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40",
                                            "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stdout + done.stderr
    first, second = done.stdout.splitlines()
    assert first.startswith("omni-dp numeric check: passed, BF16 GEMM 512x1024x1024 on cpu: "
                            "relative error 0.00")
    assert first.endswith("under CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=40")
    assert second.startswith("engine pid")
    facts = json.loads(record.read_text())
    assert facts["passed"] and facts["caps"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"


def test_a_replica_whose_check_fails_never_starts(tmp_path):
    record, ran = tmp_path / "check.json", tmp_path / "engine-ran"
    done = subprocess.run([*GATE, "--python", str(WRONG_GEMM), "--device", "cuda", "--record",
                           str(record), "--", "touch", str(ran)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert not ran.exists()
    assert ("omni-dp numeric check: FAILED, BF16 GEMM 512x1024x1024 on cuda: relative error "
            "0.9200 (limit 0.01)") in done.stdout
    assert "launch with another --mps-thread-percentage, or none" in done.stdout
    assert json.loads(record.read_text())["passed"] is False


def test_a_check_that_cannot_run_is_a_failed_one(tmp_path):
    record = tmp_path / "check.json"
    done = subprocess.run([*GATE, "--python", str(tmp_path / "no-python"), "--device", "cuda",
                           "--record", str(record), "--", "true"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "could NOT run the BF16 GEMM check" in done.stdout and "no-python" in done.stdout
    assert json.loads(record.read_text())["passed"] is False
