"""The bench's driver: specs and launch flags refused up front, the sampler over a run's
recorded processes (and a fake NVML), and, live on CPU (slow), real built-in replicas launched,
swept, downed and checked for leftovers; a launch that fails reported as failed with its own
words; a replica killed mid-run counted as failed requests of a degraded configuration."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import psutil
import pytest

from omni_dp.bench.runner import (
    BenchRunner,
    BenchSettings,
    check_launch_args,
    leftovers,
    parse_spec,
)
from omni_dp.bench.sampler import NO_RUN, Sampler, count_cpus
from omni_dp.bench.stats import RAN_OUT
from omni_dp.procs import start_of

from support.launcher import Run, kill_replica, matching_pids
from support.plans import gpu_run_record, gpus_json, stored_state
from support.ports import free_port_block

TINY = ["--max-total-tokens", "1024", "--drain-timeout", "5", "--", "--model", "tiny"]
SHORT = BenchSettings(trials=2, duration_s=2.0, warmup_s=0.5, timeout_s=20.0,
                      concurrency=(1, 2), seed=1)


# --- up front -------------------------------------------------------------------------------


def test_specs_are_n_or_n_mps_and_the_rest_is_refused_by_name():
    assert parse_spec("1") == (1, False)
    assert parse_spec("3mps") == (3, True)
    for bad in ("0", "mps", "2x", "", "-1", "2 mps"):
        with pytest.raises(ValueError, match="is not N or Nmps"):
            parse_spec(bad)
    check_launch_args(["--max-total-tokens", "1024", "--", "--replicas", "9"])  # the engine's
    with pytest.raises(ValueError, match="--replicas"):
        check_launch_args(["--replicas", "2"])
    with pytest.raises(ValueError, match="--run-id=x"):
        check_launch_args(["--run-id=x"])


def test_bad_specs_are_refused_before_anything_is_launched(tmp_path):
    lines: list[str] = []
    runner = BenchRunner(SHORT, lines.append, python="/nonexistent/python")
    with pytest.raises(ValueError, match="'2x'"):
        runner.run_configs(["1", "2x"], TINY, state_dir=tmp_path)
    assert lines == []


# --- the sampler ------------------------------------------------------------------------------


@pytest.fixture
def spinner():
    """A child that keeps one core busy for at most 20 s (killed at teardown)."""
    proc = subprocess.Popen([sys.executable, "-c",
                             "import time\nend = time.time() + 20\nwhile time.time() < end: pass"])
    yield psutil.Process(proc.pid)
    proc.kill()
    proc.wait(10)


class FakeNvml:
    """The four NVML calls the sampler makes, over one GPU at 70 % and 5 GiB."""

    NVMLError = RuntimeError

    def __init__(self) -> None:
        self.calls: list[str] = []

    def nvmlInit(self) -> None:
        self.calls.append("init")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        self.calls.append(f"uuid {uuid}")
        return uuid

    def nvmlDeviceGetUtilizationRates(self, handle: str) -> SimpleNamespace:
        return SimpleNamespace(gpu=70, memory=10)

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> SimpleNamespace:
        return SimpleNamespace(used=5 << 30, total=80 << 30)


def test_the_sampler_reads_the_recorded_processes_and_the_gpus(tmp_path, spinner):
    data = gpu_run_record("s", [{"index": 0, "pid": spinner.pid,
                                 "create_time": start_of(spinner.pid), "cpus": "0"}],
                          [{**gpus_json(1)[0], "label": "GPU-abc"}])
    data["device"] = "cuda"
    stored_state(tmp_path / "s", data)
    nvml = FakeNvml()
    with Sampler(tmp_path / "s", interval_s=0.05, nvml=nvml) as sampler:
        time.sleep(0.6)
    samples = sampler.samples
    assert samples is not None and set(samples.cpu_util) == {"replica 0", "client"}
    assert samples.cpu_util["replica 0"] > 0.3  # a busy core (shared with whatever else runs)
    assert samples.gpu_sm_util == pytest.approx(0.7)
    assert samples.gpu_memory_bytes == 5 << 30
    assert sampler.cores == {"replica 0": 1}
    assert nvml.calls[:2] == ["init", "uuid GPU-abc"] and nvml.calls[-1] == "shutdown"
    assert samples.note is None


def test_without_a_run_directory_nothing_is_sampled_and_it_says_so(tmp_path):
    with Sampler(None) as sampler:
        pass
    assert sampler.samples.cpu_util is None and sampler.samples.gpu_sm_util is None
    assert sampler.samples.note == NO_RUN
    with Sampler(tmp_path / "nothing-here") as broken:
        pass
    assert "nothing sampled" in broken.samples.note
    assert count_cpus("0-3,8") == 5 and count_cpus(None) is None and count_cpus("x") is None


# --- live: real replicas on the CPU ---------------------------------------------------------


@pytest.fixture
def state_dir(tmp_path):
    """The runs' state dir; whatever of it still runs at teardown is killed by pid (and
    fails the test: the runner's own down must have stopped it)."""
    root = tmp_path / "state"
    yield root

    def ours(env: dict[str, str]) -> bool:
        return env.get("OMNI_DP_STATE_DIR") == str(root)

    left = matching_pids(ours)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not left, f"processes of the bench's runs left running (now killed): {left}"


