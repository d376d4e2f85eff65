"""The hand-kept parts of the docs stay true to the code: every environment variable the code reads is on the
environment page, the benchmark table has one row per ``make bench-*`` target, the job specification's
generated reference describes every field, and the README stays a front door."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VARIABLE = re.compile(r"\b(UNBROKEN_[A-Z0-9_]*[A-Z0-9]|DATABASE_URL|REDIS_URL|KUBECONFIG)\b")


def _gen_reference():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_it_documents_every_environment_variable_the_code_reads():
    read = {m.group(1) for d in ("controlplane", "trainer") for p in (ROOT / d).rglob("*.py")
            for m in VARIABLE.finditer(p.read_text())}
    page = (ROOT / "docs" / "reference" / "environment.md").read_text()
    documented = set(VARIABLE.findall(page))
    # A family written once with its suffixes: UNBROKEN_EMAIL_PASSWORD (`_FILE`).
    missing = sorted(v for v in read - documented if not (v.endswith("_FILE") and v[:-5] in documented))
    assert not missing, f"read by the code, not on docs/reference/environment.md: {missing}"
    stale = sorted(documented - read - {v + "_FILE" for v in read})
    assert not stale, f"on docs/reference/environment.md, read by no code: {stale}"


def test_it_has_one_benchmark_row_per_make_target():
    targets = sorted(set(re.findall(r"^bench-([a-z]+):", (ROOT / "Makefile").read_text(), re.M)))
    table = (ROOT / "docs" / "benchmarks.md").read_text().split("## Method notes")[0]
    rows = re.findall(r"^\| \[`make bench-([a-z]+)[^`]*`\]\(#", table, re.M)
    assert sorted(set(rows)) == targets, (rows, targets)
    notes = re.findall(r"^### ([a-z]+)$", (ROOT / "docs" / "benchmarks.md").read_text(), re.M)
    assert sorted(notes) == targets


def test_it_describes_every_field_of_the_job_spec():
    text = _gen_reference().spec_reference()
    from controlplane.jobs.spec import JobSpec, KubernetesSpec

    for cls in (JobSpec, KubernetesSpec):
        names = getattr(cls, "__struct_fields__", None) or cls.__dataclass_fields__  # a msgspec Struct or not
        for name in names:
            row = re.search(rf"^\| `{name}` \|(.*)\|$", text, re.M)
            assert row, f"{cls.__name__}.{name} is not in the generated reference"
            assert row.group(1).rstrip().split("|")[-1].strip(), f"{cls.__name__}.{name} has no meaning"
    assert "`heartbeat_interval_s`" in text and "`checkpoint_timeout_s`" in text


def test_it_keeps_the_readme_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "make up" in readme and "make test" in readme
    dated = re.findall(r"\b20\d\d-\d\d-\d\d\b", readme)
    assert not dated, f"no dated history in the README (figures go to docs/benchmarks.md): {dated}"
    for target in re.findall(r"\]\(((?:docs|trainer|deploy)/[^)#]+)", readme):
        assert (ROOT / target).exists(), f"the README links to {target}, which does not exist"
