"""The weight-share manifest's reader, field by field: every validator of omni_dp/sharefile.py
on a manifest built here (no model, no torch), and the file checks of read_manifest."""

from __future__ import annotations

import copy
import json
import os

import pytest

from omni_dp.files import atomic_write
from omni_dp.procs import ProcessIdentity
from omni_dp.records import Malformed
from omni_dp.sharefile import (
    ALIGN,
    MANIFEST_FILE,
    MAX_IPC_HANDLE_BYTES,
    MAX_MANIFEST_BYTES,
    SEGMENT_FILE,
    Buffer,
    CudaIpcHandle,
    ModelIdentity,
    ShareFileError,
    ShareManifest,
    TensorEntry,
    read_manifest,
    write_manifest,
)


def ipc(index: int) -> CudaIpcHandle:
    return CudaIpcHandle(device=0, handle=bytes([index]) * 64, storage_size=4096,
                         storage_offset=512 * index, ref_counter_handle=b"\x07" * 64,
                         ref_counter_offset=8 * index, event_handle=b"",
                         event_sync_required=False)


def segment_manifest() -> ShareManifest:
    """Two float32 tensors in one 256-byte segment: a 4×4 shared one at 0, a private 8 at 64."""
    return ShareManifest(
        architecture="omni-dp-tts", policy="omni-dp-tts/1",
        model=ModelIdentity("preset tiny, seed 0", "ab" * 32), dtype="float32", device="cpu",
        run_id="standalone", leader=ProcessIdentity(1234, 1700000000.25),
        buffers=(Buffer("segment", 256, file=SEGMENT_FILE, sha256="0f" * 32),),
        shared=(TensorEntry("talker.a", "float32", (4, 4), 0, 0, 64),),
        private=(TensorEntry("talker.b", "float32", (8,), 0, 64, 32),),
        created_at=1700000001.5,
    )


def cuda_manifest() -> ShareManifest:
    """One buffer per dtype, as a CUDA leader publishes."""
    return ShareManifest(
        architecture="omni-dp-tts", policy="omni-dp-tts/1",
        model=ModelIdentity("/models/m", "cd" * 32), dtype="bfloat16", device="GPU-1234-abcd",
        run_id="run-1", leader=ProcessIdentity(99, 1700000000.0),
        buffers=(Buffer("cuda_ipc", 4096, ipc=ipc(1)), Buffer("cuda_ipc", 4096, ipc=ipc(2))),
        shared=(TensorEntry("talker.w", "bfloat16", (16, 16), 0, 0, 512),
                TensorEntry("vocoder.w", "float32", (8, 8), 1, 0, 256)),
        private=(TensorEntry("talker.n", "bfloat16", (16,), 0, 512, 32),),
        created_at=1700000002.0,
    )


def data() -> dict:
    return copy.deepcopy(segment_manifest().to_json())


def malformed(raw: dict) -> str:
    with pytest.raises(Malformed) as caught:
        ShareManifest.from_json(raw)
    return str(caught.value)


@pytest.fixture
def share(tmp_path):
    directory = tmp_path / "share"
    directory.mkdir(mode=0o700)
    return directory


def write_raw(share, text: str) -> None:
    atomic_write(share / MANIFEST_FILE, text, mode=0o600)


def unreadable(share) -> str:
    with pytest.raises(ShareFileError) as caught:
        read_manifest(share)
    return str(caught.value)


# --- round trips ------------------------------------------------------------------------


@pytest.mark.parametrize("build", [segment_manifest, cuda_manifest])
def test_a_manifest_round_trips_through_its_file(share, build):
    manifest = build()
    assert ShareManifest.from_json(manifest.to_json()) == manifest
    write_manifest(share, manifest)
    assert os.stat(share / MANIFEST_FILE).st_mode & 0o777 == 0o600
    assert read_manifest(share) == manifest


