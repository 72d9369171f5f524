"""Everything the launch plan depends on that must be read from the machine, read in one place.

Reading creates nothing: ports are probed by binding and closing at once, the engine's dry run
is a child process that allocates nothing, NVML is only queried. The plan (plan.py) is then a
pure function of the options and these facts, so tests can plan any machine.
"""

from __future__ import annotations

import os
import secrets
import select
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from omni_dp.gateway import GatewayError, SglangGateway
from omni_dp.gpus import NO_DRIVER, GpuFacts, GpuInventory, Problem, pick_gpu, query_gpus
from omni_dp.launcher.engines import ENGINES
from omni_dp.launcher.engines.base import EngineSizing, ModelFacts, ReplicaLaunch, split_model
from omni_dp.launcher.engines.model_dir import read_model
from omni_dp.launcher.planning.gpus import (
    CPU_SLOT,
    GpuSlot,
    parse_gpu_list,
    replica_total,
    spread_counts,
)
from omni_dp.launcher.planning.options import GATEWAY_KEY_ENV, LaunchOptions, replica_ports
from omni_dp.launcher.planning.share_group import LEADER_ROLE
from omni_dp.launcher.planning.topology import CpuTopology, gpu_numa_node, read_topology
from omni_dp.mps.binaries import MpsBinaries
from omni_dp.mps.preflight import GPU_CHECKS, check_preflight, in_mps_words
from omni_dp.net import bind_error, port_taken
from omni_dp.rundir import mps_pipe_dir, run_dir, share_dir, state_dir
from omni_dp.runfile import gpu_key, stored_runs


@dataclass(frozen=True)
class KnownRun:
    """A run directory found under the state root."""

    run_id: str
    directory: Path
    gpu: str | None
    live: bool  # some recorded process of it is still running


@dataclass(frozen=True)
class LaunchFacts:
    state_root: Path
    new_run_id: str  # used when --run-id is not given
    topology: CpuTopology
    gpu_problems: tuple[str, ...]  # why a GPU asked for cannot be used
    mps_binary: str | None
    mps_problems: tuple[str, ...]
    taken_ports: frozenset[int]
    runs: tuple[KnownRun, ...]
    sizing: EngineSizing | None
    engine_problems: tuple[str, ...]
    host_memory_available: int
    numactl: str | None
    host_problem: str | None = None  # the router's --host cannot be listened on
    mps_binaries: MpsBinaries | None = None  # with --mps: the pair found (mps_binary: control)
    command: str = "omni-dp"  # how the user ran omni-dp (invoked_as)
    model: ModelFacts | None = None  # an external engine's model directory, as read
    engine_python: str = sys.executable  # the interpreter that runs the engine
    # Free bytes of the state root's filesystem (of its nearest existing ancestor while it
    # does not exist): a CPU weight-share segment is written there; None when unreadable
    state_root_free: int | None = None
    # The run's GPU slots as read: `--gpu X` one, `--gpus` one per GPU found (or, with --mps
    # --no-gpu-check where NVML sees none, per index given), no GPU one CPU slot
    slots: tuple[GpuSlot, ...] = (CPU_SLOT,)
    gateway_problem: str | None = None  # --register: why the gateway cannot be used

    @property
    def first_gpu(self) -> GpuFacts | None:
        """The first slot's GPU: the engine's dry run sizes the replicas on it."""
        return self.slots[0].gpu if self.slots else None

    @property
    def numa_node(self) -> int | None:
        """The first slot's NUMA node."""
        return self.slots[0].numa_node if self.slots else None


def visible_id(gpu: GpuFacts | None) -> str:
    """What CUDA_VISIBLE_DEVICES names the GPU by: its UUID (stable), else its index; "" for
    none (hides every GPU)."""
    if gpu is None:
        return ""
    return gpu.uuid or str(gpu.index)


