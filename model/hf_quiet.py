"""transformers without its "PyTorch was not found" advisory.

The service uses transformers for config classes and tokenizers only, which need no torch, so a
serving install has none; transformers then announces at import that models will not be
available, a line that reads like a fault in a server's start-up log. Importing this module
(before transformers) drops exactly that record from the `transformers` logger, which emits it;
every other record of transformers, advisories included, still goes through.
"""

from __future__ import annotations

import logging

TORCH_ADVISORY = "PyTorch was not found."  # the start of the advisory transformers/__init__.py logs


class _DropTorchAdvisory(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(TORCH_ADVISORY)


# The record is logged on the library's root logger itself, where a logger's filters apply; the
# logger object exists before transformers configures it, and transformers keeps its filters.
logging.getLogger("transformers").addFilter(_DropTorchAdvisory())
