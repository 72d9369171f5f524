"""What the user asked for: `omni-dp launch` flags and the `--config` YAML file, merged.

The YAML file holds the same settings as the flags (dashes or underscores); a flag given on the
command line wins over the file. Unknown keys and wrong types are problems, never ignored.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import yaml
import yaml.constructor
import yaml.reader

from omni_dp.contract import API_KEY_ENV, PRIORITY_NAMES
from omni_dp.launcher.engines.sglang_omni import DEFAULT_ENGINE_STAGE
from omni_dp.mps.binaries import CONTROL_HELP
from omni_dp.sizes import parse_size
from omni_dp.yamlconfig import StrictLoader

START_MODES = ("sequential", "parallel")
# The engine adapters' names (omni_dp/launcher/engines holds them; a test keeps the two equal):
# written here so that the flags are made without importing the adapters.
ENGINE_NAMES = ("builtin", "vllm", "sglang", "sglang-omni", "vllm-omni")
MPS_FAULT_ACTIONS = ("restart", "fail")
REGISTER_AS = ("replicas", "router")
GATEWAY_KEY_ENV = "OMNI_DP_GATEWAY_API_KEY"  # the gateway's key: by environment, never on disk


# `launch --help` lists the flags under these titles, in this order (each field names its own
# "section"; omni_dp/cli/common.py's SectionedCommand draws them), as vLLM's help groups its.
RUN = "Run (replicas, GPUs, CPUs, ports)"
ENGINE = "Engine"
MEMORY = "Memory and KV cache"
MPS = "MPS"
ROUTER = "Router"
FAILURES = "Router failures, hangs and stream migration"
GATEWAY = "Fleet gateway"
SUPERVISION = "Supervision and restarts"
OBSERVABILITY = "Observability (traces, logs)"
LAUNCH_SECTIONS = (RUN, ENGINE, MEMORY, MPS, ROUTER, FAILURES, GATEWAY, SUPERVISION,
                   OBSERVABILITY)


# The flags of `omni-dp launch` are generated from these fields, in this order (omni_dp/cli
# reads the metadata: help, flag, ...); each default is written here only. A field's flag
# (without the dashes) is also its --config key.
@dataclass(frozen=True)
class LaunchOptions:
    replicas: int = field(default=1, metadata={
        "section": RUN,
        "short": "-n", "help": "How many complete replicas of the pipeline to run (with "
                               "--gpus: in all, spread over the GPUs)."})
    mps: bool = field(default=False, metadata={
        "section": MPS,
        "help": "Run the replicas under a private CUDA MPS daemon (one per GPU) and prove "
                "every GPU process attached."})
    gpu: str = field(default="auto", metadata={  # auto | none | INDEX | GPU-UUID
        "section": RUN, "metavar": "auto|none|INDEX|UUID",
        "help": "The one GPU (auto: GPU 0 when there is one; none: run on CPU); --gpus for "
                "several."})
    gpus: str | None = field(default=None, metadata={  # all | 0,1,… | GPU-UUID,…
        "section": RUN, "metavar": "all|0,1,…|UUID,…",
        "help": "Several GPUs in one run: one private MPS daemon, CPU cores and memory fit per "
                "GPU, one router over every replica (exclusive with --gpu)."})
    replicas_per_gpu: int | None = field(default=None, metadata={
        "section": RUN, "metavar": "N",
        "help": "With --gpus: N replicas on each GPU.  [default: --replicas spread evenly; "
                "one per GPU when --replicas is not given]"})
    cpu_blocks: str = field(default="auto", metadata={  # auto | none | "0-3 4-7 …"
        "section": RUN, "metavar": 'auto|none|"0-3 4-7"',
        "help": "CPU cores per replica: auto (disjoint whole cores, GPU's NUMA node first), "
                "none (unpinned) or one CPU list per replica."})
    kv_cache_bytes: int | None = field(default=None, metadata={
        "section": MEMORY,
        "size": True, "help": "Pin every replica's KV pool to this many bytes, e.g. 2GiB."})
    max_total_tokens: int | None = field(default=None, metadata={
        "section": MEMORY,
        "help": "Pin every replica's KV pool to this many tokens."})
    share_weights: bool = field(default=False, metadata={
        "section": MEMORY,
        "help": "Built-in engine: keep ONE copy of the backbone weights on the device. "
                "Replica 0 (the leader) loads and publishes them in the run's share/ "
                "directory; the others (followers) map them read-only. The memory fit is then "
                "W + N × (KV + private weights + overhead); a dead leader restarts the group."})
    # None: parallel when every replica's KV is a fixed size
    start: str | None = field(default=None, metadata={
        "section": RUN, "choices": START_MODES,
        "help": "Start the replicas one after another, or together.  [default: parallel "
                "(every replica's KV is a fixed size)]"})
    # the router's address; replicas always listen on loopback
    host: str = field(default="127.0.0.1", metadata={
        "section": ROUTER,
        "help": "Address the router listens on (replicas always listen on 127.0.0.1)."})
    router_port: int = field(default=8000, metadata={
        "section": ROUTER, "help": "Port the router listens on."})
    base_port: int = field(default=8100, metadata={
        "section": RUN,
        "help": "Replica i listens on BASE_PORT + i."})
    policy: str = field(default="least_request", metadata={  # choices: the router's
        "section": ROUTER,
        "help": "The router's load-balancing policy."})
    router_workers: int = field(default=1, metadata={
        "section": ROUTER,
        "help": "Router processes sharing the port (SO_REUSEPORT)."})
    # The router's handling of a replica that fails or hangs under a request: passed to
    # `omni-dp router` when given; None keeps the router's own default (one home for each).
    retries: int | None = field(default=None, metadata={
        "section": FAILURES,
        "help": "The router's --retries: times a request none of whose answer reached the "
                "client is sent to another replica.  [default: the router's, 3]"})
    resumes: int | None = field(default=None, metadata={
        "section": FAILURES,
        "help": "The router's --resumes: times a cut stream is continued by another replica "
                "from the byte the client has.  [default: the router's, 3]"})
    first_byte_timeout: float | None = field(default=None, metadata={
        "section": FAILURES,
        "help": "The router's --first-byte-timeout: seconds before a silent replica is "
                "checked, and ejected as hung if its /health fails too.  [default: the "
                "router's, 5]"})
    stall_timeout: float | None = field(default=None, metadata={
        "section": FAILURES,
        "help": "The router's --stall-timeout: the same for a stream that stops mid-answer.  "
                "[default: the router's, 5]"})
    replica_wait: float | None = field(default=None, metadata={
        "section": FAILURES,
        "help": "The router's --replica-wait: seconds a request with no replica to go to "
                "waits for one before 503 + Retry-After.  [default: the router's, 30]"})
    max_ejection_percent: int | None = field(default=None, metadata={
        "section": FAILURES,
        "help": "The router's --max-ejection-percent: the share of replicas it may hold "
                "ejected at once for failures or a hang (1-100).  [default: the router's, "
                "50]"})
    # Priority classes (the router's classes.py); --route-priority is the router's alone.
    default_priority: str | None = field(default=None, metadata={
        "section": ROUTER, "choices": PRIORITY_NAMES,
        "help": "The router's --default-priority: the class of a request that names none "
                "(X-Omni-DP-Priority).  [default: the router's, default]"})
    reserved_interactive: int | None = field(default=None, metadata={
        "section": ROUTER,
        "help": "The router's --reserved-interactive: in-flight slots only interactive "
                "requests may take.  [default: the router's, 0]"})
    run_id: str | None = field(default=None, metadata={
        "section": RUN,
        "help": "Name the run (default: run-DATE-TIME-XXXX)."})
    detach: bool = field(default=False, metadata={
        "section": RUN,
        "help": "Return once the run is verified; a background supervisor keeps it up."})
    config_file: str | None = field(default=None, compare=False, metadata={
        "section": RUN, "flag": "--config", "metavar": "FILE",
        "help": "A YAML file with these settings (dashes or underscores); flags win."})
    engine: str = field(default="builtin", metadata={
        "section": ENGINE, "choices": ENGINE_NAMES,
        "help": "What each replica runs: the built-in TTS pipeline, or an external engine "
                "with the model and its own arguments after `--`."})
    engine_python: str | None = field(default=None, metadata={
        "section": ENGINE, "metavar": "PATH",
        "help": "The Python interpreter that has the engine installed (vllm, sglang, "
                "sglang_omni, vllm_omni).  [default: this omni-dp's interpreter]"})
    engine_overhead: int | None = field(default=None, metadata={
        "section": ENGINE, "size": True, "metavar": "SIZE",
        "help": "Memory one replica holds beyond weights and KV (external engines), for the "
                "fit check.  [default: the engine's estimate]"})
    engine_stage: str = field(default=DEFAULT_ENGINE_STAGE, metadata={
        "section": ENGINE,
        "help": "sglang-omni: the pipeline stage whose engine holds the KV cache (the stage "
                "name is model-specific; tts_engine is Higgs TTS's). vllm-omni: its stage_id "
                "(the default means stage 0, Qwen3-TTS's talker)."})
    # what follows `--` on the command line
    engine_args: tuple[str, ...] = field(default=(), metadata={"flag": None})
    mps_control: str | None = field(default=None, metadata={
        "section": MPS, "metavar": "PATH", "help": CONTROL_HELP})
    # Per-replica MPS caps: off unless asked (a cap takes away the headroom a host-bound
    # replica uses, and some SM caps make cuBLAS pick wrong BF16 kernels: a capped replica
    # passes a BF16 GEMM check before it serves).
    mps_thread_percentage: float | None = field(default=None, metadata={
        "section": MPS, "metavar": "P",
        "help": "With --mps: cap each replica process at P% (1-100) of the GPU's SMs "
                "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; P × N may exceed 100). Each capped "
                "replica passes a BF16 GEMM check under its cap before it starts.  [default: "
                "uncapped]"})
    mps_memory_limit: int | None = field(default=None, metadata={
        "section": MPS, "size": True, "metavar": "SIZE",
        "help": "With --mps: cap the device memory each replica process may pin, e.g. 8GiB "
                "(CUDA_MPS_PINNED_DEVICE_MEM_LIMIT); refused below a replica's planned "
                "footprint.  [default: uncapped]"})
    # --mps where NVML sees no GPU: exercises the daemon only
    no_gpu_check: bool = field(default=False, metadata={
        "section": MPS,
        "help": "With --mps where NVML sees no GPU: start the daemon anyway (exercises the "
                "machinery; attach verification cannot pass without GPU clients)."})
    # per replica start, seconds
    start_timeout: float | None = field(default=None, metadata={
        "section": SUPERVISION, "deprecated": ("--health-timeout",),
        "help": "Seconds a replica may take to become healthy (formerly --health-timeout).  "
                "[default: the engine's: builtin 300, vllm 600, sglang 900, sglang-omni "
                "1200, vllm-omni 1200]"})
    drain_timeout: float = field(default=30.0, metadata={
        "section": SUPERVISION,
        "help": "Seconds in-flight requests get when a replica or the router stops."})
    check_interval: float = field(default=2.0, metadata={  # supervision sweep
        "section": SUPERVISION,
        "help": "Seconds between supervision sweeps."})
    # consecutive failed /health before a restart
    restart_after_failures: int = field(default=3, metadata={
        "section": SUPERVISION, "deprecated": ("--health-failures",),
        "help": "Consecutive failed /health checks before a replica is restarted (formerly "
                "--health-failures)."})
    restart_budget: int = field(default=5, metadata={
        "section": SUPERVISION,
        "help": "Restarts per replica within --restart-window before it is marked failed."})
    restart_window: float = field(default=600.0, metadata={
        "section": SUPERVISION, "help": "Seconds over which --restart-budget counts a "
                                        "replica's restarts."})
    on_mps_fault: str = field(default="restart", metadata={
        "section": MPS, "choices": MPS_FAULT_ACTIONS,
        "help": "If the MPS daemon dies or logs a fault: restart it and every replica, or "
                "stop the run."})
    # fraction of device memory kept free by the fit check
    memory_headroom: float = field(default=0.05, metadata={
        "section": MEMORY,
        "help": "Fraction of GPU memory the fit check keeps free."})
    # The router's API key; kept out of run.json, argv and repr (it goes by environment).
    api_key: str | None = field(default=None, repr=False, metadata={
        "section": ROUTER, "envvar": API_KEY_ENV, "metavar": "KEY",
        "help": "The router requires `Authorization: Bearer KEY` (but on /health, /ready, "
                "/live, /metrics); the supervisor's admin calls send it. Passed by "
                f"environment, never written to the run's state. Also read from {API_KEY_ENV}."})
    register: str | None = field(default=None, metadata={
        "section": GATEWAY, "metavar": "URL",
        "help": "Register with this fleet gateway (the SGLang model gateway's worker API) "
                "each replica once it passed its gates (or this host's router: "
                "--register-as router); out while it restarts, removed on teardown. "
                f"Its API key, if any, from {GATEWAY_KEY_ENV}."})
    register_as: str = field(default="replicas", metadata={
        "section": GATEWAY, "choices": REGISTER_AS,
        "help": "What --register hands the gateway: every replica (the gateway balances "
                "them; it must reach 127.0.0.1, so run it on this host) or this host's router."})
    register_url: str | None = field(default=None, metadata={
        "section": GATEWAY, "metavar": "URL",
        "help": "With --register-as router: the URL the gateway reaches this host's router "
                "at.  [default: the router's own URL]"})
    # The router's LLM stream migration (vllm; sglang: completions). None: not passed, the
    # router's default (off; no limit), written there only.
    migration_limit: int | None = field(default=None, metadata={
        "section": FAILURES, "metavar": "N",
        "help": "The router continues a streamed completion or chat cut by its replica's "
                "failure on another replica, token for token, up to N times (vllm; sglang: "
                "completions only).  [default: the router's, 0: off]"})
    migration_max_seq_len: int | None = field(default=None, metadata={
        "section": FAILURES, "metavar": "TOKENS",
        "help": "Streams longer than this (prompt plus generated tokens) are not migrated.  "
                "[default: the router's, no limit]"})
    otlp_traces_endpoint: str | None = field(default=None, metadata={
        "section": OBSERVABILITY, "metavar": "URL",
        "help": "OpenTelemetry traces to this OTLP/HTTP receiver (e.g. "
                "http://127.0.0.1:4318/v1/traces): passed to the router and to every replica "
                "(builtin: its stage processes too; vllm: its own flag of this name; sglang "
                "engines: the router's spans only).  [default: no tracing]"})
    # text | json, for the launcher, supervisor, replicas and router; help: the CLI's
    log_format: str = field(default="text", metadata={
        "section": OBSERVABILITY, "help": None})


def setting_name(f: dataclasses.Field) -> str:
    """A field's --config key and the name problems give it: its flag without the dashes,
    underscored."""
    flag = f.metadata.get("flag", f.name)
    return (flag or f.name).lstrip("-").replace("-", "_")


# Every setting by its name (as in the flags and the --config file) -> its field; config_file
# is the file itself.
FIELDS = {setting_name(f): f for f in dataclasses.fields(LaunchOptions)
          if f.name != "config_file"}
FILE_KEYS = set(FIELDS)
# The old names of renamed settings (health_timeout -> start_timeout): accepted in a --config
# file for one release, with a warning.
DEPRECATED_KEYS = {old.lstrip("-").replace("-", "_"): name for name, f in FIELDS.items()
                   for old in f.metadata.get("deprecated", ())}
_SIZE_FIELDS = {f.name for f in FIELDS.values() if f.metadata.get("size")}
MAX_CONFIG_BYTES = 1024**2  # a settings file is a few lines; /dev/zero must not fill memory
_INT_LIMIT = 2**63  # larger integers are no setting's value (and overflow C on the way)


def _dashed(name: str) -> str:
    return name.replace("_", "-")


def _coerce(f: dataclasses.Field, value, problems: list[str], source: str, shown: str):
    """A YAML value to the field's type, or a problem naming the key as shown."""
    if value is None:
        return None
    try:
        return _converter(f)(value)
    except ValueError as exc:
        problems.append(f"{source}: {shown} must be {exc}")
        return None


