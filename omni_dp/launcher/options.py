"""What the user asked for: `omni-dp launch` flags and the `--config` YAML file, merged.

The YAML file holds the same settings as the flags (dashes or underscores); a flag given on the
command line wins over the file. Unknown keys and wrong types are problems, never ignored.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import yaml
import yaml.composer
import yaml.constructor
import yaml.reader

from omni_dp.sizes import parse_size

START_MODES = ("sequential", "parallel")
MPS_FAULT_ACTIONS = ("restart", "fail")


@dataclass(frozen=True)
class LaunchOptions:
    replicas: int = 1
    mps: bool = False
    gpu: str = "auto"  # auto | none | INDEX | GPU-UUID
    cpu_blocks: str = "auto"  # auto | none | "0-3 4-7 …"
    kv_cache_bytes: int | None = None
    max_total_tokens: int | None = None
    start: str | None = None  # None: parallel when every replica's KV is a fixed size
    host: str = "127.0.0.1"  # the router's address; replicas always listen on loopback
    router_port: int = 8000
    base_port: int = 8100
    policy: str = "least_request"
    router_workers: int = 1
    run_id: str | None = None
    detach: bool = False
    engine: str = "builtin"
    engine_args: tuple[str, ...] = ()
    mps_control: str | None = None
    no_gpu_check: bool = False  # --mps where NVML sees no GPU: exercises the daemon only
    memory_headroom: float = 0.05  # fraction of device memory kept free by the fit check
    health_timeout: float = 300.0  # per replica start, seconds
    drain_timeout: float = 30.0
    check_interval: float = 2.0  # supervision sweep
    health_failures: int = 3  # consecutive failed /health before a restart
    restart_budget: int = 5
    restart_window: float = 600.0
    on_mps_fault: str = "restart"
    # The router's API key; kept out of run.json, argv and repr (it goes by environment).
    api_key: str | None = field(default=None, repr=False)
    log_format: str = "text"  # text | json, for the launcher, supervisor, replicas and router
    config_file: str | None = field(default=None, compare=False)


FIELDS = {f.name: f for f in dataclasses.fields(LaunchOptions) if f.name != "config_file"}
# What a --config file may set: every launch flag's setting, and engine_args (what follows `--`).
# `engine` has no flag while there is one built-in engine; its key comes with the flag.
FILE_KEYS = {name for name in FIELDS if name != "engine"}
_SIZE_FIELDS = {"kv_cache_bytes"}
MAX_CONFIG_BYTES = 1024**2  # a settings file is a few lines; /dev/zero must not fill memory
# The deepest a setting nests is 2 (the top mapping, then the engine_args list); PyYAML's
# composer recurses per level, so an unbounded document would end in a RecursionError.
MAX_YAML_DEPTH = 8
_INT_LIMIT = 2**63  # larger integers are no setting's value (and overflow C on the way)


class _ConfigLoader(yaml.SafeLoader):
    """safe_load, refusing what it would accept silently or without bound: aliases (`*name`: a
    billion-laughs document expands exponentially) and nesting no setting has. Duplicate keys
    are found by load_config_file, which reads the top mapping key by key."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not supported in a --config file; write the "
                "value out", self.peek_event().start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested deeper than {MAX_YAML_DEPTH} levels; a setting is a "
                    "plain value or a list of them", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _dashed(name: str) -> str:
    return name.replace("_", "-")


def _coerce(name: str, value, problems: list[str], source: str):
    """A YAML value to the field's type, or a problem naming the key."""
    if value is None:
        return None
    expected = FIELDS[name].type
    try:
        if name in _SIZE_FIELDS:
            return parse_size(str(value))
        if name == "engine_args":
            if isinstance(value, str):
                value = value.split()
            if not (isinstance(value, list) and all(
                    isinstance(v, (str, int, float)) and not isinstance(v, bool)
                    for v in value)):
                raise ValueError("a list of strings")
            args = tuple(str(v) for v in value)
            if any("\0" in arg for arg in args):
                raise ValueError("a list of strings without NUL characters")
            return args
        if "bool" in expected:
            if not isinstance(value, bool):
                raise ValueError("true or false")
            return value
        if "int" in expected and "float" not in expected:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError("an integer")
            if abs(value) >= _INT_LIMIT:
                raise ValueError(f"an integer below 2**63 (this one has {value.bit_length()} "
                                 "bits)")
            return value
        if "float" in expected:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError("a number")
            try:
                number = float(value)
            except OverflowError:
                raise ValueError("a finite number (this integer is too large)") from None
            if not math.isfinite(number):
                raise ValueError(f"a finite number, got {number}")
            return number
        if isinstance(value, (dict, list, set)):
            raise ValueError("a string")
        text = str(value)
        if "\0" in text:
            raise ValueError("a string without NUL characters")
        return text
    except ValueError as exc:
        problems.append(f"{source}: {_dashed(name)} must be {exc}")
        return None


