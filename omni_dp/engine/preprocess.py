"""The preprocess stage: text normalisation, byte-level tokenization, voices.

Byte-level: every UTF-8 string has a tokenization and nothing needs downloading.
"""

from __future__ import annotations

import math
import re
import unicodedata
from dataclasses import dataclass

from omni_dp.engine.config import ModelConfig

# OpenAI's voice names, so that existing clients work unchanged; each is one speaker id.
VOICES: tuple[str, ...] = ("alloy", "ash", "coral", "echo", "fable", "nova", "onyx", "shimmer")
DEFAULT_VOICE = "alloy"

_WHITESPACE = re.compile(r"\s+")


class PreprocessError(ValueError):
    """Input the pipeline cannot speak; `field` names the request field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class TalkerPrompt:
    text: str  # normalised
    speaker_id: int
    token_ids: list[int]


def normalize_text(text: str) -> str:
    """NFC, control characters dropped, runs of whitespace collapsed, ends stripped."""
    text = unicodedata.normalize("NFC", text)
    # \r, \f, \v are control characters too, but they separate words: keep them as spaces.
    text = "".join(ch for ch in text if ch.isspace() or unicodedata.category(ch)[0] != "C")
    return _WHITESPACE.sub(" ", text).strip()


def build_prompt(cfg: ModelConfig, text: str, voice: str, max_input_chars: int) -> TalkerPrompt:
    voices = VOICES[: cfg.num_speakers]
    if voice not in voices:
        choices = ", ".join(voices)
        raise PreprocessError("voice", f"unknown voice {voice!r}; choose one of {choices}")
    normalized = normalize_text(text)
    if not normalized:
        raise PreprocessError("input", "input is empty after normalisation; send some text")
    if len(normalized) > max_input_chars:
        raise PreprocessError(
            "input", f"input has {len(normalized)} characters; the limit is {max_input_chars}"
        )
    speaker_id = VOICES.index(voice)
    ids = [cfg.first_speaker_id + speaker_id, cfg.bos_text_id]
    ids += list(normalized.encode("utf-8"))
    ids += [cfg.eos_text_id, cfg.bos_audio_id]
    return TalkerPrompt(normalized, speaker_id, ids)


def default_max_new_tokens(cfg: ModelConfig, prompt: TalkerPrompt) -> int:
    """A duration prior: a few codec frames per input byte, within the model's limit."""
    text_bytes = len(prompt.token_ids) - 4
    wanted = math.ceil(text_bytes * cfg.new_tokens_per_input_byte)
    return max(cfg.min_new_tokens_default, min(cfg.max_new_tokens, wanted))