def test_a_cuda_handle_travels_as_hex_and_opens_with_the_same_eight_values(share):
    manifest = cuda_manifest()
    write_manifest(share, manifest)
    on_disk = json.loads((share / MANIFEST_FILE).read_text())
    assert on_disk["buffers"][0]["ipc"]["handle"] == "01" * 64
    handle = read_manifest(share).buffers[1].ipc
    assert handle is not None
    assert handle.args() == (0, b"\x02" * 64, 4096, 1024, b"\x07" * 64, 16, b"", False)
    assert manifest.shared_bytes == 768 and manifest.private_bytes == 32


# --- the manifest's fields --------------------------------------------------------------


def test_another_format_version_is_refused():
    raw = data()
    raw["format"] = 2
    assert malformed(raw) == "format is 2; this omni-dp reads format 1"


def test_a_name_given_twice_is_refused():
    raw = data()
    raw["private"][0]["name"] = "talker.a"
    assert malformed(raw) == "tensor(s) named twice: talker.a"


def test_overlapping_tensors_are_refused():
    raw = data()
    raw["shared"][0] |= {"shape": [8, 4], "nbytes": 128}  # 0..128, over talker.b's 64..96
    assert malformed(raw) == "tensors talker.a and talker.b overlap"


def test_a_tensor_past_its_buffers_end_is_refused():
    raw = data()
    raw["private"][0]["offset"] = 256  # 256..288 of a 256-byte segment
    assert malformed(raw) == ("tensor talker.b: bytes 256..288 lie past the end of buffer 0 "
                              "(256 bytes)")


def test_a_tensor_of_a_buffer_that_does_not_exist_is_refused():
    raw = data()
    raw["shared"][0]["buffer"] = 1
    assert malformed(raw) == "tensor talker.a: buffer 1 does not exist (1 buffer(s))"


