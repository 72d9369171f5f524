"""LLM streams that survive their replica (--migration-limit): a streamed completions or chat
answer cut after its first byte goes on on another replica from the token ids the client has,
and the client reads one stream, the uncut one's for greedy decoding.

The replicas here are stand-ins speaking vLLM 0.32's chunks over a toy model
(support/llm_standin.py); tests/launcher/test_engine_vllm_live.py does it with real vLLM
replicas and kill -9."""

from __future__ import annotations

import json
import logging
import random

import aiohttp
import pytest

from omni_dp.router.migration import MIGRATION_PATHS, plan_migration

from support.http_client import client
from support.llm_standin import (
    MODEL,
    PROMPT_DUMP,
    Failure,
    next_token,
    pending,
    prompt_ids,
    standin,
)
from support.openai_stream import parse_sse, post_stream
from support.router import (
    Backend,
    backends,
    make_config,
    routes,
    run,
    sample,
    scrape,
    serve,
    total,
)

COMPLETION = {"model": MODEL, "prompt": "Tell me about omni", "max_tokens": 40,
              "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about omni"}],
        "max_tokens": 40, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}
PATHS = {"completions": ("/v1/completions", COMPLETION),
         "chat": ("/v1/chat/completions", CHAT)}


async def through(handlers: list, path: str, body, **options):
    """`body` streamed through a router over stand-ins a, b, ... (round robin: a first);
    (what the client read, what each stand-in received, the metrics)."""
    bs = [Backend(chr(ord("a") + i), h) for i, h in enumerate(handlers)]
    options.setdefault("migration_limit", 1)
    async with backends(*bs), \
            serve(make_config([f"{b.name}={b.url}" for b in bs], policy="round_robin",
                              **options)) as served, client() as session:
        read, _ = await post_stream(session, served.url + path, body)
        await served.wait_idle()
        return read, [b.seen for b in bs], await scrape(session, served.url)


async def uncut(path: str, body) -> object:
    """The same request answered whole by one healthy stand-in, directly."""
    (b,) = bs = [Backend("u", standin())]
    async with backends(*bs), client() as session:
        read, _ = await post_stream(session, b.url + path, body)
    return read


def pending_cut(body: dict, chat: bool, *, after: int = 5, per_chunk: int = 1) -> int:
    """A cut (tokens generated, a whole number of chunks, at least `after`) whose last token
    is pending, i.e. ends in the middle of a character: the hardest place to go on from."""
    sequence = prompt_ids(body, chat)
    rng = random.Random(body.get("seed")) if body.get("temperature") else None
    for made in range(body["max_tokens"]):
        token = rng.randrange(4, 64) if rng else next_token(sequence)
        sequence.append(token)
        if made + 1 >= after and (made + 1) % per_chunk == 0 and pending(token):
            return made + 1
    raise AssertionError("no pending token at a chunk's end in the toy answer")


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_a_greedy_stream_cut_mid_answer_reads_as_the_uncut_one(caplog, kind):
    caplog.set_level(logging.INFO, logger="omni_dp.router.access")
    path, body = PATHS[kind]
    read, (a_seen, b_seen), metrics = run(through(
        [standin(Failure(after=9)), standin()], path, body))
    whole = run(uncut(path, {**body, "stream_options": {"include_usage": True}}))
    assert (read.status, read.broken, read.errors) == (200, False, [])
    assert read.text == whole.text and PROMPT_DUMP not in read.text
    assert read.usage == whole.usage == {"prompt_tokens": whole.usage["prompt_tokens"],
                                         "total_tokens": whole.usage["total_tokens"],
                                         "completion_tokens": 40}
    assert read.dones == 1 and read.finish == ["length"]
    # one answer: the first replica's identity on every chunk, ids removed (not asked for)
    assert {(c["id"], c["created"], c["object"]) for c in read.chunks} == \
        {(read.chunks[0]["id"], read.chunks[0]["created"],
          "chat.completion.chunk" if kind == "chat" else "text_completion")}
    assert read.chunks[0]["id"].endswith("-a-1")
    assert read.token_ids == []
    # the continuation: a completions request from the prompt's and the generated ids
    (first,), (continuation,) = a_seen, b_seen
    assert json.loads(first.body)["return_token_ids"] is True
    sent = json.loads(continuation.body)
    assert continuation.raw_path == "/v1/completions"
    prompt = prompt_ids(body, kind == "chat")
    assert sent["prompt"][:len(prompt)] == prompt
    generated = len(sent["prompt"]) - len(prompt)
    assert 0 < generated <= 9 and sent["max_tokens"] == 40 - generated
    assert (sent["temperature"], sent["stream"], sent["return_token_ids"]) == (0, True, True)
    assert "messages" not in sent and "echo" not in sent
    assert sample(metrics, "omni_dp_router_migrations_total", reason="midstream") == 1
    assert total(metrics, "omni_dp_router_streams_cut_total") == 0
    route = routes(caplog)["r"]
    assert (route["tried"], route["migrations"], route["outcome"]) == (["a", "b"],
                                                                      ["midstream"], "ok")
    assert route["migrated_at"] == 9  # the tokens the client had


