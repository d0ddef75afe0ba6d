"""The engine's options from one source (engine/options.py, prefixscore/choices.py): `serve`,
`bench`, `eval` and `batch` take every option with the same flag, choices and default, each
reaches the same EngineSpec field (or the Scorer's template), and `Scorer.load` takes them as
keywords. The commands run for real up to the engine's build, which is replaced by a recorder:
no engine starts. The expected flags, variables, defaults and choices are written out here, as
deploy/ manifests and the docs name them."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from prefixscore import cli

# name -> (flag, serve's environment variable, default, choices)
EXPECTED = {
    "model": ("--model", "PREFIXSCORE_MODEL", "smollm2-135m", None),
    "dtype": ("--dtype", "PREFIXSCORE_DTYPE", "float32", ("float32", "bfloat16")),
    "quantize": ("--quantize", "PREFIXSCORE_QUANTIZE", "auto", ("auto", "none", "int8", "fp8")),
    "activations": ("--activations", "PREFIXSCORE_ACTIVATIONS", "auto", ("auto", "dynamic", "none")),
    "template": (
        "--template",
        "PREFIXSCORE_TEMPLATE",
        "auto",
        ("auto", "qwen3-reranker", "bge-reranker-v2-gemma", "mxbai-rerank-v2", "chat", "none"),
    ),
    "pooling": ("--pooling", "PREFIXSCORE_POOLING", "auto", ("auto", "last", "mean")),
    "pool_bytes": ("--pool-bytes", "PREFIXSCORE_POOL_BYTES", None, None),
    "pool_memory_fraction": ("--pool-memory-fraction", "PREFIXSCORE_POOL_MEMORY_FRACTION", 0.5, None),
    "compile_cache": ("--compile-cache", "PREFIXSCORE_COMPILE_CACHE_DIR", None, None),
    "attn_impl": ("--attention", "PREFIXSCORE_ATTENTION", None, ("reference", "xla", "pallas_tpu", "pallas_gpu")),
    "tp_size": ("--tp-size", "PREFIXSCORE_TP_SIZE", None, None),
    "dp_size": ("--dp-size", "PREFIXSCORE_DP_SIZE", None, None),
    "max_batch_tokens": ("--max-batch-tokens", "PREFIXSCORE_MAX_BATCH_TOKENS", None, None),
    "max_prefill_tokens": ("--max-prefill-tokens", "PREFIXSCORE_MAX_PREFILL_TOKENS", None, None),
}
# the bench's own defaults: its CPU-sized model and Qwen3-Reranker's prompt (docs/benchmarks.md)
BENCH_DEFAULTS = {"model": "bench-cpu", "template": "qwen3-reranker"}
# a value unlike every default for each option: (the flag's text, the value), each different so
# that two options crossed on the way are told apart
SAMPLES = {
    "model": ("some-model", "some-model"),
    "dtype": ("bfloat16", "bfloat16"),
    "quantize": ("fp8", "fp8"),
    "activations": ("none", "none"),
    "template": ("mxbai-rerank-v2", "mxbai-rerank-v2"),
    "pooling": ("mean", "mean"),
    "pool_bytes": ("12345", 12345),
    "pool_memory_fraction": ("0.25", 0.25),
    "compile_cache": ("/nowhere/cache", "/nowhere/cache"),
    "attn_impl": ("pallas_gpu", "pallas_gpu"),
    "tp_size": ("3", 3),
    "dp_size": ("2", 2),
    "max_batch_tokens": ("512", 512),
    "max_prefill_tokens": ("256", 256),
}
BEIR = Path(__file__).resolve().parent.parent / "docs" / "examples" / "beir-mini"


def sample_flags() -> list[str]:
    return [text for name, (flag, *_) in EXPECTED.items() for text in (flag, SAMPLES[name][0])]


@pytest.fixture
def no_env(monkeypatch):
    """No PREFIXSCORE_* variable: `serve`'s defaults are its own."""
    for name in list(os.environ):
        if name.startswith("PREFIXSCORE_"):
            monkeypatch.delenv(name)


