"""Model FLOPs a scoring request needs (the work of the math, not of any implementation).

Counted as in docs/benchmarks.md: 2 FLOPs per multiply-add of every projection at every real
token, attention as QK^T and PV (4 * heads * head_dim per query-key pair, causal
pairs only), and the output head at each item's last token only (the whole
vocabulary without apply_softmax, the label rows with it). Padding, recomputation
(the sequential baseline re-running the query) and masked pairs are not counted,
so FLOP/s derived from these numbers is model FLOPs utilisation.
"""

from __future__ import annotations

from collections.abc import Sequence

from prefixscore.model.config import ModelConfig
from prefixscore.model.head import output_head


def linear_per_token(cfg: ModelConfig) -> int:
    """Projection FLOPs of one token through every layer."""
    h, hd = cfg.hidden_size, cfg.head_dim
    per_layer = h * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * h * cfg.intermediate_size
    return 2 * cfg.num_layers * per_layer


def attention_per_pair(cfg: ModelConfig) -> int:
    """FLOPs of one query-key pair across all heads and layers (QK^T and PV)."""
    return 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim


def head(cfg: ModelConfig, apply_softmax: bool, n_labels: int) -> int:
    """Output projection FLOPs at one item's last token (the rows model/head.py says it multiplies)."""
    return 2 * cfg.hidden_size * output_head(cfg).projected_rows(apply_softmax, n_labels)


def token_row_head(cfg: ModelConfig) -> int:
    """Output projection FLOPs of one token row (an item's own likelihood, model/step.py
    row_token_logprobs): the whole vocabulary, for its log-sum-exp and top log-probs."""
    return 2 * cfg.hidden_size * cfg.vocab_size


def request(
    cfg: ModelConfig,
    prefix_len: int,
    item_lens: Sequence[int],
    apply_softmax: bool,
    n_labels: int,
    prefill: bool = True,
    token_rows: bool = False,
) -> dict[str, int]:
    """FLOPs of scoring items over a query: {"prefill", "items", "head", "total"}.

    prefill=False: the query's KV is already cached (a warm request). token_rows: the items' own
    likelihood, a vocabulary head at every item token instead of one at each item's last.
    """
    lin, pair = linear_per_token(cfg), attention_per_pair(cfg)
    pre = prefix_len * lin + pair * prefix_len * (prefix_len + 1) // 2 if prefill else 0
    tokens = sum(item_lens)
    pairs = sum(n * prefix_len + n * (n + 1) // 2 for n in item_lens)
    items = tokens * lin + pair * pairs
    out = tokens * token_row_head(cfg) if token_rows else len(item_lens) * head(cfg, apply_softmax, n_labels)
    return {"prefill": pre, "items": items, "head": out, "total": pre + items + out}
