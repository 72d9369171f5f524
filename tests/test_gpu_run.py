"""The device call (bench/gpu_run.sh, bench/gpu_run.py) and its parts, run on CPU end to end.

A lent GPU machine gives one call of minutes and brings back at most 8 files under $OUT, so
the call must stay within that whatever happens — a step that fails or times out, a budget
spent, a SIGTERM, a SIGKILL — and leave none of its processes running on the (warm) machine.
Here it runs the same steps with `GPU=none` (the tiny model on the CPU); the MPS smoke test runs
against the real control daemon.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import psutil
import pytest

from omni_dp.procs import read_environ

from support.mps import real_control_binary
from support.recognizer import voice_missing

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
# What the device tool brings back: at most 8 files, 2 folders down, names of these characters.
MAX_FILES = 8
NAME = re.compile(r"^[A-Za-z0-9._-]+$")

sys.path.insert(0, str(BENCH))  # the bench scripts import each other as top-level modules


def processes_under(directory: str) -> list[int]:
    """Processes whose state dir or MPS pipe dir lies under `directory`."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        env = read_environ(proc.pid) or {}
        paths = (env.get("OMNI_DP_STATE_DIR", ""), env.get("CUDA_MPS_PIPE_DIRECTORY", ""))
        if any(p.startswith(directory) for p in paths):
            found.append(proc.pid)
    return found


def knobs(out: Path, **more: str) -> dict[str, str]:
    return {**os.environ, "OUT": str(out), "GPU": "none", "PYTHON": sys.executable,
            "BUDGET": "420", **more}


