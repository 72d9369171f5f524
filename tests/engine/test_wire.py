"""The wire codec: round trips, zero-copy frames, and every refusal (engine/wire.py)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from enum import Enum, IntEnum

import msgpack
import numpy as np
import pytest
import torch

from omni_dp.engine import wire
from omni_dp.engine.wire import WireError, decode, encode, register


@register(tag="test_wire.Color")
class Color(Enum):
    RED = "red"
    BLUE = "blue"


@register(tag="test_wire.Level")
class Level(IntEnum):
    LOW = 0
    HIGH = 1


@register(tag="test_wire.Item")
@dataclass(frozen=True)
class Item:
    name: str
    level: Level
    code: int | None = None


@register(tag="test_wire.Batch")
@dataclass
class Batch:
    items: list[Item]
    pair: tuple[int, str]
    colors: dict[str, Color]
    by_id: dict[int, list[float]]
    nothing: None = None
    flag: bool = False
    raw: bytes = b""
    nested: list = field(default_factory=list)


@register(tag="test_wire.Holder")
@dataclass
class Holder:
    value: object


@register(tag="test_wire.Derived")
@dataclass
class Derived:
    base: int
    twice: int = field(init=False)

    def __post_init__(self) -> None:
        self.twice = 2 * self.base


class Unregistered:
    pass


@dataclass
class UnregisteredData:
    x: int


class UnregisteredEnum(Enum):
    A = 1


def round_trip(message: object) -> object:
    return decode(encode(message))


def header(frames: list) -> list:
    return msgpack.unpackb(frames[0], raw=False, strict_map_key=False)


def test_nested_dataclasses_enums_tuples_dicts_round_trip() -> None:
    batch = Batch(
        items=[Item("a", Level.LOW), Item("b", Level.HIGH, code=7), Item("", Level.LOW, -1)],
        pair=(3, "x"),
        colors={"sky": Color.BLUE, "rose": Color.RED},
        by_id={1: [0.5, -2.0], -4: []},
        flag=True,
        raw=b"\x00\x01",
        nested=[(1, (2, [3, None])), {"k": (Item("c", Level.HIGH),)}, [[], ()]],
    )
    out = round_trip(batch)
    assert out == batch
    assert type(out.pair) is tuple and type(out.items) is list
    assert type(out.items[0].level) is Level and out.colors["sky"] is Color.BLUE
    assert type(out.nested[0][1]) is tuple and type(out.nested[0][1][1]) is list
    assert len(encode(batch)) == 1  # nothing large: all in the header


def test_dataclass_fields_are_restored_as_sent_without_init() -> None:
    """As pickle: init=False fields keep the sender's value; __post_init__ does not run."""
    sent = Derived(2)
    sent.twice = 5
    out = round_trip(sent)
    assert (out.base, out.twice) == (2, 5)


def test_header_is_tag_and_fields_in_order() -> None:
    assert header(encode(Item("a", Level.HIGH, 3))) == ["test_wire.Item",
                                                       ["a", [3, "test_wire.Level", 1], 3]]


def test_scalar_subclasses_go_as_their_base_type() -> None:
    out = round_trip(Holder([np.float64(1.5), True, 2**64 - 1, -(2**63)]))
    assert out.value == [1.5, True, 2**64 - 1, -(2**63)] and type(out.value[0]) is float


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16,
                                   torch.int16, torch.int64, torch.uint8, torch.bool,
                                   torch.complex64])
