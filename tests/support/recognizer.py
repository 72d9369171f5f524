"""An offline speech recognizer (pocketsphinx, its bundled en-US model) for the voice's tests:
whether audio is speech a listener would understand, as word recall against the text sent; and
an espeak-ng that fails on a given word, to put first on a replica's PATH.

The voice is skipped where it is not installed, and required under CI (OMNI_DP_REQUIRE_VOICE,
set by scripts/test), where scripts/setup installs it.
"""

from __future__ import annotations

import io
import os
import re
import shlex
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import soundfile

RECOGNIZER_RATE = 16000  # the bundled acoustic model's
_WORD = re.compile(r"[a-z']+")


def voice_missing() -> str | None:
    """Why the bundled voice cannot be served here, or None."""
    from omni_dp.engine.voice.model import find_voice, runtime_problem
    from omni_dp.engine.voice.phonemes import espeak_problem

    problem = espeak_problem() or runtime_problem("cpu")
    if problem:
        return problem
    try:
        find_voice("joe")
    except ValueError as exc:
        return str(exc)
    return None


def require_voice() -> None:
    """Skip the calling test where the voice is missing; fail instead where CI requires it."""
    problem = voice_missing()
    if problem and os.environ.get("OMNI_DP_REQUIRE_VOICE"):
        pytest.fail(f"CI requires the voice: {problem}")
    if problem:
        pytest.skip(problem)


def espeak_failing_on(word: str, directory: Path) -> Path:
    """`directory`/espeak-ng: exits 1, as a crashed espeak-ng would, on input holding `word`;
    runs the real program otherwise. Returns `directory`, for the front of PATH (the voice's
    phonemizer runs the espeak-ng found there)."""
    real = shutil.which("espeak-ng")
    assert real is not None, "no espeak-ng to wrap"
    directory.mkdir(parents=True, exist_ok=True)
    program = directory / "espeak-ng"
    program.write_text(
        "#!/bin/sh\n"
        "text=$(cat)\n"
        f'case "$text" in *{shlex.quote(word)}*) echo "espeak-ng: crashed" >&2; exit 1;; esac\n'
        f'printf "%s" "$text" | exec {shlex.quote(real)} "$@"\n')
    program.chmod(0o755)
    return directory


def transcribe(audio: bytes) -> str:
    """What the recognizer hears in a whole audio file (any format soundfile reads)."""
    from pocketsphinx import Decoder

    samples, rate = soundfile.read(io.BytesIO(audio), dtype="float32")
    count = int(len(samples) * RECOGNIZER_RATE / rate)
    resampled = np.interp(np.arange(count) * rate / RECOGNIZER_RATE,
                          np.arange(len(samples)), samples)
    pcm = (np.clip(resampled, -1, 1) * 32767).astype("<i2").tobytes()
    decoder = Decoder(samprate=RECOGNIZER_RATE)
    decoder.start_utt()
    decoder.process_raw(pcm, full_utt=True)
    decoder.end_utt()
    hypothesis = decoder.hyp()
    return hypothesis.hypstr if hypothesis else ""


def words(text: str) -> list[str]:
    """Lower case, punctuation ignored."""
    return _WORD.findall(text.lower())


def word_recall(reference: str, heard: str) -> tuple[int, int]:
    """(reference words heard, reference words): each heard word counts once."""
    wanted, got = Counter(words(reference)), Counter(words(heard))
    return sum(min(n, got[w]) for w, n in wanted.items()), sum(wanted.values())
