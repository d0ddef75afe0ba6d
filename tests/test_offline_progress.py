"""The batch progress report: a bar redrawn in place on a terminal, plain lines otherwise."""

from __future__ import annotations

import io

from prefixscore.offline.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_one_line_redrawn_a_file_gets_lines():
    for stream, tty in ((Terminal(), True), (io.StringIO(), False)):
        progress = Progress(total_bytes=1000, stream=stream, every_s=0.0)
        progress.update(lines=10, items=500, bytes_read=250)
        progress.update(lines=10, items=500, errors=1, bytes_read=500)
        progress.finish()
        text = stream.getvalue()
        assert "50.0% | 20 lines (1 errors) | 1,000 items |" in text
        assert "items/s" in text and "ETA 0:00:0" in text
        if tty:
            assert text.count("\r") == 3 and text.count("\n") == 1  # redrawn, one newline at the end
        else:
            assert "\r" not in text and text.count("\n") == 3


def test_plain_lines_are_spaced_out():
    stream = io.StringIO()
    progress = Progress(total_bytes=1000, stream=stream)  # not a terminal: every 10 s
    for _ in range(100):
        progress.update(lines=1, items=1, bytes_read=5)
    assert stream.getvalue() == ""
