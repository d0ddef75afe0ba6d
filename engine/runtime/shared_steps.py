"""Which short prefill chunks take their first key steps together (kernels/paged.py: SharedSteps).

lm-evaluation-harness scores a multiple-choice question as one prompt per choice: the k-shot
header, the question, then the choice. Each sibling choice is a prefill chunk of a few tokens
over its question's pages, and on a CPU each such chunk pays a whole query block for every key
step of its ~900-token context, the header's steps included, which every sibling reads alike. An
implementation that can take a group's common steps once (its SHARED_BLOCK, 0: none) is given
here, per data replica's prefill stream, the groups: in stream order, a short chunk (at most
SHARED_BLOCK tokens) starts a group unless it ends within SHARED_BLOCK tokens of where the last
group starts; then it joins that group if it holds the same leading pages as the group's first
chunk for at least one key step (else it is in none). A group takes as many whole key steps as
all its chunks read from those same pages.

Pure host code (numpy), like the planner that calls it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class StepSharing:
    """What the attention implementation shares: groups within `block` tokens (its SHARED_BLOCK),
    in key steps of `step_pages` pages (its key_step_pages for the call's page size and table)."""

    block: int
    step_pages: int


@dataclasses.dataclass(frozen=True)
class ChunkPlace:
    """A prefill chunk as the groups see it: where it sits in its stream, its tokens, the keys its
    last token sees (its prefix and itself) and its pages."""

    at: int
    tokens: int
    keys: int
    pages: Sequence[int]


def _same_leading(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """How many of the first `limit` pages two page lists hold alike, from the first on."""
    n = min(limit, len(a), len(b))
    differs = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differs[0]) if differs.size else n


def shared_steps(
    chunks: Sequence[ChunkPlace], tp: int, page_tokens: int, sharing: StepSharing | None
) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
    """One prefill stream's groups (chunks in stream order): blocks [tp] (each group's first token,
    -1 past the last), the number of groups, block_of [tp] and steps [tp] per token (its chunk's
    group's first token and key steps; -1 and 0 outside any group). `sharing` None: no groups."""
    blocks = np.full(tp, -1, np.int32)
    block_of = np.full(tp, -1, np.int32)
    steps = np.zeros(tp, np.int32)
    if sharing is None:
        return blocks, 0, block_of, steps
    groups: list[tuple[int, list[ChunkPlace]]] = []  # (pages every chunk reads alike, chunks)
    for chunk in chunks:
        if chunk.tokens > sharing.block:
            continue  # a longer chunk takes whole blocks of its own
        if groups:
            common, group = groups[-1]
            first = group[0]
            if chunk.at + chunk.tokens <= first.at + sharing.block:  # within the group's block
                same = _same_leading(chunk.pages, first.pages, -(-chunk.keys // page_tokens))
                if same >= sharing.step_pages:
                    group.append(chunk)
                    groups[-1] = (min(common, same), group)
                continue
        # the first chunk of a group: the pages it reads (a step past them would read its table
        # beyond its own pages)
        groups.append((-(-chunk.keys // page_tokens), [chunk]))
    count = 0
    for common, group in groups:
        taken = common // sharing.step_pages
        if len(group) < 2 or taken == 0:
            continue
        first = group[0].at
        blocks[count] = first
        count += 1
        for chunk in group:
            block_of[chunk.at : chunk.at + chunk.tokens] = first
            steps[chunk.at : chunk.at + chunk.tokens] = taken
    return blocks, count, block_of, steps
