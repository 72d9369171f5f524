"""What every engine adapter is: the small protocol the launcher plans and starts replicas with,
and the messages that cross it.

The launcher never looks inside an engine. An adapter says, for its engine: the command line
(loopback host, the replica's port, a strict-port setting), the environment, the flags the
launcher reserves, how a KV pin is written in the engine's own knobs and what capacity that
must give, how the capacity actually allocated is read back, and what runs where (the OS
processes of a replica are found by session, never by the engine's word alone: see
omni_dp/launcher/processes/groups.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from omni_dp.gpus import GpuFacts
from omni_dp.mps.attach import DeclaredProcess

# The engine's own model-path flags: a model given by one of them is the model, like a first
# positional argument (one place, so every adapter finds it the same way).
MODEL_FLAGS = ("--model", "--model-path")
NO_GPU = "{engine} needs a CUDA GPU; these engines cannot run on CPU"
# A path a Unix socket can bind (sun_path is 108 bytes with its NUL). Python engines name IPC
# sockets after tempfile's files in TMPDIR (`…/tmpXXXXXXXX`).
UNIX_SOCKET_PATH_MAX = 107
TEMP_NAME_LEN = len("/tmpXXXXXXXX")


@dataclass(frozen=True)
class EngineSizing:
    """What one replica will hold: from the engine's own dry run (builtin) or from the model
    directory and the pin (external engines); never guessed."""

    weights_bytes: int
    kv_cache_bytes: int
    kv_tokens: int | None  # None: the engine decides the count from the bytes (read back)
    overhead_bytes: int
    device: str
    # Of weights_bytes, what --share-weights keeps once on the device (the builtin engine's
    # dry run says; 0 for engines that cannot share): a follower holds only the rest.
    shared_weights_bytes: int = 0
    # The replica's OS processes by its placement (the builtin engine's dry run): each CUDA
    # one is an MPS client; None where the engine does not say (its estimate is used).
    processes: tuple[tuple[str, str], ...] = ()  # (process name, device)
    # What the replicas serve, in words a person reads before anything starts (the builtin
    # engine's dry run: a trained voice, or a seeded preset whose audio is noise); None: unsaid
    model: str | None = None

    @property
    def keeps_kv(self) -> bool:
        """False for a model with no KV cache at all (a Piper voice): nothing to pin or compare."""
        return not (self.kv_tokens == 0 and self.kv_cache_bytes == 0)

    @property
    def cuda_processes(self) -> int | None:
        if not self.processes:
            return None
        return sum(device.startswith("cuda") for _, device in self.processes)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.overhead_bytes

    @property
    def private_weights_bytes(self) -> int:
        return self.weights_bytes - self.shared_weights_bytes


@dataclass(frozen=True)
class ModelFacts:
    """A local model directory as an external engine will load it, read without loading it:
    config.json for the KV geometry, safetensors headers for the weights (no tensor data)."""

    path: Path
    architecture: str
    weights_bytes: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # the weights' and (by default) the KV cache's: "bfloat16", "float16", ...
    dtype_bytes: int
    # config's max_position_embeddings: vLLM refuses to start when the KV pool cannot hold one
    # request of that length. None: the config does not say.
    max_positions: int | None = None

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer: what one token of KV costs at the model's dtype."""
        return self.kv_bytes_per_token_at(self.dtype_bytes)

    def kv_bytes_per_token_at(self, element_bytes: int) -> int:
        """The same at another KV dtype (an engine's --kv-cache-dtype, its served --dtype)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_bytes


@dataclass(frozen=True)
class KvRequest:
    """What the plan knows when an adapter turns a KV pin into its engine's knobs."""

    kv_cache_bytes: int | None
    max_total_tokens: int | None
    replicas: int
    device: str  # "cpu" or "cuda"
    gpu: GpuFacts | None
    sizing: EngineSizing | None = None  # the builtin engine's dry run
    model: ModelFacts | None = None  # an external engine's model directory
    overhead_bytes: int | None = None  # --engine-overhead: the user's estimate wins
    engine_stage: str | None = None  # sglang-omni: the stage that holds the KV cache
    engine_args: tuple[str, ...] = ()  # the user's, for checks that depend on them


@dataclass(frozen=True)
class KvPlan:
    """A KV pin in the engine's own words: the arguments and environment that make every
    replica allocate the same pool, what each must then report, and what a replica holds."""

    args: tuple[str, ...]
    sizing: EngineSizing
    # What every replica must report; None where the engine derives the count from a byte pin
    # itself: then every replica must report the same as the others.
    expected_tokens: int | None
    notes: tuple[str, ...] = ()  # how the pin was translated, for the plan's description


@dataclass(frozen=True)
class ReplicaLaunch:
    """The launcher-owned settings of one replica; the adapter turns them into an argv."""

    port: int
    device: str  # "cpu" or "cuda"
    threads: int | None
    kv_cache_bytes: int | None
    max_total_tokens: int | None
    log_format: str = "text"  # text | json (omni_dp/logs.py)
    python: str | None = None  # the interpreter that has the engine installed
    kv_args: tuple[str, ...] = ()  # KvPlan.args
    cpus: tuple[int, ...] | None = None  # the replica's CPU block
    work_dir: Path | None = None  # the replica's own directory inside the run directory
    share_role: str | None = None  # --share-weights: "leader" | "follower" (builtin only)
    share_dir: Path | None = None  # where the leader publishes (the run's share/)


class EngineUnreadable(Exception):
    """What a running replica reports (the KV capacity it allocated, its own process list)
    could not be read; the message says why, and the gate that asked fails."""


