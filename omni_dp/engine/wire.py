"""The wire format between the stage processes of one replica: msgpack header, raw data frames.

A message is a registered dataclass. `encode` turns it into frames: frame 0 is msgpack of
`[tag, fields]` (the fields in declaration order, encoded recursively); every tensor, ndarray
and large bytes value (PCM) goes as a frame of its own, referenced from the header by index, so
that its bytes are never copied into or out of msgpack. A contiguous CPU tensor's frame is a
view of its storage (zero-copy); pyzmq's `send_multipart(copy=False)` keeps it alive until sent,
so a tensor must not be modified after it was handed to a send.

Values: None, bool, int (64-bit), float, str, bytes/bytearray (decoded as bytes), list, tuple
(decoded as tuple), dict with str or int keys, registered Enums and dataclasses, torch.Tensor,
numpy.ndarray. In the header a list is `[kind, ...]` with a small int `kind` saying what it holds
(a list, a tuple, a dataclass, an enum, a tensor...); a dict is a msgpack map.

`decode` takes frames from another process, so everything it can meet is checked: anything
malformed, unknown or inconsistent raises WireError, never another exception.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import msgpack
import numpy as np
import torch

if TYPE_CHECKING:
    import zmq

BYTES_FRAME_MIN = 1024  # bytes values of this size or more go as a frame of their own

# The header's list kinds.
_LIST, _TUPLE, _DATACLASS, _ENUM, _TENSOR, _NDARRAY, _BYTES = range(7)

_PLAIN = frozenset((type(None), bool, int, float, str))  # msgpack-native as they are

_TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "complex64", "complex128",
                 "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64",
                 "bool", "float8_e4m3fn", "float8_e5m2")
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_TORCH_NAMES = {dtype: name for name, dtype in _TORCH_DTYPES.items()}
_NUMPY_KINDS = "biufc"  # bool, int, uint, float, complex: plain bytes, no Python objects

_classes: dict[str, type] = {}  # tag → class
_tags: dict[type, str] = {}  # class → tag
_fields: dict[type, tuple[str, ...]] = {}  # dataclass → its field names, in order

T = TypeVar("T", bound=type)


class WireError(ValueError):
    """A message that cannot be encoded, or frames that are not a message."""


def register(cls: T | None = None, *, tag: str | None = None) -> T | Callable[[T], T]:
    """Make a dataclass (frozen or not) or an Enum encodable, under `tag` (default: its name).

    Usable as `@register`, `@register(tag="X")` (above `@dataclass`) or `register(cls)`. Both
    processes must register the class under the same tag; a tag already taken is refused here,
    not at the first message.
    """

    def apply(cls: T) -> T:
        if not isinstance(cls, type) or not (
            dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum)
        ):
            raise TypeError(f"wire.register: {cls!r} is neither a dataclass nor an Enum "
                            "(put @register above @dataclass)")
        name = cls.__name__ if tag is None else tag
        if not isinstance(name, str) or not name:
            raise TypeError(f"wire.register: the tag of {cls.__qualname__} must be a non-empty str")
        if _classes.get(name) is cls and _tags.get(cls) == name:
            return cls  # the same registration again: harmless
        if name in _classes:
            other = _classes[name]
            raise WireError(f"wire.register: tag {name!r} of {cls.__module__}.{cls.__qualname__}"
                            f" is already taken by {other.__module__}.{other.__qualname__}")
        if cls in _tags:
            raise WireError(f"wire.register: {cls.__qualname__} is already registered as "
                            f"{_tags[cls]!r}")
        _classes[name] = cls
        _tags[cls] = name
        if dataclasses.is_dataclass(cls):
            _fields[cls] = tuple(f.name for f in dataclasses.fields(cls))
        return cls

    return apply if cls is None else apply(cls)


# --- encode ----------------------------------------------------------------------------------
class _Refused(Exception):
    """A refusal on its way up: each container it crosses adds its part of the path (paths are
    built only for errors, never for the values that encode fine)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.where: list[str] = []  # innermost first

    def error(self, root: str) -> WireError:
        return WireError(f"{root}{''.join(reversed(self.where))}: {self.reason}")


def encode(message: object) -> list[bytes | memoryview]:
    """Frames for one registered dataclass: the msgpack header, then one frame per tensor,
    ndarray or large bytes value, in the order the header references them."""
    cls = type(message)
    if cls not in _fields:
        raise WireError(f"cannot encode type {_name(cls)}: a message is a dataclass registered "
                        "with wire.register")
    tag = _tags[cls]
    frames: list[bytes | memoryview] = [b""]
    try:
        fields = _enc_fields(message, _fields[cls], frames)
    except _Refused as refused:
        raise refused.error(tag) from None
    except RecursionError:
        raise WireError(f"{tag}: nested too deeply (or a value contains itself)") from None
    try:
        frames[0] = msgpack.packb([tag, fields], use_bin_type=True)
    except (OverflowError, ValueError, TypeError) as exc:  # an int beyond 64 bits
        raise WireError(f"{tag}: the header cannot be packed: {exc}") from None
    return frames


