"""Router policies, config validation and replica records, without sockets; then the policies
behind a real router with real backends."""

from __future__ import annotations

import asyncio
import collections

import pytest

from omni_dp.router import app as router_app
from omni_dp.router.config import RouterConfigError, plan_router
from omni_dp.router.policies import POLICIES, RequestContext, make_policy
from omni_dp.router.policies.least_request import LeastRequestPolicy
from omni_dp.router.policies.power_of_two import PowerOfTwoPolicy
from omni_dp.router.policies.round_robin import RoundRobinPolicy
from omni_dp.router.policies.uniform_random import RandomPolicy
from omni_dp.router.replicas import Backends, Health, Replica, ReplicaError

from support.http_client import client, fetch
from support.router import (
    Backend,
    backends,
    hold_if_asked,
    make_config,
    replica_of,
    run,
    serve,
)
from support.wait import until

CTX = RequestContext(path="/v1/audio/speech", request_id="r")


def fleet(*loads: int) -> list[Replica]:
    replicas = [Replica(str(i), f"http://127.0.0.1:{9000 + i}") for i in range(len(loads))]
    for replica, load in zip(replicas, loads, strict=True):
        replica.health = Health.HEALTHY
        replica.in_flight = load
    return replicas


# --- the policy classes ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_returns_none_without_candidates(name):
    policy = make_policy(name, seed=0)
    assert policy.name == name
    assert policy.select([], CTX) is None


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_picks_the_only_candidate(name):
    policy = make_policy(name, seed=0)
    (only,) = fleet(7)
    assert all(policy.select([only], CTX) is only for _ in range(5))


def test_make_policy_rejects_an_unknown_name():
    with pytest.raises(ValueError, match="fastest"):
        make_policy("fastest")


def test_round_robin_cycles_exactly():
    replicas = fleet(0, 5, 1)  # load is ignored
    policy = RoundRobinPolicy()
    picks = [policy.select(replicas, CTX).id for _ in range(9)]
    assert picks == ["0", "1", "2"] * 3


def test_least_request_picks_the_minimum_and_rotates_ties():
    policy = LeastRequestPolicy()
    replicas = fleet(3, 1, 2, 1)
    picks = [policy.select(replicas, CTX).id for _ in range(6)]
    assert set(picks) == {"1", "3"}  # only the two least loaded, ...
    assert picks[0] != picks[1]  # ... alternating
    assert collections.Counter(picks) == {"1": 3, "3": 3}

    fresh = LeastRequestPolicy()
    idle = fleet(0, 0, 0, 0)
    assert sorted(fresh.select(idle, CTX).id for _ in range(4)) == ["0", "1", "2", "3"]


def test_least_request_follows_load_as_it_changes():
    policy = LeastRequestPolicy()
    replicas = fleet(0, 0, 0)
    for _ in range(30):  # each pick adds one request: the loads never drift apart
        pick = policy.select(replicas, CTX)
        assert pick.in_flight == min(r.in_flight for r in replicas)
        pick.in_flight += 1
        loads = [r.in_flight for r in replicas]
        assert max(loads) - min(loads) <= 1


def test_power_of_two_never_picks_the_most_loaded_of_three():
    policy = PowerOfTwoPolicy(seed=3)
    replicas = fleet(0, 4, 9)
    picks = collections.Counter(policy.select(replicas, CTX).id for _ in range(300))
    assert picks["2"] == 0  # it loses to either other one
    assert picks["0"] > picks["1"] > 0  # 0 wins whenever drawn (2/3), 1 only against 2 (1/3)
    assert 150 <= picks["0"] <= 250


def test_power_of_two_with_two_candidates_always_picks_the_less_loaded():
    policy = PowerOfTwoPolicy(seed=11)
    for loads in ((5, 1), (1, 5), (0, 2)):
        replicas = fleet(*loads)
        expected = min(replicas, key=lambda r: r.in_flight)
        assert all(policy.select(replicas, CTX) is expected for _ in range(40))


def test_random_covers_all_and_repeats_with_its_seed():
    replicas = fleet(0, 0, 0)
    policy_a, policy_b = RandomPolicy(seed=42), RandomPolicy(seed=42)
    seq_a = [policy_a.select(replicas, CTX).id for _ in range(300)]
    seq_b = [policy_b.select(replicas, CTX).id for _ in range(300)]
    assert seq_a == seq_b
    counts = collections.Counter(seq_a)
    assert set(counts) == {"0", "1", "2"}
    assert all(60 <= n <= 140 for n in counts.values()), counts


# --- replica records and config validation ------------------------------------------------------


def test_dispatched_counts_exactly_once_even_on_errors():
    (replica,) = fleet(0)
    with replica.dispatched():
        assert replica.in_flight == 1
    with pytest.raises(RuntimeError), replica.dispatched():
        raise RuntimeError("boom")
    assert replica.in_flight == 0
    assert replica.num_requests == 2


