"""The request kinds: validation and tokenization, templates, and each kind's rows and answer
(label scores, an item's own likelihood, embeddings; engine/requests/answers.py). Above the
loop: a kind reaches it only as a `TokenizedRequest` (engine/loop/request.py)."""
