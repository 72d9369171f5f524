"""`omni-dp status` of a run over several GPUs (grouped by GPU, each with its own MPS daemon),
the one-GPU output kept as it was, and `status --prometheus-sd`: Prometheus file-based service
discovery of the router and every replica."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from omni_dp.launcher.record.state import RunState
from omni_dp.launcher.views import status as status_module
from omni_dp.launcher.views.scrape_targets import file_sd_problems, run_groups, target_of
from omni_dp.launcher.views.status import collect, format_status
from omni_dp.procs import identify
from omni_dp.runfile import RunRecord

from support.plans import gpu_run_record, run_record

DEAD = 666  # a recorded pid the tests treat as gone
UUID0, UUID1 = "GPU-00000000-aaaa", "GPU-11111111-bbbb"
GPUS = [{"slot": 0, "label": UUID0, "index": 0, "numa_node": 0, "name": "NVIDIA H200"},
        {"slot": 1, "label": UUID1, "index": 1, "numa_node": 1, "name": "NVIDIA H200"}]
ROOT = Path(__file__).resolve().parents[2]


def daemon(pid: int, slot: int) -> dict:
    return {"pid": pid, "create_time": 1.0, "binary": "nvidia-cuda-mps-control",
            "pipe_dir": f"/run/mps/gpu{slot}/pipe", "log_dir": f"/run/mps/gpu{slot}/log",
            "gpu_uuid": GPUS[slot]["label"], "gpu": slot}


def two_gpu_record(run_id: str = "run-2gpu", **changes) -> dict:
    """Replicas 0, 2 on GPU 0 (daemon pid 50, both attached); replica 1 on GPU 1 (daemon pid
    DEAD, its replica not attached)."""
    replicas = [{"index": 0, "gpu": 0, "pid": 10, "create_time": 1.0, "mps_attached": True},
                {"index": 1, "gpu": 1, "pid": 11, "create_time": 1.0, "mps_attached": False},
                {"index": 2, "gpu": 0, "pid": 12, "create_time": 1.0, "mps_attached": True}]
    data = gpu_run_record(run_id, replicas, GPUS, [daemon(50, 0), daemon(DEAD, 1)])
    return {**data, **changes}


def state_of(tmp_path: Path, data: dict) -> RunState:
    directory = tmp_path / data["run_id"]
    (directory / "logs").mkdir(parents=True)
    state = RunState(directory, RunRecord.from_json(data), "token")
    state.save()
    return state


@pytest.fixture
def alive(monkeypatch):
    """Every recorded process runs, but DEAD."""
    monkeypatch.setattr(status_module, "is_alive", lambda identity: identity.pid != DEAD)


UNCAPPED = {"thread_percentage": None, "memory_limit_bytes": None}


# --- status, grouped by GPU ------------------------------------------------------------------


def test_status_json_lists_each_gpu_with_its_replicas_and_its_own_daemon(tmp_path, alive):
    report = json.loads(json.dumps(collect(state_of(tmp_path, two_gpu_record()), probe=False)))
    assert report["gpu"] == f"{UUID0},{UUID1}"
    assert report["gpus"] == [
        {"slot": 0, "index": 0, "label": UUID0, "name": "NVIDIA H200", "numa_node": 0,
         "replicas": [0, 2], "mps": {"daemon_pid": 50, "daemon_alive": True, "attached": True,
                                     "limits": UNCAPPED}},
        {"slot": 1, "index": 1, "label": UUID1, "name": "NVIDIA H200", "numa_node": 1,
         "replicas": [1], "mps": {"daemon_pid": DEAD, "daemon_alive": False,
                                  "attached": False, "limits": UNCAPPED}}]
    # `mps` as before: the first GPU's daemon, and `attached` for the whole run.
    assert report["mps"] == {"daemon_pid": 50, "daemon_alive": True, "attached": False,
                             "limits": UNCAPPED}
    assert [(r["index"], r["gpu"], r["url"]) for r in report["replicas"]] == [
        (0, 0, "http://127.0.0.1:1"), (1, 1, "http://127.0.0.1:2"), (2, 0, "http://127.0.0.1:3")]


def test_status_text_prints_each_gpus_table_under_a_heading_naming_its_daemon(tmp_path, alive):
    text = format_status(collect(state_of(tmp_path, two_gpu_record()), probe=False))
    lines = text.splitlines()
    head0 = lines.index(f"  GPU 0 (NVIDIA H200)  {UUID0}  NUMA node 0  mps daemon pid 50 alive"
                        "  attached=True")
    head1 = lines.index(f"  GPU 1 (NVIDIA H200)  {UUID1}  NUMA node 1  mps daemon pid {DEAD} "
                        "NOT running  attached=False")
    assert head0 < head1
    rows = {line.split()[0]: i for i, line in enumerate(lines)
            if line.startswith("    ") and line.split()[0].isdigit()}
    assert head0 < rows["0"] < rows["2"] < head1 < rows["1"]
    assert not any(line.startswith("  mps daemon") for line in lines)  # in the headings
    assert sum(line.split()[0] == "replica" for line in lines) == 2  # one header per GPU
    headers = [line for line in lines if line.split()[0] == "replica"]
    assert headers[0] == headers[1]  # the tables line up


def test_a_gpu_without_a_daemon_or_replica_says_so(tmp_path, alive):
    data = two_gpu_record()
    data["mps"]["daemons"] = data["mps"]["daemons"][:1]  # GPU 1's never started
    for replica in data["replicas"]:
        replica["gpu"] = 0
    report = collect(state_of(tmp_path, data), probe=False)
    assert report["gpus"][1]["mps"] is None and report["gpus"][1]["replicas"] == []
    lines = format_status(report).splitlines()
    i = lines.index(f"  GPU 1 (NVIDIA H200)  {UUID1}  NUMA node 1")
    assert lines[i + 1] == "    (no replica on this GPU)"


def test_the_one_gpu_text_is_as_before_runs_spanned_gpus(tmp_path, alive):
    data = run_record("run-1", [
        {"index": 0, "pid": 10, "create_time": 1.0, "mps_attached": True, "cpus": "0-3"},
        {"index": 1, "pid": 11, "create_time": 1.0, "last_error": "boom"}],
        daemon(50, 0))
    report = collect(state_of(tmp_path, data), probe=False)
    assert report["gpus"] == [{"slot": 0, "index": None, "label": "GPU-test", "name": None,
                               "numa_node": None, "replicas": [0, 1],
                               "mps": {"daemon_pid": 50, "daemon_alive": True,
                                       "attached": None, "limits": UNCAPPED}}]
    text = format_status(report)
    assert text.splitlines()[3:] == [
        "  mps daemon  pid 50 alive  attached=None",
        "  replica  pid  cpus  port  health   kv_tokens  mps       share  memory  restarts"
        "  last_error",
        "  0        10   0-3   1     unknown  1024       attached  -      -       0         ",
        "  1        11   -     2     unknown  1024       -         -      -       0         boom"]
    md = format_status(report, fmt="markdown").splitlines()
    assert md[0] == f"**{text.splitlines()[0]}**"
    assert "- mps daemon  pid 50 alive  attached=None" in md
    assert "| replica | pid | cpus | port | health | kv_tokens | mps | share | memory | " \
           "restarts | last_error |" in md
    assert "| 1 | 11 | - | 2 | unknown | 1024 | - | - | - | 0 | boom |" in md


def test_the_markdown_of_a_run_over_gpus_has_a_gpu_column(tmp_path, alive):
    report = collect(state_of(tmp_path, two_gpu_record()), probe=False)
    md = format_status(report, fmt="markdown").splitlines()
    header = next(line for line in md if line.startswith("| gpu | replica |"))
    rows = md[md.index(header) + 2:]
    # replica 0 on GPU 0, 1 on GPU 1, 2 on GPU 0
    assert [row.split(" | ")[:2] for row in rows if row.startswith("|")] == [
        ["| 0", "0"], ["| 1", "1"], ["| 0", "2"]]
    assert any(line.startswith(f"- GPU 1 (NVIDIA H200)  {UUID1}") for line in md)


# --- Prometheus file-based service discovery ------------------------------------------------


def test_the_target_list_has_the_router_and_every_replica_labelled():
    record = RunRecord.from_json(two_gpu_record())
    groups = run_groups(record)
    assert groups[0] == {"targets": ["127.0.0.1:1"],
                         "labels": {"omni_dp_run": "run-2gpu", "omni_dp_role": "router",
                                    "__metrics_path__": "/metrics"}}
    assert groups[1:] == [
        {"targets": [f"127.0.0.1:{1 + i}"],
         "labels": {"omni_dp_run": "run-2gpu", "omni_dp_role": "replica",
                    "omni_dp_replica": str(i), "omni_dp_gpu": gpu,
                    "__metrics_path__": "/metrics"}}
        for i, gpu in ((0, UUID0), (1, UUID1), (2, UUID0))]
    assert file_sd_problems(groups) == []
    cpu = RunRecord.from_json(run_record("run-cpu", [{"index": 0}], gpu="cpu"))
    assert run_groups(cpu)[1]["labels"]["omni_dp_gpu"] == "cpu"


def test_the_recorded_router_url_wins_and_hosts_keep_their_form():
    data = two_gpu_record()
    data["router"] = {"pid": 1, "create_time": 1.0, "pgid": 1, "url": "https://[::1]:8443",
                      "argv": [], "log": "router.log"}
    [router, *_] = run_groups(RunRecord.from_json(data))
    assert router["targets"] == ["[::1]:8443"] and router["labels"]["__scheme__"] == "https"
    assert target_of("http://example:80/x") == ("example:80", "http")
    with pytest.raises(ValueError, match="not an http"):
        target_of("unix:///tmp/sock")


@pytest.mark.parametrize(("groups", "problem"), [
    ({"targets": []}, "JSON list"),
    ([{"targets": ["127.0.0.1:1"], "labels": {"omni-dp-run": "x"}}], "label name 'omni-dp-run'"),
    ([{"targets": ["127.0.0.1:1"], "labels": {"9run": "x"}}], "label name '9run'"),
    ([{"targets": ["127.0.0.1:1"], "labels": {"replica": 0}}], "not a string"),
    ([{"targets": ["http://127.0.0.1:1"]}], "is not host:port"),
    ([{"targets": ["127.0.0.1"]}], "is not host:port"),
    ([{"targets": ["127.0.0.1:99999"]}], "is not host:port"),
    ([{"targets": "127.0.0.1:1"}], "list of"),
    ([{"targets": [], "job": "x"}], "only `targets` and `labels`"),
])
def test_the_format_check_refuses_what_prometheus_would(groups, problem):
    assert any(problem in p for p in file_sd_problems(groups)), file_sd_problems(groups)


def omni_dp(*args: str, root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omni_dp", *args], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL,
                          env={**os.environ, "OMNI_DP_STATE_DIR": str(root)})


@pytest.fixture
def runs(tmp_path) -> Path:
    """Two live runs (their launcher: this test's process, by pid and create time) and one
    whose every process is gone, under one state dir."""
    me = identify(os.getpid())
    assert me is not None
    root = tmp_path / "state"
    for run_id, launcher in (("run-a", me), ("run-b", me), ("run-gone", None)):
        data = two_gpu_record(run_id)
        data["launcher"] = ({"pid": launcher.pid, "create_time": launcher.create_time}
                            if launcher else None)
        data["mps"] = None
        directory = root / "runs" / run_id
        directory.mkdir(parents=True)
        (directory / "run.json").write_text(json.dumps(data))
        (directory / "run_token").write_text("token")
    return root


def test_status_prometheus_sd_writes_every_live_run_into_one_file(runs, tmp_path):
    out = tmp_path / "sd" / "omni-dp.json"
    out.parent.mkdir()
    done = omni_dp("status", "--prometheus-sd", str(out), "--json", root=runs)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"file": str(out), "runs": ["run-a", "run-b"],
                                       "targets": 8}
    groups = json.loads(out.read_text())
    assert file_sd_problems(groups) == []
    assert [(g["labels"]["omni_dp_run"], g["labels"]["omni_dp_role"]) for g in groups] == [
        (run, role) for run in ("run-a", "run-b")
        for role in ("router", "replica", "replica", "replica")]
    assert stat.S_IMODE(out.stat().st_mode) == 0o644  # a Prometheus user reads it
    assert [p.name for p in out.parent.iterdir()] == ["omni-dp.json"]  # no temp file left
    named = omni_dp("status", "run-gone", "--prometheus-sd", "-", root=runs)
    assert named.returncode == 0, named.stderr
    assert {g["labels"]["omni_dp_run"] for g in json.loads(named.stdout)} == {"run-gone"}


def test_status_prometheus_sd_with_no_live_run_writes_an_empty_list(tmp_path):
    out = tmp_path / "omni-dp.json"
    out.write_text("[stale]")
    done = omni_dp("status", "--prometheus-sd", str(out), root=tmp_path / "state")
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text()) == [] and "no live run" in done.stdout


@pytest.mark.parametrize(("args", "why", "code"), [
    (["--prometheus-sd", "/nonexistent-dir/x.json"], "cannot write the Prometheus target list",
     2),
    (["no-such-run", "--prometheus-sd", "-"], "no run 'no-such-run'", 1),  # nothing there
])
def test_status_prometheus_sd_bad_input_exits_2(runs, args, why, code):
    done = omni_dp("status", *args, root=runs)
    assert done.returncode == code and why in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def promtool() -> str:
    found = os.environ.get("OMNI_DP_PROMTOOL")
    cached = ROOT / ".cache/promtool/usr/bin/promtool"
    if not found and cached.is_file():
        found = str(cached)
    if not found:
        if os.environ.get("CI", "") not in ("", "0", "false"):
            pytest.fail("promtool not found (scripts/test installs it into .cache/promtool)")
        pytest.skip("promtool not found (scripts/test installs it into .cache/promtool)")
    return found


def check_config(directory: Path, targets: str) -> subprocess.CompletedProcess:
    """`promtool check config` of one scrape job reading `targets` through file_sd: promtool
    parses the file_sd files a config names (a missing one is only a warning)."""
    (directory / "targets.json").write_text(targets)
    (directory / "prometheus.yml").write_text(
        "scrape_configs:\n  - job_name: omni-dp\n    file_sd_configs:\n"
        "      - files: [targets.json]\n")
    return subprocess.run([promtool(), "check", "config", str(directory / "prometheus.yml")],
                          capture_output=True, text=True, timeout=60, cwd=directory)


def test_promtool_accepts_the_written_target_list(runs, tmp_path):
    done = omni_dp("status", "--prometheus-sd", "-", root=runs)
    assert done.returncode == 0, done.stderr
    checked = check_config(tmp_path, done.stdout)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "WARNING" not in checked.stdout + checked.stderr  # the file was read
    bad = check_config(tmp_path, json.dumps([{"targets": ["127.0.0.1:1"],
                                              "labels": {"omni-dp-run": "x"}}]))
    assert bad.returncode != 0 and "not a valid label name" in bad.stdout + bad.stderr
