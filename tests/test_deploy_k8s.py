"""deploy/k8s: every overlay renders with `kubectl kustomize`, validates against the Kubernetes
JSON schemas (strict: unknown fields fail) for the oldest and newest Kubernetes versions we
target, its CRDs (PodMonitoring, ServiceMonitor) carry only known fields of the right types,
and the manifests keep the contract with the server (ports, health service names, env, drain)."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from helpers.deploy import (
    K8S,
    TOOLS,
    by_kind,
    deploy_tool_missing,
    kustomize,
    kv,
    metric_types,
    one,
    run,
    service_exposition,
    tool,
    versions,
)
from helpers.prerequisites import in_ci

OVERLAYS = [
    "tpu-v6e-1x1",
    "tpu-v6e-2x2",
    "tpu-v6e-2x4",
    "tpu-v5e-2x2",
    "tpu-v5e-2x4",
    "tpu-v5e-1x1-int8",
    "gpu",
    "gpu-x8",
    "cpu",
    "local",
]
# Overlays with no Deployment (a LeaderWorkerSet instead): tests/test_deploy_lws.py checks them.
LWS_OVERLAYS = ["tpu-v5e-4x4-multihost"]
# accelerator label value, topology, chips (single-host slices)
TPU = {
    "tpu-v6e-1x1": ("tpu-v6e-slice", "1x1", 1),
    "tpu-v6e-2x2": ("tpu-v6e-slice", "2x2", 4),
    "tpu-v6e-2x4": ("tpu-v6e-slice", "2x4", 8),
    "tpu-v5e-2x2": ("tpu-v5-lite-podslice", "2x2", 4),
    "tpu-v5e-2x4": ("tpu-v5-lite-podslice", "2x4", 8),
    "tpu-v5e-1x1-int8": ("tpu-v5-lite-podslice", "1x1", 1),
}
# the mesh an overlay pins (tp, dp): an 8B model split over a v5e slice, a small one data parallel
MESHES = {"tpu-v5e-2x2": ("4", "1"), "tpu-v5e-2x4": ("8", "1"), "tpu-v6e-2x2": ("1", "4")}
HEALTH_SERVICE = "prefixscore.v1.ScoreService"
GRPC_PORT, HTTP_PORT, METRICS_PORT = 50051, 8080, 9090
GKE_QUEUE_METRIC = "prometheus.googleapis.com|prefixscore_queue_depth|gauge"


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: kustomize(K8S / "overlays" / name) for name in OVERLAYS}


@pytest.fixture(scope="module")
def extra_renders(tmp_path_factory) -> dict[str, list[dict]]:
    """Component combinations no overlay uses: the Prometheus Operator flavour on GKE TPU, and the
    persistent compile cache."""
    combos = {
        "base+prometheus-operator": ("../base", ["prometheus-operator"]),
        "tpu-v6e-1x1+compile-cache-pvc": ("../overlays/tpu-v6e-1x1", ["compile-cache-pvc"]),
        "base+gmp": ("../base", ["gmp"]),
        "tpu-v6e-2x2+models-gcsfuse": ("../overlays/tpu-v6e-2x2", ["models-gcsfuse"]),
        "base+tls-auth": ("../base", ["tls-auth"]),
    }
    out = {}
    root = tmp_path_factory.mktemp("kustomize")
    for name, (resource, components) in combos.items():
        # kustomize resolves paths relative to the kustomization: place it next to deploy/k8s/*
        # through a symlinked tree in the temp dir.
        work = root / name
        work.mkdir()
        (work / "k8s").symlink_to(K8S)
        overlay = work / "combo"
        overlay.mkdir()
        (overlay / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kustomize.config.k8s.io/v1beta1",
                    "kind": "Kustomization",
                    "resources": [f"../k8s/{resource.removeprefix('../')}"],
                    "components": [f"../k8s/components/{c}" for c in components],
                }
            )
        )
        out[name] = kustomize(overlay)
    return out


def container(docs: list[dict]) -> dict:
    containers = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["prefixscore"]
    return containers[0]


def config(docs: list[dict]) -> dict[str, str]:
    deployment = one(docs, "Deployment")
    names = [src["configMapRef"]["name"] for src in container(docs).get("envFrom", [])]
    data = {}
    for cm in by_kind(docs, "ConfigMap"):
        if cm["metadata"]["name"] in names:
            data.update(cm["data"])
    assert data, f"{deployment['metadata']['name']}: no ConfigMap env"
    return data


# ---- rendering and schemas -----------------------------------------------------------
def test_every_overlay_exists_and_renders(rendered):
    assert sorted(p.name for p in (K8S / "overlays").iterdir() if p.is_dir()) == sorted(OVERLAYS + LWS_OVERLAYS)
    for name, docs in rendered.items():
        kinds = sorted(d["kind"] for d in docs)
        for kind in ("ConfigMap", "Deployment", "PodDisruptionBudget", "Service", "ServiceAccount"):
            assert kind in kinds, f"{name}: no {kind}"
        assert len(by_kind(docs, "Service")) == 2, name


def test_core_resources_validate_against_kubernetes_schemas(rendered, extra_renders):
    kubernetes_validate = kv()
    checked = 0
    for name, docs in {**rendered, **extra_renders}.items():
        for doc in docs:
            if doc["apiVersion"].startswith("monitoring."):
                continue  # CRDs: test_crds_*
            for version in versions(kubernetes_validate):
                try:
                    kubernetes_validate.validate(doc, version, strict=True)
                except kubernetes_validate.ValidationError as err:
                    pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']} invalid for {version}: {err}")
                checked += 1
    assert checked > 50


def test_schema_validation_catches_mistakes(rendered):
    """The validator is strict: a misspelt field or a wrong type fails (so the test above means something)."""
    kubernetes_validate = kv()
    deployment = one(rendered["tpu-v6e-1x1"], "Deployment")
    typo = copy.deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["grpc"]["servce"] = "x"
    wrong_type = copy.deepcopy(deployment)
    wrong_type["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "120"
    for bad in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, versions(kubernetes_validate)[-1], strict=True)


# ---- CRDs ----------------------------------------------------------------------------
def _obj(props: dict, required: tuple = ()) -> dict:
    return {"type": "object", "additionalProperties": False, "properties": props, "required": list(required)}


_STR = {"type": "string"}
_DURATION = {"type": "string", "pattern": r"^((\d+)(ms|s|m|h|d|w|y))+$"}
_LABEL_SELECTOR = _obj(
    {
        "matchLabels": {"type": "object", "additionalProperties": _STR},
        "matchExpressions": {
            "type": "array",
            "items": _obj(
                {
                    "key": _STR,
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": {"type": "array", "items": _STR},
                },
                ("key", "operator"),
            ),
        },
    }
)
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": _STR, "namespace": _STR, "labels": {"type": "object"}},
}
_RELABEL = _obj(
    {
        "action": {
            "enum": [
                "replace",
                "lowercase",
                "uppercase",
                "keep",
                "drop",
                "keepequal",
                "dropequal",
                "hashmod",
                "labeldrop",
                "labelkeep",
                "labelmap",
            ]
        },
        "sourceLabels": {"type": "array", "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}},
        "separator": _STR,
        "targetLabel": _STR,
        "regex": _STR,
        "modulus": {"type": "integer"},
        "replacement": _STR,
    }
)
# Field lists of the CRDs (GMP monitoring.googleapis.com/v1 PodMonitoring; Prometheus Operator
# monitoring.coreos.com/v1 ServiceMonitor), limited to what a scrape of prefixscore may use;
# unknown fields are errors, as with `kubectl apply --validate=strict`.
POD_MONITORING = _obj(
    {
        "apiVersion": {"const": "monitoring.googleapis.com/v1"},
        "kind": {"const": "PodMonitoring"},
        "metadata": _METADATA,
        "spec": _obj(
            {
                "selector": _LABEL_SELECTOR,
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 10,
                    "items": _obj(
                        {
                            "port": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "string", "minLength": 1}]},
                            "scheme": {"enum": ["http", "https"]},
                            "path": _STR,
                            "interval": _DURATION,
                            "timeout": _DURATION,
                            "params": {"type": "object"},
                            "metricRelabeling": {"type": "array", "items": _RELABEL},
                            "proxyUrl": _STR,
                        },
                        ("port", "interval"),
                    ),
                },
                "targetLabels": _obj(
                    {
                        "metadata": {
                            "type": "array",
                            "items": {
                                "enum": [
                                    "container",
                                    "node",
                                    "pod",
                                    "top_level_controller_name",
                                    "top_level_controller_type",
                                ]
                            },
                        },
                        "fromPod": {
                            "type": "array",
                            "items": _obj(
                                {"from": _STR, "to": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}},
                                ("from",),
                            ),
                        },
                    }
                ),
                "limits": _obj(
                    {k: {"type": "integer"} for k in ("samples", "labels", "labelNameLength", "labelValueLength")}
                ),
                "filterRunning": {"type": "boolean"},
            },
            ("selector", "endpoints"),
        ),
    },
    ("apiVersion", "kind", "metadata", "spec"),
)
SERVICE_MONITOR = _obj(
    {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": _METADATA,
        "spec": _obj(
            {
                "selector": _LABEL_SELECTOR,
                "namespaceSelector": _obj({"any": {"type": "boolean"}, "matchNames": {"type": "array", "items": _STR}}),
                "jobLabel": _STR,
                "targetLabels": {"type": "array", "items": _STR},
                "podTargetLabels": {"type": "array", "items": _STR},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": _obj(
                        {
                            "port": _STR,
                            "targetPort": {"anyOf": [{"type": "integer"}, _STR]},
                            "path": _STR,
                            "scheme": {"enum": ["http", "https"]},
                            "interval": _DURATION,
                            "scrapeTimeout": _DURATION,
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {"type": "array", "items": _RELABEL},
                            "metricRelabelings": {"type": "array", "items": _RELABEL},
                        }
                    ),
                },
            },
            ("selector", "endpoints"),
        ),
    },
    ("apiVersion", "kind", "metadata", "spec"),
)

_RULE = _obj(
    {
        "record": _STR,
        "alert": _STR,
        "expr": {"type": "string", "minLength": 1},
        "for": _DURATION,
        "labels": {"type": "object", "additionalProperties": _STR},
        "annotations": {"type": "object", "additionalProperties": _STR},
    },
    ("expr",),
)
GMP_RULES = _obj(
    {
        "apiVersion": {"const": "monitoring.googleapis.com/v1"},
        "kind": {"const": "Rules"},
        "metadata": _METADATA,
        "spec": _obj(
            {
                "groups": {
                    "type": "array",
                    "minItems": 1,
                    "items": _obj(
                        {"name": _STR, "interval": _DURATION, "rules": {"type": "array", "items": _RULE}},
                        ("name", "interval", "rules"),
                    ),
                }
            },
            ("groups",),
        ),
    },
    ("apiVersion", "kind", "metadata", "spec"),
)

_OPERATOR_NODE = r"""
const path = require("path"); const {pathToFileURL} = require("url");
const load = (kind) =>
  import(pathToFileURL(path.join(process.env.PROMOP, "monitoring.coreos.com", "v1", kind + ".js")).href);
