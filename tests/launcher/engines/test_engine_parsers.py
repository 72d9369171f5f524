"""The command lines the sglang and sglang-omni adapters build, checked by the engines' own code
(sglang 0.5.22's ServerArgs parser, sglang-omni 0.1.9's `config resolve`), and the environment
variables and log texts the adapters rely on, checked against the installed engines.

Neither engine can serve without a CUDA GPU, but both parse and validate on CPU. They need a
venv of their own (scripts/setup-engine-parsers, ~2.7 GB): these tests run only when
OMNI_DP_PARSERS_PYTHON names its python.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest

from omni_dp.launcher.engines import reserved_flag_problems
from omni_dp.launcher.engines.base import KvRequest, ModelFacts, ReplicaLaunch
from omni_dp.launcher.engines.sglang import SglangEngine
from omni_dp.launcher.engines.sglang_omni import ALLOCATED, POST_CAPTURE, SglangOmniEngine

from support.plans import GiB, h200

PARSERS = os.environ.get("OMNI_DP_PARSERS_PYTHON")
pytestmark = [pytest.mark.timeout(600)]


@pytest.fixture(scope="module", autouse=True)
def parsers_installed() -> None:
    """Skipped without the parsers; under CI (OMNI_DP_REQUIRE_PARSERS=1, scripts/test) a
    missing install fails instead."""
    if PARSERS:
        return
    why = ("OMNI_DP_PARSERS_PYTHON is not set: run scripts/setup-engine-parsers and set it to "
           "the python it prints")
    if os.environ.get("OMNI_DP_REQUIRE_PARSERS"):
        pytest.fail(why)
    pytest.skip(why)
TIMEOUT_S = 180  # one engine import is 5-15 s
LLAMA = ModelFacts(path=Path("/models/llama"), architecture="LlamaForCausalLM",
                   weights_bytes=16 * GiB, num_layers=32, num_kv_heads=8, head_dim=128,
                   dtype="bfloat16", dtype_bytes=2)
HIGGS_ARCHITECTURE = "HiggsMultimodalQwen3ForConditionalGeneration"

# Run in the parsers' python: parse each argv as `sglang serve` does (prepare_server_args
# builds its parser the same way), and report what the adapters rely on.
SGLANG_PROBE = r"""
import argparse, json, sys
from pathlib import Path
import sglang
from sglang.srt.environ import envs
from sglang.srt.server_args import ServerArgs

spec = json.load(sys.stdin)
parser = argparse.ArgumentParser(prog="sglang serve")
ServerArgs.add_cli_args(parser)
parsed = []
for argv in spec["argvs"]:
    ns = parser.parse_args(argv)
    parsed.append({name: getattr(ns, name) for name in spec["fields"]})
root = Path(sglang.__file__).parent / "srt"
print(json.dumps({
    "parsed": parsed,
    "options": sorted(parser._option_string_actions),
    "health_generation": envs.SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION.get(),
    "sources": {name: str(root / name) for name in (
        "mem_cache/memory_pool.py",
        "model_executor/model_runner_components/kv_pool_runtime.py")},
}))
"""

# sglang-omni's own function for the CPU variable the adapter sets. (The port check lives in
# serve/launcher.py, which imports torchaudio: its text is checked instead.)
OMNI_PROBE = r"""
import json
from pathlib import Path
import sglang_omni
from sglang_omni.utils.cpu import gpu_local_affinity

print(json.dumps({"affinity": gpu_local_affinity([0]),
                  "launcher": str(Path(sglang_omni.__file__).parent / "serve" / "launcher.py")}))
"""

# Run in the parsers' python: each case's argv through sglang-omni's own CLI, the engine
# imported once and each case run in a child forked from it (a case gets a fresh process, as
# `python -m sglang_omni.cli ...` would, without importing the engine again: ~10 s each).
# The child's stdout and stderr go to one file; an error it raises is printed by the hook
# the CLI installed, as it would be at the top of its own process.
OMNI_CASES = r"""
import json, os, sys, tempfile
from sglang_omni.cli import app

