"""The mesh and gateway alternatives to the Envoy component (deploy/k8s/components/prefix-affinity):
istio-affinity (an Istio / Cloud Service Mesh DestinationRule), inference-gateway (the Gateway API
Inference Extension: InferencePool, HTTPRoute, endpoint picker) and inference-gateway-gke (GKE's
Gateway and policies). They render beside the cpu overlay, and every object validates strictly,
unknown fields failing:

- Kubernetes kinds: the Kubernetes JSON schemas (kubernetes-validate), as tests/test_deploy_k8s.py;
- DestinationRule, Gateway, HTTPRoute: the CRDs' own schemas as compiled by the npm packages
  @kubernetes-models/istio and @kubernetes-models/gateway-api (run by node). Their validators do
  not reject unknown fields (CRD schemas leave that to the API server), so the object is handed to
  them behind a proxy that records which fields the schema reads: a field it never reads is one
  the schema does not know;
- InferencePool: the upstream CRD's OpenAPI schema (tests/data/crds, its source named there),
  closed the way the API server prunes (an object schema knows only its properties), with its
  two CEL rules checked in Python;
- the endpoint picker's EndpointPickerConfig: no schema is published. Checked here: the fields of
  its Go types and of the parameters of the plugins it uses (llm-d-router v0.10.0, which decodes
  both strictly), that every reference names a defined plugin, and what it reads from our server;
- GKE's HealthCheckPolicy and GCPBackendPolicy: no schema is published either; their fields are
  checked against lists limited to what these manifests may use (as test_deploy_k8s.py does for
  PodMonitoring).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.deploy import (
    K8S,
    TOOLS,
    by_kind,
    closed,
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

from prefixscore import prefix_key

HERE = Path(__file__).resolve().parent
INFERENCEPOOL_CRD = HERE / "data" / "crds" / "inference.networking.k8s.io_inferencepools.yaml"
MODELS = TOOLS / "deploy-node" / "node_modules" / "@kubernetes-models"
# What the endpoint picker reads from every replica (telemetry/metrics.py): the model-server
# protocol's queue, running requests, KV-cache utilization and cache-config info.
EPP_METRICS = {
    "queuedRequestsSpec": "prefixscore_queued_requests",
    "runningRequestsSpec": "prefixscore_running_requests",
    "kvUsageSpec": "prefixscore_prefix_pool_usage_ratio",
    "cacheInfoSpec": "prefixscore_prefix_pool_info",
}
SCORING_PATHS = {"/v1/score", "/v1/rerank", "/v2/rerank", "/rerank"}
GRPC_PORT, HTTP_PORT, METRICS_PORT = 50051, 8080, 9090
SERVER_LABELS = {"app.kubernetes.io/name": "prefixscore", "app.kubernetes.io/component": "server"}
# (apiVersion, kind) -> the compiled schema's module in the npm packages
NODE_SCHEMAS = {
    ("networking.istio.io/v1", "DestinationRule"): "istio/_schemas/NetworkingIstioIoV1DestinationRule.js",
    ("gateway.networking.k8s.io/v1", "Gateway"): "gateway-api/_schemas/IoK8sSigsGatewayApiApisV1Gateway.js",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "gateway-api/_schemas/IoK8sSigsGatewayApiApisV1HTTPRoute.js",
}


# ---- rendering ----------------------------------------------------------------------------
def render(root: Path, components: list[str]) -> list[dict]:
    """The cpu overlay with `components`, in the overlay's namespace, as a user's overlay that
    lists them would render (a temp kustomization beside a symlink to deploy/k8s)."""
    (root / "k8s").symlink_to(K8S)
    overlay = root / "combo"
    overlay.mkdir()
    namespace = yaml.safe_load((K8S / "overlays" / "cpu" / "kustomization.yaml").read_text())["namespace"]
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": namespace,
        "resources": ["../k8s/overlays/cpu"],
        "components": [f"../k8s/components/{c}" for c in components],
    }
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return kustomize(overlay)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory) -> list[dict]:
    return render(tmp_path_factory.mktemp("mesh"), ["istio-affinity"])


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> list[dict]:
    return render(tmp_path_factory.mktemp("gateway"), ["inference-gateway", "inference-gateway-gke"])


def added(docs: list[dict]) -> list[dict]:
    """What the components add to the cpu overlay (their objects only)."""
    kinds = {"DestinationRule", "Gateway", "HTTPRoute", "InferencePool", "HealthCheckPolicy", "GCPBackendPolicy"}
    ours = ("prefixscore-epp", "prefixscore-inference-gateway")  # the EPP's objects, the NetworkPolicy
    return [d for d in docs if d["kind"] in kinds or d["metadata"]["name"].startswith(ours)]


def named(docs: list[dict], kind: str, name: str) -> dict:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def epp_config(docs: list[dict]) -> dict:
    (configmap,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].startswith("prefixscore-epp-")]
    (text,) = configmap["data"].values()
    return yaml.safe_load(text)


def server_ports(docs: list[dict]) -> dict[str, int]:
    container = named(docs, "Deployment", "prefixscore")["spec"]["template"]["spec"]["containers"][0]
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def test_the_components_render_beside_an_overlay(mesh, gateway) -> None:
    mesh_kinds = sorted(d["kind"] for d in added(mesh))
    assert mesh_kinds == ["DestinationRule"]
    assert sorted(d["kind"] for d in added(gateway)) == sorted(
        ["ConfigMap", "Deployment", "GCPBackendPolicy", "Gateway", "HTTPRoute", "HealthCheckPolicy"]
        + ["InferencePool", "NetworkPolicy", "Role", "RoleBinding", "Service", "ServiceAccount"]
    )
    namespace = one(mesh, "DestinationRule")["metadata"]["namespace"]
    for doc in added(mesh) + added(gateway):
        assert doc["metadata"].get("namespace") == namespace, f"{doc['kind']}/{doc['metadata']['name']}"
    # the server's own objects are the overlay's, untouched
    assert server_ports(gateway) == {"grpc": GRPC_PORT, "http": HTTP_PORT, "metrics": METRICS_PORT}


# ---- Kubernetes kinds -----------------------------------------------------------------------
def test_kubernetes_objects_validate_strictly(gateway) -> None:
    validator = kv()
    kinds = {"ConfigMap", "Deployment", "NetworkPolicy", "Role", "RoleBinding", "Service", "ServiceAccount"}
    core = [d for d in added(gateway) if d["kind"] in kinds]
    assert len(core) == 7
    for doc in core:
        for version in versions(validator):
            try:
                validator.validate(doc, version, strict=True)
            except validator.ValidationError as err:
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} invalid for {version}: {err}")
    bad = copy.deepcopy(named(gateway, "Deployment", "prefixscore-epp"))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["servce"] = "x"
    with pytest.raises(validator.ValidationError):
        validator.validate(bad, versions(validator)[-1], strict=True)


# ---- Istio and Gateway API: the npm packages' compiled CRD schemas ----------------------------
_STRICT_NODE = r"""
const path = require("path"); const {pathToFileURL} = require("url");
// Wrap a document so that every field the validator reads is recorded, per object; an object the
// validator lists (a map: labels, annotations) accepts any key.
function watch(value, at, seen) {
  if (Array.isArray(value)) return value.map((v, i) => watch(v, at + "/" + i, seen));
  if (value === null || typeof value !== "object") return value;
  const entry = {read: new Set(), listed: false};
  seen.set(at, entry);
  const target = {};
  for (const k of Object.keys(value)) target[k] = watch(value[k], at + "/" + k, seen);
  return new Proxy(target, {
    get(t, k, r) { if (typeof k === "string") entry.read.add(k); return Reflect.get(t, k, r); },
    has(t, k) { if (typeof k === "string") entry.read.add(k); return Reflect.has(t, k); },
    ownKeys(t) { entry.listed = true; return Reflect.ownKeys(t); },
  });
}
function unread(value, at, seen, out) {
  if (Array.isArray(value)) { value.forEach((v, i) => unread(v, at + "/" + i, seen, out)); return; }
  if (value === null || typeof value !== "object") return;
  const entry = seen.get(at);
  for (const k of Object.keys(value)) {
    if (!entry.listed && !entry.read.has(k)) out.push(at + "/" + k);
    unread(value[k], at + "/" + k, seen, out);
  }
}
(async () => {
  let bad = 0;
  for (const {doc, schema} of JSON.parse(require("fs").readFileSync(0, "utf8"))) {
    const {validate} = await import(pathToFileURL(path.join(process.env.MODELS, schema)).href);
    const seen = new Map();
    const name = doc.kind + "/" + doc.metadata.name;
    if (!validate(watch(doc, "", seen))) {
      bad++;
      for (const e of validate.errors) {
        console.log(name + ": " + (e.instancePath || "/") + " " + e.keyword + " " + JSON.stringify(e.params));
      }
      continue;
    }
    const unknown = [];
    unread(doc, "", seen, unknown);
    if (unknown.length) { bad++; console.log(name + ": unknown fields " + unknown.join(", ")); }
  }
  process.exit(bad ? 1 : 0);
})();
"""


def node_validate(docs: list[dict]) -> tuple[bool, str]:
    """Validate `docs` with the npm packages' schemas (strict, see the module docstring)."""
    for package in ("istio", "gateway-api"):
        if not (MODELS / package).is_dir():
            deploy_tool_missing(f"{MODELS / package}")
    items = [{"doc": d, "schema": NODE_SCHEMAS[(d["apiVersion"], d["kind"])]} for d in docs]
    result = run([tool("node"), "-e", _STRICT_NODE], input=json.dumps(items), env={**os.environ, "MODELS": str(MODELS)})
    assert result.returncode in (0, 1), result.stdout + result.stderr
    return result.returncode == 0, result.stdout + result.stderr