Promise.all([load("ServiceMonitor"), load("PrometheusRule")]).then(([sm, pr]) => {
  const models = {ServiceMonitor: sm.ServiceMonitor, PrometheusRule: pr.PrometheusRule};
  const docs = JSON.parse(require("fs").readFileSync(0, "utf8"));
  let bad = 0;
  for (const d of docs) {
    try { new models[d.kind](d).validate(); }
    catch (e) { bad++; console.log(d.kind + "/" + d.metadata.name + ": " + e.message); }
  }
  process.exit(bad ? 1 : 0);
});
"""


def monitors(renders: dict[str, list[dict]], kind: str) -> list[tuple[str, dict]]:
    return [(name, d) for name, docs in renders.items() for d in by_kind(docs, kind)]


def test_crds_podmonitoring_and_servicemonitor_fields(rendered, extra_renders):
    import jsonschema

    renders = {**rendered, **extra_renders}
    pms, sms = monitors(renders, "PodMonitoring"), monitors(renders, "ServiceMonitor")
    assert pms and sms, "both GMP PodMonitoring and Prometheus Operator ServiceMonitor must be shipped"
    for schema, found in ((POD_MONITORING, pms), (SERVICE_MONITOR, sms)):
        for name, doc in found:
            errors = [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(doc)]
            assert not errors, f"{name}: {doc['kind']}: {errors}"
    # the structural schemas do reject what the CRDs reject
    bad = copy.deepcopy(pms[0][1])
    bad["spec"]["endpoints"][0]["intervall"] = "15s"
    assert list(jsonschema.Draft202012Validator(POD_MONITORING).iter_errors(bad))


def test_crds_against_the_prometheus_operator_schemas(rendered, extra_renders):
    """ServiceMonitor and PrometheusRule against the Prometheus Operator's own CRD schemas
    (npm @kubernetes-models/prometheus-operator, run by node)."""
    package = TOOLS / "deploy-node" / "node_modules" / "@kubernetes-models" / "prometheus-operator"
    if not package.is_dir():
        deploy_tool_missing(f"{package}")
    node = tool("node")
    renders = {**rendered, **extra_renders}
    docs = [d for _, d in monitors(renders, "ServiceMonitor") + monitors(renders, "PrometheusRule")]
    assert {d["kind"] for d in docs} == {"ServiceMonitor", "PrometheusRule"}
    env = {**os.environ, "PROMOP": str(package)}
    result = run([node, "-e", _OPERATOR_NODE], input=json.dumps(docs), env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    bad = copy.deepcopy(docs[0])
    bad["spec"]["endpoints"][0]["interval"] = 15
    result = run([node, "-e", _OPERATOR_NODE], input=json.dumps([bad]), env=env)
    assert result.returncode == 1, "the operator schema should reject a numeric interval"


def test_rule_resources_match_the_rule_files(rendered):
    """GMP Rules and the operator's PrometheusRule carry exactly deploy/prometheus/*.rules.yml."""
    from helpers.deploy import DEPLOY, load_rules

    result = run([sys.executable, str(DEPLOY / "prometheus" / "sync_k8s_rules.py"), "--check"])
    assert result.returncode == 0, f"stale: run python deploy/prometheus/sync_k8s_rules.py\n{result.stdout}"
    import jsonschema

    def key(rule: dict) -> str:
        return rule.get("record") or rule["alert"]

    strip = sorted(({k: v for k, v in r.items() if not k.startswith("_")} for r in load_rules()), key=key)
    for name, kind, schema in (("tpu-v6e-1x1", "Rules", GMP_RULES), ("cpu", "PrometheusRule", None)):
        doc = one(rendered[name], kind)
        assert sorted((r for g in doc["spec"]["groups"] for r in g["rules"]), key=key) == strip, f"{name}: {kind}"
        if schema:
            errors = [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(doc)]
            assert not errors, f"{name}: {kind}: {errors}"


