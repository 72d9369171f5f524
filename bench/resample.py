"""The cost and the harm of OpenAI's 24 kHz for the 22,050 Hz voice (omni_dp/engine/audio.py):
CPU seconds per second of audio of each libsamplerate sinc converter, on the voice's own speech
in sentence-sized chunks as a replica resamples it; each one's SNR on tones (3 kHz, and 9.5 kHz,
inside the medium converter's 90 % band) and against the best converter on the voice's speech
(with the share of the voice's energy above 9 kHz, where the converters differ); and word recall
of the offline recognizer (tests/support/recognizer.py) on the same synthesis at 22,050 Hz and
resampled to 24 kHz.
A few seconds; the machine and its load (`uptime`) are printed with the figures.

    python bench/resample.py                   # the table for bench/results/resample.md
    python bench/resample.py --seconds 5 --no-recall
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from omni_dp.engine.audio import OUTPUT_RATE, RESAMPLER_CONVERTER, Resampler, wav_header

ROOT = Path(__file__).resolve().parents[1]
CONVERTERS = ("sinc_fastest", "sinc_medium", "sinc_best")
VOICE_RATE = 22050
TEXTS = (
    "Please call me back in the morning.",
    "Several replicas share one machine behind a router. Each one speaks on its own.",
    "The weather is very nice today, so we will walk to the station.",
    "Thank you very much for your help.",
    "Turn left at the second light and park behind the blue building.",
    "My phone number is five five five, one two three four.",
)


def sentences_of_the_voice() -> list[tuple[str, bytes]]:
    """Each sentence of TEXTS and joe's PCM of it (22,050 Hz), as its pipeline speaks them."""
    from omni_dp.engine.voice.model import VoiceSession, find_voice, pcm16
    from omni_dp.engine.voice.phonemes import phoneme_ids, phonemize, split_sentences

    voice = find_voice("joe")
    session = VoiceSession(voice, "cpu")
    return [(sentence, pcm16(session.run(
                phoneme_ids(phonemize(sentence, voice.espeak_voice), voice.phoneme_id_map),
                length_scale=voice.length_scale, speaker=0)))
            for text in TEXTS for sentence in split_sentences(text)]


def cpu_per_audio_second(chunks: list[bytes], converter: str, seconds: float) -> float:
    """CPU seconds this process spends per second of audio resampling `chunks`, one response
    (a fresh Resampler) per pass, passes until `seconds` of audio."""
    per_pass = sum(len(c) for c in chunks) / 2 / VOICE_RATE
    passes = max(1, round(seconds / per_pass))
    samples = [np.frombuffer(c, "<i2") for c in chunks]
    started = time.process_time()
    for _ in range(passes):
        resampler = Resampler(VOICE_RATE, OUTPUT_RATE, converter)
        for chunk in samples:
            resampler(chunk)
        resampler.finish()
    return (time.process_time() - started) / (passes * per_pass)


def resampled(samples: np.ndarray, converter: str) -> np.ndarray:
    resampler = Resampler(VOICE_RATE, OUTPUT_RATE, converter)
    return np.concatenate([resampler(samples), resampler.finish()]).astype(float)


def snr_db(got: np.ndarray, want: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(want**2) / max(np.sum((got - want) ** 2), 1e-9)))


def share_above(samples: np.ndarray, hz: float) -> float:
    """The share of the signal's energy above `hz`."""
    power = np.abs(np.fft.rfft(samples.astype(float))) ** 2
    return float(power[np.fft.rfftfreq(len(samples), 1 / VOICE_RATE) > hz].sum() / power.sum())


def tone_snr_db(converter: str, hz: float) -> float:
    """SNR of a resampled tone against the tone sampled at 24 kHz (away from the ends)."""
    def tone(rate: int) -> np.ndarray:
        return np.round(np.sin(2 * np.pi * hz * np.arange(rate) / rate) * 8000)

    got, want = resampled(tone(VOICE_RATE).astype("<i2"), converter), tone(OUTPUT_RATE)
    return snr_db(got[256:-256], want[256:-256])


def recall(spoken: list[tuple[str, bytes]]) -> dict[str, tuple[int, int]]:
    """Words of each sentence the recognizer heard, summed: at the voice's rate and at 24 kHz."""
    sys.path.insert(0, str(ROOT / "tests"))  # the recognizer the voice's tests hear with
    from support.recognizer import transcribe, word_recall

    heard = {"22,050 Hz (the voice's own)": [0, 0], "24 kHz (resampled)": [0, 0]}
    for sentence, pcm in spoken:
        resampler = Resampler(VOICE_RATE, OUTPUT_RATE)
        out = resampler(np.frombuffer(pcm, "<i2")).tobytes() + resampler.finish().tobytes()
        for key, wav in zip(heard, (wav_header(VOICE_RATE, len(pcm)) + pcm,
                                    wav_header(OUTPUT_RATE, len(out)) + out), strict=True):
            hits, total = word_recall(sentence, transcribe(wav))
            heard[key][0] += hits
            heard[key][1] += total
    return {key: (hits, total) for key, (hits, total) in heard.items()}


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
                 platform.processor() or "unknown CPU")
    return f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.release()}"


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="seconds of audio resampled per converter (default 60)")
    parser.add_argument("--no-recall", action="store_true", help="skip the recognizer")
    args = parser.parse_args()

    print(f"machine: {machine()}; Python {platform.python_version()}")
    print(f"uptime before: {uptime()}")
    spoken = sentences_of_the_voice()
    chunks = [pcm for _, pcm in spoken]
    speech = np.frombuffer(b"".join(chunks), "<i2")
    print(f"input: joe, {len(chunks)} sentences, {len(speech) / VOICE_RATE:.1f} s per pass, "
          f"one chunk per sentence; its energy above 9 kHz: {share_above(speech, 9000):.1e}\n")
    print("| converter | CPU s per audio s | SNR 3 kHz tone | SNR 9.5 kHz tone | "
          "SNR vs sinc_best, the voice |")
    print("|---|---|---|---|---|")
    best = resampled(speech, "sinc_best")
    for converter in CONVERTERS:
        cost = cpu_per_audio_second(chunks, converter, args.seconds)
        mark = " (served)" if converter == RESAMPLER_CONVERTER else ""
        versus = "—" if converter == "sinc_best" else \
            f"{snr_db(resampled(speech, converter), best):.0f} dB"
        print(f"| {converter}{mark} | {cost:.4f} | {tone_snr_db(converter, 3000):.0f} dB | "
              f"{tone_snr_db(converter, 9500):.0f} dB | {versus} |")
    if not args.no_recall:
        print("\n| audio | words heard |")
        print("|---|---|")
        for key, (hits, total) in recall(spoken).items():
            print(f"| {key} | {hits}/{total} ({hits / total:.0%}) |")
    print(f"\nuptime after: {uptime()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
