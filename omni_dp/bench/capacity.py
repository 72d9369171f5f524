"""How many replicas FIT a machine: pure arithmetic over one replica's probed footprint and
the machine's facts, with the launcher's own formulas and limits (its memory formula and
headroom, whole-core CPU blocks, MPS's client limit), so that what `plan` says fits is what
`launch` accepts.

Fits, not faster: whether N replicas serve more than one is for `omni-dp bench` to measure,
and the plan ends with the exact bench command that would.
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass

from omni_dp.cpulist import format_cpu_list
from omni_dp.gpus import GpuFacts
from omni_dp.launcher.engines import EngineSizing
from omni_dp.launcher.planning.memory import memory_formula
from omni_dp.launcher.planning.topology import CpuTopology
from omni_dp.mps.preflight import check_client_limit
from omni_dp.sizes import format_size

MAX_CLIENTS_ASKED = 1024  # beyond any MPS client limit: where the search for it stops


@dataclass(frozen=True)
class Limit:
    """One limit on N: its name, the largest N it allows (None: it does not apply), and the
    formula with its numbers."""

    name: str  # "memory", "memory (shared)" (with --share-weights), "cpu cores", "mps clients"
    n: int | None
    formula: str


@dataclass(frozen=True)
class Capacity:
    """The largest N per limit (per GPU with several), the N that fits them all, the
    configurations to bench, and the command that would."""

    footprint: str  # one replica's static footprint, in words
    usable_memory_bytes: int  # per GPU (or of the host on the CPU)
    n_memory: int
    n_memory_shared: int | None  # None: the engine cannot share weights
    n_cores: int
    n_mps_clients: int | None  # None without a GPU (MPS needs one)
    n_fits: int  # min of the limits, without sharing
    n_fits_shared: int | None  # the same with --share-weights; None when it cannot share
    gpu_count: int  # N is per GPU; n_fits_total is over all of them
    limits: tuple[Limit, ...]
    limiting: tuple[str, ...]  # the limits that set n_fits
    candidates: tuple[str, ...]  # bench configuration names: 1, 2mps, 3mps (2, 3 on CPU)
    bench_command: str | None  # None when not even one replica fits
    notes: tuple[str, ...] = ()

    @property
    def n_fits_total(self) -> int:
        return self.n_fits * self.gpu_count

    def to_json(self) -> dict:
        return {**asdict(self), "n_fits_total": self.n_fits_total}


def footprint_text(s: EngineSizing) -> str:
    weights = format_size(s.weights_bytes)
    if s.shared_weights_bytes:
        weights += (f" ({format_size(s.shared_weights_bytes)} shareable, "
                    f"{format_size(s.private_weights_bytes)} private)")
    tokens = f" ({s.kv_tokens} tokens)" if s.kv_tokens is not None else ""
    what = "CUDA context, activations, buffers" if s.device.startswith("cuda") else (
        "runtime, activations, buffers")
    return (f"weights {weights} + KV {format_size(s.kv_cache_bytes)}{tokens} + overhead "
            f"{format_size(s.overhead_bytes)} ({what}) = {format_size(s.total_bytes)} on "
            f"{s.device}")


def usable_memory(gpu: GpuFacts | None, headroom: float, host_memory: int | None
                  ) -> tuple[int, str]:
    """What the replicas may take, as the launcher's fit check counts it: the GPU's total less
    the headroom and what is already in use; on the CPU the host memory available."""
    if gpu is None:
        available = host_memory or 0
        return available, f"host memory available {format_size(available)}"
    total = gpu.memory_total_bytes or 0
    used = gpu.memory_used_bytes or 0
    usable = max(int(total * (1 - headroom)) - used, 0)
    return usable, (f"{gpu.label} {format_size(total)} × (1 − {headroom:.0%} headroom) − "
                    f"{format_size(used)} in use = {format_size(usable)} usable")


def _largest(usable: int, fixed: int, each: int) -> int:
    """The largest N with fixed + N × each ≤ usable."""
    if each <= 0 or usable < fixed:
        return 0
    return (usable - fixed) // each


def memory_limit(sizing: EngineSizing, usable: int, usable_words: str, share: bool) -> Limit:
    """N by memory: the launcher's formula (memory_formula), N the largest it fits."""
    s = sizing
    if share:
        n = _largest(usable, s.shared_weights_bytes,
                     s.private_weights_bytes + s.kv_cache_bytes + s.overhead_bytes)
        name = "memory (shared)"  # with --share-weights
    else:
        n = _largest(usable, 0, s.total_bytes)
        name = "memory"
    if n >= 1:
        fits = f"{memory_formula(s, n, share)[1].split(' (without')[0]} fits"
    else:
        fits = "not even one replica fits"
    beyond = memory_formula(s, n + 1, share)[0]
    return Limit(name, n, f"{usable_words}: {fits}; {n + 1} would need {format_size(beyond)}")


def cores_limit(topology: CpuTopology, cores_per_replica: int, gpus: int) -> Limit:
    """N by whole-core CPU blocks (the launcher's `--cpu-blocks auto`): SMT siblings are one
    core, no core serves two replicas."""
    cores = len(topology.cores)
    total = cores // cores_per_replica
    n = total // gpus
    formula = (f"{cores} physical cores this process may use "
               f"({format_cpu_list(topology.allowed)}) ÷ {cores_per_replica} per replica = "
               f"{total}")
    if gpus > 1:
        formula += f" in all, ÷ {gpus} GPUs = {n} per GPU"
    return Limit("cpu cores", n, formula)