def test_new_replicas_are_unknown_and_not_routable():
    replica = Replica("a", "http://127.0.0.1:1")
    assert replica.health == Health.UNKNOWN
    assert not replica.routable
    replica.health = Health.HEALTHY
    assert replica.routable
    replica.disabled = True
    assert not replica.routable


def test_replica_set_rejects_duplicates_and_removes():
    replicas = Backends([Replica("0", "http://127.0.0.1:1")])
    with pytest.raises(ReplicaError, match="already"):
        replicas.add(Replica("0", "http://127.0.0.1:2"))
    with pytest.raises(ReplicaError, match="already"):
        replicas.add(Replica("x", "http://127.0.0.1:1"))
    replicas.add(Replica("1", "http://127.0.0.1:2"))
    assert replicas.next_id() == "2"
    removed = replicas.remove("0")
    assert removed.removed and not removed.routable
    assert [r.id for r in replicas] == ["1"]
    assert replicas.next_id() == "0"
    with pytest.raises(KeyError):
        replicas.remove("0")


def test_plan_router_accepts_ids_and_strips_trailing_slash():
    config = plan_router(["http://127.0.0.1:8101/", "b=http://localhost:8102"], port=0)
    assert config.replicas == (("0", "http://127.0.0.1:8101"), ("b", "http://localhost:8102"))
    assert config.inflight_bound(2) == 2 * config.max_inflight_per_replica
    assert plan_router([], max_inflight=7).inflight_bound(5) == 7


@pytest.mark.parametrize(("args", "options", "message"), [
    (["ftp://127.0.0.1:1"], {}, "must look like http://HOST:PORT"),
    (["http://127.0.0.1:1/v1"], {}, "must not have a path"),
    (["http://u:p@127.0.0.1:1"], {}, "must not carry credentials"),
    (["http://127.0.0.1:99999"], {}, "invalid port"),
    (["bad id=http://127.0.0.1:1"], {}, "replica id"),
    (["a=http://127.0.0.1:1", "a=http://127.0.0.1:2"], {}, "repeated: a"),
    (["http://127.0.0.1:1", "http://127.0.0.1:1"], {}, "repeated: http://127.0.0.1:1"),
    ([], {"policy": "fastest"}, "--policy 'fastest' is unknown"),
    ([], {"workers": 2, "port": 0}, "fixed --port"),
    ([], {"workers": 0}, "--workers"),
    ([], {"max_inflight": 0}, "--max-inflight must"),
    ([], {"max_inflight_per_replica": 0}, "--max-inflight-per-replica"),
    ([], {"api_key": "  "}, "--api-key"),
    ([], {"retries": -1}, "--retries must be 0 or more"),
    ([], {"resumes": -1}, "--resumes must be 0 or more"),
    ([], {"replica_wait_s": -1.0}, "--replica-wait must be 0 (no wait) or more"),
    ([], {"replica_wait_s": float("inf")}, "--replica-wait must be a finite number"),
    ([], {"first_byte_timeout_s": -1.0}, "--first-byte-timeout and --stall-timeout must be 0"),
    ([], {"stall_timeout_s": -0.5}, "--first-byte-timeout and --stall-timeout must be 0"),
    ([], {"stall_timeout_s": float("nan")}, "--stall-timeout must be a finite number"),
    ([], {"first_byte_timeout_s": float("inf")}, "--first-byte-timeout must be a finite"),
    ([], {"request_timeout_s": 0.0}, "--connect-timeout and --request-timeout must be positive"),
])
def test_plan_router_reports_problems(args, options, message):
    with pytest.raises(RouterConfigError) as info:
        plan_router(args, **options)
    assert any(message in problem for problem in info.value.problems), info.value.problems


def test_plan_router_reports_every_problem_at_once():
    with pytest.raises(RouterConfigError) as info:
        plan_router(["ftp://x"], policy="nope", workers=0)
    assert len(info.value.problems) == 3


def test_non_loopback_host_is_fine_its_admin_routes_stay_loopback_only_unless_allowed():
    # `launch --host 0.0.0.0` (a pod behind a Service) must start its router; the admin
    # routes' guard refuses remote clients per request (test_router_admin).
    assert plan_router([], host="0.0.0.0").admin_allow_remote is False
    assert plan_router([], host="0.0.0.0", admin_allow_remote=True).host == "0.0.0.0"
    assert plan_router([], host="::1").host == "::1"


def test_loopback_check_of_client_addresses():
    assert router_app.is_loopback_address("127.0.0.1")
    assert router_app.is_loopback_address("127.8.9.10")
    assert router_app.is_loopback_address("::1")
    for remote in ("10.0.0.1", "192.168.1.2", "::ffff:10.0.0.1", "fe80::1", "localhost", "", None):
        assert not router_app.is_loopback_address(remote), remote


# --- policies behind a real router --------------------------------------------------------------


