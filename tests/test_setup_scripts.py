"""The set-up scripts' decisions, without the network: which torch build and from where
(scripts/torch_setup.py plan), what is reported as installed (never the intent), which
interpreter the vLLM venv gets, and the one line setup-vllm ends with when none will do.

PyTorch's CPU index is stood in for by a loopback HTTP server (reachable) or a closed loopback
port (unreachable); torch by a stand-in package that says which build it is; interpreters by
stand-in scripts that say which version they are.
"""

from __future__ import annotations

import http.server
import os
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import torch_setup  # noqa: E402  (scripts/ is no package)

# --- which build, from where -------------------------------------------------------------------


@pytest.mark.parametrize(("wanted", "driver", "reachable", "build", "args", "words"), [
    ("auto", False, True, "cpu", ("--index-url", "IDX", "torch==2.13.0"),
     "the CPU build, from PyTorch's CPU index IDX (no NVIDIA driver)"),
    ("auto", True, None, "cuda", ("torch==2.13.0",), "from PyPI (NVIDIA driver found"),
    ("cpu", True, True, "cpu", ("--index-url", "IDX", "torch==2.13.0"), "(OMNI_DP_TORCH=cpu)"),
    ("cuda", False, None, "cuda", ("torch==2.13.0",), "(OMNI_DP_TORCH=cuda: its CUDA build)"),
    ("auto", False, False, "cpu", ("torch==2.13.0",),
     "PyTorch's CPU index IDX cannot be reached (no NVIDIA driver): installing PyPI's "
     "torch==2.13.0 instead, which on Linux x86_64 is the CUDA build (about 4 GB"),
])
def test_the_build_and_its_source_follow_the_driver_the_force_and_the_index(
        wanted, driver, reachable, build, args, words):
    plan = torch_setup.plan("2.13.0", wanted, driver, "IDX", reachable, "x86_64")
    assert (plan.build, plan.pip_args) == (build, args)
    assert words in plan.message


def test_the_fallback_says_what_it_costs_where_pypi_has_a_cpu_build():
    plan = torch_setup.plan("2.13.0", "auto", False, "IDX", False, "aarch64")
    assert "which on aarch64 is a CPU build" in plan.message and "4 GB" not in plan.message
    assert "OMNI_DP_TORCH_INDEX" in plan.message


def test_a_forced_build_that_is_no_build_is_refused():
    with pytest.raises(ValueError, match="OMNI_DP_TORCH='gpu': use one of auto, cpu, cuda"):
        torch_setup.plan("2.13.0", "gpu", False, "IDX", True, "x86_64")


def test_a_driver_is_nvidia_smi_or_the_kernel_modules_version_file(tmp_path):
    nowhere = str(tmp_path / "version")
    assert not torch_setup.driver_present(lambda name: None, nowhere)
    assert torch_setup.driver_present(lambda name: "/usr/bin/nvidia-smi", nowhere)
    (tmp_path / "version").write_text("NVRM version: 580.159.04\n")
    assert torch_setup.driver_present(lambda name: None, nowhere)


class _Index(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/simple/torch/" else 404)
        self.end_headers()
        self.wfile.write(b"<a href='torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl'>x</a>")

    def log_message(self, *args):
        pass


def test_the_index_is_reachable_only_when_it_answers_for_torch():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Index)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert torch_setup.index_reachable(base + "/simple", timeout=5)
        assert not torch_setup.index_reachable(base + "/elsewhere", timeout=5)  # a 404
    finally:
        server.shutdown()
        server.server_close()
    assert not torch_setup.index_reachable(closed_port_url(), timeout=5)


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/simple"  # nothing listens there once the socket is closed


# --- what is installed, as it imports ----------------------------------------------------------


def fake_torch(where: Path, version: str, cuda: str | None) -> Path:
    """A stand-in `torch` package that says which build it is (tests only)."""
    package = where / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        f"__version__ = {version!r}\nclass version:\n    cuda = {cuda!r}\n")
    return where


def report(python_path: Path | None, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if python_path is not None:
        env["PYTHONPATH"] = str(python_path)
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "torch_setup.py"), "report",
                           "--python", sys.executable, *args], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


def test_the_report_names_the_build_that_imports_not_the_one_planned(tmp_path):
    cuda = fake_torch(tmp_path / "cuda", "2.13.0+cu130", "13.0")
    done = report(cuda, "--wanted", "cpu")
    assert done.returncode == 1
    assert done.stdout.strip() == ("torch 2.13.0+cu130, the CUDA 13.0 build, is installed, not "
                                   "the CPU build planned")
    cpu = fake_torch(tmp_path / "cpu", "2.13.0+cpu", None)
    done = report(cpu, "--wanted", "cpu")
    assert (done.returncode, done.stdout.strip()) == (
        0, "torch 2.13.0+cpu, the CPU build, is installed")


