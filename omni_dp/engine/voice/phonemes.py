"""Text → sentences → IPA phonemes (the espeak-ng program) → a Piper voice's phoneme ids.

Piper voices are trained on espeak-ng's IPA. The program is run as a separate process, one call
per sentence: it is GPL-3.0, and a process boundary keeps it out of this Apache-2.0 package
(no library of it is loaded here). It prints one line per clause and drops punctuation, so the
clauses are joined with ", " and the sentence's own terminator is put back, as Piper's trainer
saw them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence

ESPEAK_PROGRAM = "espeak-ng"
ESPEAK_TIMEOUT_S = 10.0
# Piper's id conventions: every phoneme is followed by the pad; the utterance is framed by the
# begin and end symbols.
PAD, BOS, EOS = "_", "^", "$"
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_TERMINATORS = ".!?"


class PhonemizeError(RuntimeError):
    """espeak-ng is missing or failed: the replica cannot phonemize at all."""


def espeak_problem(program: str = ESPEAK_PROGRAM) -> str | None:
    """Why the phonemizer cannot run here, or None; said before anything is loaded."""
    if shutil.which(program) is None:
        return (f"the {program} program is not installed (Debian/Ubuntu: apt-get install "
                f"espeak-ng; scripts/setup does it where it runs as root)")
    return None


def split_sentences(text: str) -> list[str]:
    """Sentences in order, each with its terminator; the unit of streaming."""
    return [part for part in (p.strip() for p in _SENTENCE_END.split(text)) if part]


def phonemize(sentence: str, espeak_voice: str, program: str = ESPEAK_PROGRAM) -> str:
    """One sentence's IPA: clauses joined by ", ", ending with its terminator (or ".")."""
    try:
        done = subprocess.run(
            [program, "-q", "--ipa", "-v", espeak_voice, "--stdin"], input=sentence,
            capture_output=True, text=True, timeout=ESPEAK_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PhonemizeError(f"{program}: {exc}") from None
    if done.returncode != 0:
        raise PhonemizeError(f"{program} exited {done.returncode}: {done.stderr.strip()[:200]}")
    clauses = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    if not clauses:
        return ""
    end = sentence[-1] if sentence[-1] in _TERMINATORS else "."
    return ", ".join(clauses) + end


def phoneme_ids(phonemes: str, id_map: Mapping[str, Sequence[int]]) -> list[int]:
    """Piper's framing: BOS, then each known phoneme's ids and a pad, then EOS. Characters the
    voice has no id for are skipped (Piper does the same)."""
    pad = list(id_map[PAD])
    ids = [*id_map[BOS], *pad]
    for char in phonemes:
        known = id_map.get(char)
        if known is not None:
            ids += [*known, *pad]
    return [*ids, *id_map[EOS]]
