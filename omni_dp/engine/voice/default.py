"""`--model auto`, serve's default: which model it stands for here, and what to say.

Torch-free (the launcher's command line asks it too, to say the fallback before it launches).
"""

from __future__ import annotations

import os

from omni_dp.engine.options import AUTO_MODEL, DEFAULT_MODEL_ENV
from omni_dp.engine.voice import model, phonemes
from omni_dp.engine.voice.model import DEFAULT_VOICE_NAME


def resolve_default_model(spec: str) -> tuple[str, str | None]:
    """`auto` → (the model it stands for, a line to say when that is the seeded fallback);
    any other spec as given. Planned once, so that stage processes get the resolved name."""
    if spec != AUTO_MODEL:
        return spec, None
    pinned = os.environ.get(DEFAULT_MODEL_ENV)
    if pinned:
        return pinned, None
    try:
        model.find_voice(DEFAULT_VOICE_NAME)
        missing = phonemes.espeak_problem() or model.runtime_problem("cpu")
    except ValueError as exc:
        missing = str(exc)
    if missing is None:
        return DEFAULT_VOICE_NAME, None
    return "tiny", (f"no trained voice here ({missing}): serving the seeded preset tiny, whose "
                    "audio is noise; scripts/setup installs the voice joe")


def launch_note(engine: str, engine_args: tuple[str, ...]) -> str | None:
    """What `launch` says before its replicas start when serve's `auto` will fall back to the
    seeded preset (the built-in engine with no --model of its own)."""
    if engine != "builtin" or any(a == "--model" or a.startswith("--model=")
                                  for a in engine_args):
        return None
    return resolve_default_model(AUTO_MODEL)[1]
