"""How `omni-dp launch` reports, one class per way (launch.LaunchOutput):

- `TextOutput`: `omni-dp: …` lines on stdout, the summary as a block, the `ready:` line last;
  the start board redrawn in place on a terminal (stderr), plain lines every 10 s elsewhere;
- `JsonLogOutput` (`--log-format json`): one JSON record per line on stdout; the summary and
  the ready line are records whose fields a log collector can read (`event`: run_summary,
  ready), not one message with newlines inside;
- `SummaryJsonOutput` (`--detach --json`): everything on stderr (text or JSON records), and on
  stdout one JSON object, the run's summary, once it is up and supervised.
"""

from __future__ import annotations

import json
import logging
import sys

import click

from omni_dp.launcher.views.progress import StartBoard
from omni_dp.launcher.views.summary import RunSummary
from omni_dp.logs import FIELDS
from omni_dp.tables import is_terminal


class TextOutput:
    def __init__(self, *, err: bool = False) -> None:
        self.err = err
        # Redrawn in place only where what is said lands on the same terminal: rich prints
        # those lines above the board then; anywhere else, plain lines every 10 s.
        live = is_terminal(sys.stderr) and (err or is_terminal(sys.stdout))
        self.progress = StartBoard(self.say, live=live)

    def say(self, line: str) -> None:
        click.echo(f"omni-dp: {line}", err=self.err)

    def summary(self, summary: RunSummary) -> None:
        click.echo(f"\n{summary.text()}\n", err=self.err)

    def ready(self, summary: RunSummary) -> None:
        self.say(summary.ready_line)


class JsonLogOutput:
    def __init__(self, stream=None) -> None:
        from omni_dp.logs import setup_logging

        setup_logging("info", "json", stream=stream or sys.stdout)
        self.log = logging.getLogger("omni_dp.launch")
        self.progress = StartBoard(self.say, live=False)

    def say(self, line: str) -> None:
        """A block (the plan, a log's last lines) as its first line, the rest in `lines`."""
        first, *rest = line.split("\n")
        self.log.info(first, extra={FIELDS: {"lines": rest}} if rest else None)

    def summary(self, summary: RunSummary) -> None:
        self.log.info("run summary", extra={FIELDS: {"event": "run_summary",
                                                     **summary.to_json()}})

    def ready(self, summary: RunSummary) -> None:
        self.log.info(summary.ready_line, extra={FIELDS: {
            "event": "ready", "run_id": summary.run_id, "endpoint": summary.endpoint,
            "replicas": len(summary.replicas), "checks": list(summary.checks)}})


class SummaryJsonOutput:
    """Stdout is the summary's; what the launch says goes to stderr in the log format."""

    def __init__(self, log_format: str) -> None:
        self.lines = (JsonLogOutput(sys.stderr) if log_format == "json"
                      else TextOutput(err=True))
        self.progress = self.lines.progress

    def say(self, line: str) -> None:
        self.lines.say(line)

    def summary(self, summary: RunSummary) -> None:
        pass  # printed whole, once the run is handed over

    def ready(self, summary: RunSummary) -> None:
        self.lines.ready(summary)
        click.echo(json.dumps(summary.to_json(), indent=2))


def launch_output(log_format: str, summary_json: bool):
    if summary_json:
        return SummaryJsonOutput(log_format)
    return JsonLogOutput() if log_format == "json" else TextOutput()
