"""The built-in pipeline's declaration: its stages and what crosses each edge.

Every edge carries plain integers, so any placement of these stages can be served; only a
pipeline whose edge payload lives in process memory constrains the topology.
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