def test_destinationrule_gateway_and_httproute_validate_strictly(mesh, gateway) -> None:
    docs = [d for d in added(mesh) + added(gateway) if (d["apiVersion"], d["kind"]) in NODE_SCHEMAS]
    assert sorted(d["kind"] for d in docs) == ["DestinationRule", "Gateway", "HTTPRoute"]
    ok, output = node_validate(docs)
    assert ok, output


@pytest.mark.parametrize(
    ("kind", "mistake", "reported"),
    [
        # an unknown field (a typo), at any depth
        ("DestinationRule", ("spec", "trafficPolicy", "loadBalancer", "consistentHash", "httpHeader"), "unknown"),
        ("HTTPRoute", ("spec", "rules", 0, "backendRefs", 0, "namespce"), "unknown"),
        ("Gateway", ("spec", "listeners", 0, "protocl"), "unknown"),
        ("HTTPRoute", ("metadata", "labelz"), "unknown"),
        # a wrong type or value
        ("DestinationRule", ("spec", "trafficPolicy", "outlierDetection", "interval"), "type"),
        ("HTTPRoute", ("spec", "rules", 0, "matches", 0, "path", "type"), "enum"),
    ],
)
def test_the_crd_schemas_reject_mistakes(mesh, gateway, kind: str, mistake: tuple, reported: str) -> None:
    doc = copy.deepcopy(one(added(mesh) + added(gateway), kind))
    *parents, leaf = mistake
    target: Any = doc
    for key in parents:
        target = target[key]
    target[leaf] = {"unknown": "x", "type": 5, "enum": "Prefix"}[reported]
    ok, output = node_validate([doc])
    assert not ok and reported in output, output