def returned_files(out: Path) -> list[Path]:
    """What the device tool would bring back, checked against its limits."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= MAX_FILES, sorted(p.name for p in files)
    for path in files:
        relative = path.relative_to(out)
        assert len(relative.parts) <= 3 and all(NAME.match(part) for part in relative.parts)
        assert path.stat().st_size <= 16 * 1024**2
    return files


def gpu_run(out: Path, timeout: float = 400, **more: str) -> tuple[int, str]:
    done = subprocess.run(["bash", str(BENCH / "gpu_run.sh")], env=knobs(out, **more),
                          capture_output=True, text=True, timeout=timeout, check=False)
    summary = (out / "summary.md").read_text()
    work = re.search(r"work dir (\S+)", summary).group(1)
    assert not Path(work).exists(), f"work dir {work} kept: {summary}"
    assert processes_under(work) == [], "a process of the device call is still running"
    names = {p.name for p in returned_files(out)}
    assert {"summary.md", "results.json", "console.log", "artifacts.tar.gz"} <= names
    return done.returncode, summary


def results(out: Path) -> dict[str, dict]:
    return {s["name"]: s for s in json.loads((out / "results.json").read_text())["steps"]}


def row(summary: str, step: str) -> str:
    match = re.search(rf"^\| {step} \| ([^|]+) \|", summary, re.M)
    assert match, summary
    return match.group(1).strip()


@pytest.mark.slow
def test_the_device_call_runs_on_cpu_and_brings_back_at_most_eight_files(tmp_path):
    real_control_binary()  # the smoke step drives the real daemon (fails in CI if missing)
    out = tmp_path / "out"
    # every step through its own knobs, smaller: one concurrency level (the DP2 : DP1 ratio
    # needs one both reach), the shared-weights run alone (the separate one is the headline's
    # plain launch), 10 talker steps timed
    rc, summary = gpu_run(out, HEADLINE_CONCURRENCY="4", SHARE_RUNS="shared", CHECK_STEPS="10")
    assert rc == 0, summary
    for step in ("probe", "mps smoke", "headline", "share", "gpu_check", "teardown"):
        assert row(summary, step) == "ok", summary
    for step in ("overlap", "more DP", "form3", "tp2", "gpus2", "caps"):
        assert row(summary, step) == "skipped: no GPU (GPU=none)"
    # the trained voice, measured where the probe finds it (on the CPU here: DP1 only)
    missing = voice_missing()
    if missing and not os.environ.get("OMNI_DP_REQUIRE_VOICE"):
        assert row(summary, "voice").startswith("skipped: the voice cannot run here: ")
    else:
        assert row(summary, "voice") == "ok", summary
        voice = results(out)["voice"]["figures"]["configs"]
        assert [(c["name"], c["status"]) for c in voice] == [("1", "ok")]
        assert "- the trained voice, DP1: " in summary.split("## Steps")[0]
    # the headline figures lead, before the table of steps
    head = summary.split("## Steps")[0]
    assert re.search(r"^- DP2: [\d.]+ \[[\d.]+–[\d.]+\] req/s at c=\d+ .*x DP1", head, re.M), head
    assert "MPS: one client NOT listed" in head  # no GPU: no client can attach, said
    assert "weights shared: ok" in head and "one replica:" in head
    steps = results(out)
    assert steps["probe"]["figures"]["python"] == sys.executable
    assert {i["dist"] for i in steps["probe"]["figures"]["imports"]} >= {"pyzmq", "soundfile"}
    configs = steps["headline"]["figures"]["configs"]
    assert [(c["name"], c["status"]) for c in configs] == [("1", "ok"), ("2", "ok")]
    assert steps["headline"]["figures"]["bench"]["complete"] is True
    assert "Torch not compiled with CUDA" in steps["mps smoke"]["figures"]["concurrency"]["error"]
    assert steps["teardown"]["figures"] == {"cleanup_runs": [], "left_behind": []}
    assert steps["gpu_check"]["figures"]["steps"]["steps"] == 10  # the knob reached the step
    assert (out / "headline.png").stat().st_size > 10_000
    assert "### headline: ok" in (out / "console.log").read_text()
    with tarfile.open(out / "artifacts.tar.gz") as tar:
        names = tar.getnames()
    for run in ("bench-1-", "bench-2-", "share-bench-shared-"):
        run_files = [n for n in names if run in n]
        for name in ("run.json", "events.jsonl", "replica_0.log"):
            assert any(n.endswith(name) for n in run_files), (run, names)
    assert not any(n.endswith(("run_token", ".bin")) for n in names)  # no secret, no weights
    assert {"steps/probe.txt", "steps/headline.txt", "headline/bench.json",
            "smoke/log/control.log", "INDEX.txt"} <= set(names)


def start_call(out: Path, **more: str) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(BENCH / "gpu_run.sh")], env=knobs(out, **more),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def wait_for(out: Path, text: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in ((out / "console.log").read_text() if (out / "console.log").exists()
                       else ""):
        assert proc.poll() is None and time.monotonic() < deadline, f"never said {text!r}"
        time.sleep(0.2)


@pytest.mark.slow
def test_a_call_killed_outright_still_leaves_its_summary_and_tarball(tmp_path):
    """SIGKILL (the device tool's own timeout, 137): no teardown runs, and what was written
    after the last finished step is what comes back."""
    real_control_binary()
    out = tmp_path / "out"
    proc = start_call(out)
    try:
        wait_for(out, "### headline:", proc)
        time.sleep(2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    summary = (out / "summary.md").read_text()
    work = re.search(r"work dir (\S+)", summary).group(1)
    try:
        names = {p.name for p in returned_files(out)}
        assert {"summary.md", "results.json", "console.log", "artifacts.tar.gz"} <= names
        assert "in progress" in summary and row(summary, "mps smoke") == "ok"
        with tarfile.open(out / "artifacts.tar.gz") as tar:
            assert "steps/mps_smoke.txt" in tar.getnames()
    finally:  # what a rerun's teardown would do: stop the headline's run, by its records
        for pid in processes_under(work):
            with contextlib.suppress(ProcessLookupError):
                if psutil.Process(pid).name() != "nvidia-cuda-mps-control":
                    os.killpg(os.getpgid(pid), signal.SIGKILL)
        subprocess.run([sys.executable, "launch_scaling.py", "--cleanup", "--state-dir",
                        f"{work}/state", "--out", f"{work}/cleanup", "--watch-dir", work],
                       cwd=BENCH, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, timeout=120, check=False)
        smoke(Path(work), "--cleanup")
        assert processes_under(work) == []
        shutil.rmtree(work, ignore_errors=True)  # what the device machine's end does


@pytest.mark.slow
def test_sigterm_stops_the_step_in_progress_and_the_teardown_still_runs(tmp_path):
    real_control_binary()
    out = tmp_path / "out"
    proc = start_call(out)
    try:
        wait_for(out, "omni-dp bench: 1: concurrency", proc)  # a configuration is up
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(120) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    summary = (out / "summary.md").read_text()
    work = re.search(r"work dir (\S+)", summary).group(1)
    assert "stopped by SIGTERM" in summary and row(summary, "teardown") == "ok", summary
    assert "share" not in results(out)  # nothing after the stopped step
    assert not Path(work).exists() and processes_under(work) == []
    returned_files(out)


@pytest.mark.slow
def test_steps_that_time_out_or_fail_are_rows_and_the_next_runs(tmp_path):
    """The headline is stopped at 12 s in its first configuration (the bench downs it), the
    weight-share step and gpu_check at 3 s; the teardown still finds nothing left."""
    real_control_binary()
    rc, summary = gpu_run(tmp_path / "out", LIMIT_HEADLINE="12", LIMIT_SHARE="3",
                          LIMIT_GPU_CHECK="3", LIMIT_VOICE="3")
    assert rc == 1, summary
    for step, limit in (("headline", 12), ("share", 3), ("gpu_check", 3)):
        assert row(summary, step) == f"timed out after {limit} s", summary
    assert row(summary, "teardown") == "ok"
    assert results(tmp_path / "out")["gpu_check"]["figures"]["result"] is None  # cut short


@pytest.mark.slow
def test_steps_past_the_budget_are_skipped_and_said_so(tmp_path):
    """20 s before the teardown's reserve: the probe runs, then neither the smoke test (it
    needs 20) nor the headline (60) has room, however long the probe took. The probe gets 18 s
    of the 20: on a loaded machine it took 9-13 s (8 timed it out beside vLLM's start)."""
    rc, summary = gpu_run(tmp_path / "out", BUDGET="70", TEARDOWN_RESERVE="50",
                          LIMIT_PROBE="18")
    assert rc == 1
    assert row(summary, "probe") == "ok"
    assert re.match(r"skipped: budget spent \(\d+ s left, the step needs 20\)",
                    row(summary, "mps smoke")), summary
    assert re.match(r"skipped: budget spent \(\d+ s left, the step needs 60\)",
                    row(summary, "headline")), summary
    assert row(summary, "teardown") == "ok"


@pytest.mark.slow
def test_a_package_missing_on_the_machine_is_named_first_and_its_steps_skipped(tmp_path):
    """pyzmq made unimportable (a stand-in package that raises, first on PYTHONPATH): the
    probe names it and how to carry it; the MPS smoke test, which needs only torch, still
    runs; every serving step is skipped, said."""
    real_control_binary()
    shadow = tmp_path / "shadow" / "zmq"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ImportError(\"No module named 'zmq' (test stand-in)\")\n")
    out = tmp_path / "out"
    rc, summary = gpu_run(out, PYTHONPATH=str(tmp_path / "shadow"))
    assert rc == 1
    probe = (out / "console.log").read_text().split("### probe", 2)[1]
    assert probe.splitlines()[1].startswith("python ")  # the imports come first
    assert "MISSING pyzmq (import zmq)" in probe
    assert "bench/fetch_wheels.sh" in probe and ".whl" in probe
    assert row(summary, "probe") == "exit 1" and row(summary, "mps smoke") == "ok"
    for step in ("headline", "share", "gpu_check", "voice"):
        assert row(summary, step) == "skipped: pyzmq missing (see probe)", summary
    assert summary.split("## Headline")[1].lstrip().startswith("- MISSING on the machine")


@pytest.mark.slow
def test_the_run_checks_launch_verify_and_down_through_the_command_line(tmp_path):
    """gpu_runs.py's overlap check on the CPU: the --mps run is refused before it starts, the
    plain one launches, `verify-mps --overlap` answers (cannot check on the CPU: exit 2, its
    JSON kept) and is downed with nothing left — the path form3 and gpus2 share."""
    state = tmp_path / "state"
    done = subprocess.run(
        [sys.executable, str(BENCH / "gpu_runs.py"), "overlap", "--gpu", "none", "--model",
         "tiny", "--state-dir", str(state), "--duration", "1", "--concurrency", "2"],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=BENCH, capture_output=True,
        text=True, timeout=240, check=False)
    from gpu_steps import marked_json

    facts = marked_json(done.stdout)
    assert done.returncode == 1, done.stdout[-3000:]  # the --mps run could not launch
    assert facts["mps"]["launch_rc"] == 2
    assert any("--mps needs a GPU" in line for line in facts["mps"]["launch_error"])
    plain = facts["plain"]
    assert plain["launch_rc"] == 0 and plain["verify_overlap"]["rc"] == 2, plain
    assert isinstance(plain["verify_overlap"]["report"], dict)
    assert plain["down_rc"] == 0 and plain["left_behind"] == [] and not plain["run_dir_left"]
    assert processes_under(str(state)) == []


# --- what the machine lacks travels as wheels -------------------------------------------------


def dependencies() -> dict[str, bool]:
    """pyproject.toml's runtime dependencies: name -> needed on the device image's Python
    (3.12, Linux)."""
    from test_dependencies import declared

    image_python = {"python_version": "3.12", "python_full_version": "3.12.3",
                    "sys_platform": "linux"}
    return {name: r.marker is None or r.marker.evaluate(image_python)
            for name, r in declared().items()}


def carried() -> set[str]:
    done = subprocess.run([str(BENCH / "fetch_wheels.sh"), "--list"], capture_output=True,
                          text=True, check=True)
    return {line.split("==")[0].lower() for line in done.stdout.split()}


def test_every_dependency_is_in_the_device_image_or_carried_and_probed():
    from gpu_probe import DEPENDENCIES, OPTIONAL

    image = {line.strip().lower() for line in (BENCH / "device_image.txt").read_text()
             .splitlines() if line.strip() and not line.startswith("#")}
    wheels = carried()
    for name, needed in dependencies().items():
        if needed and name not in OPTIONAL:
            assert name in image or name in wheels, f"{name}: neither in the image nor carried"
        assert name in DEPENDENCIES, f"{name}: the probe does not import it"
    # soundfile's cffi (and cffi's pycparser) are not in the image: carried with it
    assert {"cffi", "pycparser", "pyzmq", "soundfile", "python-json-logger"} <= wheels
    assert not wheels & image, "a carried wheel shadows the image's own copy"


def test_an_optional_package_absent_is_reported_and_not_missing(tmp_path):
    """PyAV (the `aac` extra) is not in the device image and not carried: the probe says so
    and exits 0, where a package the serving path imports would be MISSING and exit 1."""
    shadow = tmp_path / "av"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'av' (stand-in)\")\n")
    done = subprocess.run([sys.executable, str(BENCH / "gpu_probe.py")], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert "ABSENT av (import av): response_format aac only" in done.stdout, done.stdout
    assert "MISSING" not in done.stdout and done.returncode == 0, done.stdout


def test_each_carried_wheel_is_one_pinned_version():
    done = subprocess.run([str(BENCH / "fetch_wheels.sh"), "--list"], capture_output=True,
                          text=True, check=True)
    pins = done.stdout.split()
    assert all(re.fullmatch(r"[a-z0-9-]+==[\w.]+", p) for p in pins), pins
    assert len({p.split("==")[0] for p in pins}) == len(pins)


# --- the two-kernel proof's arithmetic -----------------------------------------------------------


def test_a_pair_side_by_side_and_one_after_the_other():
    from kernel_pair import pair_timing

    together = pair_timing([(10.0, 11.0), (10.02, 11.03)], alone_s=1.0)
    assert together.wall_vs_alone == pytest.approx(1.03)
    assert together.overlap_s == pytest.approx(0.98)
    turns = pair_timing([(10.0, 11.0), (11.0, 12.0)], alone_s=1.0)
    assert turns.wall_vs_alone == pytest.approx(2.0) and turns.overlap_s == 0.0
    with pytest.raises(ValueError):
        pair_timing([(0.0, 1.0)], alone_s=1.0)


# --- the MPS smoke test against the real control daemon -------------------------------------


def smoke(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH / "mps_smoke.py"), "--work", str(tmp_path / "smoke"), *args],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=120, check=False)