def _enc_fields(value: object, names: tuple[str, ...], frames: list) -> list:
    out = []
    for name in names:
        v = getattr(value, name)
        if type(v) in _PLAIN:
            out.append(v)
            continue
        try:
            out.append(_enc(v, frames))
        except _Refused as refused:
            refused.where.append(f".{name}")
            raise
    return out


def _enc_items(items: list | tuple, frames: list) -> list:
    if all(type(v) in _PLAIN for v in items):  # token ids and the like: as they are
        return items if type(items) is list else list(items)
    out = []
    for i, v in enumerate(items):
        try:
            out.append(_enc(v, frames))
        except _Refused as refused:
            refused.where.append(f"[{i}]")
            raise
    return out


def _enc(value: Any, frames: list[bytes | memoryview]) -> Any:
    kind = type(value)
    if kind in _PLAIN:
        return value
    tag = _tags.get(kind)
    if tag is not None:
        return _enc_registered(value, kind, tag, frames)
    encode = _ENCODERS.get(kind)
    if encode is not None:
        return encode(value, frames)
    if isinstance(value, torch.Tensor):
        return _enc_tensor(value, frames)
    return _enc_other(value, kind)


def _enc_registered(value: Any, kind: type, tag: str, frames: list) -> list:
    """A registered dataclass (its fields) or Enum (its value)."""
    names = _fields.get(kind)
    if names is not None:
        return [_DATACLASS, tag, _enc_fields(value, names, frames)]
    v = value._value_
    if type(v) in _PLAIN:
        return [_ENUM, tag, v]
    try:
        return [_ENUM, tag, _enc(v, frames)]
    except _Refused as refused:
        refused.where.append(".value")
        raise


def _enc_bytes(value: bytes | bytearray, frames: list) -> Any:
    """Small ones in the header; from BYTES_FRAME_MIN on, a frame of their own (no copy)."""
    if len(value) < BYTES_FRAME_MIN:
        return bytes(value)
    frames.append(value)
    return [_BYTES, len(frames) - 1]


def _enc_dict(value: dict, frames: list) -> dict:
    out = {}
    for key, v in value.items():
        if type(key) not in (str, int):
            raise _Refused(f"cannot encode a dict key of type {_name(type(key))} (keys are "
                           "str or int)")
        try:
            out[key] = _enc(v, frames)
        except _Refused as refused:
            refused.where.append(f"[{key!r}]")
            raise
    return out


def _enc_other(value: Any, kind: type) -> Any:
    """What no encoder is registered for: a subclass of a plain type as that type; else why
    it cannot go."""
    if isinstance(value, enum.Enum):
        raise _Refused(f"cannot encode type {_name(kind)} (an Enum not registered with "
                       "wire.register)")
    for base in (bool, int, float, str):  # a subclass of a plain type (np.float64...): as it
        if isinstance(value, base):
            return base(value)
    if dataclasses.is_dataclass(value):
        raise _Refused(f"cannot encode type {_name(kind)} (a dataclass not registered with "
                       "wire.register)")
    raise _Refused(f"cannot encode type {_name(kind)}")


def _enc_tensor(t: torch.Tensor, frames: list[bytes | memoryview]) -> list:
    if t.device.type != "cpu":
        raise _Refused(f"a tensor on {t.device} cannot be sent; move it to the CPU first "
                       "(.cpu()): the wire carries host memory only")
    if t.layout != torch.strided:
        raise _Refused(f"cannot encode a {t.layout} tensor (only dense ones)")
    name = _TORCH_NAMES.get(t.dtype)
    if name is None:
        raise _Refused(f"cannot encode a tensor of dtype {t.dtype}")
    # Copies only where it must: a non-contiguous tensor (or one with its conj/neg bit set) is
    # made contiguous first; a contiguous one is sent from its own storage.
    t = t.detach().resolve_conj().resolve_neg().contiguous()
    # Bytes as uint8 through numpy: zero-copy, and also for the dtypes numpy lacks (bfloat16).
    frames.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return [_TENSOR, name, list(t.shape), len(frames) - 1]


def _enc_ndarray(a: np.ndarray, frames: list[bytes | memoryview]) -> list:
    if a.dtype.kind not in _NUMPY_KINDS or a.dtype.fields is not None:
        raise _Refused(f"cannot encode an ndarray of dtype {a.dtype}")
    if not a.flags.c_contiguous:
        a = a.copy(order="C")  # (not np.ascontiguousarray: it makes a 0-d array 1-d)
    frames.append(memoryview(a.reshape(-1).view(np.uint8)))
    return [_NDARRAY, a.dtype.str, list(a.shape), len(frames) - 1]


