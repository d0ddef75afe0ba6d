"""Start-up check of an attention implementation against the oracle, on the device it serves from.

The fast paths are tested on CPU (interpret mode, and lowered for their backends), but
a backend compiler can still miscompile a kernel on the hardware it meets. The server
runs this once before it reports SERVING: the attention the decoder runs per layer (a
call's stream over the paged pool: a prefill chunk, items of several queries, whole
sequences over no prefix), on a layer without a window and on one with a sliding window,
a soft cap and a softmax scale of its own, at the model's head shapes and dtype, compared with
kernels/reference.py computed on the same device at full precision. A mismatch stops
start-up with a message naming the function, instead of serving wrong scores. An
implementation that promises the same bits wherever a token sits in its call
(`SAME_BITS_ANYWHERE`, the CPU's `xla`) runs the same stream again with every run but the
last moved one token later in its block, and must give each moved row the same bits: that
promise rests on the device's matrix products summing a row the same way at any offset, which
a library may not (XLA:CPU's on an AMD Zen 4 pair a contraction by offset), so a machine that
breaks it stops start-up instead of serving answers that depend on the traffic. An engine
checks once per process for its implementation, head shapes and dtype (verify_once).

A passing check's errors are also kept beside jax's persistent compile cache, keyed by
everything that decides the programs it ran and the device they ran on (verdict_key): a
restarted server whose executables come from that cache takes the kept errors instead of
tracing, compiling and running the check again (4-8 s of every restart on CPU). A failing
check is never kept, so it runs again on every start.

`case()` is also the kernel tests' input: one generator of the stream shapes every
implementation must get right.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import threading
from pathlib import Path
from types import ModuleType

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from prefixscore.kernels import reference
from prefixscore.kernels.paged import DEFAULT_LOGITS, NO_WINDOW, AttentionLogits, PagedAttentionMeta

# max |fast - reference| allowed, by dtype (the kernel tests' budgets)
TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2}
PAGE_TOKENS = 128
POOL_PAGES = 24
PAGES_PER_SEGMENT = 8
ALIGN = 128  # segment starts: a multiple of every implementation's SEGMENT_ALIGN
SPLIT = 256  # the prefill region
STREAM_TOKENS = 1024
# the windowed layer: shorter than every prefix but query C's, than the chunk and than the long
# items (so windows cut prefixes, chunks and items), with a soft cap that bends the logits
WINDOW = 48
LOGITS = AttentionLogits(scale=0.1, softcap=2.0)
# the calls checked (_calls), by the names their errors are reported under
CALLS = ("paged_attention", "paged_attention_windowed")
# each call's moved rows against its rows in place, for SAME_BITS_ANYWHERE (must be exactly 0)
MOVED = " moved a token"


class KernelCheckFailed(RuntimeError):
    """The attention implementation disagrees with the reference on this device."""


def case(
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: jnp.dtype | str,
    seed: int = 0,
    window: int | None = None,
    logits: AttentionLogits = DEFAULT_LOGITS,
    shift: int = 0,
) -> dict:
    """One call's stream over a paged pool, with every kind of segment:

    prefill region (256 tokens): a 200-token chunk of query A at 300 (its first 300 tokens
    already in its pages, its own K/V written after them, as a call does) and padding;
    item region: items of query A (prefix 500, pages out of order) across the 128-token
    blocks, items of query B (prefix 128: one whole page), whole sequences over no prefix,
    items of query C (prefix 1: one key), then padding (no prefix).
    Positions as the planner gives them: prefix_len + index within the item, 0 for padding.
    window (None: none) and logits: the layer's (kernels/paged.py). shift: every run but the
    stream's tail starts that many tokens into its aligned block (padding before it), each
    token's q, k and v moving with it: the same call, other places.
    Returns q, k, v [T, ...], pool_k, pool_v [2, kv, pages, 128, d], meta (layer 1) and `place`
    [T] (numpy: where each token of the unshifted stream sits in this one).
    """
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(dtype)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)  # noqa: E731
    pages = rng.permutation(POOL_PAGES)
    table = np.zeros((6, PAGES_PER_SEGMENT), np.int32)
    table[1, :4] = pages[:4]  # query A: 4 pages (500 tokens after the chunk)
    table[2, :1] = pages[4:5]  # query B
    table[3, :1] = pages[5:6]  # query C
    table[4] = table[1]  # the chunk of query A reads the same pages
    prefix_len = np.array([0, 500, 128, 1, 300, 0], np.int32)
    segment_ids = np.zeros(STREAM_TOKENS, np.int32)
    item_ids = np.zeros(STREAM_TOKENS, np.int32)
    positions = np.zeros(STREAM_TOKENS, np.int32)
    # (start, segment, item lengths); the region and segment starts are multiples of ALIGN
    layout = [
        (0, 4, [200]),
        (SPLIT, 1, [20, 1, 63, 64, 65, 40]),
        (SPLIT + 256, 2, [5, 90]),
        (SPLIT + 384, 0, [17, 100]),
        (SPLIT + 512, 3, [3]),
        (SPLIT + 640, 5, [128]),  # the stream's tail padding: its own segment (no prefix) and item
    ]
    place = np.arange(STREAM_TOKENS)
    item = 0
    for i, (start, seg, lengths) in enumerate(layout):
        lead = shift if i < len(layout) - 1 else 0  # the tail ends the stream: no room to move it
        at = start + lead
        # padding before a moved run: the prefill chunk's of no prefix (a chunk's run starts at
        # its first token), the items' of their segment (the items then sit later in its run)
        segment_ids[start:at] = seg if start >= SPLIT else 0
        item_ids[start:at] = -1 - np.arange(start, at)
        place[start : start + sum(lengths)] += lead
        for n in lengths:
            segment_ids[at : at + n] = seg
            item_ids[at : at + n] = item
            positions[at : at + n] = prefix_len[seg] + np.arange(n)
            item += 1
            at += n
        end = (-(-at // ALIGN)) * ALIGN
        segment_ids[at:end] = seg  # alignment padding continues the segment (as the planner pads)
        item_ids[at:end] = -1 - np.arange(at, end)  # and is an item per token: never read
    meta = PagedAttentionMeta(
        segment_ids=jnp.asarray(segment_ids),
        item_ids=jnp.asarray(item_ids),
        page_table=jnp.asarray(table),
        prefix_len=jnp.asarray(prefix_len),
        max_chunk_len=jnp.int32(200),
        max_item_len=jnp.int32(100),
        layer=jnp.int32(1),
        positions=jnp.asarray(positions),
        window=jnp.int32(NO_WINDOW if window is None else window),
        split=SPLIT,
        logits=logits,
    )
    pool = (2, kv_heads, POOL_PAGES, PAGE_TOKENS, head_dim)
    k, v = normal(STREAM_TOKENS, kv_heads, head_dim), normal(STREAM_TOKENS, kv_heads, head_dim)
    q = normal(STREAM_TOKENS, heads, head_dim)
    # as a call does before attention: the chunk's K/V into its query's pages at its positions
    pos = 300 + np.arange(200)
    at = (1, slice(None), table[4][pos // PAGE_TOKENS], pos % PAGE_TOKENS)
    pool_k, pool_v = normal(*pool).at[at].set(k[:200]), normal(*pool).at[at].set(v[:200])

    moving = np.nonzero(place != np.arange(STREAM_TOKENS))[0]

    def moved(x: jax.Array) -> jax.Array:  # each moved token's row at its place (padding keeps its own)
        return x.at[place[moving]].set(x[moving])

    return {
        "q": moved(q),
        "k": moved(k),
        "v": moved(v),
        "pool_k": pool_k,
        "pool_v": pool_v,
        "meta": meta,
        "place": place,
    }


def read_rows(meta: PagedAttentionMeta) -> np.ndarray:
    """[T] bool: the tokens whose attention output a call uses. Padding (negative item ids,
    kernels/paged.py) is never read, and implementations may leave any finite value there."""
    return np.asarray(meta.item_ids) >= 0


def _calls(impl: ModuleType, x: dict) -> dict[str, jax.Array]:
    """The attention the decoder runs, through `impl`: on a plain layer and on a windowed one."""
    arrays = (x["q"], x["k"], x["v"], x["pool_k"], x["pool_v"])
    # a model with no sliding layer traces the Python int NO_WINDOW (model/step.py), and the kernels
    # leave out their windowed steps; the meta's window, an argument of the traced call, is an array
    plain = dataclasses.replace(x["meta"], window=NO_WINDOW)
    windowed = dataclasses.replace(x["meta"], window=jnp.int32(WINDOW), logits=LOGITS)
    plain_call, windowed_call = CALLS
    return {
        plain_call: impl.paged_attention(*arrays, plain),
        windowed_call: impl.paged_attention(*arrays, windowed),
    }


def check(impl: ModuleType, heads: int, kv_heads: int, head_dim: int, dtype: str, *, seed: int = 0) -> dict[str, float]:
    """Max |impl - reference| per call, computed on the default device; for an implementation
    that promises the same bits anywhere (`SAME_BITS_ANYWHERE`), also each call's max |moved -
    in place| (names ending in MOVED). Pure: raises nothing."""
    x = case(heads, kv_heads, head_dim, dtype, seed)
    del x["place"]  # every token in its place
    run = jax.jit(lambda a: _calls(impl, a))
    fast = run(x)
    # the oracle in float32 from the same (rounded) inputs: what the fast path approximates
    # (and XLA:CPU has no bf16 x bf16 -> f32 dot for the oracle's gathered layout)
    wide = {**x, **{n: x[n].astype(jnp.float32) for n in ("q", "k", "v", "pool_k", "pool_v")}}
    with jax.default_matmul_precision("highest"):  # no TF32 in the oracle on GPUs
        exact = jax.jit(lambda a: _calls(reference, a))(wide)
    # on the host: XLA's max reduction may skip NaNs, numpy's propagates them
    read = read_rows(x["meta"])
    diff = lambda a, b, at=read: float(np.max(np.abs(np.asarray(a, np.float32)[at] - np.asarray(b, np.float32)[read])))  # noqa: E731
    errors = {name: diff(fast[name], exact[name]) for name in fast}
    if same_bits_anywhere(impl):
        moved = case(heads, kv_heads, head_dim, dtype, seed, shift=1)
        place = moved.pop("place")
        again = run(moved)  # the same shapes: the same program
        errors |= {name + MOVED: diff(again[name], fast[name], place[read]) for name in fast}
    return errors


def same_bits_anywhere(impl: ModuleType) -> bool:
    """Whether `impl` promises a row the same bits wherever it sits in its call."""
    return bool(getattr(impl, "SAME_BITS_ANYWHERE", False))


def checked_names(impl: ModuleType) -> set[str]:
    """The errors check() reports for `impl`."""
    return set(CALLS) | ({name + MOVED for name in CALLS} if same_bits_anywhere(impl) else set())


def verify(impl_name: str, impl: ModuleType, heads: int, kv_heads: int, head_dim: int, dtype: str) -> dict[str, float]:
    """check(), raising KernelCheckFailed (naming the call and the way out) past the tolerance."""
    return _judged(impl_name, heads, kv_heads, head_dim, dtype, check(impl, heads, kv_heads, head_dim, dtype))


# check()'s errors in this process, by (implementation, its module, head shapes, dtype, backend)
_CHECKED: dict[tuple, dict[str, float]] = {}
_CHECKING = threading.Lock()
# kept verdicts: <jax's compile cache directory>/VERDICTS/<verdict_key>.json
VERDICTS = "prefixscore-attention-checks"
# environment a backend compiler reads: a flag may change the programs the check ran
COMPILER_ENV = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")


def verify_once(
    impl_name: str, impl: ModuleType, heads: int, kv_heads: int, head_dim: int, dtype: str
) -> dict[str, float]:
    """verify(), computed once per process for each implementation, head shapes and dtype on the
    default backend: the check's inputs are fixed (seed 0) and its programs the same, so a second
    engine of the same attention shapes in this process (a replica, an in-process server started
    again, another model with the same heads) would only compute the same errors again. Across
    processes, a passing check's errors kept with the compile cache (verdict_path) are taken the
    same way. The tolerance is applied every time: a failing implementation fails every engine."""
    key = (impl_name, impl, heads, kv_heads, head_dim, dtype, jax.default_backend())
    with _CHECKING:  # concurrent engines wait for the one check instead of running it twice
        if key not in _CHECKED:
            path = verdict_path(impl_name, impl, heads, kv_heads, head_dim, dtype)
            errors = _read_verdict(path, checked_names(impl))
            if errors is None:  # none kept: check now, and keep a pass
                errors = check(impl, heads, kv_heads, head_dim, dtype)
                if path is not None and not _past_tolerance(errors, dtype):
                    _write_verdict(path, errors)
            _CHECKED[key] = errors
    return _judged(impl_name, heads, kv_heads, head_dim, dtype, _CHECKED[key])


def verdict_key(impl_name: str, impl: ModuleType, heads: int, kv_heads: int, head_dim: int, dtype: str) -> str | None:
    """A digest of everything that decides the check's programs and where they ran: the kernels'
    sources (this package's files, which hold the check's inputs, the oracle and the tolerance,
    and the implementation's own file), jax and jaxlib, the backend's platform version and device
    kind, the compiler's flags and jax's default matmul precision, the head shapes and dtype.
    None when the implementation has no source file (nothing to key it by)."""
    try:
        own = Path(inspect.getsourcefile(impl) or "")
    except TypeError:  # not a module or class: built in this process
        return None
    if not own.is_file():
        return None
    files = sorted({*Path(__file__).parent.glob("*.py"), own.resolve()})
    sources = hashlib.sha256()
    for file in files:
        sources.update(file.read_bytes())
    device = jax.devices()[0]
    parts = {
        "implementation": impl_name,
        "sources": sources.hexdigest(),
        "attention": [heads, kv_heads, head_dim, dtype],
        "jax": [jax.__version__, jaxlib.__version__],
        "device": [jax.default_backend(), device.client.platform_version, device.device_kind],
        "compiler": {name: os.environ.get(name, "") for name in COMPILER_ENV},
        "matmul_precision": str(jax.config.jax_default_matmul_precision),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def verdict_path(impl_name: str, impl: ModuleType, heads: int, kv_heads: int, head_dim: int, dtype: str) -> Path | None:
    """Where a passing check's errors are kept: beside jax's persistent compile cache, whose
    executables a kept verdict vouches for; None with the cache off (or no key)."""
    cache = jax.config.jax_compilation_cache_dir
    key = verdict_key(impl_name, impl, heads, kv_heads, head_dim, dtype) if cache else None
    return None if key is None else Path(cache) / VERDICTS / f"{key}.json"


def _read_verdict(path: Path | None, names: set[str]) -> dict[str, float] | None:
    """The kept errors, or None (none kept, or a file this version cannot read: check again)."""
    if path is None:
        return None
    try:
        errors = {str(name): float(err) for name, err in json.loads(path.read_text()).items()}
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return errors if set(errors) == names else None  # every error check() reports, or none kept


def _write_verdict(path: Path, errors: dict[str, float]) -> None:
    """Keep the errors atomically (several hosts or replicas may write one key at once); a cache
    that cannot be written only means the next start checks again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.part")
        part.write_text(json.dumps(errors))
        os.replace(part, path)
    except OSError:
        pass


def _tolerance(name: str, dtype: str) -> float:
    return 0.0 if name.endswith(MOVED) else TOLERANCE[dtype]


def _past_tolerance(errors: dict[str, float], dtype: str) -> dict[str, float]:
    return {name: err for name, err in errors.items() if not err <= _tolerance(name, dtype)}  # NaN fails too


def _judged(
    impl_name: str, heads: int, kv_heads: int, head_dim: int, dtype: str, errors: dict[str, float]
) -> dict[str, float]:
    """The errors, or KernelCheckFailed naming each call past its tolerance."""
    bad = _past_tolerance(errors, dtype)
    if not bad:
        return errors
    where = f"{jax.default_backend()} ({dtype}, {heads} heads / {kv_heads} kv heads / head_dim {head_dim})"
    wrong = {name: err for name, err in bad.items() if not name.endswith(MOVED)}
    moved = {name: err for name, err in bad.items() if name.endswith(MOVED)}
    found = []
    if wrong:
        detail = ", ".join(f"{name} off by {err:.3g}" for name, err in wrong.items())
        found.append(
            f"attention implementation {impl_name!r} disagrees with the reference on {where}: {detail} "
            f"(tolerance {TOLERANCE[dtype]}); serve with --attention xla and report this"
        )
    if moved:
        detail = ", ".join(f"{name} off by {err:.3g}" for name, err in moved.items())
        found.append(
            f"attention implementation {impl_name!r} gives a token other bits one place later in its call "
            f"on {where}: {detail} (must be 0): this machine's matrix products sum a row by where it "
            "sits, so answers would depend on what rides beside them; report this with the CPU's model, "
            "or serve with --attention reference, which promises no such thing"
        )
    raise KernelCheckFailed("; ".join(found))
