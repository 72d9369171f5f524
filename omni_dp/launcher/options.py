"""What the user asked for: `omni-dp launch` flags and the `--config` YAML file, merged.

The YAML file holds the same settings as the flags (dashes or underscores); a flag given on the
command line wins over the file. Unknown keys and wrong types are problems, never ignored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

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
    config_file: str | None = field(default=None, compare=False)


FIELDS = {f.name: f for f in dataclasses.fields(LaunchOptions) if f.name != "config_file"}
_SIZE_FIELDS = {"kv_cache_bytes"}


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
                return tuple(value.split())
            if isinstance(value, list) and all(isinstance(v, (str, int, float)) for v in value):
                return tuple(str(v) for v in value)
            raise ValueError("a list of strings")
        if "bool" in expected:
            if not isinstance(value, bool):
                raise ValueError("true or false")
            return value
        if "int" in expected and "float" not in expected:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError("an integer")
            return value
        if "float" in expected:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError("a number")
            return float(value)
        if isinstance(value, (dict, list)):
            raise ValueError("a string")
        return str(value)
    except ValueError as exc:
        problems.append(f"{source}: {name.replace('_', '-')} must be {exc}")
        return None


def load_config_file(path: str, problems: list[str]) -> dict:
    """The settings of a YAML file as field values; problems appended, nothing raised."""
    source = f"--config {path}"
    try:
        data = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        problems.append(f"{source}: no such file")
        return {}
    except (OSError, yaml.YAMLError) as exc:
        problems.append(f"{source}: cannot read it as YAML: {exc}")
        return {}
    if data is None:
        return {}
    if not isinstance(data, dict):
        problems.append(f"{source}: the top level must be a mapping of settings")
        return {}
    values: dict = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in values:
            problems.append(f"{source}: {name.replace('_', '-')} is set twice (as "
                            f"{name.replace('_', '-')!r} and {name!r}); keep one")
            continue
        if name not in FIELDS:
            known = ", ".join(sorted(n.replace("_", "-") for n in FIELDS))
            problems.append(f"{source}: unknown setting {key!r} (known: {known})")
            continue
        values[name] = _coerce(name, value, problems, source)
    return values


def merge_options(file_values: dict, flag_values: dict, config_file: str | None
                  ) -> LaunchOptions:
    """Defaults, then the file, then the flags given on the command line."""
    merged = {name: value for name, value in file_values.items() if value is not None}
    merged.update(flag_values)
    return LaunchOptions(**merged, config_file=config_file)
