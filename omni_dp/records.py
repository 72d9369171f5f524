"""One way a record crosses a file or a process: its JSON is derived from its fields.

A record is a frozen dataclass deriving from `Record`; its `to_json` (`encode`) turns it into
JSON-ready builtins and its `from_json` (`decode`) builds it back, every field's type checked by
msgspec (enums by value, tuples from lists, a bool is no integer), so no record spells its keys
out by hand and no field can be read into another's place. A record whose JSON is not simply
its fields — a key renamed, a process identity written into the record's own object, a key
left out while null, a key older files lack — says how in a `Shape` (its class attribute
`JSON_SHAPE`): files written before still read, and are written as they were. A record's own
checks are its __post_init__, run as it is built and as it is read.

A record msgspec built keeps a field left at its default on the class, not in the instance's
__dict__: read fields by attribute (dataclasses.asdict, replace), never through vars().

What does not parse is a `Malformed` naming the key in the JSON document, in the words of the
documents' readers: "replicas[1] has no 'port'", "created_at is a string, not a number".
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")


class Malformed(ValueError):
    """A field that is missing or of the wrong type; the message names it."""


@dataclass(frozen=True)
class Shape:
    """How a record's JSON differs from its fields."""

    keys: Mapping[str, str] = field(default_factory=dict)  # field -> its key in the JSON
    # fields whose own record's keys are written into this object (a process identity:
    # "pid", "create_time"); an optional one reads as None while any of its keys is null
    flat: tuple[str, ...] = ()
    omit_none: tuple[str, ...] = ()  # keys left out while None (absent in older files)
    # keys left out while their field holds its default (absent in older files, read as it):
    # a file of before is written back as it was
    omit_default: tuple[str, ...] = ()
    absent: Mapping[str, Any] = field(default_factory=dict)  # key -> its value when absent
    null_is_absent: tuple[str, ...] = ()  # keys whose null reads as if they were absent
    # older layouts made current before the fields are read, and the layout written
    read: Callable[[dict], dict] | None = None
    write: Callable[[dict], dict] | None = None
    # field -> its place in the JSON, where that is not a key of the record's object
    # ("mps.daemons"); the messages name it so
    paths: Mapping[str, str] = field(default_factory=dict)


PLAIN = Shape()


class Hex(bytes):
    """Bytes a record holds as a hex string in its JSON (a CUDA IPC handle): JSON has no bytes,
    and hex is what a person reading the file can compare."""


def _encode_hook(value: Any) -> Any:
    if isinstance(value, Hex):
        return value.hex()
    raise NotImplementedError(type(value).__name__)


def _decode_hook(kind: type, value: Any) -> Any:
    if kind is object:  # a free-form value (PlanRecord.options): as JSON has it
        return value
    if kind is Hex:
        if not isinstance(value, str):
            raise ValueError(f"is {json_kind(value)}, not a hex string")
        try:
            return Hex(bytes.fromhex(value))
        except ValueError:
            raise ValueError("is not hex") from None
    raise NotImplementedError(kind.__name__)


def _shape(cls: type) -> Shape:
    return getattr(cls, "JSON_SHAPE", PLAIN)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _record_type(hint: Any) -> tuple[type | None, bool]:
    """The record type a field holds (T, T | None, tuple[T, ...]), and whether as a list."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        found = [_record_type(a) for a in typing.get_args(hint) if a is not type(None)]
        return found[0] if len(found) == 1 else (None, False)
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis and dataclasses.is_dataclass(args[0]):
            return args[0], True
        return None, False
    return (hint, False) if dataclasses.is_dataclass(hint) else (None, False)


def _optional(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and \
        type(None) in typing.get_args(hint)


def _children(cls: type, data: dict, each: Callable[[type, Any], Any]) -> None:
    """Apply `each` to every nested record of `data` (in its fields' layout), in place."""
    for name, hint in _hints(cls).items():
        kind, many = _record_type(hint)
        value = data.get(name)
        if kind is None or value is None:
            continue
        if many and isinstance(value, (list, tuple)):
            data[name] = [each(kind, item) for item in value]
        elif not many:
            data[name] = each(kind, value)


def _to_fields(cls: type, data: Any) -> Any:
    """A record's JSON in its fields' layout, nested records included."""
    if not isinstance(data, Mapping):
        return data  # msgspec names it: "is a list, not an object"
    shape, data = _shape(cls), dict(data)
    if shape.read:
        data = shape.read(data)
    for key in shape.null_is_absent:
        if data.get(key) is None:
            data.pop(key, None)
    for key, value in shape.absent.items():
        data.setdefault(key, value)
    for name, key in shape.keys.items():
        if key in data:
            data[name] = data.pop(key)
    hints = _hints(cls)
    for name in shape.flat:
        kind, _ = _record_type(hints[name])
        assert kind is not None
        inner = {f.name: data.pop(f.name) for f in dataclasses.fields(kind) if f.name in data}
        none = any(inner.get(f.name) is None for f in dataclasses.fields(kind))
        data[name] = None if none and _optional(hints[name]) else inner
    _children(cls, data, _to_fields)
    return data


def _from_fields(cls: type, data: Any) -> Any:
    """The JSON of a record from its fields' layout (msgspec's builtins), nested ones too."""
    _children(cls, data, _from_fields)
    shape = _shape(cls)
    for name in shape.flat:
        data = _flattened(data, name, _record_type(_hints(cls)[name])[0])
    for name in shape.omit_none:
        if data.get(name) is None:
            data.pop(name, None)
    for name in shape.omit_default:
        if name in data and data[name] == _default(cls, name):
            data.pop(name)
    data = {shape.keys.get(name, name): value for name, value in data.items()}
    return shape.write(data) if shape.write else data


def _default(cls: type, name: str) -> Any:
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def _flattened(data: dict, name: str, kind: Any) -> dict:
    """`data` with field `name`'s record written in its place, key by key (null when None)."""
    inner = data[name] or dict.fromkeys(f.name for f in dataclasses.fields(kind))
    out: dict = {}
    for key, value in data.items():
        out.update(inner if key == name else {key: value})
    return out


def _plain(value: Any) -> Any:
    """A record as dicts and lists, field by field through getattr: a record msgspec built
    keeps a default on the class, not in its __dict__, which msgspec's encoder reads (it would
    drop the field); and JSON reads a tuple back as a list, a mapping as a dict."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def encode(record: Any) -> dict:
    """The record's JSON: builtins json.dumps writes (enums by value, Hex as hex)."""
    return _from_fields(type(record), msgspec.to_builtins(_plain(record),
                                                          enc_hook=_encode_hook))


def decode(data: Any, cls: type[T], where: str = "") -> T:
    """The record of parsed JSON; Malformed naming what is wrong (`where`: the record's place
    in its document, "plan", for the message). A record's own checks (its __post_init__, which
    msgspec runs) raise ValueError(".key is …") for one of its keys, or ValueError("…") for
    the record as a whole; the message is placed at the record's path in the document."""
    try:
        return msgspec.convert(_to_fields(cls, data), cls, strict=True, dec_hook=_decode_hook)
    except msgspec.ValidationError as exc:
        raise Malformed(_message(cls, str(exc), where)) from None


# --- the messages -----------------------------------------------------------------------------

_KINDS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "a boolean",
          "array": "a list", "object": "an object", "null": "null", "bytes": "a string"}