def test_the_client_that_asked_for_token_ids_gets_them_all_once():
    path, body = PATHS["completions"]
    asked = {**body, "return_token_ids": True}
    read, (a_seen, _), _ = run(through([standin(Failure(after=6)), standin()], path, asked))
    whole = run(uncut(path, asked))
    assert read.token_ids == whole.token_ids and len(read.token_ids) == 40
    firsts = [ch["prompt_token_ids"] for c in read.chunks for ch in c["choices"]
              if ch.get("prompt_token_ids")]
    assert firsts == [prompt_ids(body, chat=False)]  # the prompt's ids once, as uncut
    assert a_seen[0].body == json.dumps(asked).encode()  # its body went up untouched


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_a_sampled_cut_right_after_a_token_in_the_middle_of_a_character(kind):
    """Continued from there, the engine would write the whole prompt's text first. The router
    held that token's chunk back (it shows no text yet), so the client never had it and the
    other replica goes on from the boundary before it: even sampled, one stream."""
    path, body = PATHS[kind]
    sampled = {**body, "temperature": 1.0, "seed": 3, "return_token_ids": True}
    cut = pending_cut(sampled, kind == "chat")
    read, (_, b_seen), metrics = run(through([standin(Failure(after=cut)), standin()], path,
                                             sampled))
    assert (read.broken, read.dones, len(read.token_ids)) == (False, 1, 40)
    assert PROMPT_DUMP not in read.text
    generated = len(json.loads(b_seen[0].body)["prompt"]) - len(prompt_ids(body, kind == "chat"))
    assert generated < cut  # the held token was generated anew by the other replica
    assert sample(metrics, "omni_dp_router_migrations_total", reason="midstream") == 1


@pytest.mark.parametrize("kind, per_chunk", [("completions", 3), ("chat", 2)])
def test_merged_chunks_go_on_from_the_last_clean_boundary_checked(kind, per_chunk):
    """Several tokens to a chunk (vLLM merges them when its reader lags), the last one in the
    middle of a character: the continuation starts at the last boundary known clean, and what
    the client has beyond it is checked and skipped; greedy, it is the uncut stream."""
    path, body = PATHS[kind]
    cut = pending_cut(body, kind == "chat", per_chunk=per_chunk)
    read, (_, b_seen), metrics = run(through(
        [standin(Failure(after=cut), per_chunk=per_chunk), standin(per_chunk=per_chunk)],
        path, body))
    whole = run(uncut(path, body))
    assert PROMPT_DUMP not in read.text
    assert (read.text, read.usage, read.dones) == (whole.text, whole.usage, 1)
    generated = len(json.loads(b_seen[0].body)["prompt"]) - len(prompt_ids(body, kind == "chat"))
    assert generated < cut
    assert sample(metrics, "omni_dp_router_migrations_total", reason="midstream") == 1


def test_a_sampled_continuation_that_goes_another_way_is_refused_not_spliced():
    """Merged chunks cut mid-character, sampled: the other replica draws other tokens where
    the client already has some, so the stream ends cut rather than read two answers."""
    path, body = PATHS["completions"]
    sampled = {**body, "temperature": 1.0, "seed": 3}
    cut = pending_cut(sampled, False, per_chunk=3)
    read, _, metrics = run(through(
        [standin(Failure(after=cut), per_chunk=3), standin(per_chunk=3)], path, sampled))
    assert read.broken and read.dones == 0
    assert sample(metrics, "omni_dp_router_streams_cut_total", why="resume_refused") == 1


