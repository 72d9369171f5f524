"""Options + machine facts in, a validated launch plan (or every problem at once) out.

Pure: no file, socket, process or daemon is created here, so a bad launch exits 2 with nothing
left behind, and tests can plan for machines they do not have.

A pipeline of sub-planners, each `(options, facts[, earlier parts]) -> (part | None, problems)`.
A part is None when it has a problem of its own, or when an option it reads was refused
(check_options says why, once); no planner builds on a part that is None. plan_launch runs them
all, so every problem is reported at once, and builds the replicas and the router only from
complete parts.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from omni_dp.contract import REPLICA_ENV, RUN_ID_ENV, Problems
from omni_dp.cpulist import format_cpu_list
from omni_dp.launcher.engines import ENGINES
from omni_dp.launcher.engines.base import EngineSizing, ReplicaLaunch, split_model
from omni_dp.launcher.planning.checks import (
    check_options,
    is_loopback_url,
)
from omni_dp.launcher.planning.cpus import CpuPart, plan_cpus
from omni_dp.launcher.planning.devices import GpuPart, plan_gpus, plan_mps
from omni_dp.launcher.planning.facts import LaunchFacts, visible_id
from omni_dp.launcher.planning.gpus import GpuGroup, with_gpu_replicas
from omni_dp.launcher.planning.memory import (
    KvPart,
    memory_formula,
    plan_kv,
    plan_memory,
    plan_mps_memory_limit,
    plan_share_room,
)
from omni_dp.launcher.planning.options import LaunchOptions, options_record
from omni_dp.launcher.planning.run import (
    TRACED_ENGINES,
    RunPart,
    plan_ports,
    plan_router,
    plan_run,
    plan_state_root,
    tracing_argv,
)
from omni_dp.launcher.planning.share_group import LEADER, followers, share_role
from omni_dp.mps.binaries import MpsBinaries
from omni_dp.rundir import (
    engine_work_dir,
    mps_log_dir,
    mps_pipe_dir,
    numeric_check_file,
    share_dir,
)
from omni_dp.runfile import GpuRecord, PlanRecord, RouterPlan, SupervisionSettings, gpu_key
from omni_dp.sizes import format_size

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                    "NUMEXPR_NUM_THREADS")
NO_DRY_RUN = ("the engine's dry run did not run, so the replicas' sizes are unknown; run "
              "`omni-dp serve --dry-run` with the engine arguments to see why")


class LaunchPlanError(Problems):
    """Every problem that stops this launch, before anything was started."""


@dataclass(frozen=True)
class ReplicaPlan:
    index: int
    port: int
    cpus: tuple[int, ...] | None  # None: unpinned (--cpu-blocks none)
    argv: tuple[str, ...]  # the pinning wrapper, then the engine
    env: dict[str, str]  # what the launcher sets (the run token is added at spawn, not kept)
    gpu: int = 0  # the slot of its GPU in LaunchPlan.gpus

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_name(self) -> str:
        return f"replica_{self.index}.log"


@dataclass(frozen=True)
class LaunchPlan:
    options: LaunchOptions
    run_id: str
    run_dir: Path
    device: str  # "cpu" or "cuda"
    start: str
    replicas: tuple[ReplicaPlan, ...]
    router_argv: tuple[str, ...]
    router_url: str
    expected_kv_tokens: int | None  # what every replica must report (None: equal to each other)
    sizing: EngineSizing
    mps_binary: str | None
    warnings: tuple[str, ...] = field(default=())
    mps_binaries: MpsBinaries | None = None  # the located pair; mps_binary is its control
    command: str = "omni-dp"  # how the user runs omni-dp, for the commands we print
    start_timeout: float = 300.0  # --start-timeout, or the engine's default
    kv_notes: tuple[str, ...] = ()  # how the engine adapter wrote the KV pin
    gpus: tuple[GpuRecord, ...] = ()  # the run's GPUs by slot (one "cpu" slot without one)

    @property
    def gpu_label(self) -> str:
        """Its slots' labels, comma-separated ("GPU-<uuid>", or "cpu"): run.json's "gpu"."""
        return ",".join(g.label for g in self.gpus)

    @property
    def gpu_numa_node(self) -> int | None:
        """The first slot's NUMA node: run.json's plan keeps it."""
        return self.gpus[0].numa_node if self.gpus else None

    def describe(self) -> list[str]:
        """The resolved plan, as printed before anything starts."""
        o = self.options
        s = self.sizing
        sharing = followers(o.share_weights, (r.index for r in self.replicas))
        weights = format_size(s.weights_bytes)
        if o.share_weights:
            weights += (f" ({format_size(s.shared_weights_bytes)} shared, "
                        f"{format_size(s.private_weights_bytes)} private)")
        several = len(self.gpus) > 1
        where = (f"{len(self.gpus)} GPUs" if several else self.gpu_label)
        daemon = (" under a private MPS daemon per GPU" if several
                  else " under a private MPS daemon")
        lines = [
            f"run {self.run_id}: {len(self.replicas)} replica(s) of engine {o.engine} on "
            f"{where}{daemon if o.mps else ''}",
            f"  state        {self.run_dir}",
            *([f"  model        {s.model}"] if s.model else []),
            f"  per replica  weights {weights} + KV "
            f"{format_size(s.kv_cache_bytes)} ({self._kv_words()}) + overhead "
            f"{format_size(s.overhead_bytes)} on {s.device}",
            *(f"  kv pin       {note}" for note in self.kv_notes),
            *([f"  processes    {self._processes_words()}"] if len(s.processes) > 1 else []),
            *self._memory_lines(),
            *([f"  share        replica {LEADER} leads (loads the weights, publishes them in "
               f"{share_dir(self.run_dir)}); "
               + (f"replica(s) {', '.join(map(str, sharing))} follow "
                  "(map them), started once it published, stopped before it"
                  if sharing else "no follower")] if o.share_weights else []),
            *self._cap_lines(),
            f"  start        {self.start} (each healthy within {self.start_timeout:g} s)",
            f"  router       {self.router_url} (policy {o.policy}, {o.router_workers} "
            "worker(s))",
        ]
        for r in self.replicas:
            cpus = format_cpu_list(r.cpus) if r.cpus else "unpinned"
            on = f"  {self.gpus[r.gpu].title}" if several else ""
            lines.append(f"  replica {r.index}    {r.url}  cpus {cpus}{on}")
        lines += [f"  warning: {w}" for w in self.warnings]
        return lines

    def _cap_lines(self) -> list[str]:
        o = self.options
        caps = [f"{o.mps_thread_percentage:g}% of the SMs"] if o.mps_thread_percentage else []
        if o.mps_memory_limit is not None:
            caps.append(f"{format_size(o.mps_memory_limit)} of pinned memory")
        if not caps:
            return []
        check = ("; each replica passes a BF16 GEMM check under them before it starts"
                 if o.mps_thread_percentage is not None else "")
        return [f"  mps caps     {' and '.join(caps)} per replica process{check}"]

    def _memory_lines(self) -> list[str]:
        """The fit formula: the run's, or each GPU's with its share of the replicas."""
        o, s = self.options, self.sizing
        if len(self.gpus) <= 1:
            return [f"  memory       {memory_formula(s, len(self.replicas), o.share_weights)[1]}"]
        lines = []
        for gpu in self.gpus:
            mine = [r.index for r in self.replicas if r.gpu == gpu.slot]
            node = f", NUMA node {gpu.numa_node}" if gpu.numa_node is not None else ""
            lines.append(f"  {gpu.title:<12} replicas {format_cpu_list(mine)}{node}: "
                         f"{memory_formula(s, len(mine), o.share_weights)[1]}")
        return lines

    def _processes_words(self) -> str:
        """Each replica's processes by its placement, and the CUDA ones of the run."""
        s = self.sizing
        words = ", ".join(f"{name} ({device})" for name, device in s.processes) + " per replica"
        cuda = (s.cuda_processes or 0) * len(self.replicas)
        if cuda:
            words += f"; {cuda} CUDA process(es) in all, each an MPS client under --mps"
        return words

    def _kv_words(self) -> str:
        """What the KV line may claim: pinned (to what), or sized by the engine itself."""
        o, s = self.options, self.sizing
        pinned = o.kv_cache_bytes is not None or o.max_total_tokens is not None
        if not s.keeps_kv:
            return "none: the model keeps no KV cache, so there is nothing to pin"
        if not pinned and ENGINES[o.engine].fixed_default_kv:
            return f"{s.kv_tokens} tokens; pinned to the engine's fixed default"
        if not pinned:
            return "not pinned: one replica sizes its own pool, read back"
        if s.kv_tokens is None:
            return "tokens: the engine's count from the bytes, read back and compared"
        return f"{s.kv_tokens} tokens"

    def record(self) -> PlanRecord:
        """What run.json keeps of this plan (`to_json` is its JSON, for --dry-run --json and
        the run_created event)."""
        o = self.options
        return PlanRecord(
            replicas=len(self.replicas), engine=o.engine, engine_args=tuple(o.engine_args),
            config_file=o.config_file, device=self.device, gpu=self.gpu_label,
            gpu_numa_node=self.gpu_numa_node, mps=o.mps, start=self.start,
            cpu_blocks=o.cpu_blocks, kv_cache_bytes=o.kv_cache_bytes,
            max_total_tokens=o.max_total_tokens, expected_kv_tokens=self.expected_kv_tokens,
            router=RouterPlan(self.router_url, o.policy, o.router_workers,
                              tuple(self.router_argv)),
            supervision=SupervisionSettings(
                check_interval=o.check_interval, restart_after_failures=o.restart_after_failures,
                restart_budget=o.restart_budget, restart_window=o.restart_window,
                on_mps_fault=o.on_mps_fault, start_timeout=self.start_timeout,
                drain_timeout=o.drain_timeout),
            log_format=o.log_format,  # the supervisor's and the replica log banners'
            warnings=tuple(self.warnings),
            command=self.command,  # for the commands the detached supervisor prints
            api_key_set=o.api_key is not None,  # the key itself never goes to disk
            share_weights=o.share_weights, register=o.register, register_as=o.register_as,
            register_url=o.register_url, replicas_per_gpu=o.replicas_per_gpu,
            options=options_record(o), mps_thread_percentage=o.mps_thread_percentage,
            mps_memory_limit=o.mps_memory_limit)

    def to_json(self) -> dict:
        return self.record().to_json()

    def gpus_json(self) -> list[dict]:
        """Each GPU slot with its replicas (run.json keeps them as the record's `gpus`)."""
        return [{**g.to_json(), "replicas": [r.index for r in self.replicas if r.gpu == g.slot]}
                for g in self.gpus]


