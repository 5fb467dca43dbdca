"""The CRD validator itself: it must refuse what the API server refuses in strict mode.

python -m pytest tests/unit/test_kuberay_validator.py -q
"""

from __future__ import annotations

import copy

import jsonschema
import pytest

from tests.unit.kuberay_validation import CRD_DIR, CRD_FILES, KUBERAY_DIR, crd_json_schema, render, validation_errors


@pytest.fixture(scope="module")
def raycluster():
    (cluster,) = [doc for doc in render(KUBERAY_DIR / "base") if doc["kind"] == "RayCluster"]
    assert validation_errors(cluster) == []
    return cluster


def test_a_misspelt_field_is_rejected(raycluster):
    bad = copy.deepcopy(raycluster)
    bad["spec"]["workerGroupSpecs"][1]["maxReplica"] = bad["spec"]["workerGroupSpecs"][1].pop("maxReplicas")
    assert validation_errors(bad) == [
        "RayCluster/meshpilot: $.spec.workerGroupSpecs[1]: 'maxReplicas' is a required property",
        "RayCluster/meshpilot: $.spec.workerGroupSpecs[1]: "
        "Additional properties are not allowed ('maxReplica' was unexpected)",
    ]


def test_a_misspelt_field_deep_in_the_pod_spec_is_rejected(raycluster):
    bad = copy.deepcopy(raycluster)
    bad["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"] = {
        "comand": ["python"]
    }
    assert validation_errors(bad) == [
        "RayCluster/meshpilot: $.spec.workerGroupSpecs[0].template.spec.containers[0].lifecycle.preStop.exec: "
        "Additional properties are not allowed ('comand' was unexpected)"
    ]


def test_a_wrong_type_is_rejected(raycluster):
    bad = copy.deepcopy(raycluster)
    bad["spec"]["workerGroupSpecs"][1]["template"]["spec"]["terminationGracePeriodSeconds"] = "90s"
    bad["spec"]["enableInTreeAutoscaling"] = "yes"
    assert validation_errors(bad) == [
        "RayCluster/meshpilot: $.spec.enableInTreeAutoscaling: 'yes' is not of type 'boolean'",
        "RayCluster/meshpilot: $.spec.workerGroupSpecs[1].template.spec.terminationGracePeriodSeconds: "
        "'90s' is not of type 'integer'",
    ]


def test_metadata_is_checked_strictly_too(raycluster):
    bad = copy.deepcopy(raycluster)
    bad["metadata"]["lables"] = bad["metadata"].pop("labels")
    assert validation_errors(bad) == [
        "RayCluster/meshpilot: $.metadata: Additional properties are not allowed ('lables' was unexpected)"
    ]


def test_an_unknown_kind_is_not_silently_accepted():
    assert validation_errors({"apiVersion": "ray.io/v1", "kind": "RayClustr", "metadata": {"name": "x"}}) == [
        "RayClustr: not a KubeRay resource (apiVersion 'ray.io/v1')"
    ]


def test_kubernetes_extensions_are_translated():
    schema = crd_json_schema(
        {
            "type": "object",
            "properties": {
                "port": {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True},
                "maybe": {"type": "string", "nullable": True, "enum": ["a"]},
                "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                "closed": {"type": "object", "x-kubernetes-map-type": "atomic"},
            },
        }
    )
    validator = jsonschema.Draft4Validator(schema)
    assert validator.is_valid({"port": 8080, "maybe": None, "free": {"anything": {"goes": 1}}, "closed": {}})
    assert validator.is_valid({"port": "metrics", "maybe": "a"})
    assert sorted(error.message for error in validator.iter_errors({"port": 1.5})) == [
        "1.5 is not of type 'integer', 'string'",
        "1.5 is not valid under any of the given schemas",
    ]
    assert [error.message for error in validator.iter_errors({"closed": {"x": 1}})] == [
        "Additional properties are not allowed ('x' was unexpected)"
    ]
    assert [error.message for error in validator.iter_errors({"extra": 1})] == [
        "Additional properties are not allowed ('extra' was unexpected)"
    ]


@pytest.mark.parametrize("kind", sorted(CRD_FILES))
def test_the_crds_schematise_embedded_pod_specs_fully(kind):
    """No subtree of the v1.7.0 CRDs keeps unknown fields, so the CRD schema alone checks the pod
    templates (containers, lifecycle, volumes, ...). Should a later CRD mark a subtree
    preserve-unknown, this fails, and that subtree needs its own schema (core/v1 PodSpec)."""
    assert "x-kubernetes-preserve-unknown-fields" not in (CRD_DIR / CRD_FILES[kind]).read_text()
