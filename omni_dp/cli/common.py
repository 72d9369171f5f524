"""What the commands share: parameter types, the exits, --json output, --log-format, and the
click options generated from a settings dataclass (so that every default is written once).

Imports click and nothing heavy: `omni-dp --help` and `launch --help` load this.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NoReturn

import click
from click.core import ParameterSource

from omni_dp.contract import ExitCode
from omni_dp.sizes import parse_size

# The router's policies (omni_dp/router/policies), named here so that `launch --help` need not
# import the router; a test keeps the lists equal.
POLICIES = ("least_request", "round_robin", "power_of_two", "random")
# The formats of omni_dp/logs.py and the levels of the commands that log, named here so that
# `--help` need not import it; a test keeps LOG_FORMATS equal.
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMAT_HELP = ("Log lines as text, or as one JSON object per line (time, level, logger, "
                   "message, fields).")


class SizeParam(click.ParamType):
    """A byte size such as 2GiB, 512MiB or 4096."""

    name = "SIZE"

    def convert(self, value, param, ctx):
        try:
            return parse_size(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


SIZE = SizeParam()


def finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """nan and inf parse as floats and then pass every bound check (nan compares false with
    everything): refuse them where no plan checks the number."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number", ctx, param)
    return value


def fail(command: str, message: str, code: int = ExitCode.USAGE) -> NoReturn:
    click.echo(f"omni-dp {command}: {message}", err=True)
    sys.exit(code)


def nothing_there(command: str, message: str) -> NoReturn:
    """No run of that id, or none at all: the question has an answer, so exit 1 (not 2, which
    says the input itself is wrong); docs/contracts.md's exit codes."""
    fail(command, message, ExitCode.CHECK_FAILED)


def exit_with_problems(command: str, problems: Iterable[str]) -> NoReturn:
    """Every problem of a plan, one per line, then exit 2: nothing was started."""
    for problem in problems:
        click.echo(f"omni-dp {command}: {problem}", err=True)
    sys.exit(ExitCode.USAGE)


def emit(data: dict, text: str, as_json: bool) -> None:
    """The result of a command: `data` as JSON with --json, else `text`."""
    click.echo(json.dumps(data, indent=2) if as_json else text.rstrip("\n"))


def json_option(what: str):
    return click.option("--json", "as_json", is_flag=True, help=f"Print {what} as JSON.")


RICH_OR_PLAIN = ("rich at the terminal's width on a terminal, plain fixed-width columns "
                 "anywhere else, never wrapped")


def format_options(what: str, table: str = RICH_OR_PLAIN):
    """`--format table|markdown|json` and `--json` (the same as `--format json`): the command
    gets `fmt` alone, `json` when either asked for it. `table`: what the table format is for
    this command, as its help says."""
    from omni_dp.tables import FORMATS

    def decorate(f):
        @functools.wraps(f)
        def command(*args, fmt: str, as_json: bool, **kwargs):
            return f(*args, fmt="json" if as_json else fmt, **kwargs)

        command = json_option(what)(command)
        return click.option(
            "--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True,
            help=f"How to print {what}: table ({table}), markdown, or json.")(command)
    return decorate


def log_format_attrs(envvar: str | None = None, more: str = "") -> dict[str, Any]:
    """`--log-format` as the commands that log show it; from the environment where they read
    it."""
    also = f" Also read from {envvar}." if envvar else ""
    return {"type": click.Choice(LOG_FORMATS), "envvar": envvar,
            "help": f"{LOG_FORMAT_HELP}{more}{also}"}


def log_format_option(envvar: str | None = None, more: str = "",
                      section: str | None = None):
    """`--log-format` for a command without a settings dataclass to take its default from."""
    return click.option("--log-format", default="text", show_default=True,
                        cls=SectionOption, section=section, **log_format_attrs(envvar, more))


def log_level_option(help: str, section: str | None = None):
    return click.option("--log-level", default="info", show_default=True,
                        type=click.Choice(LOG_LEVELS), help=help, cls=SectionOption,
                        section=section)


