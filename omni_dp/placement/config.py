"""A placement request from three layers: the defaults, a YAML file, then dotted CLI overrides.

Every value keeps the provenance of the layer that set it last, so the resolved table can say
where each one came from; every problem of every layer is reported at once, each naming the key
as the user wrote it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_dp.placement.model import (
    MAX_CPU_DEVICE_MEMORY_BYTES,
    MAX_REPLICAS,
    MAX_TP_SIZE,
    PipelineSpec,
    PlacementConfig,
    PlacementError,
    PlacementRequest,
    Provenance,
    Source,
    StageConfig,
)
from omni_dp.sizes import parse_size
from omni_dp.yamlconfig import StrictYAMLError, brief, clip, load_strict

PLACEMENT = "placement"  # the top-level key (and CLI prefix) of the placement-wide fields
MAX_FILE_BYTES = 1024**2  # a placement file is a few lines; /dev/zero must not fill memory
# Matched whole (fullmatch: `$` would let "t\n" through). [0-9], never \d or str.isdigit(): those
# take '²' and '٣', which int() and float() then read (or refuse with a traceback).
_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # no dots: a dot separates the keys of a flag
_GPU_RE = re.compile(r"(?:cuda:)?([0-9]{1,6})")
_INT_RE = re.compile(r"\s*([+-]?)0*([0-9]+)\s*")
_NUMBER_RE = re.compile(r"\s*[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\s*")
_GPU_INDEX_LIMIT = 10**6  # a GPU index has at most 6 digits (no machine has a million GPUs)


@dataclass(frozen=True)
class _Setting:
    """One value as a layer gave it, and how to name it in a problem."""

    owner: str  # a stage name or PLACEMENT, as written
    name: str  # the field, as written
    raw: Any  # a string from the CLI; any YAML value from a file
    provenance: Provenance
    label: str  # the key as written: "--talker.tp_size" or "FILE: talker.tp_size"
    place: str  # where it was written: "--talker.tp_size" or "FILE"

    @property
    def field(self) -> str:
        return self.name.replace("-", "_")  # --talker.gpu-memory-fraction reads as well


# --- the value parsers: each raises ValueError("what it must be") ---------------------------
def _process(value: Any) -> str:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise ValueError("a process name of 1-64 letters, digits, '_' and '-'")
    return value


def _parse_device(value: Any, *, auto: bool) -> str:
    """cpu | a GPU index (cuda:N accepted, normalised to N) | auto where allowed."""
    forms = "auto, cpu or a GPU index (0, cuda:0)" if auto else "cpu or a GPU index (0, cuda:0)"
    if isinstance(value, int) and not isinstance(value, bool):  # YAML `device: 0`
        if not 0 <= value < _GPU_INDEX_LIMIT:  # str() of a 5,000-digit int would raise
            raise ValueError(forms)
        return str(value)
    if not isinstance(value, str):
        raise ValueError(forms)
    text = value.strip()
    if text == "cpu" or (auto and text == "auto"):
        return text
    match = _GPU_RE.fullmatch(text)
    if match is None:
        raise ValueError(forms)
    return str(int(match.group(1)))


def _device(value: Any) -> str:
    return _parse_device(value, auto=True)


def _devices(value: Any) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    expected = "a list of devices, each cpu or a GPU index (0,1 or cpu,cpu)"
    if not isinstance(items, list):
        raise ValueError(expected)
    try:
        return tuple(_parse_device(item, auto=False) for item in items)
    except ValueError:
        raise ValueError(expected) from None


def _fraction(value: Any) -> float:
    number = float("nan")
    if isinstance(value, str) and not _NUMBER_RE.fullmatch(value):
        pass  # float() reads '٠.٥', '1_0' and 'nan' too: none of them is written here
    elif isinstance(value, (str, int, float)) and not isinstance(value, bool):
        with contextlib.suppress(OverflowError):  # 10**400
            number = float(value)
    if not 0 < number <= 1:  # nan fails too
        raise ValueError("a number in (0, 1]")
    return number


def _optional_fraction(value: Any) -> float | None:
    return None if value is None else _fraction(value)  # YAML null: undeclared


def _count(value: Any, *, most: int) -> int:
    """An integer 1..most: from the CLI, ASCII digits (an optional sign); from YAML, an int."""
    if isinstance(value, str):
        match = _INT_RE.fullmatch(value)
        if match is None:
            raise ValueError(f"an integer 1-{most}")
        sign, digits = match.groups()
        if len(digits) > len(str(most)):  # int() refuses 4,301 digits (zeros too), by traceback
            raise ValueError(f"1-{most}")
        value = int(sign + digits)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"an integer 1-{most}")
    if not 1 <= value <= most:
        raise ValueError(f"1-{most}")
    return value


def _fused(value: Any) -> tuple[tuple[str, ...], ...]:
    """YAML [[talker, vocoder]]; CLI 'talker,vocoder' (groups separated by ';', '' for none)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return ()
    if isinstance(value, str):
        value = [group.split(",") for group in value.split(";")]
    expected = "a list of stage groups, e.g. [[talker, vocoder]] (CLI: talker,vocoder)"
    if not isinstance(value, list) or not all(isinstance(g, list) for g in value):
        raise ValueError(expected)
    if not all(isinstance(s, str) and s.strip() for g in value for s in g):
        raise ValueError(expected)
    return tuple(tuple(s.strip() for s in group) for group in value)


