"""What each replica is doing while bring-up waits for it: never a silent wait.

A replica with a real model takes seconds to minutes before its /health answers, and its own
log is where it says what it is doing (loading weights, compiling, profiling memory). The board
shows, for each replica bring-up is waiting on, its phase, how long it has been at it and its
log's last line: on a terminal one line per replica redrawn in place (rich's Live, on stderr,
gone once the wait ends); anywhere else a plain line per replica every `every_s` seconds once it
has waited `quiet_s`, through the launcher's own `say` (so a JSON log gets records).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from omni_dp.launcher.engines.readback import is_start_banner, read_tail

TAIL_BYTES = 4096  # a log's last line is within its last few KB
LINE_CHARS = 100  # of a log line shown: enough to say what it does


@dataclass
class _Waiting:
    phase: str
    since: float
    log: Path
    said_at: float = 0.0


def last_line(path: Path) -> str:
    """The log's last non-empty line, shortened; "" when there is none yet."""
    try:
        lines = [line.strip() for line in read_tail(path, TAIL_BYTES)
                 if line.strip() and not is_start_banner(line)]  # ours: says nothing new
    except OSError:
        return ""
    if not lines:
        return ""
    line = lines[-1]
    return line if len(line) <= LINE_CHARS else line[:LINE_CHARS - 1] + "…"


class StartBoard:
    """bringup.steps.StartProgress: begin(i, …) when bring-up starts waiting on a replica,
    phase(i, …) as it passes gates, end(i) when done with it; start()/stop() (or `with`) run
    the ticker."""

    def __init__(self, say: Callable[[str], None], *, live: bool,
                 quiet_s: float = 2.0, every_s: float = 10.0) -> None:
        self.say = say
        self.live = live
        self.quiet_s = quiet_s
        self.every_s = every_s
        self.waiting: dict[int, _Waiting] = {}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self._live = None  # rich.live.Live while on a terminal

    # --- what bring-up tells it ---------------------------------------------------------------
    def begin(self, index: int, log: Path, phase: str) -> None:
        with self.lock:
            self.waiting[index] = _Waiting(phase, time.monotonic(), log)

    def phase(self, index: int, phase: str) -> None:
        with self.lock:
            if index in self.waiting:
                self.waiting[index].phase = phase

    def end(self, index: int) -> None:
        with self.lock:
            self.waiting.pop(index, None)

    # --- the ticker ---------------------------------------------------------------------------
    def __enter__(self) -> StartBoard:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if self.live:
            from rich.console import Console
            from rich.live import Live

            self._live = Live("", console=Console(stderr=True), transient=True,
                              refresh_per_second=4)
            self._live.start()
        self.thread = threading.Thread(target=self._tick, name="start-board", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(5)
        if self._live is not None:
            self._live.stop()
            self._live = None

    def lines(self, now: float | None = None) -> list[str]:
        """One line per replica waited on: `replica 1  starting  12 s  <its log's last line>`."""
        now = time.monotonic() if now is None else now
        with self.lock:
            waiting = sorted(self.waiting.items())
        return [f"replica {i}  {now - w.since:3.0f} s  {w.phase}  "
                f"{last_line(w.log) or '(nothing in its log yet)'}" for i, w in waiting]

    def due(self, now: float) -> list[str]:
        """The plain lines due now: each replica waited on for quiet_s, then every every_s."""
        out = []
        with self.lock:
            for i, w in sorted(self.waiting.items()):
                waited = now - w.since
                if waited < self.quiet_s or now - w.said_at < self.every_s:
                    continue
                w.said_at = now
                log = last_line(w.log)
                out.append(f"replica {i}: {w.phase} ({waited:.0f} s)"
                           + (f"; its log: {log}" if log else "; nothing in its log yet"))
        return out

    def _tick(self) -> None:
        while not self.stopping.wait(0.25 if self.live else 0.5):
            if self._live is not None:
                from rich.text import Text

                # one row per replica: cut at the terminal's width, never wrapped
                self._live.update(Text("\n".join(self.lines()), no_wrap=True,
                                       overflow="ellipsis"))
            else:
                for line in self.due(time.monotonic()):
                    self.say(line)
