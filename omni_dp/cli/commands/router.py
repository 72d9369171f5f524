"""`omni-dp router`: its flags are the fields of omni_dp/router/config.py."""

from __future__ import annotations

import sys

import click

from omni_dp.cli.common import (
    HELP,
    SectionedCommand,
    SectionOption,
    build,
    exit_with_problems,
    finite,
    log_format_option,
    log_level_option,
    options_from,
    setup_logging,
)
from omni_dp.router.config import (
    LIMITS,
    OBSERVABILITY,
    ROUTER_SECTIONS,
    HealthConfig,
    RouterConfig,
    RouterConfigError,
    plan_router,
)


@click.command(cls=SectionedCommand, sections=(*ROUTER_SECTIONS, HELP), help_section=HELP)
@options_from(RouterConfig)
@options_from(HealthConfig, prefix="health_")
@click.option("--drain-timeout", default=30.0, show_default=True, type=float, callback=finite,
              cls=SectionOption, section=LIMITS,
              help="Seconds in-flight requests may take to finish after SIGTERM.")
@log_level_option("Least severe log messages written to stderr (route lines are info).",
                  section=OBSERVABILITY)
@log_format_option("OMNI_DP_LOG_FORMAT", section=OBSERVABILITY)
def router(log_level: str, log_format: str, drain_timeout: float, **values) -> None:
    """Route HTTP traffic over replicas: one endpoint that keeps every replica driven.

    Any path is forwarded byte for byte to one replica and the answer streamed back. Ops:
    GET /health, /ready, /live, /metrics. Admin (loopback): GET/POST /workers,
    PUT/DELETE /workers/ID.

    Exit codes: 0 stopped by SIGTERM/SIGINT, 2 bad options or port taken (nothing started),
    3 a router worker process died.
    """
    health = HealthConfig(**build(HealthConfig, values, prefix="health_"))
    options = build(RouterConfig, values)
    try:
        config = plan_router(list(options.pop("replicas")), health=health, **options)
    except RouterConfigError as exc:
        exit_with_problems("router", exc.problems)
    setup_logging(log_level, log_format)
    from omni_dp.router.workers import run_router

    sys.exit(run_router(config, drain_s=drain_timeout))
