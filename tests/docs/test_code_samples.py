"""Every code sample in the README and the docs runs, or is checked against the code it shows.

- The Level-1 diff is exactly what turns ``trainer/examples/plain_fsdp.py`` into ``fsdp_level1.py``
  (indentation and the ``# unbroken`` markers aside; ``...`` stands for unchanged lines).
- The curl examples run, as written, against a live test server: a real ``curl`` with ``--fail``, the docs'
  URL, ``$PASS`` and ``$UNBROKEN_API_TOKEN`` pointed at it.
- Every ``unbroken ...`` and ``python manage.py ...`` line of a shell or CI sample is accepted by that
  command's own parser, every ``pip install ./...`` names a project and extras that exist, every ``make``
  target named exists, and the shell-completion lines print a script.
- The Level-2 sketch makes its SDK calls as ``fsdp_level2.py`` does; every JSON spec sample (the docs'
  and deploy/README.md's) is accepted by the spec's validator.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "trainer" / "examples"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
DOCS_URL = "http://127.0.0.1:8000"


def _blocks(lang: str) -> list[tuple[Path, str]]:
    fence = re.compile(rf"^```{lang}\n(.*?)^```", re.S | re.M)
    return [(p, m.group(1)) for p in PAGES for m in fence.finditer(p.read_text())]


def _code_lines(path: Path) -> list[str]:
    """The file's lines after its module docstring, stripped of indentation and of ``# unbroken`` markers."""
    text = path.read_text()
    body = text.split('"""', 2)[2]
    out = []
    for line in body.splitlines():
        line = re.sub(r"\s*# unbroken.*$", "", line).strip()
        if line:
            out.append(line)
    return out


def _norm(line: str) -> str:
    return line.strip()


def _matches(sample: str, line: str) -> bool:
    """A sample line matches a code line; ``...`` inside a sample line stands for elided arguments."""
    pattern = ".*".join(re.escape(p).replace(r"\ ", " ") for p in sample.split("..."))
    return re.fullmatch(pattern, line) is not None


def test_it_finds_the_level1_diff_in_the_readme_and_the_docs():
    diffs = [p.relative_to(ROOT).as_posix() for p, _ in _blocks("diff")]
    assert "README.md" in diffs and "docs/guides/your-own-script.md" in diffs, diffs


@pytest.mark.parametrize("where,diff", _blocks("diff"), ids=lambda v: v.name if isinstance(v, Path) else "")
def test_it_shows_exactly_what_level1_adds_to_the_plain_script(where, diff):
    plain, level1 = _code_lines(EXAMPLES / "plain_fsdp.py"), _code_lines(EXAMPLES / "fsdp_level1.py")
    added_in_code = [line[2:] for line in difflib.ndiff(plain, level1) if line.startswith(("+ ", "- "))]
    lines = [ln for ln in diff.splitlines() if ln.strip() != "..."]
    added = [_norm(ln[1:]) for ln in lines if ln.startswith("+")]
    context = [_norm(ln[1:]) for ln in lines if ln.startswith(" ")]
    assert not [ln for ln in lines if ln.startswith("-")], "Level 1 removes nothing from the plain script"
    # Every line the diff adds is added by the example, in order, and nothing else is.
    assert added == added_in_code, f"{where}: the diff adds {added}, the examples differ by {added_in_code}"
    # Its context lines are in both scripts, in this order.
    for code in (plain, level1):
        i = 0
        for sample in context:
            while i < len(code) and not _matches(sample, code[i]):
                i += 1
            assert i < len(code), f"{where}: context line {sample!r} is not in the script (in order)"
    # And the added lines sit where the diff puts them: right after the context line before them.
    pos = -1
    for ln in lines:
        text = _norm(ln[1:])
        j = next((k for k in range(pos + 1, len(level1)) if _matches(text, level1[k])), None)
        assert j is not None, f"{where}: {text!r} not found after line {pos} of fsdp_level1.py"
        pos = j


def _curl_commands() -> list[tuple[Path, str]]:
    """Each curl command of the bash blocks, whole: continued lines joined, a quoted body kept together,
    a trailing comment dropped."""
    out = []
    for page, block in _blocks("bash"):
        command = ""
        for line in block.splitlines():
            if not command and not line.startswith("curl "):
                continue
            if command.count("'") % 2 == 0:  # outside a quoted body: a comment ends the line
                line = line.split("  #")[0].rstrip()
            command += line + "\n"
            if command.count("'") % 2 == 0 and not line.endswith("\\"):
                out.append((page, command.strip()))
                command = ""
    return out


