"""The steps of the device call (bench/gpu_run.py runs them), in the order of what their
evidence is worth, each with its limit, what it needs, how its figures are read from what it
printed, and the headline lines they make.

1. probe: what Python imports and from where, the GPU, the driver, the MPS programs;
2. mps smoke: a private daemon, one client proven attached (the daemon's lists and NVML's,
   recorded as they are), then two processes' kernels timed alone, as a pair without MPS and
   as a pair under the daemon (bench/kernel_pair.py);
3. headline: `omni-dp bench` of DP1, DP3 under MPS and DP3 without, saturated, 2 trials a level;
4. share: `--share-weights` — device memory of 3 replicas with their own weights, then sharing;
5. gpu_check: one replica's device path, its steps/s, syncs per step, measured overhead;
6. voice: `omni-dp bench` of the trained voice (the default model), DP1 and DP3 under MPS,
   where the probe found it measurable (its package, espeak-ng, onnxruntime's CUDA provider);
7. overlap: `verify-mps --overlap` with and without MPS, recorded;
8. while time is left: DP2 and DP5 under MPS, placement form ③ under MPS, TP2's refusal on
   one GPU, one run over two GPUs where there are two;
9. vllm-omni: the plan of 2 replicas on this GPU (`launch --engine vllm-omni --dry-run`), where
   the image has vllm-omni (the probe says) and a model directory and deploy file are given
   (VLLM_OMNI_MODEL, VLLM_OMNI_DEPLOY); skipped and said otherwise;
then the teardown.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import kernel_pair

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
JSON_MARK = "@@json "


@dataclass
class Settings:
    """The call's knobs, from the environment (bench/gpu_run.sh lists them). On `GPU=none`
    (the tests) the defaults shrink to the tiny model on the CPU."""

    out: Path
    work: Path
    gpu: str = "0"
    model: str = "small"
    python: str = sys.executable
    budget_s: float = 440.0
    teardown_reserve_s: float = 40.0
    headline_configs: str = "1,3mps,3"
    headline_concurrency: str = "32,96,192"
    headline_trials: int = 2
    headline_duration_s: float = 6.0
    headline_warmup_s: float = 2.0
    kv_tokens: int = 65536
    share_replicas: int = 3
    share_runs: str = "separate,shared"  # weight_share.py's --runs
    more_configs: str = "2mps,5mps"
    voice_model: str = "joe"  # the trained voice (docs/voice.md)
    voice_configs: str = "1,3mps"
    voice_concurrency: str = "16,48"
    kernel_seconds: float = 1.0
    check_steps: int = 100  # gpu_check.py's --steps: talker steps timed
    overlap_duration_s: float = 6.0
    overlap_concurrency: int = 32
    # the vllm-omni step: a model directory and deploy file on the machine (nothing can be
    # downloaded there), and the python that has vllm-omni (default: PYTHON)
    vllm_omni_model: str = ""
    vllm_omni_deploy: str = ""
    vllm_omni_python: str = ""
    limits: dict[str, float] = field(default_factory=dict)

    @property
    def state(self) -> Path:
        return self.work / "state"

    @property
    def on_gpu(self) -> bool:
        return self.gpu != "none"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Settings:
        cpu = env.get("GPU", "0") == "none"
        defaults = cls(Path("."), Path("."))
        if cpu:
            defaults = cls(Path("."), Path("."), model="tiny", headline_configs="1,2",
                           headline_concurrency="2,4", headline_duration_s=2.0,
                           headline_warmup_s=1.0, kv_tokens=4096, share_replicas=2,
                           kernel_seconds=0.2, voice_configs="1", voice_concurrency="2")
        # short (an MPS socket path is at most 107 bytes) and private
        work = Path(env.get("WORK") or tempfile.mkdtemp(prefix="odp-gpu."))
        values = {}
        for name, default in vars(defaults).items():
            raw = env.get(name.upper().removesuffix("_S"))
            if raw is not None and name not in ("out", "work", "limits"):
                values[name] = type(default)(raw) if not isinstance(default, Path) else raw
        limits = {k.removeprefix("LIMIT_").lower(): float(v) for k, v in env.items()
                  if k.startswith("LIMIT_")}
        return cls(**{**vars(defaults), **values, "out": Path(env.get("OUT", "gpu-out")),
                      "work": work, "python": env.get("PYTHON", sys.executable),
                      "limits": limits})

    def to_json(self) -> dict:
        return {k: str(v) if isinstance(v, Path) else v for k, v in vars(self).items()}


@dataclass
class Step:
    name: str
    argv: list[str]
    limit_s: float
    min_s: float  # less room than this: skipped, said
    read: Callable[[str, Path], dict] = lambda output, work: {}
    cwd: Path = ROOT
    env: dict[str, str] = field(default_factory=dict)
    grace_s: float = 15.0  # SIGTERM to SIGKILL: a step that was launching downs its run
    needs: tuple[str, ...] = ()  # "serving" (omni-dp's imports), "torch", "gpus2", "voice"
    exports: Callable[[dict], dict[str, str]] = lambda figures: {}  # into later steps' env
    not_here: str | None = None  # why it cannot run on this machine at all
    unready: str | None = None  # why not, once what the probe found allows it

    def skip(self, done: list) -> str | None:
        """Why this step cannot run here, or None."""
        if self.not_here:
            return self.not_here
        probe = next((r.figures for r in done if r.name == "probe"), {})
        missing = probe.get("missing") or []
        if "torch" in self.needs and "torch" in missing:
            return "torch does not import (see probe)"
        if "serving" in self.needs and missing:
            return f"{', '.join(missing)} missing (see probe)"
        voice = probe.get("voice_problems")
        if "voice" in self.needs and voice != []:
            return "the voice cannot run here: " + ("; ".join(voice or ["the probe did not say"]))
        gpus = (probe.get("system") or {}).get("gpus")
        engines = probe.get("engines") or {}
        if "vllm-omni" in self.needs and "version" not in (engines.get("vllm-omni") or {}):
            return ("vllm-omni is not in this image: "
                    + str((engines.get("vllm-omni") or {}).get("error", "the probe did not say")))
        if "gpus2" in self.needs and (not isinstance(gpus, list) or len(gpus) < 2):
            return f"{len(gpus) if isinstance(gpus, list) else 0} GPU(s) here; needs two"
        return self.unready


# --- readers: figures from what a step printed -------------------------------------------------


def marked_json(output: str, work: Path | None = None) -> dict:
    """The last `@@json {...}` line's object."""
    found = [line[len(JSON_MARK):] for line in output.splitlines() if line.startswith(JSON_MARK)]
    return json.loads(found[-1]) if found else {}


