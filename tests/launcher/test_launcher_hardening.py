"""Bad input to `omni-dp launch` (flags and --config YAML) and the other number-taking commands:
exit 2, every problem named, no traceback, nothing created, no process started.

The table runs the CLI in process (click's CliRunner): faithful for option parsing and the plan,
as long as nothing is started — the engine's dry run, the one process a preflight may start, is
replaced by a stub that records its calls. A few cases run `omni-dp launch` for real.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from omni_dp.cli import cli
from omni_dp.launcher.engines import BuiltinEngine, EngineSizing

from support.plans import one_replica_plan
from support.ports import free_port_block
from support.stub_http import StubHttp

ROOT = Path(__file__).resolve().parents[2]

LAUGHS = ("a: &a [x, x, x, x, x, x, x, x, x]\n"
          "b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
          "c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\n"
          "d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
          "e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d]\n"
          "f: &f [*e, *e, *e, *e, *e, *e, *e, *e, *e]\n"
          "g: &g [*f, *f, *f, *f, *f, *f, *f, *f, *f]\n"
          "kv_cache_bytes: *g\n")

# (id, flags, --config contents (str, bytes) or None, what the output must name)
FLAG_CASES = [
    ("check-interval-nan", ["--check-interval", "nan"], None, ["--check-interval", "nan"]),
    ("check-interval-nan-detach", ["--check-interval", "nan", "--detach"], None,
     ["--check-interval", "nan"]),
    ("drain-timeout-inf", ["--drain-timeout", "inf"], None, ["--drain-timeout", "inf"]),
    ("restart-window-minus-inf", ["--restart-window", "-inf"], None, ["--restart-window"]),
    ("start-timeout-nan", ["--start-timeout", "NaN"], None, ["--start-timeout", "nan"]),
    ("memory-headroom-nan", ["--memory-headroom", "nan"], None, ["--memory-headroom"]),
    ("memory-headroom-inf", ["--memory-headroom", "inf"], None, ["--memory-headroom"]),
    ("check-interval-zero", ["--check-interval", "0"], None, ["--check-interval"]),
    ("check-interval-huge", ["--check-interval", "1e300"], None, ["--check-interval"]),
    ("drain-timeout-negative", ["--drain-timeout", "-1"], None, ["--drain-timeout"]),
    ("check-interval-word", ["--check-interval", "soon"], None, ["--check-interval"]),
    ("replicas-zero", ["--replicas", "0"], None, ["--replicas must be at least 1"]),
    ("replicas-negative", ["--replicas", "-5"], None, ["--replicas"]),
    ("replicas-beyond-ports", ["--replicas", "100000"], None, ["--base-port", "65535"]),
    ("replicas-astronomic", ["--replicas", "9" * 30], None, ["--base-port", "65535"]),
    ("gpus-and-gpu", ["--gpus", "0,1", "--gpu", "0"], None, ["--gpu 0 and --gpus 0,1"]),
    ("gpus-empty-entry", ["--gpus", "0,,1"], None, ["--gpus", "an empty entry"]),
    ("replicas-per-gpu-alone", ["--replicas-per-gpu", "2"], None, ["--replicas-per-gpu needs"]),
    ("replicas-per-gpu-astronomic", ["--gpus", "0", "--replicas-per-gpu", "9" * 30], None,
     ["--replicas-per-gpu"]),
    ("register-not-a-url", ["--register", "ftp://x"], None, ["--register", "http"]),
    ("register-url-alone", ["--register-url", "http://h:1"], None, ["--register-url"]),
    ("base-port-zero", ["--base-port", "0"], None, ["--base-port"]),
    ("base-port-too-high", ["--base-port", "70000"], None, ["--base-port"]),
    ("router-port-too-high", ["--router-port", "99999"], None, ["--router-port"]),
    ("router-port-in-replica-range", ["--router-port", "{base}"], None,
     ["--router-port", "replica port range"]),
    ("run-id-path", ["--run-id", "../escape"], None, ["--run-id '../escape'"]),
    ("run-id-newline", ["--run-id", "a\nb"], None, ["--run-id"]),
    ("host-too-long", ["--host", "h" * 300], None, ["--host"]),
    ("host-not-an-address", ["--host", "256.1.1.1"], None, ["--host '256.1.1.1'"]),
    ("router-workers-zero", ["--router-workers", "0"], None, ["--router-workers"]),
    ("router-workers-fork-bomb", ["--router-workers", "100000"], None,
     ["--router-workers 100000", "at most"]),
    ("restart-after-failures-zero", ["--restart-after-failures", "0"], None,
     ["--restart-after-failures"]),
    ("restart-budget-negative", ["--restart-budget", "-1"], None, ["--restart-budget"]),
    ("two-kv-pins", ["--kv-cache-bytes", "1GiB", "--max-total-tokens", "1024"], None,
     ["--kv-cache-bytes and --max-total-tokens"]),
    ("kv-bytes-zero", ["--kv-cache-bytes", "0"], None, ["--kv-cache-bytes"]),
    ("kv-bytes-word", ["--kv-cache-bytes", "lots"], None, ["--kv-cache-bytes"]),
    ("tokens-zero", ["--max-total-tokens", "0"], None, ["--max-total-tokens"]),
    ("cpu-blocks-garbage", ["--replicas", "2", "--cpu-blocks", "x y"], None, ["block 0"]),
    ("cpu-blocks-astronomic", ["--cpu-blocks", "0-99999999999"], None, ["block 0"]),
    ("cpu-blocks-count", ["--replicas", "2", "--cpu-blocks", "0"], None, ["--cpu-blocks"]),
    ("no-gpu-check-alone", ["--no-gpu-check"], None, ["--no-gpu-check"]),
    ("reserved-engine-arg", ["--", "--port", "1"], None, ["engine argument --port"]),
    ("api-key-empty", ["--api-key", ""], None, ["--api-key", "empty"]),
    ("api-key-space", ["--api-key", "two words"], None, ["--api-key", "ASCII"]),
    ("start-mode", ["--start", "sideways"], None, ["--start"]),
    ("policy", ["--policy", "fastest"], None, ["--policy"]),
]

YAML_CASES = [
    ("yaml-wrong-type", [], "replicas: two\n", ["replicas must be an integer"]),
    ("yaml-float-for-int", [], "base_port: 8100.5\n", ["base-port must be an integer"]),
    ("yaml-bool-as-string", [], "mps: 'yes'\n", ["mps must be true or false"]),
    ("yaml-unknown-key", [], "replica_count: 2\n", ["unknown setting 'replica_count'"]),
    ("yaml-unknown-engine", [], "engine: tensorrt\n", ["engine 'tensorrt' is not known"]),
    ("yaml-engine-without-model", [], "engine: vllm\n", ["give the model directory after --"]),
    ("yaml-top-level-list", [], "- replicas\n- 2\n", ["top level must be a mapping"]),
    ("yaml-top-level-scalar", [], "42\n", ["top level must be a mapping"]),
    ("yaml-missing-file", [], None, ["no such file"]),
    ("yaml-directory", [], None, ["is a directory"]),
    ("yaml-unreadable", [], None, ["cannot read it"]),
    ("yaml-python-object", [], "host: !!python/object/apply:os.system ['touch {marker}']\n",
     ["host (line 1)", "python/object/apply"]),
    ("yaml-python-name", [], "gpu: !!python/name:os.system\n", ["gpu (line 1)", "python/name"]),
    ("yaml-duplicate-key", [], "replicas: 1\nreplicas: 2\n", ["replicas is set twice",
                                                                "lines 1 and 2"]),
    ("yaml-duplicate-spelling", [], "max-total-tokens: 1024\nmax_total_tokens: 2048\n",
     ["max-total-tokens is set twice"]),
    ("yaml-list-as-key", [], "? [replicas, mps]\n: 1\n", ["line 1", "not a list"]),
    ("yaml-mapping-as-key", [], "? {replicas: 1}\n: 1\n", ["line 1", "not a mapping"]),
    ("yaml-billion-laughs", [], LAUGHS, ["line 2", "aliases"]),
    ("yaml-invalid-utf8", [], b"replicas: \xff\xfe\n", ["not UTF-8", "offset 10"]),
    ("yaml-binary-garbage", [], bytes(range(256)) * 4, ["not UTF-8"]),
    ("yaml-deep-list", [], "engine_args: " + "[" * 100_000 + "]" * 100_000 + "\n",
     ["line 1", "nested deeper"]),
    ("yaml-deep-mapping", [], "host: " + "{a: " * 50_000 + "1" + "}" * 50_000 + "\n",
     ["line 1", "nested deeper"]),
    ("yaml-nan", [], "check_interval: .nan\n", ["check-interval must be a finite number"]),
    ("yaml-inf", [], "drain-timeout: .inf\n", ["drain-timeout must be a finite number"]),
    ("yaml-minus-inf", [], "restart_window: -.inf\n", ["restart-window must be a finite"]),
    ("yaml-overflowing-float", [], "start_timeout: 1.0e+400\n", ["start-timeout must be"]),
    ("yaml-headroom-nan", [], "memory_headroom: .NaN\n", ["memory-headroom must be"]),
    ("yaml-integer-too-large-for-float", [], "check_interval: " + "9" * 400 + "\n",
     ["check-interval must be a finite number"]),
    ("yaml-integer-of-5000-digits", [], "replicas: " + "9" * 5000 + "\n", ["replicas"]),
    ("yaml-integer-of-30-digits", [], "router_port: " + "9" * 30 + "\n",
     ["router-port must be an integer below 2**63"]),
    ("yaml-huge-size", [], "kv_cache_bytes: " + "9" * 5000 + "\n", ["kv-cache-bytes"]),
    ("yaml-nul-escape", [], 'host: "127.0.0.1\\0evil"\n', ["host must be a string without NUL"]),
    ("yaml-nul-in-engine-args", [], 'engine_args: ["--model", "a\\0b"]\n', ["engine-args"]),
    ("yaml-raw-nul-byte", [], b"replicas: 1\x00\n", ["unacceptable character"]),
    ("yaml-syntax", [], "replicas: [1\n", ["cannot read it as YAML", "line"]),
    ("yaml-tab-indent", [], "replicas:\n\t- 1\n", ["line 2"]),
    ("yaml-two-documents", [], "replicas: 1\n---\nreplicas: 2\n", ["another document"]),
    ("yaml-too-large", [], "# padding\n" * 120_000, ["larger than 1 MiB"]),
    ("yaml-list-for-string", [], "cpu_blocks: [0-1, 2-3]\n", ["cpu-blocks must be a string"]),
    ("yaml-merge-key", [], "<<: {replicas: 2}\n", ["unknown setting '<<'"]),
    ("yaml-run-id-path", [], "run_id: ../../etc\n", ["--run-id '../../etc'"]),
    ("yaml-reserved-engine-arg", [], "engine_args: [--port, '1']\n",
     ["engine argument --port"]),
    ("yaml-api-key-empty", [], "api_key: ''\n", ["--api-key", "empty"]),
    ("yaml-with-a-flag-problem", ["--replicas", "0"], "check_interval: .nan\n",
     ["check-interval must be a finite number", "--replicas must be at least 1"]),
]


@pytest.fixture
def fuzz_env(tmp_path, monkeypatch):
    """A state dir that must stay absent, free ports, and a dry run that starts nothing."""
    state = tmp_path / "state"
    monkeypatch.setenv("OMNI_DP_STATE_DIR", str(state))
    for name in ("OMNI_DP_API_KEY", "OMNI_DP_LOG_FORMAT"):
        monkeypatch.delenv(name, raising=False)
    def dry_run(self, launch, engine_args, env):
        return EngineSizing(weights_bytes=1 << 20, kv_cache_bytes=8 << 20, kv_tokens=1024,
                            overhead_bytes=1 << 20, device="cpu"), []

    monkeypatch.setattr(BuiltinEngine, "dry_run", dry_run)

    def accepted(plan, out) -> int:  # should bad input get through, start nothing anyway
        raise AssertionError(f"launch accepted the input and would start run {plan.run_id}")

    monkeypatch.setattr("omni_dp.launcher.launch.launch", accepted)
    return state


def _config_path(tmp_path: Path, case_id: str, contents: str | bytes | None) -> str:
    if case_id == "yaml-missing-file":
        return str(tmp_path / "absent.yaml")
    if case_id == "yaml-directory":
        return str(tmp_path)
    if case_id == "yaml-unreadable":  # unreadable even for root: reading it fails with EIO
        return "/proc/self/mem"
    path = tmp_path / "launch.yaml"
    if isinstance(contents, bytes):
        path.write_bytes(contents)
    else:
        path.write_text(contents.replace("{marker}", str(tmp_path / "pwned")))
    return str(path)


@pytest.mark.parametrize(("flags", "contents", "needles"),
                         [pytest.param(*case[1:], id=case[0]) for case in FLAG_CASES + YAML_CASES])
def test_bad_launch_input_exits_2_naming_it_and_creates_nothing(tmp_path, fuzz_env, request,
                                                                flags, contents, needles):
    state = fuzz_env
    case_id = request.node.callspec.id
    base = free_port_block(3)
    flags = [f.replace("{base}", str(base)) for f in flags]
    args = ["launch", "--base-port", str(base), "--router-port", str(base + 2)]
    if contents is not None or case_id.startswith("yaml-"):
        args += ["--config", _config_path(tmp_path, case_id, contents)]
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    result = CliRunner().invoke(cli, [*args, *flags], prog_name="omni-dp")
    output = result.output
    assert result.exit_code == 2, output
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        repr(result.exception)
    assert "Traceback" not in output
    for needle in needles:
        assert needle.lower() in output.lower(), f"{needle!r} not in:\n{output}"
    assert not state.exists(), "the state directory was created"
    assert not (tmp_path / "pwned").exists(), "a YAML tag ran code"
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children_before
    assert result.stdout == "", "nothing but problems may be printed"
    assert len(FLAG_CASES + YAML_CASES) >= 40


def test_gpu_index_without_a_gpu_and_without_mps_does_not_speak_of_mps(fuzz_env,
                                                                       monkeypatch):
    from omni_dp.gpus import GpuInventory
    from omni_dp.mps import preflight

    monkeypatch.setattr("omni_dp.launcher.planning.facts.query_gpus", lambda nvml=None: (
        GpuInventory(nvml_problem=preflight.Problem("nvml", preflight.NO_DRIVER_MESSAGE))))
    base = free_port_block(3)
    result = CliRunner().invoke(cli, ["launch", "--gpu", "0", "--base-port", str(base),
                                      "--router-port", str(base + 2)], prog_name="omni-dp")
    assert result.exit_code == 2, result.output
    assert "--gpu 0: there is no NVIDIA driver" in result.output
    assert "--gpu none" in result.output
    assert "MPS" not in result.output
    with_mps = CliRunner().invoke(cli, ["launch", "--gpu", "0", "--mps", "--base-port",
                                        str(base), "--router-port", str(base + 2)])
    assert with_mps.exit_code == 2 and "MPS" in with_mps.output  # there it is the point


# --- the same, for real: a process per case -------------------------------------------------


@pytest.mark.parametrize(("flags", "contents", "needles"), [
    pytest.param(["--check-interval", "nan", "--detach"], None, ["--check-interval"],
                 id="nan-detach"),
    pytest.param([], "replicas: 1\nreplicas: 2\n", ["replicas is set twice"], id="dup-keys"),
    pytest.param([], b"\x89PNG\r\n\x1a\n\x00\x00", ["not UTF-8"], id="binary"),
    pytest.param([], "engine_args: " + "[" * 50_000 + "]" * 50_000 + "\n", ["nested deeper"],
                 id="deep"),
])
def test_bad_launch_input_in_a_real_process(tmp_path, flags, contents, needles):
    state = tmp_path / "state"
    marker = uuid.uuid4().hex  # inherited by whatever an accepting launch would start
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_DP_")}
    env.update(OMNI_DP_STATE_DIR=str(state), OMNI_DP_TEST_HARDENING_MARKER=marker)
    args = list(flags)
    if contents is not None:
        path = tmp_path / "launch.yaml"
        if isinstance(contents, bytes):
            path.write_bytes(contents)
        else:
            path.write_text(contents)
        args += ["--config", str(path)]
    base = free_port_block(3)
    try:
        done = subprocess.run([sys.executable, "-m", "omni_dp", "launch", "--base-port",
                               str(base), "--router-port", str(base + 2), *args], env=env,
                              capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL, check=False)
    finally:
        leftovers = _stop_processes_marked(marker)
    assert leftovers == [], "launch left processes behind"
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    for needle in needles:
        assert needle in done.stderr
    assert done.stdout == "" and not state.exists()


def _stop_processes_marked(marker: str) -> list[int]:
    """SIGKILL, by pid, every process that inherited the marker; returns their pids."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("OMNI_DP_TEST_HARDENING_MARKER") == marker:
                found.append(proc)
    for proc in found:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(found, timeout=10)
    return [proc.pid for proc in found]