def test_it_finds_the_curl_examples():
    pages = {p.relative_to(ROOT).as_posix() for p, _ in _curl_commands()}
    assert {"docs/getting-started.md", "docs/guides/your-own-script.md", "docs/guides/resilience-report.md",
            "docs/reference/cli.md", "docs/reference/operator-api.md"} <= pages


@pytest.mark.django_db(transaction=True)
def test_it_runs_every_curl_example_against_the_server(live_server):
    """In page order: the first POST /api/v1/jobs creates the job that ``/jobs/1`` stands for."""
    if shutil.which("curl") is None:
        pytest.skip("curl is missing: apt-get install -y curl")
    from django.contrib.auth.models import Group, User

    from controlplane.api.tokens import mint_api_token
    from controlplane.jobs.models import Job
    from controlplane.jobs.roles import OPERATORS_GROUP

    password = "docs-example-password"
    operator = User.objects.create_user("operator", password=password)
    operator.groups.add(Group.objects.get_or_create(name=OPERATORS_GROUP)[0])
    _, token = mint_api_token(user=operator, name="docs", requested_by=None)
    env = {**os.environ, "PASS": password, "UNBROKEN_API_TOKEN": token}
    job_id = None
    for page, command in _curl_commands():
        if job_id is not None:
            command = re.sub(rf"{re.escape(DOCS_URL)}/api/v1/jobs/1\b", f"{DOCS_URL}/api/v1/jobs/{job_id}",
                             command)
        assert DOCS_URL in command, f"{page}: {command} (examples use {DOCS_URL})"
        assert "-u operator:$PASS" in command or "Bearer $UNBROKEN_API_TOKEN" in command, (
            f"{page}: {command} (examples sign in as operator:$PASS or with $UNBROKEN_API_TOKEN)")
        # --fail: an example the server answers with an error fails here, whatever flags it shows.
        run = subprocess.run(["bash", "-c", "curl --fail " + command.replace(DOCS_URL, live_server.url)[5:]],
                             capture_output=True, text=True, timeout=60, env=env)
        assert run.returncode == 0, f"{page}: {command}\n{run.stdout}\n{run.stderr}"
        body = json.loads(run.stdout)
        if "/api/v1/jobs -d" in command and job_id is None:
            job_id = body["id"]
            # The demo's restart command acts on a running job: as if its launcher had started it.
            Job.objects.filter(pk=job_id).update(status="running")
    assert job_id is not None


def _statements(source: str) -> list[str]:
    """The statements of a block of Python, one per line: comments dropped, ``a; b`` split, spaces
    normalised."""
    out = []
    for line in source.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        out.extend(" ".join(part.split()) for part in line.split(";") if part.strip())
    return out


@pytest.mark.parametrize("where,sample", _blocks("python"),
                         ids=lambda v: v.name if isinstance(v, Path) else "")
def test_it_makes_every_sdk_call_of_a_python_sample_as_the_level2_example_does(where, sample):
    """The Level-2 sketch parses, and every SDK call it shows is a line of ``fsdp_level2.py``, in its
    order."""
    import ast

    ast.parse(sample)
    example = _statements((EXAMPLES / "fsdp_level2.py").read_text())
    calls = [s for s in _statements(sample)
             if ("ctx." in s or s.startswith("@unbroken")) and not s.startswith("def ")]
    assert calls, f"{where}: a python sample without SDK calls"
    i = 0
    for call in calls:
        while i < len(example) and example[i] != call:
            i += 1
        assert i < len(example), f"{where}: {call!r} is not in trainer/examples/fsdp_level2.py (in order)"


def _spec_samples() -> list[tuple[Path, dict]]:
    """Every JSON sample that is a job spec or a part of one (a fragment ``"name": value`` is wrapped in
    {})."""
    out = []
    for page, block in _blocks("json") + [(ROOT / "deploy" / "README.md", m.group(1)) for m in re.finditer(
            r"^```json\n(.*?)^```", (ROOT / "deploy" / "README.md").read_text(), re.S | re.M)]:
        text = block.strip()
        out.append((page, json.loads("{" + text + "}" if text.startswith('"') else text)))
    return out


def test_it_accepts_every_spec_sample_of_the_docs():
    from controlplane.jobs.spec import JobSpec, KubernetesSpec

    spec_fields = set(JobSpec.__dataclass_fields__ if hasattr(JobSpec, "__dataclass_fields__")
                      else JobSpec.__struct_fields__)
    k8s_fields = set(KubernetesSpec.__dataclass_fields__ if hasattr(KubernetesSpec, "__dataclass_fields__")
                     else KubernetesSpec.__struct_fields__)
    samples = _spec_samples()
    assert len(samples) >= 5, samples
    for page, sample in samples:
        if set(sample) <= spec_fields:
            data = sample
        else:
            assert set(sample) <= k8s_fields, f"{page}: {sample} is neither a spec nor its kubernetes block"
            data = {"backend": "kubernetes", "kubernetes": sample}
        if "kubernetes" in data:
            data = {"backend": "kubernetes", **data}
        JobSpec.from_dict(data)  # a SpecError names the field the sample gets wrong


