"""Router settings in, a validated config (or every problem at once) out. No side effects."""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from dataclasses import dataclass, field

from omni_dp.router.policies import POLICIES
from omni_dp.router.replicas import ReplicaError, validate_id, validate_url


class RouterConfigError(ValueError):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class HealthConfig:
    interval_s: float = 5.0
    timeout_s: float = 2.0
    failure_threshold: int = 3  # consecutive failures (active or passive) that eject
    success_threshold: int = 2  # consecutive successful checks that re-admit
    jitter: float = 0.2  # each interval is scaled by a random factor in [1 - jitter, 1 + jitter]
    path: str = "/health"


@dataclass(frozen=True)
class RouterConfig:
    replicas: tuple[tuple[str, str], ...] = ()  # (id, url)
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "least_request"
    workers: int = 1
    api_key: str | None = None
    admin_allow_remote: bool = False
    max_inflight: int | None = None  # None: max_inflight_per_replica × replicas
    max_inflight_per_replica: int = 256
    max_body_bytes: int = 64 * 1024**2
    # Bodies are read before a request is admitted, so a slow sender holds a reader slot (its
    # own bound) for at most body_timeout_s, never one of the in-flight slots.
    max_body_readers: int | None = None  # None: 4 × the in-flight bound
    body_timeout_s: float = 30.0
    header_timeout_s: float = 30.0  # request headers, and idle keep-alive connections
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 1800.0
    retry_connect_failures: bool = True
    health: HealthConfig = field(default_factory=HealthConfig)
    seed: int | None = None  # for the random policies; tests fix it

    def inflight_bound(self, num_replicas: int) -> int:
        if self.max_inflight is not None:
            return self.max_inflight
        return self.max_inflight_per_replica * max(num_replicas, 1)

    def body_reader_bound(self, num_replicas: int) -> int:
        if self.max_body_readers is not None:
            return self.max_body_readers
        return 4 * self.inflight_bound(num_replicas)


def parse_replica_arg(text: str, index: int) -> tuple[str, str]:
    """`URL` or `ID=URL`; the id defaults to the replica's position."""
    replica_id, sep, url = text.partition("=")
    if not sep or "://" in replica_id:
        replica_id, url = str(index), text
    return validate_id(replica_id), validate_url(url)


def plan_router(
    replica_args: list[str], *, health: HealthConfig | None = None, **options
) -> RouterConfig:
    problems: list[str] = []
    replicas: list[tuple[str, str]] = []
    for index, text in enumerate(replica_args):
        try:
            replicas.append(parse_replica_arg(text, index))
        except ReplicaError as exc:
            problems.append(str(exc))
    ids = [r[0] for r in replicas]
    urls = [r[1] for r in replicas]
    for name, values in (("id", ids), ("URL", urls)):
        dupes = sorted({v for v in values if values.count(v) > 1})
        if dupes:
            problems.append(f"replica {name}s must be unique; repeated: {', '.join(dupes)}")

    config = RouterConfig(replicas=tuple(replicas), health=health or HealthConfig(), **options)
    if config.policy not in POLICIES:
        problems.append(f"--policy {config.policy!r} is unknown; choose {', '.join(POLICIES)}")
    if not 0 <= config.port <= 65535:
        problems.append(f"--port must be 0-65535, got {config.port}")
    if config.workers < 1:
        problems.append(f"--workers must be at least 1, got {config.workers}")
    if config.workers > 1 and config.port == 0:
        problems.append("--workers > 1 needs a fixed --port: every worker binds the same one")
    if config.max_inflight is not None and config.max_inflight < 1:
        problems.append("--max-inflight must be at least 1")
    if config.max_inflight_per_replica < 1:
        problems.append("--max-inflight-per-replica must be at least 1")
    if config.max_body_readers is not None and config.max_body_readers < 1:
        problems.append("--max-body-readers must be at least 1")
    if not (config.body_timeout_s > 0 and config.header_timeout_s > 0):
        problems.append("--body-timeout and --header-timeout must be positive")
    if config.api_key is not None and not config.api_key.strip():
        problems.append("--api-key must not be empty")
    h = config.health
    problems += _non_finite_problems(config)
    if h.interval_s <= 0 or h.timeout_s <= 0:
        problems.append("--health-interval and --health-timeout must be positive")
    if h.failure_threshold < 1 or h.success_threshold < 1:
        problems.append("--health-failures and --health-successes must be at least 1")
    if not 0 <= h.jitter < 1:
        problems.append("--health-jitter must be in [0, 1)")
    if not config.admin_allow_remote and not _is_loopback_host(config.host):
        problems.append(
            f"--host {config.host} is not loopback, so the admin routes (/workers) would be "
            "refused to everyone but local clients: pass --admin-allow-remote to accept that, "
            "or listen on 127.0.0.1"
        )
    if problems:
        raise RouterConfigError(problems)
    return config


def _non_finite_problems(config: RouterConfig) -> list[str]:
    """nan passes every range check (it compares false with everything) and inf the lower
    ones, then both break the timers they set: every float setting must be finite."""
    numbers = [(f"--{name.removesuffix('_s').replace('_', '-')}", getattr(config, name))
               for name in (f.name for f in dataclasses.fields(config))]
    numbers += [("--health-" + name.removesuffix("_s").replace("_", "-"),
                 getattr(config.health, name))
                for name in (f.name for f in dataclasses.fields(config.health))]
    return [f"{flag} must be a finite number, got {value}" for flag, value in numbers
            if isinstance(value, float) and not math.isfinite(value)]


def is_loopback_address(address: str | None) -> bool:
    """An IP address in 127.0.0.0/8 or ::1 (a name is not an address)."""
    try:
        return address is not None and ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _is_loopback_host(host: str) -> bool:
    return host == "localhost" or is_loopback_address(host)
