"""The messages a voice's stage processes add to the replica's (engine/messages.py).

The preprocess stage answers the front's Prepare with Prepared, as the seeded pipeline's does,
its `speech` a VoiceSpeech; a Prepared with no speech and no field means the stage could not
prepare it (espeak-ng failed: a 503, the replica stays up). The voice stage speaks one
sentence per Speak and answers with Spoken.
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_dp.engine.voice.preprocess import VoicePrompt, VoiceSpeech
from omni_dp.engine.wire import register


@dataclass(frozen=True)
class Speak:
    """[main → voice] Speak one sentence of a request."""

    sentence_id: str
    ids: list[int]
    length_scale: float
    speaker_id: int
    traceparent: str | None = None  # the request's span, the parent of this sentence's


@dataclass(frozen=True)
class Spoken:
    """[voice → main] A sentence's 16-bit PCM."""

    sentence_id: str
    pcm: bytes


for _cls in (VoicePrompt, VoiceSpeech, Speak, Spoken):
    register(_cls)