def invoked_as(argv0: str | None = None) -> str:
    """How to write the omni-dp command in the follow-up commands we print, as the user ran
    it: `.venv/bin/omni-dp` when typed so, `omni-dp` when that is the one on PATH (or we
    cannot tell), `PYTHON -m omni_dp` after `python -m omni_dp`."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    path = Path(argv0)
    if path.name == "omni-dp":
        on_path = shutil.which("omni-dp")
        if os.sep not in argv0 or (on_path and Path(on_path).resolve() == path.resolve()):
            return "omni-dp"
        return shlex.quote(argv0)
    if path.name == "__main__.py" and path.parent.name == "omni_dp":
        return f"{shlex.quote(sys.executable)} -m omni_dp"
    return "omni-dp"


def new_run_id() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def host_problem(host: str) -> str | None:
    """Why the router cannot listen on host (None if it can)."""
    why = bind_error(host)
    if why is None:
        return None
    return (f"--host {host!r}: the router cannot listen there ({why}); "
            "use an address of this machine, e.g. 127.0.0.1 or 0.0.0.0")


def free_bytes(path: Path) -> int | None:
    """Free bytes of the filesystem path is on, or will be once created (that of its nearest
    existing ancestor); None when it cannot be read."""
    for candidate in (path, *path.parents):
        try:
            if candidate.exists():
                return shutil.disk_usage(candidate).free
        except OSError:  # an ancestor we may not search, or a vanished one
            return None
    return None


def known_runs(root: Path) -> tuple[KnownRun, ...]:
    """Every run under the state dir: its GPU and whether it is live (omni_dp/runfile.py's one
    definition); an unreadable run.json is neither."""
    return tuple(KnownRun(run.run_id, run.directory, run.record.gpu if run.record else None,
                          run.live) for run in stored_runs(root))


def gather_facts(options: LaunchOptions, *, option_problems: list[str]) -> LaunchFacts:
    """Read the machine for this launch; NVML is asked once (the MPS preflight checks the GPU
    facts read here). The engine dry run is skipped when the options alone are already wrong
    (its complaints would only repeat them)."""
    root = state_dir()
    run_id = options.run_id or new_run_id()
    slots, gpu_problems = look_up_gpus(options)
    # --replicas as the run's total: what the ports and the MPS client limits count
    options = replace(options, replicas=replica_total(options, len(slots))[0])
    python = resolve_python(options.engine_python)
    model = None
    engine = ENGINES.get(options.engine)
    gpu = slots[0].gpu if slots else None
    if engine is None or not engine.external:  # it sizes itself: a dry run
        sizing, engine_problems = _dry_run(options, gpu, option_problems,
                                           run_dir(root, run_id))
    else:
        sizing = None
        model, engine_problems = _external_engine(options, python, option_problems)
    # After the dry run: its placement says how many CUDA processes each replica starts.
    mps_binaries, mps_problems = _mps_preflight(options, slots, run_dir(root, run_id), sizing)
    return LaunchFacts(
        state_root=root,
        new_run_id=run_id,
        topology=read_topology(),
        gpu_problems=tuple(gpu_problems),
        mps_binary=mps_binaries.control if mps_binaries else None,
        mps_problems=tuple(mps_problems),
        taken_ports=_taken_ports(options),
        runs=known_runs(root),
        sizing=sizing,
        engine_problems=tuple(engine_problems),
        host_memory_available=psutil.virtual_memory().available,
        numactl=shutil.which("numactl"),
        host_problem=host_problem(options.host),
        mps_binaries=mps_binaries,
        command=invoked_as(),
        model=model,
        engine_python=python,
        state_root_free=free_bytes(root),
        slots=slots,
        gateway_problem=_gateway_problem(options, option_problems),
    )


def _gateway_problem(options: LaunchOptions, option_problems: list[str]) -> str | None:
    """--register: the gateway answers its worker API (with its key), before anything starts."""
    if options.register is None or option_problems:
        return None
    try:
        gateway = SglangGateway(options.register, timeout_s=5.0,
                                api_key=os.environ.get(GATEWAY_KEY_ENV))
        gateway.workers()
    except GatewayError as exc:
        return f"--register {options.register}: {exc}"
    return None


def look_up_gpus(options: LaunchOptions) -> tuple[tuple[GpuSlot, ...], list[str]]:
    """The run's GPU slots, read in one NVML session: `--gpu X` one (the CPU slot for --gpu
    none, or when there is no such GPU), `--gpus` every GPU it names (all: every one NVML
    sees); and why a GPU cannot be used. Only "is there such a GPU": what MPS needs of it is
    the MPS preflight's."""
    wanted, problems = _wanted_gpus(options)
    if problems:  # check_options says what is wrong with the --gpus list
        return (), []
    if not wanted:
        return (CPU_SLOT,), []
    inventory = query_gpus()
    if options.gpus is not None and _sees_none(inventory):
        return _unchecked_gpus(options, wanted, inventory)
    if wanted == ["all"]:
        wanted = [str(g.index) for g in inventory.gpus]
    found, problems = _pick_each(options, inventory, wanted)
    slots = tuple(GpuSlot(k, g, g.index, gpu_numa_node(g.pci_bus_id) if g.pci_bus_id else None)
                  for k, g in enumerate(found))
    return (slots or ((CPU_SLOT,) if options.gpus is None else ())), problems


