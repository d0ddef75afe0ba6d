#!/usr/bin/env bash
# On a machine with a GPU (or TPU) and JAX for it already installed, without network:
# the device tests, the whole suite and the accelerator bench, logs and JSON into $OUT.
# Python packages the machine lacks can travel as wheels in .whl/ (installed into
# /tmp/site); the package itself is put on the path as pyproject.toml maps it, not installed.
#
#   OUT=/tmp/out bash .ci/accelerator.sh env device suite bench
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-/tmp/prefixscore-accelerator}"
PY="${PY:-python3}"
mkdir -p "$OUT"
cd "$ROOT"

if [[ -d .whl ]] && compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
PKG=/tmp/prefixscore-path/prefixscore
mkdir -p "$PKG"
for d in __init__.py cli.py client model kernels engine service telemetry bench offline; do ln -sfn "$ROOT/$d" "$PKG/$d"; done
ln -sfn "$ROOT/protos/prefixscore/v1" "$PKG/v1"
export PYTHONPATH="/tmp/prefixscore-path:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# .accel/cache: derived files made on another machine (SmolLM2's converted tokenizer: its
# 94 MB GGUF package may not travel), used as $PREFIXSCORE_CACHE
[[ -d .accel/cache ]] && export PREFIXSCORE_CACHE="${PREFIXSCORE_CACHE:-$ROOT/.accel/cache}"
export PREFIXSCORE_COMPILE_CACHE_DIR="${PREFIXSCORE_COMPILE_CACHE_DIR:-/tmp/prefixscore-jax-cache}"
BENCH_MODEL="${BENCH_MODEL:-qwen3-0.6b-random}"
BENCH_ARGS="${BENCH_ARGS:-}"

for step in "$@"; do
  case "$step" in
    env)
      nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee "$OUT/env.txt"
      "$PY" -c "import jax, flax, grpc, google.protobuf as pb, transformers; print('jax', jax.__version__, jax.devices(), '| flax', flax.__version__, '| grpc', grpc.__version__, '| protobuf', pb.__version__, '| transformers', transformers.__version__)" 2>&1 | tee -a "$OUT/env.txt"
      ;;
    device)
      "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels_device.py 2>&1 | tee "$OUT/device_tests.log"
      ;;
    suite)
      timeout "${SUITE_TIMEOUT:-540}" "$PY" -m pytest -q -p no:cacheprovider --timeout 300 -rfE ${SUITE_ARGS:-} 2>&1 | tee "$OUT/suite.log"
      ;;
    bench)
      "$PY" -m prefixscore.cli bench --model "$BENCH_MODEL" --dtype bfloat16 --no-progress \
        --json "$OUT/bench.json" ${BENCH_ARGS} 2>&1 | tee "$OUT/bench.log"
      ;;
    *)
      echo "unknown step: $step (env, device, suite, bench)" >&2
      exit 2
      ;;
  esac
done