@pytest.mark.slow
def test_mps_smoke_without_a_gpu_reports_that_no_server_could_start(tmp_path):
    real_control_binary()
    done = smoke(tmp_path, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    facts = json.loads(done.stdout)
    assert facts["binaries"]["control"] and facts["binaries"]["server"]
    assert facts["daemon"]["path_first"] == os.path.dirname(facts["binaries"]["server"])
    assert facts["daemon"]["before_any_client"] == {"servers": [], "clients": {}}
    assert "libcuda" in facts["after_cuinit"]["client"]["error"]
    assert not facts["after_context"]["client_listed"]
    assert facts["after_context"]["daemon"]["servers"] == []
    by_hand = facts["start_server_by_hand"]
    assert by_hand["daemon"]["servers"] == []
    assert any("Starting new server" in line for line in by_hand["control_log"])
    assert any(re.search(r"Server \d+ exited with status [1-9]", line)
               for line in by_hand["control_log"])
    assert facts["quit"] == {"stopped": True, "alive_after": False}
    assert processes_under(str(tmp_path)) == []


@pytest.mark.slow
def test_mps_smoke_cleanup_quits_the_daemon_a_killed_run_left(tmp_path):
    real_control_binary()
    proc = subprocess.Popen(
        [sys.executable, str(BENCH / "mps_smoke.py"), "--work", str(tmp_path / "smoke")],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "smoke" / "daemon.json").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "no daemon record"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)  # the smoke test and its client, not the daemon
        proc.wait(10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    record = json.loads((tmp_path / "smoke" / "daemon.json").read_text())
    assert psutil.pid_exists(record["pid"]), "the daemon should outlive the killed smoke test"
    done = smoke(tmp_path, "--cleanup")
    assert done.returncode == 0 and "stopped" in done.stdout, done.stdout
    assert processes_under(str(tmp_path)) == []
    assert "nothing to stop" in smoke(tmp_path, "--cleanup").stdout or \
        "already gone" in smoke(tmp_path, "--cleanup").stdout


# --- launch_scaling's pieces ------------------------------------------------------------------


def test_the_router_port_lies_outside_the_replicas_range():
    from launch_scaling import free_port_block

    base = free_port_block(4)  # 3 replicas, then the router
    replicas, router = range(base, base + 3), base + 3
    assert router not in replicas and router == replicas[-1] + 1


def test_artifacts_are_copied_without_the_token_sockets_or_fifos(tmp_path):
    import socket

    from artifacts import copy_artifacts

    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "mps" / "pipe").mkdir(parents=True)
    (run / "run.json").write_text("{}")
    (run / "run_token").write_text("secret")
    (run / "share").mkdir()
    (run / "share" / "weights.bin").write_bytes(b"w" * 100)
    (run / "logs" / "replica_0.log").write_text("x" * 100)
    os.mkfifo(run / "mps" / "pipe" / "log")  # opening it to read would block forever
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(run / "mps" / "pipe" / "control"))
        copied = copy_artifacts(run, tmp_path / "copy")
    assert sorted(copied) == ["logs/replica_0.log", "run.json"]
    assert (tmp_path / "copy" / "logs" / "replica_0.log").read_text() == "x" * 100


