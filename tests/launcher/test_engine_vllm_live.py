"""A REAL vLLM engine as omni-dp replicas: vLLM's CPU build (scripts/setup-vllm) serving a
tiny Llama built locally (scripts/make-tiny-llama), two replicas on this machine's two cores.

scripts/test installs both and exports OMNI_DP_VLLM_PYTHON and OMNI_DP_TINY_LLAMA; under CI
(OMNI_DP_REQUIRE_VLLM=1) a missing install fails these tests instead of skipping them. The
stages of one run follow each other in one test, because each vLLM start costs about a minute:
- bring-up with the pin read back from /metrics, completions through the router;
- the run registered with a REAL SGLang model gateway (`--register`, scripts/setup-gateway):
  completions routed by the gateway reach both replicas;
- LLM streams that survive kill -9 of their replica (`launch --migration-limit 1`): four
  streams run on replica 0 at once — through the run's router a greedy completion, a greedy
  chat and a sampled completion, and through a second router of the behaviour without
  migration (`--migration-limit 0`) the same greedy completion — and replica 0's API server
  is killed with SIGKILL once each has read a few dozen chunks. Through the run's router every
  stream reads on to its end: the greedy ones exactly the text and usage of the same request
  uncut, the sampled one exactly max_tokens tokens, each with one [DONE]. Through the second
  the same kill ends the stream cut, with an error event and no [DONE];
- the same kill orphans the API server's EngineCore and Worker: found, stopped, the replica
  restarted through the gates, taken out of the gateway and registered again (one entry each);
- `down` leaving no process, port, socket file or cache of the run, and the gateway listing
  none of its replicas.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request

import aiohttp
import psutil
import pytest

from omni_dp.gateway import SglangGateway

from support.http_client import client
from support.launcher import SUPERVISION, Run, alive, describe
from support.openai_stream import Read, post_stream
from support.ports import port_listening
from support.router import sample, scrape
from support.router_process import RouterProcess
from support.sglang_gateway import SglangGatewayProcess, smg_path
from support.vllm import installed_vllm, vllm_args
from support.wait import wait_for

LAUNCH_TIMEOUT_S = 600.0
RESTART_TIMEOUT_S = 420.0
PIN_TOKENS = 2048  # 64 blocks of 32: four streams of MAX_TOKENS fit, no preemption
MAX_TOKENS = 200
CUT_AFTER = 25  # data lines each stream has read when replica 0 is killed


@pytest.fixture(scope="module")
def vllm() -> tuple[str, str]:
    return installed_vllm()


def completion(url: str, model: str, prompt: str, timeout: float = 60.0) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 8,
                       "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=timeout) as response:
        assert response.status == 200
        return json.loads(response.read())


def served(url: str) -> float:
    """The completions a vLLM replica finished, from its /metrics."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics(url).splitlines()
               if line.startswith("vllm:request_success_total"))


def listed(gateway_url: str) -> dict[str, bool | None]:
    return {w.url: w.healthy for w in SglangGateway(gateway_url).workers()}


def metrics(url: str) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url + "/metrics", timeout=10) as response:
        return response.read().decode()


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


async def cut_streams(run: Run, plain: RouterProcess, model: str, victim: dict):
    """The uncut references, then the four streams on replica 0 and its kill -9; whether the
    API server's children were still alive once it was dead (looked at at once: the
    supervisor stops them at its next sweep)."""
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
        os.kill(victim["pid"], signal.SIGKILL)
        orphaned = await asyncio.to_thread(orphans_outlive, victim)
        cut = {name: await task for name, task in tasks.items()}
        return uncut, cut, read, orphaned, await scrape(session, run.router_url), \
            await scrape(session, plain.url)


def orphans(victim: dict) -> list[dict]:
    return [p for p in victim["processes"] if p["pid"] != victim["pid"]]


def orphans_outlive(victim: dict) -> bool:
    """The API server dead, and any of its children still alive."""
    wait_for("the API server to die", lambda: not alive(victim["pid"]), timeout=10,
             interval=0.05)
    return any(alive(p["pid"], p["create_time"]) for p in orphans(victim))