@pytest.mark.parametrize("shape", [(3, 5), (), (0,), (2, 0, 3)])
def test_tensors_round_trip(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = (torch.randn(shape, dtype=torch.float64) * 100).to(dtype)
    out = round_trip(Holder(t)).value
    assert out.dtype == dtype and out.shape == t.shape and torch.equal(out, t)


def test_ndarrays_round_trip() -> None:
    for a in (np.arange(12, dtype=np.float32).reshape(3, 4), np.array(3.5), np.eye(3)[:, 1:],
              np.zeros((0, 2), dtype=np.int16), np.arange(6, dtype=">i4"),
              np.array([True, False])):
        out = round_trip(Holder(a)).value
        assert out.dtype == a.dtype and out.shape == a.shape and np.array_equal(out, a)


def test_contiguous_tensor_frame_is_its_storage() -> None:
    for t in (torch.arange(4096, dtype=torch.float32), torch.randn(64, 64).to(torch.bfloat16),
              torch.arange(100, dtype=torch.int64)[10:60]):  # a view with a storage offset
        frames = encode(Holder(t))
        assert len(frames) == 2
        sent = np.frombuffer(frames[1], dtype=np.uint8)
        assert sent.ctypes.data == t.data_ptr() and sent.nbytes == t.numel() * t.element_size()
    a = np.arange(1000.0)
    assert np.shares_memory(np.frombuffer(encode(Holder(a))[1], dtype=np.uint8), a)


def test_non_contiguous_tensor_is_made_contiguous() -> None:
    """A copy, by design: only contiguous memory can be a frame."""
    t = torch.arange(12.0).reshape(3, 4).t()
    frames = encode(Holder(t))
    assert np.frombuffer(frames[1], dtype=np.uint8).ctypes.data != t.data_ptr()
    out = decode(frames).value
    assert torch.equal(out, t) and out.is_contiguous()


def test_autograd_and_conj_views_go_as_plain_values() -> None:
    t = torch.randn(3, dtype=torch.complex64, requires_grad=True)
    out = round_trip(Holder(t.conj())).value  # a lazily conjugated view: resolved on encode
    assert torch.equal(out, t.detach().conj().resolve_conj()) and not out.requires_grad


def test_decoded_tensor_is_a_view_of_a_writable_frame() -> None:
    frames = encode(Holder(torch.arange(256, dtype=torch.float32)))
    data = bytearray(frames[1])
    out = decode([frames[0], data]).value
    assert out.data_ptr() == np.frombuffer(data, dtype=np.uint8).ctypes.data
    data[:4] = np.float32(-1).tobytes()
    assert out[0].item() == -1.0  # shares memory with the frame


def test_read_only_frame_is_copied_without_warning() -> None:
    frames = [bytes(f) for f in encode(Holder(torch.arange(10, dtype=torch.int16)))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = decode(frames).value
    assert torch.equal(out, torch.arange(10, dtype=torch.int16))
    out[0] = 5  # writable, and not the bytes object's memory
    assert frames[1][:2] == b"\x00\x00"


def test_unaligned_frame_is_copied_to_aligned_memory() -> None:
    t = torch.arange(64, dtype=torch.float64)
    frames = encode(Holder(t))
    shifted = memoryview(bytearray(len(frames[1]) + 1))[1:]
    shifted[:] = frames[1]
    out = decode([frames[0], shifted]).value
    assert out.data_ptr() % 8 == 0 and torch.equal(out, t)


def test_large_bytes_go_as_their_own_frame() -> None:
    pcm = bytes(range(256)) * 16  # 4 KiB
    small = b"x" * (wire.BYTES_FRAME_MIN - 1)
    frames = encode(Batch([], (1, "a"), {}, {}, raw=pcm, nested=[small, bytearray(pcm)]))
    assert len(frames) == 3 and frames[1] is pcm
    out = decode(frames)
    assert out.raw == pcm and out.nested == [small, pcm] and type(out.nested[1]) is bytes


def test_frames_from_several_values_keep_their_order() -> None:
    a, b = torch.arange(3), torch.ones(2, 2)
    out = round_trip(Holder({"a": a, "pcm": b"p" * 5000, "b": [b, np.arange(2)]})).value
    assert torch.equal(out["a"], a) and torch.equal(out["b"][0], b) and out["pcm"] == b"p" * 5000


# --- refusals --------------------------------------------------------------------------------
def test_unsupported_type_names_the_field_path() -> None:
    batch = Batch([Item("a", Level.LOW), Item("b", Level.LOW), Item("c", Level.LOW)], (1, ""),
                  {}, {})
    object.__setattr__(batch.items[2], "code", Unregistered())
    with pytest.raises(WireError, match=r"^test_wire\.Batch\.items\[2\]\.code: cannot encode "
                                        r"type test_wire\.Unregistered$"):
        encode(batch)
    cases = [({"k": {1.5: 0}}, r"Holder\.value\['k'\]: .*dict key of type float"),
             ((1, [UnregisteredData(1)]), r"Holder\.value\[1\]\[0\]: .*not registered"),
             (UnregisteredEnum.A, r"Holder\.value: .*Enum not registered"),
             (np.int64(3), r"Holder\.value: cannot encode type numpy\.int64"),
             ([2**64], r"test_wire\.Holder: the header cannot be packed"),
             (np.array(["a"]), r"Holder\.value: .*ndarray of dtype <U1"),
             (torch.empty(2, device="meta"), r"move it to the CPU first \(\.cpu\(\)\)"),
             (torch.eye(2).to_sparse(), r"sparse_coo tensor")]
    for value, message in cases:
        with pytest.raises(WireError, match=message):
            encode(Holder(value))
    cyclic: list = []
    cyclic.append(cyclic)
    with pytest.raises(WireError, match="nested too deeply"):
        encode(Holder(cyclic))
    with pytest.raises(WireError, match="a message is a dataclass registered"):
        encode(Level.LOW)
    with pytest.raises(WireError, match="a message is a dataclass registered"):
        encode(UnregisteredData(1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensor_is_refused() -> None:
    with pytest.raises(WireError, match=r"Holder\.value: a tensor on cuda:0 .* CPU"):
        encode(Holder(torch.ones(2, device="cuda")))


def test_registration_refusals() -> None:
    with pytest.raises(WireError, match=r"'test_wire\.Item' .* already taken by"):
        register(dataclass(type("Other", (), {"__annotations__": {"x": int}})),
                 tag="test_wire.Item")
    with pytest.raises(WireError, match=r"already registered as 'test_wire\.Item'"):
        register(Item, tag="test_wire.Item2")
    with pytest.raises(TypeError, match="neither a dataclass nor an Enum"):
        register(Unregistered)
    assert register(Item, tag="test_wire.Item") is Item  # the same registration: a no-op


def test_default_tag_is_the_class_name() -> None:
    @dataclass
    class WireTestDefaultTag:
        x: int

    register(WireTestDefaultTag)
    assert header(encode(WireTestDefaultTag(1)))[0] == "WireTestDefaultTag"


def good_frames() -> list:
    return list(encode(Holder([torch.arange(4), b"z" * 2000])))


def with_header(value: object, *frames: object) -> list:
    return [msgpack.packb(value, use_bin_type=True), *frames]


@pytest.mark.parametrize("frames, message", [
    ([], "no frames"),
    ([b"\xc1"], "not msgpack"),
    ([b"\x93\x01"], "not msgpack"),  # truncated
    ([12], "not a contiguous buffer"),
    (with_header({"tag": 1}), r"not \[tag, fields\]"),
    (with_header(["test_wire.Holder"]), r"not \[tag, fields\]"),
    (with_header(["nope", []]), "unknown tag 'nope'"),
    (with_header(["test_wire.Color", []]), "is not a dataclass"),
    (with_header(["test_wire.Holder", [1, 2]]), "has 1 fields, the header 2"),
    (with_header(["test_wire.Holder", 5]), "has 1 fields, the header int"),
    (with_header(["test_wire.Holder", [[99, 1]]]), "unknown value kind 99"),
    (with_header(["test_wire.Holder", [[]]]), "malformed value"),
    (with_header(["test_wire.Holder", [["x"]]]), "malformed value"),
    (with_header(["test_wire.Holder", [[0, 1, 2]]]), "malformed value"),
    (with_header(["test_wire.Holder", [{b"k": 1}]]), "malformed dict"),
    (with_header(["test_wire.Holder", [[3, "test_wire.Item", 1]]]), "is not an Enum"),
    (with_header(["test_wire.Holder", [[3, "test_wire.Level", 7]]]), "7 is not a test_wire"),
    (with_header(["test_wire.Holder", [[4, "float128", [1], 1]]], b"x"), "unknown tensor dtype"),
    (with_header(["test_wire.Holder", [[4, "int16", [-1], 1]]], b"xx"), "malformed shape"),
    (with_header(["test_wire.Holder", [[4, "int16", [3], 1]]], b"xx"), "needs 6 bytes"),
    (with_header(["test_wire.Holder", [[5, "O", [1], 1]]], b"x" * 8), "refused ndarray dtype"),
    (with_header(["test_wire.Holder", [[5, "zz", [1], 1]]], b"x"), "unknown ndarray dtype"),
    (with_header(["test_wire.Holder", [[6, 1]]]), "frame count mismatch"),
    (with_header(["test_wire.Holder", [[0, [[6, 1], [6, 1]]]]], b"x"), "used twice"),
    (with_header(["test_wire.Holder", [[6, 0]]]), "frame count mismatch"),
    (good_frames()[:2], "frame count mismatch"),
    ([*good_frames(), b"extra"], "frame count mismatch: 4 frames, the header uses 3"),
])
def test_malformed_frames_raise_wire_error(frames: list, message: str) -> None:
    with pytest.raises(WireError, match=message):
        decode(frames)