def test_a_misspelled_configuration_is_refused_before_anything_runs():
    from launch_scaling import parse_args, parse_config

    assert parse_config("3mps") == (3, True) and parse_config("2") == (2, False)
    for bad in ("mps", "0", "2MPS", "x2"):
        with pytest.raises(ValueError, match="is not N or Nmps"):
            parse_config(bad)
    with pytest.raises(ValueError):
        parse_args(["--configs", "1,2mps,3pms", "--state-dir", "/nonexistent"])


def test_the_vllm_omni_step_runs_only_where_the_image_has_it_and_a_model_is_given(tmp_path):
    """Skipped and said: no vllm-omni in the image (the probe's word), then no model on the
    machine; with both, the plan of two replicas on the GPU through the launcher's dry run."""
    import gpu_probe
    from gpu_steps import Settings, steps

    def step(**env):
        settings = Settings.from_env({"GPU": "0", "WORK": str(tmp_path), **env})
        return next(s for s in steps(settings) if s.name == "vllm-omni")

    @dataclasses.dataclass
    class Probe:
        figures: dict
        name: str = "probe"

    absent = Probe({"engines": {"vllm-omni": {"error": "no module vllm_omni in /usr/bin/python3"}}})
    present = Probe({"engines": {"vllm-omni": {"version": "0.30.0", "at": "/x"}}})
    assert step().skip([absent]) == ("vllm-omni is not in this image: no module vllm_omni in "
                                    "/usr/bin/python3")
    assert step().skip([present]).startswith("no vllm-omni model on this machine")
    given = step(VLLM_OMNI_MODEL="/m", VLLM_OMNI_DEPLOY="/d.yaml")
    assert given.skip([present]) is None
    assert given.argv[-4:] == ["--", "/m", "--deploy-config", "/d.yaml"]
    assert given.argv[4:7] == ["--engine", "vllm-omni", "--dry-run"]
    missing = gpu_probe.engine_package("vllm-omni", "vllm_omni", sys.executable)
    assert missing == {"error": f"no module vllm_omni in {sys.executable}"}
