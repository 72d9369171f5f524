"""The vllm-omni adapter against vllm-omni 0.30.0's own code: its deploy-config loader reads
every deploy file it ships (and the ones the unit tests write) to the same stage fractions,
devices and parallelism as omni-dp's reader; the KV fields omni-dp sets pass through its stage
schema into vLLM's engine arguments; and its serve command's flags and vLLM's KV line are what
the adapter writes and reads.

vllm-omni cannot serve without CUDA; its config code imports on CPU in the venv
scripts/setup-vllm-omni makes (its serve CLI does not: it registers every model, and one needs
torchvision's CPU build, so those flags are checked in its source text). These tests run when
OMNI_DP_VLLM_OMNI_PYTHON names that venv's python, and are required under CI
(OMNI_DP_REQUIRE_VLLM_OMNI=1, scripts/test).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from omni_dp.launcher.engines.base import ReplicaLaunch
from omni_dp.launcher.engines.vllm_omni import ENTRY, KV_SIZE, VllmOmniEngine
from omni_dp.launcher.engines.vllm_omni_deploy import read_deploy_stages

PYTHON = os.environ.get("OMNI_DP_VLLM_OMNI_PYTHON")
TIMEOUT_S = 300  # one import of vllm-omni's config code: 15-45 s on 2 cores
pytestmark = [pytest.mark.timeout(600)]

OVERLAY = """\
base_config: base.yaml
stages:
  - stage_id: 1
    engine_args:
      gpu_memory_utilization: 0.1
    runtime:
      devices: "0"
"""

PROBE = r"""
import dataclasses, json, sys
from pathlib import Path
import vllm, vllm_omni
from vllm.engine.arg_utils import EngineArgs
from vllm_omni.config.stage_config import _parse_stage_deploy, load_deploy_config

spec = json.load(sys.stdin)
package = Path(vllm_omni.__file__).parent
files = sorted(str(p) for p in (package / "deploy").glob("*.yaml")) + spec["files"]
stages = {}
for file in files:
    try:
        deploy = load_deploy_config(file)
    except Exception as exc:
        stages[file] = repr(exc)
        continue
    stages[file] = [[s.stage_id, s.gpu_memory_utilization, s.devices,
                     s.tensor_parallel_size or 1] for s in deploy.stages]
extras = _parse_stage_deploy({"stage_id": 0, **spec["kv_fields"]})
print(json.dumps({
    "stages": stages,
    "kv_fields_as_engine_args": {**extras.engine_extras,
                                 "gpu_memory_utilization": extras.gpu_memory_utilization},
    "engine_args": sorted(f.name for f in dataclasses.fields(EngineArgs)),
    "sources": {
        "serve": str(package / "entrypoints" / "cli" / "serve.py"),
        "main": str(package / "entrypoints" / "cli" / "main.py"),
        "kv_line": str(Path(vllm.__file__).parent / "v1" / "core" / "kv_cache_utils.py"),
    },
    "versions": [vllm_omni.__version__ if hasattr(vllm_omni, "__version__") else "",
                 vllm.__version__],
}))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """The probe's answer. Skipped without the venv; under CI a missing install fails."""
    if not PYTHON:
        why = ("OMNI_DP_VLLM_OMNI_PYTHON is not set: run scripts/setup-vllm-omni and set it to "
               "the python it prints")
        if os.environ.get("OMNI_DP_REQUIRE_VLLM_OMNI"):
            pytest.fail(why)
        pytest.skip(why)
    root = tmp_path_factory.mktemp("deploy")
    from test_engine_vllm_omni import DEPLOY  # the unit tests' file, in vllm-omni's format

    (root / "base.yaml").write_text(DEPLOY)
    (root / "over.yaml").write_text(OVERLAY)
    spec = {"files": [str(root / "base.yaml"), str(root / "over.yaml")],
            "kv_fields": {"kv_cache_memory_bytes": 123456, "gpu_memory_utilization": 0.015}}
    done = subprocess.run([PYTHON, "-W", "ignore", "-c", PROBE], input=json.dumps(spec),
                          capture_output=True, text=True, timeout=TIMEOUT_S, check=False,
                          cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    answer["written"] = spec["files"]
    return answer


def test_every_deploy_file_reads_to_the_same_stages_as_vllm_omnis_loader(installed):
    compared, differ = 0, []
    for file, theirs in installed["stages"].items():
        if isinstance(theirs, str):  # vllm-omni itself refuses it: nothing to compare
            continue
        ours, problems = read_deploy_stages(file)
        if not theirs:  # a file without stages (a forced aligner's): nothing to size
            assert problems and "no `stages:` list" in problems[0]
            continue
        mine = [[s.stage_id, s.fraction, s.devices, s.tensor_parallel_size] for s in ours]
        if problems or mine != sorted(theirs):
            differ.append((Path(file).name, problems or mine, sorted(theirs)))
        compared += 1
    assert differ == []
    assert compared >= 50  # vllm-omni 0.30.0 ships 110 deploy files
    for file in installed["written"]:
        assert not isinstance(installed["stages"][file], str), installed["stages"][file]
    assert installed["stages"][installed["written"][1]] == [[0, 0.3, "0", 1], [1, 0.1, "0", 1]]


def test_the_kv_fields_omni_dp_sets_pass_through_the_stage_schema_into_vllms_engine_args(
        installed):
    assert installed["kv_fields_as_engine_args"] == {"kv_cache_memory_bytes": 123456,
                                                    "gpu_memory_utilization": 0.015}
    for name in ("kv_cache_memory_bytes", "gpu_memory_utilization", "num_gpu_blocks_override",
                 "data_parallel_size"):
        assert name in installed["engine_args"], name
    assert installed["versions"][1].startswith("0.30.")


def test_the_serve_command_the_adapter_writes_is_vllm_omnis(installed):
    serve = Path(installed["sources"]["serve"]).read_text()
    for flag in ('"--omni"', '"--deploy-config"', '"--stage-overrides"', '"--stage-id"'):
        assert flag in serve, flag
    main = Path(installed["sources"]["main"]).read_text()
    assert '"--omni" not in sys.argv' in main  # without --omni it is plain vLLM
    assert ENTRY == "vllm_omni.entrypoints.cli.main" and "def main()" in main
    assert '"--api-server-count' in serve or "api_server_count" in serve  # reserved
    launch = ReplicaLaunch(port=1, device="cuda", threads=None, kv_cache_bytes=None,
                           max_total_tokens=None)
    argv = VllmOmniEngine().argv(launch, ("/m",))
    assert argv[1:6] == ["-m", ENTRY, "serve", "/m", "--omni"]


def test_vllms_kv_line_as_its_source_formats_it_is_the_one_read_back(installed):
    source = Path(installed["sources"]["kv_line"]).read_text()
    fmt = '"%s KV cache size: %s tokens, "'
    assert fmt in source and '"GPU" if device_type == "cuda"' in source
    line = fmt.strip('"') % ("GPU", f"{36864:,}")
    match = KV_SIZE.search(line)
    assert match is not None and match.group(1) == "36,864"