def _shell_lines() -> list[tuple[Path, str]]:
    """The ``unbroken``, ``manage.py`` and ``pip install`` commands of the shell and CI samples (bash, sh,
    yaml; the README's, the docs' and deploy/README.md's): continued lines joined, comments dropped,
    ``a && b`` and ``a; b`` split, a YAML step's ``run:`` taken."""
    fence = re.compile(r"^ *```(?:bash|sh|yaml)\n(.*?)^ *```", re.S | re.M)
    out = []
    for page in [*PAGES, ROOT / "deploy" / "README.md"]:
        for m in fence.finditer(page.read_text()):
            text = re.sub(r"\\\n\s*", " ", m.group(1))
            for line in text.splitlines():
                line = re.sub(r"(^|\s)#.*$", "", line.strip())
                line = re.sub(r"^-?\s*run:\s*", "", line)
                out.extend((page, part.strip()) for part in re.split(r"&&|; | \| ", line)
                           if part.strip().startswith(("unbroken ", "python manage.py ", "python3 manage.py ",
                                                       "pip install ")))
    return out


def test_it_parses_every_unbroken_and_manage_py_command_of_the_samples():
    """Every ``unbroken ...`` and ``python manage.py ...`` line of a sample is accepted by that command's own
    parser (options, choices, required arguments), and every ``make`` target named anywhere exists."""
    import shlex

    import click
    from django.core.management import get_commands, load_command_class

    from tests.docs.test_reference import _gen_reference

    cli = _gen_reference()._cli_group()  # the console script's group, found as the docs build finds it
    lines = _shell_lines()
    seen = set()
    for page, line in lines:
        words = shlex.split(line)
        if words[:1] == ["unbroken"] and len(words) > 1:
            name = words[1]
            cmd = cli.get_command(click.Context(cli), name)
            assert cmd is not None, f"{page.name}: {line}: no command {name!r}"
            try:
                cmd.make_context(name, words[2:], parent=click.Context(cli, info_name="unbroken"))
            except click.ClickException as e:
                pytest.fail(f"{page.name}: {line}: {e.format_message()}")
            seen.add("unbroken")
        elif words[:2] in (["python", "manage.py"], ["python3", "manage.py"]) and len(words) > 2:
            name = words[2]
            app = get_commands().get(name)
            assert app, f"{page.name}: {line}: no management command {name!r}"
            if app.startswith("controlplane"):
                load_command_class(app, name).create_parser("manage.py", name).parse_args(words[3:])
            seen.add("manage.py")
        elif words[:2] == ["pip", "install"]:
            import tomllib

            for target in (w for w in words[2:] if w.startswith("./")):
                path, _, extras = target.partition("[")
                project = tomllib.loads((ROOT / path / "pyproject.toml").read_text())["project"]
                for extra in filter(None, extras.rstrip("]").split(",")):
                    extras_declared = project.get("optional-dependencies", {})
                    assert extra in extras_declared, f"{page.name}: {line}: no [{extra}]"
                seen.add("pip")
    assert seen == {"unbroken", "manage.py", "pip"}, seen
    targets = set(re.findall(r"^([a-z][a-z0-9-]*):", (ROOT / "Makefile").read_text(), re.M))
    named = {(page.name, t) for page in [*PAGES, ROOT / "deploy" / "README.md"]
             for t in re.findall(r"(?:`|^ *)make ([a-z][a-z0-9-]*)(?=[`\s])", page.read_text(), re.M)}
    unknown = sorted((where, t) for where, t in named if t not in targets)
    assert not unknown, f"make targets the docs name that the Makefile lacks: {unknown}"


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_it_prints_the_shell_completion_the_cli_page_shows(shell):
    page = (ROOT / "docs" / "reference" / "cli.md").read_text()
    assert f"_UNBROKEN_COMPLETE={shell}_source unbroken" in page
    run = subprocess.run([sys.executable, "-c", "from trainer.cli import main; main()"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "_UNBROKEN_COMPLETE": f"{shell}_source"})
    assert run.returncode == 0 and "_UNBROKEN_COMPLETE" in run.stdout, run.stderr