_FACT = re.compile(r"^([a-z_]+): ([\[{\"].*|true|false|null|-?\d.*)$")


def smoke_facts(output: str, work: Path) -> dict:
    """mps_smoke.py's `key: json` lines."""
    facts = {}
    for line in output.splitlines():
        match = _FACT.match(line)
        if match:
            try:
                facts[match.group(1)] = json.loads(match.group(2))
            except ValueError:
                continue
    return facts


def bench_reader(folder: str) -> Callable[[str, Path], dict]:
    def read(output: str, work: Path) -> dict:
        path = work / folder / "bench.json"
        if not path.is_file():
            return {}
        data = json.loads(path.read_text())
        return {"configs": [_config_figures(c) for c in data["configs"]],
                "scaling_range": data.get("scaling_range"), "premise": data.get("premise"),
                "complete": data.get("complete", True), "bench": data}
    return read


def _config_figures(config: dict) -> dict:
    at = config.get("compared_at")
    level = next((lv for lv in config["levels"] if lv["concurrency"] == at), None)
    sm = [p["gpu_sm_util"] for p in config["points"]
          if p["concurrency"] == at and p.get("gpu_sm_util") is not None]
    return {"name": config["name"], "status": config["status"], "reason": config["reason"],
            "compared_at": at, "saturated": config.get("saturated"),
            "requests_per_s": level and level["requests_per_s"],
            "audio_s_per_s": level and level["audio_s_per_s"],
            "latency_p99_s": level and level["latency_p99_s"],
            "gpu_sm_util": sm or None, "verdict": config.get("verdict")}


def share_rows(output: str, work: Path) -> dict:
    return {"runs": [json.loads(line) for line in output.splitlines()
                     if line.startswith('{"run":')]}


def check_lines(output: str, work: Path) -> dict:
    """gpu_check.py's check lines and the JSON facts it printed."""
    checks = [line for line in output.splitlines() if re.match(r"^(ok  |FAIL) ", line)]
    facts = [json.loads(line) for line in output.splitlines()
             if line.startswith("{") and line.endswith("}")]
    steps = next((f for f in facts if "steps_per_s" in f), None)
    server = next((f for f in facts if "max_total_num_tokens" in f), None)
    return {"checks": checks, "steps": steps, "server": server,
            "result": next((line for line in output.splitlines()
                            if line.startswith("RESULT:")), None)}