results = {}
for name, argv in json.load(sys.stdin).items():
    with tempfile.TemporaryFile("w+") as out:
        sys.stdout.flush(); sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1); os.dup2(out.fileno(), 2)
            code = 0
            try:
                if argv[0] == "-c":
                    exec(argv[1], {"__name__": "__main__"})
                else:
                    sys.argv = ["sglang_omni.cli", *argv]
                    app(argv, prog_name="python -m sglang_omni.cli")
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (exc.code is not None)
            except BaseException:
                sys.excepthook(*sys.exc_info())
                code = 1
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        results[name] = [os.waitstatus_to_exitcode(status), out.read()]
print(json.dumps(results))
"""


def run_parsers(args: list[str], env: dict[str, str] | None = None,
                stdin: str | None = None) -> subprocess.CompletedProcess:
    assert PARSERS is not None
    return subprocess.run([PARSERS, *args], input=stdin, capture_output=True, text=True,
                          timeout=TIMEOUT_S, check=False,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


def sglang_request(**changes) -> KvRequest:
    base = KvRequest(kv_cache_bytes=None, max_total_tokens=100000, replicas=2, device="cuda",
                     gpu=h200(), model=LLAMA, engine_args=("/models/llama",))
    return dataclasses.replace(base, **changes)


def replica(kv_args: tuple[str, ...]) -> ReplicaLaunch:
    return ReplicaLaunch(port=31000, device="cuda", threads=None, kv_cache_bytes=None,
                         max_total_tokens=None, python=PARSERS, kv_args=kv_args)


@pytest.fixture(scope="module")
def sglang_probe() -> dict:
    engine = SglangEngine()
    pin, problems = engine.plan_kv(sglang_request())
    assert problems == []
    argv = engine.argv(replica(pin.args), ("/models/llama", "--dtype", "bfloat16"))
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    spec = {"argvs": [argv[3:], ["--model-path", "/m", "--mem-frac", "0.4"]],
            "fields": ["model_path", "host", "port", "max_total_tokens", "mem_fraction_static",
                       "dtype"]}
    done = run_parsers(["-c", SGLANG_PROBE], env=engine.environment(replica(())),
                       stdin=json.dumps(spec))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_sglang_parses_the_adapters_argv_into_the_planned_pin(sglang_probe):
    assert sglang_probe["parsed"][0] == {
        "model_path": "/models/llama", "host": "127.0.0.1", "port": 31000,
        "max_total_tokens": 100000, "mem_fraction_static": 0.273, "dtype": "bfloat16"}


def test_every_reserved_flag_is_an_sglang_flag(sglang_probe):
    assert set(SglangEngine.reserved_flags) <= set(sglang_probe["options"])


def test_sglang_expands_abbreviations_so_the_adapter_refuses_them(sglang_probe):
    assert sglang_probe["parsed"][1]["mem_fraction_static"] == 0.4
    problems = reserved_flag_problems(SglangEngine(), ("/models/llama", "--mem-frac", "0.4"))
    assert problems and "abbreviates --mem-fraction-static" in problems[0]


def test_the_adapters_environment_turns_the_generating_health_check_off(sglang_probe):
    assert sglang_probe["health_generation"] is False


def test_sglangs_allocation_log_texts_are_the_ones_read_back(sglang_probe):
    pool = Path(sglang_probe["sources"]["mem_cache/memory_pool.py"]).read_text()
    for fragment in ('else "KV Cache"', "'VA upper bound' if self.post_capture_active else "
                     "'is allocated'}. dtype: {self.dtype}, ", '#tokens: {num_tokens}, '):
        assert fragment in pool
    line = "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 58240, KV size: 6.22 GB"
    assert ALLOCATED.search(line).group(1) == "58240"
    runtime = Path(sglang_probe["sources"][
        "model_executor/model_runner_components/kv_pool_runtime.py"]).read_text()
    template = "Post-capture KV sizing: KV cache allocated. dtype: %s, #tokens: %d, "
    assert template in runtime
    assert POST_CAPTURE.search(template % ("torch.bfloat16", 58112)).group(1) == "58112"


# --- sglang-omni ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Done:
    returncode: int
    output: str  # stdout and stderr, whitespace folded (its errors are boxed and wrapped)


def omni_pin(**changes) -> tuple[str, ...]:
    base = KvRequest(kv_cache_bytes=2 * GiB, max_total_tokens=None, replicas=2, device="cuda",
                     gpu=h200(), model=LLAMA, engine_stage="tts_engine")
    pin, problems = SglangOmniEngine().plan_kv(dataclasses.replace(base, **changes))
    assert problems == []
    return pin.args


def resolve_args(model: Path, pin_args: tuple[str, ...],
                 user_args: tuple[str, ...] = ()) -> list[str]:
    """`config resolve` of the adapter's serve argv, less the options only `serve` has
    (--host, --port: `serve --help` shows it takes them)."""
    argv = SglangOmniEngine().argv(replica(pin_args), (str(model), *user_args))
    assert argv[1:4] == ["-m", "sglang_omni.cli", "serve"]
    args = argv[4:]
    for flag in ("--host", "--port"):
        i = args.index(flag)
        del args[i:i + 2]
    return ["config", "resolve", "--show", "diff", *args]


@pytest.fixture(scope="module")
def omni(tmp_path_factory) -> dict[str, Done]:
    """Every sglang-omni case, by name: its exit status and output. The model directory holds
    only the config.json that selects Higgs TTS's pipeline."""
    model = tmp_path_factory.mktemp("higgs")
    (model / "config.json").write_text(json.dumps({"architectures": [HIGGS_ARCHITECTURE]}))
    cases = {
        "bytes": resolve_args(model, omni_pin()),
        "tokens": resolve_args(model, omni_pin(kv_cache_bytes=None, max_total_tokens=16384)),
        "broadcast": resolve_args(model, omni_pin(), ("--mem-fraction-static", "0.5")),
        "cap beside bytes": resolve_args(model, omni_pin(),
                                         ("--tts_engine.engine.max_total_tokens", "10")),
        "wrong stage": resolve_args(model, omni_pin(engine_stage="tts_engnie")),
        "serve help": ["serve", "--help"],
        "probe": ["-c", OMNI_PROBE],
    }
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200",
           **SglangOmniEngine().environment(replica(()))}
    ran = run_parsers(["-c", OMNI_CASES], env=env, stdin=json.dumps(cases))
    assert ran.returncode == 0, ran.stderr[-3000:]
    done = {}
    for name, (returncode, output) in json.loads(ran.stdout.strip().splitlines()[-1]).items():
        text = output.replace("│", " ")  # the side of typer's error box
        done[name] = Done(returncode, " ".join(text.split()))
    return done


