"""The chaos soak (bench/soak.py): its short form — the same code over a compressed schedule, a
fixed seed, the seeded engine — must hold every invariant, with every fault kind struck at
least once and overlaps among them; and each check, fed records made by hand, must break on
what it guards.

To see the short form fail when an invariant breaks, run it sabotaged:
`OMNI_DP_SOAK_SABOTAGE=router-stays-dead pytest tests/test_soak.py -k short` (the supervisor is
killed and not revived, then the router: nothing brings it back, the run is never whole again)
or `OMNI_DP_SOAK_SABOTAGE=wrong-reference` (one reference answer has a byte flipped: every
answer to it is wrong)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))  # the bench scripts import each other as top-level modules

import soak_checks as checks  # noqa: E402
import soak_load as load  # noqa: E402
from soak_nemesis import FAULTS, OVERLAPS, Fault, coverage_size, events  # noqa: E402

SHORT = ("--engine", "seeded", "--duration", "20s", "--seed", "3", "--gap", "1:2",
         "--delay", "1:2", "--stop-s", "3", "--supervisor-down-s", "3", "--sample-every",
         "0.5", "--status-every", "30", "--whole-bound", "120", "--warmup", "0", "--window",
         "1.5s", "--json")


@pytest.mark.slow
@pytest.mark.timeout(660)
def test_the_short_soak_holds_every_invariant(tmp_path):
    sabotage = os.environ.get("OMNI_DP_SOAK_SABOTAGE")
    argv = [sys.executable, str(BENCH / "soak.py"), *SHORT, "--record",
            str(tmp_path / "soak.md")] + (["--sabotage", sabotage] if sabotage else [])
    started = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the soak downs its run, then exits
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"the short soak ran past 540 s; its progress:\n{err[-4000:]}")
    wall = time.monotonic() - started
    result = json.loads(out)
    verdicts = {v["name"]: v for v in result["verdicts"]}
    assert set(verdicts) == {"references", "answers", "bounds", "whole", "commands",
                             "coverage", "flat", "down"}
    broken = [f"{name}: {v['detail']}" for name, v in verdicts.items() if not v["ok"]]
    assert not broken, f"{broken}\n{err[-4000:]}"
    assert proc.returncode == 0 and result["ok"]
    assert {f["kind"] for f in result["faults"]} == set(FAULTS)
    assert any(f["overlap"] for f in result["faults"])
    assert all(f["whole_s"] is not None for f in result["faults"])
    # the seeded engine answers byte for byte alike: every form is compared so
    assert result["exact"] == dict.fromkeys(("pcm", "sse", "wav-whole", "wav"), True)
    assert all(row["ok"] > 0 for row in result["requests"].values()), result["requests"]
    assert all(row["judged"] for row in result["drift"]), result["drift"]
    record = (tmp_path / "soak.md").read_text()
    assert "Requests by outcome" in record and "| answers | yes |" in record
    png = tmp_path / "soak-seeded-20s.png"
    assert png.stat().st_size < 200_000 and png.read_bytes()[:4] == b"\x89PNG"
    requests = sum(sum(row.values()) for row in result["requests"].values())
    print(f"short soak: {wall:.0f} s wall, {requests} requests, {len(result['faults'])} faults")


# --- the schedule ------------------------------------------------------------------------


def test_the_schedule_is_the_seeds_and_covers_every_kind_first():
    kinds, overlaps = list(FAULTS), list(OVERLAPS)

    def drawn(seed: int, n: int = 30) -> list:
        schedule = events(seed, kinds, overlaps, (1, 5), (1, 2))
        return [next(schedule) for _ in range(n)]

    assert drawn(7) == drawn(7) and drawn(7) != drawn(8)
    first = drawn(7)[:coverage_size(kinds, overlaps)]
    assert {k for e in first for k in e.kinds} == set(kinds)
    assert sorted(e.kinds for e in first if len(e.kinds) == 2) == sorted(overlaps)
    singles = [e for e in drawn(7, 200)[len(first):] if len(e.kinds) == 1]
    assert {e.kinds[0] for e in singles} == set(kinds)  # later, every kind on its own too
    lean = drawn(3, 4)
    assert coverage_size(kinds, [("replica-kill", "router-kill")]) == len(kinds) - 1
    assert all(1 <= e.gap <= 5 and 1 <= e.delay <= 2 for e in lean)


# --- an answer, judged by its form --------------------------------------------------------

PCM = bytes(range(256)) * 20


def wav(pcm: bytes, rate: int = 24000, size: int | None = None) -> bytes:
    header = b"RIFF" + struct.pack("<I", 36 + len(pcm)) + b"WAVEfmt " + struct.pack(
        "<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16) + b"data"
    return header + struct.pack("<I", len(pcm) if size is None else size) + pcm


def sse(*events: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)


def ask(form: str, **body) -> load.Ask:
    return load.Ask("interactive", form, {"input": "x", **body})


def exact(form: str, data: bytes) -> load.Reference:
    return load.Reference(load.payload(ask(form), data)[0], 0.0, True)


def test_a_reproducible_answer_is_compared_byte_for_byte():
    ref = exact("pcm", PCM)
    assert load.judge(ask("pcm"), ref, PCM) == (load.OK, "")
    assert load.judge(ask("pcm"), ref, PCM[:-100])[0] == load.SILENT  # a clean, short end
    flipped = PCM[:-1] + bytes([PCM[-1] ^ 1])
    assert load.judge(ask("pcm"), ref, flipped)[0] == load.WRONG
    whole = wav(PCM)
    assert load.judge(ask("wav-whole"), exact("wav-whole", whole), whole)[0] == load.OK
    assert load.judge(ask("wav-whole"), None, wav(PCM, size=10))[0] == load.WRONG
    assert load.judge(ask("wav"), None, wav(PCM, rate=22050))[0] == load.WRONG


def test_an_sse_stream_ends_with_its_done_event_or_an_error():
    delta = {"type": "speech.audio.delta", "audio": base64.b64encode(PCM).decode()}
    done = {"type": "speech.audio.done", "usage": {"output_tokens": 3}}
    assert load.judge(ask("sse"), None, sse(delta, done))[0] == load.OK
    assert load.judge(ask("sse"), None, sse(delta))[0] == load.SILENT
    error = {"error": {"message": "no other replica", "type": "upstream_failed", "code": 502}}
    assert load.judge(ask("sse"), None, sse(delta, error))[0] == load.CUT
    replica_error = {"type": "error", "error": {"message": "engine failed"}}
    assert load.judge(ask("sse"), None, sse(delta, replica_error))[0] == load.CUT


def test_an_unreproducible_answer_needs_a_plausible_duration():
    second = b"\0\0" * 24000
    ref = load.Reference(second * 2, 2.0, False)  # the voice: two seconds for this text
    assert load.judge(ask("pcm"), ref, second * 2 + b"\0\0" * 2400)[0] == load.OK
    assert load.judge(ask("pcm"), ref, second)[0] == load.SILENT
    assert load.judge(ask("wav-whole"), ref, wav(second))[0] == load.WRONG
    assert load.judge(ask("wav-whole"), ref, wav(second * 4))[0] == load.WRONG


def test_an_llm_stream_ends_with_done_and_its_token_count():
    llm = load.Ask("interactive", "llm-stream", {"max_tokens": 2}, "/v1/completions")
    chunk = {"choices": [{"text": "a"}]}
    usage = {"choices": [], "usage": {"completion_tokens": 2}}
    ref = load.Reference("ab", 2, False)
    body = sse(chunk, chunk, usage) + b"data: [DONE]\n\n"
    assert load.judge(llm, ref, body)[0] == load.OK
    assert load.judge(llm, ref, sse(chunk, chunk, usage))[0] == load.SILENT
    short = sse(chunk, {"choices": [], "usage": {"completion_tokens": 1}}) + b"data: [DONE]\n\n"
    assert load.judge(llm, ref, short)[0] == load.SILENT
    assert load.judge(llm, ref, sse(chunk, {"error": {"message": "cut"}}))[0] == load.CUT


# --- what a client saw, from a server that misbehaves on purpose -------------------------


async def _sent(routes: dict[str, object]) -> dict[str, str]:
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    seen = {}
    try:
        async with aiohttp.ClientSession() as session:
            for path in routes:
                client = load.Load(f"http://127.0.0.1:{port}", [], {}, {"interactive": 0.5})
                done, _ = await client.send(session, load.Ask("interactive", "pcm", {},
                                                              path))
                seen[path] = done.outcome
    finally:
        await runner.cleanup()
    return seen


async def _full(request):
    return web.json_response({"error": {"type": "full"}}, status=503,
                             headers={"Retry-After": "1"})


async def _bare_503(request):
    return web.json_response({"error": {"type": "no"}}, status=503)


async def _bad_gateway(request):
    return web.json_response({"error": {"type": "upstream_failed"}}, status=502)


async def _cut(request):
    response = web.StreamResponse()
    await response.prepare(request)
    await response.write(PCM[:100])
    request.transport.close()  # the stream breaks: no terminating chunk
    return response


async def _slow(request):
    await asyncio.sleep(2.5)  # past the bound (0.5 s) and the client's timeout (2 s)
    return web.Response(body=PCM)


def test_a_client_names_what_it_saw():
    seen = asyncio.run(_sent({"/full": _full, "/bare": _bare_503, "/gateway": _bad_gateway,
                              "/cut": _cut, "/slow": _slow}))
    assert seen == {"/full": load.REFUSED, "/bare": load.UNCLEAR, "/gateway": load.UNCLEAR,
                    "/cut": load.CUT, "/slow": load.TIMEOUT}

    async def refused() -> str:
        async with aiohttp.ClientSession() as session:
            client = load.Load("http://127.0.0.1:9", [], {}, {"interactive": 5.0})
            done, _ = await client.send(session, load.Ask("interactive", "pcm", {}))
            return done.outcome

    assert asyncio.run(refused()) == load.UNREACHABLE  # nothing listens on the discard port


# --- each invariant breaks on what it guards ----------------------------------------------


def done(outcome: str, start: float = 10.0, seconds: float = 1.0,
         cls: str = "interactive") -> load.Done:
    return load.Done(cls, "pcm", start, start + seconds, outcome)


def test_answers_allow_refusals_and_errored_cuts_and_the_router_down_only():
    router = Fault(0, "router-kill", at=10.0, whole_s=3.0)
    fine = [done(load.OK), done(load.REFUSED), done(load.CUT), done(load.UNREACHABLE, 11.0)]
    assert checks.answers(fine, [router], 120).ok
    for outcome in (load.WRONG, load.SILENT, load.UNCLEAR, load.TIMEOUT):
        verdict = checks.answers([*fine, done(outcome)], [router], 120)
        assert not verdict.ok and outcome in verdict.detail
    late = done(load.UNREACHABLE, start=20.0)  # failed after the router was back
    assert not checks.answers([late], [router], 120).ok
    never = Fault(0, "router-kill", at=10.0)  # never whole: down until the bound
    assert checks.answers([late], [never], 120).ok
    assert not checks.answers([done(load.UNREACHABLE)], [], 120).ok


def test_bounds_whole_commands_and_coverage_break():
    limits = {"interactive": 20.0, "bulk": 60.0}
    assert checks.bounds([done(load.OK, seconds=19), done(load.OK, 0, 59, "bulk")], limits).ok
    assert not checks.bounds([done(load.OK, seconds=21)], limits).ok
    assert not checks.bounds([done(load.TIMEOUT, seconds=1)], limits).ok
    healed = Fault(0, "replica-kill", at=0, whole_s=14.0)
    assert checks.whole([healed], 120).ok
    assert not checks.whole([healed, Fault(1, "router-kill", at=30, problems=["no router"])],
                            120).ok
    assert not checks.whole([], 120).ok
    assert checks.commands([Fault(0, "scale", at=0, rc=0), healed]).ok
    assert not checks.commands([Fault(0, "scale", at=0, rc=3, detail="scale: exit 3")]).ok
    kinds = ["replica-kill", "router-kill"]
    pair = [Fault(0, "replica-kill", 0, overlap="router-kill"),
            Fault(0, "router-kill", 1, overlap="replica-kill")]
    assert checks.coverage(pair, kinds).ok
    assert not checks.coverage(pair[:1], kinds).ok
    assert not checks.coverage([Fault(0, k, 0) for k in kinds], kinds).ok  # no overlap


def samples(role: str, rss: list[int], fds: int = 20, threads: int = 5, pid: int = 100):
    from soak_run import Sample

    return [Sample(float(t), role, (pid,), value * checks.MiB, fds, threads)
            for t, value in enumerate(rss)]


def test_flat_breaks_on_growth_and_on_too_few_samples():
    tolerance = checks.Tolerance()
    steady = samples("router", [50] * 60)
    rows = checks.drift(steady, ["router"], warmup=5, count=5, tolerance=tolerance)
    assert checks.flat(rows, tolerance).ok and rows[0]["rss"][:2] == (50 * checks.MiB,) * 2
    leaking = samples("router", [50 + t * 2 for t in range(60)])  # 2 MiB a sample
    assert not checks.flat(checks.drift(leaking, ["router"], 5, 5, tolerance), tolerance).ok
    fds = [*samples("router", [50] * 30),
           *(s for s in samples("router", [50] * 60, fds=60) if s.t >= 30)]  # 40 more fds
    assert not checks.flat(checks.drift(fds, ["router"], 5, 5, tolerance), tolerance).ok
    short = checks.drift(samples("router", [50] * 8), ["router"], 0, 5, tolerance)
    assert not checks.flat(short, tolerance).ok  # 8 samples: not two windows of 5
    assert not checks.flat([], tolerance).ok


def test_flat_judges_the_samples_taken_while_no_fault_was_going_on():
    faults = [Fault(0, "rolling-restart", at=10, whole_s=20), Fault(0, "replica-kill", at=12,
                                                                      whole_s=22),
              Fault(1, "router-kill", at=50, whole_s=5), Fault(2, "scale", at=70)]
    assert checks.quiet(faults, 100) == [(0.0, 10), (34, 50), (55, 70)]
    assert checks.quiet([], 100) == [(0.0, 100)]
    # a restart's cold process (20 MiB) inside the faults: no baseline, no peak judged
    rss = [20 if 10 <= t < 34 else 50 for t in range(70)]
    tolerance = checks.Tolerance()
    spans = checks.quiet(faults, 70)
    rows = checks.drift(samples("replica 0", rss), ["replica 0"], 0, 5, tolerance, spans)
    assert rows[0]["rss"][:2] == (50 * checks.MiB,) * 2 and checks.flat(rows, tolerance).ok
    everything = checks.drift(samples("replica 0", [*rss[:34], *[99] * 36]), ["replica 0"], 0, 5,
                              tolerance)
    assert not checks.flat(everything, tolerance).ok


def test_down_breaks_on_anything_left():
    clean = {"down_rc": 0, "left_behind": [], "ports_taken": [], "files_left": [],
             "run_dir_left": False}
    assert checks.down(clean).ok
    for key, value in (("down_rc", 3), ("left_behind", [{"pid": 1, "name": "python"}]),
                       ("ports_taken", [8000]), ("files_left", ["omni-dp-stages-x"]),
                       ("run_dir_left", True)):
        assert not checks.down({**clean, key: value}).ok, key
