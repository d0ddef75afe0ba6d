"""How a serving process ends (service/process.py): its last line says when it decided to, a
log stream nobody reads cannot keep it alive, and a lost host group ends it within the README's
5 s (EXIT_PROMISE_S) of the loss being noticed even while its event loop is held."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

from prefixscore.service.process import EXIT_FLUSH_S, EXIT_PROMISE_S, GROUP_EXIT_S

# a child's interpreter start and imports (jax's among them) on a loaded 2-core machine
START_S = 30.0


def _child(code: str) -> subprocess.Popen:
    """`code` in a new interpreter with the prefixscore loggers on stderr as JSON (a pipe)."""
    preamble = "from prefixscore.telemetry import logs\nlogs.configure('json', 'INFO')\n"
    script = preamble + textwrap.dedent(code)
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _events(stderr: bytes) -> list[dict]:
    return [json.loads(line) for line in stderr.decode().splitlines() if line.startswith("{")]


def test_the_last_line_is_exit_with_its_code():
    child = _child("""
        import logging
        from prefixscore.service.process import exit_now
        logging.getLogger("prefixscore.test").info("working")
        exit_now(3)
    """)
    _, stderr = child.communicate(timeout=START_S)
    assert child.returncode == 3
    events = _events(stderr)
    assert [e["event"] for e in events[-2:]] == ["working", "exit"], events
    assert events[-1]["code"] == 3 and events[-1]["ts"] >= events[-2]["ts"]


def test_a_log_stream_nobody_reads_does_not_keep_an_exiting_process_alive():
    """A thread blocked writing to a full pipe holds the log handler's lock: the exit line and
    flush wait for it at most EXIT_FLUSH_S, then the process ends with its code."""
    child = _child("""
        import logging, threading, time
        from prefixscore.service.process import exit_now
        log = logging.getLogger("prefixscore.test")
        def flood():
            while True:
                log.info("x" * 4096)
        threading.Thread(target=flood, daemon=True).start()
        time.sleep(0.5)  # far past a pipe's 64 KB: the flood blocks in a write, its lock held
        exit_now(3)
    """)
    started = time.monotonic()
    try:
        returncode = child.wait(timeout=START_S + 0.5 + EXIT_FLUSH_S)  # stderr is not read until it ends
    finally:
        child.kill()
        child.communicate()
    assert returncode == 3, f"exited {returncode} after {time.monotonic() - started:.1f} s"


def test_a_lost_group_ends_the_process_while_its_event_loop_is_held(tmp_path):
    """The loss noticed (the step channel's callback) while the event loop runs something that
    does not yield: the process still ends non-zero within EXIT_PROMISE_S of the loss, from a
    timer started on the thread that noticed (at GROUP_EXIT_S, early enough for its own last
    line), says why first (`worker_failed`, also from the thread that noticed) and says so in its
    last line."""
    child = _child(f"""
        import asyncio, threading, time
        from prefixscore.service.config import ServerConfig
        from prefixscore.service.process import ScoreServer

        async def main():
            config = ServerConfig(model="tiny-qwen3", host="127.0.0.1", port=0, warmup=False)
            server = ScoreServer(config)
            await server.start()
            def lose():
                open({str(tmp_path / "lost")!r}, "w").write(repr(time.time()))
                server.service.group._lose("host 1 closed the step channel")
            threading.Timer(0.5, lose).start()
            time.sleep(600)  # the event loop held: the service's own failure path cannot run

        asyncio.run(main())
    """)
    try:
        _, stderr = child.communicate(timeout=START_S + GROUP_EXIT_S + 10.0)
    finally:
        child.kill()
    assert child.returncode == 1, stderr.decode()[-2000:]
    lost_at = float((tmp_path / "lost").read_text())
    events = _events(stderr)
    exit_line = events[-1]
    assert exit_line["event"] == "exit" and exit_line["code"] == 1, exit_line
    failed = [e for e in events if e["event"] == "worker_failed"]
    assert failed and "host 1 closed the step channel" in failed[0]["error"], events[-5:]
    # the backstop's own delay, and the loss's lines written before it: inside the promise
    assert GROUP_EXIT_S - 0.1 <= exit_line["ts"] - lost_at <= EXIT_PROMISE_S, exit_line["ts"] - lost_at