def _pick_each(options: LaunchOptions, inventory: GpuInventory, wanted: list[str]
               ) -> tuple[list[GpuFacts], list[str]]:
    """Each GPU asked for, in the order given, and why one is not there (or named twice)."""
    found: list[GpuFacts] = []
    problems: list[str] = []
    for entry in wanted:
        gpu, lookup = pick_gpu(inventory, entry)
        problems += [_gpu_problem(p, options, entry) for p in lookup]
        twice = next((g for g in found if gpu is not None and g.index == gpu.index), None)
        if twice is not None:
            problems.append(f"--gpus {options.gpus} names {twice.label} twice ({entry} is GPU "
                            f"{twice.index}, listed before)")
        elif gpu is not None:
            found.append(gpu)
    return found, problems


def _wanted_gpus(options: LaunchOptions) -> tuple[list[str], list[str]]:
    """The GPUs asked for as entries to look up (["all"] for all, [] for none)."""
    if options.gpus is not None:
        return parse_gpu_list(options.gpus)
    if options.gpu == "none":
        return [], []
    return ["0" if options.gpu == "auto" else options.gpu], []


def _sees_none(inventory: GpuInventory) -> bool:
    return inventory.nvml_problem is not None or (inventory.count_error is None
                                                  and not inventory.gpus)


def _unchecked_gpus(options: LaunchOptions, wanted: list[str], inventory: GpuInventory
                    ) -> tuple[tuple[GpuSlot, ...], list[str]]:
    """--gpus where NVML sees no GPU: with --mps --no-gpu-check the indices as given
    (unchecked: the daemons run, the replicas on the CPU), else why not."""
    unchecked = options.mps and options.no_gpu_check
    if unchecked and wanted != ["all"] and all(e.isdigit() for e in wanted):
        return tuple(GpuSlot(k, None, int(e), None) for k, e in enumerate(wanted)), []
    why = (inventory.nvml_problem.message if inventory.nvml_problem is not None
           else "NVML sees no GPUs")
    hint = ("; with --no-gpu-check, --gpus takes GPU indices (not UUIDs or all) unchecked"
            if unchecked else "; run without --gpus to use the CPU")
    return (), [f"--gpus {options.gpus}: {why}{hint}"]


