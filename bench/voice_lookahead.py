"""The voice's sentence lookahead, its clause-sized first piece and a long input, measured on
one `omni-dp serve --model joe` replica (loopback, one request at a time).

(a) window: one 20-sentence input, streamed, c=1, the voice stage in `--voice.replicas 1` or
    `2` processes of its own (`--voice.process voice`), `--voice-lookahead 0` (one sentence at
    a time: before) or `2`: wall time to the answer's end and time to first audio.
(b) first piece: time to first audio of inputs whose first sentence has 6, 20 or 40 words
    (commas where a speaker pauses), `--voice-first-piece-chars 0` (spoken whole: before) and
    80 (the default: cut at its clauses), the front speaking (default placement).
(c) long input: a 20,000-character input (about 250 sentences) streamed to its end with
    `--max-input-chars 20000`: the replica's peak RSS (VmHWM of the serve process: the kernel's
    high-water mark, not a sample), time to first audio, wall time; and the same for a
    2,000- and a 4,096-character input, to see whether the peak grows with the input.

Each configuration starts its own serve process, sends one warm-up request, then `--repeat`
measured ones; the figures are medians. Time to first audio: from sending the request to the
first byte of PCM (response_format pcm, so no header comes first).

    python bench/voice_lookahead.py --repeat 3 --out bench/results/voice_lookahead.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = "joe"
THREADS = 2
# Everyday sentences the voice says well, cycled to make the inputs.
SENTENCES = (
    "Thank you very much for your help.",
    "I would like a cup of coffee.",
    "It is a very nice day today.",
    "I am going to the store.",
    "The train leaves at nine in the morning.",
    "We walked along the river until the sun went down.",
    "Please close the window before you leave the room.",
    "My sister lives in a small house near the sea.",
)
# First sentences of 6, 20 and 40 words, with commas where a speaker pauses.
FIRST_SENTENCES = {
    6: "I made a cup of tea.",
    20: "When I got home from work last night, the house was quiet, and the dog was "
        "sleeping by the door.",
    40: "When I got home from work last night, the house was very quiet, the lights in the "
        "kitchen were off, the dog was sleeping by the door, and my sister, who had come to "
        "stay for the week, was upstairs.",
}
_LISTENING = re.compile(r"listening on http://([\d.]+):(\d+)")


def text_of(sentences: int) -> str:
    return " ".join(SENTENCES[i % len(SENTENCES)] for i in range(sentences))


def text_of_chars(chars: int) -> str:
    """Whole sentences, cycled, up to `chars` characters."""
    text, i = "", 0
    while len(text) + 1 + len(SENTENCES[i % len(SENTENCES)]) <= chars:
        text = f"{text} {SENTENCES[i % len(SENTENCES)]}".strip()
        i += 1
    return text


class Serve:
    """One `omni-dp serve` process on a free loopback port; stopped with SIGTERM."""

    def __init__(self, log: Path, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("OMNI_DP_")}
        self.log = log
        self._out = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omni_dp", "serve", "--model", MODEL, "--port", "0",
             "--threads", str(THREADS), *args], stdout=self._out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=env)
        self.host, self.port = self._wait_ready()

    def _wait_ready(self, timeout: float = 120) -> tuple[str, int]:
        deadline = time.monotonic() + timeout
        address = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited {self.proc.returncode}: "
                                   f"{self.log.read_text()[-1500:]}")
            match = address or _LISTENING.search(self.log.read_text())
            if match:
                address = match
                try:
                    status, _ = request(match.group(1), int(match.group(2)), "GET", "/health")
                except OSError:
                    status = 0
                if status == 200:
                    return match.group(1), int(match.group(2))
            time.sleep(0.1)
        raise RuntimeError(f"serve never became ready: {self.log.read_text()[-1500:]}")

    def peak_rss(self) -> int:
        """The serve process's resident high-water mark (VmHWM), in bytes."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmHWM")

    def rss(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()


def request(host: str, port: int, method: str, path: str) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection(host, port, timeout=30)
    try:
        connection.request(method, path)
        answer = connection.getresponse()
        return answer.status, answer.read()
    finally:
        connection.close()


def speak(serve: Serve, text: str) -> dict:
    """One streamed request: seconds to the first PCM byte and to the end, audio seconds."""
    connection = http.client.HTTPConnection(serve.host, serve.port, timeout=600)
    body = json.dumps({"input": text, "response_format": "pcm", "stream": True})
    try:
        started = time.perf_counter()
        connection.request("POST", "/v1/audio/speech", body,
                           {"Content-Type": "application/json"})
        answer = connection.getresponse()
        if answer.status != 200:
            raise RuntimeError(f"{answer.status}: {answer.read()[:300]!r}")
        rate = int(answer.getheader("X-Sample-Rate"))
        first = None
        size = 0
        while chunk := answer.read1(1 << 16):
            first = first or time.perf_counter()
            size += len(chunk)
        ended = time.perf_counter()
    finally:
        connection.close()
    return {"ttfa_s": first - started, "wall_s": ended - started,
            "audio_s": size / 2 / rate}


def medians(runs: list[dict]) -> dict:
    return {key: round(statistics.median(r[key] for r in runs), 3) for key in runs[0]}


def measured(serve: Serve, text: str, repeat: int) -> dict:
    speak(serve, text)  # warm-up: the graph's first call, the phonemizer's first process
    runs = [speak(serve, text) for _ in range(repeat)]
    return {**medians(runs), "runs": len(runs),
            "wall_s_each": [round(r["wall_s"], 2) for r in runs],
            "ttfa_s_each": [round(r["ttfa_s"], 3) for r in runs]}


def window(args: argparse.Namespace, logs: Path) -> list[dict]:
    rows = []
    text = text_of(20)
    for replicas in (1, 2):
        for lookahead in (0, 2):
            serve = Serve(logs / f"window-{replicas}-{lookahead}.log", "--voice.process",
                          "voice", "--voice.replicas", str(replicas), "--voice-lookahead",
                          str(lookahead))
            try:
                row = {"bench": "window", "voice_replicas": replicas, "lookahead": lookahead,
                       "sentences": 20, "chars": len(text),
                       **measured(serve, text, args.repeat)}
            finally:
                serve.stop()
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def first_piece(args: argparse.Namespace, logs: Path) -> list[dict]:
    rows = []
    for bound in (0, 80):
        serve = Serve(logs / f"first-{bound}.log", "--voice-first-piece-chars", str(bound))
        try:
            for words, first in FIRST_SENTENCES.items():
                assert len(first.split()) == words, (words, len(first.split()))
                text = f"{first} {text_of(2)}"
                row = {"bench": "first_piece", "first_piece_chars": bound,
                       "first_words": words, "first_chars": len(first),
                       **measured(serve, text, args.repeat)}
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            serve.stop()
    return rows


def long_input(args: argparse.Namespace, logs: Path) -> list[dict]:
    rows = []
    for chars in (2000, 4096, 20000):
        text = text_of_chars(chars)
        serve = Serve(logs / f"long-{chars}.log", "--max-input-chars", "20000")
        try:
            speak(serve, text_of(3))  # warm-up
            before = serve.rss()
            result = speak(serve, text)
            row = {"bench": "long_input", "chars": len(text),
                   "rss_before_mb": round(before / 2**20), "peak_rss_mb":
                   round(serve.peak_rss() / 2**20), "rss_after_mb": round(serve.rss() / 2**20),
                   **{k: round(v, 2) for k, v in result.items()}}
        finally:
            serve.stop()
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", choices=("window", "first_piece", "long_input"),
                        action="append", help="run these parts only (repeatable)")
    parser.add_argument("--out", type=Path, default=None, help="a JSON file for the rows")
    args = parser.parse_args()
    parts = args.only or ["window", "first_piece", "long_input"]
    started = load()
    print(f"# {platform.machine()}, {os.cpu_count()} CPUs; {started}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="odp-lookahead-") as logs:
        for part in parts:
            rows += {"window": window, "first_piece": first_piece,
                     "long_input": long_input}[part](args, Path(logs))
    ended = load()
    print(f"# {ended}", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"cpus": os.cpu_count(), "machine": platform.machine(),
                                        "uptime_start": started, "uptime_end": ended,
                                        "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
