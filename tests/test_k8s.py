"""deploy/k8s rendered by the real kustomize and checked: strictly against the Kubernetes
JSON schemas (PyPI kubernetes-validate) and KEDA's own CRD schema, then for what an SRE
expects of each object. The server-side dry run is tests/test_k8s_apiserver.py."""

from __future__ import annotations

import copy
import functools
import json
import re
from typing import Any

import jsonschema
import kubernetes_validate
import pytest

from shared.topics import Topics
from tests.built_tools import WAITS_FOR_BUILD
from tests.k8s_tools import K8S, OVERLAYS, keda_crds, named, of_kind, rendered, tool
from tokenbus.config import env_file

pytestmark = [pytest.mark.integration, WAITS_FOR_BUILD]

KUBERNETES_VERSION = "1.37.0"
KEDA_GROUP = "keda.sh"
SERVICES = ("edge", "ingest", "scheduler", "worker")
# Where the kubelet probes each service's /healthz and /readyz (the edge: its public port,
# as a load balancer does), and where each serves /metrics (shared/health.py, settings).
HEALTH_PORT = {"edge": 8000, "ingest": 9101, "scheduler": 9102, "worker": 9103}
METRICS_PORT = {"edge": 9100, "ingest": 9101, "scheduler": 9102, "worker": 9103}
PARTITIONS = Topics("tokenbus").partitions()


