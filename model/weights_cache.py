"""Converted weights kept on disk, so a restart maps them in instead of converting again.

Reading a GGUF file means parsing its metadata (SmolLM2's tokenizer arrays alone take
about 4 s of Python in the `gguf` reader) and dequantizing every tensor: 6 s for
SmolLM2-135M on a 2-core CPU, a third of a warm restart. The parameters that conversion
produces (config and weights, in the served dtype) are written once as a safetensors file
under `presets.cache_dir()/weights` (up to MAX_BYTES) and read back (about 0.7 s) while the
source file, its size and modification time, the dtype and the conversion code are unchanged. The key covers
the code because a fixed conversion must never be served from a stale file. Writing is best
effort: a read-only home directory serves from the source each time, with a warning.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from prefixscore.model import (
    config,
    config_inventory,
    families,
    gguf_blocks,
    gguf_loader,
    head,
    quant,
    quant_choice,
    weights,
)
from prefixscore.model.config import ModelConfig
from prefixscore.model.presets import cache_dir
from prefixscore.model.weights import Weights, flat_weights, weights_from_flat

log = logging.getLogger("prefixscore.weights")

ENV = "PREFIXSCORE_WEIGHTS_CACHE"  # "off" disables the cache
FORMAT = 2  # bump when the file layout changes (2: the typed tree's dotted names)
# larger conversions are not kept: a big model's weights in float would fill the cache volume
# that the compile cache lives on (an emptyDir with a size limit in deploy/k8s) and get the pod
# evicted; the embedded SmolLM2 is 0.5 GiB in float32
MAX_BYTES = 2 << 30


def directory() -> Path | None:
    """Where converted weights are kept; None when $PREFIXSCORE_WEIGHTS_CACHE is "off"."""
    if os.environ.get(ENV, "").strip().lower() in ("off", "none", "false", "0"):
        return None
    return cache_dir() / "weights"


def _key(source: Path, dtype: str) -> str:
    stat = source.stat()
    digest = hashlib.sha256()
    for part in (FORMAT, source.resolve(), stat.st_size, stat.st_mtime_ns, dtype):
        digest.update(f"{part}\0".encode())
    conversion = (config, config_inventory, families, gguf_blocks, gguf_loader, head, quant, quant_choice, weights)
    for module in conversion:  # the conversion itself
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:32]


def cached(source: Path, dtype: str, convert: Callable[[], tuple[ModelConfig, Weights]]) -> tuple[ModelConfig, Weights]:
    """`convert()`'s config and parameters for `source` in `dtype`, from the cache when it has
    them (written there after a conversion). convert() keeps the weights on the host (numpy, the
    checkpoint's layout), and so does a read: the caller places them on its device or mesh."""
    root = directory()
    if root is None:
        return convert()
    path = root / f"{source.stem}-{_key(source, dtype)}.safetensors"
    if path.is_file():
        try:
            return _read(path)
        except Exception as err:  # a damaged file: convert again and replace it
            log.warning("converted weights %s unreadable (%s); converting %s again", path, err, source)
    cfg, params = convert()
    if sum(a.nbytes for a in flat_weights(params).values()) > MAX_BYTES:
        return cfg, params
    try:
        _write(path, cfg, params)
    except OSError as err:
        log.warning("converted weights not cached (%s): each start converts %s again", err, source)
    return cfg, params


def _write(path: Path, cfg: ModelConfig, params: Weights) -> None:
    from safetensors.numpy import save_file

    flat = flat_weights(params)  # "layers.attn.wq": array, ...
    path.parent.mkdir(parents=True, exist_ok=True)
    # written beside, then renamed: a reader never sees half a file, and replicas sharing the
    # directory may race to write it harmlessly
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        save_file(flat, tmp, metadata={"config": cfg.to_json()})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _read(path: Path) -> tuple[ModelConfig, Weights]:
    from safetensors import safe_open

    flat: dict[str, np.ndarray] = {}
    with safe_open(str(path), framework="numpy") as f:
        cfg = ModelConfig.from_json(f.metadata()["config"])
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            flat[name] = f.get_tensor(name)
    return cfg, weights_from_flat(flat)