def test_the_mesh_hashes_on_the_prefix_key(mesh) -> None:
    """The DestinationRule hashes the Service the clients address on exactly the header the
    clients send and the server echoes, on a ring, and ejects failing replicas."""
    rule = one(mesh, "DestinationRule")
    service = named(mesh, "Service", "prefixscore")
    assert service["spec"].get("clusterIP") != "None"
    assert rule["spec"]["host"] == service["metadata"]["name"]
    assert rule["metadata"]["namespace"] == service["metadata"]["namespace"]
    policy = rule["spec"]["trafficPolicy"]
    assert "portLevelSettings" not in rule["spec"]["trafficPolicy"]  # one policy for gRPC and HTTP
    consistent = policy["loadBalancer"]["consistentHash"]
    assert consistent["httpHeaderName"] == prefix_key.HEADER
    assert consistent["ringHash"]["minimumRingSize"] >= 1024
    # Istio balances each request (not each connection) on ports it knows as gRPC or HTTP: by
    # their names, and their appProtocol
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["grpc"]["appProtocol"] == "kubernetes.io/h2c" and ports["http"]["appProtocol"] == "http"
    outliers = policy["outlierDetection"]
    assert outliers["consecutiveGatewayErrors"] > 0 and outliers["maxEjectionPercent"] <= 50