def client_cap(capability: tuple[int, int] | None) -> int:
    """The most MPS clients one GPU admits, as the MPS preflight (check_client_limit) rules."""
    cap = 0
    while cap < MAX_CLIENTS_ASKED and not check_client_limit(cap + 1, capability):
        cap += 1
    return cap


def mps_limit(gpu: GpuFacts, cuda_processes_per_replica: int) -> Limit:
    cap = client_cap(gpu.capability)
    if gpu.capability is None:
        which = "compute capability unknown, taken as Volta or newer"
    else:
        which = f"compute capability {gpu.capability[0]}.{gpu.capability[1]}"
    if cuda_processes_per_replica <= 0:
        return Limit("mps clients", None, "no replica process holds a CUDA context")
    n = cap // cuda_processes_per_replica
    return Limit("mps clients", n,
                 f"MPS admits {cap} clients per GPU ({which}, CUDA ≤ 13.0) ÷ "
                 f"{cuda_processes_per_replica} CUDA process(es) per replica = {n}")


def config_names(n: int, mps: bool) -> tuple[str, ...]:
    """`omni-dp bench --configs` names for 1..n replicas: 1, 2mps, 3mps on a GPU (under MPS);
    1, 2, 3 on the CPU."""
    return tuple("1" if k == 1 else f"{k}mps" if mps else str(k) for k in range(1, n + 1))


def bench_command(command: str, configs: tuple[str, ...], bench_args: tuple[str, ...],
                  engine_args: tuple[str, ...]) -> str:
    """The exact `omni-dp bench` command line (`command` is how omni-dp was run, already
    quoted for the shell)."""
    line = f"{command} bench --configs {','.join(configs)}"
    if bench_args or engine_args:  # launch's options after `--`, the engine's after another
        line += " --" + ("" if not bench_args else " " + shlex.join(bench_args))
    if engine_args:
        line += " -- " + shlex.join(engine_args)
    return line


def _notes(n_fits: int, n_shared: int | None, sizing: EngineSizing, gpus: int) -> list[str]:
    if n_fits > 1:
        notes = [f"fits, not faster: whether {n_fits} replicas serve more than one is for "
                 "`omni-dp bench` to measure"]
    elif n_fits == 1:
        notes = ["only one replica fits: there is no data-parallel configuration to bench"]
    else:
        notes = ["not even one replica fits: lower the KV size or use a larger device"]
    if n_shared is not None and n_shared > n_fits:
        notes.append(f"with --share-weights {n_shared} fit: the "
                     f"{format_size(sizing.shared_weights_bytes)} of shareable weights held "
                     "once, not once per replica"
                     + (" (one launch per GPU: sharing spans one GPU)" if gpus > 1 else ""))
    if gpus > 1:
        notes.append(f"N is per GPU: {n_fits} on each of {gpus} GPUs, {n_fits * gpus} in all")
    notes.append("the router, the supervisor and the bench's load generator run unpinned on "
                 "the same cores as the replicas")
    return notes


def plan_capacity(sizing: EngineSizing, gpu: GpuFacts | None, topology: CpuTopology, *,
                  headroom: float, shares_weights: bool, cuda_processes_per_replica: int,
                  cores_per_replica: int = 1, gpus: int = 1, host_memory: int | None = None,
                  command: str = "omni-dp", bench_args: tuple[str, ...] = (),
                  engine_args: tuple[str, ...] = ()) -> Capacity:
    """Every limit on N (per GPU), the N that fits them all, and the bench that would tell
    whether they pay. `gpu` is the GPU each replica gets (of several: the one with the least
    usable memory); None on the CPU, where `host_memory` is what the replicas may take."""
    usable, usable_words = usable_memory(gpu, headroom, host_memory)
    plain = memory_limit(sizing, usable, usable_words, share=False)
    shared = (memory_limit(sizing, usable, usable_words, share=True) if shares_weights
              else None)
    cores = cores_limit(topology, cores_per_replica, gpus)
    mps = mps_limit(gpu, cuda_processes_per_replica) if gpu is not None else None
    others = [limit for limit in (cores, mps) if limit is not None and limit.n is not None]
    n_fits = min([plain.n, *(limit.n for limit in others)])
    n_shared = (min([shared.n, *(limit.n for limit in others)]) if shared is not None
                else None)
    limits = tuple(limit for limit in (plain, shared, cores, mps) if limit is not None)
    limiting = tuple(limit.name for limit in (plain, *others) if limit.n == n_fits)
    candidates = config_names(n_fits, mps=gpu is not None)
    notes = _notes(n_fits, n_shared, sizing, gpus)
    return Capacity(
        footprint=footprint_text(sizing), usable_memory_bytes=usable, n_memory=plain.n,
        n_memory_shared=shared.n if shared is not None else None, n_cores=cores.n,
        n_mps_clients=mps.n if mps is not None else None, n_fits=n_fits,
        n_fits_shared=n_shared, gpu_count=gpus, limits=limits, limiting=limiting,
        candidates=candidates,
        bench_command=(bench_command(command, candidates, bench_args, engine_args)
                       if candidates else None),
        notes=tuple(notes))
