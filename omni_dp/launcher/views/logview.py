"""`omni-dp logs`: print a run's logs, optionally following them (`tail -n N -F` over several
files, each line prefixed with its log's name when there are several). The reading itself,
whole lines only and across a replaced file, is omni_dp/logs.py's."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

from omni_dp.logs import Follower, last_lines

POLL_S = 0.25  # how often a follower looks for new lines


class LogError(Exception):
    """A log that is not there or cannot be read; the message names it."""


def select_logs(logs: Path, *, replica: int | None = None, router: bool = False,
                supervisor: bool = False) -> list[Path]:
    """The logs asked for (one replica's, the router's, the supervisor's, or all of them);
    LogError naming any that do not exist."""
    if replica is not None:
        names = [f"replica_{replica}.log"]
    elif router:
        names = ["router.log"]
    elif supervisor:
        names = ["supervisor.log"]
    else:
        names = sorted(p.name for p in logs.glob("*.log"))
    paths = [logs / name for name in names]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise LogError(f"no {', '.join(missing)} in {logs}")
    return paths


def show_logs(paths: list[Path], *, lines: int, follow: bool, write: Callable[[str], None],
              running: Callable[[], bool] = lambda: True) -> None:
    """The last `lines` lines of each log; with follow, then every line completed after,
    until Ctrl-C or until `running()` is false (the run's state was removed by `down`).
    LogError if a log cannot be read (removed meanwhile, or unreadable)."""

    def echo(path: Path, raw_lines: list[bytes]) -> None:
        prefix = f"[{path.stem}] " if len(paths) > 1 else ""
        for raw in raw_lines:
            write(prefix + raw.decode(errors="replace"))

    with contextlib.ExitStack() as stack:
        try:
            if not follow:
                for path in paths:
                    with open(path, "rb") as f:
                        echo(path, last_lines(f, lines, whole_only=False))
                return
            followers = []
            for path in paths:
                follower = stack.enter_context(contextlib.closing(Follower(path)))
                followers.append(follower)
                echo(path, follower.start(lines))
        except OSError as exc:
            raise LogError(f"cannot read {exc.filename}: {exc.strerror}") from exc
        with contextlib.suppress(KeyboardInterrupt):
            while running():
                time.sleep(POLL_S)
                for follower in followers:
                    echo(follower.path, follower.poll())