# ---- InferencePool: the upstream CRD's schema ----------------------------------------------------
def _port_when_service(ref: dict) -> bool:
    return ref.get("kind", "Service") != "Service" or "port" in ref


def _unique_numbers(ports: list[dict]) -> bool:
    numbers = [p["number"] for p in ports]
    return len(numbers) == len(set(numbers))


# The CRD's CEL rules (x-kubernetes-validations), which JSON Schema cannot express: each rule
# text, the schema path it sits on, and the same check in Python. A rule not listed here fails
# the test, so a newer CRD cannot add one unchecked.
CEL_RULES = {
    "self.kind != 'Service' || has(self.port)": (("spec", "endpointPickerRef"), _port_when_service),
    "self.all(p1, self.exists_one(p2, p1.number==p2.number))": (("spec", "targetPorts"), _unique_numbers),
}


def inferencepool_schema() -> dict:
    crd = yaml.safe_load(INFERENCEPOOL_CRD.read_text())
    assert crd["spec"]["group"] == "inference.networking.k8s.io" and crd["spec"]["names"]["kind"] == "InferencePool"
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


def cel_rules(schema: dict, at: tuple = ()) -> list[tuple[tuple, str]]:
    found = [(at, rule["rule"]) for rule in schema.get("x-kubernetes-validations", [])]
    for name, sub in schema.get("properties", {}).items():
        found += cel_rules(sub, (*at, name))
    if isinstance(schema.get("items"), dict):
        found += cel_rules(schema["items"], at)
    return found


def inferencepool_errors(doc: dict) -> list[str]:
    import jsonschema

    schema = inferencepool_schema()
    errors = [
        f"{list(e.absolute_path)}: {e.message}"
        for e in jsonschema.Draft202012Validator(closed(schema)).iter_errors(doc)
    ]
    if doc.get("apiVersion") != "inference.networking.k8s.io/v1" or doc.get("kind") != "InferencePool":
        errors.append(f"not an InferencePool v1: {doc.get('apiVersion')} {doc.get('kind')}")
    for at, rule in cel_rules(schema):
        assert rule in CEL_RULES, f"the CRD has a CEL rule this test does not check: {rule} at {at}"
        path, check = CEL_RULES[rule]
        assert at == path, (rule, at)
        value: Any = doc
        for key in at:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None and not check(value):
            errors.append(f"{'.'.join(at)}: {rule}")
    return errors


def test_the_inferencepool_validates_against_the_upstream_crd(gateway) -> None:
    pool = one(gateway, "InferencePool")
    assert not inferencepool_errors(pool)
    assert {rule for _, rule in cel_rules(inferencepool_schema())} == set(CEL_RULES)
    mistakes = []
    typo = copy.deepcopy(pool)
    typo["spec"]["targetPort"] = typo["spec"].pop("targetPorts")  # unknown field (and a required one gone)
    mistakes.append(typo)
    nested = copy.deepcopy(pool)
    nested["spec"]["endpointPickerRef"]["failuremode"] = "FailOpen"
    mistakes.append(nested)
    wrong_value = copy.deepcopy(pool)
    wrong_value["spec"]["appProtocol"] = "http2"
    mistakes.append(wrong_value)
    no_port = copy.deepcopy(pool)  # the CEL rule: a Service reference needs its port
    del no_port["spec"]["endpointPickerRef"]["port"]
    mistakes.append(no_port)
    duplicate = copy.deepcopy(pool)
    duplicate["spec"]["targetPorts"] *= 2
    mistakes.append(duplicate)
    for bad in mistakes:
        assert inferencepool_errors(bad), bad["spec"]


# ---- the endpoint picker -------------------------------------------------------------------------
def _obj(props: dict, required: tuple = ()) -> dict:
    return {"type": "object", "additionalProperties": False, "properties": props, "required": list(required)}


