"""The transformers oracles' forward passes on one torch thread.

torch runs a tiny model's matmuls on as many OpenMP threads as there are cores; on a saturated
machine (CI: two cores, two pytest workers, XLA compiling beside them) its idle threads spin for
each other: the oracle of one parametrized case cost about 2.5 CPU-s on two threads and 0.1 on
one (measured on tests/test_parity_transformers.py's sequences). Same float32 arithmetic, same
eager model: only the threads that run it change.
"""

from __future__ import annotations

from collections.abc import Iterator


def one_torch_thread() -> Iterator[None]:
    """A module fixture's body: torch on one intra-op thread for the module, restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