def test_a_sampled_stream_reads_exactly_max_tokens():
    path, body = PATHS["completions"]
    sampled = {**body, "temperature": 1.0, "seed": 7, "return_token_ids": True}
    read, _, metrics = run(through([standin(Failure(after=11)), standin()], path, sampled))
    assert (read.status, read.broken, read.dones) == (200, False, 1)
    assert len(read.token_ids) == 40 and read.usage["completion_tokens"] == 40
    assert sample(metrics, "omni_dp_router_migrations_total", reason="midstream") == 1


@pytest.mark.parametrize("how, reason", [
    ("error_event", "replica_error"), ("abort", "replica_error"), ("close", "closed_early")])
def test_every_way_a_replica_fails_mid_stream_is_migrated(how, reason):
    path, body = PATHS["chat"]
    read, _, metrics = run(through([standin(Failure(after=8, how=how)), standin()],
                                   path, body))
    whole = run(uncut(path, body))
    assert (read.text, read.usage, read.dones, read.errors) == (whole.text, whole.usage, 1, [])
    assert sample(metrics, "omni_dp_router_migrations_total", reason=reason) == 1


def test_a_stalled_replica_is_found_hung_and_its_stream_migrated():
    path, body = PATHS["completions"]
    a = Backend("a", standin(Failure(after=8, how="stall")))

    def sick(backend: Backend) -> None:  # its /health stops answering once it stalled
        backend.health_status = 503 if backend.seen else 200

    a.on_probe = sick
    b = Backend("b", standin())

    async def main():
        config = make_config([f"a={a.url}", f"b={b.url}"], policy="round_robin",
                             migration_limit=1, stall_timeout_s=0.4, health_timeout=0.1)
        async with serve(config) as served, client() as session:
            read, _ = await post_stream(session, served.url + path, body)
            return read, await scrape(session, served.url)

    async def with_backends():
        async with backends(a, b):
            return await main()

    read, metrics = run(with_backends())
    whole = run(uncut(path, body))
    assert (read.text, read.usage, read.dones) == (whole.text, whole.usage, 1)
    assert sample(metrics, "omni_dp_router_migrations_total", reason="stall_timeout") == 1


def test_migration_limit_0_leaves_the_stream_cut_and_the_body_untouched():
    path, body = PATHS["completions"]
    raw = json.dumps(body).encode()
    read, (a_seen, b_seen), metrics = run(through(
        [standin(Failure(after=9)), standin()], path, raw, migration_limit=0))
    assert read.broken and read.dones == 0
    assert read.errors and read.errors[0]["error"]["code"] == 502
    assert b_seen == [] and a_seen[0].body == raw
    assert sample(metrics, "omni_dp_router_streams_cut_total", why="not_resumable") == 1


@pytest.mark.parametrize("change, why", [
    ({"n": 2}, "n"), ({"best_of": 3}, "best_of"), ({"use_beam_search": True}, "beam_search"),
    ({"response_format": {"type": "json_object"}}, "structured_output"),
    ({"guided_regex": "[a-z]+"}, "structured_output"), ({"logprobs": 1}, "logprobs"),
    ({"stop": ["\n"]}, "stop_strings"), ({"presence_penalty": 0.5}, "output_penalties"),
    ({"max_tokens": None}, "no_max_tokens"), ({"prompt": ["one", "two"]}, "several_prompts"),
])
def test_what_cannot_migrate_ends_cut_and_says_why(change, why):
    path, body = PATHS["completions"]
    asked = {k: v for k, v in {**body, **change}.items() if v is not None}
    read, (a_seen, b_seen), metrics = run(through(
        [standin(Failure(after=9)), standin()], path, asked))
    assert read.broken and read.dones == 0 and read.errors
    assert b_seen == []
    assert "return_token_ids" not in json.loads(a_seen[0].body)  # nothing asked of it
    assert sample(metrics, "omni_dp_router_streams_cut_total", why=why) == 1