_STR = {"type": "string"}
_REF = _obj({"pluginRef": {"type": "string", "minLength": 1}}, ("pluginRef",))
_REFS = {"type": "array", "items": _REF}
# EndpointPickerConfig (llm-d-router v0.10.0, apix/config/v1alpha1/endpointpickerconfig_types.go):
# the fields of its Go types, as its strict decoder accepts them (the deprecated top-level
# `parser` and `saturationDetector` left out: this config must not use them).
EPP_CONFIG = _obj(
    {
        "apiVersion": {"const": "llm-d.ai/v1alpha1"},
        "kind": {"const": "EndpointPickerConfig"},
        "featureGates": {"type": "array", "items": _STR},
        "plugins": {
            "type": "array",
            "minItems": 1,
            "items": _obj({"name": _STR, "type": {"type": "string", "minLength": 1}, "parameters": {}}, ("type",)),
        },
        "schedulingProfiles": {
            "type": "array",
            "items": _obj(
                {
                    "name": {"type": "string", "minLength": 1},
                    "plugins": {
                        "type": "array",
                        "items": _obj(
                            {"pluginRef": {"type": "string", "minLength": 1}, "weight": {"type": "number"}},
                            ("pluginRef",),
                        ),
                    },
                },
                ("name",),
            ),
        },
        "dataLayer": _obj(
            {
                "injectDefaults": {"type": "boolean"},
                "sources": {"type": "array", "items": _obj({"pluginRef": _STR, "extractors": _REFS}, ("pluginRef",))},
                "discovery": _REF,
                "crossReplicaSyncerPluginRef": _STR,
                "crossReplicaSyncInterval": _STR,
            }
        ),
        "flowControl": {"type": "object"},
        "requestHandler": _obj({"parsers": _REFS}),
    },
    ("apiVersion", "kind", "plugins"),
)
_DURATION = {"type": "string", "pattern": r"^([0-9]+(\.[0-9]+)?(ns|us|ms|s|m|h))+$"}
# The parameters of the plugin types this config may use (their factories' parameter structs in
# llm-d-router v0.10.0, decoded with unknown fields disallowed); None: the plugin takes none. A
# type not listed fails the test: add its parameters from upstream first.
PLUGIN_PARAMETERS: dict[str, dict | None] = {
    "passthrough-parser": None,
    "queue-scorer": None,
    "kv-cache-utilization-scorer": None,
    "single-profile-handler": None,
    "max-score-picker": _obj({"maxNumOfEndpoints": {"type": "integer", "minimum": 1}}),
    "metrics-data-source": _obj(
        {
            "scheme": {"enum": ["http", "https"]},
            "path": {"type": "string", "pattern": "^/"},
            "port": {"type": "integer", "minimum": 1, "maximum": 65535},
            "insecureSkipVerify": {"type": "boolean"},
            "caCertPath": _STR,
            "clientCertPath": _STR,
            "clientKeyPath": _STR,
            "interval": _DURATION,
        }
    ),
    "core-metrics-extractor": _obj(
        {
            "engineLabelKey": _STR,
            "defaultEngine": _STR,
            "engineConfigs": {
                "type": "array",
                "items": _obj(
                    {
                        "name": {"type": "string", "minLength": 1},
                        **{
                            key: _STR
                            for key in (
                                "queuedRequestsSpec",
                                "runningRequestsSpec",
                                "kvUsageSpec",
                                "loraSpec",
                                "cacheInfoSpec",
                                "cacheBlockSizeLabelName",
                                "cacheNumBlocksLabelName",
                                "cacheBlockSizeSpec",
                                "cacheNumBlocksSpec",
                            )
                        },
                        "customMetrics": {
                            "type": "array",
                            "items": _obj({"attributeKey": _STR, "metricSpec": _STR}),
                        },
                    },
                    ("name",),
                ),
            },
        }
    ),
    "session-affinity-scorer": _obj(
        {
            "strategy": {"enum": ["encoded_endpoint_header", "session_id"]},
            "profileName": _STR,
            "encodedEndpointHeaderConfig": _obj({"header": _STR}),
            "sessionIdConfig": _obj(
                {
                    "sources": {
                        "type": "array",
                        "items": {
                            "oneOf": [
                                _obj({"header": {"type": "string", "minLength": 1}}, ("header",)),
                                _obj({"attribute": {"type": "string", "minLength": 1}}, ("attribute",)),
                            ]
                        },
                    },
                    "evictionTtlSeconds": {"type": "number", "exclusiveMinimum": 0},
                    "evictionSweepSeconds": {"type": "number", "exclusiveMinimum": 0},
                }
            ),
        }
    ),
}
# kinds of plugin, to check each list references the right kind
SCORERS = {"queue-scorer", "kv-cache-utilization-scorer", "session-affinity-scorer"}
PICKERS = {"max-score-picker"}


