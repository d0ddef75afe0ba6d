"""Progress on stderr: a bar redrawn in place on a terminal (lines, items/s, ETA), plain lines
every few seconds otherwise (a log file or a CI job has no use for carriage returns)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress:
    """Counts lines and items; the ETA comes from the share of the input's bytes read (or of any
    other total: `CrossEncoder` counts pairs)."""

    def __init__(
        self,
        total_bytes: int,
        start_bytes: int = 0,
        stream: TextIO | None = None,
        every_s: float | None = None,
        label: str = "batch",
    ) -> None:
        self.label = label
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every_s = every_s if every_s is not None else (0.2 if self.tty else 10.0)
        self.total_bytes = max(1, total_bytes)
        self.start_bytes = start_bytes
        self.bytes = start_bytes
        self.lines = self.items = self.errors = 0
        self.started = self._shown = time.monotonic()

    def update(self, lines: int = 0, items: int = 0, errors: int = 0, bytes_read: int | None = None) -> None:
        self.lines += lines
        self.items += items
        self.errors += errors
        if bytes_read is not None:
            self.bytes = bytes_read
        now = time.monotonic()
        if now - self._shown >= self.every_s:
            self._shown = now
            self._show(now)

    def line(self, now: float) -> str:
        elapsed = max(now - self.started, 1e-9)
        share = self.bytes / self.total_bytes
        done = self.bytes - self.start_bytes
        eta = elapsed * (self.total_bytes - self.bytes) / done if done > 0 else None
        return (
            f"{self.label} {share:6.1%} | {self.lines:,} lines ({self.errors:,} errors) | {self.items:,} items "
            f"| {self.items / elapsed:,.0f} items/s | elapsed {_clock(elapsed)} "
            f"| ETA {_clock(eta) if eta is not None else '?'}"
        )

    def _show(self, now: float) -> None:
        text = self.line(now)
        if self.tty:
            self.stream.write("\r" + text + "\033[K")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def finish(self) -> None:
        self._show(time.monotonic())
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
