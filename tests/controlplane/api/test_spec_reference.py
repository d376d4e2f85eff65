"""The job spec's reference rows (``trainer.spec_reference.reference_rows``: what docs/reference/job-spec.md is made
of) and the operator API's OpenAPI document agree field by field: both come from the one type."""

import json

import msgspec

from controlplane.api import openapi
from controlplane.jobs.spec import JobSpec, reference_rows

BOUNDS = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}


def _schemas():
    doc = openapi.document()
    schemas = doc["components"]["schemas"]
    return doc, schemas


def _resolve(prop, schemas):
    if "$ref" in prop:
        return schemas[prop["$ref"].rsplit("/", 1)[-1]]
    return prop


def test_it_types_the_spec_of_a_new_job_and_of_a_shown_job_field_by_field():
    _, schemas = _schemas()
    for name in ("JobCreate", "Job"):
        spec = schemas[name]["properties"]["spec"]
        assert spec["$ref"].endswith("/JobSpec"), spec
    assert set(schemas["JobSpec"]["properties"]) == set(JobSpec.__struct_fields__)
    assert schemas["JobSpec"]["additionalProperties"] is False


def test_the_reference_rows_and_the_openapi_document_agree():
    _, schemas = _schemas()
    owners = {"": schemas["JobSpec"], "kubernetes.": schemas["KubernetesSpec"], "drills[].": schemas["Drill"]}
    rows = reference_rows()
    assert {r.name for r in rows if "." not in r.name} == set(JobSpec.__struct_fields__)
    for row in rows:
        prefix = row.name[: row.name.rfind(".") + 1]
        prop = owners[prefix]["properties"][row.name[len(prefix) :]]
        assert prop.get("description", "") == row.description, row.name
        assert row.description, f"{row.name} has no description"
        if row.default != "(required)":
            assert json.loads(msgspec.json.encode(prop.get("default"))) == json.loads(row.default), row.name
        bounds = ", ".join(f"{op} {prop[k]:g}" for k, op in BOUNDS.items() if k in prop)
        assert sorted(bounds.split(", ")) == sorted(row.bounds.split(", ")), row.name
        target = _resolve(prop.get("anyOf", [prop])[0], schemas)
        if "enum" in target:
            assert set(row.type.split(" | ")) == set(target["enum"]), row.name


def test_a_row_says_what_the_field_is():
    rows = {r.name: r for r in reference_rows()}
    assert rows["step_timeout_s"].default == "30.0" and rows["step_timeout_s"].bounds == ">= 0.1, <= 604800"
    assert rows["backend"].type == "local | kubernetes"
    assert rows["straggler_window_s"].bounds == ">= 1, <= 600"
    assert rows["kubernetes.image_pull_policy"].type == "Always | IfNotPresent | Never"
    assert rows["drills[].step"].default == "(required)"
