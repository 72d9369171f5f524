"""KV and memory fit: the KV pin every replica gets (one token count for the run, the engine's
knobs per GPU), and whether N replicas of weights + KV + overhead fit each GPU (or the host),
with and without shared weights."""

from __future__ import annotations

from dataclasses import dataclass

from omni_dp.gpus import GpuFacts
from omni_dp.launcher.engines import ENGINES
from omni_dp.launcher.engines.base import EngineSizing, KvPlan, KvRequest
from omni_dp.launcher.planning.checks import (
    kv_pin_problems,
    kv_size_problems,
    memory_headroom_problems,
    replica_count_problems,
)
from omni_dp.launcher.planning.devices import GpuPart
from omni_dp.launcher.planning.facts import LaunchFacts
from omni_dp.launcher.planning.options import LaunchOptions
from omni_dp.sizes import format_size

SEGMENT_SLACK_BYTES = 16 * 1024**2


@dataclass(frozen=True)
class KvPart:
    pin: KvPlan  # the engine adapter's: its arguments, what every replica holds and reports
    per_gpu: tuple[KvPlan, ...] = ()  # each GPU slot's pin (its own size)

    @property
    def sizing(self) -> EngineSizing:
        return self.pin.sizing

    def of(self, slot: int) -> KvPlan:
        """GPU slot's pin: the same tokens everywhere, the engine's knobs per GPU."""
        return self.per_gpu[slot] if self.per_gpu else self.pin


def plan_kv(o: LaunchOptions, facts: LaunchFacts,
            gpu: GpuPart | None = None) -> tuple[KvPart | None, list[str]]:
    """The KV pin in the engine's own knobs, from the engine's word on its sizes (the builtin
    engine's dry run, an external engine's model directory): one per GPU slot (its knobs may
    depend on the GPU's size), one token count for all."""
    engine = ENGINES.get(o.engine)
    if engine is None or kv_pin_problems(o) or kv_size_problems(o):
        return None, list(facts.engine_problems)
    if engine.needs_gpu and gpu is None:  # plan_gpus said why; a pin needs the GPU's size
        return None, list(facts.engine_problems)
    device = gpu.device if gpu is not None else ("cuda" if facts.first_gpu else "cpu")
    targets = _kv_targets(o, facts, gpu)
    pins, problems = [], list(facts.engine_problems)
    for title, on, replicas in targets:
        pin, found = engine.plan_kv(_kv_request(o, facts, device, on, replicas))
        problems += [p if title is None or title in p else f"{title}: {p}" for p in found]
        pins.append(pin)
    if problems or any(pin is None for pin in pins):
        return None, problems
    return _same_tokens(targets, pins)


def _same_tokens(targets: list[tuple[str | None, GpuFacts | None, int]], pins: list[KvPlan]
                 ) -> tuple[KvPart | None, list[str]]:
    """Every replica holds the same KV: the GPUs' pins must agree on its tokens."""
    tokens = {title: pin.expected_tokens
              for (title, _, _), pin in zip(targets, pins, strict=True)}
    if len(set(tokens.values())) > 1:
        return None, ["the GPUs' KV pins differ: " + ", ".join(
            f"{title} {count} tokens" for title, count in tokens.items())
            + "; every replica must hold the same KV: pin it by --max-total-tokens, or list "
            "GPUs of one model in --gpus"]
    return KvPart(pins[0], tuple(pins)), []


def _kv_targets(o: LaunchOptions, facts: LaunchFacts, gpu: GpuPart | None
                ) -> list[tuple[str | None, GpuFacts | None, int]]:
    """What each pin is planned for: (its GPU's title where there are several, the GPU, its
    replicas); without a GPU part (refused elsewhere) the first GPU, all the replicas."""
    if gpu is None or len(gpu.groups) == 1:
        return [(None, gpu.groups[0].gpu if gpu is not None else facts.first_gpu, o.replicas)]
    return [(g.title, g.gpu, len(g.replicas)) for g in gpu.groups]


def _kv_request(o: LaunchOptions, facts: LaunchFacts, device: str, gpu: GpuFacts | None,
                replicas: int) -> KvRequest:
    return KvRequest(
        kv_cache_bytes=o.kv_cache_bytes, max_total_tokens=o.max_total_tokens,
        replicas=replicas, device=device, gpu=gpu, sizing=facts.sizing, model=facts.model,
        overhead_bytes=o.engine_overhead, engine_stage=o.engine_stage,
        engine_args=o.engine_args)


