"""Finding the MPS control/server pair where the driver ships it, their versions, and the PATH
that makes the daemon start the chosen server. Fake driver folders under tmp_path; the last
tests drive the REAL control daemon (skipped unless it is installed, as in scripts/test)."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

from omni_dp.launcher.bringup.steps import start_daemon
from omni_dp.launcher.planning.facts import LaunchFacts, gather_facts
from omni_dp.launcher.planning.options import LaunchOptions
from omni_dp.mps import binaries
from omni_dp.mps.binaries import (
    SERVER_NAME,
    BinaryNotFound,
    MpsBinaries,
    control_version,
    driver_version,
    locate_mps_binaries,
)
from omni_dp.mps.control import BINARY_NAME, MpsControl
from omni_dp.mps.daemon import DaemonRecord, MpsDaemon
from omni_dp.mps.preflight import locate_control_binary, run_preflight
from omni_dp.procs import ProcessIdentity, is_alive

from support import plans
from support.mps import real_control_binary
from support.ports import free_port_block
from support.wait import wait_for

OLD = "535.309.01"  # Debian's build, the one CI installs
NEW = "580.159.03"  # the driver of the GPU machines we are lent
DEFAULT_DRIVER_DIRS = binaries.DRIVER_DIRS  # before any test replaces them


def fake(path: Path, version: str | None = None, body: str = "exit 0") -> Path:
    """A small executable script; `version` embedded as the real control binary holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    stamp = f"# built for driver {version}\n" if version else ""
    path.write_text(f"#!/bin/sh\n{stamp}{body}\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """An empty PATH folder, no $OMNI_DP_MPS_CONTROL, no driver folders unless a test adds
    them: nothing of the real machine is found."""
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("OMNI_DP_MPS_CONTROL", raising=False)
    monkeypatch.setattr(binaries, "DRIVER_DIRS", ())
    return tmp_path


def locate(*args, driver=None, **kwargs) -> MpsBinaries:
    return locate_mps_binaries(*args, driver=driver or (lambda: None), **kwargs)


# --- where control and server are found -------------------------------------------------------


def test_found_on_path_with_its_server_beside_it(machine, monkeypatch):
    control = fake(machine / "bin" / BINARY_NAME)
    server = fake(machine / "bin" / SERVER_NAME)
    monkeypatch.setenv("PATH", f"{machine / 'empty'}{os.pathsep}{machine / 'bin'}")
    found = locate()
    assert (found.control, found.server, found.origin) == (str(control), str(server), "PATH")


def test_found_only_in_a_driver_folder(machine):
    driver_bin = machine / "usr" / "local" / "nvidia" / "bin"
    control = fake(driver_bin / BINARY_NAME)
    server = fake(driver_bin / SERVER_NAME)
    found = locate(driver_dirs=[str(machine / "nowhere"), str(driver_bin)])
    assert (found.control, found.server) == (str(control), str(server))
    assert found.origin == f"driver folder {driver_bin}"
    assert f"driver folder {driver_bin}" in found.describe()


def test_the_default_driver_folders_are_searched(machine, monkeypatch):
    driver_bin = machine / "nvidia" / "bin"
    control = fake(driver_bin / BINARY_NAME)
    monkeypatch.setattr(binaries, "DRIVER_DIRS", (str(driver_bin),))
    assert locate().control == str(control)
    assert locate_control_binary(None)[1] == []
    assert "/usr/local/nvidia/bin" in DEFAULT_DRIVER_DIRS  # the lent machines' driver mount


def test_path_comes_before_the_driver_folders(machine, monkeypatch):
    on_path = fake(machine / "bin" / BINARY_NAME)
    fake(machine / "nvidia" / BINARY_NAME)
    monkeypatch.setenv("PATH", str(machine / "bin"))
    assert locate(driver_dirs=[str(machine / "nvidia")]).control == str(on_path)


def test_found_only_next_to_nvidia_smi_through_its_link(machine, monkeypatch):
    """Debian's layout: /usr/bin/nvidia-smi links into /usr/lib/nvidia/current, where the
    driver's other programs are."""
    current = machine / "lib" / "nvidia" / "current"
    smi = fake(current / "nvidia-smi")
    control = fake(current / BINARY_NAME)
    (machine / "bin").mkdir()
    (machine / "bin" / "nvidia-smi").symlink_to(smi)
    monkeypatch.setenv("PATH", str(machine / "bin"))
    found = locate()
    assert found.control == str(control)
    assert found.origin == f"next to nvidia-smi ({current})"


def test_next_to_the_nvidia_smi_of_a_driver_folder(machine):
    driver_bin, current = machine / "drv", machine / "real"
    fake(current / "nvidia-smi")
    control = fake(current / BINARY_NAME)
    driver_bin.mkdir()
    (driver_bin / "nvidia-smi").symlink_to(current / "nvidia-smi")
    found = locate(driver_dirs=[str(driver_bin)])
    assert (found.control, found.origin) == (str(control), f"next to nvidia-smi ({current})")


def test_server_in_sbin_as_debian_installs_it(machine):
    control = fake(machine / "usr" / "bin" / BINARY_NAME)
    server = fake(machine / "usr" / "sbin" / SERVER_NAME)
    found = locate(str(control))
    assert found.server == str(server)
    assert found.origin == "--mps-control"


def test_server_beside_control_wins_over_one_on_path(machine, monkeypatch):
    control = fake(machine / "pair" / BINARY_NAME)
    server = fake(machine / "pair" / SERVER_NAME)
    fake(machine / "bin" / SERVER_NAME)
    monkeypatch.setenv("PATH", str(machine / "bin"))
    assert locate(str(control)).server == str(server)


def test_server_elsewhere_is_searched_like_control(machine, monkeypatch):
    control = fake(machine / "alone" / BINARY_NAME)
    server = fake(machine / "nvidia" / SERVER_NAME)
    assert locate(str(control), driver_dirs=[str(machine / "nvidia")]).server == str(server)


def test_no_server_anywhere_is_still_usable_and_said(machine):
    control = fake(machine / "alone" / BINARY_NAME)
    found = locate(str(control))
    assert found.control == str(control) and found.server is None
    assert f"no {SERVER_NAME} found" in found.describe()
    assert locate_control_binary(str(control))[1] == []


def test_not_found_says_everywhere_it_looked_and_what_to_do(machine):
    with pytest.raises(BinaryNotFound) as caught:
        locate(driver_dirs=["/nonexistent/nvidia/bin"])
    message = str(caught.value)
    assert f"{BINARY_NAME} not found on PATH (searched {machine / 'empty'})" in message
    assert "nor in the driver folders (/nonexistent/nvidia/bin)" in message
    assert "nor next to nvidia-smi (not found either)" in message
    assert "--mps-control PATH" in message and "OMNI_DP_MPS_CONTROL=PATH" in message


def test_an_explicit_path_never_falls_back_to_the_search(machine, monkeypatch):
    fake(machine / "nvidia" / BINARY_NAME)
    monkeypatch.setattr(binaries, "DRIVER_DIRS", (str(machine / "nvidia"),))
    with pytest.raises(BinaryNotFound, match=r"--mps-control=.*/gone: .* does not exist"):
        locate(str(machine / "gone"))
    monkeypatch.setenv("OMNI_DP_MPS_CONTROL", str(machine / "gone"))
    with pytest.raises(BinaryNotFound, match=r"OMNI_DP_MPS_CONTROL=.*/gone: .* does not exist"):
        locate()


def test_env_origin_is_named(machine, monkeypatch):
    control = fake(machine / "x" / BINARY_NAME)
    monkeypatch.setenv("OMNI_DP_MPS_CONTROL", str(control))
    assert locate().origin == "$OMNI_DP_MPS_CONTROL"


# --- versions -----------------------------------------------------------------------------------


def test_control_version_is_read_from_the_binary(tmp_path):
    assert control_version(str(fake(tmp_path / "a", OLD))) == OLD
    # The real binary's percentage messages hold "100.0": not a driver release.
    assert control_version(str(fake(tmp_path / "b", OLD, 'echo "(0.0, 100.0]"'))) == OLD
    assert control_version(str(fake(tmp_path / "c"))) is None
    both = fake(tmp_path / "d", OLD, f"# and {NEW}")
    assert control_version(str(both)) is None  # two candidates: cannot be told
    assert control_version(str(tmp_path / "missing")) is None


def test_the_real_control_binary_holds_its_release():
    """Cross-checked with the version of the Debian package it came from, when beside it."""
    binary = real_control_binary()
    version = control_version(binary)
    assert version is not None and re.fullmatch(r"\d{3}\.\d{2,3}\.\d{2}", version), version
    changelog = Path(binary).parent.parent / "share/doc/nvidia-cuda-mps/changelog.Debian.gz"
    if changelog.exists():
        first = gzip.decompress(changelog.read_bytes()).decode().splitlines()[0]
        assert f"({version}-" in first, first


def test_driver_version_from_nvml(monkeypatch):
    calls = []
    monkeypatch.setattr(pynvml, "nvmlInit", lambda: calls.append("init"))
    monkeypatch.setattr(pynvml, "nvmlSystemGetDriverVersion", lambda: NEW.encode())
    monkeypatch.setattr(pynvml, "nvmlShutdown", lambda: calls.append("shutdown"))
    assert driver_version() == NEW
    assert calls == ["init", "shutdown"]


def _no_nvml(*_):
    raise pynvml.NVMLError_LibraryNotFound()


@pytest.mark.parametrize("line", [
    f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {NEW}  Release Build  (dvs-builder@U16)",
    f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {NEW}  Release Build  (dvs)",
])
def test_driver_version_from_the_kernel_module_without_nvml(tmp_path, monkeypatch, line):
    proc = tmp_path / "version"
    proc.write_text(f"{line}\nGCC version:  gcc version 12.2.0 (Debian 12.2.0-14)\n")
    monkeypatch.setattr(pynvml, "nvmlInit", _no_nvml)
    monkeypatch.setattr(binaries, "PROC_VERSION", str(proc))
    assert driver_version() == NEW
    monkeypatch.setattr(binaries, "PROC_VERSION", str(tmp_path / "absent"))
    assert driver_version() is None


def test_mismatched_versions_are_a_preflight_problem_naming_the_drivers_own(machine,
                                                                           monkeypatch):
    old = fake(machine / "debian" / BINARY_NAME, OLD)
    own = fake(machine / "nvidia" / BINARY_NAME, NEW)
    found, problems = locate_control_binary(str(old), driver=lambda: NEW)
    assert found is not None and found.mismatch
    assert [p.check for p in problems] == ["control_binary"]
    message = problems[0].message
    assert (f"control binary {old} (from --mps-control) is version {OLD} but the driver is "
            f"{NEW}; use the driver's own {BINARY_NAME}") in message
    assert "--mps-control PATH" in message
    assert str(own) not in message  # not where the search looks
    monkeypatch.setattr(binaries, "DRIVER_DIRS", (str(machine / "nvidia"),))
    _, problems = locate_control_binary(str(old), driver=lambda: NEW)
    assert f"{own} is that one" in problems[0].message


@pytest.mark.parametrize(("control", "driver"), [(NEW, NEW), (None, NEW), (OLD, None),
                                                 (None, None)],
                         ids=["equal", "control-unknown", "no-driver", "both-unknown"])
def test_equal_or_unknown_versions_are_no_problem(machine, control, driver):
    binary = fake(machine / "bin" / BINARY_NAME, control)
    found, problems = locate_control_binary(str(binary), driver=lambda: driver)
    assert problems == [] and found is not None and not found.mismatch
    assert (found.control_version, found.driver_version) == (control, driver)
    assert f"version {control or 'unknown'}" in found.describe()
    assert f"driver {driver or 'unknown'}" in found.describe()


def test_run_preflight_reports_the_mismatch_and_the_pair(machine):
    binary = fake(machine / "bin" / BINARY_NAME, OLD)
    report = run_preflight(control_binary=str(binary), gpu="0", pipe_dir=str(machine / "p"),
                           num_client_processes=1, driver=lambda: NEW)
    assert "control_binary" in [p.check for p in report.problems]
    assert report.binaries is not None and report.binaries.control == str(binary)


# --- the CLI refuses a mismatch before anything exists -------------------------------------------


def omni_dp_with_driver(version: str, *args: str, env: dict) -> subprocess.CompletedProcess:
    """`omni-dp ARGS` in a process whose driver reads as `version` (there is none here)."""
    code = ("import omni_dp.mps.binaries as b; b.driver_version = lambda: "
            f"{version!r}; from omni_dp.cli import main; main()")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env}, stdin=subprocess.DEVNULL)


