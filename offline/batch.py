"""`prefixscore batch`: read windows of the input, have a backend answer them (in process, or
running servers), append each answer to the output as it comes, report progress."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from typing import Any, Protocol

from prefixscore.offline.lines import BatchLine, failed
from prefixscore.offline.output import OutputFile
from prefixscore.offline.progress import Progress
from prefixscore.offline.reading import windows


class Backend(Protocol):
    prefills: int | None  # queries prefilled so far, where the backend can count them

    def answer(self, groups: list[list[BatchLine]]) -> Iterator[dict[str, Any]]: ...


@dataclasses.dataclass
class Summary:
    lines: int  # answered in this run
    errors: int  # of them, answered with an error
    skipped: int  # answered before (--resume)
    items: int  # items and documents of the lines answered without an error
    seconds: float
    prefills: int | None

    def text(self) -> str:
        rate = self.items / self.seconds if self.seconds > 0 else 0.0
        prefills = "" if self.prefills is None else f"; {self.prefills} prefills"
        return (
            f"batch done: {self.lines} lines ({self.errors} errors, {self.skipped} answered before), "
            f"{self.items} items in {self.seconds:.2f} s ({rate:.1f} items/s){prefills}"
        )


def run_batch(
    input_path: str,
    out: OutputFile,
    backend: Backend,
    *,
    window_lines: int = 4096,
    window_bytes: int = 64 << 20,
) -> Summary:
    """Answer every line of `input_path` not answered in `out` yet (opened with or without
    resume); `out` is closed at the end."""
    started = time.monotonic()
    before = backend.prefills
    progress = Progress(os.path.getsize(input_path))
    errors = lines = 0
    try:
        with open(input_path, "rb") as f:
            for window in windows(f, out.done, window_lines, window_bytes):
                for bad in window.bad:
                    out.write(failed(bad.custom_id, None, 400, bad.message))
                    lines += 1
                    errors += 1
                    progress.update(lines=1, errors=1)
                # custom_id -> items, for the lines of the window in flight
                items = {line.custom_id: line.items for group in window.groups for line in group}
                for answer in backend.answer(window.groups):
                    out.write(answer)
                    ok = answer["error"] is None
                    lines += 1
                    errors += int(not ok)
                    progress.update(lines=1, errors=int(not ok), items=items[answer["custom_id"]] if ok else 0)
                progress.update(bytes_read=window.bytes_read)
                out.sync()
    finally:
        out.close()
        progress.finish()
    after = backend.prefills
    prefills = None if after is None or before is None else after - before
    return Summary(lines, errors, len(out.done), progress.items, time.monotonic() - started, prefills)
