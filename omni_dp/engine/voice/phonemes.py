"""Text → sentences → IPA phonemes (the espeak-ng program) → a Piper voice's phoneme ids.

Piper voices are trained on espeak-ng's IPA. The program is run as a separate process, one call
per sentence: it is GPL-3.0, and a process boundary keeps it out of this Apache-2.0 package
(no library of it is loaded here). It prints one line per clause and drops punctuation, so the
clauses are joined with ", " and the sentence's own terminator is put back, as Piper's trainer
saw them.

A sentence is the unit of streaming, with two exceptions that cut it at its clauses
(`clause_pieces`): the first sentence of a request when it is longer than the front's bound
(`--voice-first-piece-chars`: the first audio waits for one clause-sized piece, not the whole
sentence), and any sentence longer than MAX_PIECE_CHARS (the graph's memory grows with its
input: one call on a 600-character sentence held ~670 MB on top of the session, measured).
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
# What ends a clause cut from its sentence: the voice hears a comma's pause, not a full stop.
_CLAUSE_MARKS = ",;:"
_ENDINGS = _TERMINATORS + _CLAUSE_MARKS
# Where a sentence may be cut: after a comma, semicolon or colon followed by a space (not
# "1,000" or "10:30"); at a dash between spaces (" - ", " -- ", " – ", " — "); at an en or em
# dash between words ("home—it"). A hyphen inside a word ("well-known") is no cut.
_CLAUSE_CUT = re.compile(r"(?<=[,;:])\s+|\s+(?:--?|[–—])\s+|(?<=\w)[–—](?=\w)")
# The longest piece one graph call speaks, whatever sentence it is cut from: its memory and
# time grow with its input (joe on this CPU, measured: 100 characters +130 MB and 0.34 s; 300
# +340 MB and 1.1 s; 600 +670 MB and 2.6 s), so a long sentence is cut into pieces of at
# most this (at its clauses first) and a replica's peak memory has a bound whatever the input.
# 300: longer than almost every sentence of prose (they stay whole: a cut is a pause).
MAX_PIECE_CHARS = 300


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


def clause_pieces(sentence: str, bound: int) -> list[str]:
    """`sentence` in order, in pieces of at most `bound` characters: its clauses (cut at
    _CLAUSE_CUT) packed greedily, so that each piece is as long as the bound allows and a cut
    falls where a reader pauses anyway; a clause longer than the bound is cut between its
    words (a single word longer than it, between characters). Every piece but the last ends
    with a clause mark (a dash, or a cut between words, becomes a comma), so the voice ends
    it as a clause and not as a sentence; the last keeps the sentence's own ending. A
    sentence within the bound is returned whole."""
    if len(sentence) <= bound:
        return [sentence]
    clauses = [part.strip() for part in _CLAUSE_CUT.split(sentence) if part.strip()]
    parts = [word_run for clause in (_with_mark(c, i < len(clauses) - 1)
                                     for i, c in enumerate(clauses))
             for word_run in _word_runs(clause, bound)]
    pieces: list[str] = []
    for part in parts:
        if pieces and len(pieces[-1]) + 1 + len(part) <= bound:
            pieces[-1] = f"{pieces[-1]} {part}"
        else:
            pieces.append(part)
    return [_with_mark(piece, i < len(pieces) - 1) for i, piece in enumerate(pieces)]


def _with_mark(text: str, cut: bool) -> str:
    """A piece that ends at a cut ends with a clause mark (a comma where it has none)."""
    return f"{text}," if cut and text[-1] not in _ENDINGS else text


def _word_runs(clause: str, bound: int) -> list[str]:
    """A clause in runs of whole words of about equal length, each at most `bound` (leaving
    one mark's room for the comma a cut adds), or the clause itself when it fits."""
    if len(clause) <= bound:
        return [clause]
    limit = max(1, bound - 1)
    count = -(-len(clause) // limit)
    target = min(limit, -(-len(clause) // count))
    runs: list[str] = []
    for word in clause.split():
        while len(word) > limit:  # one "word" longer than a piece: a URL, a run of digits
            runs.append(word[:limit])
            word = word[limit:]
        if runs and len(runs[-1]) + 1 + len(word) <= target:
            runs[-1] = f"{runs[-1]} {word}"
        else:
            runs.append(word)
    return runs


def speech_pieces(text: str, first_piece_chars: int,
                  max_piece_chars: int = MAX_PIECE_CHARS) -> list[str]:
    """What the voice speaks, one graph call each, in order: the sentences; the first cut at
    its clauses into pieces of at most `first_piece_chars` when it is longer (0: never), so
    the first audio does not wait for a long sentence; any other cut only when it is longer
    than `max_piece_chars`. Only the first is cut for time: a cut is a pause a listener
    hears, and after the first, lookahead (engine/voice/pipeline.py) has the next sentences
    spoken while the earlier ones play."""
    pieces = []
    for index, sentence in enumerate(split_sentences(text)):
        bound = max_piece_chars
        if index == 0 and first_piece_chars > 0:
            bound = min(bound, first_piece_chars)
        pieces += clause_pieces(sentence, bound)
    return pieces


def phonemize(sentence: str, espeak_voice: str, program: str = ESPEAK_PROGRAM) -> str:
    """One sentence's IPA: clauses joined by ", ", ending with its terminator, or the clause
    mark a piece cut from a sentence ends with (clause_pieces), else "."."""
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
    end = sentence[-1] if sentence[-1] in _ENDINGS else "."
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
