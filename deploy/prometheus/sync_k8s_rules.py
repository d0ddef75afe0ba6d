"""Write the rule files of deploy/prometheus/ as Kubernetes resources, so one source of rules
serves plain Prometheus, the Prometheus Operator (PrometheusRule) and Google Managed
Prometheus (Rules). tests/test_deploy_k8s.py fails when the generated files are stale.

    python deploy/prometheus/sync_k8s_rules.py          # rewrite
    python deploy/prometheus/sync_k8s_rules.py --check  # exit 1 if stale
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
COMPONENTS = HERE.parent / "k8s" / "components"
RULE_FILES = ("prefixscore-recording.rules.yml", "prefixscore-alerts.rules.yml")
GMP_INTERVAL = "30s"  # GMP's Rules require an evaluation interval per group
HEADER = "# Generated from deploy/prometheus/*.rules.yml by deploy/prometheus/sync_k8s_rules.py: do not edit.\n"


class _Dumper(yaml.SafeDumper):
    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        return super().increase_indent(flow, False)  # indent list items under their key


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def groups() -> list[dict]:
    out = []
    for name in RULE_FILES:
        out += yaml.safe_load((HERE / name).read_text())["groups"]
    return out


def resources() -> dict[Path, dict]:
    labels = {"app.kubernetes.io/name": "prefixscore"}
    return {
        COMPONENTS / "prometheus-operator" / "prometheusrule.yaml": {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "PrometheusRule",
            # kube-prometheus-stack selects rules by its release label; change to your release name.
            "metadata": {"name": "prefixscore", "labels": {**labels, "release": "kube-prometheus-stack"}},
            "spec": {"groups": groups()},
        },
        COMPONENTS / "gmp" / "rules.yaml": {
            "apiVersion": "monitoring.googleapis.com/v1",
            "kind": "Rules",
            "metadata": {"name": "prefixscore", "labels": labels},
            "spec": {"groups": [{"name": g["name"], "interval": GMP_INTERVAL, "rules": g["rules"]} for g in groups()]},
        },
    }


def render(doc: dict) -> str:
    return HEADER + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=120, allow_unicode=True)


def main(argv: list[str]) -> int:
    stale = []
    for path, doc in resources().items():
        text = render(doc)
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path)
        if "--check" not in argv:
            path.write_text(text)
    for path in stale:
        print(f"{'stale' if '--check' in argv else 'wrote'}: {path}")
    return 1 if stale and "--check" in argv else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
