"""What a stage process is told when its front starts it: one JSON argument, these fields.

Apart from engine/stage_process.py so that the code serving a pipeline's stages there (the
seeded TTS stages, a voice's: engine/voice/stages.py) reads its launch without importing the
process's entry point.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from omni_dp.engine.options import DEFAULT_PRIORITY_SHARE_EVERY, DEFAULT_VOICE_FIRST_PIECE_CHARS
from omni_dp.placement.builtin import BUILTIN_PIPELINE
from omni_dp.records import Record


@dataclass(frozen=True)
class TPRank(Record):
    rank: int
    size: int
    store_port: int  # the rendezvous the front opened (tensor_parallel.open_store)
    backend: str  # gloo on the CPU, nccl on GPUs


@dataclass(frozen=True)
class StageLaunch(Record):
    """Everything a stage process needs, from its front's plan (argv: JSON)."""

    process: str
    stages: tuple[str, ...]
    device: str  # cpu | cuda:N
    dtype: str
    threads: int
    model: str
    weight_seed: int
    page_size: int
    num_pages: int
    max_running_requests: int
    max_input_chars: int
    inbox: str  # this process's endpoint
    front: str  # main's endpoint: Ready, StageFailed, Audio, Prepared, Stats go there
    vocoders: tuple[str, ...]  # the endpoints of the vocoder processes (a talker's downstream)
    log_level: str
    log_format: str
    budget_bytes: int | None = None  # this process's memory budget (placement), if declared
    tp: TPRank | None = None
    pipeline: str = BUILTIN_PIPELINE.name  # which pipeline's stages (placement/builtin.py)
    # A voice's preprocess: --voice-first-piece-chars (engine/voice/phonemes.speech_pieces)
    voice_first_piece_chars: int = DEFAULT_VOICE_FIRST_PIECE_CHARS
    priority_share_every: int = DEFAULT_PRIORITY_SHARE_EVERY  # the talker's admission policy
    otlp_traces_endpoint: str | None = None  # --otlp-traces-endpoint: its spans go there too

    def argv_word(self) -> str:
        """The launch as the one argv word the stage process reads (`read`)."""
        return json.dumps(self.to_json())

    @classmethod
    def read(cls, word: str) -> StageLaunch:
        return cls.from_json(json.loads(word), "stage launch")
