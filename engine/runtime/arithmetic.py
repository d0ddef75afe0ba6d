"""The same arithmetic in every compiled program of the CPU engine (docs/design.md, "The same
answer whatever the call").

XLA:CPU contracts `a * b + c` into one fused multiply-add wherever the multiply and the add land
in the same fused loop, and whether they do depends on the program around them: in SmolLM2's
layer 0 a token's queries and keys (after RoPE) differed in their last bit between a call of 256
tokens and one of 1,280 while its values did not, and its score by 2.5e-5 in float32 (0.78 in log space with 8-bit
activations, whose rounding amplifies it). Capping the instructions XLA:CPU generates at AVX
(no FMA) leaves every multiply and add rounded on its own, in every program alike. What it costs
was not measured apart: it is one of the parts of the whole change's cost in docs/benchmarks.md.

XLA reads its flags once, when its CPU backend starts: `prefixscore.engine` adds the flag on
import, and an engine built in a process whose backend started earlier (jax used before
prefixscore was imported) says so in its log (`cpu_fma_contraction`).
"""

from __future__ import annotations

import os

import numpy as np

CPU_FLAG = "--xla_cpu_max_isa=AVX"


def pin_cpu_arithmetic() -> None:
    """Add CPU_FLAG to XLA_FLAGS, unless the caller chose a max ISA there."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_max_isa" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {CPU_FLAG}".strip()


def contracts_multiply_add() -> bool:
    """Whether this process's CPU programs fuse a * b + c into one rounding (CPU_FLAG came too late,
    or XLA_FLAGS chose another ISA): a small program's sums against numpy's, rounded twice."""
    import jax

    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(4096).astype(np.float32) for _ in range(3))
    cpu = jax.local_devices(backend="cpu")[0]
    fused = np.asarray(jax.jit(lambda a, b, c: a * b + c)(*(jax.device_put(x, cpu) for x in (a, b, c))))
    return not np.array_equal(fused, a * b + c)