def teardown_facts(output: str, work: Path) -> dict:
    found = [json.loads(line) for line in output.splitlines() if line.startswith('{"cleanup_')]
    return found[-1] if found else {"left_behind": ["the teardown said nothing"]}


# --- the steps ---------------------------------------------------------------------------------


def steps(s: Settings) -> list[Step]:
    py, gpu, state = s.python, s.gpu, str(s.state)
    launch_gpu = ["--gpu", gpu]
    mps_fault = ["--on-mps-fault", "fail"] if s.on_gpu else []
    with_state = {"OMNI_DP_STATE_DIR": state}

    def bench(configs: str, folder: str, model: str = s.model,
              concurrency: str = s.headline_concurrency, kv: bool = True) -> list[str]:
        # the seeded model's pool is pinned; a voice keeps no KV (a pin is refused)
        pin = ["--max-total-tokens", str(s.kv_tokens)] if kv else []
        return [py, "-m", "omni_dp", "bench", "--configs", configs,
                "--trials", str(s.headline_trials), "--duration", str(s.headline_duration_s),
                "--warmup", str(s.headline_warmup_s), "--concurrency", concurrency,
                "--out", str(s.work / folder), "--", *launch_gpu, *pin, "--start-timeout",
                "90", *mps_fault, "--", "--model", model]

    def limit(name: str, default: float) -> float:
        return s.limits.get(name.replace(" ", "_"), default)

    no_gpu = None if s.on_gpu else "no GPU (GPU=none)"
    runs = [py, str(BENCH / "gpu_runs.py")]
    run_args = ["--gpu", gpu, "--model", s.model, "--state-dir", state]
    return [
        Step("probe", [py, str(BENCH / "gpu_probe.py")], limit("probe", 30), 5, marked_json,
             exports=lambda f: ({"OMNI_DP_MPS_CONTROL": f["mps"]["use"]}
                                if "use" in (f.get("mps") or {}) else {})),
        Step("mps smoke", [py, str(BENCH / "mps_smoke.py"), "--work", str(s.work / "smoke"),
                           "--gpu", gpu if s.on_gpu else "0",
                           "--concurrency", str(s.kernel_seconds)],
             limit("mps_smoke", 90), 20, smoke_facts, needs=("torch",)),
        Step("headline", bench(s.headline_configs, "headline"), limit("headline", 230), 60,
             bench_reader("headline"), env=with_state, grace_s=30, needs=("serving",)),
        Step("share", [py, "weight_share.py", "--replicas", str(s.share_replicas),
                       "--runs", s.share_runs, "--serve-args", f"--model {s.model}",
                       *launch_gpu, *(["--mps"] if s.on_gpu else []), "--state-dir", state,
                       "--out", str(s.work / "share"), "--run-timeout", "90",
                       "--recovery-timeout", "40", "--launch-args",
                       " ".join(["--start-timeout", "60", *mps_fault])],
             limit("share", 120), 40, share_rows, cwd=BENCH, env=with_state,
             needs=("serving",)),
        Step("gpu_check", [py, "gpu_check.py", s.model, "--device",
                           "cuda" if s.on_gpu else "cpu", "--steps", str(s.check_steps)],
             limit("gpu_check", 90), 30, check_lines, cwd=BENCH, needs=("serving",)),
        Step("voice", bench(s.voice_configs, "voice", s.voice_model, s.voice_concurrency,
                            kv=False),
             limit("voice", 100), 50, bench_reader("voice"), env=with_state, grace_s=30,
             needs=("serving", "voice")),
        Step("overlap", [*runs, "overlap", *run_args, "--duration", str(s.overlap_duration_s),
                         "--concurrency", str(s.overlap_concurrency)],
             limit("overlap", 100), 40, marked_json, cwd=BENCH, env=with_state,
             needs=("serving",), not_here=no_gpu),
        Step("more DP", bench(s.more_configs, "more"), limit("more_dp", 200), 60,
             bench_reader("more"), env=with_state, grace_s=30, needs=("serving",),
             not_here=no_gpu),
        Step("form3", [*runs, "form3", *run_args], limit("form3", 90), 40, marked_json,
             cwd=BENCH, env=with_state, needs=("serving",), not_here=no_gpu),
        Step("tp2", [*runs, "tp2", *run_args], limit("tp2", 60), 15, marked_json, cwd=BENCH,
             needs=("serving",), not_here=no_gpu),
        Step("gpus2", [*runs, "gpus2", *run_args], limit("gpus2", 120), 50, marked_json,
             cwd=BENCH, env=with_state, needs=("serving", "gpus2"), not_here=no_gpu),
        Step("caps", [*runs, "caps", *run_args], limit("caps", 90), 40, marked_json,
             cwd=BENCH, env=with_state, needs=("serving",), not_here=no_gpu),
        Step("vllm-omni", vllm_omni_plan(s), limit("vllm_omni", 60), 20, marked_plan,
             needs=("vllm-omni",), not_here=no_gpu, unready=vllm_omni_missing(s)),
        Step("teardown", ["sh", "-c", TEARDOWN, "teardown", py, str(s.work), state],
             s.teardown_reserve_s, 0, teardown_facts, cwd=BENCH),
    ]


