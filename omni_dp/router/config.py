"""Router settings in, a validated config (or every problem at once) out. No side effects."""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from omni_dp.contract import API_KEY_ENV, PRIORITY_NAMES, Priority, Problems
from omni_dp.router.classes import PriorityRules, parse_route_priority
from omni_dp.router.migration import MIGRATION_PATHS
from omni_dp.router.policies import POLICIES
from omni_dp.router.replicas import ReplicaError, validate_id, validate_url
from omni_dp.tracing import endpoint_problem


class RouterConfigError(Problems):
    """Every problem of a router command line or config; nothing was started."""


# `router --help` lists the flags under these titles, in this order (each field names its own
# "section"; omni_dp/cli/common.py's SectionedCommand draws them), as vLLM's help groups its.
LISTEN = "Replicas, address, workers"
ACCESS = "Access"
LIMITS = "Limits and timeouts"
FAILURES = "Failures (retries, resumes, hangs)"
HEALTH = "Health checks and ejection"
MIGRATION = "LLM stream migration"
PRIORITY = "Priority classes"
OBSERVABILITY = "Observability (traces, logs)"
ROUTER_SECTIONS = (LISTEN, ACCESS, LIMITS, FAILURES, HEALTH, MIGRATION, PRIORITY, OBSERVABILITY)

# The flags of `omni-dp router` are generated from these fields (omni_dp/cli/common.py reads
# the metadata: help, flag, ...); each default is written here only.


@dataclass(frozen=True)
class HealthConfig:
    interval_s: float = field(default=5.0, metadata={
        "section": HEALTH, "flag": "--health-interval",
        "help": "Seconds between active /health checks of each replica."})
    timeout_s: float = field(default=2.0, metadata={
        "section": HEALTH,
        "flag": "--health-timeout", "help": "Seconds a /health check may take."})
    # consecutive failures (active or passive) that eject
    failure_threshold: int = field(default=3, metadata={
        "section": HEALTH, "flag": "--health-failures",
        "help": "Consecutive failures (checks, connection errors, 502/504) that eject."})
    # consecutive successful checks that re-admit
    success_threshold: int = field(default=2, metadata={
        "section": HEALTH, "flag": "--health-successes",
        "help": "Consecutive passing checks that re-admit an ejected replica."})
    # each interval is scaled by a random factor in [1 - jitter, 1 + jitter]
    jitter: float = field(default=0.2, metadata={
        "section": HEALTH, "flag": "--health-jitter",
        "help": "Each check interval is scaled by a random factor in [1-J, 1+J]."})
    # 50: with 2 replicas one may be ejected, never both; 1 of 3, 2 of 4 (health.ejection_bound)
    max_ejection_percent: int = field(default=50, metadata={
        "section": HEALTH, "flag": "--max-ejection-percent", "metavar": "PERCENT",
        "help": "At most this share of the replicas may be ejected at once for failures or a "
                "hang (rounded down, but at least one: 50 ejects 1 of 2 or 3, 2 of 4). A "
                "replica due for ejection beyond it stays routable (GET /workers: "
                "ejection_suppressed). A replica whose port refuses connections is ejected "
                "whatever the bound, and does not count. 100: no bound."})
    path: str = field(default="/health", metadata={"flag": None})


