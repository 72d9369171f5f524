"""The tables of `bench`, `plan` and `status`, written for where they land.

A `Grid` is the table itself (title, headers, rows of strings, caption); `render` writes it:

- `table` on a terminal: rich, at the terminal's width (a cell too long for it folds there,
  which a reader scrolling a terminal can follow);
- `table` anywhere else (a file, a pipe, a CI log): plain fixed-width columns, never wrapped —
  rich would squeeze every table to 80 columns there, five lines to a cell;
- `markdown`: a GitHub table, `|` in a cell escaped, for pasting into an issue or a results file.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

FORMATS = ("table", "markdown", "json")


@dataclass(frozen=True)
class Grid:
    title: str
    headers: tuple[str, ...]
    rows: list[tuple[str, ...]] = field(default_factory=list)
    caption: str = ""
    sections: frozenset[int] = frozenset()  # row indexes a rule is drawn before
    warn: frozenset[int] = frozenset()  # rows shown in red on a terminal (a failure)
    show_headers: bool = True
    indent: str = ""  # of the rows in plain text (under a title that is not indented)

    def __post_init__(self) -> None:
        for row in self.rows:
            if len(row) != len(self.headers):
                raise ValueError(f"{self.title}: a row of {len(row)} cells under "
                                 f"{len(self.headers)} headers: {row}")


def plain(grid: Grid) -> str:
    """Fixed-width columns separated by two spaces; the last column is never padded."""
    shown = ([grid.headers] if grid.show_headers else []) + list(grid.rows)
    widths = [max((len(row[c]) for row in shown), default=0)
              for c in range(len(grid.headers))]

    def line(row: tuple[str, ...]) -> str:
        cells = [cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=False)]
        return (grid.indent + "  ".join([*cells, row[-1]])).rstrip()

    lines = [grid.title] if grid.title else []
    if grid.show_headers:
        lines.append(line(grid.headers))
    for n, row in enumerate(grid.rows):
        if n in grid.sections and n:
            lines.append("")
        lines.append(line(row))
    if grid.caption:
        lines.append(grid.caption)
    return "\n".join(lines)


def markdown(grid: Grid) -> str:
    def cells(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") or " "
                                 for c in row) + " |"

    lines = [f"**{grid.title}**", ""] if grid.title else []
    lines += [cells(grid.headers), "|" + "|".join("---" for _ in grid.headers) + "|"]
    lines += [cells(row) for row in grid.rows]
    if grid.caption:
        lines += ["", grid.caption]
    return "\n".join(lines)


def render(grids: Sequence[Grid], fmt: str = "table", stream: TextIO | None = None) -> None:
    """Write the grids to `stream` (stdout) in `fmt` (`table` or `markdown`), a blank line
    between two."""
    stream = stream or sys.stdout
    if fmt == "table" and is_terminal(stream):
        from rich.console import Console

        console = Console(file=stream)
        for n, grid in enumerate(grids):
            if n:
                console.print()
            console.print(rich_table(grid))
        return
    write = markdown if fmt == "markdown" else plain
    stream.write("\n\n".join(write(grid) for grid in grids) + "\n")
    stream.flush()


def rich_table(grid: Grid):
    """rich's Table of the grid; every cell a Text, so `[low–high]` is never read as markup."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text(grid.title) if grid.title else None,
                  caption=Text(grid.caption) if grid.caption else None,
                  title_justify="left", caption_justify="left", show_header=grid.show_headers)
    for header in grid.headers:
        table.add_column(Text(header), overflow="fold")
    for n, row in enumerate(grid.rows):
        if n in grid.sections and n:
            table.add_section()
        table.add_row(*(Text(cell) for cell in row), style="red" if n in grid.warn else None)
    return table


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
