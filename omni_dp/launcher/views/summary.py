"""What `launch` tells its user once the run is up: the summary, and the line a script waits for.

One `RunSummary` is built from the run as it is (health probed again), then shown three ways:
as text under the launch's lines, as the fields of one JSON log record (`--log-format json`),
or as the one JSON object `launch --detach --json` prints.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass

from omni_dp.contract import API_KEY_ENV
from omni_dp.launcher.engines import ENGINES
from omni_dp.launcher.engines.base import flag_value, split_model
from omni_dp.launcher.planning.plan import LaunchPlan
from omni_dp.launcher.planning.share_group import attachment_basis
from omni_dp.launcher.record.state import RunState
from omni_dp.launcher.views.status import collect, replica_table
from omni_dp.sizes import format_size


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    endpoint: str
    replicas: list[dict]  # `omni-dp status --json`'s rows
    checks: tuple[str, ...]  # the gates bring-up passed before it called the run ready
    try_command: str
    status_command: str
    teardown_command: str
    auth: str | None = None  # how to pass the router's API key (the key itself never)
    replicas_unauthenticated: str | None = None  # said whenever the router wants a key
    mps_proof: str | None = None
    share: str | None = None

    @property
    def ready_line(self) -> str:
        """`ready: 2 replicas verified behind http://…` — the line a script can wait for; a
        replica the summary's own health probe did not find healthy is not counted."""
        count = sum(r["health"] == "healthy" for r in self.replicas)
        of = f" of {len(self.replicas)}" if count != len(self.replicas) else ""
        return (f"ready: {count}{of} replica{'s' if len(self.replicas) != 1 else ''} verified "
                f"behind "
                f"{self.endpoint} (run {self.run_id}; checked: {', '.join(self.checks)})")

    def text(self) -> str:
        fields = [("endpoint", self.endpoint), ("share", self.share), ("try", self.try_command),
                  ("auth", self.auth), ("replicas", self.replicas_unauthenticated),
                  ("mps", self.mps_proof), ("status", self.status_command),
                  ("teardown", self.teardown_command)]
        return "\n".join([replica_table(self.replicas), "",
                          *(f"{name:<10} {value}" for name, value in fields if value)])

    def to_json(self) -> dict:
        fields = asdict(self)
        fields["checks"] = list(self.checks)
        fields["ready"] = self.ready_line
        return fields


def run_summary(plan: LaunchPlan, state: RunState, checks: tuple[str, ...]) -> RunSummary:
    """`checks`: the gates bring-up passed (bringup.steps.RunUp)."""
    status = collect(state)  # health probed again: the table shows what is, not what was
    o = plan.options
    # The key itself is never printed: the header names the variable that holds it.
    auth = f" -H \"Authorization: Bearer ${API_KEY_ENV}\"" if o.api_key else ""
    share = state.record.share
    return RunSummary(
        run_id=plan.run_id, endpoint=plan.router_url, replicas=status["replicas"],
        checks=checks, try_command=example_request(plan, auth),
        status_command=f"{plan.command} status {plan.run_id}",
        teardown_command=f"{plan.command} down {plan.run_id}",
        auth=(f"the router wants the API key: export {API_KEY_ENV}=KEY for the command above"
              if o.api_key else None),
        replicas_unauthenticated=(
            "listen on 127.0.0.1 without the API key: anyone on this host can reach them "
            f"directly (ports {_ports(status['replicas'])}); the key guards the router only"
            if o.api_key else None),
        mps_proof=(f"{plan.command} verify-mps {plan.run_id}   ({state.directory / _proof(plan)})"
                   if o.mps else None),
        share=(f"replica {share.leader}'s {format_size(share.shared_bytes)} of weights held "
               f"once, mapped by replica(s) {', '.join(map(str, share.followers)) or 'none'}, "
               f"{attachment_basis(plan.device)} ({share.directory})" if share else None))


def _proof(plan: LaunchPlan) -> str:
    return "mps_attach.txt" if len(plan.gpus) <= 1 else "mps_attach.gpu*.txt: one per GPU"


def _ports(replicas: list[dict]) -> str:
    ports = [r["port"] for r in replicas]
    return f"{ports[0]}-{ports[-1]}" if len(ports) > 1 else str(ports[0])


def example_request(plan: LaunchPlan, auth: str) -> str:
    """A request that fits the engine: speech for the TTS pipelines, a completion for LLMs."""
    url = plan.router_url
    if ENGINES[plan.options.engine].example == "completions":
        body = json.dumps({"model": served_model(plan), "prompt": "Hello, my name is",
                           "max_tokens": 16})
        return (f"curl -s {url}/v1/completions{auth} -H 'Content-Type: application/json' "
                f"-d {shlex.quote(body)}")
    return (f"curl -s {url}/v1/audio/speech{auth} -H 'Content-Type: application/json' "
            "-d '{\"input\": \"Hello there.\"}' -o hello.wav")


def served_model(plan: LaunchPlan) -> str | None:
    """The name the engine serves the model under: --served-model-name if the user gave one,
    else the model as the replicas are started with it (vLLM's and sglang's default)."""
    argv = plan.replicas[0].argv
    for flag in ("--served-model-name", "--model", "--model-path"):
        name = flag_value(argv, flag)
        if name is not None:
            return name
    return split_model(plan.options.engine_args)[0]
