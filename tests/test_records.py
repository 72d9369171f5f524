"""Records derive their JSON from their fields (omni_dp/records.py), and files written before
that still read: run.json and share manifests written by omni-dp at main 232a526, before the
change (tests/fixtures/, made with that version's own writers), read field for field and are
written back byte for byte."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import pytest

from omni_dp.mps.attach import DeclaredProcess
from omni_dp.mps.daemon import DaemonLimits, DaemonRecord
from omni_dp.procs import ProcessIdentity
from omni_dp.records import Malformed
from omni_dp.runfile import (
    GatewayEntry,
    GatewayRecord,
    GpuRecord,
    PlanRecord,
    ReplicaRecord,
    ReplicaState,
    RouterPlan,
    RunFileError,
    RunPhase,
    RunRecord,
    ShareRecord,
    SupervisionSettings,
    SupervisorRecord,
    read_run,
)
from omni_dp.sharefile import (
    MANIFEST_FILE,
    Buffer,
    CudaIpcHandle,
    ModelIdentity,
    TensorEntry,
    read_manifest,
)

FIXTURES = Path(__file__).parent / "fixtures"
RUN_JSON = FIXTURES / "run-232a526.json"
UUID = "GPU-0a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9"
RUN = "/var/tmp/omni-dp/state/runs/run-test-0001"


def _ident(pid: int) -> ProcessIdentity:
    return ProcessIdentity(pid, 123456.78 + pid)


@pytest.fixture
def old_run(tmp_path) -> tuple[RunRecord, str]:
    """The run.json main wrote, in a run directory, read by read_run."""
    (tmp_path / "run.json").write_text(RUN_JSON.read_text())
    (tmp_path / "run_token").write_text("token\n")
    return read_run(tmp_path)[0], RUN_JSON.read_text()


def test_a_run_json_written_before_records_were_derived_reads_field_for_field(old_run):
    record, _ = old_run
    assert (record.schema, record.run_id, record.created_at, record.state, record.gpu,
            record.device) == (2, "run-test-0001", 1700000000.125, RunPhase.DEGRADED, UUID,
                               "cuda")
    assert record.launcher == _ident(4000)
    assert record.supervisor == SupervisorRecord(_ident(4001), True, 1700000001.5)
    assert record.router is not None and record.router.identity == _ident(4002)
    assert (record.router.pgid, record.router.url, record.router.log) == (
        4002, "http://127.0.0.1:8000", "router.log")
    assert record.router.argv[-2:] == ("--replica", "1=http://127.0.0.1:8101")
    assert record.daemons == (DaemonRecord(
        _ident(4003), "/usr/bin/nvidia-cuda-mps-control", f"{RUN}/mps/pipe", f"{RUN}/mps/log",
        UUID, "/usr/bin/nvidia-cuda-mps-server", 0, DaemonLimits(40.0, 2 * 1024**3)),)
    assert record.share == ShareRecord(0, (1,), f"{RUN}/share", "omni-dp-tts/1", 3 * 1024**2,
                                       4096, 12, 4100, 1700000002.0)
    assert record.gpus == (GpuRecord(0, UUID, 0, 1, "NVIDIA H200"),)
    assert record.gateway == GatewayRecord("http://gateway.test:30000", (
        GatewayEntry("http://127.0.0.1:8100", 0, "worker-0"),
        GatewayEntry("http://127.0.0.1:8000", None, "worker-r")))


def test_its_plan_reads_every_one_of_the_27_keys_into_its_own_field(old_run):
    plan = old_run[0].plan
    data = json.loads(old_run[1])["plan"]
    assert plan == PlanRecord(
        replicas=2, engine="builtin", engine_args=(), config_file=None, device="cuda", gpu=UUID,
        gpu_numa_node=1, mps=True, start="parallel", cpu_blocks="auto", kv_cache_bytes=None,
        max_total_tokens=1024, expected_kv_tokens=1024,
        router=RouterPlan("http://127.0.0.1:8000", "least_request", 1,
                          tuple(data["router"]["argv"])),
        supervision=SupervisionSettings(check_interval=2.0, restart_after_failures=3,
                                        restart_budget=5, restart_window=600.0,
                                        on_mps_fault="restart", start_timeout=300.0,
                                        drain_timeout=30.0),
        log_format="text", warnings=("block 1 is on NUMA node 0, the GPU on 1",),
        command="omni-dp", api_key_set=False, share_weights=True, register=None,
        register_as="replicas", register_url=None, replicas_per_gpu=None,
        options=data["options"], mps_thread_percentage=40.0, mps_memory_limit=None)
    assert len(data) == 27


def test_its_replicas_read_field_for_field(old_run):
    first, second = old_run[0].replicas
    assert (first.index, first.port, first.url, first.cpus, first.log) == (
        0, 8100, "http://127.0.0.1:8100", "2-3,6-7", "replica_0.log")
    assert first.argv[:3] == ("/usr/bin/python3", "-m", "omni_dp.launcher.processes.pin")
    assert first.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert (first.identity, first.pgid, first.state) == (_ident(4100), 4100,
                                                         ReplicaState.HEALTHY)
    assert first.processes == (DeclaredProcess(4100, "main", "cuda:0", 123456.5),
                               DeclaredProcess(4101, "vocoder", "cpu", None))
    assert (first.kv_tokens, first.mps_attached, first.memory_bytes, first.restarts,
            first.last_error, first.gpu) == (1024, True, 3 * 1024**3, (), None, 0)
    assert (second.identity, second.pgid, second.state, second.restarts, second.last_error) == (
        None, None, ReplicaState.DOWN, (1700000000.25, 1700000100.5), "killed by SIGKILL")


def test_it_is_written_back_byte_for_byte(old_run):
    record, text = old_run
    assert json.dumps(record.to_json(), indent=1) + "\n" == text


def test_a_record_read_back_equals_the_one_written_defaults_included():
    """msgspec leaves a default on the class, not in the instance: written all the same."""
    record = SupervisorRecord(ProcessIdentity(1, 2.5), False)
    back = SupervisorRecord.from_json(json.loads(json.dumps(record.to_json())))
    assert back == record and back.to_json() == {"pid": 1, "create_time": 2.5,
                                                  "detached": False}


def test_a_read_only_mapping_in_a_record_is_written_as_an_object():
    replica = ReplicaRecord(0, 8100, "http://127.0.0.1:8100", None, ("serve",),
                            MappingProxyType({"A": "1"}), "replica_0.log")
    assert replica.to_json()["env"] == {"A": "1"}
    assert ReplicaRecord.from_json(json.loads(json.dumps(replica.to_json()))) == replace(
        replica, env={"A": "1"})


@pytest.mark.parametrize(("data", "why"), [
    ({"pid": 1}, "supervisor has no 'create_time'"),
    ({"pid": True, "create_time": 1.0}, "supervisor.pid is a boolean, not an integer"),
    ({"pid": 1, "create_time": 1.0, "supervising_since": "now"},
     "supervisor.supervising_since is a string, not a number or null"),
    ([], "supervisor is a list, not an object"),
])
def test_a_malformed_record_names_its_key_in_the_document(data, why):
    with pytest.raises(Malformed) as caught:
        SupervisorRecord.from_json(data, "supervisor")
    assert str(caught.value) == why


def test_a_malformed_run_json_is_still_a_run_file_error(tmp_path):
    data = json.loads(RUN_JSON.read_text())
    data["plan"]["supervision"]["health_timeout"] = "soon"
    (tmp_path / "run.json").write_text(json.dumps(data))
    (tmp_path / "run_token").write_text("token\n")
    with pytest.raises(RunFileError, match=r"run\.json is malformed: plan\.supervision\."
                                           r"health_timeout is a string, not a number$"):
        read_run(tmp_path)


@pytest.mark.parametrize("name", ["weights-segment-232a526.json", "weights-cuda-232a526.json"])
def test_a_share_manifest_written_before_reads_and_is_written_back_byte_for_byte(tmp_path,
                                                                                name):
    (tmp_path / MANIFEST_FILE).write_text((FIXTURES / name).read_text())
    (tmp_path / MANIFEST_FILE).chmod(0o600)
    manifest = read_manifest(tmp_path)
    assert (manifest.format, manifest.architecture, manifest.policy, manifest.dtype,
            manifest.run_id, manifest.created_at) == (1, "omni-dp-tts", "omni-dp-tts/1",
                                                      "float32", "run-test-0001", 1700000002.0)
    assert manifest.model == ModelIdentity("preset tiny, seed 0", "ab" * 32)
    assert manifest.leader == ProcessIdentity(4100, 123456.5)
    assert manifest.shared == (TensorEntry("talker.embed.weight", "float32", (16, 8), 0, 0, 512),)
    assert manifest.private == (TensorEntry("talker.norm.weight", "bfloat16", (8,), 0, 512, 16),)
    [buffer] = manifest.buffers
    if manifest.device == "cpu":
        assert buffer == Buffer("segment", 576, "weights.bin", "cd" * 32)
    else:
        assert buffer == Buffer("cuda_ipc", 576, ipc=CudaIpcHandle(
            0, bytes(range(64)), 576, 0, b"\x01" * 16, 8, b"", False))
        assert buffer.ipc is not None and buffer.ipc.args()[1] == bytes(range(64))
    assert json.dumps(manifest.to_json(), indent=1) + "\n" == (FIXTURES / name).read_text()