def epp_config_errors(config: dict) -> list[str]:
    """What the EPP would refuse at start (or what this config must not do), as far as it can be
    told without the EPP: fields, plugin types and parameters, references between sections."""
    import jsonschema

    errors = [
        f"{list(e.absolute_path)}: {e.message}" for e in jsonschema.Draft202012Validator(EPP_CONFIG).iter_errors(config)
    ]
    if errors:
        return errors
    plugins: dict[str, str] = {}
    for spec in config["plugins"]:
        name = spec.get("name") or spec["type"]  # the EPP names a plugin by its type by default
        if name in plugins:
            errors.append(f"duplicate plugin name {name}")
        plugins[name] = spec["type"]
        if spec["type"] not in PLUGIN_PARAMETERS:
            errors.append(f"plugin type {spec['type']} is not one this test knows (llm-d-router v0.10.0)")
            continue
        schema = PLUGIN_PARAMETERS[spec["type"]]
        if "parameters" in spec and schema is None:
            errors.append(f"{name}: {spec['type']} takes no parameters")
        elif schema is not None:
            validator = jsonschema.Draft202012Validator(schema)
            errors += [
                f"{name}: {list(e.absolute_path)}: {e.message}"
                for e in validator.iter_errors(spec.get("parameters", {}))
            ]

    def ref(at: str, pluginref: str, kinds: set[str] | None = None) -> None:
        if pluginref not in plugins:
            errors.append(f"{at} references undefined plugin {pluginref}")
        elif kinds is not None and plugins[pluginref] not in kinds:
            errors.append(f"{at}: {pluginref} is a {plugins[pluginref]}")

    for profile in config.get("schedulingProfiles", []):
        for entry in profile.get("plugins", []):
            ref(f"schedulingProfiles[{profile['name']}]", entry["pluginRef"], SCORERS | PICKERS)
            if plugins.get(entry["pluginRef"]) in PICKERS and "weight" in entry:
                errors.append(f"{entry['pluginRef']}: a picker has no weight")
    for parser in config.get("requestHandler", {}).get("parsers", []):
        ref("requestHandler.parsers", parser["pluginRef"], {"passthrough-parser"})
    for source in config.get("dataLayer", {}).get("sources", []):
        ref("dataLayer.sources", source["pluginRef"], {"metrics-data-source"})
        for extractor in source.get("extractors", []):
            ref("dataLayer.sources.extractors", extractor["pluginRef"], {"core-metrics-extractor"})
    return errors


def plugin(config: dict, plugin_type: str) -> dict:
    (spec,) = [p for p in config["plugins"] if p["type"] == plugin_type]
    return spec


def test_the_endpoint_picker_config_is_one_the_picker_accepts(gateway) -> None:
    config = epp_config(gateway)
    assert not epp_config_errors(config)
    # one scheduling profile that scores and picks; the key's scorer outweighs the load scorers
    (profile,) = config["schedulingProfiles"]
    weights = {e["pluginRef"]: e.get("weight") for e in profile["plugins"]}
    affinity = plugin(config, "session-affinity-scorer")["name"]
    load = [w for ref, w in weights.items() if ref != affinity and w is not None]
    assert weights[affinity] >= sum(load) and len(load) == 2
    assert any(ref in PICKERS for ref in weights)

    mistakes = {
        "an unknown top-level field": lambda c: c.update(schedulingProfile=c["schedulingProfiles"]),
        "an unknown plugin field": lambda c: c["plugins"][0].update(paramters={}),
        "an unknown plugin parameter": lambda c: plugin(c, "metrics-data-source")["parameters"].update(prot=9090),
        "a misspelt plugin type": lambda c: c["plugins"].append({"type": "queue-scorrer"}),
        "an undefined reference": lambda c: c["schedulingProfiles"][0]["plugins"].append({"pluginRef": "nope"}),
        "a parser that is no parser": lambda c: c["requestHandler"]["parsers"].append({"pluginRef": "queue-scorer"}),
        "a wrong type": lambda c: plugin(c, "session-affinity-scorer")["parameters"]["sessionIdConfig"].update(
            evictionTtlSeconds="30m"
        ),
    }
    for what, mistake in mistakes.items():
        bad = copy.deepcopy(config)
        mistake(bad)
        assert epp_config_errors(bad), what