def _size(value: Any) -> int | None:
    """A size from 1 byte to 1 EiB (None: undeclared); 0 is no size, not "the host's"."""
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, (str, int))
            or (isinstance(value, str) and not value.isascii())):  # parse_size reads '٣' too
        raise ValueError("a size, e.g. 8GiB")
    try:
        size = parse_size(value)
    except ValueError:
        raise ValueError("a size, e.g. 8GiB") from None
    if not 1 <= size <= MAX_CPU_DEVICE_MEMORY_BYTES:
        raise ValueError("a size of 1 byte to 1 EiB (2**60 bytes), e.g. 8GiB")
    return size


Parser = Callable[[Any], Any]
STAGE_FIELDS: dict[str, Parser] = {
    "process": _process,
    "device": _device,
    "gpu_memory_fraction": _optional_fraction,
    "tp_size": functools.partial(_count, most=MAX_TP_SIZE),
    "devices": _devices,
    "replicas": functools.partial(_count, most=MAX_REPLICAS),
}
PLACEMENT_FIELDS: dict[str, Parser] = {
    "max_total_gpu_memory_fraction_per_gpu": _fraction,
    "fused_stages": _fused,
    "cpu_device_memory_bytes": _size,
}


# --- names -----------------------------------------------------------------------------------
def suggestion(name: str, valid: Sequence[str], kind: str) -> str:
    """'; did you mean X?' for a near miss, else the valid names: either way the fix is shown."""
    close = difflib.get_close_matches(name, valid, n=1) or [  # `fused` → fused_stages too
        v for v in valid if len(name) >= 3 and name in v]
    return f"; did you mean {close[0]!r}?" if close else f"; the {kind} are {', '.join(valid)}"


def _owners(pipeline: PipelineSpec) -> list[str]:
    return [stage.name for stage in pipeline.stages] + [PLACEMENT]


def _owner_problem(pipeline: PipelineSpec, owner: str, place: str) -> str | None:
    if owner in _owners(pipeline):
        return None
    return (f"unknown stage {brief(owner)} in {place}"
            + suggestion(owner, _owners(pipeline), f"keys of {pipeline.name}'s placement"))


def _fields_of(owner: str) -> dict[str, Parser]:
    return PLACEMENT_FIELDS if owner == PLACEMENT else STAGE_FIELDS


def _field_problem(setting: _Setting) -> str | None:
    fields = _fields_of(setting.owner)
    if setting.field in fields:
        return None
    whose = PLACEMENT if setting.owner == PLACEMENT else f"stage {setting.owner}"
    return (f"unknown field {brief(setting.name)} of {whose} in {setting.place}"
            + suggestion(setting.field, list(fields), "fields"))


