"""The stages one process runs, and the routes between stages.

A process of the replica (the HTTP front `main`, or a stage process) runs a StageSet: the
workers of the stages the placement gave it, built from the models it holds. An edge inside the
process is a queue (`inbox.put`), exactly form ①'s; an edge that leaves it is a callable the
caller wires to pyzmq. Stages never know which: that is what makes a placement a configuration
and not a code path (docs/design.md, placement model).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from omni_dp.engine.config import ModelConfig
from omni_dp.engine.core import Abort, Add, StepOutputs, TalkerWorker, VocoderWorker
from omni_dp.engine.gpu_busy import Recorder
from omni_dp.engine.kv_cache import KVCache
from omni_dp.engine.options import DEFAULT_PRIORITY_SHARE_EVERY
from omni_dp.engine.preprocess import PreparedSpeech, PreprocessLimits, SpeechAsk, prepare
from omni_dp.engine.scheduler import RequestStatus, Scheduler, SchedulerStats
from omni_dp.engine.vocoder import ChunkSchedule, Vocoder

Deliver = Callable[[str, bytes | None, bool], None]


class LeastLoaded:
    """Bind each new request to the target with the fewest requests bound to it now; ties go
    to the one that was picked longest ago, so equal loads still take turns (never round-robin
    only: a target slowed by long requests gets fewer new ones)."""

    def __init__(self, count: int) -> None:
        self.loads = [0] * count
        self._picked = [0] * count  # when each was last picked (a counter, not a clock)
        self._clock = 0

    def select(self) -> int:
        index = min(range(len(self.loads)), key=lambda i: (self.loads[i], self._picked[i]))
        self._clock += 1
        self._picked[index] = self._clock
        return index

    def bind(self) -> int:
        index = self.select()
        self.loads[index] += 1
        return index

    def release(self, index: int) -> None:
        self.loads[index] -= 1


class VocoderRoute:
    """The talker → vocoder edge. With one vocoder, every step goes to it as is. With several
    (a replicated stage), each request is bound to the least-loaded vocoder when its first
    output appears, and all of its outputs go there, in order, until it finishes."""

    def __init__(self, targets: Sequence[Callable[[StepOutputs], None]]) -> None:
        self.targets = list(targets)
        self.policy = LeastLoaded(len(self.targets))
        self.bound: dict[str, int] = {}

    def __call__(self, step: StepOutputs) -> None:
        if len(self.targets) == 1:
            self.targets[0](step)
            return
        per_target: dict[int, list] = {}
        for output in step.outputs:
            index = self.bound.get(output.request_id)
            if index is None:
                if output.status == RequestStatus.FINISHED_ABORTED:
                    continue  # aborted before it spoke: no vocoder has heard of it
                index = self.bound[output.request_id] = self.policy.bind()
            per_target.setdefault(index, []).append(output)
            if output.status.is_finished:
                del self.bound[output.request_id]
                self.policy.release(index)
        for index, outputs in per_target.items():
            self.targets[index](StepOutputs(outputs))


@dataclass
class StageModels:
    """What a process holds for its stages: the talker's model, runner and KV, the vocoder."""

    cfg: ModelConfig
    device: torch.device
    talker_runner: object | None = None  # ModelRunner or TPModelRunner (rank 0)
    kv_cache: KVCache | None = None
    vocoder: Vocoder | None = None
    tp_group: object | None = None  # a TP rank's group (tensor_parallel.TPGroup)
    tp_shard: object | None = None  # a TP rank ≥ 1's talker shard (it only follows)


class PreprocessStage:
    """Text → prompt: a pure function of the request, run where the placement puts it."""

    name = "preprocess"

    def __init__(self, cfg: ModelConfig, limits: PreprocessLimits) -> None:
        self.cfg = cfg
        self.limits = limits

    def prepare(self, ask: SpeechAsk) -> PreparedSpeech:
        return prepare(self.cfg, ask, self.limits)


class StageSet:
    def __init__(
        self,
        stages: Sequence[str],
        held: StageModels,
        *,
        limits: PreprocessLimits,
        max_running_requests: int,
        to_vocoder: Callable[[StepOutputs], None] | None,
        deliver: Deliver,
        on_fatal: Callable[[str], None],
        on_stats: Callable[[SchedulerStats], None] | None = None,
        priority_share_every: int = DEFAULT_PRIORITY_SHARE_EVERY,
    ) -> None:
        """`to_vocoder`: where the talker's steps go when the vocoder is not in this process;
        `priority_share_every`: the talker's admission policy (engine/priority.py)."""
        self.stages = tuple(stages)
        cfg = held.cfg
        self.preprocess = PreprocessStage(cfg, limits) if "preprocess" in stages else None
        self.vocoder: VocoderWorker | None = None
        self.talker: TalkerWorker | None = None
        self.scheduler: Scheduler | None = None
        if "vocoder" in stages:
            assert held.vocoder is not None
            self.vocoder = VocoderWorker(
                held.vocoder,
                ChunkSchedule(cfg.vocoder.first_chunk_tokens, cfg.vocoder.chunk_tokens),
                deliver=deliver, on_fatal=on_fatal,
            )
        if "talker" in stages:
            assert held.talker_runner is not None and held.kv_cache is not None
            self.scheduler = Scheduler(held.kv_cache.spec, end_of_audio=cfg.end_of_audio,
                                       max_running_requests=max_running_requests,
                                       priority_share_every=priority_share_every)
            emit = self.vocoder.inbox.put if self.vocoder is not None else to_vocoder
            assert emit is not None, "a talker needs a vocoder: here or through to_vocoder"
            self.talker = TalkerWorker(self.scheduler, held.talker_runner, emit=emit,
                                       on_fatal=on_fatal, on_stats=on_stats)

    def busy_recorders(self) -> dict[str, Recorder]:
        """The step timers of this process's model stages (engine/gpu_busy.py), by stage."""
        found: dict[str, Recorder] = {}
        if self.talker is not None:
            found["talker"] = self.talker.runner.busy
        if self.vocoder is not None:
            found["vocoder"] = self.vocoder.busy
        return found

    def start(self) -> None:
        # Downstream first: nothing the talker emits may find its vocoder not yet running.
        if self.vocoder is not None:
            self.vocoder.start()
        if self.talker is not None:
            self.talker.start()

    def stop(self) -> None:
        if self.talker is not None:
            self.talker.stop()
        if self.vocoder is not None:
            self.vocoder.stop()

    def handle(self, message: object) -> bool:
        """A message for one of this process's workers, put in its inbox; False if none is
        its receiver (the caller's to answer)."""
        if isinstance(message, (Add, Abort)) and self.talker is not None:
            self.talker.inbox.put(message)
            return True
        if isinstance(message, StepOutputs) and self.vocoder is not None:
            self.vocoder.inbox.put(message)
            return True
        return False