@dataclass(frozen=True)
class RouterConfig:
    replicas: tuple[tuple[str, str], ...] = field(default=(), metadata={  # (id, url)
        "section": LISTEN, "flag": "--replica", "multiple": True, "metavar": "[ID=]URL",
        "help": "A replica to route to, e.g. http://127.0.0.1:8101 or 0=http://…; repeat for "
                "each. The id defaults to the position. More can be added at runtime with POST "
                "/workers."})
    host: str = field(default="127.0.0.1", metadata={
        "section": LISTEN, "help": "Address to listen on."})
    port: int = field(default=8000, metadata={"section": LISTEN, "help": "TCP port to listen on."})
    policy: str = field(default="least_request", metadata={
        "section": LISTEN, "choices": tuple(POLICIES),
        "help": "How a replica is chosen among the routable ones with room."})
    workers: int = field(default=1, metadata={
        "section": LISTEN,
        "help": "Router processes sharing the port (SO_REUSEPORT), for when one core is the "
                "limit. Bounds are split between them."})
    api_key: str | None = field(default=None, metadata={
        "section": ACCESS, "envvar": API_KEY_ENV,
        "help": "Require `Authorization: Bearer KEY` (or X-API-Key) on every route but "
                f"/health, /ready, /live and /metrics. Also read from {API_KEY_ENV}."})
    admin_allow_remote: bool = field(default=False, metadata={
        "section": ACCESS,
        "help": "Let non-loopback clients use /workers (loopback only by default)."})
    # None: max_inflight_per_replica × replicas
    max_inflight: int | None = field(default=None, metadata={
        "section": LIMITS,
        "help": "Requests in flight through the router; more get 503 + Retry-After at once. "
                "[default: --max-inflight-per-replica × replicas]"})
    max_inflight_per_replica: int = field(default=256, metadata={
        "section": LIMITS,
        "help": "Requests in flight to one replica; also its upstream connection pool size."})
    max_body_bytes: int = field(default=64 * 1024**2, metadata={
        "section": LIMITS,
        "size": True, "help": "Largest accepted request body (413 beyond)."})
    # Bodies are read before a request is admitted, so a slow sender holds a reader slot (its
    # own bound) for at most body_timeout_s, never one of the in-flight slots.
    max_body_readers: int | None = field(default=None, metadata={  # None: 4 × in-flight bound
        "section": LIMITS,
        "help": "Requests whose body is still arriving; more get 503 + Retry-After. Bodies are "
                "read before a request takes an in-flight slot, so slow senders never hold "
                "those. [default: 4 × the --max-inflight bound]"})
    body_timeout_s: float = field(default=30.0, metadata={
        "section": LIMITS, "flag": "--body-timeout",
        "help": "Seconds a request body may take to arrive (408 beyond)."})
    # request headers, and idle keep-alive connections
    header_timeout_s: float = field(default=30.0, metadata={
        "section": LIMITS, "flag": "--header-timeout",
        "help": "Seconds a connection may take to send a complete request head, from when it "
                "opened or its previous response ended; idle keep-alive connections close "
                "after it too."})
    connect_timeout_s: float = field(default=5.0, metadata={
        "section": LIMITS,
        "flag": "--connect-timeout", "help": "Seconds to connect to a replica."})
    request_timeout_s: float = field(default=1800.0, metadata={
        "section": LIMITS,
        "flag": "--request-timeout", "help": "Seconds a whole proxied request may take."})
    # Generation has no side effects: a request none of whose answer reached the client can
    # go to another replica; never to one it was already sent to (unless restarted since).
    # 3, not 1: with 2 replicas both dying a few seconds apart (a double fault), a request's
    # first replica and its retry's both die, and the third try goes to the first one
    # restarted. Each try goes to a replica it has not tried, within --request-timeout.
    retries: int = field(default=3, metadata={
        "section": FAILURES,
        "help": "Times a request is sent again, each time to a replica it was not sent to "
                "yet (a replica restarted since counts as not tried), when its replica failed "
                "before any byte of the answer reached the client: connection refused or "
                "reset, closed before its status line, a 5xx from a replica going away "
                "(X-Omni-DP-Going-Away), found hung. 0: never."})
    resumes: int = field(default=3, metadata={
        "section": FAILURES,
        "help": "Times a stream cut after its first byte reached the client is continued by "
                "another replica from the byte the client has (built-in engine, wav and pcm, "
                "raw or SSE; a speech session's moves); other streams end cut. 0: never."})
    # 30 s: a replica's restart through the supervisor's gates took 3.7-11.8 s here (kill -9
    # to routable, its restart backoff included: bench/results/router_faults.md), a stopped
    # one is routable again a few seconds after it continues, and a model loading on a GPU
    # takes tens of seconds; 30 s is still well under what HTTP clients wait (60 s and more),
    # so a wait that runs out is still answered. Waiting costs no more than an in-flight slot.
    replica_wait_s: float = field(default=30.0, metadata={
        "section": FAILURES, "flag": "--replica-wait",
        "help": "Seconds a request waits for a replica to go to when it finds none (none "
                "routable, or those it has not tried yet all out or at their cap), instead of "
                "a 503 at once: a new request, a retry, a resume, a speech session's opening "
                "and its move. It waits in its in-flight slot and never past "
                "--request-timeout; then 503 + Retry-After (a stream begun ends cut). A new "
                "request finding every routable replica at its cap is still refused at once. "
                "0: no wait."})
    # A replica that passes its /health check is slow, not hung, and is waited on (hangs.py).
    first_byte_timeout_s: float = field(default=5.0, metadata={
        "section": FAILURES, "flag": "--first-byte-timeout",
        "help": "Seconds a replica may take to begin its answer (its status line) before it "
                "is checked: one that fails its /health check too is ejected at once as hung "
                "and the request sent to another replica; one that passes is waited on. "
                "0: no limit."})
    stall_timeout_s: float = field(default=5.0, metadata={
        "section": FAILURES, "flag": "--stall-timeout",
        "help": "Seconds a replica may send nothing in the middle of an answer before it is "
                "checked the same way; a hung replica's stream is resumed elsewhere where it "
                "can be, else cut. 0: no limit."})
    # Off by default, as in NVIDIA Dynamo: it costs a JSON parse of each such request and of
    # every chunk of its answer (migration.py, token_stream.py; bench/results/migration.md).
    migration_limit: int = field(default=0, metadata={
        "section": MIGRATION,
        "help": "Times a streamed completions or chat answer of an LLM engine (vLLM; sglang: "
                "completions) cut after its first byte goes on on another replica, token for "
                "token: the prompt's and the generated token ids as its prompt, max_tokens "
                "less what was generated, the same sampling; the client reads one stream. "
                "Not for n > 1, best_of, beam search, structured output, logprobs, stop "
                "strings, presence/frequency penalties, tools, non-text input, or no stated "
                "max_tokens. 0: off."})
    migration_max_seq_len: int | None = field(default=None, metadata={
        "section": MIGRATION, "metavar": "TOKENS",
        "help": "A stream whose prompt plus generated tokens exceed this is no longer "
                "tracked (its ids are let go) and cannot migrate.  [default: no limit]"})
    migration_paths: tuple[str, ...] = field(default=MIGRATION_PATHS, metadata={
        "section": MIGRATION, "flag": "--migration-path", "multiple": True, "metavar": "PATH",
        "help": "An endpoint whose streams migrate; repeat for each. sglang streams token "
                "ids on /v1/completions only (it refuses them on streamed chat): give "
                "that one alone in front of sglang.  [default: /v1/completions, "
                "/v1/chat/completions]"})
    # Priority classes (classes.py): interactive, default, bulk.
    default_priority: str = field(default="default", metadata={
        "section": PRIORITY, "choices": PRIORITY_NAMES,
        "help": "The class of a request that names none (X-Omni-DP-Priority or smg's "
                "x-smg-priority) and whose path has no --route-priority."})
    route_priorities: tuple[str, ...] = field(default=(), metadata={
        "section": PRIORITY, "flag": "--route-priority", "multiple": True,
        "metavar": "PATH=CLASS",
        "help": "The class of requests to PATH (exact) that name none, e.g. "
                "/v1/audio/speech=interactive; repeat for each."})
    # 0: every class takes any slot, as before classes existed.
    reserved_interactive: int = field(default=0, metadata={
        "section": PRIORITY,
        "help": "In-flight slots (of the --max-inflight bound) only interactive requests may "
                "take: a default or bulk request waits (or is refused) while no more than "
                "this many are free."})
    queue_timeout_interactive_s: float = field(default=30.0, metadata={
        "section": PRIORITY, "flag": "--queue-timeout-interactive",
        "help": "Seconds an interactive request may wait in its queue for an in-flight slot "
                "when the router is full; then 503 + Retry-After. 0: refused at once."})
    # 0: a full router refuses a default request at once (503 router_full), as it always did.
    queue_timeout_default_s: float = field(default=0.0, metadata={
        "section": PRIORITY, "flag": "--queue-timeout-default",
        "help": "The same for default requests. 0: refused at once (the router's answer "
                "when full before classes existed)."})
    queue_timeout_bulk_s: float = field(default=300.0, metadata={
        "section": PRIORITY,
        "flag": "--queue-timeout-bulk", "help": "The same for bulk requests."})
    max_queued: int | None = field(default=None, metadata={  # None: 4 × in-flight bound
        "section": PRIORITY,
        "help": "Requests waiting in the class queues, all classes together; more get 503 + "
                "Retry-After at once. [default: 4 × the --max-inflight bound]"})
    # vLLM honours `priority` only under --scheduling-policy priority and refuses any value
    # but 0 otherwise: `omni-dp launch` sets this when the engine args ask for it.
    priority_field: bool = field(default=False, metadata={
        "section": PRIORITY,
        "help": "Put the class into the JSON body of forwarded completions and chat requests "
                "as vLLM's `priority` field (-1 interactive, 0 default, 1 bulk), unless the "
                "client set one: for vLLM replicas run with --scheduling-policy priority."})
    priority_field_order: str = field(default="low-first", metadata={
        "section": PRIORITY, "choices": ("low-first", "high-first"),
        "help": "Which way the engine orders --priority-field's values: low-first (vLLM: "
                "-1 interactive, 0 default, 1 bulk) or high-first (sglang run with "
                "--enable-priority-scheduling: 1, 0, -1)."})
    # OpenTelemetry (omni_dp/tracing.py): vLLM's flag name, so one URL means the same to both.
    otlp_traces_endpoint: str | None = field(default=None, metadata={
        "section": OBSERVABILITY, "metavar": "URL",
        "help": "Export a span per request and per attempt to this OTLP/HTTP traces receiver "
                "(e.g. http://127.0.0.1:4318/v1/traces), and send each replica the attempt's "
                "W3C traceparent (a client's traceparent is the request's parent). "
                "[default: no tracing]"})
    health: HealthConfig = field(default_factory=HealthConfig, metadata={"flag": None})
    # for the random policies; tests fix it
    seed: int | None = field(default=None, metadata={"flag": None})

    def inflight_bound(self, num_replicas: int) -> int:
        if self.max_inflight is not None:
            return self.max_inflight
        return self.max_inflight_per_replica * max(num_replicas, 1)

    def queue_bound(self, num_replicas: int) -> int:
        if self.max_queued is not None:
            return self.max_queued
        return 4 * self.inflight_bound(num_replicas)

    def queue_timeout(self, priority: Priority) -> float:
        """Seconds a request of this class may wait for an in-flight slot (0: none)."""
        return (self.queue_timeout_interactive_s, self.queue_timeout_default_s,
                self.queue_timeout_bulk_s)[priority]

    def priority_rules(self) -> PriorityRules:
        """The classes of requests that name none (validated by plan_router)."""
        return PriorityRules(
            Priority[self.default_priority.upper()],
            dict(parse_route_priority(text) for text in self.route_priorities))

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
    """The router's configuration, or RouterConfigError with every problem at once."""
    replicas, problems = _replicas(replica_args)
    config = RouterConfig(replicas=tuple(replicas), health=health or HealthConfig(), **options)
    problems += _option_problems(config) + _non_finite_problems(config)
    problems += _health_problems(config.health)
    if (endpoint := endpoint_problem(config.otlp_traces_endpoint)) is not None:
        problems.append(endpoint)
    if problems:
        raise RouterConfigError(problems)
    return config