def test_mps_start_refuses_a_control_binary_of_another_release(machine):
    binary = fake(machine / "bin" / BINARY_NAME, OLD)
    state = machine / "s"
    done = omni_dp_with_driver(NEW, "mps", "start", "--state-dir", str(state), "--mps-control",
                               str(binary), "--no-gpu-check", env={})
    assert done.returncode == 2, done.stderr
    assert f"is version {OLD} but the driver is {NEW}" in done.stderr
    assert "Traceback" not in done.stderr
    assert not state.exists()


def test_launch_mps_refuses_a_control_binary_of_another_release(machine):
    binary = fake(machine / "bin" / BINARY_NAME, OLD)
    state = machine / "state"
    base = free_port_block(3)
    done = omni_dp_with_driver(
        NEW, "launch", "--mps", "--no-gpu-check", "--mps-control", str(binary), "--replicas",
        "1", "--base-port", str(base), "--router-port", str(base + 2),
        env={"OMNI_DP_STATE_DIR": str(state)})
    assert done.returncode == 2, done.stderr
    assert f"--mps: control binary {binary} (from --mps-control) is version {OLD} but the " \
           f"driver is {NEW}" in done.stderr
    assert "Traceback" not in done.stderr
    assert not state.exists()


# --- the pair reaches the plan, the daemon's record and its PATH ----------------------------------


