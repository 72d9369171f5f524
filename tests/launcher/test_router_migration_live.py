"""LLM streams that survive kill -9 of their REAL vLLM replica (`launch --migration-limit 1`):
two replicas of vLLM's CPU build serving the tiny Llama, one launch shared by every check.

Four streams run on replica 0 at once — through the run's router (migration on) a greedy
completion, a greedy chat and a sampled completion, and through a second router of today's
behaviour (`--migration-limit 0`) the same greedy completion — and replica 0's API server is
killed with SIGKILL once each has read a few dozen chunks. Through the first router every
stream reads on to its end: the greedy ones exactly the text and usage of the same request
uncut, the sampled one exactly max_tokens tokens, each with one [DONE]. Through the second the
same kill ends the stream cut, with an error event and no [DONE]."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import aiohttp
import pytest

from support.http_client import client
from support.launcher import SUPERVISION, Run, describe
from support.openai_stream import Read, post_stream
from support.router import sample, scrape
from support.router_process import RouterProcess
from support.vllm import installed_vllm, vllm_args

LAUNCH_TIMEOUT_S = 600.0
MAX_TOKENS = 200  # four at once fit a 2048-token pin: no preemption, no recomputation
CUT_AFTER = 25  # data lines each stream has read when replica 0 is killed


def bodies(model: str) -> dict[str, tuple[str, dict]]:
    """The streams, by name: (path, body). ignore_eos: the random model may end early."""
    common = {"model": model, "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True,
              "stream_options": {"include_usage": True}}
    completion = {**common, "prompt": "Hello world, this is a test of migration",
                  "temperature": 0}
    return {
        "completion": ("/v1/completions", completion),
        "chat": ("/v1/chat/completions", {
            **common, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me a story about omni"}]}),
        "sampled": ("/v1/completions", {**completion, "temperature": 1.0, "seed": 11,
                                        "return_token_ids": True}),
    }


async def admin(session: aiohttp.ClientSession, url: str, replica: str, disabled: bool):
    async with session.put(f"{url}/workers/{replica}", json={"disabled": disabled}) as resp:
        assert resp.status == 200, await resp.text()


async def cut_streams(run: Run, plain: RouterProcess, model: str, victim: int):
    """The uncut references, then the four streams on replica 0 and its kill -9."""
    streams = bodies(model)
    async with client(timeout=aiohttp.ClientTimeout(total=120)) as session:
        uncut = {name: (await post_stream(session, run.router_url + path, body))[0]
                 for name, (path, body) in streams.items() if name != "sampled"}
        await admin(session, run.router_url, "1", disabled=True)  # all four on replica 0
        read: dict[str, int] = {}
        everyone_read = asyncio.Event()

        def progress(name: str):
            def seen(count: int) -> None:
                read[name] = count
                if len(read) == 4 and min(read.values()) >= CUT_AFTER:
                    everyone_read.set()
            return seen

        tasks = {name: asyncio.create_task(post_stream(
            session, run.router_url + path, body, on_chunk=progress(name), request_id=name))
            for name, (path, body) in streams.items()}
        path, body = streams["completion"]
        tasks["plain"] = asyncio.create_task(post_stream(
            session, plain.url + path, body, on_chunk=progress("plain"), request_id="plain"))
        await asyncio.wait_for(everyone_read.wait(), 60)
        await admin(session, run.router_url, "1", disabled=False)  # somewhere to go on
        os.kill(victim, signal.SIGKILL)
        cut = {name: await task for name, task in tasks.items()}
        return uncut, cut, read, await scrape(session, run.router_url), \
            await scrape(session, plain.url)


def assert_whole(got: Read, uncut: Read, what: str) -> None:
    assert (got.status, got.broken, got.errors, got.dones) == (200, False, [], 1), what
    assert got.text == uncut.text, what
    assert got.usage == uncut.usage and got.usage["completion_tokens"] == MAX_TOKENS, what
    assert got.finish == ["length"], what


@pytest.mark.slow
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 300)
def test_vllm_streams_survive_kill_9_of_their_replica(tmp_path):
    python, model = installed_vllm()
    with Run(tmp_path, replicas=2) as run:
        run.launch(*vllm_args(python, model, *SUPERVISION, "--start-timeout", "400",
                              "--max-total-tokens", "2048", "--migration-limit", "1",
                              "--restart-budget", "0"), timeout=LAUNCH_TIMEOUT_S)
        replicas = run.run_json()["replicas"]
        victim = replicas[0]["pid"]

        async def main():
            plain = RouterProcess(tmp_path / "plain-router.log", "--replica",
                                  f"0={replicas[0]['url']}", "--migration-limit", "0")
            try:
                await plain.start()
                await plain.wait_listening()
                return await cut_streams(run, plain, model, victim)
            finally:
                await plain.killed()

        uncut, cut, read, metrics, plain_metrics = asyncio.run(main())
        for name, (_, headers) in cut.items():
            assert headers["X-Omni-DP-Replica"] == "0", (name, headers)  # the victim's
        # migration on: every stream read on to its end, as if uncut
        assert_whole(cut["completion"][0], uncut["completion"], "completion")
        assert_whole(cut["chat"][0], uncut["chat"], "chat")
        sampled = cut["sampled"][0]
        assert (sampled.broken, sampled.errors, sampled.dones) == (False, [], 1)
        assert len(sampled.token_ids) == MAX_TOKENS == sampled.usage["completion_tokens"]
        migrated = sum(v for (name, _), v in metrics.items()
                       if name == "omni_dp_router_migrations_total")
        assert migrated == 3, (read, {k: v for k, v in metrics.items() if "migrat" in k[0]
                                      or "cut" in k[0]})
        # migration off: the same kill ends the same stream cut, never as a short success
        plain = cut["plain"][0]
        assert plain.broken and plain.dones == 0, json.dumps(plain.chunks[-2:])
        assert [e["error"]["type"] for e in plain.errors] == ["upstream_failed"]
        assert uncut["completion"].text.startswith(plain.text)
        assert len(plain.text) < len(uncut["completion"].text)
        assert sample(plain_metrics, "omni_dp_router_streams_cut_total",
                      why="not_resumable") == 1
        down = run.down(timeout=180)
        assert down.returncode == 0, describe(down)
        assert run.leftover_pids() == []