def _read_text(path: str, source: str, problems: list[str]) -> str | None:
    """The file as text, or None with the problem appended (nothing raised)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        problems.append(f"{source}: no such file")
        return None
    except IsADirectoryError:
        problems.append(f"{source}: is a directory; give the YAML file of settings")
        return None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        why = getattr(exc, "strerror", None) or str(exc)
        problems.append(f"{source}: cannot read it ({why})")
        return None
    if len(data) > MAX_CONFIG_BYTES:
        problems.append(f"{source}: is larger than {MAX_CONFIG_BYTES // 1024**2} MiB; a "
                        "settings file is a few lines of YAML")
        return None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        problems.append(f"{source}: is not UTF-8 text (byte {data[exc.start]:#04x} at offset "
                        f"{exc.start}); it must be a YAML file of settings")
        return None


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line: where in the file, and what is wrong there."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        what = exc.problem or exc.context or "not valid YAML"
        if isinstance(exc, yaml.constructor.ConstructorError):
            what += " (a --config file holds plain values: strings, numbers, true/false, lists)"
        return where + what
    if isinstance(exc, yaml.reader.ReaderError):
        return f"character {exc.position + 1}: {str(exc).splitlines()[0]}"
    return str(exc).splitlines()[0]


def load_config_file(path: str, problems: list[str]) -> dict:
    """The settings of a YAML file as field values; problems appended, nothing raised."""
    source = f"--config {path}"
    text = _read_text(path, source, problems)
    if text is None:
        return {}
    loader = None
    try:
        loader = _ConfigLoader(text)  # its reader refuses control characters at once
        root = loader.get_single_node()
        if root is None:
            return {}
        if not isinstance(root, yaml.MappingNode):
            problems.append(f"{source}: the top level must be a mapping of settings")
            return {}
        return _settings(loader, root, source, problems)
    except yaml.YAMLError as exc:
        problems.append(f"{source}: cannot read it as YAML: {_yaml_problem(exc)}")
        return {}
    finally:
        if loader is not None:
            loader.dispose()


def _settings(loader: _ConfigLoader, root: yaml.MappingNode, source: str,
              problems: list[str]) -> dict:
    """The top mapping key by key, so that a problem names its setting and line, and a key
    given twice is a problem (safe_load keeps the last one silently)."""
    values: dict = {}
    seen: dict[str, tuple[str, int]] = {}  # field name -> (key as written, line)
    for key_node, value_node in root.value:
        line = key_node.start_mark.line + 1
        if not isinstance(key_node, yaml.ScalarNode):
            kind = "list" if isinstance(key_node, yaml.SequenceNode) else "mapping"
            problems.append(f"{source}: line {line}: a setting's name must be a word, not a "
                            f"{kind}")
            continue
        key = key_node.value  # never constructed: a name is its text, whatever its tag
        name = key.replace("-", "_")
        if name in seen:
            first, first_line = seen[name]
            how = (f"lines {first_line} and {line}" if first == key else
                   f"as {first!r} and {key!r}")
            problems.append(f"{source}: {_dashed(name)} is set twice ({how}); keep one")
            values.pop(name, None)
            continue
        seen[name] = (key, line)
        if name not in FILE_KEYS:
            known = ", ".join(sorted(_dashed(n) for n in FILE_KEYS))
            shown = key if len(key) <= 60 else key[:57] + "..."
            problems.append(f"{source}: unknown setting {shown!r} (known: {known})")
            continue
        try:
            value = loader.construct_object(value_node, deep=True)
        except (yaml.YAMLError, ValueError, OverflowError) as exc:
            why = (_yaml_problem(exc) if isinstance(exc, yaml.YAMLError) else
                   f"cannot read this value ({str(exc).split(';')[0]})")
            problems.append(f"{source}: {_dashed(name)} (line {line}): {why}")
            values[name] = None
            continue
        values[name] = _coerce(name, value, problems, source)
    return values


def replica_ports(o: LaunchOptions) -> range:
    """The replicas' ports that exist (1-65535): a huge --replicas must not make a huge list
    (the plan reports the ports beyond)."""
    first = max(o.base_port, 1)
    return range(first, max(first, min(o.base_port + max(o.replicas, 0), 65536)))


def merge_options(file_values: dict, flag_values: dict, config_file: str | None
                  ) -> LaunchOptions:
    """Defaults, then the file, then the flags given on the command line."""
    merged = {name: value for name, value in file_values.items() if value is not None}
    merged.update(flag_values)
    return LaunchOptions(**merged, config_file=config_file)
