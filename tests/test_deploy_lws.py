"""deploy/k8s/overlays/tpu-v5e-4x4-multihost: one model across the 4 hosts of a v5e 4x4 slice,
as a LeaderWorkerSet group of 4 pods (one `prefixscore serve` per host, JAX multi-controller).

It renders with `kubectl kustomize`; the LeaderWorkerSet validates against the upstream CRD's
OpenAPI schema (tests/data/crds, its source named there), closed the way the API server prunes,
and its pod templates and the core kinds against the Kubernetes JSON schemas (strict); the group
fills the slice; every pod resolves its host variables from what LeaderWorkerSet sets on it
(modelled below from its source); only leaders take traffic, are scraped and are averaged by
the HPA; the group restarts as a whole; and the pods keep the base Deployment's server contract.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.deploy import K8S, by_kind, closed, kustomize, kv, one, versions

HERE = Path(__file__).resolve().parent
OVERLAY = K8S / "overlays" / "tpu-v5e-4x4-multihost"
LWS_CRD = HERE / "data" / "crds" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
HOSTS, CHIPS_PER_HOST, TOPOLOGY = 4, 4, "4x4"
ACCELERATOR = "tpu-v5-lite-podslice"
GRPC_PORT, HTTP_PORT, METRICS_PORT = 50051, 8080, 9090
# the coordinator's port (JAX's own on a TPU slice; the TPU runtime has 8476) and the step channel's
COORDINATOR_PORT = 8482
GKE_QUEUE_METRIC = "prometheus.googleapis.com|prefixscore_queue_depth|gauge"

# What LeaderWorkerSet (kubernetes-sigs/lws v0.10.0) puts on the pods it creates:
# api/leaderworkerset/v1/leaderworkerset_types.go, pkg/webhooks/pod_webhook.go,
# pkg/utils/pod/pod_utils.go (AddLWSVariables), pkg/utils/accelerators/tpu.go (AddTPUVariables).
NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
SIZE_ANNOTATION = "leaderworkerset.sigs.k8s.io/size"
EXCLUSIVE_ANNOTATION = "leaderworkerset.sigs.k8s.io/exclusive-topology"
TPU_RUNTIME_ENV = ("TPU_WORKER_HOSTNAMES", "TPU_WORKER_ID", "TPU_NAME", "TPU_PROCESS_ADDRESSES", "TPU_PROCESS_PORT")
HOST_ENV = ("PREFIXSCORE_NUM_HOSTS", "PREFIXSCORE_HOST_INDEX", "PREFIXSCORE_COORDINATOR")


# ---- renders -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return kustomize(OVERLAY)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """The base Deployment as a single-host TPU overlay has it (base + the tpu and gmp
    components, no overlay's own sizing): the contract the LeaderWorkerSet's pods keep."""
    work = tmp_path_factory.mktemp("kustomize")
    (work / "k8s").symlink_to(K8S)
    (work / "reference").mkdir()
    (work / "reference" / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "namespace": "prefixscore",
                "resources": ["../k8s/base"],
                "components": ["../k8s/components/tpu", "../k8s/components/gmp"],
            }
        )
    )
    return kustomize(work / "reference")


def lws(docs: list[dict]) -> dict:
    return one(docs, "LeaderWorkerSet")


def templates(docs: list[dict]) -> dict[str, dict]:
    """{"leader": pod template, "follower": pod template}."""
    lwt = lws(docs)["spec"]["leaderWorkerTemplate"]
    return {"leader": lwt["leaderTemplate"], "follower": lwt["workerTemplate"]}


def server(template: dict) -> dict:
    containers = template["spec"]["containers"]
    assert [c["name"] for c in containers] == ["prefixscore"]
    return containers[0]


def config(docs: list[dict], container: dict) -> dict[str, str]:
    names = [src["configMapRef"]["name"] for src in container.get("envFrom", [])]
    data: dict[str, str] = {}
    for cm in by_kind(docs, "ConfigMap"):
        if cm["metadata"]["name"] in names:
            data.update(cm["data"])
    assert data, f"no ConfigMap named {names} renders"
    return data


# ---- what LeaderWorkerSet does to a pod ------------------------------------------------
def lws_pod(docs: list[dict], group: int, worker: int) -> dict:
    """The pod LeaderWorkerSet creates for worker `worker` of group `group`: the template, the
    labels and annotations its controller and pod webhook add, the subdomain of its headless
    Service, and LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX placed first in every
    container's env (so that $(VAR) references to them expand)."""
    lset = lws(docs)
    name, namespace = lset["metadata"]["name"], lset["metadata"]["namespace"]
    size = lset["spec"]["leaderWorkerTemplate"]["size"]
    template = copy.deepcopy(templates(docs)["leader" if worker == 0 else "follower"])
    pod = {
        "metadata": {
            "name": f"{name}-{group}" if worker == 0 else f"{name}-{group}-{worker}",
            "namespace": namespace,
            "labels": {
                **template["metadata"].get("labels", {}),
                NAME_LABEL: name,
                GROUP_INDEX_LABEL: str(group),
                WORKER_INDEX_LABEL: str(worker),
            },
            "annotations": {**template["metadata"].get("annotations", {}), SIZE_ANNOTATION: str(size)},
        },
        "spec": {**template["spec"], "subdomain": name},
    }
    first = [
        {"name": "LWS_LEADER_ADDRESS", "value": f"{name}-{group}.{name}.{namespace}"},
        {"name": "LWS_GROUP_SIZE", "value": str(size)},
        {"name": "LWS_WORKER_INDEX", "value": str(worker)},
    ]
    for c in pod["spec"]["containers"]:
        c["env"] = first + [e for e in c.get("env", []) if e["name"] not in {f["name"] for f in first}]
    return pod


_FIELD = re.compile(r"^metadata\.(labels|annotations)\['([^']+)'\]$")
_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(value: str, defined: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: a defined name is replaced, $$ is a literal $, an undefined
    reference stays as written."""
    return _REF.sub(lambda m: "$" if m.group(0) == "$$" else defined.get(m.group(1), m.group(0)), value)


def resolve_env(docs: list[dict], pod: dict, container: dict) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom first, then env in order,
    a value's $(VAR) expanded from the variables defined before it ($$ escapes; an undefined
    reference stays as written), valueFrom.fieldRef read from the pod's labels and annotations."""
    out = dict(config(docs, container))
    for var in container.get("env", []):
        if "valueFrom" in var:
            (source,) = var["valueFrom"]
            assert source == "fieldRef", f"{var['name']}: {source}"
            where, key = _FIELD.match(var["valueFrom"]["fieldRef"]["fieldPath"]).groups()
            assert key in pod["metadata"][where], f"{var['name']}: the pod has no {where} {key}"
            out[var["name"]] = pod["metadata"][where][key]
        else:
            out[var["name"]] = expand(var["value"], dict(out))
    return out


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


# ---- the CRD's schema ------------------------------------------------------------------
@pytest.fixture(scope="module")
def crd() -> dict:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # 1.3 MB: libyaml when present
    doc = yaml.load(LWS_CRD.read_text(), Loader=loader)
    assert doc["spec"]["group"] == "leaderworkerset.x-k8s.io" and doc["spec"]["names"]["kind"] == "LeaderWorkerSet"
    return doc


def crd_version(crd: dict) -> dict:
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert version["served"] and version["storage"]
    return version


def lws_errors(crd: dict, doc: dict) -> list[str]:
    import jsonschema

    schema = crd_version(crd)["schema"]["openAPIV3Schema"]
    errors = [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
        for e in jsonschema.Draft202012Validator(closed(schema)).iter_errors(doc)
    ]
    if doc.get("apiVersion") != f"{crd['spec']['group']}/v1" or doc.get("kind") != "LeaderWorkerSet":
        errors.append(f"not a LeaderWorkerSet v1: {doc.get('apiVersion')} {doc.get('kind')}")
    return errors


def cel_rules(schema: Any) -> list[str]:
    if isinstance(schema, list):
        return [r for s in schema for r in cel_rules(s)]
    if not isinstance(schema, dict):
        return []
    return [r["rule"] for r in schema.get("x-kubernetes-validations", [])] + [
        r for k, v in schema.items() if k != "x-kubernetes-validations" for r in cel_rules(v)
    ]


# ---- tests ---------------------------------------------------------------------------
def test_overlay_renders_a_leaderworkerset_and_no_deployment(docs):
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        [
            "ConfigMap",
            "HorizontalPodAutoscaler",
            "LeaderWorkerSet",
            "NetworkPolicy",
            "PodDisruptionBudget",
            "PodMonitoring",
            "Rules",
            "Service",
            "Service",
            "ServiceAccount",
        ]
    ), kinds
    assert {d["metadata"]["namespace"] for d in docs} == {"prefixscore"}
    # LWS creates a headless Service named after the set (the pods' DNS subdomain) unless one of
    # that name exists: it must not be one of ours, which would not give pods DNS names.
    assert lws(docs)["metadata"]["name"] not in {s["metadata"]["name"] for s in by_kind(docs, "Service")}


def test_leaderworkerset_validates_against_the_upstream_crd(docs, crd):
    lset = lws(docs)
    assert not lws_errors(crd, lset)
    assert not cel_rules(crd_version(crd)["schema"]), "the CRD gained CEL rules this test does not check"
    mistakes = {}
    typo = copy.deepcopy(lset)
    typo["spec"]["leaderWorkerTemplate"]["restartPolcy"] = typo["spec"]["leaderWorkerTemplate"].pop("restartPolicy")
    mistakes["misspelt field"] = typo
    nested = copy.deepcopy(lset)
    nested["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["livenessProbe"]["httpGet"][
        "paht"
    ] = "/health"
    mistakes["misspelt pod field"] = nested
    wrong_type = copy.deepcopy(lset)
    wrong_type["spec"]["leaderWorkerTemplate"]["size"] = "4"
    mistakes["size as a string"] = wrong_type
    wrong_value = copy.deepcopy(lset)
    wrong_value["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RecreateGroup"
    mistakes["unknown restart policy"] = wrong_value
    missing = copy.deepcopy(lset)
    del missing["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    mistakes["no worker template"] = missing
    for what, bad in mistakes.items():
        assert lws_errors(crd, bad), f"the CRD schema accepts a {what}"


def test_pod_templates_and_core_resources_validate_against_kubernetes_schemas(docs):
    kubernetes_validate = kv()
    objects = [d for d in docs if d["kind"] not in ("LeaderWorkerSet", "PodMonitoring", "Rules")]
    assert sorted({d["kind"] for d in objects}) == [
        "ConfigMap",
        "HorizontalPodAutoscaler",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Service",
        "ServiceAccount",
    ]
    for role, template in templates(docs).items():  # the CRD's pod schema may lag Kubernetes'
        objects.append({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role}, "template": template})
    for doc in objects:
        for version in versions(kubernetes_validate):
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as err:
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} invalid for {version}: {err}")
    bad = copy.deepcopy(objects[-1])
    bad["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "9090"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, versions(kubernetes_validate)[-1], strict=True)


def test_a_group_fills_the_slice(docs):
    """4 pods x 4 chips = the 16 chips of a v5e 4x4, every pod on that slice's hosts, one group
    per slice (node pool), requests equal to limits."""
    lset = lws(docs)
    size = lset["spec"]["leaderWorkerTemplate"]["size"]
    rows, cols = map(int, TOPOLOGY.split("x"))
    assert size == HOSTS
    for role, template in templates(docs).items():
        spec = template["spec"]
        assert spec["nodeSelector"] == {
            "cloud.google.com/gke-tpu-accelerator": ACCELERATOR,
            "cloud.google.com/gke-tpu-topology": TOPOLOGY,
        }, role
        assert {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"], role
        resources = server(template)["resources"]
        chips = resources["requests"]["google.com/tpu"]
        assert chips == resources["limits"]["google.com/tpu"] == str(CHIPS_PER_HOST), role
        assert int(chips) * size == rows * cols, role
    assert lset["metadata"]["annotations"][EXCLUSIVE_ANNOTATION] == "cloud.google.com/gke-nodepool"


def test_every_pod_resolves_its_host_variables(docs):
    """Each pod of each group gets PREFIXSCORE_NUM_HOSTS = the group size, PREFIXSCORE_HOST_INDEX
    = its worker index (0 for the leader) and PREFIXSCORE_COORDINATOR = its own leader's DNS
    name and the coordinator port the leader declares (the step channel on the next); every
    PREFIXSCORE_* it sets is a `serve` flag; the TPU runtime's variables are left to LWS."""
    from prefixscore.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = {m.group(1) for a in serve._actions for m in [re.search(r"\[\$(PREFIXSCORE_\w+)", a.help or "")] if m}
    assert set(HOST_ENV) <= flags
    lset = lws(docs)
    name, namespace = lset["metadata"]["name"], lset["metadata"]["namespace"]
    leader_ports = {p["name"]: p["containerPort"] for p in server(templates(docs)["leader"])["ports"]}
    assert leader_ports["coordinator"] == COORDINATOR_PORT and leader_ports["steps"] == COORDINATOR_PORT + 1
    for role, template in templates(docs).items():
        names = [e["name"] for e in server(template).get("env", [])]
        assert set(HOST_ENV) <= set(names), role
        assert not set(names) & set(TPU_RUNTIME_ENV), f"{role}: LWS's webhook skips a container that sets these"
        assert not [n for n in names if n.startswith("LWS_")], f"{role}: LWS's own variables are not to be shadowed"
        assert {n for n in names if n.startswith("PREFIXSCORE_")} <= flags, role
    for group in (0, 2):
        for worker in range(lset["spec"]["leaderWorkerTemplate"]["size"]):
            pod = lws_pod(docs, group, worker)
            env = resolve_env(docs, pod, server(pod))
            where = f"group {group} worker {worker}"
            assert env["PREFIXSCORE_NUM_HOSTS"] == str(HOSTS), where
            assert env["PREFIXSCORE_HOST_INDEX"] == str(worker), where
            assert env["PREFIXSCORE_COORDINATOR"] == f"{name}-{group}.{name}.{namespace}:{COORDINATOR_PORT}", where


def test_only_leaders_take_traffic_and_are_scraped(docs):
    """The Services (regular and headless: clients, Envoy) and the PodMonitoring select the
    leader of every group and no follower; so does the servers' selector the Inference
    Gateway's InferencePool uses; the HPA averages over the leaders (the scale subresource's
    selector), on the metric the single-host HPA uses, and scales whole groups."""
    lset = lws(docs)
    size = lset["spec"]["leaderWorkerTemplate"]["size"]
    leaders = [lws_pod(docs, g, 0)["metadata"]["labels"] for g in range(3)]
    followers = [lws_pod(docs, g, w)["metadata"]["labels"] for g in range(3) for w in range(1, size)]
    selectors = {f"Service/{s['metadata']['name']}": s["spec"]["selector"] for s in by_kind(docs, "Service")}
    pm = one(docs, "PodMonitoring")
    selectors["PodMonitoring"] = pm["spec"]["selector"]["matchLabels"]
    assert set(pm["spec"]["selector"]) == {"matchLabels"}
    selectors["servers"] = {"app.kubernetes.io/name": "prefixscore", "app.kubernetes.io/component": "server"}
    for what, selector in selectors.items():
        assert all(matches(selector, labels) for labels in leaders), what
        assert not any(matches(selector, labels) for labels in followers), what
    assert {e["port"] for e in pm["spec"]["endpoints"]} == {"metrics"}
    headless = [s for s in by_kind(docs, "Service") if s["spec"].get("clusterIP") == "None"]
    assert [s["spec"].get("publishNotReadyAddresses", False) for s in headless] == [False]


def test_the_hpa_scales_whole_groups_on_the_leaders_queue_depth(docs, reference, crd):
    """The HPA targets the LeaderWorkerSet's scale subresource (replicas = groups; its selector,
    status.hpaPodSelector, is the leaders'), with the single-host HPA's metric and behaviour."""
    lset = lws(docs)
    hpa, single = one(docs, "HorizontalPodAutoscaler"), one(reference, "HorizontalPodAutoscaler")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == (
        lset["apiVersion"],
        "LeaderWorkerSet",
        lset["metadata"]["name"],
    )
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == GKE_QUEUE_METRIC
    for key in ("metrics", "behavior", "minReplicas", "maxReplicas"):
        assert hpa["spec"][key] == single["spec"][key], key
    scale = crd_version(crd)["subresources"]["scale"]
    assert scale == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.hpaPodSelector",
    }


def test_followers_serve_only_metrics(docs):
    """Followers declare the metrics port alone and are probed there (liveness /health,
    readiness /ready); the leader declares the base's ports plus the coordinator's and the step
    channel's, which the followers connect to."""
    leader, follower = (server(t) for t in templates(docs).values())
    assert {p["name"]: p["containerPort"] for p in follower["ports"]} == {"metrics": METRICS_PORT}
    assert {p["name"]: p["containerPort"] for p in leader["ports"]} == {
        "grpc": GRPC_PORT,
        "http": HTTP_PORT,
        "metrics": METRICS_PORT,
        "coordinator": COORDINATOR_PORT,
        "steps": COORDINATOR_PORT + 1,
    }
    for probe, path in (("startupProbe", "/ready"), ("readinessProbe", "/ready"), ("livenessProbe", "/health")):
        assert set(follower[probe]) & {"grpc", "httpGet", "exec", "tcpSocket"} == {"httpGet"}, probe
        assert follower[probe]["httpGet"] == {"path": path, "port": "metrics"}, probe
        timing = {k: v for k, v in leader[probe].items() if k != "grpc"}
        assert {k: v for k, v in follower[probe].items() if k != "httpGet"} == timing, probe


def test_a_failure_restarts_the_whole_group(docs, crd):
    spec = lws(docs)["spec"]
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    schema = crd_version(crd)["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert "RecreateGroupOnPodRestart" in schema["leaderWorkerTemplate"]["properties"]["restartPolicy"]["enum"]
    # the leader is ready only when every host is: followers must not wait for it
    assert spec.get("startupPolicy", "LeaderCreated") == "LeaderCreated"
    rolling = spec["rolloutStrategy"]["rollingUpdateConfiguration"]
    assert (rolling["maxSurge"], rolling["maxUnavailable"]) == (0, 1), "a slice is not spare"


def test_pdb_and_networkpolicy_cover_every_pod_and_let_the_group_talk(docs):
    size = lws(docs)["spec"]["leaderWorkerTemplate"]["size"]
    pods = [lws_pod(docs, g, w)["metadata"]["labels"] for g in range(2) for w in range(size)]
    pdb = one(docs, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert all(matches(pdb["spec"]["selector"]["matchLabels"], labels) for labels in pods)
    policy = one(docs, "NetworkPolicy")
    assert all(matches(policy["spec"]["podSelector"]["matchLabels"], labels) for labels in pods)
    peers = [
        rule
        for rule in policy["spec"]["ingress"]
        if "ports" not in rule
        and any(all(matches(f["podSelector"]["matchLabels"], labels) for labels in pods) for f in rule["from"])
    ]
    assert peers, "the pods of a group must reach each other (coordinator, step channel, TPU runtime)"
    assert all(set(f) == {"podSelector"} and f["podSelector"]["matchLabels"] for r in peers for f in r["from"])


def test_pods_keep_the_base_deployments_server_contract(docs, reference):
    """Image, entrypoint, ConfigMap env, security contexts, volumes, drain and (the leader's)
    probes and ports are the base Deployment's with the tpu component, field for field."""
    deployment = one(reference, "Deployment")
    base_pod = deployment["spec"]["template"]["spec"]
    (base,) = base_pod["containers"]
    assert "command" not in base and "args" not in base
    drain = float(config(reference, base)["PREFIXSCORE_DRAIN_SECONDS"])
    for role, template in templates(docs).items():
        pod, c = template["spec"], server(template)
        assert template["metadata"]["labels"]["app.kubernetes.io/name"] == "prefixscore"
        for key in (
            "serviceAccountName",
            "automountServiceAccountToken",
            "enableServiceLinks",
            "terminationGracePeriodSeconds",
            "securityContext",
            "volumes",
            "tolerations",
        ):
            assert pod.get(key) == base_pod.get(key), f"{role}: {key}"
        for key in ("image", "imagePullPolicy", "command", "args", "securityContext", "volumeMounts"):
            assert c.get(key) == base.get(key), f"{role}: container {key}"
        assert config(docs, c) == config(reference, base), role
        assert set(c["resources"]["requests"]) == set(base["resources"]["requests"]) | {"google.com/tpu"}, role
        pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep" and pod["terminationGracePeriodSeconds"] > int(pre_stop[1]) + drain + 10, role
    leader, follower = (server(t) for t in templates(docs).values())
    for key in ("startupProbe", "readinessProbe", "livenessProbe", "lifecycle"):
        assert leader[key] == base[key], f"leader: {key}"
    assert [p for p in leader["ports"] if p["name"] in ("grpc", "http", "metrics")] == base["ports"]
    assert [p for p in follower["ports"]] == [p for p in base["ports"] if p["name"] == "metrics"]
    # a follower's SIGTERM waits out the leader's preStop and drain (the leader's last calls need it)
    leader_stop = int(leader["lifecycle"]["preStop"]["exec"]["command"][1])
    assert int(follower["lifecycle"]["preStop"]["exec"]["command"][1]) >= leader_stop + drain
