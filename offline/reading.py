"""The input file read as a stream of windows: never whole, so memory is bounded by the window
(lines and bytes), not the file. Inside a window, lines over one query (one prefix key) are
gathered so the query is prefilled once whatever their order in the file; the window's bounds
bound how far apart in the file two lines can be and still be gathered."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import BinaryIO

from prefixscore.offline.lines import BadLine, BatchLine, parse


@dataclasses.dataclass
class Window:
    groups: list[list[BatchLine]]  # lines by prefix key, each group in file order
    bad: list[BadLine]  # lines that are not requests
    bytes_read: int  # input bytes read so far (this window included), for progress

    @property
    def lines(self) -> int:
        return sum(map(len, self.groups)) + len(self.bad)


def windows(f: BinaryIO, skip: set[str], max_lines: int = 4096, max_bytes: int = 64 << 20) -> Iterator[Window]:
    """Windows of up to `max_lines` lines or `max_bytes` bytes of input; lines whose custom_id
    is in `skip` (answered before a resume) are passed over."""
    groups: dict[str, list[BatchLine]] = {}
    bad: list[BadLine] = []
    lines = size = read = 0
    for number, raw in enumerate(f, 1):
        read += len(raw)
        if not raw.strip():
            continue
        line = parse(number, raw)
        if line.custom_id in skip:
            continue
        if isinstance(line, BadLine):
            bad.append(line)
        else:
            groups.setdefault(line.key, []).append(line)
        lines += 1
        size += len(raw)
        if lines >= max_lines or size >= max_bytes:
            yield Window(list(groups.values()), bad, read)
            groups, bad, lines, size = {}, [], 0, 0
    if lines:
        yield Window(list(groups.values()), bad, read)