@pytest.mark.parametrize("offset", [ALIGN // 2, -ALIGN])
def test_an_offset_off_the_alignment_is_refused(offset):
    raw = data()
    raw["private"][0]["offset"] = offset
    assert malformed(raw) == (f"private[0].offset {offset} is not a non-negative multiple of "
                              f"{ALIGN}")


def test_nbytes_that_are_not_shape_times_itemsize_are_refused():
    raw = data()
    raw["shared"][0]["nbytes"] = 60
    assert malformed(raw) == "shared[0]: nbytes 60 is not (4, 4) × 4 bytes"


_NOT_A_SHAPE = "shared[0].shape is not a list of at most 8 non-negative integers"


@pytest.mark.parametrize(("shape", "why"), [
    ([4, -4], _NOT_A_SHAPE), ([1] * 9, _NOT_A_SHAPE),
    ([4.0, 4], "shared[0].shape[0] is a number, not an integer"), ([1] * 7 + [16], None)])
def test_a_shape_is_a_few_non_negative_integers(shape, why):
    raw = data()
    raw["shared"][0]["shape"] = shape
    if why is None:
        assert ShareManifest.from_json(raw).shared[0].shape == tuple(shape)
    else:
        assert malformed(raw) == why


def test_an_unknown_dtype_is_refused():
    raw = data()
    raw["shared"][0]["dtype"] = "complex64"
    assert malformed(raw).startswith("shared[0].dtype is 'complex64', not one of float64, ")


@pytest.mark.parametrize("name", ["../weights.bin", "/tmp/weights.bin", "other.bin"])
def test_a_segment_is_weights_bin_beside_the_manifest_never_a_path(name):
    raw = data()
    raw["buffers"][0]["file"] = name
    assert malformed(raw) == f"buffers[0].file is {name!r}, not {SEGMENT_FILE!r}"


@pytest.mark.parametrize("digest", ["0F" * 32, "0f" * 31, "zz" * 32])
def test_a_segment_digest_is_lowercase_sha256_hex(digest):
    raw = data()
    raw["buffers"][0]["sha256"] = digest
    assert malformed(raw) == "buffers[0].sha256 is not a sha256 hex digest"


def test_a_buffer_of_another_kind_or_negative_size_is_refused():
    raw = data()
    raw["buffers"][0]["kind"] = "shm"
    assert malformed(raw) == "buffers[0].kind is 'shm', not one of segment, cuda_ipc"
    raw = data()
    raw["buffers"][0]["nbytes"] = -1
    assert malformed(raw) == "buffers[0].nbytes is negative"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_created_at_that_is_not_finite_is_refused(share, value):
    raw = data()
    raw["created_at"] = value
    assert malformed(raw) == f"created_at is {value}, not a finite number"
    write_raw(share, json.dumps(raw))  # Python's json writes and reads NaN, Infinity
    assert "created_at is" in unreadable(share)


# --- the CUDA handles -------------------------------------------------------------------


def cuda_data() -> dict:
    return copy.deepcopy(cuda_manifest().to_json())


@pytest.mark.parametrize("key", ["device", "storage_size", "storage_offset",
                                 "ref_counter_offset"])
def test_a_negative_count_in_a_cuda_handle_is_refused(key):
    raw = cuda_data()
    raw["buffers"][1]["ipc"][key] = -1
    assert malformed(raw) == f"buffers[1].ipc.{key} is negative"


@pytest.mark.parametrize("key", ["handle", "ref_counter_handle"])
def test_an_empty_cuda_handle_is_refused(key):
    raw = cuda_data()
    raw["buffers"][0]["ipc"][key] = ""
    assert malformed(raw) == f"buffers[0].ipc.{key} is empty"


def test_an_empty_event_handle_is_one_that_needs_no_wait():
    raw = cuda_data()
    raw["buffers"][0]["ipc"]["event_handle"] = ""
    assert ShareManifest.from_json(raw).buffers[0].ipc.event_handle == b""


@pytest.mark.parametrize("key", ["handle", "ref_counter_handle", "event_handle"])
def test_a_cuda_handle_longer_than_a_kilobyte_is_refused(key):
    raw = cuda_data()
    raw["buffers"][0]["ipc"][key] = "ab" * MAX_IPC_HANDLE_BYTES  # exactly the limit: fine
    ShareManifest.from_json(raw)
    raw["buffers"][0]["ipc"][key] = "ab" * (MAX_IPC_HANDLE_BYTES + 1)
    assert malformed(raw) == (f"buffers[0].ipc.{key} is {MAX_IPC_HANDLE_BYTES + 1} bytes, "
                              f"more than {MAX_IPC_HANDLE_BYTES}")


def test_a_cuda_handle_that_is_not_hex_or_absent_is_refused():
    raw = cuda_data()
    raw["buffers"][0]["ipc"]["handle"] = "xyz"
    assert malformed(raw) == "buffers[0].ipc.handle is not hex"
    raw = cuda_data()
    raw["buffers"][0]["ipc"] = None
    assert malformed(raw) == "buffers[0].ipc is null, not an object"


# --- the file ---------------------------------------------------------------------------


def test_a_manifest_over_the_size_cap_is_refused_unparsed(share):
    write_raw(share, " " * MAX_MANIFEST_BYTES + json.dumps(data()))
    assert unreadable(share) == (f"the weight-share manifest {share / MANIFEST_FILE} is larger "
                                 f"than {MAX_MANIFEST_BYTES} bytes")


@pytest.mark.parametrize("text", ["[" * 200000, '{"a":' * 200000])
def test_json_nested_too_deeply_is_a_share_file_error(share, text):
    """json.loads raises RecursionError, not ValueError, for it: still a refusal (exit 3)."""
    write_raw(share, text)
    assert "nested too deeply to parse" in unreadable(share)


def test_a_manifest_that_is_not_json_or_not_an_object_is_refused(share):
    write_raw(share, "{")
    assert "is not JSON" in unreadable(share)
    write_raw(share, "[]")
    assert unreadable(share).endswith("is malformed: the top level is a list, not an object")
