"""The one error of request validation (engine/requests/validation.py and the head's request rules,
engine/requests/heads.py): a bad input, naming the field."""

from __future__ import annotations


class InvalidInput(ValueError):
    """Bad request input; `field` names what is wrong. `too_large`: a size limit was exceeded
    (HTTP 413) rather than a malformed input (HTTP 400); gRPC says INVALID_ARGUMENT for both.
    `precondition`: the input is fine but the server is not set up to serve it (a rerank on a
    model with no reranker template): gRPC FAILED_PRECONDITION, HTTP 400."""

    def __init__(self, field: str, message: str, too_large: bool = False, precondition: bool = False) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.too_large = too_large
        self.precondition = precondition