def vllm_omni_missing(s: Settings) -> str | None:
    """Why the vllm-omni step has nothing to size: no model directory or deploy file here."""
    if not s.vllm_omni_model or not s.vllm_omni_deploy:
        return ("no vllm-omni model on this machine (VLLM_OMNI_MODEL and VLLM_OMNI_DEPLOY "
                "unset: a model directory and its deploy file)")
    return None


def vllm_omni_plan(s: Settings) -> list[str]:
    """The launch's plan on this GPU (`--dry-run --json`): what it pins and whether N fit.
    Not a live run: that needs its model's weights on the machine and more than this budget."""
    return [s.python, "-m", "omni_dp", "launch", "--engine", "vllm-omni", "--dry-run",
            "--json", "--replicas", "2", "--max-total-tokens", "8192", "--gpu", s.gpu,
            "--engine-python", s.vllm_omni_python or s.python, "--",
            s.vllm_omni_model, "--deploy-config", s.vllm_omni_deploy]


def marked_plan(output: str, work: Path | None = None) -> dict:
    """The dry run's JSON plan (the last JSON object it printed)."""
    start = output.find("{")
    try:
        return json.loads(output[start:]) if start >= 0 else {}
    except ValueError:
        return {}


# The smoke test's daemon, then every run left in the state directory (artifacts kept, `down`),
# then every process of this call still running (its state dir, or an MPS pipe under the work
# dir): the last line is {"cleanup_runs": [...], "left_behind": [...]}, exit 0 when none is.
TEARDOWN = """py=$1 work=$2 state=$3
timeout -k 5 30 "$py" mps_smoke.py --work "$work/smoke" --cleanup
exec timeout -k 5 150 "$py" launch_scaling.py --cleanup --state-dir "$state" \
    --out "$work/cleanup" --artifacts "$work/artifacts" --watch-dir "$work"
"""


# --- the headline ------------------------------------------------------------------------------


def _range(r: dict | None, fmt: str = "{:.2f}") -> str:
    if not r:
        return "-"
    return f"{fmt.format(r['median'])} [{fmt.format(r['low'])}–{fmt.format(r['high'])}]"


def dp_lines(figures: dict) -> list[str]:
    lines = []
    ratios = figures.get("scaling_range") or {}
    for c in figures.get("configs", []):
        name = c["name"].replace("mps", "+MPS")
        if c["status"] == "failed" or not c["requests_per_s"]:
            lines.append(f"DP{name}: {c['status']}: {c['reason']}")
            continue
        ratio = ratios.get(c["name"])
        lines.append(
            f"DP{name}: {_range(c['requests_per_s'])} req/s at c={c['compared_at']} "
            f"({'saturated' if c['saturated'] else 'not saturated'})"
            + (f", **{_range(ratio)}x DP1**" if ratio else "")
            + (f", GPU SM busy {max(c['gpu_sm_util']):.0%}" if c["gpu_sm_util"] else "")
            + (f" ({c['status']}: {c['reason']})" if c["status"] != "ok" else ""))
    if figures.get("complete") is False:
        lines.append("(the sweep was cut short: the configurations above are what it finished)")
    return lines


def smoke_lines(f: dict) -> list[str]:
    after = f.get("after_context") or {}
    lines = []
    if after:
        nvml = after.get("nvml") or {}
        said = (nvml["error"] if "error" in nvml else
                f"NVML's compute list {nvml.get('compute')}, its MPS list {nvml.get('mps')}")
        client = after.get("client") or {}
        lines.append(f"MPS: one client {'LISTED' if after.get('client_listed') else 'NOT listed'}"
                     f" by its daemon after its first context"
                     + (f" (the client: {client['error']})" if "error" in client else "")
                     + f"; {said}")
    if "concurrency" in f:
        lines += [f"two kernels at once, {line}" for line in kernel_pair.describe(f["concurrency"])]
    if "static_partitions" in f:
        known = f["static_partitions"].get("known")
        lines.append("MPS static SM partitions: "
                     + ("the daemon knows `sm_partition`" if known else
                        "this daemon does not know `sm_partition` (none offered)"))
    return lines


