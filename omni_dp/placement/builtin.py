"""The built-in engine's pipelines: their stages and what crosses each edge.

Every edge carries plain integers, so any placement of these stages can be served; only a
pipeline whose edge payload lives in process memory constrains the topology. The seeded
presets run the TTS pipeline; a Piper voice (engine/voice/) runs the voice pipeline.
"""

from __future__ import annotations

from omni_dp.placement.model import EdgeSpec, PipelineSpec, StageSpec

BUILTIN_PIPELINE = PipelineSpec(
    "omni-dp-tts",
    stages=(
        StageSpec("preprocess", accelerator=False, replicable=True),
        StageSpec("talker", accelerator=True, tp_capable=True, state="its KV cache"),
        StageSpec("vocoder", accelerator=True, replicable=True),
    ),
    edges=(
        EdgeSpec("preprocess", "talker", "a tokenised prompt (ints) and its sampling seed"),
        EdgeSpec("talker", "vocoder", "each step's codec codes per request (ints)"),
    ),
)

# A Piper voice: text → espeak-ng phonemes → ids on the CPU, then one ONNX call per sentence.
# The voice stage keeps nothing across sentences, so it may be replicated; its graph is one
# onnxruntime session, which cannot be split across ranks.
VOICE_PIPELINE = PipelineSpec(
    "omni-dp-voice",
    stages=(
        StageSpec("preprocess", accelerator=False, replicable=True),
        StageSpec("voice", accelerator=True, replicable=True),
    ),
    edges=(
        EdgeSpec("preprocess", "voice", "each sentence's phoneme ids (ints)"),
    ),
)