# ---- the contract with the server ----------------------------------------------------
def test_pod_runs_the_server_with_its_contract(rendered):
    from prefixscore.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = {a.dest.upper() for a in serve._actions}
    for name, docs in rendered.items():
        c = container(docs)
        pod = one(docs, "Deployment")["spec"]["template"]["spec"]
        env = config(docs)
        assert "command" not in c and "args" not in c, f"{name}: the image's entrypoint (prefixscore serve) runs"
        for key in env:
            if key.startswith("PREFIXSCORE_") and key not in ("PREFIXSCORE_CACHE", "PREFIXSCORE_COMPILE_CACHE_DIR"):
                assert key.removeprefix("PREFIXSCORE_") in flags, f"{name}: {key} is no `serve` flag"
        assert env["PREFIXSCORE_PORT"] == str(GRPC_PORT) and env["PREFIXSCORE_METRICS_PORT"] == str(METRICS_PORT)
        assert env["PREFIXSCORE_HOST"] == "0.0.0.0"
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"grpc": GRPC_PORT, "http": HTTP_PORT, "metrics": METRICS_PORT}, name
        assert env["PREFIXSCORE_HTTP_PORT"] == str(HTTP_PORT)

        # native gRPC probes on the health service; start-up allows minutes of compilation
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert set(c[probe]) & {"grpc", "httpGet", "exec", "tcpSocket"} == {"grpc"}, f"{name}: {probe}"
            assert c[probe]["grpc"]["port"] == GRPC_PORT
        assert c["startupProbe"]["grpc"]["service"] == HEALTH_SERVICE
        assert c["readinessProbe"]["grpc"]["service"] == HEALTH_SERVICE
        assert c["livenessProbe"]["grpc"]["service"] == ""
        startup = c["startupProbe"]
        budget = startup["periodSeconds"] * startup["failureThreshold"]
        assert budget >= (1800 if name.startswith("tpu") else 600), f"{name}: start-up budget {budget}s"

        # graceful termination outlasts preStop + the server's drain
        pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        drain = float(env.get("PREFIXSCORE_DRAIN_SECONDS", serve.get_default("drain_seconds")))
        assert pod["terminationGracePeriodSeconds"] > int(pre_stop[1]) + drain + 10, name
        # a liveness failure must not kill a draining pod before its grace period would
        live = c["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] >= drain, name

        # non-root, weights from a read-only volume, compile cache on a writable volume
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert mounts["/models"].get("readOnly") is True
        cache = env["PREFIXSCORE_COMPILE_CACHE_DIR"]
        assert any(cache.startswith(p + "/") and not m.get("readOnly") for p, m in mounts.items()), cache
        assert "/tmp" in mounts
        volumes = {v["name"] for v in pod["volumes"]}
        assert {m["name"] for m in c["volumeMounts"]} <= volumes
        assert set(c["resources"]["requests"]) >= {"cpu", "memory"}


def test_tpu_overlays_select_the_slice_and_request_every_chip(rendered):
    for name, (accelerator, topology, chips) in TPU.items():
        docs = rendered[name]
        pod = one(docs, "Deployment")["spec"]["template"]["spec"]
        assert pod["nodeSelector"] == {
            "cloud.google.com/gke-tpu-accelerator": accelerator,
            "cloud.google.com/gke-tpu-topology": topology,
        }, name
        resources = container(docs)["resources"]
        assert resources["requests"]["google.com/tpu"] == resources["limits"]["google.com/tpu"] == str(chips), name
        assert {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert container(docs)["image"].endswith(":tpu")
        assert config(docs)["PREFIXSCORE_DTYPE"] == "bfloat16"


def test_int8_overlay_quantizes_and_only_it(rendered):
    """The single-chip v5e overlay serves an 8B model in int8 (four chips in bfloat16); no other
    overlay quantizes: a full-precision model stays full precision unless an overlay says so."""
    assert config(rendered["tpu-v5e-1x1-int8"])["PREFIXSCORE_QUANTIZE"] == "int8"
    for name in set(OVERLAYS) - {"tpu-v5e-1x1-int8"}:
        assert "PREFIXSCORE_QUANTIZE" not in config(rendered[name]), name


def test_overlay_meshes_use_every_chip(rendered):
    """An overlay that pins the mesh pins one that uses the whole slice (tp x dp = chips)."""
    for name, (tp, dp) in MESHES.items():
        env = config(rendered[name])
        assert (env["PREFIXSCORE_TP_SIZE"], env["PREFIXSCORE_DP_SIZE"]) == (tp, dp), name
        assert int(tp) * int(dp) == TPU[name][2], name
    for name in set(OVERLAYS) - set(MESHES):  # the others: chosen at start-up from the model
        assert "PREFIXSCORE_TP_SIZE" not in config(rendered[name]), name


def test_gpu_and_cpu_overlays(rendered):
    for name, gpus in (("gpu", "1"), ("gpu-x8", "8")):
        gpu = rendered[name]
        resources = container(gpu)["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == gpus
        assert "cloud.google.com/gke-accelerator" in one(gpu, "Deployment")["spec"]["template"]["spec"]["nodeSelector"]
        assert container(gpu)["image"].endswith(":gpu")
    for name in ("cpu", "local"):
        r = container(rendered[name])["resources"]
        assert not {"google.com/tpu", "nvidia.com/gpu"} & (set(r["requests"]) | set(r.get("limits", {})))
    assert config(rendered["local"])["PREFIXSCORE_MODEL"] == "smollm2-135m"


def test_services_pdb_and_monitors_select_the_pods(rendered, extra_renders):
    for name, docs in {**rendered, **extra_renders}.items():
        deployment = one(docs, "Deployment")
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        services = {s["spec"].get("clusterIP") == "None": s for s in by_kind(docs, "Service")}
        assert set(services) == {True, False}, f"{name}: one headless and one regular Service"
        for svc in services.values():
            assert svc["spec"]["selector"].items() <= labels.items(), name
            assert {p["targetPort"] for p in svc["spec"]["ports"]} <= {"grpc", "http", "metrics"}
        assert services[True]["spec"].get("publishNotReadyAddresses", False) is False
        assert "metrics" in {p["name"] for p in services[False]["spec"]["ports"]}
        pdb = one(docs, "PodDisruptionBudget")
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
        for pm in by_kind(docs, "PodMonitoring"):
            assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
            assert {e["port"] for e in pm["spec"]["endpoints"]} == {"metrics"}
        for sm in by_kind(docs, "ServiceMonitor"):
            selected = [
                s
                for s in services.values()
                if sm["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
            ]
            assert selected == [services[False]], f"{name}: the ServiceMonitor scrapes the regular Service only"
            assert {e["port"] for e in sm["spec"]["endpoints"]} == {"metrics"}


def test_hpa_scales_on_the_exported_queue_depth_gauge(rendered, extra_renders):
    types = metric_types(service_exposition())
    assert types.get("prefixscore_queue_depth") == "gauge"
    seen = set()
    for name, docs in {**rendered, **extra_renders}.items():
        for hpa in by_kind(docs, "HorizontalPodAutoscaler"):
            ref = hpa["spec"]["scaleTargetRef"]
            assert (ref["kind"], ref["name"]) == ("Deployment", one(docs, "Deployment")["metadata"]["name"])
            (metric,) = hpa["spec"]["metrics"]
            assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
            metric_name = metric["pods"]["metric"]["name"]
            assert metric_name in ("prefixscore_queue_depth", GKE_QUEUE_METRIC), f"{name}: {metric_name}"
            if by_kind(docs, "PodMonitoring"):
                assert metric_name == GKE_QUEUE_METRIC, f"{name}: GMP is read through the GKE adapter naming"
            if by_kind(docs, "ServiceMonitor"):
                assert metric_name == "prefixscore_queue_depth", name
            seen.add(metric_name)
    assert seen == {"prefixscore_queue_depth", GKE_QUEUE_METRIC}


def test_ci_installs_the_tools():
    """Sanity of the install script the CI calls (the tools are found where it puts them)."""
    script = Path(__file__).resolve().parents[1] / ".ci" / "deploy-tools.sh"
    assert script.is_file()
    if in_ci():
        assert (TOOLS / "bin" / "kubectl").is_file() or os.environ.get("PREFIXSCORE_KUBECTL")


YAMLLINT = (
    "{extends: default, rules: {line-length: {max: 200}, document-start: disable, "
    "truthy: {check-keys: false}, comments: {min-spaces-from-content: 1}}}"
)


def test_yaml_and_json_are_clean():
    try:
        import yamllint  # noqa: F401
    except ImportError:
        deploy_tool_missing("the yamllint package")
    deploy = K8S.parent
    result = run([sys.executable, "-m", "yamllint", "--strict", "-d", YAMLLINT, str(deploy)])
    assert result.returncode == 0, result.stdout + result.stderr
    for path in deploy.rglob("*.json"):
        json.loads(path.read_text())


def test_tls_auth_component_mounts_the_secrets_and_probes_the_admin_port(extra_renders):
    """TLS files and tokens from Secrets (mounted whole, so rotations reach the server), their
    paths handed to `serve` flags, and probes on the plaintext admin port (no kubelet TLS)."""
    from prefixscore.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = {a.dest.upper() for a in serve._actions}
    docs = extra_renders["base+tls-auth"]
    c = container(docs)
    env = config(docs)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    assert secrets == {"tls": "prefixscore-tls", "auth-tokens": "prefixscore-auth-tokens"}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    for volume, key in (
        ("tls", "TLS_CERT"),
        ("tls", "TLS_KEY"),
        ("tls", "TLS_CLIENT_CA"),
        ("auth-tokens", "AUTH_TOKENS_FILE"),
    ):
        assert key in flags
        path = env[f"PREFIXSCORE_{key}"]
        assert path.startswith(mounts[volume]["mountPath"] + "/") and mounts[volume]["readOnly"] is True
        assert "subPath" not in mounts[volume]  # a subPath mount never sees a rotated file
    for probe, path in (("startupProbe", "/ready"), ("readinessProbe", "/ready"), ("livenessProbe", "/health")):
        assert "grpc" not in c[probe] and c[probe]["httpGet"] == {"path": path, "port": "metrics"}
    # the pod's group can read the secret files (0440 with fsGroup)
    assert all(v["secret"]["defaultMode"] == 0o440 for v in pod["volumes"] if "secret" in v)
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