def test_facts_and_plan_carry_the_located_pair(machine, tmp_path, monkeypatch):
    control = fake(machine / "usr" / "bin" / BINARY_NAME, OLD)
    server = fake(machine / "usr" / "sbin" / SERVER_NAME)
    monkeypatch.setenv("OMNI_DP_STATE_DIR", str(tmp_path / "state"))
    options = LaunchOptions(replicas=1, mps=True, no_gpu_check=True, mps_control=str(control))
    facts = gather_facts(options, option_problems=["skip the engine's dry run"])
    assert facts.mps_binary == str(control)
    assert facts.mps_binaries is not None and facts.mps_binaries.server == str(server)
    machine_facts = dataclasses.replace(  # a GPU machine, as support/plans.py's
        facts, slots=plans.gpu_slots(plans.h200()), gpu_problems=(), sizing=plans.sizing(),
        engine_problems=(), mps_problems=(), topology=plans.smt_topology(),
        taken_ports=frozenset(), runs=(), host_problem=None)
    assert isinstance(machine_facts, LaunchFacts)
    plan = plans.plan(plans.opts(mps=True, replicas=1), machine_facts)
    assert plan.mps_binary == str(control) and plan.mps_binaries == facts.mps_binaries


def test_daemon_env_puts_the_server_folder_first_on_path(tmp_path):
    server = tmp_path / "drv" / SERVER_NAME
    base = {"PATH": f"/usr/bin{os.pathsep}{server.parent}{os.pathsep}/bin"}
    env = MpsControl("x", "/p", "/l", server_binary=str(server)).env(base)
    assert env["PATH"].split(os.pathsep) == [str(server.parent), "/usr/bin", "/bin"]
    assert MpsControl("x", "/p", "/l").env(base)["PATH"] == base["PATH"]
    assert MpsControl("x", "/p", "/l", server_binary=str(server)).env({})["PATH"].startswith(
        f"{server.parent}{os.pathsep}")