def test_an_engine_that_gives_no_token_ids_is_not_migrated():
    path, body = PATHS["completions"]
    read, (_, b_seen), metrics = run(through(
        [standin(Failure(after=9), honours_token_ids=False), standin()], path, body))
    assert read.broken and b_seen == []
    assert sample(metrics, "omni_dp_router_streams_cut_total", why="no_token_ids") == 1


def test_past_migration_max_seq_len_a_stream_is_no_longer_tracked():
    path, body = PATHS["completions"]
    prompt = len(prompt_ids(body, chat=False))
    read, (_, b_seen), metrics = run(through(
        [standin(Failure(after=20)), standin()], path, body,
        migration_max_seq_len=prompt + 10))
    assert read.broken and b_seen == []
    assert sample(metrics, "omni_dp_router_streams_cut_total", why="max_seq_len") == 1


def test_migrations_are_bounded_and_never_go_back_to_a_replica_tried():
    path, body = PATHS["completions"]
    # round robin over the replicas not tried yet goes a, c, b
    handlers = [standin(Failure(after=5)), standin(), standin(Failure(after=15))]
    read, seen, metrics = run(through(handlers, path, body, migration_limit=2))
    whole = run(uncut(path, body))
    assert (read.text, read.usage, read.dones) == (whole.text, whole.usage, 1)
    assert [len(s) for s in seen] == [1, 1, 1]
    assert sample(metrics, "omni_dp_router_migrations_total", reason="midstream") == 2
    read, seen, metrics = run(through(handlers, path, body, migration_limit=1))
    assert read.broken and [len(s) for s in seen] == [1, 0, 1]
    assert sample(metrics, "omni_dp_router_streams_cut_total", why="migrations_spent") == 1


def test_a_stream_lost_after_its_finish_is_ended_by_the_router():
    """The finish chunk reached the client, then the replica died: nothing is left to
    generate, so the router sends the usage and [DONE] itself."""
    path, body = PATHS["completions"]

    def dies_after_finish(backend, request, seen):
        handler = standin(Failure(after=40))  # fails where only usage and [DONE] are left
        return handler(backend, request, seen)

    read, (_, b_seen), _ = run(through([dies_after_finish, standin()], path, body))
    whole = run(uncut(path, body))
    assert (read.text, read.usage, read.dones, read.broken) == (whole.text, whole.usage, 1,
                                                                False)
    assert b_seen == []


async def read_releasing(session, url: str, body: dict, *bs: Backend):
    """Stream `body` and read it whole, setting each backend's `release` once the client has
    read a [DONE] (a stand-in failing "after_done" dies then); what the client read."""
    async with session.post(url, json=body) as resp:
        got, broken = b"", False
        try:
            async for chunk in resp.content.iter_any():
                got += chunk
                if b"data: [DONE]" in got:
                    for backend in bs:
                        backend.release.set()
        except aiohttp.ClientPayloadError:
            broken = True
        return parse_sse(got, resp.status, broken)


@pytest.mark.parametrize("dies", ["first", "continuation"])
def test_a_replica_lost_after_its_done_leaves_the_client_one_done(dies):
    """The replica's [DONE] reached the client, then it died before the chunked body's end
    (killed between the two writes): the answer is whole, so the client reads one clean stream
    ending in that [DONE] — no second [DONE] from the router, no cut, no migration."""
    path, body = PATHS["completions"]
    first = Failure(how="after_done") if dies == "first" else Failure(after=9)
    a, b = Backend("a", standin(first)), Backend("b", standin(Failure(how="after_done")))

    async def main():
        async with backends(a, b), \
                serve(make_config([f"a={a.url}", f"b={b.url}"], policy="round_robin",
                                  migration_limit=1)) as served, client() as session:
            read = await read_releasing(session, served.url + path, body, a, b)
            await served.wait_idle()
            return read, await scrape(session, served.url)

    read, metrics = run(main())
    whole = run(uncut(path, body))
    assert (read.status, read.broken, read.errors) == (200, False, [])
    assert read.dones == 1
    assert (read.text, read.usage, read.finish) == (whole.text, whole.usage, ["length"])
    assert len(b.seen) == (0 if dies == "first" else 1)  # nothing after the [DONE]
    assert total(metrics, "omni_dp_router_migrations_total") == (0 if dies == "first" else 1)
    assert total(metrics, "omni_dp_router_streams_cut_total") == 0