# --- non-finite numbers elsewhere: serve, router, down, mps start ----------------------------


@pytest.mark.parametrize(("args", "needle"), [
    (["serve", "--drain-timeout", "nan", "--dry-run"], "--drain-timeout"),
    (["serve", "--drain-timeout", "inf", "--dry-run"], "--drain-timeout"),
    (["router", "--health-interval", "nan"], "--health-interval"),
    (["router", "--health-timeout", "inf"], "--health-timeout"),
    (["router", "--health-jitter", "nan"], "--health-jitter"),
    (["router", "--connect-timeout", "nan"], "--connect-timeout"),
    (["router", "--request-timeout", "inf"], "--request-timeout"),
    (["router", "--drain-timeout", "nan"], "--drain-timeout"),
    (["down", "--drain-timeout", "nan"], "--drain-timeout"),
    (["down", "--drain-timeout", "-1"], "--drain-timeout"),
    (["mps", "start", "--state-dir", "{tmp}", "--mps-thread-percentage", "nan"],
     "--mps-thread-percentage"),
])
def test_non_finite_numbers_are_refused_by_every_command(tmp_path, monkeypatch, args, needle):
    monkeypatch.setenv("OMNI_DP_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv("OMNI_DP_API_KEY", raising=False)

    def started(*_args, **_kwargs):  # accepted after all: fail instead of serving here
        raise AssertionError("the command accepted a non-finite number and started")

    monkeypatch.setattr("omni_dp.router.workers.run_router", started)
    monkeypatch.setattr("omni_dp.engine.server.serve", started)
    monkeypatch.setattr("omni_dp.mps.daemon.MpsDaemon.start", started)
    args = [a.replace("{tmp}", str(tmp_path / "mps")) for a in args]
    result = CliRunner().invoke(cli, args, prog_name="omni-dp")
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert needle in result.output and "Traceback" not in result.output
    assert not (tmp_path / "state").exists() and not (tmp_path / "mps").exists()


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_serve_plan_refuses_a_non_finite_drain_timeout(value):
    from omni_dp.engine.plan import ServeOptions, ServePlanError, plan_serve

    with pytest.raises(ServePlanError) as caught:
        plan_serve(ServeOptions(device="cpu", drain_timeout=value))
    assert any("--drain-timeout" in p for p in caught.value.problems)


@pytest.mark.parametrize(("options", "flag"), [
    ({"connect_timeout_s": math.nan}, "--connect-timeout"),
    ({"request_timeout_s": math.inf}, "--request-timeout"),
    ({"health": {"interval_s": math.nan}}, "--health-interval"),
    ({"health": {"timeout_s": math.inf}}, "--health-timeout"),
    ({"health": {"jitter": math.nan}}, "--health-jitter"),
])
def test_router_plan_refuses_non_finite_numbers(options, flag):
    from omni_dp.router.config import HealthConfig, RouterConfigError, plan_router

    health = HealthConfig(**options.pop("health", {}))
    with pytest.raises(RouterConfigError) as caught:
        plan_router(["http://127.0.0.1:9"], health=health, **options)
    assert any(flag in p and "finite" in p for p in caught.value.problems), \
        caught.value.problems


# --- launch --detach: "detached" only once the supervisor supervises --------------------------


def _healthy(state, index: int = 0, **fields) -> None:
    """A replica as bring-up leaves it: started, then healthy (the lifecycle's only way)."""
    from omni_dp.runfile import ReplicaState

    state.update_replica(index, state=ReplicaState.STARTING, **fields)
    state.update_replica(index, state=ReplicaState.HEALTHY)


def _started_healthy(state, pid: int, url: str) -> None:
    """Replica 0 recorded as this live process, listening on url, healthy."""
    from omni_dp.procs import identify

    _healthy(state, identity=identify(pid), pgid=pid, url=url)


def _no_router_process(state, url: str):
    """A router record for a stub at url with no process of its own: its identity is this
    test process's pid with another create time, so nothing ever takes it for alive."""
    from omni_dp.procs import ProcessIdentity
    from omni_dp.runfile import RouterRecord

    return RouterRecord(ProcessIdentity(os.getpid(), 0.0), 0, url, state.plan.router.argv,
                        "router.log")


@pytest.fixture
def silent_replica():
    """A live process standing in for a replica, and a port that accepts but never answers
    /health: the supervisor's first sweep then takes its whole health timeout (2 s)."""
    import socket

    sleeper = subprocess.Popen(["sleep", "120"], stdin=subprocess.DEVNULL,
                               start_new_session=True)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    yield sleeper, f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()
    if sleeper.poll() is None:
        sleeper.kill()
    sleeper.wait(10)


def test_detach_is_not_reported_when_the_supervisor_dies_before_supervising(
        tmp_path, silent_replica):
    """The supervisor records itself, then is SIGKILLed during its first sweep: launch must
    not say "detached" (exit 0) but report it with the log tail, tear down, exit 3."""
    import signal as signals
    import threading
    import time

    from omni_dp.launcher import launch
    from omni_dp.launcher.record.state import RunState
    from omni_dp.runfile import RunPhase

    sleeper, url = silent_replica
    state = RunState.create(one_replica_plan(tmp_path))
    state.update(launcher=None)  # this test process: the supervisor's teardown must spare it
    _started_healthy(state, sleeper.pid, url)
    state.set_phase(RunPhase.RUNNING)
    killed: list[int] = []

    def kill_once_recorded() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            record = RunState.load(state.directory).record.supervisor
            if record:
                os.kill(record.identity.pid, signals.SIGKILL)
                killed.append(record.identity.pid)
                return
            time.sleep(0.005)

    killer = threading.Thread(target=kill_once_recorded, daemon=True)
    handlers = {sig: signals.getsignal(sig) for sig in (signals.SIGTERM, signals.SIGINT)}
    said: list[str] = []
    killer.start()
    try:
        code = launch._hand_off(state, [], threading.Event(), said.append)
    finally:
        for sig, handler in handlers.items():
            signals.signal(sig, handler)
        killer.join(30)
    text = "\n".join(said)
    assert killed, "the supervisor never recorded itself"
    assert code == 3, text
    assert "detached: supervisor" not in text and "is supervising" not in text
    assert "was killed by SIGKILL before it was supervising" in text
    assert "last lines of" in text and "supervisor.log" in text
    assert sleeper.wait(30) is not None, "the run was not torn down"
    assert "handoff_failed" in [e["event"] for e in RunState.load(state.directory).events()]


def test_detach_waits_for_the_supervisors_first_sweep(tmp_path, silent_replica):
    """Once it returns 0 the supervisor has recorded a heartbeat: it is supervising."""
    import signal as signals
    import threading

    from omni_dp.launcher import launch
    from omni_dp.launcher.record.state import RunState
    from omni_dp.launcher.teardown import teardown
    from omni_dp.runfile import RunPhase

    sleeper, url = silent_replica
    state = RunState.create(one_replica_plan(tmp_path))
    state.update(launcher=None)  # this test process: the supervisor's teardown must spare it
    _started_healthy(state, sleeper.pid, url)
    state.set_phase(RunPhase.RUNNING)  # as bring-up leaves it before the hand-off
    handlers = {sig: signals.getsignal(sig) for sig in (signals.SIGTERM, signals.SIGINT)}
    said: list[str] = []
    try:
        code = launch._hand_off(state, [], threading.Event(), said.append)
        record = RunState.load(state.directory).record.supervisor
        assert code == 0, said
        assert record.supervising_since and psutil.pid_exists(record.identity.pid)
        assert "supervisor_supervising" in [e["event"] for e in
                                            RunState.load(state.directory).events()]
    finally:
        for sig, handler in handlers.items():
            signals.signal(sig, handler)
        result = teardown(RunState.load(state.directory), drain_timeout=1.0)
    assert result.clean, result.leftovers


# --- exit descriptions, how omni-dp was run, admin calls that fail ---------------------------


@pytest.mark.parametrize(("code", "words"), [
    (3, "exited with code 3"), (-9, "was killed by SIGKILL"), (-15, "was killed by SIGTERM"),
    (-200, "was killed by signal 200"), (None, "died"),
])
def test_exit_codes_are_described_with_signal_names(code, words):
    from omni_dp.launcher.bringup.gates import describe_exit

    assert describe_exit(code) == words


def test_follow_up_commands_are_written_as_the_user_ran_omni_dp(tmp_path, monkeypatch):
    from omni_dp.launcher.planning.facts import invoked_as

    script = tmp_path / "venv" / "bin" / "omni-dp"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert invoked_as(".venv/bin/omni-dp") == ".venv/bin/omni-dp"
    assert invoked_as(str(script)) == str(script)
    assert invoked_as("omni-dp") == "omni-dp"  # found on PATH
    monkeypatch.setenv("PATH", str(script.parent))
    assert invoked_as(str(script)) == "omni-dp"  # the one on PATH: the short name works
    main = str(ROOT / "omni_dp" / "__main__.py")
    assert invoked_as(main) == f"{sys.executable} -m omni_dp"
    assert invoked_as("/usr/lib/python3/site-packages/pytest/__main__.py") == "omni-dp"
    monkeypatch.setattr(sys, "argv", [".venv/bin/omni-dp", "launch"])
    plan = one_replica_plan(tmp_path, run_id="named")
    assert plan.command == "omni-dp"  # one_replica_plan's facts say so; gather_facts reads argv
    from omni_dp.launcher.planning.facts import gather_facts
    from omni_dp.launcher.planning.options import LaunchOptions

    monkeypatch.setenv("OMNI_DP_STATE_DIR", str(tmp_path / "state"))
    facts = gather_facts(LaunchOptions(gpu="none"), option_problems=["skip the dry run"])
    assert facts.command == ".venv/bin/omni-dp"


class _AdminStub(StubHttp):
    """Answers every request with one status and an API-key error, recording the PUTs."""

    def __init__(self, status: int) -> None:
        super().__init__(lambda *_: (status, b'{"error": "missing or wrong API key"}'))

    @property
    def seen_puts(self) -> list[tuple]:
        return [(path, auth, body) for method, path, auth, body in self.seen if method == "PUT"]


@pytest.mark.parametrize("status", [401, 500])
def test_a_failed_router_admin_call_is_a_visible_warning_never_a_success(tmp_path, status):
    from omni_dp.launcher.bringup.replicas import ReplicaControl
    from omni_dp.launcher.record.state import RunState
    from omni_dp.launcher.supervision.supervisor import Supervisor

    stub = _AdminStub(status)
    try:
        state = RunState.create(one_replica_plan(tmp_path))
        state.api_key = "s3cret-key"
        state.update(router=_no_router_process(state, stub.url))
        _healthy(state)
        said: list[str] = []
        supervisor = Supervisor(state, ReplicaControl(state), detached=True, say=said.append)
        assert supervisor.router.set_disabled(0, False) is False
    finally:
        stub.close()
    assert stub.seen_puts == [("/workers/0", "Bearer s3cret-key", b'{"disabled": false}')]
    record = RunState.load(state.directory).replica(0)
    assert f"answered {status}" in record.last_error
    assert any(line.startswith("warning: ") and f"answered {status}" in line for line in said)
    events = RunState.load(state.directory).events()
    assert [e["event"] for e in events] == ["router_admin_failed"]
    assert events[0]["status"] == status
    assert not any("back in the router" in line for line in said)
    assert "s3cret-key" not in (state.directory / "run.json").read_text()
    assert "s3cret-key" not in (state.directory / "events.jsonl").read_text()
    if status == 401:
        assert "--api-key" in record.last_error


def test_a_router_that_refused_a_replica_is_asked_again_until_it_takes_it(tmp_path):
    from omni_dp.launcher.bringup.replicas import ReplicaControl
    from omni_dp.launcher.record.state import RunState
    from omni_dp.launcher.supervision.supervisor import Supervisor

    refusing, accepting = _AdminStub(503), _AdminStub(200)
    try:
        state = RunState.create(one_replica_plan(tmp_path))
        state.update(router=_no_router_process(state, refusing.url))
        _healthy(state)
        said: list[str] = []
        supervisor = Supervisor(state, ReplicaControl(state), detached=True, say=said.append)
        supervisor.router.not_in_router.add(0)
        supervisor.router.retry_enable(skip=lambda index: False)
        assert supervisor.router.not_in_router == {0} and not any("back in" in s for s in said)
        state.update(router=_no_router_process(state, accepting.url))
        supervisor.router.retry_enable(skip=lambda index: False)
    finally:
        refusing.close()
        accepting.close()
    assert supervisor.router.not_in_router == set()
    assert said[-1] == "replica 0: back in the router"
    assert state.replica(0).last_error is None


# --- end to end: real replicas and router on loopback ---------------------------------------

SLOW_REQUESTS = 24  # seeded requests that together keep one CPU replica busy for > 30 s


@pytest.mark.slow
def test_down_drain_timeout_bounds_the_teardown_a_live_supervisor_does(runs):
    """The plan drains 30 s; `down --drain-timeout 1` with requests in flight must take the
    caller's bound through the supervisor (it took 37 s before: the plan's 30 + more)."""
    import threading
    import time
    from http.client import HTTPException

    from support.http_client import request
    from support.launcher import describe

    run = runs(1)
    run.launch("--max-total-tokens", "16384")  # the plan's drain: the default 30 s
    assert run.run_json()["plan"]["supervision"]["drain_timeout"] == 30.0
    statuses: list[int] = []

    def long_request() -> None:
        try:  # cut off by the teardown: a chunked body ends short, which urllib raises on
            statuses.append(request("POST", run.router_url + "/v1/audio/speech",
                                    {"input": "Keep busy please, for a while.", "seed": 1,
                                     "max_new_tokens": 1024}, timeout=90)[0])
        except (ValueError, HTTPException):
            statuses.append(-1)

    clients = [threading.Thread(target=long_request, daemon=True)
               for _ in range(SLOW_REQUESTS)]
    for client in clients:
        client.start()
    time.sleep(1.5)  # all of them in flight
    started = time.monotonic()
    down = run.down("--drain-timeout", "1")
    took = time.monotonic() - started
    for client in clients:
        client.join(90)
    print(f"down --drain-timeout 1 with {SLOW_REQUESTS} requests in flight: {took:.1f} s")
    assert down.returncode == 0, describe(down)
    assert "drain ≤ 1 s" in down.stdout, down.stdout
    assert took < 15, f"down --drain-timeout 1 took {took:.1f} s"
    assert not run.run_dir.exists()


_STALLED_LAUNCH = """
import sys, time
from omni_dp import cli
from omni_dp.launcher.bringup import replicas

def wait_healthy(self, index, timeout_s):  # bring-up stalls here, the replica running
    time.sleep(120)

replicas.ReplicaControl.wait_healthy = wait_healthy
sys.argv = ["omni-dp", *sys.argv[1:]]
cli.main()
"""


@pytest.mark.slow
def test_status_of_a_run_whose_launch_was_killed_during_bring_up_says_abandoned(runs):
    from support.http_client import get
    from support.launcher import describe
    from support.wait import wait_for

    run = runs(1)
    launcher = subprocess.Popen(
        [sys.executable, "-c", _STALLED_LAUNCH, *run.launch_argv(detach=False)], env=run.env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        wait_for("the replica to start", lambda: (run.run_dir / "run.json").exists() and all(
            r["pid"] for r in run.run_json()["replicas"]), timeout=60)
        wait_for("the replica to be healthy", lambda: get(
            f"http://127.0.0.1:{run.base_port}/health", timeout=2)[0] == 200,
            timeout=60)
    finally:
        launcher.kill()  # SIGKILL: no teardown, the replica left running
        launcher.wait(10)
    status = run.cli("status", run.run_id)
    assert status.returncode == 1, describe(status)
    assert f"run {run.run_id}: abandoned" in status.stdout
    assert f"down {run.run_id}" in status.stdout
    as_json = run.cli("status", run.run_id, "--json")
    assert as_json.returncode == 1 and '"state": "abandoned"' in as_json.stdout
    down = run.down()
    assert down.returncode == 0, describe(down)
    assert not run.run_dir.exists() and run.leftover_pids() == []


@pytest.mark.slow
def test_api_key_reaches_the_router_by_environment_and_authenticates_the_supervisor(runs):
    """OMNI_DP_API_KEY set: the router requires it, the supervisor's admin calls send it (so a
    restarted replica really is back in the router), and it is in no argv and no state file.
    A restart clears last_error; a restarted replica killed again is "killed by SIGKILL"."""
    import signal as signals

    from omni_dp.launcher.planning.facts import invoked_as
    from omni_dp.procs import read_environ

    from support.http_client import request, speech
    from support.launcher import OMNI_DP, describe
    from support.wait import wait_for

    key = "hardening-" + uuid.uuid4().hex
    run = runs(2)
    env = {**run.env, "OMNI_DP_API_KEY": key}
    done = subprocess.run([*OMNI_DP, *run.launch_argv("--check-interval", "0.5",
                                                      "--drain-timeout", "5")],
                          env=env, capture_output=True, text=True, timeout=180,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, describe(done)
    data = run.run_json()
    assert data["plan"]["api_key_set"] is True
    command = invoked_as(OMNI_DP[0])
    assert f"teardown   {command} down {run.run_id}" in done.stdout
    assert "-H \"Authorization: Bearer $OMNI_DP_API_KEY\"" in done.stdout
    assert key not in done.stdout + done.stderr
    router, supervisor = data["router"], data["supervisor"]
    for pid in (router["pid"], supervisor["pid"]):
        assert key not in Path(f"/proc/{pid}/cmdline").read_text()
        assert read_environ(pid).get("OMNI_DP_API_KEY") == key
    for replica in data["replicas"]:
        assert "OMNI_DP_API_KEY" not in read_environ(replica["pid"])
    assert speech(run.router_url, timeout=60)[0] == 401  # no key: refused

    def killed_and_restarted(expected_restarts: int) -> dict:
        pid = run.run_json()["replicas"][0]["pid"]
        os.kill(pid, signals.SIGKILL)
        wait_for("replica 0 restarted", lambda: (
            (r := run.run_json()["replicas"][0])["restarts"]
            and len(r["restarts"]) == expected_restarts and r["state"] == "healthy"
            and r["pid"] != pid and sum(e["event"] == "restart_completed"
                                        for e in run.events()) == expected_restarts),
            timeout=60, interval=0.3)
        return run.run_json()["replicas"][0]

    first = killed_and_restarted(1)
    assert first["last_error"] is None  # resolved by the restart; its reason is in the events
    second = killed_and_restarted(2)  # now a child of the supervisor: its signal is known
    assert second["last_error"] is None
    events = run.events()
    reasons = [e["reason"] for e in events if e["event"] == "restart_started"]
    assert reasons == ["its process is gone", "its process was killed by SIGKILL"], reasons
    admin = [e for e in events if e["event"] in ("router_disabled", "router_enabled",
                                                  "router_admin_failed")]
    assert [e["event"] for e in admin] == ["router_disabled", "router_enabled"] * 2, admin
    assert all(e["status"] == 200 for e in admin), admin
    log = (run.run_dir / "logs" / "supervisor.log").read_text()
    assert log.count("back in the router") == 2 and "warning" not in log
    status, _, body = request("POST", run.router_url + "/v1/audio/speech", {"input": "Hello."},
                              headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert status == 200 and body[:4] == b"RIFF"
    for path in run.run_dir.rglob("*"):
        if path.is_file():
            assert key not in path.read_text(errors="replace"), path
    down = run.down()
    assert down.returncode == 0, describe(down)
