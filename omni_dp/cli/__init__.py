"""The `omni-dp` command line: a table of commands, each module imported only when its command
is run (or its own help shown).

Thin: a command parses its options, calls into one package and prints or exits. The top-level
help is rendered from the table's short help, so `omni-dp --help` imports no command module
(and never torch). The commands live in omni_dp/cli/commands/, one module per group.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import NamedTuple

import click

from omni_dp import __version__
from omni_dp.cli.common import POLICIES


class LazyCommand(NamedTuple):
    target: str  # "module:attribute" of the click command
    short_help: str  # what `omni-dp --help` shows; a test keeps it the command's own


_COMMANDS = "omni_dp.cli.commands"
CLI_COMMANDS: dict[str, LazyCommand] = {
    "serve": LazyCommand(f"{_COMMANDS}.serve:serve",
                         "Serve ONE replica of the built-in TTS pipeline over HTTP."),
    "save-weights": LazyCommand(
        f"{_COMMANDS}.serve:save_weights",
        "Write a preset's seeded weights to DIRECTORY (config.json + model.safetensors)."),
    "router": LazyCommand(
        f"{_COMMANDS}.router:router",
        "Route HTTP traffic over replicas: one endpoint that keeps every replica driven."),
    "launch": LazyCommand(
        f"{_COMMANDS}.launch:launch",
        "Run N replicas on one GPU (or on each of --gpus) behind one router, verified, and "
        "supervise them."),
    "status": LazyCommand(
        f"{_COMMANDS}.runs:status",
        "A run's replicas (pid, CPU block, port, health, KV, MPS, restarts), router, daemon."),
    "top": LazyCommand(
        f"{_COMMANDS}.top:top",
        "A live view of a run's replicas (health, in flight, requests/s, TTFA p50/p99, RTF, "
        "underruns, restarts) and its fleet, from their /metrics."),
    "list": LazyCommand(f"{_COMMANDS}.runs:list_runs",
                        "Every run under the state directory, live or kept after a failure."),
    "logs": LazyCommand(
        f"{_COMMANDS}.runs:logs",
        "Print a run's logs (replicas, router, supervisor), optionally following them."),
    "down": LazyCommand(
        f"{_COMMANDS}.runs:down",
        "Stop a run and everything it started, and nothing else; remove its state."),
    "supervise": LazyCommand(
        f"{_COMMANDS}.runs:supervise",
        "Supervise again a live run whose supervisor died (kill -9, OOM): serving went on, "
        "but nothing restarted a failing replica."),
    "restart": LazyCommand(
        f"{_COMMANDS}.changes:restart",
        "Restart a live run's replicas one at a time, without downtime; `-- ENGINE ARGS` "
        "updates the model."),
    "scale": LazyCommand(
        f"{_COMMANDS}.changes:scale",
        "Add replicas to a live run, or remove the highest-numbered ones, without downtime."),
    "verify-mps": LazyCommand(
        f"{_COMMANDS}.mps:verify_mps",
        "Re-prove that every GPU process of every replica of a live run is an MPS client."),
    "mps": LazyCommand(
        f"{_COMMANDS}.mps:mps",
        "Manage a private MPS control daemon on its own (the launcher does this for a run)."),
    "plan": LazyCommand(
        f"{_COMMANDS}.plan:plan",
        "How many replicas FIT this machine (not whether they are faster: `omni-dp bench`)."),
    "bench": LazyCommand(
        f"{_COMMANDS}.bench:bench",
        "Find the right N: a sweep per configuration, ranges over trials, failures kept."),
}


def load(entry: LazyCommand) -> click.Command:
    module, _, attribute = entry.target.partition(":")
    return getattr(importlib.import_module(module), attribute)


class LazyGroup(click.Group):
    """A group whose commands are imported when one is looked up, never to list them."""

    def __init__(self, *args, lazy_commands: Mapping[str, LazyCommand], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_commands = lazy_commands

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self.lazy_commands})

    def get_command(self, ctx: click.Context | None, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.lazy_commands:
            self.add_command(load(self.lazy_commands[cmd_name]), cmd_name)
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """click's listing, with each short help from the table: no command is imported."""
        names = self.list_commands(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(map(len, names))
        rows = []
        for name in names:
            entry = self.lazy_commands.get(name)
            # A stand-in with the table's text shortens it as click does the command's own.
            command = click.Command(name, help=entry.short_help) if entry else self.commands[name]
            rows.append((name, command.get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, lazy_commands=CLI_COMMANDS,
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="omni-dp")
def cli() -> None:
    """Run N replicas of a multi-stage omni model pipeline on one GPU, and prove it."""


def main() -> None:
    cli(prog_name="omni-dp")


def __getattr__(name: str):
    """`from omni_dp.cli import router`: a command object by its attribute name, loaded on
    first use (the modules are omni_dp.cli.commands.*, so no name here is shadowed)."""
    for command, entry in CLI_COMMANDS.items():
        if entry.target.endswith(f":{name}"):
            return cli.get_command(None, command)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CLI_COMMANDS", "POLICIES", "LazyCommand", "LazyGroup", "cli", "main"]