def test_a_done_the_client_has_completes_the_answer_even_without_a_finish():
    """An engine that ends its stream with [DONE] but no finish_reason, then dies before the
    body's end: the answer is over for the client, so nothing may be migrated after it."""
    body = json.dumps(COMPLETION).encode()
    plan = plan_migration("POST", "/v1/completions", body, 1, MIGRATION_PATHS, None)
    stream = plan.strategy(200, {"Content-Type": "text/event-stream"})
    chunk = {"id": "x", "object": "text_completion", "created": 1, "model": MODEL,
             "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None,
                          "stop_reason": None, "prompt_token_ids": [1, 2], "token_ids": [5]}]}
    stream.take(b"data: " + json.dumps(chunk).encode() + b"\n\n" + b"data: [DONE]\n\n")
    stream.sent()
    assert stream.resumable and stream.complete
    assert stream.ending() == b""  # and the router adds no [DONE] of its own


def test_ids_are_nulled_in_the_chunks_own_bytes_and_nowhere_else():
    """The ids the client did not ask for are nulled where the engine wrote them, never in
    its text (where a quote is escaped), whatever pieces the chunk arrives in."""
    body = json.dumps(COMPLETION).encode()
    plan = plan_migration("POST", "/v1/completions", body, 1, MIGRATION_PATHS, None)
    stream = plan.strategy(200, {"Content-Type": "text/event-stream"})
    text = 'say "token_ids":[1,2] and "prompt_token_ids":[3]'
    chunk = {"id": "x", "object": "text_completion", "created": 1, "model": MODEL,
             "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None,
                          "stop_reason": None, "prompt_token_ids": [1, 2],
                          "token_ids": [5, 6]}]}
    raw = b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
    out = b"".join(stream.take(raw[i:i + 7]) for i in range(0, len(raw), 7))
    stream.sent()
    choice = json.loads(out[len(b"data: "):])["choices"][0]
    assert choice["text"] == text
    assert (choice["prompt_token_ids"], choice["token_ids"]) == (None, None)
    assert (stream.prompt_ids, stream.generated) == ([1, 2], [5, 6])


def test_what_the_router_cannot_read_chunk_by_chunk_passes_as_it_comes():
    """A compressed answer, or one whose events never end ("\\r\\n" separators, not an
    engine's): relayed untouched, and never migrated."""
    body = json.dumps(COMPLETION).encode()
    plan = plan_migration("POST", "/v1/completions", body, 1, MIGRATION_PATHS, None)
    gzipped = plan.strategy(200, {"Content-Type": "text/event-stream",
                                  "Content-Encoding": "gzip"})
    assert not gzipped.resumable and gzipped.take(b"\x1f\x8b\x08") == b"\x1f\x8b\x08"
    stream = plan.strategy(200, {"Content-Type": "text/event-stream"})
    crlf = b'data: {"x": 1}\r\n\r\n' * 70_000  # over a MiB with no "\n\n" in it
    assert stream.take(crlf[:1000]) == b""  # held: an event's end may still come
    assert stream.take(crlf[1000:]) == crlf
    assert stream.take(b"more") == b"more"
    stream.sent()
    assert (stream.resumable, stream.why_not, stream.at_end()) == (False, "unreadable_chunk",
                                                                   None)


def test_a_stream_sent_whole_with_its_length_is_read_chunk_by_chunk_too():
    """An engine that sends a streamed answer as one body of known length: the router still
    removes the ids the client did not ask for (so the length changes: it goes out chunked)."""
    path, body = PATHS["completions"]
    read, _, _ = run(through([standin(whole=True)], path, body))
    assert (read.status, read.broken, read.dones, read.errors) == (200, False, 1, [])
    assert read.usage["completion_tokens"] == 40
    assert all(ch["token_ids"] is None and ch["prompt_token_ids"] is None
               for c in read.chunks for ch in c["choices"])
