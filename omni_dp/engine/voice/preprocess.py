"""The voice's preprocess stage: what can never be spoken is refused by field (a 400), the
rest becomes each sentence's phoneme ids, wherever the placement runs the stage.

A front that runs the stage phonemizes a request's sentences side by side on worker threads
(engine/voice/pipeline.py); a stage process does it with `prepare` (engine/voice/stages.py).
Either way the request comes out as the same VoiceSpeech. Its `sentences` are the pieces the
voice speaks (phonemes.speech_pieces): the sentences, a long first one in clause-sized pieces.

Every sentence is phonemized before the answer starts, so that espeak-ng failing on any of them
is a 503 the router can retry elsewhere, not a cut answer. What that holds is small: a
20,000-character input is ~45,000 phoneme ids (Python's small ints: a pointer each); the audio
is made and streamed a few sentences at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

from omni_dp.engine.options import DEFAULT_VOICE_FIRST_PIECE_CHARS
from omni_dp.engine.preprocess import (
    VOICES,
    PreprocessError,
    SpeechAsk,
    normalize_text,
    too_long_message,
    unknown_voice_message,
)
from omni_dp.engine.voice.model import VoiceModel
from omni_dp.engine.voice.phonemes import phoneme_ids, phonemize, speech_pieces

# BOS, a pad and EOS: a sentence with no more than these has nothing to speak
FRAMING_IDS = 3
# Threads running espeak-ng for the stage, wherever it runs: they wait on its processes, not on
# the cores, so two keep a request's sentences (or two requests) going side by side.
PHONEMIZER_THREADS = 2


@dataclass(frozen=True)
class VoicePrompt:
    text: str  # normalised
    speaker_id: int
    token_ids: list[int]  # every sentence's phoneme ids, for the usage figures


@dataclass(frozen=True)
class VoiceSpeech:
    """A request the voice stage can speak: its sentences' ids, speaker and speaking rate."""

    prompt: VoicePrompt
    sentences: list[list[int]]
    length_scale: float
    seed: int | None  # accepted, and reproduces nothing (engine/voice/pipeline.py says why)


@dataclass(frozen=True)
class Checked:
    """A request that passed every check that needs no phonemes: what remains to phonemize."""

    ask: SpeechAsk
    speaker_id: int
    text: str
    sentences: list[str]  # the pieces the voice speaks, in order (phonemes.speech_pieces)


def voice_names(voice: VoiceModel) -> tuple[str, ...]:
    """What a request's `voice` may name: OpenAI's voices (so existing clients work), then the
    voice's own speakers."""
    return (*VOICES, *voice.speaker_id_map)


class VoicePreprocess:
    def __init__(self, voice: VoiceModel, max_input_chars: int,
                 first_piece_chars: int = DEFAULT_VOICE_FIRST_PIECE_CHARS) -> None:
        """`first_piece_chars`: --voice-first-piece-chars (0: a first sentence stays whole)."""
        self.voice = voice
        self.max_input_chars = max_input_chars
        self.first_piece_chars = first_piece_chars

    def speaker_of(self, voice_name: str) -> int:
        """The speaker a name of voice_names stands for."""
        if voice_name in self.voice.speaker_id_map:
            return self.voice.speaker_id_map[voice_name]
        if voice_name in VOICES:
            return VOICES.index(voice_name) % self.voice.num_speakers
        raise PreprocessError("voice", unknown_voice_message(voice_name, voice_names(self.voice)))

    def check(self, ask: SpeechAsk) -> Checked:
        """PreprocessError naming the field for a request that can never be spoken."""
        if ask.max_new_tokens is not None:
            raise PreprocessError("max_new_tokens", "max_new_tokens counts the codec tokens of "
                                  "the seeded presets; a Piper voice has none (omit it)")
        speaker = self.speaker_of(ask.voice)
        text = normalize_text(ask.input)
        if not text:
            raise PreprocessError("input", "input is empty after normalisation; send some text")
        if len(text) > self.max_input_chars:
            raise PreprocessError("input", too_long_message(len(text), self.max_input_chars))
        first_piece = self.first_piece_chars if ask.opens_answer else 0
        return Checked(ask, speaker, text, speech_pieces(text, first_piece))

    def ids_of(self, sentence: str) -> list[int]:
        """One sentence's framed phoneme ids (PhonemizeError when espeak-ng fails)."""
        return phoneme_ids(phonemize(sentence, self.voice.espeak_voice),
                           self.voice.phoneme_id_map)

    def speech(self, checked: Checked, ids: list[list[int]]) -> VoiceSpeech:
        """The request with its sentences' ids (in order); the sentences without a phoneme
        are dropped, and a request with none left is refused."""
        sentences = [each for each in ids if len(each) > FRAMING_IDS]
        if not sentences:
            raise PreprocessError("input", "input has nothing to speak (no phonemes)")
        length_scale = self.voice.length_scale / (checked.ask.speed or 1.0)
        every = [i for each in sentences for i in each]
        return VoiceSpeech(VoicePrompt(checked.text, checked.speaker_id, every), sentences,
                           length_scale, checked.ask.seed)

    def prepare(self, ask: SpeechAsk) -> VoiceSpeech:
        """The whole stage, one sentence after another (a stage process's worker thread)."""
        checked = self.check(ask)
        return self.speech(checked, [self.ids_of(s) for s in checked.sentences])