def subcommand(name: str) -> argparse.ArgumentParser:
    return cli.build_parser()._subparsers._group_actions[0].choices[name]


@pytest.mark.parametrize("command", ["serve", "bench", "eval", "batch"])
def test_every_command_takes_every_option_with_its_flag_choices_and_default(command, no_env):
    from prefixscore.engine.options import OPTIONS

    assert [o.name for o in OPTIONS] == list(EXPECTED)  # a new option is declared here too
    actions = {a.dest: a for a in subcommand(command)._actions}
    for name, (flag, _, default, choices) in EXPECTED.items():
        action = actions.get(name)
        assert action is not None and flag in action.option_strings, (command, name)
        if command == "bench":
            default = BENCH_DEFAULTS.get(name, default)
        assert (action.default, action.choices and tuple(action.choices)) == (default, choices), (command, name)


def test_serve_reads_each_option_from_its_environment_variable(no_env, monkeypatch):
    for name, (_, env, *_) in EXPECTED.items():
        monkeypatch.setenv(env, SAMPLES[name][0])
    config = cli.config_from_args(cli.build_parser().parse_args(["serve"]))
    assert {name: getattr(config, name) for name in EXPECTED} == {n: v for n, (_, v) in SAMPLES.items()}


class Built(Exception):
    """Where the engine would have been built: what it would have been built with."""


@pytest.fixture
def recorded(monkeypatch):
    """The engine's build and the Scorer replaced by recorders: `recorded` gets the EngineSpec
    and the Scorer's template, then Built ends the command."""
    from prefixscore.engine import build, scorer

    seen: dict = {}

    def build_engine(spec, loaded=None):
        seen["spec"] = spec
        return types.SimpleNamespace(model=None, engine=None)

    def scorer_init(self, model, engine, limits=None, template=None):
        seen["template"] = template
        raise Built

    monkeypatch.setattr(build, "build_engine", build_engine)
    monkeypatch.setattr(scorer, "build_engine", build_engine)
    monkeypatch.setattr(scorer.Scorer, "__init__", scorer_init)
    return seen


def assert_samples(spec, template: str) -> None:
    fields = {name: getattr(spec, name) for name in EXPECTED if name != "template"}
    assert {**fields, "template": template} == {name: value for name, (_, value) in SAMPLES.items()}
    buckets = spec.buckets_for(2048)  # the call shapes the two sizes give the engine
    assert (buckets.max_batch_tokens, buckets.max_prefill_tokens, buckets.context) == (512, 256, 2048)


def test_serve_maps_each_option_to_the_engine_spec(no_env):
    config = cli.config_from_args(cli.build_parser().parse_args(["serve", *sample_flags()]))
    assert_samples(config.engine_spec(), config.template)