_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_SEGMENT = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, as the messages say it: "a list", "null"."""
    names = ((bool, "bool"), (int, "int"), (float, "float"), (str, "str"), (list, "array"),
             (dict, "object"), (type(None), "null"))
    return next((_KINDS[n] for t, n in names if isinstance(value, t)), type(value).__name__)


def _kinds(spelled: str) -> str:
    return " or ".join(_KINDS.get(k.strip("` "), k.strip("` ")) for k in spelled.split("|"))


def _walk(cls: Any, segments: list[str]) -> tuple[str, Any]:
    """The JSON path of a path in the fields' layout, and the type found there."""
    path, hint = "", cls
    for segment in segments:
        kind, _ = _record_type(hint)
        if segment.isdigit() or segment == "...":
            path += f"[{segment}]" if segment.isdigit() else ""
            hint = _item(hint)
            continue
        if kind is None:
            path += f".{segment}"
            continue
        shape, hint = _shape(kind), _hints(kind).get(segment)
        if segment not in shape.flat:
            path += f".{shape.paths.get(segment) or shape.keys.get(segment, segment)}"
    return path.lstrip("."), hint


def _item(hint: Any) -> Any:
    kind, many = _record_type(hint)
    if many:
        return kind
    args = [a for a in typing.get_args(hint) if a is not type(None) and a is not Ellipsis]
    return args[-1] if args else None


def _allowed(hint: Any) -> list[str]:
    """The values an enum or a Literal (or either | None) allows, as JSON spells them."""
    for a in (hint, *typing.get_args(hint)):
        if isinstance(a, type) and issubclass(a, enum.Enum):
            return [str(m.value) for m in a]
        if typing.get_origin(a) is typing.Literal:
            return [str(v) for v in typing.get_args(a)]
    return []


def _message(cls: type, error: str, where: str) -> str:
    match = _AT.match(error)
    assert match is not None
    what = match["what"]
    raw = match["path"] or ""
    segments = [a or b for a, b in _SEGMENT.findall(raw)]
    path, hint = _walk(cls, segments)
    if raw.endswith("[...]"):
        path = f"a value of {path}"
    path = ".".join(p for p in (where, path) if p) or ""
    at = path or "the top level"
    if missing := re.match(r"Object missing required field `(.+)`", what):
        return f"{at} has no {missing[1]!r}"
    if expected := re.match(r"Expected `(.+)`, got `(.+)`", what):
        return f"{at} is {_kinds(expected[2])}, not {_kinds(expected[1])}"
    if bad := re.match(r"Invalid enum value (.+)", what):
        allowed = _allowed(hint)
        return f"{at} is {bad[1]}" + (f", not one of {', '.join(allowed)}" if allowed else "")
    if not path:
        return what.lstrip(".")
    if what.startswith("."):
        return f"{path}{what}"
    return f"{at} {what}" if what.startswith("is ") else f"{at}: {what}"


class Record:
    """A record's one encode/decode pair, derived from its fields (a frozen dataclass that
    derives from this writes no to_json or from_json of its own)."""

    def to_json(self) -> dict:
        return encode(self)

    @classmethod
    def from_json(cls: type[T], data: Any, where: str = "") -> T:
        return decode(data, cls, where)
