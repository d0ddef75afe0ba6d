"""The output file: one whole line per answer, written and flushed at once, so a crash (or
Ctrl-C, or SIGKILL) loses at most the line being written; `--resume` reads back which
`custom_id`s were answered and drops a trailing partial line first."""

from __future__ import annotations

import json
import os
from typing import Any


class OutputExists(Exception):
    """The output already has lines and --resume was not given."""


class OutputFile:
    """Appends output lines to `path`; `done` holds the custom_ids answered before this run."""

    def __init__(self, path: str, resume: bool) -> None:
        self.path = path
        self.done: set[str] = set()
        if resume:
            self._recover()
        elif os.path.exists(path) and os.path.getsize(path) > 0:
            raise OutputExists(f"{path} has lines already: --resume to continue it, or remove it")
        # O_APPEND: every write lands whole at the end, the file position is never ours to lose
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | (0 if resume else os.O_TRUNC), 0o644)

    def _recover(self) -> None:
        """Read the answered custom_ids, cutting a last line that a crash left without its newline."""
        if not os.path.exists(self.path):
            return
        whole = 0  # bytes up to the end of the last complete line
        with open(self.path, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break
                whole += len(line)
                self.done.add(json.loads(line)["custom_id"])
        if whole < os.path.getsize(self.path):
            os.truncate(self.path, whole)

    def write(self, obj: dict[str, Any]) -> None:
        data = (json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n").encode()
        view = memoryview(data)
        while view:  # a regular file takes it in one call; a short write (disk full) continues
            view = view[os.write(self._fd, view) :]

    def sync(self) -> None:
        """To the disk (after each window): an answered line survives a power cut too."""
        os.fsync(self._fd)

    def close(self) -> None:
        os.fsync(self._fd)
        os.close(self._fd)