def _mps_preflight(options: LaunchOptions, slots: tuple[GpuSlot, ...], directory: Path,
                   sizing: EngineSizing | None) -> tuple[MpsBinaries | None, list[str]]:
    """With --mps, for each GPU slot: its own pipe directory and the clients its share of the
    replicas brings, checked on the GPU facts already read. The binaries found (the one search;
    a refused pair comes with a problem) and the problems: over several GPUs each names its
    GPU, and one with the binaries (the same for every GPU) is said once."""
    if not options.mps or not slots:
        return None, []
    binaries, problems = None, []
    per_replica = _cuda_processes(replace(options, replicas=1), sizing)
    counts = spread_counts(max(options.replicas, 1), len(slots))
    for slot, count in zip(slots, counts, strict=True):
        key = gpu_key(len(slots), slot.index, slot.slot)
        found, said = _preflight(options, slot.gpu, mps_pipe_dir(directory, key),
                                 per_replica * count)
        binaries = binaries or found
        for problem in said:
            named = problem.message
            if len(slots) > 1 and problem.check != "control_binary" \
                    and slot.title not in named:
                named = f"{slot.title}: {named}"
            if f"--mps: {named}" not in problems:
                problems.append(f"--mps: {named}")
    return binaries, problems


def _preflight(options: LaunchOptions, gpu: GpuFacts | None, pipe_dir: Path,
               clients: int) -> tuple[MpsBinaries | None, list[Problem]]:
    report = check_preflight(control_binary=options.mps_control, gpu=gpu,
                             pipe_dir=str(pipe_dir), num_client_processes=clients)
    return report.binaries, [p for p in report.problems
                             if p.check not in ("gpu", "nvml")  # the plan words those
                             and not (options.no_gpu_check and p.check in GPU_CHECKS)]


def _cuda_processes(options: LaunchOptions, sizing: EngineSizing | None = None) -> int:
    """What MPS's client limit must admit: each replica's CUDA processes, as its dry run's
    placement counts them (the built-in engine), else by its engine's estimate."""
    engine = ENGINES.get(options.engine)
    per_replica = engine.cuda_processes_per_replica if engine else 1
    if sizing is not None and sizing.cuda_processes is not None:
        per_replica = sizing.cuda_processes
    return max(options.replicas, 1) * per_replica


def _external_engine(options: LaunchOptions, python: str, option_problems: list[str]
                     ) -> tuple[ModelFacts | None, list[str]]:
    """The model directory (read, not loaded) and whether the engine's interpreter has it."""
    engine = ENGINES.get(options.engine)
    if engine is None or option_problems:
        return None, []
    problems = _engine_module_problems(python, engine.module or "", engine.name)
    model_path, _ = split_model(options.engine_args)
    if model_path is None:
        problems.append(f"engine {engine.name}: give the model directory after --, e.g. "
                        f"omni-dp launch --engine {engine.name} ... -- /models/my-model")
        return None, problems
    model, model_problems = read_model(model_path)  # its path absolute: see plan_replicas
    return model, problems + model_problems


def resolve_python(given: str | None) -> str:
    """The engine's interpreter as the replicas will run it: found on PATH like a shell would
    (`python3`), absolute (a replica runs in a working directory of its own), never resolved
    through its links (a venv's python is a link, and the link is the venv)."""
    if not given:
        return sys.executable
    found = shutil.which(given) if os.sep not in given else given
    return os.path.abspath(found or given)


PROBE_SENTINEL = "omni-dp-engine-probe"
PROBE_TIMEOUT_S = 60.0
PROBE_OUTPUT_LIMIT = 4096  # a probe prints one line; anything else is not the interpreter


