"""The preprocess stage: text normalisation, byte-level tokenization, voices.

Byte-level: every UTF-8 string has a tokenization and nothing needs downloading.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

from omni_dp.engine.config import ModelConfig
from omni_dp.engine.sampling import derive_seed

# Every built-in voice OpenAI's speech API names (its SDK's `Voice`), so that existing clients
# work unchanged. The i-th voice is speaker i mod the model's num_speakers: the first eight keep
# the speakers they always had, and on a model with fewer speakers than voices some share one
# (they still sound different with no `seed`: the voice's name goes into the default seed).
# docs/contracts.md lists the mapping.
VOICES: tuple[str, ...] = (
    "alloy", "ash", "coral", "echo", "fable", "nova", "onyx", "shimmer",
    "ballad", "sage", "verse", "marin", "cedar",
)
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


def unknown_voice_message(voice: object, choices: Sequence[str] = VOICES) -> str:
    """The 400's text for a voice the model has not got (the API and the stages say it)."""
    return f"unknown voice {voice!r}; choose one of {', '.join(choices)}"


def too_long_message(length: int, limit: int) -> str:
    """The 400's text for an input over --max-input-chars (the seeded engine and a voice say
    it alike): the field, its length and the bound, and the option that raises it."""
    return (f"input has {length} characters after normalisation; the limit is {limit} "
            "(the replica's --max-input-chars)")


def speaker_of(cfg: ModelConfig, voice: str) -> int:
    """The model's speaker for `voice` (one of VOICES): the same on every replica of a model."""
    return VOICES.index(voice) % cfg.num_speakers


def build_prompt(cfg: ModelConfig, text: str, voice: str, max_input_chars: int) -> TalkerPrompt:
    if voice not in VOICES:
        raise PreprocessError("voice", unknown_voice_message(voice))
    normalized = normalize_text(text)
    if not normalized:
        raise PreprocessError("input", "input is empty after normalisation; send some text")
    if len(normalized) > max_input_chars:
        raise PreprocessError("input", too_long_message(len(normalized), max_input_chars))
    speaker_id = speaker_of(cfg, voice)
    ids = [cfg.first_speaker_id + speaker_id, cfg.bos_text_id]
    ids += list(normalized.encode("utf-8"))
    ids += [cfg.eos_text_id, cfg.bos_audio_id]
    return TalkerPrompt(normalized, speaker_id, ids)


def default_max_new_tokens(cfg: ModelConfig, prompt: TalkerPrompt) -> int:
    """A duration prior: a few codec frames per input byte, within the model's limit."""
    text_bytes = len(prompt.token_ids) - 4
    wanted = math.ceil(text_bytes * cfg.new_tokens_per_input_byte)
    return max(cfg.min_new_tokens_default, min(cfg.max_new_tokens, wanted))


@dataclass(frozen=True)
class SpeechAsk:
    """What the preprocess stage reads from a speech request (it crosses processes as is)."""

    input: str
    voice: str
    speed: float | None = None
    seed: int | None = None
    max_new_tokens: int | None = None
    # the text opens what the client hears (a request, a speech session's first sentence): a
    # voice speaks its long first sentence in clause-sized pieces; a later sentence of a
    # session, asked alone, says False and is spoken whole
    opens_answer: bool = True


@dataclass(frozen=True)
class PreprocessLimits:
    max_input_chars: int
    max_total_tokens: int  # the talker's KV pool: a request needing more can never run


@dataclass(frozen=True)
class PreparedSpeech:
    """A request the talker can serve: its prompt, how many codes, and its sampling seed."""

    prompt: TalkerPrompt
    max_new_tokens: int
    seed: int


def duration_prior(cfg: ModelConfig, prompt: TalkerPrompt, speed: float | None) -> int:
    """Codec tokens for a request that names none; `speed` 2.0 gives half as many.

    The talker speaks its text in the frames it is given, so scaling that budget changes the
    speaking rate inside the model, with no resampling or time-stretching of its output.
    Speed 1.0 is exactly the unscaled prior (same tokens, same default seed, same bytes).
    """
    prior = default_max_new_tokens(cfg, prompt)
    if speed is None or speed == 1.0:
        return prior
    return max(1, min(cfg.max_new_tokens, math.ceil(prior / speed)))


def prepare(cfg: ModelConfig, ask: SpeechAsk, limits: PreprocessLimits) -> PreparedSpeech:
    """The preprocess stage: text → prompt, length and seed, or PreprocessError naming the
    field. Every reason a request can never be served is found here, before a response starts
    (in whichever process this stage runs)."""
    prompt = build_prompt(cfg, ask.input, ask.voice, limits.max_input_chars)
    max_new_tokens = ask.max_new_tokens or duration_prior(cfg, prompt, ask.speed)
    positions = len(prompt.token_ids) + max_new_tokens
    if positions > cfg.max_position:
        raise PreprocessError("input", f"input and max_new_tokens need {positions} positions; "
                                       f"the model has {cfg.max_position}")
    need = positions - 1  # the last code is never fed back
    if need > limits.max_total_tokens:
        raise PreprocessError(
            "input", f"request needs {need} KV tokens ({len(prompt.token_ids)} prompt + "
            f"{max_new_tokens} new - 1) but the whole pool holds {limits.max_total_tokens}; "
            "shorten the input or lower max_new_tokens")
    seed = ask.seed
    if seed is None:
        seed = derive_seed({"input": prompt.text, "voice": ask.voice,
                            "max_new_tokens": max_new_tokens})
    return PreparedSpeech(prompt, max_new_tokens, seed)
