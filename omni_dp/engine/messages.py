"""The messages that cross between the stage processes of one replica.

Each is a dataclass registered with the wire codec (engine/wire.py): msgpack for the fields, raw
frames for PCM and tensors. Inside one process the same objects travel through queues
unchanged; across processes, through pyzmq (engine/links.py). Direction in brackets.
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_dp.contract import Priority
from omni_dp.engine.core import Abort, Add, StepOutputs, Stop
from omni_dp.engine.preprocess import PreparedSpeech, SpeechAsk, TalkerPrompt
from omni_dp.engine.scheduler import RequestOutput, RequestStatus, SchedulerStats, TalkerRequest
from omni_dp.engine.wire import register


@dataclass(frozen=True)
class Prepare:
    """[main → preprocess] Prepare this request; answer with Prepared."""

    request_id: str
    ask: SpeechAsk
    traceparent: str | None = None  # the request's span, the parent of this stage's (tracing.py)


@dataclass(frozen=True)
class Prepared:
    """[preprocess → main] The prepared request, or the field and reason it was refused."""

    request_id: str
    speech: PreparedSpeech | None
    field: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class Audio:
    """[vocoder → main] One chunk of a request's PCM (empty when `done` only ends it)."""

    request_id: str
    pcm: bytes
    done: bool


@dataclass(frozen=True)
class Stats:
    """[talker → main] The scheduler's gauges, for /metrics (sent when they change, throttled)."""

    stats: SchedulerStats


@dataclass(frozen=True)
class Ready:
    """[stage process → main] Built and serving."""

    process: str
    pid: int


@dataclass(frozen=True)
class StageFailed:
    """[stage process → main] A stage of this process failed; the replica must restart."""

    process: str
    reason: str


for _cls in (RequestStatus, Priority, TalkerRequest, RequestOutput, SchedulerStats, TalkerPrompt,
             SpeechAsk, PreparedSpeech, Add, Abort, Stop, StepOutputs):
    register(_cls)
for _cls in (Prepare, Prepared, Audio, Stats, Ready, StageFailed):
    register(_cls)
