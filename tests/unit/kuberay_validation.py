"""Strict, offline validation of Kubernetes manifests against the KubeRay CRD schemas (test helper).

A CRD's ``openAPIV3Schema`` is OpenAPI v3 with Kubernetes extensions; ``crd_json_schema`` turns it
into a JSON schema that ``jsonschema`` checks the way ``kubectl apply --validate=strict`` would:

* ``x-kubernetes-int-or-string: true``  -> ``type: [integer, string]``
* ``nullable: true``                    -> ``null`` added to the allowed types
* ``x-kubernetes-preserve-unknown-fields: true`` -> unknown keys allowed at that node only;
  every other object gets ``additionalProperties: false`` (an unknown or misspelt field is an error)
* other ``x-kubernetes-*`` keys (list types, map types, CEL rules) are dropped: CEL rules and
  the operator's webhook checks are not covered here (tests/unit/test_kuberay_manifests.py
  checks the few KubeRay rules our manifests touch by hand).

The root ``metadata`` is declared as a bare object in every CRD (the API server validates
ObjectMeta itself); it is checked against ``OBJECT_META`` instead.

The KubeRay v1.7.0 CRDs are vendored in tests/data/kuberay-crds (see the README there).
"""

from __future__ import annotations

import functools
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jsonschema
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CRD_DIR = REPO_ROOT / "tests" / "data" / "kuberay-crds"
KUBERAY_DIR = REPO_ROOT / "deploy" / "kuberay"
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml"}

_SCHEMA_KEYS = ("properties", "patternProperties")
_SUBSCHEMA_KEYS = ("items", "additionalProperties", "not")
_SUBSCHEMA_LIST_KEYS = ("allOf", "anyOf", "oneOf")
_DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}

# The fields of metav1.ObjectMeta a manifest may set (server-set ones are refused).
OBJECT_META: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "maxLength": 253, "pattern": _DNS1123_SUBDOMAIN},
        "namespace": {"type": "string", "maxLength": 63, "pattern": _DNS1123_LABEL},
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
    },
}


def crd_json_schema(node: Any) -> Any:
    """The JSON-schema form of one OpenAPI v3 schema node of a CRD (see the module docstring)."""
    if not isinstance(node, dict):
        return node
    schema: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key in ("nullable", "description"):
            continue
        if key in _SCHEMA_KEYS:
            schema[key] = {name: crd_json_schema(child) for name, child in value.items()}
        elif key in _SUBSCHEMA_KEYS and isinstance(value, dict):
            schema[key] = crd_json_schema(value)
        elif key in _SUBSCHEMA_LIST_KEYS:
            schema[key] = [crd_json_schema(child) for child in value]
        else:
            schema[key] = value
    if node.get("x-kubernetes-int-or-string"):
        schema["type"] = ["integer", "string"]
    if node.get("nullable"):
        kinds = schema.get("type")
        if kinds is not None:
            schema["type"] = [*(kinds if isinstance(kinds, list) else [kinds]), "null"]
        if "enum" in schema:
            schema["enum"] = [*schema["enum"], None]
    is_object = schema.get("type") == "object" or "properties" in schema
    if is_object and "additionalProperties" not in schema and not node.get("x-kubernetes-preserve-unknown-fields"):
        schema["additionalProperties"] = False
    return schema


@functools.cache
def crd_schema(kind: str, version: str = "v1") -> dict[str, Any]:
    """The strict JSON schema of ``kind`` (RayCluster, RayJob) at ``version`` from the vendored CRD."""
    crd = load_yaml_documents((CRD_DIR / CRD_FILES[kind]).read_text())[0]
    (openapi,) = [entry["schema"]["openAPIV3Schema"] for entry in crd["spec"]["versions"] if entry["name"] == version]
    schema = crd_json_schema(openapi)
    schema["properties"]["metadata"] = OBJECT_META
    schema["required"] = sorted({*schema.get("required", ()), "apiVersion", "kind", "metadata", "spec"})
    return schema


def validation_errors(manifest: dict[str, Any]) -> list[str]:
    """Every schema violation of one KubeRay manifest, as 'Kind/name: $.path: message' lines."""
    kind = manifest.get("kind")
    group, _, version = str(manifest.get("apiVersion", "")).partition("/")
    if kind not in CRD_FILES or group != "ray.io":
        return [f"{kind}: not a KubeRay resource (apiVersion {manifest.get('apiVersion')!r})"]
    validator = jsonschema.Draft4Validator(crd_schema(kind, version))
    name = (manifest.get("metadata") or {}).get("name", "?")
    return sorted(f"{kind}/{name}: {error.json_path}: {error.message}" for error in validator.iter_errors(manifest))


def render(directory: Path | str) -> list[dict[str, Any]]:
    """``kubectl kustomize DIRECTORY`` (offline), parsed."""
    try:
        result = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        raise AssertionError(
            "kubectl is not installed: the manifest checks render with `kubectl kustomize` "
            "(offline, no cluster needed); install kubectl >= 1.27"
        ) from None
    if result.returncode != 0:
        raise AssertionError(f"kubectl kustomize {directory} failed:\n{result.stderr}")
    return load_yaml_documents(result.stdout)


def load_yaml_documents(text: str) -> list[Any]:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the CRDs are megabytes
    return [document for document in yaml.load_all(text, Loader=loader) if document is not None]


def pod_templates(manifest: dict[str, Any]) -> Iterable[tuple[str, dict[str, Any]]]:
    """(group name, pod template) of a RayCluster: the head first, then each worker group."""
    spec = manifest["spec"]
    yield "head", spec["headGroupSpec"]["template"]
    for group in spec.get("workerGroupSpecs", []):
        yield group["groupName"], group["template"]