def test_bench_eval_and_batch_map_each_option_to_the_engine_spec(recorded, no_env, tmp_path):
    bench = ["bench", "--devices", "1", "--no-progress", *sample_flags()]
    beir_run = ["--beir", str(BEIR), "--run", str(BEIR / "bm25.trec")]
    batch = ["batch", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")]
    for argv in (bench, ["eval", *beir_run, *sample_flags()], [*batch, *sample_flags()]):
        recorded.clear()
        with pytest.raises(Built):
            cli.main(argv)
        assert_samples(recorded["spec"], recorded["template"])
        assert argv[0] != "bench" or recorded["spec"].devices == 1


def test_scorer_load_takes_every_option_as_a_keyword(recorded):
    from prefixscore.engine.scorer import Scorer

    with pytest.raises(Built):
        Scorer.load(**{name: value for name, (_, value) in SAMPLES.items()})
    assert_samples(recorded["spec"], recorded["template"])
    with pytest.raises(Built):  # model and dtype stay positional
        Scorer.load("some-model", "bfloat16")
    spec = recorded["spec"]
    assert (spec.model, spec.dtype, spec.quantize) == ("some-model", "bfloat16", "auto")
    with pytest.raises(TypeError, match="tp"):
        Scorer.load("some-model", tp=2)


def test_bench_serve_process_passes_each_option_to_serve(no_env, monkeypatch):
    """`bench --serve-process`: the served process gets every option as its `serve` flag."""
    from prefixscore.bench import processes

    started = []

    def popen(cmd, **kwargs):
        started.append(cmd)
        raise Built

    monkeypatch.setattr(processes.subprocess, "Popen", popen)
    args = cli.build_parser().parse_args(["bench", "--serve-process", *sample_flags()])
    with pytest.raises(Built):
        processes.ServedProcess(args)
    serve_argv = started[0][started[0].index("serve") :]
    config = cli.config_from_args(cli.build_parser().parse_args(serve_argv))
    assert_samples(config.engine_spec(), config.template)


def test_the_choice_names_import_no_jax():
    """The command lines read the options without JAX (the leaf, the table, serve's config)."""
    code = (
        "import sys, prefixscore.choices, prefixscore.engine.options, prefixscore.service.config\n"
        "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('prefixscore'))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_new_option_is_one_row_of_the_table():
    """A row added to OPTIONS (before the modules that read it are imported: a fresh process) is an
    EngineSpec field with its type and default and a ServerConfig field with its `serve` flag and
    variable, and reaches the spec: EngineSpec and ServerConfig declare no option themselves."""
    code = (
        "import dataclasses, os\n"
        "from prefixscore.engine import options\n"
        "row = options.EngineOption('new_knob', 'a knob', None, int)\n"
        "options.OPTIONS, options.BY_NAME['new_knob'] = (*options.OPTIONS, row), row\n"
        "from prefixscore import cli\n"
        "from prefixscore.engine.build import EngineSpec\n"
        "from prefixscore.service.config import ServerConfig\n"
        "for cls in (EngineSpec, ServerConfig):\n"
        "    field = {f.name: f for f in dataclasses.fields(cls)}['new_knob']\n"
        "    assert (field.type, field.default) == ('int | None', None), (cls, field)\n"
        "assert EngineSpec.from_options({'new_knob': 3}).new_knob == 3\n"
        "config = cli.config_from_args(cli.build_parser().parse_args(['serve', '--new-knob', '8']))\n"
        "assert config.new_knob == 8 and config.engine_spec().new_knob == 8\n"
        "os.environ['PREFIXSCORE_NEW_KNOB'] = '9'\n"
        "assert cli.config_from_args(cli.build_parser().parse_args(['serve'])).new_knob == 9\n"
    )
    env = {name: value for name, value in os.environ.items() if not name.startswith("PREFIXSCORE_")}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env)


def test_the_choice_names_are_those_the_code_gives_a_meaning():
    """Each leaf name has its meaning where the engine uses it, and the defaults agree."""
    from prefixscore import choices
    from prefixscore.engine.build import EngineSpec
    from prefixscore.engine.requests.templates import RECORDS
    from prefixscore.engine.runtime.scoring_engine import POOL_MEMORY_FRACTION
    from prefixscore.kernels.dispatch import IMPLEMENTATIONS
    from prefixscore.model import quant, quant_choice
    from prefixscore.model.config import DTYPES
    from prefixscore.model.presets import PRESETS

    assert choices.DTYPES == tuple(DTYPES)
    assert choices.TEMPLATES == tuple(RECORDS)
    assert choices.ATTENTION == tuple(IMPLEMENTATIONS)
    assert choices.QUANTIZE == (quant_choice.AUTO, quant.NONE, quant.INT8, quant.FP8)
    assert choices.ACTIVATIONS == (quant_choice.AUTO, quant.DYNAMIC, quant.NONE)
    assert choices.DEFAULT_MODEL in PRESETS
    spec = EngineSpec()
    assert spec.buckets_for(2048) is None  # no sizes: the engine's default buckets
    assert EXPECTED["pool_memory_fraction"][2] == POOL_MEMORY_FRACTION
    for name, (_, _, default, _) in EXPECTED.items():
        assert name == "template" or getattr(spec, name) == default, name
