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
    read = {m.group(1) for d in ("controlplane", "trainer", "tests") for p in (ROOT / d).rglob("*.py")
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


def _flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", text))


def test_its_command_line_tables_match_the_parser():
    """The hand-kept overview of docs/reference/cli.md (the generated part below it cannot drift): one row per
    command with every option it has, and the `unbroken run` table with every option of `run`."""
    import click

    group = _gen_reference()._cli_group()
    root = click.Context(group, info_name="unbroken")
    options = {}  # per command, each option's names ({"-f", "--follow"}, {"--wait", "--no-wait"})
    for name in group.list_commands(root):
        cmd = group.get_command(root, name)
        options[name] = [set(p.opts + p.secondary_opts) for p in cmd.params
                         if isinstance(p, click.Option) and "--help" not in p.opts]
    page = (ROOT / "docs" / "reference" / "cli.md").read_text().split("## Every command and option")[0]
    rows = dict(re.findall(r"^\| `unbroken ([a-z]+)([^`]*)` \|", page, re.M))
    assert set(rows) == set(options), f"commands on the page {sorted(rows)}, in the parser {sorted(options)}"
    run_table = page.split("### `unbroken run`")[1].split("\n\n|")[1].split("\n\n")[0]
    rows["run"] = " ".join(line.split("|")[1] for line in run_table.splitlines()[2:])
    for name, text in rows.items():
        shown, names = _flags(text), set().union(*options[name]) if options[name] else set()
        assert shown <= names, f"unbroken {name}: the page shows {sorted(shown - names)}, which it lacks"
        missing = [sorted(o) for o in options[name] if not o & shown]
        assert not missing, f"unbroken {name}: the page leaves out {missing}"


def test_deploy_readme_file_tree_lists_every_file_in_deploy():
    """deploy/README.md opens with the folder's file tree: every file there is under one of its entries, and
    every entry exists."""
    readme = (ROOT / "deploy" / "README.md").read_text()
    tree = readme.split("```\ndeploy/\n", 1)[1].split("```", 1)[0]
    entries = [line.split()[0] for line in tree.splitlines() if line.strip()]
    for entry in entries:
        assert (ROOT / "deploy" / entry).exists(), f"deploy/README.md's tree lists {entry}, which is missing"
    files = [p.relative_to(ROOT / "deploy").as_posix() for p in (ROOT / "deploy").rglob("*")
             if p.is_file() and p.name != "README.md"]
    unlisted = sorted(f for f in files
                      if not any(f == e or f.startswith(e.rstrip("/") + "/") for e in entries))
    assert not unlisted, f"files in deploy/ that deploy/README.md's tree leaves out: {unlisted}"


def test_every_screenshot_is_taken_by_the_browser_tests_and_shown():
    """The pictures of the README and the docs are the browser tests' own (``docs_shot``), so they show the
    pages as they are; none is missing, and none lies unused in docs/img/."""
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    shown = {Path(m).name for p in pages for m in re.findall(r"!\[[^\]]*\]\(([^)\s]+)", p.read_text())}
    taken = {f"{name}.png" for p in (ROOT / "tests" / "browser").rglob("*.py")
             for name in re.findall(r"docs_shot\(\s*\w+,\s*\"([\w-]+)\"", p.read_text())}
    in_folder = {p.name for p in (ROOT / "docs" / "img").iterdir()}
    assert shown <= in_folder, f"pictures shown that docs/img/ lacks: {sorted(shown - in_folder)}"
    assert shown <= taken, f"pictures no browser test takes (they would go stale): {sorted(shown - taken)}"
    assert in_folder <= shown, f"pictures in docs/img/ that no page shows: {sorted(in_folder - shown)}"


def test_the_faults_page_defines_every_fault_class():
    from trainer.wire import FaultClass

    page = (ROOT / "docs" / "concepts" / "faults.md").read_text()
    table = page.split("## Fault classes", 1)[1].split("\n## ", 1)[0]
    named = {c for line in table.splitlines() if line.startswith("| `")
             for c in re.findall(r"`([a-z_]+)`", line.split("|")[1])}
    assert named == {c.value for c in FaultClass}, sorted(named ^ {c.value for c in FaultClass})


def test_only_the_benchmarks_page_has_dates():
    """Figures and their dates live in docs/benchmarks.md; the other pages say how things are, not when."""
    pages = [*(ROOT / "docs").rglob("*.md"), ROOT / "deploy" / "README.md"]
    dated = sorted((p.relative_to(ROOT).as_posix(), d) for p in pages if p.name != "benchmarks.md"
                   for d in re.findall(r"\b20\d\d-\d\d-\d\d\b", p.read_text()))
    assert not dated, f"dates outside docs/benchmarks.md (move the figure there): {dated}"