# --- --help in titled sections ------------------------------------------------------------------
# A long flat list of options is hard to scan; vLLM's --help groups its flags under titles, and
# so do `launch`, `serve` and `router`. Each option names its section where it is declared: a
# generated one in its field's metadata ("section"), a written one with `section=`
# (cls=SectionOption). The command holds the titles' order.
OTHER_OPTIONS = "Other options"  # where an option naming no listed section ends (a test: none)
OUTPUT = "Output"  # what a command prints instead of running (--dry-run, --json), and --help
HELP = "Help"  # --help, where a command has no OUTPUT section


class SectionOption(click.Option):
    """A click option that names the --help section it is listed under."""

    def __init__(self, *args, section: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.section = section


class SectionedCommand(click.Command):
    """A command whose --help lists its options under titled sections, in `sections`' order
    (the help option under `help_section`); a section with no shown option is left out."""

    def __init__(self, *args, sections: Sequence[str], help_section: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        assert help_section in sections, f"{help_section!r} is not one of {sections}"
        self.sections = tuple(sections)
        self.help_section = help_section

    def section_of(self, ctx: click.Context, param: click.Parameter) -> str | None:
        """The section `param` is listed under (None: it names none). The help option is
        known by its names (click before 8.2 makes a new one each time it is asked for; 8.2
        keeps the first, made with the names of the first context)."""
        if isinstance(param, SectionOption):
            return param.section
        if set(param.opts) & set(self.get_help_option_names(ctx)):
            return self.help_section
        return None

    def sectioned_rows(self, ctx: click.Context) -> dict[str, list[tuple[str, str]]]:
        """Each shown option's help row under its section's title, in order; an option
        naming no listed section goes under OTHER_OPTIONS, last, rather than nowhere."""
        rows: dict[str, list[tuple[str, str]]] = {title: [] for title in self.sections}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None or not isinstance(param, click.Option):
                continue
            section = self.section_of(ctx, param)
            rows.setdefault(section if section in rows else OTHER_OPTIONS, []).append(record)
        return {title: shown for title, shown in rows.items() if shown}

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections = self.sectioned_rows(ctx)
        # One column of flags across the sections, as in a flat list: write_dl sizes it from
        # the widest flag it is given (up to its col_max, 30), so one row of each is padded.
        widest = min(max((len(flag) for rows in sections.values() for flag, _ in rows),
                         default=0), 30)
        for title, rows in sections.items():
            # a row with help text: a lone flag's padding would trail its line
            padded = next((i for i, (_, text) in enumerate(rows) if text), None)
            rows = [(flag.ljust(widest), text) if i == padded else (flag, text)
                    for i, (flag, text) in enumerate(rows)]
            with formatter.section(title):
                formatter.write_dl(rows)


def setup_logging(level: str, log_format: str) -> None:
    from omni_dp.logs import setup_logging

    setup_logging(level, log_format)


# --- click options from a settings dataclass ---------------------------------------------------
# A field is a flag unless its metadata says {"flag": None}; its default is the field's, never
# written again here. Metadata (all optional): help, flag (the long flag; default --field-name),
# short ("-n"), metavar, choices, size (a byte size: shown and parsed as 2GiB), envvar,
# multiple, invert (an is_flag that sets the field to False: --no-retry), deprecated (old
# spellings: hidden, accepted with a warning; see take_deprecated), section (the title it is
# listed under in a SectionedCommand's --help). The type is the field's.


class FieldOption(SectionOption):
    """A click option generated from a dataclass field (tests compare their defaults)."""

    def __init__(self, *args, field: dataclasses.Field, replaces: str | None = None,
                 **kwargs) -> None:
        super().__init__(*args, section=field.metadata.get("section"), **kwargs)
        self.field = field
        self.replaces = replaces  # a deprecated spelling: the dest it stands in for


def flag_of(f: dataclasses.Field) -> str | None:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def cli_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of a settings dataclass that are flags, in order."""
    return [f for f in dataclasses.fields(cls) if flag_of(f) is not None]


def size_text(size: int) -> str:
    """64 * 1024**2 -> "64MiB": the largest binary unit that divides it."""
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if size and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def _click_type(f: dataclasses.Field, hint) -> Any:
    if f.metadata.get("size"):
        return SIZE
    if "choices" in f.metadata:
        return click.Choice(f.metadata["choices"])
    base = ([a for a in typing.get_args(hint) if a is not type(None)] or [hint])[0]
    return base if base in (int, float, str) else str


def _field_attrs(f: dataclasses.Field, hint) -> dict[str, Any]:
    meta = f.metadata
    if hint is bool:
        return {"is_flag": True, "help": meta.get("help"),
                "default": not f.default if meta.get("invert") else f.default}
    default = f.default
    if meta.get("size") and default is not None:
        default = size_text(default)  # shown as written: [default: 64MiB]
    attrs = {"type": _click_type(f, hint), "default": default, "help": meta.get("help"),
             "metavar": meta.get("metavar"), "envvar": meta.get("envvar")}
    if meta.get("multiple"):
        return {**attrs, "multiple": True, "type": str}
    return {**attrs, "show_default": True}


def options_from(cls: type, *, prefix: str = "", only: Iterable[str] | None = None,
                 **overrides: dict[str, Any]):
    """A decorator adding one click option per flag field of `cls`, in field order, as if
    written one above the other where it is placed. The option's dest is prefix + field name.
    `only`: just these fields (a command that takes a few of another's settings).
    `overrides` adds click attributes per field name (a type, help), never a default."""
    hints = typing.get_type_hints(cls)
    chosen = None if only is None else set(only)
    if chosen is not None:
        unknown = chosen - {f.name for f in cli_fields(cls)}
        assert not unknown, f"no such flag field of {cls.__name__}: {sorted(unknown)}"
    options = []
    for f in cli_fields(cls):
        if chosen is not None and f.name not in chosen:
            continue
        extra = overrides.pop(f.name, {})
        assert "default" not in extra, f"{f.name}: the default is the dataclass's"
        attrs = {**_field_attrs(f, hints[f.name]), **extra}
        dest = prefix + f.name
        decls = [flag_of(f), *([f.metadata["short"]] if "short" in f.metadata else []), dest]
        options.append(click.option(*decls, cls=FieldOption, field=f, **attrs))
        for old in f.metadata.get("deprecated", ()):
            hidden = {**attrs, "default": None, "hidden": True, "show_default": False,
                      "envvar": None}
            options.append(click.option(old, "deprecated_" + old.lstrip("-").replace("-", "_"),
                                        cls=FieldOption, field=f, replaces=dest, **hidden))
    assert not overrides, f"no such flag field of {cls.__name__}: {sorted(overrides)}"

    def decorate(function: Callable) -> Callable:
        for option in reversed(options):
            function = option(function)
        return function

    return decorate


def take_deprecated(ctx: click.Context, values: dict[str, Any]) -> list[str]:
    """Move the values of deprecated spellings given on the command line to the flags that
    replace them (the new spelling wins where both are given); one warning line each."""
    warnings = []
    for param in ctx.command.params:
        if not (isinstance(param, FieldOption) and param.replaces):
            continue
        value = values.pop(param.name)
        if ctx.get_parameter_source(param.name) != ParameterSource.COMMANDLINE:
            continue
        new = next(p for p in ctx.command.params if p.name == param.replaces)
        warnings.append(f"{param.opts[0]} is deprecated (it goes in the next release); use "
                        f"{new.opts[0]}")
        if ctx.get_parameter_source(new.name) == ParameterSource.DEFAULT:
            values[new.name] = value
            ctx.set_parameter_source(new.name, ParameterSource.COMMANDLINE)
    return warnings


def build(cls: type, values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The keyword arguments of `cls` that its generated options set, popped from `values`."""
    taken = {}
    for f in cli_fields(cls):
        value = values.pop(prefix + f.name)
        taken[f.name] = not value if f.metadata.get("invert") else value
    return taken