def test_the_record_keeps_the_server_and_old_records_still_load():
    record = DaemonRecord(ProcessIdentity(10, 1.5), "/d/control", "/p", "/l", "GPU-x",
                          "/d/server")
    data = json.loads(json.dumps(record.to_json()))
    assert data["server_binary"] == "/d/server"
    assert DaemonRecord.from_json(data) == record
    assert record.control().server_binary == "/d/server"
    assert record.control().binary == "/d/control"
    del data["server_binary"]
    old = DaemonRecord.from_json(data)
    assert old.server_binary is None and old.control().server_binary is None


def test_the_real_daemon_runs_the_recorded_server(tmp_path):
    """End to end: bring-up's start_daemon records the server, and the REAL control daemon,
    asked to start a server, runs exactly that script (found through its PATH)."""
    binary = real_control_binary()
    marker = tmp_path / "server-ran"
    server = fake(tmp_path / "srv" / SERVER_NAME,
                  body=f'echo "$0 $*" > "{marker}"\nexit 1')
    state = plans.stored_state(tmp_path / "run", plans.run_record("run-srv", [{"index": 0}],
                                                                  gpu="cpu"))
    start_daemon(state, 0, binary, str(server))  # the one GPU slot (the CPU: no UUID)
    record = state.record.daemon(0)
    try:
        assert record.server_binary == str(server) and record.gpu_uuid is None
        assert state.events()[-1]["server_binary"] == str(server)
        control = record.control()
        assert control.run(f"start_server -uid {os.getuid()}") == ""
        # the shell makes the file before echo writes to it: wait for the line, not the file
        wait_for("the daemon to run the recorded server",
                 lambda: marker.exists() and marker.read_text().endswith("\n"), 10, interval=0.05)
        assert marker.read_text().split()[0] == str(server)
    finally:
        MpsDaemon(record.control()).stop(record, force=True)
    assert not is_alive(record.identity)
