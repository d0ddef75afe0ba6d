#!/usr/bin/env bash
# Installs the buf CLI (npm package @bufbuild/buf, pinned) into a tools folder
# outside the work tree and runs `buf lint` on protos/ (buf.yaml at the repo root).
# Idempotent: a second run reuses the install. Prints where buf is, so tests can
# find it through $PREFIXSCORE_BUF (tests/test_proto.py also looks in the
# same default folder).
#
#   bash .ci/proto-tools.sh            # install if needed, then lint
#   bash .ci/proto-tools.sh install    # install only
set -euo pipefail

BUF_VERSION="${BUF_VERSION:-1.75.0}"
TOOLS_DIR="${PREFIXSCORE_TOOLS:-${HOME}/.cache/prefixscore/tools}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUF="${TOOLS_DIR}/node_modules/.bin/buf"

if [[ ! -x "${BUF}" ]] || [[ "$("${BUF}" --version 2>/dev/null)" != "${BUF_VERSION}" ]]; then
  mkdir -p "${TOOLS_DIR}"
  # --no-save/--no-package-lock: keep the tools folder free of manifests we do not need
  npm install --silent --no-audit --no-fund --no-save --no-package-lock \
    --prefix "${TOOLS_DIR}" "@bufbuild/buf@${BUF_VERSION}"
fi
echo "buf ${BUF_VERSION}: ${BUF}"

if [[ "${1:-lint}" == "lint" ]]; then
  cd "${ROOT}"
  "${BUF}" lint
  echo "buf lint: clean"
fi