# By exact type (a subclass takes the slower path of _enc_other, as before).
_ENCODERS: dict[type, Callable[[Any, list], Any]] = {
    list: lambda v, frames: [_LIST, _enc_items(v, frames)],
    tuple: lambda v, frames: [_TUPLE, _enc_items(v, frames)],
    bytes: _enc_bytes,
    bytearray: _enc_bytes,
    dict: _enc_dict,
    np.ndarray: _enc_ndarray,
}


def _name(cls: type) -> str:
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


# --- decode ----------------------------------------------------------------------------------
_DECODED_PLAIN = _PLAIN | {bytes}


def decode(frames: Sequence[bytes | memoryview | zmq.Frame]) -> object:
    """The message `encode` made these frames from.

    Tensors and ndarrays are views of their frame where they can be: zero-copy from a writable
    buffer (what pyzmq's `recv_multipart(copy=False)` gives). A read-only buffer (bytes) is
    copied once into a bytearray, as torch has no read-only tensors (an ndarray of one is simply
    read-only); a tensor whose frame is not aligned to its element size (small frames inside
    zmq's receive buffer can be) is copied once into aligned memory. Large bytes values are
    copied once into a bytes object.
    """
    if not frames:
        raise WireError("no frames")
    try:
        header = msgpack.unpackb(_buffer(frames[0], 0), raw=False, strict_map_key=False)
    except _Refused as refused:
        raise WireError(refused.reason) from None
    except Exception as exc:  # msgpack's own errors are many: any of them is a bad header
        raise WireError(f"the header is not msgpack: {exc}") from None
    if not (isinstance(header, list) and len(header) == 2 and type(header[0]) is str):
        raise WireError("malformed header: not [tag, fields]")
    tag, fields = header
    reader = _Reader(frames)
    try:
        message = reader.dataclass(tag, fields)
    except _Refused as refused:
        raise refused.error(tag) from None
    except RecursionError:
        raise WireError(f"{tag}: nested too deeply") from None
    except (TypeError, ValueError, KeyError, IndexError, OverflowError, RuntimeError) as exc:
        raise WireError(f"{tag}: malformed: {exc}") from None
    if len(reader.used) != len(frames) - 1:
        raise WireError(f"{tag}: frame count mismatch: {len(frames)} frames, the header uses "
                        f"{len(reader.used) + 1}")
    return message


def _buffer(frame: object, index: int) -> memoryview:
    """A frame as a flat memoryview of bytes (zmq.Frame, bytes, bytearray, memoryview...)."""
    try:
        view = memoryview(frame)  # type: ignore[arg-type]
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
    except (TypeError, ValueError) as exc:
        raise _Refused(f"frame {index} is not a contiguous buffer: {exc}") from None
    return view


