"""The soak's load (bench/soak.py): clients of two classes sending in a loop through the router,
each answer checked and named by what its client saw. Apart from the nemesis and the checks.

- **interactive**: short texts, streamed — raw PCM and SSE (for vLLM: streamed completions);
- **bulk**: long texts, WAV whole (`stream: false`) and streamed (vLLM: whole completions).

Every ask is answered twice before any fault: equal answers make it the reference, compared
byte for byte (the seeded engine: audio; vLLM: text); an engine whose two answers differ (the
voice: noise drawn in its graph) is checked for form instead — decodable, 24 kHz mono 16-bit,
and a duration within `DURATION_RANGE` of its reference's (LLM: the asked token count).
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import time
from dataclasses import dataclass, field

import aiohttp
from router_faults import TEXTS

OK, REFUSED, UNCLEAR, CUT, SILENT, WRONG, UNREACHABLE, TIMEOUT = (
    "ok", "refused", "refused without Retry-After", "cut with an error",
    "cut without an error", "wrong answer", "unreachable", "timeout")
OUTCOMES = (OK, REFUSED, UNCLEAR, CUT, SILENT, WRONG, UNREACHABLE, TIMEOUT)
RATE = 24000  # every format's rate (docs/contracts.md, "Sample rate")
DURATION_RANGE = (0.75, 1.35)  # an unreproducible answer's duration against its reference's
LONG_TEXTS = [
    "Your order has shipped and will arrive on Tuesday. Please keep the receipt. The courier "
    "will call you an hour before arrival, and if you are not home he will leave the parcel "
    "with a neighbour. Thank you for shopping with us; we hope to see you again soon.",
    "Welcome to the quarterly review. Revenue grew in every region, led by the north. Costs "
    "stayed flat, so the margin rose by two points. Next quarter we open two new offices and "
    "hire forty people; the details follow in the appendix.",
]
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):",
           "The quick brown fox"]


@dataclass(frozen=True)
class Ask:
    """One request a client sends: its class, its form (how the answer is read) and body."""

    cls: str  # interactive | bulk
    form: str  # pcm | sse | wav | wav-whole | llm-stream | llm-whole
    body: dict
    path: str = "/v1/audio/speech"

    @property
    def key(self) -> str:
        return json.dumps(self.body, sort_keys=True)


def asks(engine: str, model: str | None = None) -> list[Ask]:
    """What each engine is asked: seeded (with seeds and codec-token budgets), voice, vllm."""
    if engine == "vllm":
        def llm(cls: str, form: str, prompt: str, tokens: int) -> Ask:
            body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                    "ignore_eos": True, "stream": form == "llm-stream"}
            if form == "llm-stream":
                body["stream_options"] = {"include_usage": True}
            return Ask(cls, form, body, "/v1/completions")

        return ([llm("interactive", "llm-stream", p, 16) for p in PROMPTS]
                + [llm("bulk", "llm-whole", p, 96) for p in PROMPTS[:2]]
                + [llm("bulk", "llm-stream", p, 96) for p in PROMPTS[2:]])
    seeded = engine == "seeded"

    def speech(cls: str, form: str, text: str, seed: int, tokens: int) -> Ask:
        body: dict = {"input": text}
        if seeded:
            body.update(seed=seed, max_new_tokens=tokens)
        body.update({"pcm": {"response_format": "pcm"},
                     "sse": {"response_format": "pcm", "stream_format": "sse"},
                     "wav": {"response_format": "wav"},
                     "wav-whole": {"response_format": "wav", "stream": False}}[form])
        return Ask(cls, form, body)

    return ([speech("interactive", form, text, seed, 40) for text in TEXTS
             for seed, form in ((1, "pcm"), (2, "sse"))]
            + [speech("bulk", form, text, 3, 200) for text in LONG_TEXTS
               for form in ("wav-whole", "wav")])


@dataclass
class Done:
    """One request as its client saw it (times: seconds since the soak started)."""

    cls: str
    form: str
    start: float
    end: float
    outcome: str
    status: int | None = None
    first_byte: float | None = None  # seconds after start
    size: int = 0
    replica: str | None = None
    detail: str = ""

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Reference:
    payload: bytes | str
    measure: float  # audio seconds, or completion tokens
    exact: bool  # two answers before any fault were equal: compare byte for byte


class Malformed(ValueError):
    """The answer cannot be read as its form: `cut` when it broke off with an error."""

    def __init__(self, message: str, cut: bool = False) -> None:
        super().__init__(message)
        self.cut = cut


def wav_samples(data: bytes, whole: bool) -> bytes:
    if len(data) < 44 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise Malformed(f"not a WAV ({len(data)} bytes)")
    channels, rate, _, _, bits = struct.unpack_from("<HIIHH", data, 22)
    if (channels, rate, bits) != (1, RATE, 16) or data[36:40] != b"data":
        raise Malformed(f"WAV of {channels} channel(s), {rate} Hz, {bits} bits")
    size = struct.unpack_from("<I", data, 40)[0]
    if whole and size != len(data) - 44:
        raise Malformed(f"a whole WAV's data size says {size}, it has {len(data) - 44}")
    return data[44:]


def sse_events(data: bytes) -> list:
    """The `data:` payloads of an SSE body, parsed (`[DONE]` kept as the string)."""
    events = []
    for block in data.decode(errors="replace").split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data:"):
                text = line[5:].strip()
                events.append(text if text == "[DONE]" else json.loads(text))
    return events


def speech_payload(form: str, data: bytes) -> tuple[bytes, float]:
    """(what a reference compares, the audio's seconds)."""
    if form == "sse":
        events = sse_events(data)
        if any(e.get("type") == "error" or "error" in e for e in events):
            raise Malformed(f"SSE error event: {json.dumps(events[-1])[:200]}", cut=True)
        if not events or events[-1].get("type") != "speech.audio.done":
            raise Malformed("SSE stream ended without its done event")
        pcm = b"".join(base64.b64decode(e["audio"]) for e in events if "audio" in e)
        return pcm + json.dumps(events[-1]).encode(), len(pcm) / 2 / RATE
    pcm = data if form == "pcm" else wav_samples(data, form == "wav-whole")
    if len(pcm) % 2:
        raise Malformed("odd number of PCM bytes")
    return pcm, len(pcm) / 2 / RATE


def llm_payload(form: str, data: bytes) -> tuple[str, float]:
    """(the completion's text, its completion tokens)."""
    if form == "llm-whole":
        answer = json.loads(data)
        return answer["choices"][0]["text"], answer["usage"]["completion_tokens"]
    events = sse_events(data)
    if any(isinstance(e, dict) and "error" in e for e in events):
        raise Malformed("an error chunk in the stream", cut=True)
    if not events or events[-1] != "[DONE]":
        raise Malformed("stream ended without [DONE]")
    chunks = [e for e in events if isinstance(e, dict)]
    usage = next((e["usage"] for e in reversed(chunks) if e.get("usage")), None)
    if usage is None:
        raise Malformed("no usage chunk")
    text = "".join(c["text"] for e in chunks for c in e.get("choices", []))
    return text, usage["completion_tokens"]


def payload(ask: Ask, data: bytes) -> tuple[bytes | str, float]:
    try:
        if ask.form.startswith("llm"):
            return llm_payload(ask.form, data)
        return speech_payload(ask.form, data)
    except Malformed:
        raise
    except (ValueError, KeyError, IndexError, TypeError, UnicodeDecodeError) as exc:
        raise Malformed(f"unreadable: {exc!r}"[:200]) from exc


def judge(ask: Ask, ref: Reference | None, data: bytes) -> tuple[str, str]:
    """A 200 answer read to its clean end: ok, wrong, or cut without an error."""
    try:
        got, measure = payload(ask, data)
    except Malformed as exc:
        return (CUT if exc.cut else SILENT if ask.form in ("sse", "llm-stream") else WRONG,
                str(exc))
    if ref is None:
        return OK, ""
    if ref.exact:
        if got == ref.payload:
            return OK, ""
        short = isinstance(got, type(ref.payload)) and ref.payload[:len(got)] == got
        return (SILENT if short else WRONG,
                f"{len(got)} against {len(ref.payload)} in the reference")
    if ask.form.startswith("llm"):
        ok = measure == ask.body["max_tokens"]
        return (OK, "") if ok else (SILENT, f"{measure} tokens of {ask.body['max_tokens']}")
    low, high = (ref.measure * f for f in DURATION_RANGE)
    if low <= measure <= high:
        return OK, ""
    return (SILENT if measure < low and ask.form != "wav-whole" else WRONG,
            f"{measure:.2f} s of audio against {ref.measure:.2f} s in the reference")


@dataclass
class Load:
    """The clients, their asks, the references and every request as its client saw it."""

    url: str
    asks: list[Ask]
    clients: dict[str, int]  # class → how many clients
    bounds: dict[str, float]  # class → the longest a request may take, seconds
    t0: float = field(default_factory=time.monotonic)
    headers: dict = field(default_factory=dict)
    refs: dict[str, Reference] = field(default_factory=dict)
    done: list[Done] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def send(self, session: aiohttp.ClientSession, ask: Ask) -> tuple[Done, bytes]:
        done = Done(ask.cls, ask.form, self.now(), 0.0, OK)
        data, broken = bytearray(), None
        timeout = aiohttp.ClientTimeout(total=self.bounds[ask.cls] * 2 + 1, sock_connect=5)
        try:
            async with session.post(self.url + ask.path, json=ask.body, timeout=timeout,
                                    headers=self.headers) as resp:
                done.status, done.replica = resp.status, resp.headers.get("X-Omni-DP-Replica")
                retry_after = resp.headers.get("Retry-After")
                async for chunk in resp.content.iter_any():
                    if done.first_byte is None:
                        done.first_byte = self.now() - done.start
                    data += chunk
        except asyncio.TimeoutError:
            broken = TIMEOUT
        except (aiohttp.ClientError, OSError) as exc:  # refused, reset, a broken body
            broken = UNREACHABLE if done.status is None else CUT
            done.detail = f"{type(exc).__name__}: {exc}"[:200]
        done.end, done.size = self.now(), len(data)
        if broken is not None:
            done.outcome = broken
        elif done.status != 200:
            clear = done.status in (429, 503) and retry_after is not None
            done.outcome = REFUSED if clear else UNCLEAR
            done.detail = bytes(data[:200]).decode(errors="replace")
        else:
            done.outcome, done.detail = judge(ask, self.refs.get(ask.key), bytes(data))
        return done, bytes(data)

    async def references(self, session: aiohttp.ClientSession, at_once: int = 4) -> list[str]:
        """Each ask answered twice before any fault (`at_once` asks at a time); what could
        not be answered, said."""
        problems: list[str] = []
        room = asyncio.Semaphore(at_once)

        async def twice(ask: Ask) -> None:
            answers = []
            async with room:
                for _ in range(2):
                    done, data = await self.send(session, ask)
                    if done.outcome != OK:
                        problems.append(f"{ask.form} {ask.key[:60]}: {done.outcome} "
                                        f"{done.status} {done.detail[:200]}")
                        return
                    answers.append(payload(ask, data))
            (first, measure), (second, _) = answers
            self.refs[ask.key] = Reference(first, measure, first == second)

        await asyncio.gather(*(twice(ask) for ask in self.asks))
        return problems

    async def client(self, session: aiohttp.ClientSession, cls: str, offset: int) -> None:
        mine = [ask for ask in self.asks if ask.cls == cls]
        i = offset
        while not self.stop.is_set():
            done, _ = await self.send(session, mine[i % len(mine)])
            self.done.append(done)
            i += 1
            if done.outcome in (REFUSED, UNCLEAR, UNREACHABLE):
                await asyncio.sleep(0.5)  # as a client told Retry-After: 1 would, shortened

    def start(self, session: aiohttp.ClientSession) -> list[asyncio.Task]:
        return [asyncio.create_task(self.client(session, cls, i))
                for cls, count in self.clients.items() for i in range(count)]

    def exact(self) -> dict[str, bool]:
        """Per form, whether its answers are compared byte for byte."""
        forms: dict[str, bool] = {}
        for ask in self.asks:
            ref = self.refs.get(ask.key)
            forms[ask.form] = forms.get(ask.form, True) and bool(ref and ref.exact)
        return forms
