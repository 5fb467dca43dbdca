"""Every manifest deploy/kuberay renders, checked offline: KubeRay CRD schemas in strict mode, the
PodMonitor's structure, and the wiring between pieces (secrets, drain hook, metrics, job config).

    python -m pytest tests/unit/test_kuberay_manifests.py -q

``kubectl kustomize`` renders each kustomization (no cluster needed); RayCluster and RayJob are
validated against the vendored KubeRay v1.7.0 CRDs (tests/unit/kuberay_validation.py).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from orchestrator.config import config_from_dict
from tests.unit.kuberay_validation import KUBERAY_DIR, REPO_ROOT, pod_templates, render, validation_errors

KUSTOMIZATIONS = ("base", "overlays/cpu-dev", "overlays/gpu")
HOOK_SOURCE = KUBERAY_DIR / "base" / "hooks" / "drain_node.py"
SECRET_ENV = re.compile(r"(^AWS_|SECRET|TOKEN|PASSWORD|CREDENTIAL|_KEY$|_KEY_ID$)")
IANA_SVC_NAME = re.compile(r"^(?=.{1,15}$)(?=.*[a-z])[a-z0-9]+(-[a-z0-9]+)*$")

# monitoring.coreos.com/v1 PodMonitor, the fields this project uses, as the Prometheus Operator's
# API reference defines them (PodMonitorSpec, PodMetricsEndpoint, LabelSelector). Strict: a
# misspelt field is an error here, as it would be for an API server with the operator's CRD.
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
PODMONITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"enum": ["monitoring.coreos.com/v1"]},
        "kind": {"enum": ["PodMonitor"]},
        "metadata": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "namespace": {"type": "string"},
                "labels": _LABELS,
                "annotations": _LABELS,
            },
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "jobLabel": {"type": "string"},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "minProperties": 1,
                    "properties": {"matchLabels": _LABELS, "matchExpressions": {"type": "array"}},
                },
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["port"],
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": _DURATION,
                            "scrapeTimeout": _DURATION,
                            "honorLabels": {"type": "boolean"},
                        },
                    },
                },
            },
        },
    },
}
PRIORITYCLASS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "value"],
    "properties": {
        "apiVersion": {"enum": ["scheduling.k8s.io/v1"]},
        "kind": {"enum": ["PriorityClass"]},
        "metadata": PODMONITOR_SCHEMA["properties"]["metadata"],
        "value": {"type": "integer", "minimum": -2147483648, "maximum": 1000000000},
        "globalDefault": {"type": "boolean"},
        "description": {"type": "string"},
        "preemptionPolicy": {"enum": ["Never", "PreemptLowerPriority"]},
    },
}


@functools.cache
def rendered(kustomization: str) -> tuple[dict, ...]:
    return tuple(render(KUBERAY_DIR / kustomization))


def one(kustomization: str, kind: str, name: str | None = None) -> dict:
    found = [doc for doc in rendered(kustomization) if doc["kind"] == kind and name in (None, doc["metadata"]["name"])]
    assert len(found) == 1, f"{kustomization}: expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def containers(template: dict) -> list[dict]:
    return template["spec"]["containers"]


@pytest.fixture(params=KUSTOMIZATIONS)
def kustomization(request) -> str:
    return request.param


def test_renders_the_expected_objects(kustomization):
    kinds = sorted(f"{doc['kind']}/{doc['metadata']['name']}" for doc in rendered(kustomization))
    assert kinds == [
        "ConfigMap/meshpilot-hooks",
        "ConfigMap/meshpilot-job",
        "PodMonitor/meshpilot",
        "PriorityClass/meshpilot-head",
        "PriorityClass/meshpilot-on-demand",
        "PriorityClass/meshpilot-spot",
        "RayCluster/meshpilot",
        "RayJob/meshpilot-train",
    ]


def test_kuberay_objects_validate_strictly_against_the_v1_7_0_crds(kustomization):
    for kind in ("RayCluster", "RayJob"):
        assert validation_errors(one(kustomization, kind)) == []


def test_podmonitor_structure_and_targets(kustomization):
    monitor = one(kustomization, "PodMonitor")
    jsonschema.Draft4Validator(PODMONITOR_SCHEMA).validate(monitor)
    templates = dict(pod_templates(one(kustomization, "RayCluster")))
    selector = monitor["spec"]["selector"]["matchLabels"]
    for group, template in templates.items():  # every Ray pod is scraped
        assert selector.items() <= template["metadata"]["labels"].items(), group
    port_names = {
        group: {port["name"] for c in containers(t) for port in c.get("ports", [])} for group, t in templates.items()
    }
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        assert any(endpoint["port"] in names for names in port_names.values()), endpoint
    assert all("metrics" in names for names in port_names.values())  # Ray's metrics on every node
    assert "driver-metrics" in port_names["head"]  # meshpilot_* from the driver
    for label in monitor["spec"]["podTargetLabels"]:
        assert any(label in t["metadata"]["labels"] for t in templates.values()), label


def test_priority_classes_exist_and_are_ordered(kustomization):
    classes = {doc["metadata"]["name"]: doc for doc in rendered(kustomization) if doc["kind"] == "PriorityClass"}
    for priority_class in classes.values():
        jsonschema.Draft4Validator(PRIORITYCLASS_SCHEMA).validate(priority_class)
    used = {group: t["spec"]["priorityClassName"] for group, t in pod_templates(one(kustomization, "RayCluster"))}
    assert used == {"head": "meshpilot-head", "on-demand": "meshpilot-on-demand", "spot": "meshpilot-spot"}
    value = {group: classes[name]["value"] for group, name in used.items()}
    assert value["head"] > value["on-demand"] > value["spot"]
    assert classes["meshpilot-spot"]["preemptionPolicy"] == "Never"


def test_worker_groups_on_demand_and_spot(kustomization):
    spec = one(kustomization, "RayCluster")["spec"]
    groups = {group["groupName"]: group for group in spec["workerGroupSpecs"]}
    assert list(groups) == ["on-demand", "spot"]
    for name, group in groups.items():
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], name
        assert group["labels"]["meshpilot.io/capacity"] == name
        template_spec = group["template"]["spec"]
        capacity = template_spec.get("nodeSelector", {}).get("karpenter.sh/capacity-type")
        assert capacity in (None, name), (name, capacity)  # cpu-dev selects no capacity type
    assert groups["on-demand"]["minReplicas"] >= 1  # one replica that a spot reclaim cannot take
    assert {"key": "meshpilot.io/spot", "operator": "Exists", "effect": "NoSchedule"} in groups["spot"]["template"][
        "spec"
    ]["tolerations"]
    if kustomization != "overlays/cpu-dev":
        assert groups["spot"]["template"]["spec"]["nodeSelector"]["karpenter.sh/capacity-type"] == "spot"


def test_autoscaler_is_on_with_a_sensible_idle_timeout(kustomization):
    spec = one(kustomization, "RayCluster")["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["autoscalerOptions"]["version"] == "v2"
    assert 30 <= spec["autoscalerOptions"]["idleTimeoutSeconds"] <= 1800
    # KubeRay v1.7.0 (validation.go): autoscaler v2 needs restartPolicy Never or unset on every Ray pod.
    for group, template in pod_templates(one(kustomization, "RayCluster")):
        assert template["spec"].get("restartPolicy", "Never") == "Never", group


def test_graceful_termination_is_wired_to_the_drain_hook(kustomization):
    hooks = one(kustomization, "ConfigMap", "meshpilot-hooks")
    assert hooks["data"]["drain_node.py"] == HOOK_SOURCE.read_text()
    for group, template in pod_templates(one(kustomization, "RayCluster")):
        if group == "head":
            assert "lifecycle" not in containers(template)[0]  # the head is not drained: it is the cluster
            continue
        spec = template["spec"]
        command = containers(template)[0]["lifecycle"]["preStop"]["exec"]["command"]
        assert command[:2] == ["python", "/etc/meshpilot/hooks/drain_node.py"], group
        assert float(command[command.index("--grace-seconds") + 1]) == spec["terminationGracePeriodSeconds"], group
        assert spec["terminationGracePeriodSeconds"] >= 25, group
        mounts = {m["name"]: m["mountPath"] for m in containers(template)[0]["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert mounts["hooks"] == "/etc/meshpilot/hooks" and volumes["hooks"]["configMap"]["name"] == "meshpilot-hooks"


def test_credentials_come_only_from_secrets(kustomization):
    assert not [doc for doc in rendered(kustomization) if doc["kind"] == "Secret"]
    cluster = one(kustomization, "RayCluster")
    assert cluster["spec"]["authOptions"] == {"mode": "token", "secretName": "meshpilot-ray-auth"}
    for group, template in pod_templates(cluster):
        env = {item["name"]: item for c in containers(template) for item in c.get("env", [])}
        assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= env.keys(), group
        for name, item in env.items():
            if SECRET_ENV.search(name):
                assert "value" not in item and item["valueFrom"]["secretKeyRef"]["name"] == "meshpilot-s3", (
                    group,
                    name,
                )
    job_config = yaml.safe_load(one(kustomization, "ConfigMap", "meshpilot-job")["data"]["job.yaml"])
    assert not re.search(r"(?i)(secret|password|access_key|AKIA)", yaml.safe_dump(job_config))


def test_ports_and_images(kustomization):
    cluster = one(kustomization, "RayCluster")
    images = set()
    for group, template in pod_templates(cluster):
        for container in containers(template):
            images.add(container["image"])
            for port in container.get("ports", []):
                assert IANA_SVC_NAME.match(port["name"]), (group, port["name"])  # Kubernetes refuses longer names
    assert len(images) == 1
    if kustomization != "base":
        assert re.match(r"^[\w./-]+:[\w.-]+$", images.pop())  # overlays pin a tag


def test_kuberay_operator_rules(kustomization):
    """The KubeRay v1.7.0 webhook rules (utils/validation.go) that our manifests could break."""
    cluster, job = one(kustomization, "RayCluster"), one(kustomization, "RayJob")
    dns1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
    assert dns1035.match(cluster["metadata"]["name"]) and len(cluster["metadata"]["name"]) <= 53
    assert dns1035.match(job["metadata"]["name"]) and len(job["metadata"]["name"]) <= 47
    version = tuple(int(part) for part in cluster["spec"]["rayVersion"].split("."))
    assert version >= (2, 52, 0)  # authOptions.mode=token needs Ray 2.52+
    for group in [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]:
        resources_in_start_params = {"num-cpus", "num-gpus", "memory", "resources"} & group["rayStartParams"].keys()
        assert not (resources_in_start_params and "resources" in group)  # one or the other, never both
        assert "labels" not in group["rayStartParams"]  # use the group's labels field
    # clusterSelector mode: no backoffLimit, no suspend, no shutdownAfterJobFinishes.
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    assert not {"backoffLimit", "suspend", "shutdownAfterJobFinishes", "rayClusterSpec"} & job["spec"].keys()


def test_the_job_config_is_a_valid_meshpilot_config_wired_to_the_pods(kustomization):
    cluster, job = one(kustomization, "RayCluster"), one(kustomization, "RayJob")
    raw = yaml.safe_load(one(kustomization, "ConfigMap", "meshpilot-job")["data"]["job.yaml"])
    if raw["data"]["source"] == "text":
        assert raw["data"]["path"] == "/app/data/sample.txt"  # where deploy/Dockerfile puts it
        assert (REPO_ROOT / "data" / "sample.txt").is_file()
        raw["data"]["path"] = str(REPO_ROOT / "data" / "sample.txt")
    config = config_from_dict(raw)
    head = dict(pod_templates(cluster))["head"]
    mounts = {m["name"]: m["mountPath"] for m in containers(head)[0]["volumeMounts"]}
    assert job["spec"]["entrypoint"] == f"meshpilot train {mounts['job-config']}/job.yaml"
    assert job["spec"]["metadata"]["meshpilot_name"] == config.name
    assert (
        config.checkpoint.uri.endswith(f"/{config.name}") and config.checkpoint.resume
    )  # as `meshpilot submit` names it
    driver_port = {p["name"]: p["containerPort"] for p in containers(head)[0]["ports"]}["driver-metrics"]
    assert (config.metrics.host, config.metrics.port) == ("0.0.0.0", driver_port)
    gpus = {group: containers(t)[0]["resources"]["limits"].get("nvidia.com/gpu") for group, t in pod_templates(cluster)}
    if kustomization == "overlays/gpu":
        assert gpus["head"] is None and gpus["on-demand"] == gpus["spot"] == "8"
        assert config.runtime.backend == "nccl" and config.runtime.gpus_per_rank == 1
        assert config.mesh.world_size // config.parallelism.dp_replicate == 8  # one replica group per 8-GPU node
    else:
        assert set(gpus.values()) == {None} and config.runtime.backend == "gloo"


def test_gpu_workers_tolerate_the_gpu_taint():
    for group, template in pod_templates(one("overlays/gpu", "RayCluster")):
        tolerations = template["spec"].get("tolerations", [])
        has_gpu_toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
        assert has_gpu_toleration == (group != "head"), group


def test_every_manifest_file_is_rendered():
    """No stray YAML in deploy/kuberay that no kustomization uses (it would never be validated)."""
    listed: set[Path] = set()
    for kustomization_file in KUBERAY_DIR.rglob("kustomization.yaml"):
        spec = yaml.safe_load(kustomization_file.read_text())
        entries = [*spec.get("resources", []), *[p["path"] for p in spec.get("patches", []) if "path" in p]]
        entries += [f for generator in spec.get("configMapGenerator", []) for f in generator.get("files", [])]
        listed |= {(kustomization_file.parent / entry).resolve() for entry in entries}
        listed.add(kustomization_file.resolve())
    stray = [path for path in KUBERAY_DIR.rglob("*.yaml") if path.resolve() not in listed]
    assert stray == []