# --- the layers ------------------------------------------------------------------------------
def split_overrides(args: Sequence[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """The (dotted key, raw value) pairs of `--a.b v` / `--a.b=v` among click's leftover args,
    and the other args, in order, for the caller to report."""
    pairs: list[tuple[str, str]] = []
    rest: list[str] = []
    problems: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        key, equals, value = arg[2:].partition("=")
        i += 1
        if not arg.startswith("--") or "." not in key:
            rest.append(arg)
        elif equals:
            pairs.append((key, value))
        elif i < len(args) and not args[i].startswith("--"):
            pairs.append((key, args[i]))
            i += 1
        else:
            problems.append(f"--{key} needs a value: --{key} VALUE or --{key}=VALUE")
    if problems:
        raise PlacementError(problems)
    return pairs, rest


def _cli_setting(key: str, raw: str) -> _Setting:
    owner, _, name = key.partition(".")
    flag = f"--{key}"
    shown = clip(flag)  # an unknown key's flag may be long; a known one is short
    return _Setting(owner, name, raw, Provenance(Source.CLI, flag), shown, shown)


def _read_yaml(path: Path, problems: list[str]) -> Any:
    """The file's document, or None with the problem appended (nothing raised)."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        problems.append(f"{path}: cannot read it ({getattr(exc, 'strerror', None) or exc})")
        return None
    if len(data) > MAX_FILE_BYTES:
        problems.append(f"{path}: larger than 1 MiB; a placement file is a few lines of YAML")
        return None
    try:
        return load_strict(data.decode("utf-8-sig"), str(path), what="a placement file",
                           shape="a placement file maps stages to fields of plain values or "
                                 "lists")
    except UnicodeDecodeError:
        problems.append(f"{path}: not UTF-8 text; a placement file is YAML")
    except StrictYAMLError as exc:  # names the path and the line
        problems.append(str(exc))
    return None


def _file_settings(pipeline: PipelineSpec, path: Path, problems: list[str]) -> list[_Setting]:
    document = _read_yaml(path, problems)
    if document is None:
        return []
    if not isinstance(document, dict):
        problems.append(f"{path}: the top level must be a mapping of stage names (and "
                        f"{PLACEMENT}) to their fields")
        return []
    provenance = Provenance(Source.FILE, str(path))
    settings = []
    for owner, fields in document.items():
        owner = _key(owner)
        problem = _owner_problem(pipeline, owner, str(path))
        if problem:
            problems.append(problem)
        elif not isinstance(fields, dict):
            problems.append(f"{path}: {owner} must be a mapping of field: value, got "
                            f"{type(fields).__name__} {brief(fields)}")
        else:
            settings += [_Setting(owner, _key(name), raw, provenance,
                                  f"{path}: {owner}.{clip(_key(name))}", str(path))
                         for name, raw in fields.items()]
    return _once_each(settings, problems)


def _key(key: Any) -> str:
    """A YAML key as a name: a string as written, anything else (1, null, 10**5000) briefly."""
    return key if isinstance(key, str) else brief(key)


def _once_each(settings: list[_Setting], problems: list[str]) -> list[_Setting]:
    """The file's settings, a field written twice (tp_size and tp-size) refused: YAML finds an
    exact key given twice, not two spellings of one field."""
    first: dict[tuple[str, str], str] = {}
    kept = []
    for setting in settings:
        written = first.setdefault((setting.owner, setting.field), setting.name)
        if written == setting.name:
            kept.append(setting)
        else:
            problems.append(f"{setting.place}: {setting.owner}.{clip(setting.field)} is set "
                            f"twice (as {brief(written)} and {brief(setting.name)}); keep one")
    return kept


_BAD = object()  # a setting whose key or value was refused (its problem is appended)


def _value(pipeline: PipelineSpec, setting: _Setting, problems: list[str]) -> Any:
    """The setting's parsed value, or _BAD with the problem appended."""
    problem = (_owner_problem(pipeline, setting.owner, setting.place)
               or _field_problem(setting))
    if problem is None:
        try:
            return _fields_of(setting.owner)[setting.field](setting.raw)
        except ValueError as exc:
            problem = f"{setting.label} must be {exc}, got {brief(setting.raw)}"
    problems.append(problem)
    return _BAD


def load_placement(pipeline: PipelineSpec, file: Path | None,
                   overrides: Sequence[tuple[str, str]]) -> PlacementRequest:
    """Defaults, then `file`, then `overrides` (from split_overrides): the last layer wins.
    Raises PlacementError with every problem of every layer."""
    problems: list[str] = []
    settings = _file_settings(pipeline, file, problems) if file is not None else []
    settings += [_cli_setting(key, raw) for key, raw in overrides]
    values: dict[str, dict[str, Any]] = {owner: {} for owner in _owners(pipeline)}
    provenance: dict[tuple[str, str], Provenance] = {}
    for setting in settings:
        value = _value(pipeline, setting, problems)
        if value is not _BAD:
            values[setting.owner][setting.field] = value
            provenance[(setting.owner, setting.field)] = setting.provenance
    if problems:
        raise PlacementError(problems)
    stages = {stage.name: dataclasses.replace(StageConfig(), **values[stage.name])
              for stage in pipeline.stages}
    placement = dataclasses.replace(PlacementConfig(), **values[PLACEMENT])
    return PlacementRequest(stages, placement, provenance)