def assert_whole(got: Read, uncut: Read, what: str) -> None:
    assert (got.status, got.broken, got.errors, got.dones) == (200, False, [], 1), what
    assert got.text == uncut.text, what
    assert got.usage == uncut.usage and got.usage["completion_tokens"] == MAX_TOKENS, what
    assert got.finish == ["length"], what


def test_plans_that_vllm_would_get_wrong_exit_2_before_anything_starts(tmp_path, vllm):
    python, model = vllm
    with Run(tmp_path, replicas=2) as run:
        # launch_argv pins 1024 tokens unless told; drop the pin to see it refused
        argv = [a for a in run.launch_argv(*vllm_args(python, model)) if a != "--detach"]
        at = argv.index("--max-total-tokens")
        unpinned = run.cli(*(argv[:at] + argv[at + 2:]))
        assert unpinned.returncode == 2, describe(unpinned)
        assert "--replicas 2 needs a pinned KV size" in unpinned.stderr
        rounded = run.cli(*run.launch_argv("--max-total-tokens", "1000",
                                           *vllm_args(python, model)))
        assert rounded.returncode == 2, describe(rounded)
        assert "vLLM allocates whole blocks of 32 tokens" in rounded.stderr
        assert "ask for 992 or 1024" in rounded.stderr
        assert not run.run_dir.exists()
        assert not run.state_root.exists() or not any(run.state_root.rglob("run.json"))