def test_sglang_omni_resolves_a_byte_pin_onto_the_kv_stage(omni):
    assert omni["bytes"].returncode == 0, omni["bytes"].output[-3000:]
    assert "stages.tts_engine.engine.kv_cache_bytes: None -> 2147483648" in omni["bytes"].output


def test_sglang_omni_resolves_a_token_pin_onto_the_kv_stage_as_its_bytes(omni):
    """16384 tokens × 131072 bytes per token (the test Llama's KV) = 2 GiB."""
    assert omni["tokens"].returncode == 0, omni["tokens"].output[-3000:]
    assert "stages.tts_engine.engine.kv_cache_bytes: None -> 2147483648" in omni["tokens"].output
    assert "max_total_tokens: None ->" not in omni["tokens"].output


def test_a_broadcast_fraction_of_the_user_yields_to_the_byte_pins_null(omni):
    assert omni["broadcast"].returncode == 0, omni["broadcast"].output[-3000:]


def test_sglang_omni_refuses_a_token_cap_beside_the_byte_pin_hence_reserved(omni):
    assert omni["cap beside bytes"].returncode != 0
    assert "silently shrinks the byte-derived pool" in omni["cap beside bytes"].output


def test_a_wrong_kv_stage_is_refused_by_sglang_omni_naming_the_stages(omni):
    assert omni["wrong stage"].returncode != 0
    assert "did you mean: tts_engine" in omni["wrong stage"].output


def test_serve_takes_the_options_resolve_does_not(omni):
    assert omni["serve help"].returncode == 0, omni["serve help"].output[-3000:]
    for flag in ("--model-path", "--host", "--port"):
        assert flag in omni["serve help"].output


def test_sglang_omni_reads_the_adapters_environment_as_meant(omni):
    assert omni["probe"].returncode == 0, omni["probe"].output[-3000:]
    report = json.loads(omni["probe"].output[omni["probe"].output.rindex("{"):])
    assert report["affinity"] is None  # SGLANG_OMNI_BIND_GPU_LOCAL_CPUS=0: left alone
    launcher = Path(report["launcher"]).read_text()
    assert '(os.environ.get("SGLANG_OMNI_STRICT_PORT") or "").strip() == "1"' in launcher
    assert "forbids falling back" in launcher
