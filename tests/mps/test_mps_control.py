"""The control client: strict parsers and typed errors, against a scripted front end."""

from __future__ import annotations

import pytest

from omni_dp.mps import binaries
from omni_dp.mps.binaries import locate_mps_binaries
from omni_dp.mps.control import (
    BinaryNotFound,
    CommandRejected,
    ControlTimeout,
    DaemonUnreachable,
    MalformedOutput,
    MpsControl,
    parse_mem_limit,
    parse_percentage,
    parse_pid_list,
)


def control_for(standin, tmp_path, timeout_s=5.0) -> MpsControl:
    return MpsControl(str(standin.binary), str(tmp_path / "pipe"), str(tmp_path / "log"),
                      timeout_s=timeout_s)


def test_parse_pid_list_is_strict():
    assert parse_pid_list("") == []
    assert parse_pid_list("12\n345\n") == [12, 345]
    for bad in ("12 13", "abc", "12\nServer 5 not found", "-3", "1.5"):
        with pytest.raises(MalformedOutput):
            parse_pid_list(bad)


def test_parse_percentage_and_memory_limit():
    assert parse_percentage("100.0") == 100.0
    assert parse_percentage("37.5") == 37.5
    for bad in ("", "0", "101", "fifty", "50%"):
        with pytest.raises(MalformedOutput):
            parse_percentage(bad)
    assert parse_mem_limit("2G") == 2 * 1024**3
    assert parse_mem_limit("512M") == 512 * 1024**2
    with pytest.raises(MalformedOutput):
        parse_mem_limit("2 GB")


def test_replies_are_parsed(standin, tmp_path):
    standin.set({"get_server_list": "101", "get_client_list 101": "201\n202",
                 "get_default_active_thread_percentage": "100.0"})
    control = control_for(standin, tmp_path)
    assert control.server_list() == [101]
    assert control.client_list(101) == [201, 202]
    assert control.default_thread_percentage() == 100.0
    assert standin.commands() == ["get_server_list", "get_client_list 101",
                                  "get_default_active_thread_percentage"]


def test_unreachable_daemon_is_its_own_error(standin, tmp_path):
    standin.set(unreachable=True)
    with pytest.raises(DaemonUnreachable, match="Cannot find MPS control daemon"):
        control_for(standin, tmp_path).server_list()


@pytest.mark.parametrize("reply", ["Server 101 not found", 'Unknown command "x"',
                                   "A user id (UID) is required to start a new server"])
def test_rejections_with_exit_0_are_errors(standin, tmp_path, reply):
    standin.set({"get_client_list 101": reply})
    with pytest.raises(CommandRejected, match=reply.split()[0]):
        control_for(standin, tmp_path).client_list(101)


def test_unexpected_output_is_not_silently_dropped(standin, tmp_path):
    standin.set({"get_server_list": "101\nwarning: something"})
    with pytest.raises(MalformedOutput, match="warning"):
        control_for(standin, tmp_path).server_list()


def test_timeout(standin, tmp_path):
    standin.set({"get_server_list": ""}, sleep=3)
    with pytest.raises(ControlTimeout):
        control_for(standin, tmp_path, timeout_s=0.5).server_list()


def test_inherited_limits_are_stripped_and_dirs_set(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "10")
    monkeypatch.setenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "0=1G")
    env = MpsControl("x", "/p", "/l").env()
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env
    assert (env["CUDA_MPS_PIPE_DIRECTORY"], env["CUDA_MPS_LOG_DIRECTORY"]) == ("/p", "/l")


def test_locate_control_binary(standin, tmp_path, monkeypatch):
    monkeypatch.delenv("OMNI_DP_MPS_CONTROL", raising=False)
    monkeypatch.setattr(binaries, "DRIVER_DIRS", ())  # not the real driver's, where there is one
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(BinaryNotFound, match="nvidia-cuda-mps"):
        locate_mps_binaries()
    assert locate_mps_binaries(str(standin.binary)).control == str(standin.binary)
    monkeypatch.setenv("OMNI_DP_MPS_CONTROL", str(standin.binary))
    assert locate_mps_binaries().control == str(standin.binary)
    monkeypatch.delenv("OMNI_DP_MPS_CONTROL")
    monkeypatch.setenv("PATH", str(standin.binary.parent))
    assert locate_mps_binaries().control == str(standin.binary)


def test_a_memory_limit_is_read_back(standin, tmp_path):
    control = control_for(standin, tmp_path)
    standin.set({"set_default_device_pinned_mem_limit 0 3072M": "",
                 "get_default_device_pinned_mem_limit 0": "3G"})
    control.set_default_pinned_mem_limit(3 * 1024**3)
    assert standin.commands()[-1] == "get_default_device_pinned_mem_limit 0"
    standin.set({"set_default_device_pinned_mem_limit 0 3072M": "",
                 "get_default_device_pinned_mem_limit 0": "2G"})
    with pytest.raises(MalformedOutput, match="3072 MiB memory limit, the daemon reports"):
        control.set_default_pinned_mem_limit(3 * 1024**3)


def test_a_thread_percentage_is_read_back_not_taken_from_the_setters_echo(standin, tmp_path):
    """The setter's echo only says what the front end heard: the cap recorded is the one the
    daemon answers for afterwards, and a disagreement is an error, never a recorded cap."""
    control = control_for(standin, tmp_path)
    standin.set({"set_default_active_thread_percentage 40": "40.0",
                 "get_default_active_thread_percentage": "40.0"})
    assert control.set_default_thread_percentage(40) == 40.0
    assert standin.commands() == ["set_default_active_thread_percentage 40",
                                  "get_default_active_thread_percentage"]
    standin.set({"set_default_active_thread_percentage 40": "40.0",
                 "get_default_active_thread_percentage": "100.0"})
    with pytest.raises(MalformedOutput, match="asked for 40% threads, the daemon reports 100"):
        control.set_default_thread_percentage(40)