def test_the_cpu_build_where_cuda_was_planned_is_exit_1_and_said(tmp_path):
    """The direction that costs a GPU host its GPU: PyPI's CUDA build planned (a driver found,
    or OMNI_DP_TORCH=cuda) and a CPU build landed (a pip config or mirror serving +cpu)."""
    cpu = fake_torch(tmp_path / "cpu", "2.13.0+cpu", None)
    done = report(cpu, "--wanted", "cuda")
    assert (done.returncode, done.stdout.strip()) == (
        1, "torch 2.13.0+cpu, the CPU build, is installed, not the CUDA build planned")
    cuda = fake_torch(tmp_path / "cuda", "2.13.0+cu130", "13.0")
    done = report(cuda, "--wanted", "cuda")
    assert (done.returncode, done.stdout.strip()) == (
        0, "torch 2.13.0+cu130, the CUDA 13.0 build, is installed")


def test_a_torch_that_does_not_import_is_said_and_is_exit_3(tmp_path):
    broken = tmp_path / "broken" / "torch"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('libtorch_cpu.so: not found')\n")
    done = report(tmp_path / "broken")
    assert done.returncode == 3 and "torch does not import" in done.stdout


# --- the vLLM venv's interpreter ---------------------------------------------------------------


VERSIONS = {"python3": (3, 10), "python3.12": (3, 12), "python3.13": (3, 13),
            "python3.15": (3, 15), "python3.11": (3, 11)}


def test_the_vllm_interpreter_is_the_first_in_range_whose_torch_can_be_had():
    found = {"python3.12": False, "python3.11": True}
    chosen, passed = torch_setup.pick_interpreter(
        ["python3", "python3.15", "python3.12", "python3.11", "python3.9"], "torch==2.13.0+cpu",
        "IDX", reachable=False, version_of=VERSIONS.get,
        found=lambda python, requirement, index: found[python])
    assert chosen == "python3.11"
    assert passed == [
        "python3 (Python 3.10): vLLM's CPU build needs Python 3.11 to 3.14",
        "python3.15 (Python 3.15): vLLM's CPU build needs Python 3.11 to 3.14",
        "python3.12 (Python 3.12): no torch==2.13.0+cpu wheel found for it (the index is "
        "unreachable)"]


def test_with_the_index_reachable_the_first_in_range_is_taken_without_asking_pip():
    def never(*args):
        raise AssertionError("pip was asked although the index answers")

    chosen, _ = torch_setup.pick_interpreter(["python3", "python3.13", "python3.11"], "torch",
                                             "IDX", reachable=True, version_of=VERSIONS.get,
                                             found=never)
    assert chosen == "python3.13"


def stand_in_python(folder: Path, name: str, version: tuple[int, int], real: str) -> None:
    """An interpreter stand-in: says `version` when asked, finds no wheel, else runs `real`."""
    script = folder / name
    script.write_text(
        "#!/bin/sh\n"
        f'case "$*" in *version_info*) echo {version[0]} {version[1]}; exit 0 ;;\n'
        "  *'pip install --dry-run'*) exit 1 ;; esac\n"
        f'exec {real} "$@"\n')
    script.chmod(0o755)


def test_setup_vllm_without_a_usable_interpreter_ends_in_one_line_and_makes_nothing(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, version in (("python3", (3, 10)), ("python3.12", (3, 12))):
        stand_in_python(bin_dir, name, version, sys.executable)
    venv = tmp_path / "venv-vllm"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path),
           "OMNI_DP_VLLM_VENV": str(venv), "OMNI_DP_TORCH_INDEX": closed_port_url()}
    done = subprocess.run([str(ROOT / "scripts" / "setup-vllm")], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    [line] = done.stderr.strip().splitlines()
    assert re.match(r"setup-vllm: no Python here can hold vLLM's CPU build: it needs Python 3.11 "
                    r"to 3.14 and torch==2.13.0\+cpu", line), line
    assert "OMNI_DP_TORCH_INDEX" in line
    assert not venv.exists()


# --- the Python range said is the one declared --------------------------------------------------


def test_the_readme_says_the_python_range_pyproject_declares():
    from packaging.specifiers import SpecifierSet
    from test_dependencies import tomllib

    declared = SpecifierSet(tomllib.loads((ROOT / "pyproject.toml").read_text())
                            ["project"]["requires-python"])
    said = re.search(r"Python (3\.\d+) to (3\.\d+)", (ROOT / "README.md").read_text())
    assert said, "the README names no Python range"
    low, high = (int(v.split(".")[1]) for v in said.groups())
    assert [f"3.{m}" in declared for m in range(low - 1, high + 2)] == \
        [False, *([True] * (high - low + 1)), False]