def test_round_robin_is_exact_over_three_replicas():
    async def main():
        async with backends("a", "b", "c") as bs, \
                serve(make_config([f"{b.name}={b.url}" for b in bs],
                                  policy="round_robin")) as served, client() as session:
            picks = [await replica_of(session, served.url + "/v1/models") for _ in range(12)]
        assert picks == ["a", "b", "c"] * 4
        assert [len(b.seen) for b in bs] == [4, 4, 4]

    run(main())


def test_random_policy_reaches_every_replica():
    async def main():
        async with backends("a", "b", "c") as bs, \
                serve(make_config([f"{b.name}={b.url}" for b in bs],
                                  policy="random", seed=5)) as served, client() as session:
            picks = [await replica_of(session, served.url + "/v1/models") for _ in range(30)]
        assert set(picks) == {"a", "b", "c"}
        assert len(set(picks[:10])) > 1  # not one replica after another in blocks

    run(main())


def test_least_request_rotates_ties_on_a_fresh_router():
    async def main():
        async with backends("a", "b", "c", "d") as bs, \
                serve(make_config([f"{b.name}={b.url}" for b in bs])) as served, \
                client() as session:
            picks = []
            for _ in range(4):
                picks.append(await replica_of(session, served.url + "/v1/models"))
                await served.wait_idle()  # nothing in flight: every replica ties
        assert sorted(picks) == ["a", "b", "c", "d"]

    run(main())


@pytest.mark.parametrize("policy", ["least_request", "round_robin"])
def test_least_request_balances_uneven_requests(policy):
    """Slow and fast requests interleaved: least_request spreads the slow ones evenly, where
    round robin (the control) piles them on the same replicas."""

    async def main():
        bs = [Backend(name, hold_if_asked) for name in ("a", "b", "c")]
        async with backends(*bs), \
                serve(make_config([f"{b.name}={b.url}" for b in bs], policy=policy)) as served, \
                client() as session:
            held, violations = [], 0
            # slow, fast, fast, slow, fast, fast, ...: round robin sends every slow one to a
            for i in range(9):
                slow = i % 3 == 0
                loads = served.in_flight()
                if slow:
                    arrived = sum(len(b.seen) for b in bs)
                    task = asyncio.create_task(
                        fetch(session, "GET", served.url + "/generate?hold=1"))
                    held.append(task)
                    await until(lambda n=arrived: sum(len(b.seen) for b in bs) == n + 1)
                    after = served.in_flight()
                    (pick,) = [rid for rid in after if after[rid] == loads[rid] + 1]
                else:
                    pick = await replica_of(session, served.url + "/generate")
                    slow_count = len(held)
                    await until(lambda n=slow_count: sum(served.in_flight().values()) == n)
                if loads[pick] != min(loads.values()):
                    violations += 1
            final = served.in_flight()
            for b in bs:
                b.release.set()
            results = await asyncio.gather(*held)
            assert [status for status, _, _ in results] == [200] * len(held)
            await served.wait_idle()
            return violations, final

    violations, final = run(main())
    spread = max(final.values()) - min(final.values())
    if policy == "least_request":
        assert violations == 0
        assert spread <= 1, final
    else:  # the control: without load awareness the slow requests pile up
        assert spread >= 2, final


def test_least_request_keeps_concurrent_batch_balanced():
    """A batch of concurrent held requests lands evenly (max - min <= 1 at every admission)."""

    async def main():
        bs = [Backend(name, hold_if_asked) for name in ("a", "b", "c")]
        async with backends(*bs), \
                serve(make_config([f"{b.name}={b.url}" for b in bs])) as served, \
                client() as session:
            tasks = []
            for i in range(10):
                tasks.append(asyncio.create_task(
                    fetch(session, "POST", served.url + "/v1/audio/speech?hold=1")))
                await until(lambda n=i + 1: sum(len(b.seen) for b in bs) == n)
                loads = served.in_flight().values()
                assert max(loads) - min(loads) <= 1
            assert sorted(served.in_flight().values()) == [3, 3, 4]
            for b in bs:
                b.release.set()
            assert [s for s, _, _ in await asyncio.gather(*tasks)] == [200] * 10
            await served.wait_idle()

    run(main())


def test_power_of_two_sends_new_requests_to_the_less_loaded_replica():
    async def main():
        bs = [Backend(name, hold_if_asked) for name in ("a", "b")]
        async with backends(*bs), \
                serve(make_config([f"{b.name}={b.url}" for b in bs],
                                  policy="power_of_two", seed=9)) as served, \
                client() as session:
            busy_task = asyncio.create_task(fetch(session, "GET", served.url + "/x?hold=1"))
            await until(lambda: sum(len(b.seen) for b in bs) == 1)
            busy = next(rid for rid, n in served.in_flight().items() if n == 1)
            picks = [await replica_of(session, served.url + "/x") for _ in range(12)]
            for b in bs:
                b.release.set()
            assert (await busy_task)[0] == 200
            await served.wait_idle()
            return busy, picks

    busy, picks = run(main())
    assert busy not in picks
    assert len(picks) == 12