@pytest.mark.slow
def test_each_configuration_is_launched_swept_downed_and_leaves_nothing(state_dir):
    lines: list[str] = []
    results = BenchRunner(SHORT, lines.append).run_configs(["1", "2"], TINY,
                                                           state_dir=state_dir)
    assert [r.name for r in results] == ["1", "2"], lines
    for result in results:
        assert result.status == "ok", (result.reason, lines)
        assert [level.concurrency for level in result.levels] == [1, 2]
        for level in result.levels:
            assert level.trials == 2 and level.requests > 0
            assert level.requests_per_s.low <= level.requests_per_s.median \
                <= level.requests_per_s.high and level.requests_per_s.low > 0
            assert level.audio_s_per_s.low > 0 and level.failures == {}
        # saturated at 1 (2 rose < 5 %), or the levels ran out still rising: no saturation
        assert len(result.points) == 4
        assert result.saturation == 1 or (result.saturation is None
                                          and RAN_OUT in result.stop_reason)
        assert result.stop_reason and result.verdict
        assert all(p.cpu_util and "replica 0" in p.cpu_util and "router" in p.cpu_util
                   for p in result.points)
    two = results[1]
    served = {replica for p in two.points for replica in p.per_replica}
    assert len(served) == 2, two.points  # the router spread them over both replicas
    assert (two.replicas, two.mps) == (2, False)
    assert not (state_dir / "runs").exists() or not any((state_dir / "runs").iterdir())


@pytest.mark.slow
def test_a_configuration_whose_launch_fails_is_reported_failed_with_its_reason(state_dir):
    base = free_port_block(3)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 2))
        taken.listen()
        args = ["--base-port", str(base), "--router-port", str(base + 2), *TINY]
        (result,) = BenchRunner(SHORT, lambda line: None).run_configs(["2"], args,
                                                                      state_dir=state_dir)
    assert result.status == "failed" and result.points == ()
    assert result.reason.startswith("launch exited 2: ") and str(base + 2) in result.reason
    assert (result.name, result.replicas) == ("2", 2)


@pytest.mark.slow
def test_a_replica_killed_mid_run_is_counted_as_failed_requests(tmp_path):
    settings = BenchSettings(trials=1, duration_s=3.0, warmup_s=0.5, timeout_s=10.0,
                             concurrency=(4,), seed=2)
    with Run(tmp_path, replicas=2) as run:
        # the router's retry and resume would save every request: off, so that some fail
        run.launch("--retries", "0", "--resumes", "0", "--", "--model", "tiny")
        killer = threading.Timer(1.5, kill_replica, (run, 1))
        killer.start()
        try:
            result = BenchRunner(settings, lambda line: None).run_url(run.router_url,
                                                                      run.run_dir)
        finally:
            killer.cancel()
            killer.join()
        assert run.cleanup() == []
    (point,) = result.points
    failed = sum(point.failures.values())
    assert failed >= 1 and point.requests == point.ok + failed, point
    assert result.status == "degraded" and "requests failed" in result.reason
    assert result.replicas == 2 and point.ok > 0
    assert {"replica 0", "replica 1", "router", "client"} <= set(point.cpu_util)


def test_a_process_left_carrying_the_run_token_is_named_and_nothing_is_once_it_is_gone():
    # what makes a configuration "failed" after its down: a process of the run still running
    token = "bench-leftover-" + os.urandom(4).hex()
    left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, "OMNI_DP_RUN_TOKEN": token},
                            stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not (found := leftovers(token, None, wait_s=0.1)):
            assert time.monotonic() < deadline, "the token carrier was never seen"
        assert found == [f"pid {left.pid} ({psutil.Process(left.pid).name()})"]
    finally:
        left.kill()
        left.wait(10)
    assert leftovers(token, None, wait_s=5) == []
