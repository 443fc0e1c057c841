"""The Kubernetes manifests, offline: schemas, the serveConfigV2 and dashboard drift, pool sizing, scraping, probes,
the model cache, the upgrade strategy and the GCS fault tolerance option.

The RayService is validated against the KubeRay CRD's OpenAPI v3 schema (k8s/schemas/), its pod
templates, the metrics Service, the model cache's claim and Job against Kubernetes' own schemas
(`kubernetes-validate`, strict: unknown fields fail). serveConfigV2 must be deploy/cluster-gpu.yaml verbatim,
the Grafana ConfigMap's JSON deploy/grafana/specserve-dashboard.json, and each worker group must fit its pool:
the target group tp_size GPUs per pod, the draft group one replica per GPU. The PodMonitor (a Prometheus
Operator CRD, whose schema is not vendored) must select every group and scrape its metrics port. The Ray
containers leave their probes to KubeRay, every pod reads the models from one claim that a Job fills with
serveConfigV2's models, the upgrade strategy is None, and k8s/gcs-ft/'s patch keeps the RayService valid.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import subprocess
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


def models() -> dict[str, dict[str, Any]]:
    """k8s/models.yaml's documents by kind: the PersistentVolumeClaim and the Job that fills it."""
    return {doc["kind"]: doc for doc in yaml.safe_load_all((K8S / "models.yaml").read_text())}


def serve_app() -> AppConfig:
    (app,) = yaml.safe_load(rayservice()["spec"]["serveConfigV2"])["applications"]
    return AppConfig.model_validate(app["args"])


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
        (("spec", "upgradeStrategy", "maxSurge"), 1),  # not in the CRD
        (("spec", "rayClusterConfig", "gcsFaultToleranceOptions"), {"backend": "etcd"}),  # enum
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
    job = models()["Job"]["spec"]["template"]["metadata"]["labels"].items()
    assert not selector <= job, "the models Job's pod serves no metrics: the Service must not select it"


def limits(group: dict[str, Any]) -> dict[str, float]:
    (container,) = group["template"]["spec"]["containers"]
    raw = container["resources"]["limits"]
    return {"cpu": float(raw["cpu"]), "gpu": float(raw.get("nvidia.com/gpu", 0))}


def node_resources(group: dict[str, Any]) -> dict[str, float]:
    return dict(json.loads(json.loads(group["rayStartParams"]["resources"])))


def test_worker_groups_fit_their_pools() -> None:
    service = rayservice()
    config = serve_app()
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


def test_ray_containers_leave_their_probes_to_kuberay() -> None:
    """KubeRay injects a probe only where the Ray container has none; on a RayService worker its readiness probe
    also asks the Serve proxy's /-/healthz on the container port named `serve` (8000 when there is none)."""
    http_port = yaml.safe_load(rayservice()["spec"]["serveConfigV2"])["http_options"]["port"]
    for name, group in groups(rayservice()).items():
        ray = group["template"]["spec"]["containers"][0]
        assert "readinessProbe" not in ray and "livenessProbe" not in ray, f"{name}: a probe of its own"
        ports = {p["name"]: p["containerPort"] for p in ray["ports"]}
        assert ports["serve"] == http_port, name


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def claim_mounts(pod: dict[str, Any]) -> dict[str, str]:
    """claim name -> where the pod's first container mounts it."""
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v
    }
    return {claims[m["name"]]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"] if m["name"] in claims}


def test_every_pod_reads_the_models_from_the_claim_the_job_fills() -> None:
    docs = models()
    claim, job = docs["PersistentVolumeClaim"], docs["Job"]
    for doc in (claim, job):
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"], "the head and every worker, on any node"
    name = claim["metadata"]["name"]

    filler = job["spec"]["template"]["spec"]
    (fetch,) = filler["containers"]
    path = env(fetch)["SPECSERVE_MODELS"]
    assert claim_mounts(filler) == {name: path}
    assert fetch["command"][:4] == ["python", "-m", "modelstore", "fetch"]
    config = serve_app()
    assert set(fetch["command"][4:]) == {config.target_model, config.draft_model}, "what serveConfigV2 serves"

    images = {fetch["image"]}
    for group_name, group in groups(rayservice()).items():
        pod = group["template"]["spec"]
        ray = pod["containers"][0]
        images.add(ray["image"])
        assert env(ray)["SPECSERVE_MODELS"] == path, group_name
        assert claim_mounts(pod) == {name: path}, group_name
        scratch = [v for v in pod["volumes"] if "emptyDir" in v]
        assert all(v["emptyDir"].get("medium") == "Memory" for v in scratch), f"{group_name}: a model cache per pod"
    assert len(images) == 1, images


def test_the_upgrade_strategy_never_starts_a_second_cluster() -> None:
    """The CRD leaves `type` a string; KubeRay's validation takes these three. NewCluster (the default when
    unset) starts a whole second cluster, twice the GPUs; NewClusterWithIncrementalUpgrade needs a Gateway."""
    strategy = rayservice()["spec"]["upgradeStrategy"]
    assert strategy == {"type": "None"}
    assert strategy["type"] in {"NewCluster", "NewClusterWithIncrementalUpgrade", "None"}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch, as kustomize applies a patch to a custom resource (maps merge, the rest replaces)."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def test_gcs_fault_tolerance_component_patches_a_valid_rayservice(tmp_path: Path) -> None:
    base = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert base["resources"] == ["models.yaml", "rayservice.yaml", "metrics-service.yaml"]
    assert "#   - gcs-ft" in (K8S / "kustomization.yaml").read_text(), "the line that turns the component on"
    component = yaml.safe_load((K8S / "gcs-ft" / "kustomization.yaml").read_text())
    assert component["kind"] == "Component"
    (entry,) = component["patches"]
    patch = yaml.safe_load((K8S / "gcs-ft" / entry["path"]).read_text())
    service = rayservice()
    assert (patch["kind"], patch["metadata"]["name"]) == (service["kind"], service["metadata"]["name"])

    patched = merge_patch(service, patch)
    validate_rayservice(patched)
    options = patched["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    assert options["redisAddress"] and options["redisPassword"]["valueFrom"]["secretKeyRef"]["key"]
    assert (
        patched["spec"]["rayClusterConfig"].keys() - {"gcsFaultToleranceOptions"}
        == service["spec"]["rayClusterConfig"].keys()
    )

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl: kustomize's own build is not compared")
    shutil.copytree(K8S, tmp_path / "k8s")
    on = (tmp_path / "k8s" / "kustomization.yaml").read_text().replace("# components:", "components:")
    (tmp_path / "k8s" / "kustomization.yaml").write_text(on.replace("#   - gcs-ft", "  - gcs-ft"))
    built = subprocess.run([kubectl, "kustomize", str(tmp_path / "k8s")], capture_output=True, text=True, check=True)
    (rendered,) = [d for d in yaml.safe_load_all(built.stdout) if d["kind"] == "RayService"]
    assert rendered == patched
