"""`prefixscore` as a serving image runs it: without torch. torch is a development dependency
only (the tests' transformers oracles); with it installed, transformers imports it on the
tokenizer's path, 2 s of every server start, and a server that needed it would pass here and
fail in the image. Run as a script: `python cli_as_deployed.py serve ARGS`
(tests/helpers/service.py starts every test server so)."""

from __future__ import annotations

import sys

sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises, as in the image

from prefixscore import cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[1:]))