def share_lines(f: dict) -> list[str]:
    lines = []
    for r in f.get("runs", []):
        delta = r.get("device_used_delta")
        gpu = (f"GPU memory used +{delta / 2**20:.0f} MiB" if delta is not None else
               f"ΣPSS {r.get('sum_pss', 0) / 2**20:.0f} MiB")
        per = r.get("device_per_process") or {}
        lines.append(f"weights {r['run']}: {r['result']}, {gpu}"
                     + (f", per process {list(per.values())}" if per else "")
                     + f", identical audio {r.get('identical')}"
                     + (f", leader kill → all back in {r['leader_kill_recovery_s']} s"
                        if "leader_kill_recovery_s" in r else ""))
    return lines


def check_summary(f: dict) -> list[str]:
    steps = f.get("steps") or {}
    if not steps:
        return [f"gpu_check: {f.get('result') or 'no result'}"]
    overhead = steps.get("measured_overhead_bytes")
    return [f"one replica: {steps['steps_per_s']} talker steps/s at batch {steps['batch']}, "
            f"syncs per step {(steps.get('syncs_per_step') or {}).get('per_step')}, overhead "
            + (f"{overhead / 2**30:.2f} GiB measured" if overhead is not None else "not measured")
            + f" (the plan assumes {steps['planned_overhead_bytes'] / 2**30:.2f} GiB); "
            f"{f.get('result')}"]


def overlap_lines(f: dict) -> list[str]:
    lines = []
    for mode in ("mps", "plain"):
        report = ((f.get(mode) or {}).get("verify_overlap") or {}).get("report")
        if isinstance(report, dict):
            lines.append(f"verify-mps --overlap {'with' if mode == 'mps' else 'without'} MPS "
                         f"(recorded, not gated): {json.dumps(report)[:300]}")
    return lines


def missing_lines(f: dict) -> list[str]:
    return ([f"MISSING on the machine: {', '.join(f['missing'])}: the serving steps were "
             "skipped (carry them: bench/fetch_wheels.sh, .whl in the call's carry)"]
            if f.get("missing") else [])


def probe_lines(f: dict) -> list[str]:
    if not f or f.get("missing"):
        return []
    torch = next((i for i in f.get("imports", []) if i["dist"] == "torch"), {})
    gpus = (f.get("system") or {}).get("gpus")
    return [f"machine: {gpus if isinstance(gpus, str) else [g['name'] for g in gpus]}, "
            f"driver {((f.get('mps') or {}).get('omni_dp') or {}).get('driver_version')}, "
            f"python {f.get('python_version')}, torch {torch.get('version')} CUDA "
            f"{torch.get('cuda')}"]


def caps_lines(f: dict) -> list[str]:
    """`MPS caps 50%/16GiB: read back …; BF16 GEMM check …; cudaMemGetInfo total …`."""
    checks = f.get("numeric_checks") or []
    errors = ", ".join(f"{c.get('relative_error', float('nan')):.4f}" for c in checks)
    seen = [(c.get("mem_get_info") or {}).get("total") for c in checks]
    return [f"MPS caps {f.get('thread_percentage')}%/{f.get('memory_limit')}: read back "
            f"{f.get('daemon_limits')}; BF16 GEMM check error(s) {errors or 'none recorded'}, "
            f"SMs seen {[c.get('sm_count') for c in checks]}, cudaMemGetInfo total {seen}; "
            f"launch rc {f.get('launch_rc')}, request {f.get('speech_status')}"]


HEADLINES: list[tuple[str, Callable[[dict], list[str]]]] = [
    ("probe", missing_lines), ("headline", dp_lines), ("mps smoke", smoke_lines),
    ("share", share_lines), ("gpu_check", check_summary),
    ("voice", lambda f: [f"the trained voice, {line}" for line in dp_lines(f)]),
    ("overlap", overlap_lines),
    ("more DP", dp_lines),
    ("form3", lambda f: [f"form ③ under MPS: {json.dumps(f)[:300]}"]),
    ("tp2", lambda f: [f"TP2 on one GPU refused before start: {f.get('refused_as_expected')}"]),
    ("caps", caps_lines),
    ("probe", probe_lines),
]


def headline_lines(results: list) -> list[str]:
    """The figures that matter most first, whatever order the steps ran in."""
    by_name = {r.name: r for r in results}
    lines: list[str] = []
    for name, lines_of in HEADLINES:
        result = by_name.get(name)
        if result is not None and result.figures and "read_error" not in result.figures:
            lines += lines_of(result.figures)
    return lines