def plan_memory(o: LaunchOptions, facts: LaunchFacts, gpu: GpuPart | None,
                kv: KvPart | None) -> tuple[int | None, list[str]]:
    """Whether each GPU slot's replicas fit in its memory (the host's for replicas on the
    CPU); the part is the bytes they need."""
    if gpu is None or kv is None or replica_count_problems(o) or memory_headroom_problems(o):
        return None, []
    several = len(gpu.groups) > 1
    problems, total = [], 0
    for group in gpu.groups:
        count = len(group.replicas) if several else o.replicas
        mine, words = memory_formula(kv.of(group.slot).sizing, count, o.share_weights)
        total += mine
        if group.gpu is not None:
            problems += _gpu_memory_problems(o, group.gpu, mine, words, named=several)
    if gpu.device == "cpu" and total > facts.host_memory_available:  # on the CPU, unchecked
        each = memory_formula(kv.sizing, o.replicas, o.share_weights)[1]
        problems.append(f"host memory: {each} does not fit in the "
                        f"{format_size(facts.host_memory_available)} available; lower the KV "
                        "size or the replica count")
    return (None, problems) if problems else (total, [])


def plan_mps_memory_limit(o: LaunchOptions, kv: KvPart | None) -> tuple[None, list[str]]:
    """--mps-memory-limit caps what each replica process may pin: below the replica's planned
    footprint it would fail at its first large allocation (or its engine would size a smaller
    KV than the plan's), so it is refused here. A replica of several CUDA processes is held
    to its whole footprint too: how it splits over them is the engine's."""
    limit = o.mps_memory_limit
    if limit is None or kv is None:
        return None, []
    sizings = [pin.sizing for pin in kv.per_gpu] or [kv.sizing]
    largest = max(sizings, key=lambda s: s.total_bytes)
    if limit >= largest.total_bytes:
        return None, []
    s = largest
    return None, [f"--mps-memory-limit {format_size(limit)} is below one replica's planned "
                  f"footprint: weights {format_size(s.weights_bytes)} + KV "
                  f"{format_size(s.kv_cache_bytes)} + overhead {format_size(s.overhead_bytes)} "
                  f"= {format_size(s.total_bytes)}; raise the limit to at least that, or lower "
                  "the KV size"]


def plan_share_room(o: LaunchOptions, facts: LaunchFacts, gpu: GpuPart | None,
                    kv: KvPart | None) -> tuple[int | None, list[str]]:
    """--share-weights on the CPU: the leader writes every weight, shared and private, as one
    segment file into the run's share/ directory, on the state root's filesystem (by default
    under $XDG_RUNTIME_DIR, often a small tmpfs). The part is the segment's bytes."""
    if not o.share_weights or gpu is None or gpu.device != "cpu" or kv is None:
        return None, []
    # + the manifest, alignment padding and buffers beside the parameters: a slack, not a size
    need, free = kv.sizing.weights_bytes + SEGMENT_SLACK_BYTES, facts.state_root_free
    if free is None or need <= free:
        return need, []
    return None, [f"--share-weights on the CPU: the leader writes its weights "
                  f"({format_size(kv.sizing.weights_bytes)}, shared and private; "
                  f"{format_size(need)} with the manifest and padding) as one segment into the run "
                  f"directory under {facts.state_root}, whose filesystem has "
                  f"{format_size(free)} free; set OMNI_DP_STATE_DIR to a directory on a "
                  "filesystem with room for it, or run without --share-weights"]


def memory_formula(sizing: EngineSizing, replicas: int, share: bool) -> tuple[int, str]:
    """What N replicas need, and the formula with its numbers: N × (weights + KV + overhead),
    or with --share-weights W + N × (private weights + KV + overhead), W the shared weights
    held once (beside it, what the same replicas would need without sharing)."""
    s = sizing
    plain = replicas * s.total_bytes
    plain_text = (f"{replicas} × (weights {format_size(s.weights_bytes)} + KV "
                  f"{format_size(s.kv_cache_bytes)} + overhead {format_size(s.overhead_bytes)})"
                  f" = {format_size(plain)}")
    if not share:
        return plain, plain_text
    need = s.shared_weights_bytes + replicas * (
        s.private_weights_bytes + s.kv_cache_bytes + s.overhead_bytes)
    return need, (f"shared weights {format_size(s.shared_weights_bytes)} + {replicas} × "
                  f"(private weights {format_size(s.private_weights_bytes)} + KV "
                  f"{format_size(s.kv_cache_bytes)} + overhead {format_size(s.overhead_bytes)})"
                  f" = {format_size(need)} (without --share-weights: {plain_text})")


def _gpu_memory_problems(o: LaunchOptions, gpu: GpuFacts, need: int, each: str,
                         named: bool = False) -> list[str]:
    total = gpu.memory_total_bytes
    if not total:  # NVML could not tell: nothing to check against
        return []
    used = gpu.memory_used_bytes or 0
    usable = int(total * (1 - o.memory_headroom)) - used
    if need <= usable:
        return []
    where = f" of {gpu.label}" if named else ""
    return [f"GPU memory{where}: {each} does not fit: the GPU has {format_size(total)}, "
            f"{format_size(used)} already in use, {o.memory_headroom:.0%} kept as headroom → "
            f"{format_size(max(usable, 0))} usable; lower the KV size or the replica count"]