def test_the_endpoint_picker_reads_our_metrics_and_our_key(gateway) -> None:
    """The EPP reads exactly the four gauges the server exports (by those names, as gauges, on
    the metrics port) and binds requests by exactly the header the clients send."""
    config = epp_config(gateway)
    extractor = plugin(config, "core-metrics-extractor")["parameters"]
    (engine,) = [e for e in extractor["engineConfigs"] if e["name"] == extractor["defaultEngine"]]
    specs = {k: v for k, v in engine.items() if k != "name" and v}
    assert specs == EPP_METRICS
    types = metric_types(service_exposition())
    for name in EPP_METRICS.values():
        assert types.get(name) == "gauge", f"the server exports no gauge {name}"
    source = plugin(config, "metrics-data-source")["parameters"]
    assert (source["port"], source["path"]) == (server_ports(gateway)["metrics"], "/metrics")
    assert source["port"] != one(gateway, "InferencePool")["spec"]["targetPorts"][0]["number"]

    (sessions,) = [p for p in config["plugins"] if p["type"] == "session-affinity-scorer"]
    assert sessions["parameters"]["strategy"] == "session_id"
    assert sessions["parameters"]["sessionIdConfig"]["sources"] == [{"header": prefix_key.HEADER}]
    # our bodies are not OpenAI's: the picker must not try to parse them
    assert [p["pluginRef"] for p in config["requestHandler"]["parsers"]] == ["passthrough-parser"]


def test_the_pool_route_and_picker_fit_together(gateway) -> None:
    pool = one(gateway, "InferencePool")
    server = named(gateway, "Deployment", "prefixscore")
    labels = server["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"] == SERVER_LABELS and SERVER_LABELS.items() <= labels.items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [server_ports(gateway)["http"]]
    assert pool["spec"]["appProtocol"] == "http" and pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"

    # the pool's picker is the EPP Service, on its ext_proc port, selecting the EPP pods
    ref = pool["spec"]["endpointPickerRef"]
    service = named(gateway, "Service", ref["name"])
    epp = named(gateway, "Deployment", "prefixscore-epp")
    pod = epp["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert not (pool["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items())
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    (container,) = pod["spec"]["containers"]
    assert port["targetPort"] in {p["name"] for p in container["ports"]}
    assert epp["spec"]["replicas"] == 1 and epp["spec"]["strategy"]["type"] == "Recreate"

    # the EPP's flags name this pool and the mounted config file
    args = dict(a.removeprefix("--").split("=", 1) for a in container["args"])
    assert args["pool-name"] == pool["metadata"]["name"]
    assert args["pool-group"] == "inference.networking.k8s.io"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "config")
    configmap = named(gateway, "ConfigMap", volume["configMap"]["name"])
    assert args["config-file"] == f"{mount['mountPath']}/{next(iter(configmap['data']))}"
    assert args["allow-experimental-plugins"] == "true"  # the session-affinity scorer is Alpha
    assert container["image"].rsplit(":", 1)[1] == "v0.10.0"  # the version the config is checked against
    binding = one(gateway, "RoleBinding")
    (subject,) = binding["subjects"]
    assert (subject["name"], subject["namespace"]) == (pod["spec"]["serviceAccountName"], epp["metadata"]["namespace"])

    # the route sends the scoring paths to the pool, from the Gateway of the GKE component
    route = one(gateway, "HTTPRoute")
    (rule,) = route["spec"]["rules"]
    assert {m["path"]["value"] for m in rule["matches"]} == SCORING_PATHS
    assert all(m["path"]["type"] == "Exact" for m in rule["matches"])
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}
    ]
    (parent,) = route["spec"]["parentRefs"]
    assert parent["name"] == one(gateway, "Gateway")["metadata"]["name"]

    # the NetworkPolicies let the picker scrape the metrics port and the gateway reach HTTP
    policy = named(gateway, "NetworkPolicy", "prefixscore-inference-gateway")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    scrape, http = policy["spec"]["ingress"]
    assert scrape["from"][0]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert [p["port"] for p in scrape["ports"]] == ["metrics"] and [p["port"] for p in http["ports"]] == ["http"]


