"""Shared by tests/test_deploy_*.py (and the prefix-affinity component's test): where deploy/
lives, the external tools the deploy tests run (installed by `.ci/deploy-tools.sh`), rendering
and validating the Kubernetes manifests, and metric names referenced by PromQL.

A missing tool skips a test on a developer's machine but fails it in CI (CI=true): nothing
that CI is meant to check may silently not run (helpers/prerequisites.py).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NoReturn

import yaml

from .prerequisites import missing

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
RULE_FILES = sorted((DEPLOY / "prometheus").glob("*.rules.yml"))
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "prefixscore.json"
TOOLS = Path(os.environ.get("PREFIXSCORE_TOOLS") or Path.home() / ".cache" / "prefixscore" / "tools")
INSTALL_HINT = "run `bash .ci/deploy-tools.sh`"
# Oldest Kubernetes minor we support (GKE's oldest in standard support) and the newest schema set.
K8S_VERSIONS = ("1.31.0", "latest")

# The command the image's ENTRYPOINT runs and the end-to-end test starts.
SERVE_COMMAND = ("prefixscore", "serve")


def deploy_tool_missing(what: str) -> NoReturn:
    """A tool or package `.ci/deploy-tools.sh` installs is absent: skip locally, fail in CI."""
    missing(what, INSTALL_HINT)


def tool(name: str) -> str:
    """Path of an external tool: $PREFIXSCORE_<NAME>, the tools dir, the venv's bin, then PATH."""
    override = os.environ.get(f"PREFIXSCORE_{name.upper()}")
    candidates = [override] if override else []
    candidates += [str(TOOLS / "bin" / name), str(Path(sys.executable).parent / name), shutil.which(name)]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK) and Path(candidate).is_file():
            return candidate
    deploy_tool_missing(f"`{name}`")


def run(cmd: list[str], timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)


# ---- rendered manifests ----------------------------------------------------------------
def kustomize(path: Path) -> list[dict]:
    """`kubectl kustomize PATH`: the documents it renders."""
    result = run([tool("kubectl"), "kustomize", str(path)])
    assert result.returncode == 0, f"kubectl kustomize {path} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def kv():
    """The kubernetes_validate module (the Kubernetes JSON schemas)."""
    try:
        import kubernetes_validate
    except ImportError:
        deploy_tool_missing("the kubernetes-validate package")
    return kubernetes_validate


def versions(kubernetes_validate) -> list[str]:
    """K8S_VERSIONS with "latest" resolved to the newest schema set the package has."""
    return [kubernetes_validate.utils.latest_version() if v == "latest" else v for v in K8S_VERSIONS]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str) -> dict:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


# ---- metric names in PromQL ----------------------------------------------------------
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_IDENT = re.compile(r"(?<![A-Za-z0-9_:$])[A-Za-z_:][A-Za-z0-9_:]*")


def referenced_series(expr: str) -> set[str]:
    """Metric (and recorded series) names in a PromQL expression: identifiers that start with
    `prefixscore_` or `prefixscore:` outside strings, label matchers and range brackets."""
    text = _STRINGS.sub('""', expr)
    text = _MATCHERS.sub("{}", text)
    text = _RANGES.sub("[]", text)
    return {m for m in _IDENT.findall(text) if m.startswith(("prefixscore_", "prefixscore:"))}


def sample_names(exposition: str) -> set[str]:
    """Every sample name a Prometheus text exposition declares or carries: from its TYPE lines
    (counter -> _total, histogram -> _bucket/_sum/_count, info -> _info, ...) and its samples.
    Labeled metrics that have not been observed yet still count (they are declared)."""
    suffixes = {
        "counter": ("_total", "_created"),
        "gauge": ("",),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "summary": ("", "_sum", "_count", "_created"),
        "info": ("_info",),
        "untyped": ("",),
    }
    names: set[str] = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(None, 3)
            kind = kind.strip()
            base = name[: -len("_total")] if kind == "counter" and name.endswith("_total") else name
            base = base[: -len("_info")] if kind == "info" and base.endswith("_info") else base
            names.update(base + s for s in suffixes.get(kind, ("",)))
            if kind == "gauge" and name.endswith("_info"):  # prometheus_client's Info in 0.0.4 text
                names.add(name)
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


def metric_types(exposition: str) -> dict[str, str]:
    out = {}
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(None, 3)
            out[name] = kind.strip()
    return out


def service_exposition() -> str:
    """The exposition of a fresh ServiceMetrics registry (every metric declared, none observed)."""
    from prometheus_client import generate_latest

    from prefixscore.telemetry.metrics import ServiceMetrics

    return generate_latest(ServiceMetrics().registry).decode()


# ---- rules and dashboard -------------------------------------------------------------
def load_rules() -> list[dict]:
    rules = []
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                rules.append({**rule, "_file": path.name, "_group": group["name"]})
    return rules


def load_dashboard() -> dict:
    import json

    return json.loads(DASHBOARD.read_text())


def dashboard_panels(dashboard: dict) -> Iterable[dict]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title / refId, expr) for every query target of every panel."""
    out = []
    for panel in dashboard_panels(dashboard):
        for target in panel.get("targets", []):
            out.append((f"{panel['title']} / {target['refId']}", target["expr"]))
    return out


def substitute_grafana(expr: str, variables: dict[str, str]) -> str:
    """Replace Grafana's built-in and dashboard variables ($x, ${x}, [[x]]) for a Prometheus query."""
    builtins = {
        "__rate_interval": "1m",
        "__interval": "15s",
        "__range": "5m",
        "__range_s": "300",
        "__interval_ms": "15000",
        "__scrape_interval": "15s",
    }
    values = {**builtins, **variables}
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", values[name]).replace("[[" + name + "]]", values[name])
        expr = re.sub(r"\$" + re.escape(name) + r"(?![A-Za-z0-9_])", values[name], expr)
    leftover = re.findall(r"\$\{?\w+|\[\[\w+\]\]", expr)
    assert not leftover, f"unsubstituted Grafana variables {leftover} in {expr}"
    return expr


_COMPARISON = re.compile(r"(==|!=|>=|<=|(?<![=!~])>|(?<![=!~])<)(?!\s*bool\b)(?![=~])")


def with_bool(expr: str) -> str:
    """An alert expression with every comparison turned into its `bool` form, so it returns a
    0/1 sample for every series it would compare (data whether or not the alert fires).
    Only comparisons outside strings, label matchers and range brackets are touched."""
    out, pos = [], 0
    protected = sorted([m.span() for rx in (_STRINGS, _MATCHERS, _RANGES) for m in rx.finditer(expr)])
    for start, end in protected + [(len(expr), len(expr))]:
        if start < pos:
            continue
        out.append(_COMPARISON.sub(lambda m: f"{m.group(1)} bool ", expr[pos:start]))
        out.append(expr[start:end])
        pos = end
    return "".join(out)


def closed(schema: Any) -> Any:
    """An OpenAPI object schema as the API server applies it: an object with properties knows
    only those (unknown fields are pruned, or rejected with strict field validation)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out