# --- the plan, from its parts ------------------------------------------------------------------

T = TypeVar("T")


def _take(planned: tuple[T | None, list[str]], problems: list[str]) -> T | None:
    """A sub-planner's part; its problems join the plan's."""
    part, found = planned
    problems.extend(found)
    return part


def plan_launch(o: LaunchOptions, facts: LaunchFacts, *,
                earlier_problems: tuple[str, ...] | list[str] = ()) -> LaunchPlan:
    """earlier_problems: found before planning (the --config file's); reported with the
    plan's. The engine's dry run is skipped while any exist, so no plan can be made then."""
    o, spread_problems = with_gpu_replicas(o, len(facts.slots))  # the run's total, fixed here
    problems = [*earlier_problems, *check_options(o), *spread_problems]
    gpu = _take(plan_gpus(o, facts), problems)
    mps = _take(plan_mps(o, facts), problems)
    run = _take(plan_run(o, facts), problems)
    _take(plan_state_root(facts), problems)
    ports = _take(plan_ports(o, facts), problems)
    router = _take(plan_router(o, facts), problems)
    if facts.gateway_problem:
        problems.append(facts.gateway_problem)
    cpus = _take(plan_cpus(o, facts, gpu), problems)
    kv = _take(plan_kv(o, facts, gpu), problems)
    _take(plan_memory(o, facts, gpu, kv), problems)
    _take(plan_share_room(o, facts, gpu, kv), problems)
    _take(plan_mps_memory_limit(o, kv), problems)
    if problems:
        raise LaunchPlanError(problems)
    if kv is None:  # no dry run, and nothing said why: never plan without the engine's word
        raise LaunchPlanError([NO_DRY_RUN])
    # Without a problem every part is there: a part is None only with a problem of its own or
    # one of check_options'.
    parts = (gpu, mps, run, ports, router, cpus)
    assert all(part is not None for part in parts), "a part failed without saying why"
    replicas = plan_replicas(o, facts, run, gpu, ports, cpus, kv)
    router_argv = [*router.argv]
    for r in replicas:
        router_argv += ["--replica", f"{r.index}={r.url}"]
    engine = ENGINES[o.engine]
    # An engine that sizes KV from the memory free at its start sees the others' footprint
    # only once they are up: one after another. A fixed size can start together.
    start = o.start or ("sequential" if engine.kv_profiled else "parallel")
    return LaunchPlan(
        options=o, run_id=run.run_id, run_dir=run.directory, device=gpu.device, start=start,
        replicas=replicas, router_argv=tuple(router_argv), router_url=router.url,
        expected_kv_tokens=kv.pin.expected_tokens, sizing=kv.sizing, mps_binary=mps.binary,
        mps_binaries=mps.binaries,
        warnings=(*gpu.warnings, *_neighbour_warnings(run, gpu, facts), *cpus.warnings,
                  *_share_warnings(o), *_register_warnings(o, router.url)),
        command=facts.command,
        start_timeout=o.start_timeout if o.start_timeout is not None else engine.start_timeout_s,
        kv_notes=kv.pin.notes, gpus=tuple(g.record() for g in gpu.groups),
    )