class _Reader:
    """Rebuilds values from the header; refuses (_Refused) anything encode would not make."""

    def __init__(self, frames: Sequence[object]) -> None:
        self.frames = frames
        self.used: set[int] = set()

    def dataclass(self, tag: object, fields: object) -> object:
        cls = self._class(tag)
        names = _fields.get(cls)
        if names is None:
            raise _Refused(f"tag {tag!r} is not a dataclass")
        if type(fields) is not list or len(fields) != len(names):
            got = len(fields) if type(fields) is list else type(fields).__name__
            raise _Refused(f"{tag} has {len(names)} fields, the header {got}")
        values = []
        for name, v in zip(names, fields, strict=True):
            if type(v) in _DECODED_PLAIN:
                values.append(v)
                continue
            try:
                values.append(self.value(v))
            except _Refused as refused:
                refused.where.append(f".{name}")
                raise
        # As pickle does: the fields are set as they were sent, __init__/__post_init__ not run
        # (init=False fields keep the sender's value; frozen dataclasses work the same).
        message = object.__new__(cls)
        state = getattr(message, "__dict__", None)
        if state is not None:
            state.update(zip(names, values, strict=True))
        else:  # __slots__
            for name, v in zip(names, values, strict=True):
                object.__setattr__(message, name, v)
        return message

    def items(self, items: list) -> list:
        if all(type(x) in _DECODED_PLAIN for x in items):
            return items
        out = []
        for i, x in enumerate(items):
            try:
                out.append(self.value(x))
            except _Refused as refused:
                refused.where.append(f"[{i}]")
                raise
        return out

    def value(self, v: Any) -> Any:
        kind = type(v)
        if kind in _DECODED_PLAIN:
            return v
        if kind is dict:
            return self._dict(v)
        if kind is not list or not v or type(v[0]) is not int:
            raise _Refused(f"malformed value of type {kind.__name__}")
        marker = v[0]
        decode = self._DECODERS.get(marker)
        if decode is None:
            raise _Refused(f"unknown value kind {marker}" if marker > _BYTES or marker < 0
                           else "malformed value")
        return decode(self, v)

    def _dict(self, v: dict) -> dict:
        out = {}
        for key, x in v.items():
            if type(key) not in (str, int):
                raise _Refused("malformed dict (keys are str or int)")
            try:
                out[key] = self.value(x)
            except _Refused as refused:
                refused.where.append(f"[{key!r}]")
                raise
        return out

    # Each kind of list: [marker, ...] of the length and types encode makes, else malformed.

    def _dataclass_value(self, v: list) -> object:
        if len(v) != 3:
            raise _Refused("malformed value")
        return self.dataclass(v[1], v[2])

    def _enum_value(self, v: list) -> enum.Enum:
        if len(v) != 3:
            raise _Refused("malformed value")
        cls = self._class(v[1])
        if not issubclass(cls, enum.Enum):
            raise _Refused(f"tag {v[1]!r} is not an Enum")
        try:
            value = self.value(v[2])
        except _Refused as refused:
            refused.where.append(".value")
            raise
        member = cls._value2member_map_.get(value) if type(value) in _PLAIN else None
        if member is not None:  # (the lookup cls(value) starts with, without its overhead)
            return member
        try:
            return cls(value)
        except ValueError:
            raise _Refused(f"{value!r} is not a {v[1]}") from None

    def _sequence_value(self, v: list) -> list | tuple:
        if len(v) != 2 or type(v[1]) is not list:
            raise _Refused("malformed value")
        items = self.items(v[1])
        return items if v[0] == _LIST else tuple(items)

    def _array_value(self, v: list) -> object:
        if len(v) != 4 or type(v[1]) is not str or type(v[2]) is not list or \
                type(v[3]) is not int:
            raise _Refused("malformed value")
        return self._tensor(*v[1:]) if v[0] == _TENSOR else self._ndarray(*v[1:])

    def _bytes_value(self, v: list) -> bytes:
        if len(v) != 2 or type(v[1]) is not int:
            raise _Refused("malformed value")
        return bytes(self._frame(v[1]))

    _DECODERS: ClassVar[dict[int, Callable[[_Reader, list], Any]]] = {
        _DATACLASS: _dataclass_value, _ENUM: _enum_value, _LIST: _sequence_value,
        _TUPLE: _sequence_value, _TENSOR: _array_value, _NDARRAY: _array_value,
        _BYTES: _bytes_value,
    }

    def _class(self, tag: object) -> type:
        cls = _classes.get(tag) if type(tag) is str else None
        if cls is None:
            raise _Refused(f"unknown tag {tag!r} (not registered in this process)")
        return cls

    def _frame(self, index: int) -> memoryview:
        if not 1 <= index < len(self.frames) or index in self.used:
            raise _Refused(f"frame count mismatch: frame {index} of {len(self.frames)} is "
                           "missing or used twice")
        self.used.add(index)
        return _buffer(self.frames[index], index)

    @staticmethod
    def _shape(shape: list, itemsize: int, view: memoryview) -> tuple[int, ...]:
        if not all(type(n) is int and n >= 0 for n in shape):
            raise _Refused(f"malformed shape {shape!r}")
        if math.prod(shape) * itemsize != view.nbytes:
            raise _Refused(f"shape {shape} needs {math.prod(shape) * itemsize} bytes, the frame "
                           f"has {view.nbytes}")
        return tuple(shape)

    def _tensor(self, name: str, shape: list, index: int) -> torch.Tensor:
        dtype = _TORCH_DTYPES.get(name)
        if dtype is None:
            raise _Refused(f"unknown tensor dtype {name!r}")
        view = self._frame(index)
        size = self._shape(shape, dtype.itemsize, view)
        if view.nbytes == 0:
            return torch.empty(size, dtype=dtype)  # torch.frombuffer refuses empty buffers
        buffer: memoryview | bytearray = view
        if view.readonly:  # torch has no read-only tensors: one copy, and no warning
            buffer = bytearray(view)
        t = torch.frombuffer(buffer, dtype=dtype)
        if t.data_ptr() % dtype.itemsize:
            t = t.clone()  # an unaligned frame: kernels may assume aligned elements
        return t.reshape(size)

    def _ndarray(self, name: str, shape: list, index: int) -> np.ndarray:
        try:
            dtype = np.dtype(name)
        except (TypeError, ValueError):
            raise _Refused(f"unknown ndarray dtype {name!r}") from None
        if dtype.kind not in _NUMPY_KINDS or dtype.fields is not None:
            raise _Refused(f"refused ndarray dtype {name!r}")
        view = self._frame(index)
        size = self._shape(shape, dtype.itemsize, view)
        return np.frombuffer(view, dtype=dtype).reshape(size)
