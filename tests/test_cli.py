"""The command line as a person meets it: help, bad options (exit 2, no traceback), weights."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from omni_dp.engine.config import CONFIG_FILE, WEIGHTS_FILE

from conftest import post_json


def omni_dp(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "omni_dp", *args],
        capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )


def test_help_lists_commands():
    result = omni_dp("--help")
    assert result.returncode == 0
    assert "serve" in result.stdout
    assert "save-weights" in result.stdout


def test_serve_help_documents_every_flag():
    from omni_dp.cli import serve

    result = omni_dp("serve", "--help")
    assert result.returncode == 0
    for param in serve.params:
        for flag in param.opts:
            assert flag in result.stdout
        assert param.help, f"{param.opts[0]} has no help text"


def test_help_does_not_import_torch():
    code = "import sys; from omni_dp.cli import cli; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "False"


BAD_OPTIONS = [
    (["--kv-cache-bytes", "1GiB", "--max-total-tokens", "4096"], "give only one"),
    (["--kv-cache-bytes", "lots"], "is not a size"),
    (["--kv-cache-bytes", "100"], "holds no whole page"),
    (["--max-total-tokens", "1000"], "use 992 or 1008"),
    (["--max-total-tokens", "-16"], "must be positive"),
    (["--device", "cuda"], "CUDA is not available"),
    (["--device", "tpu"], "is not a device"),
    (["--device", "mps"], "not supported"),
    (["--model", "/nonexistent/model"], "neither a preset"),
    (["--threads", "0"], "--threads"),
    (["--max-running-requests", "0"], "--max-running-requests"),
    (["--kv-cache-bytes", "1000TiB"], "lower --kv-cache-bytes"),
    (["--dtype", "int8"], "int8"),
]


@pytest.mark.parametrize(("args", "message"), BAD_OPTIONS)
def test_bad_options_exit_2_with_a_message_and_no_traceback(args, message):
    result = omni_dp("serve", "--port", "0", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert "listening" not in result.stderr  # nothing was started


def test_several_problems_are_reported_together():
    result = omni_dp("serve", "--device", "cuda", "--max-total-tokens", "1000", "--threads", "0")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 3


def test_port_in_use_exits_2():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = omni_dp("serve", "--port", str(port))
    assert result.returncode == 2
    assert f"127.0.0.1:{port} is already in use" in result.stderr
    assert "Traceback" not in result.stderr


def test_model_dir_with_a_broken_config_exits_2(tmp_path):
    (tmp_path / CONFIG_FILE).write_text('{"architecture": "something-else"}')
    (tmp_path / WEIGHTS_FILE).write_bytes(b"")
    result = omni_dp("serve", "--model", str(tmp_path))
    assert result.returncode == 2
    assert "architecture" in result.stderr


def test_saved_weights_serve_the_same_audio_as_the_preset(tmp_path, replica, start_replica):
    weights = tmp_path / "tiny-seed0"
    result = omni_dp("save-weights", str(weights))
    assert result.returncode == 0, result.stderr
    assert (weights / CONFIG_FILE).is_file()
    assert (weights / WEIGHTS_FILE).is_file()

    again = omni_dp("save-weights", str(weights))
    assert again.returncode == 2
    assert "--force" in again.stderr

    from_dir = start_replica("--model", str(weights))
    assert from_dir.info()["model"]["source"] == str(weights)
    body = {"input": "Loaded from disk.", "seed": 99}
    assert post_json(from_dir.url + "/v1/audio/speech", body)[2] == \
        post_json(replica.url + "/v1/audio/speech", body)[2]


def test_other_weight_seed_gives_other_audio(replica, start_replica):
    other = start_replica("--weight-seed", "1")
    body = {"input": "Different weights.", "seed": 5}
    first = post_json(replica.url + "/v1/audio/speech", body)
    second = post_json(other.url + "/v1/audio/speech", body)
    assert first[0] == second[0] == 200
    assert first[2] != second[2]


def test_policy_names_agree_everywhere():
    """`--policy` of router and launch, the launcher's plan and the router itself."""
    from omni_dp.cli import POLICIES
    from omni_dp.launcher import plan
    from omni_dp.router import policies

    assert set(POLICIES) == set(plan.POLICIES) == set(policies.POLICIES)