def plan_replicas(o: LaunchOptions, facts: LaunchFacts, run: RunPart, gpu: GpuPart,
                  ports: tuple[int, ...], cpus: CpuPart, kv: KvPart) -> tuple[ReplicaPlan, ...]:
    """Each replica's port, CPU block, environment and command line, from complete parts."""
    engine = ENGINES[o.engine]
    external = engine.external
    engine_args = o.engine_args
    if external and facts.model is not None:  # the directory as read (absolute: see facts)
        engine_args = (str(facts.model.path), *split_model(o.engine_args)[1])
    if o.engine in TRACED_ENGINES:
        engine_args = (*engine_args, *tracing_argv(o))
    replicas = []
    for i, (port, block) in enumerate(zip(ports, cpus.blocks, strict=True)):
        group = gpu.group_of(i)
        threads = len(block) if block else max(1, len(facts.topology.allowed) // o.replicas)
        launch = ReplicaLaunch(
            port, gpu.device, threads, o.kv_cache_bytes, o.max_total_tokens,
            log_format=o.log_format,
            python=facts.engine_python if external else None, kv_args=kv.of(group.slot).args,
            cpus=block, work_dir=engine_work_dir(run.directory, i) if external else None,
            share_role=share_role(o.share_weights, i),
            share_dir=share_dir(run.directory) if o.share_weights else None)
        argv = engine.argv(launch, engine_args)
        if o.mps_thread_percentage is not None:  # an SM cap: its numeric check first
            argv = [*_numeric_gate(launch.python or sys.executable, gpu.device,
                                   numeric_check_file(run.directory, i)), *argv]
        env = {**_replica_env(o, run, gpu, group, i, threads), **engine.environment(launch)}
        pinned = _pinned(argv, block, facts, group.numa_node)
        replicas.append(ReplicaPlan(i, port, block, tuple(pinned), env, group.slot))
    return tuple(replicas)


def _replica_env(o: LaunchOptions, run: RunPart, gpu: GpuPart, group: GpuGroup, index: int,
                 threads: int) -> dict[str, str]:
    """Its GPU alone visible (by UUID; an unchecked GPU is none: the replica runs on the
    CPU), and under --mps its GPU's daemon's pipe."""
    env = {RUN_ID_ENV: run.run_id, REPLICA_ENV: str(index),
           "CUDA_VISIBLE_DEVICES": visible_id(group.gpu),
           **{name: str(threads) for name in THREAD_VARIABLES}}
    if o.mps:
        key = gpu_key(len(gpu.groups), group.index, group.slot)
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(mps_pipe_dir(run.directory, key))
        env["CUDA_MPS_LOG_DIRECTORY"] = str(mps_log_dir(run.directory, key))
        env.update(mps_limit_env(o))
    return env


def mps_limit_env(o: LaunchOptions) -> dict[str, str]:
    """The caps as a client's environment: the memory limit keyed by device index (0, the
    one GPU a replica sees; MPS ignores UUID keys), in MiB."""
    env = {}
    if o.mps_thread_percentage is not None:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = f"{o.mps_thread_percentage:g}"
    if o.mps_memory_limit is not None:
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={o.mps_memory_limit // 1024**2}M"
    return env


def _register_warnings(o: LaunchOptions, router_url: str) -> list[str]:
    """What a gateway will not do with what --register hands it."""
    if o.register is None:
        return []
    warnings = []
    if ENGINES[o.engine].example != "completions":
        warnings.append(f"--register: the SGLang model gateway does not proxy "
                        f"/v1/audio/speech; engine {o.engine}'s speech goes through this host's "
                        f"router ({router_url}) only, the gateway lists the replicas")
    if o.register_as == "replicas" and not is_loopback_url(o.register):
        warnings.append(f"--register {o.register}: the replicas listen on 127.0.0.1, so that "
                        "gateway must run on this host; from elsewhere register the router "
                        "(--register-as router --register-url http://THIS_HOST:PORT, --host "
                        "0.0.0.0)")
    return warnings


def _share_warnings(o: LaunchOptions) -> list[str]:
    if o.share_weights and o.replicas == 1:
        return ["--share-weights with one replica: replica 0 leads and shares with nobody "
                "(its weights are published all the same)"]
    return []


def _neighbour_warnings(run: RunPart, gpu: GpuPart, facts: LaunchFacts) -> list[str]:
    """Other runs on the same GPU: stale state to remove, or a live run to share it with."""
    warnings = []
    mine = set(gpu.label.split(","))
    for other in facts.runs:
        if other.run_id == run.run_id or not mine & set((other.gpu or "").split(",")):
            continue
        if not other.live:
            warnings.append(f"stale state of run {other.run_id} (same GPU) is kept at "
                            f"{other.directory}; `{facts.command} down {other.run_id}` "
                            "removes it")
        elif gpu.device == "cuda":
            warnings.append(f"run {other.run_id} is live on the same GPU; both runs will "
                            "share it")
    return warnings


def _numeric_gate(python: str, device: str, record: Path) -> list[str]:
    """Before an SM-capped replica's engine: its BF16 GEMM check, with the engine's own
    interpreter under the replica's caps (processes/numeric_gate.py); exec keeps the pid."""
    return [sys.executable, "-m", "omni_dp.launcher.processes.numeric_gate", "--python", python,
            "--device", device, "--record", str(record), "--"]


def _pinned(argv: list[str], cpus: tuple[int, ...] | None, facts: LaunchFacts,
            node: int | None) -> list[str]:
    """Pin before the engine executes anything: our exec wrapper sets the affinity, then (when
    numactl is there and the block is on its GPU's node) numactl binds memory to that node."""
    if not cpus:
        return argv
    prefix = [sys.executable, "-m", "omni_dp.launcher.processes.pin", format_cpu_list(cpus), "--"]
    nodes = {core.node for core in facts.topology.cores if set(core.cpus) & set(cpus)}
    if facts.numactl and node is not None and nodes == {node}:
        prefix += [facts.numactl, f"--membind={node}", "--"]
    return prefix + argv