def _replicas(replica_args: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """(id, URL) of each --replica, and what is wrong with them (malformed, repeated)."""
    problems: list[str] = []
    replicas: list[tuple[str, str]] = []
    for index, text in enumerate(replica_args):
        try:
            replicas.append(parse_replica_arg(text, index))
        except ReplicaError as exc:
            problems.append(str(exc))
    for name, values in (("id", [r[0] for r in replicas]), ("URL", [r[1] for r in replicas])):
        dupes = sorted({v for v in values if values.count(v) > 1})
        if dupes:
            problems.append(f"replica {name}s must be unique; repeated: {', '.join(dupes)}")
    return replicas, problems


# Each bound: (it is broken, the message naming its flag).
_OPTION_RULES: tuple[tuple[Callable[[RouterConfig], bool], str], ...] = (
    (lambda c: c.policy not in POLICIES, "--policy {policy!r} is unknown; choose {policies}"),
    (lambda c: not 0 <= c.port <= 65535, "--port must be 0-65535, got {port}"),
    (lambda c: c.workers < 1, "--workers must be at least 1, got {workers}"),
    (lambda c: c.workers > 1 and c.port == 0,
     "--workers > 1 needs a fixed --port: every worker binds the same one"),
    (lambda c: c.max_inflight is not None and c.max_inflight < 1,
     "--max-inflight must be at least 1"),
    (lambda c: c.max_inflight_per_replica < 1, "--max-inflight-per-replica must be at least 1"),
    (lambda c: c.max_body_readers is not None and c.max_body_readers < 1,
     "--max-body-readers must be at least 1"),
    (lambda c: not (c.body_timeout_s > 0 and c.header_timeout_s > 0),
     "--body-timeout and --header-timeout must be positive"),
    (lambda c: c.api_key is not None and not c.api_key.strip(), "--api-key must not be empty"),
    (lambda c: c.retries < 0, "--retries must be 0 or more, got {retries}"),
    (lambda c: c.resumes < 0, "--resumes must be 0 or more, got {resumes}"),
    (lambda c: c.replica_wait_s < 0, "--replica-wait must be 0 (no wait) or more, got "
     "{replica_wait_s}"),
    (lambda c: c.first_byte_timeout_s < 0 or c.stall_timeout_s < 0,
     "--first-byte-timeout and --stall-timeout must be 0 (no limit) or more"),
    (lambda c: not (c.connect_timeout_s > 0 and c.request_timeout_s > 0),
     "--connect-timeout and --request-timeout must be positive"),
    (lambda c: c.migration_limit < 0, "--migration-limit must be 0 or more, got "
     "{migration_limit}"),
    (lambda c: c.migration_max_seq_len is not None and c.migration_max_seq_len < 1,
     "--migration-max-seq-len must be at least 1, got {migration_max_seq_len}"),
    (lambda c: not c.migration_paths or not set(c.migration_paths) <= set(MIGRATION_PATHS),
     "--migration-path must be one of {migration_choices}, got {migration_given}"),
    (lambda c: c.default_priority not in PRIORITY_NAMES,
     "--default-priority must be one of {priority_names}, got {default_priority!r}"),
    (lambda c: c.reserved_interactive < 0,
     "--reserved-interactive must be 0 or more, got {reserved_interactive}"),
    (lambda c: c.max_inflight is not None and c.reserved_interactive >= c.max_inflight > 0,
     "--reserved-interactive ({reserved_interactive}) must be below --max-inflight "
     "({max_inflight}), or default and bulk requests never run"),
    (lambda c: min(c.queue_timeout_interactive_s, c.queue_timeout_default_s,
                   c.queue_timeout_bulk_s) < 0,
     "--queue-timeout-interactive, -default and -bulk must be 0 (no queue) or more"),
    (lambda c: c.max_queued is not None and c.max_queued < 0,
     "--max-queued must be 0 or more, got {max_queued}"),
)
_HEALTH_RULES: tuple[tuple[Callable[[HealthConfig], bool], str], ...] = (
    (lambda h: h.interval_s <= 0 or h.timeout_s <= 0,
     "--health-interval and --health-timeout must be positive"),
    (lambda h: h.failure_threshold < 1 or h.success_threshold < 1,
     "--health-failures and --health-successes must be at least 1"),
    (lambda h: not 0 <= h.jitter < 1, "--health-jitter must be in [0, 1)"),
    (lambda h: not 1 <= h.max_ejection_percent <= 100,
     "--max-ejection-percent must be 1-100"),
)


def _option_problems(config: RouterConfig) -> list[str]:
    values = {**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)},
              "policies": ", ".join(POLICIES), "migration_choices": ", ".join(MIGRATION_PATHS),
              "migration_given": ", ".join(config.migration_paths) or "none",
              "priority_names": ", ".join(PRIORITY_NAMES)}
    problems = [message.format(**values) for broken, message in _OPTION_RULES
                if broken(config)]
    for text in config.route_priorities:
        try:
            parse_route_priority(text)
        except ValueError as exc:
            problems.append(str(exc))
    return problems


def _health_problems(health: HealthConfig) -> list[str]:
    return [message for broken, message in _HEALTH_RULES if broken(health)]


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
