"""The Kubernetes manifests, offline: schemas, the serveConfigV2 and dashboard drift, pool sizing, scraping.

The RayService is validated against the KubeRay CRD's OpenAPI v3 schema (k8s/schemas/), its pod
templates and the metrics Service against Kubernetes' own schemas (`kubernetes-validate`, strict:
unknown fields fail). serveConfigV2 must be deploy/cluster-gpu.yaml verbatim, the Grafana ConfigMap's
JSON deploy/grafana/specserve-dashboard.json, and each worker group must fit its pool: the target
group tp_size GPUs per pod, the draft group one replica per GPU. The PodMonitor (a Prometheus Operator
CRD, whose schema is not vendored) must select every group and scrape its metrics port.
"""

from __future__ import annotations

import copy
import json
import math
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from deploy import k8s
from deploy.app import app_builder
from deploy.config import AppConfig

K8S = Path(k8s.REPO) / "k8s"
KUBERNETES = "1.33.0"
Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@cache
def crd_schema() -> dict[str, Any]:
    crd = yaml.load((K8S / "schemas" / "ray.io_rayservices.yaml").read_text(), Loader=Loader)
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return strict(version["schema"]["openAPIV3Schema"])


def strict(schema: Any) -> Any:
    """Unknown fields are errors, as `kubectl apply --validate=strict` reports them (the API server
    would otherwise prune them silently); objects that preserve unknown fields stay open."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: strict(v) if k in ("properties", "items", "additionalProperties") or isinstance(v, dict) else v
        for k, v in schema.items()
    }
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def rayservice() -> dict[str, Any]:
    return dict(yaml.safe_load(k8s.RAYSERVICE.read_text()))


def groups(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    cluster = service["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"], **{g["groupName"]: g for g in cluster["workerGroupSpecs"]}}


def validate_rayservice(service: dict[str, Any]) -> None:
    assert service["apiVersion"] == "ray.io/v1" and service["kind"] == "RayService"
    jsonschema.validate(service, crd_schema())
    for name, group in groups(service).items():
        template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": name},
            "template": group["template"],
        }
        kubernetes_validate.validate(template, KUBERNETES, strict=True)


def test_rayservice_serve_config_is_cluster_gpu_yaml() -> None:
    """The drift test: `make k8s` (python -m deploy.k8s render) leaves the committed file unchanged."""
    assert k8s.rendered() == k8s.RAYSERVICE.read_text(), "k8s/rayservice.yaml drifted: run `make k8s`"
    assert k8s.main(["check"]) == 0
    embedded = rayservice()["spec"]["serveConfigV2"]
    assert yaml.safe_load(embedded) == yaml.safe_load(k8s.SERVE_CONFIG.read_text())


def test_drift_is_detected_and_render_repairs_it() -> None:
    committed = k8s.RAYSERVICE.read_text()
    edited = k8s.SERVE_CONFIG.read_text().replace("tp_size: 2", "tp_size: 4")
    assert k8s.render(committed, edited) != committed
    stale = k8s.render(committed, edited)
    assert k8s.render(stale, k8s.SERVE_CONFIG.read_text()) == committed


def test_rayservice_passes_the_kuberay_and_kubernetes_schemas() -> None:
    validate_rayservice(rayservice())
    schema = ServeDeploySchema.model_validate(yaml.safe_load(rayservice()["spec"]["serveConfigV2"]))
    (app,) = schema.applications
    app_builder(app.args)


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        (("spec", "rayClusterConfig", "workerGroupSpecs", 0, "replica"), 1),  # typo: not in the CRD
        (("spec", "rayClusterConfig", "authOptions", "mode"), "off"),  # enum
        (("spec", "rayClusterConfig", "headGroupSpec", "template", "spec", "containers", 0, "ports", 0), "8000"),
    ],
)
def test_schema_validation_rejects_broken_manifests(path: tuple[Any, ...], bad: Any) -> None:
    service = copy.deepcopy(rayservice())
    node: Any = service
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    with pytest.raises((jsonschema.ValidationError, kubernetes_validate.ValidationError)):
        validate_rayservice(service)


def test_metrics_service_passes_the_kubernetes_schema_and_selects_every_group() -> None:
    service = yaml.safe_load((K8S / "metrics-service.yaml").read_text())
    kubernetes_validate.validate(service, KUBERNETES, strict=True)
    assert service["metadata"]["annotations"]["prometheus.io/port"] == "8080"
    selector = service["spec"]["selector"].items()
    for name, group in groups(rayservice()).items():
        assert selector <= group["template"]["metadata"]["labels"].items(), name
        assert group["rayStartParams"]["metrics-export-port"] == "8080", name
        (container,) = group["template"]["spec"]["containers"]
        assert container["readinessProbe"] and container["livenessProbe"], name


def limits(group: dict[str, Any]) -> dict[str, float]:
    (container,) = group["template"]["spec"]["containers"]
    raw = container["resources"]["limits"]
    return {"cpu": float(raw["cpu"]), "gpu": float(raw.get("nvidia.com/gpu", 0))}


def node_resources(group: dict[str, Any]) -> dict[str, float]:
    return dict(json.loads(json.loads(group["rayStartParams"]["resources"])))


def test_worker_groups_fit_their_pools() -> None:
    service = rayservice()
    (app,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    config = AppConfig.model_validate(app["args"])
    by_name = groups(service)
    draft, target = by_name["draft-gpu"], by_name["target-gpu"]
    assert config.device == "cuda" and not limits(by_name["head"])["gpu"]

    pool = config.target_pool
    assert limits(target)["gpu"] == config.tp_size * pool.shard_num_gpus  # one TP replica per pod
    assert limits(target)["cpu"] >= config.tp_size * pool.shard_num_cpus + pool.replica_num_cpus
    assert pool.resources.keys() <= node_resources(target).keys()
    assert target["maxReplicas"] >= pool.autoscaling.max_replicas
    assert target["minReplicas"] >= pool.autoscaling.min_replicas

    per_pod = min(limits(draft)["gpu"] / config.draft_pool.num_gpus, limits(draft)["cpu"] / config.draft_pool.num_cpus)
    assert per_pod >= 1 and config.draft_pool.resources.keys() <= node_resources(draft).keys()
    assert draft["maxReplicas"] * math.floor(per_pod) >= config.draft_pool.autoscaling.max_replicas
    assert not (pool.resources.keys() & node_resources(draft).keys()), "pools must not share a node type"


def test_grafana_dashboard_configmap_holds_the_dashboard_for_grafanas_sidecar() -> None:
    configmap = yaml.safe_load(k8s.DASHBOARD_CONFIGMAP.read_text())
    kubernetes_validate.validate(configmap, KUBERNETES, strict=True)
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"  # the sidecar's default label
    (text,) = configmap["data"].values()
    assert json.loads(text) == json.loads(k8s.DASHBOARD.read_text())
    block = k8s.BLOCKS[1]
    committed, edited = block.manifest.read_text(), block.source.read_text().replace("specserve", "renamed")
    stale = k8s.render(committed, edited, block.key)
    assert stale != committed and k8s.render(stale, block.source.read_text(), block.key) == committed


def test_podmonitor_scrapes_the_metrics_port_of_every_group() -> None:
    monitor = yaml.safe_load((K8S / "podmonitor.yaml").read_text())
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "PodMonitor"
    # No Prometheus Operator schema here: its metadata is checked as Kubernetes' own, its spec by name.
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": monitor["metadata"]}, KUBERNETES)
    assert monitor["spec"].keys() <= {"selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel"}
    selector = monitor["spec"]["selector"]["matchLabels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    for name, group in groups(rayservice()).items():
        assert selector <= group["template"]["metadata"]["labels"].items(), name
        (container,) = group["template"]["spec"]["containers"]
        ports = {p["name"]: str(p["containerPort"]) for p in container["ports"]}
        assert ports[endpoint["port"]] == group["rayStartParams"]["metrics-export-port"], name