def _engine_module_problems(python: str, module: str, name: str) -> list[str]:
    """Whether `python` is a Python that can import the engine's package (found, not
    imported: importing vLLM takes seconds)."""
    top = module.split(".", 1)[0]
    hint = "install it there, or point --engine-python at the interpreter that has it"
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        return [f"--engine-python {python}: not an executable file"]
    probe = ("import importlib.util, sys; "
             f"print({PROBE_SENTINEL!r}, bool(importlib.util.find_spec({top!r})))")
    code, out = _bounded_run([python, "-c", probe])
    if code is None:
        return [f"engine {name}: {python} did not answer within {PROBE_TIMEOUT_S:.0f} s"]
    words = out.split()
    if code != 0 or len(words) != 2 or words[0] != PROBE_SENTINEL:
        return [f"--engine-python {python}: not a Python interpreter that runs (asked to look "
                f"for the module {top!r}, it exited {code} saying {out[:120]!r})"]
    if words[1] != "True":
        return [f"engine {name}: {python} has no module {top!r}; {hint}"]
    return []


def _bounded_run(argv: list[str]) -> tuple[int | None, str]:
    """(exit code, the first PROBE_OUTPUT_LIMIT bytes of its output); (None, ...) on timeout.
    Hand-written over subprocess.run, which keeps everything a wrong program prints (`yes`
    would fill memory until the timeout): read what is needed, then stop it."""
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    except OSError as exc:
        return 126, str(exc)
    deadline = time.monotonic() + PROBE_TIMEOUT_S
    out = b""
    with proc:
        while len(out) < PROBE_OUTPUT_LIMIT:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
                proc.kill()
                return None, out.decode(errors="replace")
            data = os.read(proc.stdout.fileno(), PROBE_OUTPUT_LIMIT)
            if not data:
                break
            out += data
        if len(out) >= PROBE_OUTPUT_LIMIT:
            proc.kill()
        try:
            code = proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            return None, out.decode(errors="replace")
    return code, out[:PROBE_OUTPUT_LIMIT].decode(errors="replace")


def _taken_ports(options: LaunchOptions) -> frozenset[int]:
    taken = {p for p in replica_ports(options) if port_taken("127.0.0.1", p)}
    if port_taken(options.host, options.router_port):
        taken.add(options.router_port)
    return frozenset(taken)


def _dry_run(options: LaunchOptions, gpu: GpuFacts | None, option_problems: list[str],
             directory: Path) -> tuple[EngineSizing | None, list[str]]:
    """With --share-weights the dry run is a leader's (the share directory named, not made), so
    that a model whose architecture has no share policy is refused before anything starts."""
    engine = ENGINES.get(options.engine)
    if engine is None or option_problems:
        return None, []
    device = "cuda" if gpu is not None else "cpu"
    # Not through anyone's MPS daemon: the dry run may create a CUDA context (to read free
    # memory) before ours exists. Without a pipe directory a CUDA client tries the system
    # default (/tmp/nvidia-mps) and would join whatever daemon answers there; a private,
    # empty one has none, so the client falls back to a plain context of its own.
    with tempfile.TemporaryDirectory(prefix="omni-dp-dry-run-") as no_daemon:
        env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
        env["CUDA_MPS_PIPE_DIRECTORY"] = no_daemon
        env["CUDA_VISIBLE_DEVICES"] = visible_id(gpu)
        return engine.dry_run(
            ReplicaLaunch(port=options.base_port, device=device, threads=1,
                          kv_cache_bytes=options.kv_cache_bytes,
                          max_total_tokens=options.max_total_tokens,
                          share_role=LEADER_ROLE if options.share_weights else None,
                          share_dir=share_dir(directory) if options.share_weights else None),
            options.engine_args, env)


def _gpu_problem(problem: Problem, options: LaunchOptions, wanted: str) -> str:
    """The GPU lookup's words: --gpus names the entry; --gpu an MPS run's where it asked for
    MPS, else without MPS."""
    if options.gpus is not None:
        return problem.message.replace("--gpu ", "--gpus entry ", 1)
    if options.mps:
        return in_mps_words(problem, wanted).message
    if problem.message.startswith(NO_DRIVER):
        return (f"--gpu {options.gpu}: there is no NVIDIA driver on this machine "
                "(libnvidia-ml not found); use --gpu none to run on the CPU")
    return problem.message
