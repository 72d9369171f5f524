"""`omni-dp top`: a live view of a run in the terminal, from its router's and replicas'
/metrics."""

from __future__ import annotations

import json

import click

from omni_dp.cli.common import fail, finite

TOP_HELP = ("A live view of a run's replicas (health, in flight, requests/s, TTFA p50/p99, RTF, "
            "underruns, restarts) and its fleet, from their /metrics.")


@click.command(help=TOP_HELP + """

With no RUN_ID: the only live run (as `status`). Redraws every --interval seconds until
Ctrl-C: the first frame at once with every figure since each process started, then each over
the last interval. --once prints one frame, over one interval, and exits; --once --json prints
it as one JSON object (docs/contracts.md). A replica whose /metrics cannot be read shows as
such, with why. Exit codes: 0 shown (also left with Ctrl-C), 1 no such run, 2 bad input, which
run is ambiguous.""")
@click.argument("run_id", required=False)
@click.option("--interval", type=click.FloatRange(min=0.2, max=3600), default=2.0,
              show_default=True, callback=finite, metavar="SECONDS",
              help="Seconds between two looks (rates and percentiles are over it).")
@click.option("--once", is_flag=True, help="One frame after one interval, then exit.")
@click.option("--json", "as_json", is_flag=True,
              help="With --once: the frame as one JSON object.")
def top(run_id: str | None, interval: float, once: bool, as_json: bool) -> None:
    from omni_dp.cli.commands.runs import _pick_run
    from omni_dp.launcher.views import top_screen

    if as_json and not once:
        fail("top", "--json needs --once (a live view is not JSON)")
    state = _pick_run(run_id, "top")
    timeout = min(max(interval, 1.0), 5.0)  # a scrape that hangs must not stall the view long
    try:
        if once:
            shown = top_screen.once(state.directory, state.record, interval, timeout)
            if as_json:
                click.echo(json.dumps(shown.to_json(), indent=2))
            else:
                top_screen.print_frame(shown)
            return
        top_screen.live(state.directory, state.record, interval, timeout)
    except KeyboardInterrupt:  # Ctrl-C: how one leaves a live view, not a failure
        return