@pytest.mark.slow
# Its own waits are bounded (bring-up ≤ LAUNCH_TIMEOUT_S, restart ≤ RESTART_TIMEOUT_S, the
# streams ≤ 60 s + 120 s, down ≤ 180 s) and say what they waited for; pytest's default 300 s
# would cut a slow but bounded restart short with nothing but a stack.
@pytest.mark.timeout(LAUNCH_TIMEOUT_S + RESTART_TIMEOUT_S + 360)
def test_two_vllm_replicas_pinned_migrated_restarted_and_torn_down(tmp_path, vllm):
    python, model = vllm
    timings: dict[str, float] = {}
    with Run(tmp_path, replicas=2) as run, \
            SglangGatewayProcess(smg_path(), tmp_path / "gateway.log") as gateway:
        gateway.wait_ready()
        # --- bring-up: both healthy, the pin read back from each replica's /metrics -------
        started = time.monotonic()
        result = run.launch(*vllm_args(python, model, *SUPERVISION, "--start-timeout", "400",
                                       "--max-total-tokens", str(PIN_TOKENS),
                                       "--migration-limit", "1", "--register", gateway.url),
                            timeout=LAUNCH_TIMEOUT_S)
        timings["bring-up of two replicas (s)"] = time.monotonic() - started
        assert f"KV capacity equal: {PIN_TOKENS} tokens on every replica" in result.stdout
        assert "/v1/completions" in result.stdout  # the example request fits the engine
        record = run.run_json()
        for replica in record["replicas"]:
            assert replica["state"] == "healthy" and replica["kv_tokens"] == PIN_TOKENS
            names = [p["role"] for p in replica["processes"]]
            assert any("EngineCore" in n for n in names), names  # found by session
            assert all(p["create_time"] for p in replica["processes"])
            text = metrics(replica["url"])
            assert f'num_gpu_blocks="{PIN_TOKENS // 32}"' in text and 'block_size="32"' in text
            env = replica["env"]
            assert env["VLLM_CPU_OMP_THREADS_BIND"] == replica["cpus"]
            assert env["TMPDIR"].startswith(str(run.run_dir))

        # --- completions through the router, both replicas serving -------------------------
        for i in range(6):
            reply = completion(run.router_url, model, f"Hello number {i}")
            assert reply["choices"][0]["text"] is not None

        # --- the gateway lists both, healthy, and routes completions to both ---------------
        urls = [r["url"] for r in record["replicas"]]
        assert listed(gateway.url) == {url: True for url in urls}, gateway.log_text()[-3000:]
        before = [served(url) for url in urls]
        for i in range(4):  # the test gateway balances round robin
            completion(gateway.url, model, f"Through the gateway {i}")
        after = [served(url) for url in urls]
        assert all(b > a for a, b in zip(before, after, strict=True)), (before, after)

        # --- four streams on replica 0, its API server killed with SIGKILL midway ----------
        victim = record["replicas"][0]
        assert orphans(victim), victim["processes"]

        async def streams():
            plain = RouterProcess(tmp_path / "plain-router.log", "--replica",
                                  f"0={victim['url']}", "--migration-limit", "0")
            try:
                await plain.start()
                await plain.wait_listening()
                return await cut_streams(run, plain, model, victim)
            finally:
                await plain.killed()

        killed_at = time.monotonic()
        uncut, cut, read, orphaned, router_metrics, plain_metrics = asyncio.run(streams())
        assert orphaned, \
            "vLLM's children outlive a SIGKILLed API server (the reason for session teardown)"
        for name, (_, headers) in cut.items():
            assert headers["X-Omni-DP-Replica"] == "0", (name, headers)  # the victim's
        # migration on: every stream read on to its end, as if uncut
        assert_whole(cut["completion"][0], uncut["completion"], "completion")
        assert_whole(cut["chat"][0], uncut["chat"], "chat")
        sampled = cut["sampled"][0]
        assert (sampled.broken, sampled.errors, sampled.dones) == (False, [], 1)
        assert len(sampled.token_ids) == MAX_TOKENS == sampled.usage["completion_tokens"]
        migrated = sum(v for (name, _), v in router_metrics.items()
                       if name == "omni_dp_router_migrations_total")
        assert migrated == 3, (read, {k: v for k, v in router_metrics.items()
                                      if "migrat" in k[0] or "cut" in k[0]})
        # migration off: the same kill ends the same stream cut, never as a short success
        plain = cut["plain"][0]
        assert plain.broken and plain.dones == 0, json.dumps(plain.chunks[-2:])
        assert [e["error"]["type"] for e in plain.errors] == ["upstream_failed"]
        assert uncut["completion"].text.startswith(plain.text)
        assert len(plain.text) < len(uncut["completion"].text)
        assert sample(plain_metrics, "omni_dp_router_streams_cut_total",
                      why="not_resumable") == 1

        # --- the killed replica: orphans stopped, restarted through the gates --------------
        def back() -> bool:
            replica = run.run_json()["replicas"][0]
            return replica["state"] == "healthy" and replica["pid"] != victim["pid"]

        wait_for("replica 0 back through the gates", back, timeout=RESTART_TIMEOUT_S,
                 interval=1.0)
        timings["kill -9 to healthy again (s)"] = time.monotonic() - killed_at
        assert not any(alive(p["pid"], p["create_time"]) for p in orphans(victim)), \
            "the orphans of the killed API server were left running"
        [completed] = [e for e in run.events() if e["event"] == "restart_completed"]
        assert completed["replica"] == 0 and completed["in_router"] is True
        assert run.run_json()["replicas"][0]["kv_tokens"] == PIN_TOKENS
        completion(run.router_url, model, "Hello again")
        assert listed(gateway.url) == {url: True for url in urls}  # one entry each
        gone = [e["event"] for e in run.events() if e.get("replica") == 0
                and e["event"].startswith("gateway_")]
        assert gone[-2:] == ["gateway_deregistered", "gateway_registered"], gone
        completion(gateway.url, model, "Through the gateway again")

        # --- down: nothing of the run is left ---------------------------------------------
        pids_before = run.leftover_pids()
        assert pids_before
        down = run.down(timeout=180)
        assert down.returncode == 0, describe(down)
        assert run.leftover_pids() == []
        assert not [p for p in pids_before if psutil.pid_exists(p) and alive(p)]
        assert not any(port_listening(p) for p in run.ports)
        assert not run.run_dir.exists()  # TMPDIR (IPC sockets), VLLM_CACHE_ROOT inside it
        assert listed(gateway.url) == {}
    for what, seconds in timings.items():
        print(f"vllm live: {what}: {seconds:.1f}")