# ---- GKE's policies --------------------------------------------------------------------------------
_TARGET_POOL = _obj(
    {
        "group": {"const": "inference.networking.k8s.io"},
        "kind": {"const": "InferencePool"},
        "name": _STR,
        "namespace": _STR,
    },
    ("group", "kind", "name"),
)
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": _STR, "namespace": _STR, "labels": {"type": "object"}},
}
# networking.gke.io/v1, fields as GKE's documentation of these policies lists them, limited to
# what a policy for this pool may use.
HEALTH_CHECK_POLICY = _obj(
    {
        "apiVersion": {"const": "networking.gke.io/v1"},
        "kind": {"const": "HealthCheckPolicy"},
        "metadata": _METADATA,
        "spec": _obj(
            {
                "targetRef": _TARGET_POOL,
                "default": _obj(
                    {
                        "checkIntervalSec": {"type": "integer", "minimum": 1, "maximum": 300},
                        "timeoutSec": {"type": "integer", "minimum": 1, "maximum": 300},
                        "healthyThreshold": {"type": "integer", "minimum": 1, "maximum": 10},
                        "unhealthyThreshold": {"type": "integer", "minimum": 1, "maximum": 10},
                        "logConfig": _obj({"enabled": {"type": "boolean"}}),
                        "config": _obj(
                            {
                                "type": {"enum": ["HTTP", "HTTPS", "HTTP2", "GRPC", "TCP"]},
                                "httpHealthCheck": _obj(
                                    {
                                        "portSpecification": {
                                            "enum": ["USE_FIXED_PORT", "USE_NAMED_PORT", "USE_SERVING_PORT"]
                                        },
                                        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                                        "portName": _STR,
                                        "host": _STR,
                                        "requestPath": {"type": "string", "pattern": "^/"},
                                        "response": _STR,
                                        "proxyHeader": {"enum": ["NONE", "PROXY_V1"]},
                                    }
                                ),
                            },
                            ("type",),
                        ),
                    }
                ),
            },
            ("targetRef", "default"),
        ),
    },
    ("apiVersion", "kind", "metadata", "spec"),
)
GCP_BACKEND_POLICY = _obj(
    {
        "apiVersion": {"const": "networking.gke.io/v1"},
        "kind": {"const": "GCPBackendPolicy"},
        "metadata": _METADATA,
        "spec": _obj(
            {
                "targetRef": _TARGET_POOL,
                "default": _obj(
                    {
                        "timeoutSec": {"type": "integer", "minimum": 1, "maximum": 2147483647},
                        "logging": _obj({"enabled": {"type": "boolean"}, "sampleRate": {"type": "integer"}}),
                        "connectionDraining": _obj({"drainingTimeoutSec": {"type": "integer", "minimum": 0}}),
                    }
                ),
            },
            ("targetRef", "default"),
        ),
    },
    ("apiVersion", "kind", "metadata", "spec"),
)


def test_gke_policies_target_the_pool_and_check_readiness(gateway) -> None:
    import jsonschema

    pool = one(gateway, "InferencePool")
    for kind, schema in (("HealthCheckPolicy", HEALTH_CHECK_POLICY), ("GCPBackendPolicy", GCP_BACKEND_POLICY)):
        doc = one(gateway, kind)
        errors = [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(doc)]
        assert not errors, f"{kind}: {errors}"
        assert doc["spec"]["targetRef"]["name"] == pool["metadata"]["name"]
        bad = copy.deepcopy(doc)
        bad["spec"]["default"]["timeoutSecs"] = 30
        assert list(jsonschema.Draft202012Validator(schema).iter_errors(bad)), kind
    # the load balancer checks the HTTP API's readiness on the pool's port (/ answers 404)
    check = one(gateway, "HealthCheckPolicy")["spec"]["default"]["config"]
    assert check["type"] == "HTTP"
    assert check["httpHealthCheck"] == {"port": pool["spec"]["targetPorts"][0]["number"], "requestPath": "/ready"}
    assert one(gateway, "GCPBackendPolicy")["spec"]["default"]["timeoutSec"] > 30
