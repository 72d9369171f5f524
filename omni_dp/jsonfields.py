"""Reading a JSON document field by field, each field's JSON type checked, before any of it is
used: a state file omni-dp reads back (run.json; soon a weight-share manifest) is input like any
other, and a wrong one must be a message naming the field, never a KeyError or a half-used file.

Hand-written on purpose: a validation library (pydantic, msgspec) would be a dependency larger
than the launcher for a dozen flat records, and this is imported on the launcher's path, which
starts in well under a second.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omni_dp.procs import ProcessIdentity
from omni_dp.records import Malformed

REQUIRED: Any = object()
_JSON_KINDS = ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
               (list, "a list"), (dict, "an object"))


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return next((name for kind, name in _JSON_KINDS if isinstance(value, kind)),
                type(value).__name__)


class JsonFields:
    """One JSON object, read field by field: each accessor checks the JSON type,
    and `where` ("replicas[1].processes[0]") names the object in what it raises."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, Mapping):
            raise Malformed(f"{where or 'the top level'} is {_kind(data)}, not an object")
        self.data, self.where = data, where  # where: "" for the top level

    def path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def _get(self, key: str, default: Any) -> Any:
        if key in self.data:
            return self.data[key]
        if default is REQUIRED:
            raise Malformed(f"{self.where or 'the top level'} has no {key!r}")
        return default

    def _bad(self, key: str, value: Any, expected: str) -> Malformed:
        return Malformed(f"{self.path(key)} is {_kind(value)}, not {expected}")

    def _check(self, key: str, value: Any, ok: bool, expected: str, optional: bool) -> Any:
        if value is None and optional:
            return None
        if not ok:
            raise self._bad(key, value, expected + (" or null" if optional else ""))
        return value

    def str(self, key: str, default: Any = REQUIRED, *, optional: bool = False) -> Any:
        value = self._get(key, default)
        return self._check(key, value, isinstance(value, str), "a string", optional)

    def int(self, key: str, default: Any = REQUIRED, *, optional: bool = False) -> Any:
        value = self._get(key, default)
        ok = isinstance(value, int) and not isinstance(value, bool)
        return self._check(key, value, ok, "an integer", optional)

    def number(self, key: str, default: Any = REQUIRED, *, optional: bool = False) -> Any:
        """int or float, kept as written (a round trip changes no byte of run.json)."""
        value = self._get(key, default)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return self._check(key, value, ok, "a number", optional)

    def bool(self, key: str, default: Any = REQUIRED, *, optional: bool = False) -> Any:
        value = self._get(key, default)
        return self._check(key, value, isinstance(value, bool), "a boolean", optional)

    def strings(self, key: str, default: Any = REQUIRED) -> tuple[str, ...]:
        value = self._get(key, default)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise self._bad(key, value, "a list of strings")
        return tuple(value)

    def numbers(self, key: str, default: Any = REQUIRED) -> tuple[float, ...]:
        value = self._get(key, default)
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            raise self._bad(key, value, "a list of numbers")
        return tuple(value)

    def items(self, key: str, default: Any = REQUIRED) -> list[JsonFields]:
        """A list of objects."""
        value = self._get(key, default)
        if not isinstance(value, (list, tuple)):
            raise self._bad(key, value, "a list")
        return [JsonFields(item, f"{self.path(key)}[{i}]") for i, item in enumerate(value)]

    def object(self, key: str, *, optional: bool = False) -> JsonFields | None:
        """A nested object; with optional, None when it is absent or null."""
        value = self._get(key, None if optional else REQUIRED)
        if value is None and optional:
            return None
        return JsonFields(value, self.path(key))

    def string_map(self, key: str) -> dict[str, str]:
        value = self._get(key, REQUIRED)
        if not isinstance(value, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise self._bad(key, value, "an object of strings")
        return dict(value)

    def identity(self) -> ProcessIdentity:
        """A recorded process: pid + create time, both required."""
        return ProcessIdentity(self.int("pid"), self.number("create_time"))

    def maybe_identity(self) -> ProcessIdentity | None:
        """pid + create time; None until the process was started (either is null)."""
        pid = self.int("pid", None, optional=True)
        created = self.number("create_time", None, optional=True)
        return None if pid is None or created is None else ProcessIdentity(pid, created)
