"""Where a request's time goes: a `jax.profiler` trace of it, summed by part of the model.

`prefixscore bench --profile DIR` traces one cold W1 request and prints this summary.
Device kernels are attributed to a part through the compiled HLO: each kernel event
names its HLO instruction (`hlo_op`), whose `op_name` metadata carries the
`jax.named_scope` path of the code that made it (model/decoder.py, model/step.py,
the attention families). The request's wall time minus the device's busy time
(the union of its kernel intervals) is host work and launch gaps.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# (part, substring of the op_name scope path), first match wins: inner scopes before outer ones
PARTS: tuple[tuple[str, str], ...] = (
    ("head", "/head/"),
    ("pool_write", "/pool_write/"),
    ("pool_copy", "/pool_copy/"),
    ("prefix_part", "/prefix_part/"),
    ("item_part", "/item_part/"),
    ("merge", "/merge/"),
    ("attention_other", "/attention/"),  # projections, norms, rope, output projection
    ("mlp", "/mlp/"),
)
COPIES = "copies"  # memcpy/memset events (no HLO instruction)
OTHER = "other"  # embedding, input gathers, loop bookkeeping

# XLA:CPU traces control flow (a while loop, a conditional) as an event around its body's
# events: counting it too would count its body twice
_CONTROL_FLOW = re.compile(r"^(while|cond|conditional|call)(\.\d+)?$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*op_name=\"([^\"]*)\"")


def scopes_by_instruction(hlo_texts: Iterable[str]) -> dict[str, str]:
    """HLO instruction name -> its op_name (the jax name-scope path) from compiled HLO texts."""
    scopes: dict[str, str] = {}
    for text in hlo_texts:
        for line in text.splitlines():
            m = _INSTRUCTION.match(line)
            if m:
                scopes.setdefault(m.group(1), m.group(2))
    return scopes


def part_of(op_name: str | None) -> str:
    if not op_name:
        return OTHER
    path = "/" + op_name.strip("/") + "/"
    for part, needle in PARTS:
        if needle in path:
            return part
    return OTHER


def _kernel_events(xplane: Path) -> list[tuple[int, int, str | None, str]]:
    """(start_ns, duration_ns, hlo_op, name) of each kernel the device ran.

    Accelerators: every event on a `/device:*` plane. CPU (no device plane): the host
    events that carry an `hlo_op` stat (XLA:CPU thunks)."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(str(xplane))
    planes = [p for p in data.planes if p.name.startswith("/device:")]
    host_only = not planes
    if host_only:
        planes = [p for p in data.planes if p.name == "/host:CPU"]
    events = []
    for plane in planes:
        for line in plane.lines:
            if not host_only and line.name in ("XLA Modules", "XLA Ops", "Steps", "Source", "Framework Ops"):
                continue  # summaries of the kernels on the stream lines, not kernels themselves
            for ev in line.events:
                stats = dict(ev.stats)
                op = stats.get("hlo_op")
                if host_only and (op is None or _CONTROL_FLOW.match(str(op))):
                    continue
                events.append((int(ev.start_ns), int(ev.duration_ns), None if op is None else str(op), ev.name))
    return events


def _busy_ns(intervals: list[tuple[int, int]]) -> int:
    """Length of the union of [start, start + duration) intervals."""
    busy, end = 0, None
    for start, dur in sorted(intervals):
        stop = start + dur
        if end is None or start >= end:
            busy += dur
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy


def summarize(xplane: Path, hlo_texts: Iterable[str], wall_s: float) -> dict[str, Any]:
    """Device time by model part, the top kernels, and host/launch gaps of one traced request."""
    scopes = scopes_by_instruction(hlo_texts)
    events = _kernel_events(xplane)
    by_part: dict[str, int] = defaultdict(int)
    by_kernel: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for _, dur, op, name in events:
        part = COPIES if op is None and "mem" in name.lower() else part_of(scopes.get(op or ""))
        by_part[part] += dur
        k = by_kernel[f"{part}: {op or name}"]
        k[0] += dur
        k[1] += 1
    busy = _busy_ns([(s, d) for s, d, _, _ in events])
    wall_ns = int(wall_s * 1e9)
    kernel_ns = sum(by_part.values())
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:15]
    return {
        "wall_ms": wall_ns / 1e6,
        "device_busy_ms": busy / 1e6,
        "host_and_gaps_ms": max(wall_ns - busy, 0) / 1e6,
        "kernel_ms": kernel_ns / 1e6,
        "kernels": len(events),
        "parts_ms": {p: ns / 1e6 for p, ns in sorted(by_part.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"kernel": name, "ms": ns / 1e6, "count": n} for name, (ns, n) in top],
    }


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"traced request: wall {s['wall_ms']:.2f} ms, device busy {s['device_busy_ms']:.2f} ms "
        f"({s['kernels']} kernels), host work and launch gaps {s['host_and_gaps_ms']:.2f} ms",
        "device time by part (sum over kernels; streams may overlap):",
    ]
    total = s["kernel_ms"] or 1.0
    for part, ms in s["parts_ms"].items():
        lines.append(f"  {part:<16} {ms:9.3f} ms  {100 * ms / total:5.1f}%")
    lines.append("top kernels:")
    for k in s["top_kernels"]:
        lines.append(f"  {k['ms']:9.3f} ms  x{k['count']:<5} {k['kernel']}")
    return "\n".join(lines)


def latest_xplane(log_dir: Path) -> Path:
    """The newest `*.xplane.pb` jax.profiler wrote under log_dir."""
    found = sorted(Path(log_dir).glob("**/*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no .xplane.pb under {log_dir}")
    return found[-1]