class EngineAdapter(Protocol):
    name: str
    # True: an engine installed apart (run by --engine-python, in a working directory of its
    # own inside the run directory, sized from its model directory). False: omni-dp's own,
    # which sizes itself by its dry run (`dry_run`).
    external: bool
    # The Python module the engine runs as; None for the built-in engine (this interpreter).
    module: str | None
    # Engine flags the launcher sets itself → the omni-dp option to use instead. The same flag
    # among the user's engine args is an error: it would silently fight the launcher's value.
    reserved_flags: Mapping[str, str]
    # True: the engine sizes its KV from the memory free when it starts, so replicas start one
    # after another by default, and a pin is required for more than one.
    kv_profiled: bool
    # True when the engine's KV without a knob is a fixed number: then unpinned replicas still
    # get equal KV (the built-in engine's 16384 tokens).
    fixed_default_kv: bool
    needs_gpu: bool
    # True: its replicas can share one copy of the weights (--share-weights: the argv's
    # share_role / share_dir, the dry run's shared_weights_bytes, /get_server_info's
    # weight_share).
    shares_weights: bool
    # How many processes of one replica hold a CUDA context, for MPS's client limit.
    cuda_processes_per_replica: int
    start_timeout_s: float  # --start-timeout's default for this engine
    example: str  # "speech" or "completions": the request the launch summary shows
    # The OpenAI endpoints whose streamed answers give every chunk's token ids when asked
    # (`return_token_ids`): the router's --migration-path, for --migration-limit. () for an
    # engine without such streams (migration refused).
    migration_paths: tuple[str, ...]
    # True: what the engine writes in its TMPDIR (an external engine's work dir's tmp/) is one
    # process's alone — its caches are pointed elsewhere — so it is emptied before each start.
    tmp_per_process: bool

    def plan_kv(self, request: KvRequest) -> tuple[KvPlan | None, list[str]]:
        """Pure: the pin in the engine's knobs, or every reason it cannot be pinned."""
        ...

    def argv(self, launch: ReplicaLaunch, engine_args: tuple[str, ...]) -> list[str]: ...

    def environment(self, launch: ReplicaLaunch) -> dict[str, str]:
        """What the engine needs on top of the launcher's own variables."""
        ...

    def read_capacity(self, url: str, log: Path) -> int:
        """The KV tokens the running replica allocated; EngineUnreadable if it cannot tell."""
        ...

    def reported_processes(self, url: str) -> list[DeclaredProcess] | None:
        """The engine's own list of its processes (cross-checked against its session), or
        None when the engine keeps none."""
        ...


def split_model(engine_args: tuple[str, ...]) -> tuple[str | None, tuple[str, ...]]:
    """(the model, the other arguments): the model is the first positional argument or the
    value of --model / --model-path, written either way (`--model M`, `--model=M`)."""
    rest: list[str] = []
    model = None
    args = list(engine_args)
    i = 0
    while i < len(args):
        arg = args[i]
        flag, eq, value = arg.partition("=")
        if model is None and flag in MODEL_FLAGS:
            if eq:
                model = value
            elif i + 1 < len(args):
                model = args[i + 1]
                i += 1
            i += 1
            continue
        if model is None and not arg.startswith("-") and (not rest or not _takes_value(rest)):
            model = arg
            i += 1
            continue
        rest.append(arg)
        i += 1
    return model, tuple(rest)


def _takes_value(before: list[str]) -> bool:
    """Whether the argument just before is a flag awaiting its value (`--dtype half`)."""
    last = before[-1]
    return last.startswith("--") and "=" not in last


def flag_value(engine_args: tuple[str, ...], flag: str) -> str | None:
    """The last value given to `flag` (`--flag V` or `--flag=V`, also spelled `--flag_name`
    as argparse accepts it), as the engine's parser will read it; None if not given."""
    value = None
    for i, arg in enumerate(engine_args):
        name, eq, inline = arg.partition("=")
        if name.startswith("--") and name.replace("_", "-") == flag:
            value = inline if eq else (engine_args[i + 1] if i + 1 < len(engine_args) else None)
    return value


def socket_safe_tmpdir(work_dir: Path | None) -> str | None:
    """The replica's own TMPDIR, where the engine leaves its IPC socket files; None (the
    system's) when socket paths under it would be too long to bind."""
    if work_dir is None:
        return None
    tmp = str(work_dir / "tmp")
    return tmp if len(tmp) + TEMP_NAME_LEN <= UNIX_SOCKET_PATH_MAX else None


def flag_problems(reserved: Mapping[str, str], engine_args: tuple[str, ...],
                  engine: str) -> list[str]:
    """Every reserved flag among the user's engine arguments, naming what to use instead —
    also as the engines' argparse parsers would read it: `--flag_name` for `--flag-name`, and
    an unambiguous prefix (`--gpu-mem 0.5` sets --gpu-memory-utilization), either of which
    would otherwise override the launcher's value from behind it on the command line."""
    problems = []
    for arg in engine_args:
        flag = arg.split("=", 1)[0]
        if not flag.startswith("--"):
            continue
        spelled = flag.replace("_", "-")
        if spelled in reserved:
            named = flag if spelled == flag else f"{flag} ({spelled})"
            problems.append(
                f"engine argument {named} is set by the launcher for every replica; "
                f"use {reserved[spelled]} instead"
            )
            continue
        if len(spelled) < 4:
            continue
        for name, instead in reserved.items():
            if name.startswith(spelled):
                problems.append(f"engine argument {flag} abbreviates {name}, which the launcher "
                                f"sets for every replica; use {instead} instead")
                break
    return problems