# Each converter takes a YAML value and returns the setting's, or raises ValueError saying what
# the value must be ("must be " + its message).


def _as_bool(value) -> bool:
    if not isinstance(value, bool):
        raise ValueError("true or false")
    return value


def _as_int(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("an integer")
    if abs(value) >= _INT_LIMIT:
        raise ValueError(f"an integer below 2**63 (this one has {value.bit_length()} bits)")
    return value


def _as_float(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("a number")
    try:
        number = float(value)
    except OverflowError:
        raise ValueError("a finite number (this integer is too large)") from None
    if not math.isfinite(number):
        raise ValueError(f"a finite number, got {number}")
    return number


def _as_text(value) -> str:
    if isinstance(value, (dict, list, set)):
        raise ValueError("a string")
    text = str(value)
    if "\0" in text:
        raise ValueError("a string without NUL characters")
    return text


def _as_gpus(value) -> str:
    """`gpus: [0, 1]` as well as "0,1" (and `all`)."""
    if not isinstance(value, list):
        return _as_text(value)
    if not value or not all(isinstance(v, (str, int)) and not isinstance(v, bool)
                            for v in value):
        raise ValueError("all, or GPU indices or UUIDs (a list, or separated by commas)")
    return ",".join(str(v) for v in value)


def _as_engine_args(value) -> tuple[str, ...]:
    if isinstance(value, str):
        value = value.split()
    if not (isinstance(value, list) and all(
            isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in value)):
        raise ValueError("a list of strings")
    args = tuple(str(v) for v in value)
    if any("\0" in arg for arg in args):
        raise ValueError("a list of strings without NUL characters")
    return args


_BY_NAME = {"gpus": _as_gpus, "engine_args": _as_engine_args}


def _converter(f: dataclasses.Field):
    """The converter a field's schema calls for: by its name where its value has a form of its
    own, a size where its metadata says so, else by its annotated type."""
    if f.name in _SIZE_FIELDS:
        return lambda value: parse_size(str(value))
    if f.name in _BY_NAME:
        return _BY_NAME[f.name]
    expected = f.type
    if "bool" in expected:
        return _as_bool
    if "int" in expected and "float" not in expected:
        return _as_int
    return _as_float if "float" in expected else _as_text


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


def load_config_file(path: str, problems: list[str],
                     deprecations: list[str] | None = None) -> dict:
    """The settings of a YAML file as field values; problems appended, nothing raised. A key
    of a renamed setting still counts, and appends a warning to `deprecations`."""
    source = f"--config {path}"
    text = _read_text(path, source, problems)
    if text is None:
        return {}
    loader = None
    try:
        # Its reader refuses control characters at once; aliases, nesting deeper than
        # yamlconfig.MAX_DEPTH and a key given twice in one mapping are refused as it composes;
        # a value of the wrong shape (deeper than a setting's list) by _settings.
        loader = StrictLoader(text, what="a --config file",
                              shape="a setting is a plain value or a list of them")
        root = loader.get_single_node()
        if root is None:
            return {}
        if not isinstance(root, yaml.MappingNode):
            problems.append(f"{source}: the top level must be a mapping of settings")
            return {}
        return _settings(loader, root, source, problems,
                         [] if deprecations is None else deprecations)
    except yaml.YAMLError as exc:
        problems.append(f"{source}: cannot read it as YAML: {_yaml_problem(exc)}")
        return {}
    finally:
        if loader is not None:
            loader.dispose()


def _settings(loader: StrictLoader, root: yaml.MappingNode, source: str,
              problems: list[str], deprecations: list[str]) -> dict:
    """The top mapping key by key, so that a problem names its setting and line, and a key
    given twice is a problem (safe_load keeps the last one silently)."""
    values: dict = {}  # field name -> value
    seen: dict[str, tuple[str, int]] = {}  # setting name -> (key as written, line)
    for key_node, value_node in root.value:
        line = key_node.start_mark.line + 1
        if not isinstance(key_node, yaml.ScalarNode):
            kind = "list" if isinstance(key_node, yaml.SequenceNode) else "mapping"
            problems.append(f"{source}: line {line}: a setting's name must be a word, not a "
                            f"{kind}")
            continue
        key = key_node.value  # never constructed: a name is its text, whatever its tag
        written = key.replace("-", "_")
        name = DEPRECATED_KEYS.get(written, written)
        if name in seen:
            problems.append(_set_twice(source, name, seen[name], key, line))
            if name in FIELDS:
                values.pop(FIELDS[name].name, None)
            continue
        seen[name] = (key, line)
        if name not in FILE_KEYS:
            problems.append(_unknown(source, key))
            continue
        if name != written:
            deprecations.append(f"{source}: {key} is deprecated (it goes in the next release); "
                                f"use {_dashed(name)}")
        f = FIELDS[name]
        try:
            value = loader.construct_object(value_node, deep=True)
        except (yaml.YAMLError, ValueError, OverflowError) as exc:
            why = (_yaml_problem(exc) if isinstance(exc, yaml.YAMLError) else
                   f"cannot read this value ({str(exc).split(';')[0]})")
            problems.append(f"{source}: {_dashed(written)} (line {line}): {why}")
            values[f.name] = None
            continue
        values[f.name] = _coerce(f, value, problems, source, _dashed(written))
    return values


def _set_twice(source: str, name: str, first: tuple[str, int], key: str, line: int) -> str:
    first_key, first_line = first
    how = f"lines {first_line} and {line}" if first_key == key else f"as {first_key!r} and {key!r}"
    return f"{source}: {_dashed(name)} is set twice ({how}); keep one"


def _unknown(source: str, key: str) -> str:
    known = ", ".join(sorted(_dashed(n) for n in FILE_KEYS))
    shown = key if len(key) <= 60 else key[:57] + "..."
    return f"{source}: unknown setting {shown!r} (known: {known})"


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


# --- the options a run was launched with, kept in its run.json ---------------------------------
# What a day-two change (omni-dp restart with new engine arguments, omni-dp scale) plans from:
# the run's options as they were merged at launch, keys as in a --config file. Secrets never
# go to disk (the API key is in the environment of whoever needs it).
NOT_RECORDED = ("api_key", "config_file")


def options_record(o: LaunchOptions) -> dict:
    """The options as plain JSON values, by setting name."""
    record = {}
    for name, f in FIELDS.items():
        if f.name in NOT_RECORDED:
            continue
        value = getattr(o, f.name)
        record[name] = list(value) if isinstance(value, tuple) else value
    return record


def options_from_record(record: dict, source: str = "run.json's options"
                        ) -> tuple[LaunchOptions, list[str]]:
    """The options a run.json kept, read back as a --config file is (each value to its
    field's type); the problems with it, if any (an unknown setting is skipped, said)."""
    problems: list[str] = []
    values = {}
    for name, value in record.items():
        f = FIELDS.get(name)
        if f is None or f.name in NOT_RECORDED:
            problems.append(f"{source}: {name!r} is no setting of this omni-dp")
            continue
        values[f.name] = _coerce(f, value, problems, source, name)
    values = {k: v for k, v in values.items() if v is not None}
    return LaunchOptions(**values), problems
