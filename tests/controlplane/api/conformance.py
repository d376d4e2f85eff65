"""Checks an operator API answer against the served OpenAPI document (jsonschema, draft 2020-12)."""

from __future__ import annotations

import re

import jsonschema


def conforms(doc: dict, method: str, url: str, response) -> None:
    """The response's status is declared for the path and its body is valid against the declared schema."""
    path = url.split("?")[0]
    for template, ops in doc["paths"].items():
        if re.fullmatch(re.sub(r"\{[^}]+\}", r"[^/]+", template), path):
            declared = ops[method]["responses"]
            break
    else:
        raise AssertionError(f"{path} is not in the document")
    assert str(response.status_code) in declared, f"{response.status_code} not declared for {method} {path}"
    schema = declared[str(response.status_code)]["content"]["application/json"]["schema"]
    assert response["Content-Type"] == "application/json"
    jsonschema.validate(response.json(), {**schema, "components": doc["components"]},
                        cls=jsonschema.Draft202012Validator, format_checker=jsonschema.FormatChecker())
