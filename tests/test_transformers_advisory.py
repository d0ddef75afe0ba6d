"""A serving install has no torch (transformers serves configs and tokenizers only): transformers'
"PyTorch was not found" advisory must not reach the log, whichever of the project's two ways in
(model/config.py, model/tokenizer.py) imports transformers first; its other records still do."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import make_torch_model

ADVISORY = "PyTorch was not found"
# a fresh interpreter without torch, as a serving image: transformers imported by the project's code
SCRIPT = """
import sys
sys.modules["torch"] = None  # find_spec("torch") is None: transformers sees no torch
from prefixscore.model.{module} import {function}
{function}(sys.argv[1])
from transformers.utils import logging
logging.get_logger("transformers").warning_advice("another advisory")
logging.get_logger("transformers.configuration_utils").warning("a real warning")
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen3 checkpoint directory with a tokenizer: config.json and tokenizer files."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("qwen3")
    make_torch_model("qwen3").config.save_pretrained(path)
    words = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(path)
    return path


@pytest.mark.parametrize(("module", "function"), [("config", "load_config"), ("tokenizer", "load_tokenizer")])
def test_no_torch_advisory_and_other_records_pass(checkpoint, module, function):
    script = SCRIPT.format(module=module, function=function)
    run = subprocess.run([sys.executable, "-c", script, str(checkpoint)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert ADVISORY not in run.stderr, run.stderr
    assert "another advisory" in run.stderr and "a real warning" in run.stderr, run.stderr