@pytest.fixture(scope="module", autouse=True)
def _tools_built() -> None:
    """kustomize and KEDA's CRDs, waited for here if make test is still building them."""
    tool("kustomize")
    tool("keda-crds")


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def config_values(docs: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """What a container's environment resolves to: its ConfigMaps in order, then `env`."""
    maps = {d["metadata"]["name"]: d.get("data", {}) for d in of_kind(docs, "ConfigMap")}
    values: dict[str, str] = {}
    for source in container.get("envFrom", []):
        values.update(maps[source["configMapRef"]["name"]])
    for name, entry in env_of(container).items():
        if "value" in entry:
            values[name] = entry["value"]
    return values


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """An OpenAPI v3 CRD schema where an object takes no field it does not declare (what
    `kubectl apply --validate=strict` and the API server's field validation do)."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@functools.cache
def keda_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for crd in keda_crds():
        kind = crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version["served"]:
                api = f"{crd['spec']['group']}/{version['name']}"
                out[(api, kind)] = strict(version["schema"]["openAPIV3Schema"])
    return out


def test_settings_env_is_generated_from_the_defaults() -> None:
    path = K8S / "base" / "settings.env"
    assert path.read_text() == env_file(), (
        "deploy/k8s/base/settings.env is stale: run "
        "`tokenbus config --env deploy/k8s/base/settings.env`"
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_manifest_validates_strictly_against_the_kubernetes_schemas(overlay: str) -> None:
    docs = [d for d in rendered(overlay) if not d["apiVersion"].startswith(KEDA_GROUP)]
    assert {d["kind"] for d in docs} >= {
        "Namespace", "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy",
        "ConfigMap", "Job", "ServiceAccount",
    }  # fmt: skip
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_scaledobjects_validate_against_the_keda_crd_schema(overlay: str) -> None:
    schemas = keda_schemas()
    docs = [d for d in rendered(overlay) if d["apiVersion"].startswith(KEDA_GROUP)]
    # ingest, the scheduler, and each model's worker pool (one at least: `worker`).
    pools = sorted(worker_pools(rendered(overlay)))
    assert "worker" in pools
    assert sorted(d["metadata"]["name"] for d in of_kind(docs, "ScaledObject")) == sorted(
        ["ingest", "scheduler", *pools]
    )
    for doc in docs:
        jsonschema.validate(doc, schemas[(doc["apiVersion"], doc["kind"])])


def test_the_strict_keda_schema_refuses_an_unknown_field() -> None:
    """The check above can fail: a misspelt field is refused, not ignored."""
    doc = copy.deepcopy(named(rendered("sim"), "ScaledObject", "worker"))
    doc["spec"]["minReplicas"] = 1  # KEDA spells it minReplicaCount
    with pytest.raises(jsonschema.ValidationError, match="minReplicas"):
        jsonschema.validate(doc, keda_schemas()[(doc["apiVersion"], doc["kind"])])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_service_is_a_deployment_with_probes_resources_and_a_locked_down_pod(
    overlay: str,
) -> None:
    docs = rendered(overlay)
    pools = worker_pools(docs)  # each model's workers: `worker`, and one per further model
    deployments = sorted({*SERVICES, *pools})
    assert sorted(d["metadata"]["name"] for d in of_kind(docs, "Deployment")) == deployments
    for name in deployments:
        service = "worker" if name in pools else name
        pod = named(docs, "Deployment", name)["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["automountServiceAccountToken"] is False, name
        (container,) = pod["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        probe_port = "http" if name == "edge" else "metrics"
        assert ports[probe_port] == HEALTH_PORT[service], name
        config = config_values(docs, container)
        setting = "TOKENBUS_EDGE_PORT" if name == "edge" else "TOKENBUS_METRICS_PORT"
        assert config[setting] == str(HEALTH_PORT[service]), name
        # /metrics on the `metrics` port Prometheus scrapes (prometheus-k8s.yml), bound to
        # every interface of the pod (the NetworkPolicies say who reaches it).
        assert ports["metrics"] == METRICS_PORT[service], name
        assert config["TOKENBUS_METRICS_PORT"] == str(METRICS_PORT[service]), name
        assert config["TOKENBUS_METRICS_HOST"] == "0.0.0.0", name
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": probe_port}
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": probe_port}
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(container["resources"][kind]), (name, kind)
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] is True, name
        assert security["allowPrivilegeEscalation"] is False, name
        assert security["capabilities"]["drop"] == ["ALL"], name


def test_gpu_workers_request_a_gpu_and_outlast_their_drain() -> None:
    for overlay in OVERLAYS:
        docs = rendered(overlay)
        pod = named(docs, "Deployment", "worker")["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        config = config_values(docs, container)
        drain = float(config["TOKENBUS_WORKER_DRAIN_TIMEOUT_S"])
        assert pod["terminationGracePeriodSeconds"] > drain + 5, overlay
        resources = container["resources"]
        if overlay == "gpu":
            assert config["TOKENBUS_WORKER_ENGINE"] == "vllm"
            assert resources["limits"]["nvidia.com/gpu"] == "1"
            assert resources["requests"]["nvidia.com/gpu"] == "1"
        else:
            assert config["TOKENBUS_WORKER_ENGINE"] == "sim"
            assert "nvidia.com/gpu" not in resources["limits"]


def test_the_edge_is_the_only_service_reachable_from_outside_the_namespace() -> None:
    docs = rendered("sim")
    assert [s["metadata"]["name"] for s in of_kind(docs, "Service")] == ["edge"]
    edge_labels = named(docs, "Deployment", "edge")["spec"]["template"]["metadata"]["labels"]
    assert named(docs, "Service", "edge")["spec"]["selector"].items() <= edge_labels.items()
    assert named(docs, "Service", "edge")["spec"]["type"] == "ClusterIP"
    pdb = named(docs, "PodDisruptionBudget", "edge")["spec"]
    assert pdb["selector"]["matchLabels"].items() <= edge_labels.items()
    policies = of_kind(docs, "NetworkPolicy")
    deny = named(docs, "NetworkPolicy", "default-deny")["spec"]
    assert deny == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            sources = rule.get("from", [])
            open_to_all = not sources
            only_monitoring = all(
                s.get("namespaceSelector", {}).get("matchLabels")
                == {"kubernetes.io/metadata.name": "monitoring"}
                for s in sources
            )
            assert open_to_all or only_monitoring, policy["metadata"]["name"]
            if open_to_all:
                # Open to everyone: only the edge's pods, only its HTTP port.
                assert policy["spec"]["podSelector"] == {
                    "matchLabels": {"app.kubernetes.io/name": "edge"}
                }
                assert rule["ports"] == [{"port": "http", "protocol": "TCP"}]


def test_the_edges_metrics_port_is_reached_from_monitoring_only() -> None:
    docs = rendered("sim")
    # The Service (what an Ingress or LoadBalancer forwards to) carries the chat port alone.
    service_ports = named(docs, "Service", "edge")["spec"]["ports"]
    assert [p["targetPort"] for p in service_ports] == ["http"]
    # Prometheus's namespace reaches every pod's `metrics` port, the edge's included.
    policy = named(docs, "NetworkPolicy", "metrics-from-monitoring")["spec"]
    (selector,) = policy["podSelector"]["matchExpressions"]
    assert (selector["key"], selector["operator"]) == ("app.kubernetes.io/name", "In")
    assert set(selector["values"]) == set(SERVICES)
    (rule,) = policy["ingress"]
    assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]


SECRETISH = re.compile(r"PASSWORD|SECRET|TOKEN$|KEY$|API_KEY")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_are_references_never_values(overlay: str) -> None:
    docs = rendered(overlay)
    assert not of_kind(docs, "Secret"), "a Secret object would carry its values in the repo"
    for cm in of_kind(docs, "ConfigMap"):
        leaked = [k for k in cm.get("data", {}) if SECRETISH.search(k)]
        assert not leaked, (cm["metadata"]["name"], leaked)
    referenced = set()
    for doc in of_kind(docs, "Deployment") + of_kind(docs, "Job"):
        pod = doc["spec"]["template"]["spec"]
        for container in pod["containers"]:
            for name, entry in env_of(container).items():
                if SECRETISH.search(name) or name.endswith("SASL_USERNAME"):
                    assert set(entry) == {"name", "valueFrom"}, (doc["metadata"]["name"], name)
                    referenced.add(entry["valueFrom"]["secretKeyRef"]["name"])
        for volume in pod.get("volumes", []):
            if "secret" in volume:
                referenced.add(volume["secret"]["secretName"])
    # API keys, the resume secret, each service's SASL credentials and the Kafka CA.
    assert referenced == {
        "tokenbus-api-keys", "tokenbus-resume", "tokenbus-kafka-ca", "tokenbus-kafka-admin",
        "tokenbus-kafka-edge", "tokenbus-kafka-ingest", "tokenbus-kafka-scheduler",
        "tokenbus-kafka-worker",
    }  # fmt: skip


def test_the_topics_job_creates_the_topics_and_acls() -> None:
    job = named(rendered("sim"), "Job", "topics")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["tokenbus", "topics", "create", "--acls"]
    assert env_of(container)["TOKENBUS_KAFKA_SASL_USERNAME"]["valueFrom"]["secretKeyRef"] == {
        "name": "tokenbus-kafka-admin",
        "key": "username",
    }


def test_edges_lease_their_result_partition_so_replicas_need_no_per_pod_setting() -> None:
    docs = rendered("sim")
    edge = named(docs, "Deployment", "edge")
    (container,) = edge["spec"]["template"]["spec"]["containers"]
    assert "TOKENBUS_EDGE_RESULT_PARTITION" not in config_values(docs, container)
    assert config_values(docs, container)["TOKENBUS_EDGE_RESULT_TOPOLOGY"] == "partition"
    assert edge["spec"]["replicas"] <= PARTITIONS["tokenbus.results"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_scaledobjects_keep_a_warm_pool_and_do_not_flap(overlay: str) -> None:
    docs = rendered(overlay)
    scaled = {d["metadata"]["name"]: d["spec"] for d in of_kind(docs, "ScaledObject")}
    pools = worker_pools(docs)
    for name, spec in scaled.items():
        assert named(docs, "Deployment", spec["scaleTargetRef"]["name"])
        # A worker pool may scale to zero (its requests are held while a worker starts);
        # the other services keep one replica at least.
        least = 0 if spec["scaleTargetRef"]["name"] in pools else 1
        assert least <= spec["minReplicaCount"] < spec["maxReplicaCount"], name
        assert spec["cooldownPeriod"] >= 60, name
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300, name
        assert "stabilizationWindowSeconds" in behavior["scaleUp"], name
        for trigger in spec["triggers"]:
            meta = trigger["metadata"]
            assert "activationThreshold" in meta or "activationLagThreshold" in meta, name
    (worker,) = scaled["worker"]["triggers"]
    assert worker["type"] == "prometheus"
    assert worker["metadata"]["query"].startswith("sum(model:tokenbus_sequences_wanted:sum{")
    (ingest,) = scaled["ingest"]["triggers"]
    assert (ingest["type"], ingest["metadata"]["topic"]) == ("kafka", "tokenbus.requests")
    assert ingest["metadata"]["consumerGroup"] == "tokenbus.ingest"
    assert scaled["ingest"]["maxReplicaCount"] <= PARTITIONS["tokenbus.requests"]
    tiers = {t["metadata"]["topic"] for t in scaled["scheduler"]["triggers"]}
    assert tiers == set(Topics("tokenbus").tiers)
    assert scaled["scheduler"]["maxReplicaCount"] <= min(PARTITIONS[t] for t in tiers)


def worker_pools(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Worker Deployment name -> the Deployment, for every Deployment of workers."""
    return {
        d["metadata"]["name"]: d
        for d in of_kind(docs, "Deployment")
        if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
        == "worker"
    }


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_model_is_a_pool_of_its_own_scaled_on_its_own_signal(overlay: str) -> None:
    """One worker Deployment per model: its model in its selector and on its pods, one
    ScaledObject on that model's signal alone, and the model among those served."""
    docs = rendered(overlay)
    pools = worker_pools(docs)
    assert pools
    scaled = {d["spec"]["scaleTargetRef"]["name"]: d["spec"] for d in of_kind(docs, "ScaledObject")}
    served: set[str] = set()
    for name, deployment in pools.items():
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        values = config_values(docs, container)
        model = values["TOKENBUS_WORKER_MODEL"]
        assert deployment["spec"]["selector"]["matchLabels"]["tokenbus.dev/model"] == model
        assert deployment["spec"]["template"]["metadata"]["labels"]["tokenbus.dev/model"] == model
        (trigger,) = scaled[name]["triggers"]
        query = trigger["metadata"]["query"]
        assert query == f'sum(model:tokenbus_sequences_wanted:sum{{model="{model}"}}) or vector(0)'
        assert model in json.loads(values["TOKENBUS_SERVED_MODELS"]), (name, model)
        served.add(model)
    pool_models = [
        d["spec"]["selector"]["matchLabels"]["tokenbus.dev/model"] for d in pools.values()
    ]
    assert len(set(pool_models)) == len(pools)  # no two pools select each other's pods
    # A request that names no model runs on the default one, which is served.
    (scheduler,) = named(docs, "Deployment", "scheduler")["spec"]["template"]["spec"]["containers"]
    values = config_values(docs, scheduler)
    assert set(json.loads(values["TOKENBUS_SERVED_MODELS"])) == served
    assert values["TOKENBUS_SCHEDULER_DEFAULT_MODEL"] in served
