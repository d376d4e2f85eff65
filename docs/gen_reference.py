"""MkDocs hook: the reference pages generated from the code at build time.

A page asks for a generated part with a marker line, ``<!-- gen:NAME -->``, replaced by
``GENERATORS[NAME]()``: the job specification from its type, the operator and ingest APIs from their OpenAPI
documents (also published beside the pages as JSON), the Prometheus metrics from the registered
collectors, the ``unbroken`` command and the ``manage.py`` commands from their parsers, and the import
contracts from ``pyproject.toml``. A marker with no generator fails the build. The control plane is set up
once per build on a throw-away SQLite database in a temporary data directory, whatever ``DATABASE_URL`` or
``REDIS_URL`` say, so the build touches no server.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- gen:([a-z0-9-]+) -->$", re.M)
_django_ready = False


def _setup_django() -> None:
    """Django on a temporary SQLite database, migrated (the metrics collectors query their tables)."""
    global _django_ready
    if _django_ready:
        return
    data = tempfile.mkdtemp(prefix="unbroken-docs-")
    atexit.register(shutil.rmtree, data, ignore_errors=True)
    for name in ("DATABASE_URL", "REDIS_URL", "KUBECONFIG", "UNBROKEN_METRICS_TOKEN",
                 "UNBROKEN_METRICS_TOKEN_FILE"):
        os.environ.pop(name, None)
    os.environ.update(UNBROKEN_DATA_DIR=data, UNBROKEN_SECRET_KEY="docs-build-" + os.urandom(16).hex(),
                      DJANGO_SETTINGS_MODULE="controlplane.settings")
    os.environ.pop("UNBROKEN_SECRET_KEY_FILE", None)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0, interactive=False)
    _django_ready = True


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("<", "&lt;").replace("\n", " ")


def _code(text: Any) -> str:
    """A table cell's code span: its pipes are no column separators to Python-Markdown, and an escape or an
    entity would show literally."""
    return "`" + " ".join(str(text).split()) + "`"


# --- The job specification -------------------------------------------------------------------------------

# What each field means, where the type does not say it yet. The type is the source: a description on the
# field (a msgspec ``Meta(description=...)``, a dataclass field's ``metadata["doc"]``) or a comment above it
# wins over this table, and a field that has neither fails the build.
_MEANINGS = {
    "JobSpec.backend": "Where the job runs: `local` (processes on the control plane's machine) or "
                       "`kubernetes` (an Indexed Job or JobSet, see `kubernetes`).",
    "JobSpec.nodes": "Nodes (pods on Kubernetes); the local backend runs on 1.",
    "JobSpec.procs_per_node": "Ranks per node (GPUs per node on a GPU cluster). World size = nodes × "
                              "procs_per_node.",
    "JobSpec.preset": "The built-in example model's size (`tiny`, `small`, `1b`), used when `entrypoint` "
                      "is empty.",
    "JobSpec.steps": "Steps to train; for your own script, how far you expect it to go (the progress bar; "
                     "drills must fall before it).",
    "JobSpec.checkpoint_interval": "Steps between the SDK's checkpoints (Level 2 and the built-in model).",
    "JobSpec.checkpoint_mode": "`async` (DCP save on a background thread after a staging copy) or `sync`.",
    "JobSpec.keep_checkpoints": "Durable checkpoints kept on disk; older ones are deleted.",
    "JobSpec.in_process": "The in-process restart layer (NVRx `inprocess.Wrapper` re-enters the entrypoint). "
                          "Off by default for a user's `entrypoint` unless set.",
    "JobSpec.in_job": "The in-job layer: NVRx `ft_launcher` restarts the worker group on the same node.",
    "JobSpec.job_restart": "The job layer: the control plane stops everything and relaunches.",
    "JobSpec.max_in_process_restarts": "In-process restarts allowed per attempt.",
    "JobSpec.max_in_job_restarts": "In-job restarts allowed per attempt.",
    "JobSpec.max_job_restarts": "Job-level relaunches allowed.",
    "JobSpec.heartbeat_interval_s": "Seconds between a rank's heartbeats to the control plane.",
    "JobSpec.step_timeout_s": "A rank whose newest heartbeat is older than this in a fast phase is lost "
                              "(the SDK beats from the step, so a hung loop stops beating); ft_launcher's "
                              "step timeout on the node.",
    "JobSpec.checkpoint_timeout_s": "The deadline instead of `step_timeout_s` while a rank is in a slow "
                                    "phase (`checkpoint_save`, `checkpoint_load`, `eval`).",
    "JobSpec.stall_timeout_s": "A training rank that beats but whose step does not move for this long is "
                               "stalled (alive but stuck).",
    "JobSpec.storm_restarts": "Restarts without step progress after which the job is stopped (a restart "
                              "storm).",
    "JobSpec.straggler_window_s": "Seconds over which a rank averages its own work per step (`busy_s`).",
    "JobSpec.drills": "Faults to inject on purpose: a list of `{step, fault, rank, fraction}` (see the "
                      "table below).",
    "JobSpec.kubernetes": "The Kubernetes settings (the table below); required with `backend: kubernetes`.",
    "JobSpec.args": "Arguments to your own script (needs `entrypoint`).",
    "JobSpec.env": "Plain environment variables for your ranks; names the launcher owns or that look like "
                   "secrets are refused.",
    "KubernetesSpec.namespace": "The namespace the job's objects are created in.",
    "KubernetesSpec.image": "The training image (your code, torch, `unbroken-sdk`).",
    "KubernetesSpec.gpus_per_node": "`nvidia.com/gpu` requested per pod.",
    "KubernetesSpec.efa_per_node": "`vpc.amazonaws.com/efa` interfaces requested per pod (0: none).",
    "KubernetesSpec.checkpoint_claim": "A ReadWriteMany PersistentVolumeClaim (e.g. FSx for Lustre) for "
                                        "checkpoints.",
    "KubernetesSpec.node_selector": "Node labels the pods must match.",
    "KubernetesSpec.tolerations": "Tolerations added to the pods.",
    "KubernetesSpec.use_jobset": "Create a JobSet instead of an Indexed Job.",
    "KubernetesSpec.image_pull_policy": "`Always`, `IfNotPresent` or `Never`.",
    "Drill.step": "The step at which it fires (once per job).",
    "Drill.fault": "What to inject: `exception`, `nan_loss`, `hang`, `hang_collective`, `sigkill`, "
                   "`slow_rank`.",
    "Drill.rank": "The rank it fires on.",
}


def _comments_above_fields(cls: type) -> dict[str, str]:
    """The comment lines right above (or beside) each field in the class's source: today's field docs."""
    import inspect

    out: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        s = line.strip()
        if s.startswith("#"):
            pending.append(s.lstrip("# ").strip())
            continue
        if len(pending) == 1 and len(pending[0].split()) <= 3 and pending[0][-1:].isalpha():
            pending = []  # a section heading ("# Supervision"), not a field's doc
        m = re.match(r"^([a-z_][a-z0-9_]*)\s*:[^=]*(?:=.*?)?(?:#\s*(.*))?$", s)
        if m and line.startswith("    ") and not line.startswith("        "):
            text = " ".join(pending + ([m.group(2)] if m.group(2) else []))
            if text:
                out[m.group(1)] = text
        pending = []
    return out


def spec_reference() -> str:
    """The job specification, one table per type (JobSpec, KubernetesSpec, Drill): every field with its JSON
    type, default, bounds and meaning. Types, defaults and schema bounds come from ``msgspec.json.schema`` of
    the type (dataclass or msgspec Struct alike); the bounds the validator enforces beyond the schema are
    read from its own error for an out-of-range value; meanings from the field (see ``_MEANINGS``)."""
    import msgspec

    from controlplane.jobs import spec as spec_mod

    def json_type(p: dict, defs: dict) -> str:
        if "$ref" in p:
            return f"object ({p['$ref'].rsplit('/', 1)[-1]})"
        if "anyOf" in p:
            return " or ".join(json_type(q, defs) for q in p["anyOf"])
        if "enum" in p:
            return ", ".join(f"`{v}`" for v in p["enum"])
        t = p.get("type", "any")
        if t == "array":
            return f"list of {json_type(p.get('items', {}), defs)}"
        return t

    def probe(cls: type, name: str, t: str) -> str:
        """The validator's own words for values outside the field's range ("" when it takes any): the field
        set alone, on each backend, through ``JobSpec.from_dict`` as the API and the form call it."""
        if t not in ("integer", "number", "string"):
            return ""
        k8s = {"backend": "kubernetes", "nodes": 2, "kubernetes": {}}
        said = []
        for bad in ((-10**9, 10**9) if t != "string" else ("\x00?",)):
            if cls is spec_mod.KubernetesSpec:
                tries = [(dict(k8s, kubernetes={name: bad}), f"kubernetes.{name}")]
            elif cls is spec_mod.Drill:
                drill = dict({"step": 1, "fault": "exception"}, **{name: bad})
                tries = [({"drills": [drill]}, f"drills[0].{name}")]
            else:
                tries = [({name: bad}, name), (dict(k8s, **{name: bad}), name)]
            for data, key in tries:
                try:
                    spec_mod.JobSpec.from_dict(data)
                except spec_mod.SpecError as e:
                    if key in e.errors and e.errors[key] not in said:
                        said.append(e.errors[key])
        return "; ".join(said)

    parts = []
    for cls in (spec_mod.JobSpec, spec_mod.KubernetesSpec, spec_mod.Drill):
        schema = msgspec.json.schema(cls)
        defs = schema.get("$defs", {})
        root = defs[schema["$ref"].rsplit("/", 1)[-1]] if "$ref" in schema else schema
        comments = _comments_above_fields(cls)
        rows = ["| Field | Type | Default | Bounds | Meaning |", "|---|---|---|---|---|"]
        for name, prop in root["properties"].items():
            t = json_type(prop, defs)
            bounds = [f"{k} {prop[k]}" for k in ("minimum", "exclusiveMinimum", "maximum", "maxLength")
                      if k in prop]
            bounds.append(probe(cls, name, t))
            meaning = prop.get("description") or comments.get(name) or _MEANINGS.get(f"{cls.__name__}.{name}")
            if not meaning:
                raise RuntimeError(f"{cls.__name__}.{name} has no meaning: describe the field in its type")
            default = f"`{_cell(json.dumps(prop['default']))}`" if "default" in prop else "required"
            rows.append(f"| `{name}` | {_cell(t)} | {default} | {_cell('; '.join(b for b in bounds if b))} "
                        f"| {_cell(meaning)} |")
        parts.append(f"### {cls.__name__}\n\n" + "\n".join(rows))
    return "\n\n".join(parts)


# --- OpenAPI documents -----------------------------------------------------------------------------------

def _schema_words(s: dict) -> str:
    if "$ref" in s:
        name = s["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    if "anyOf" in s or "oneOf" in s:
        return " or ".join(_schema_words(q) for q in s.get("anyOf", s.get("oneOf")))
    if "enum" in s:
        return ", ".join(f"`{v}`" for v in s["enum"])
    t = s.get("type", "any")
    if isinstance(t, list):
        t = " or ".join(t)
    if t == "array":
        return f"list of {_schema_words(s.get('items', {}))}"
    bounds = [f"{k} {s[k]}" for k in ("minimum", "maximum", "maxLength") if k in s]
    return t + (f" ({', '.join(bounds)})" if bounds else "")


def openapi_markdown(doc: dict) -> str:
    """An OpenAPI 3 document as Markdown: each operation with its parameters, body and responses, then
    each schema's properties."""
    out = []
    for path, ops in doc.get("paths", {}).items():
        for method, op in ops.items():
            if method not in ("get", "post", "put", "patch", "delete"):
                continue
            out.append(f"### `{method.upper()} {path}`\n")
            if op.get("summary") or op.get("description"):
                out.append(_cell(" ".join(filter(None, (op.get("summary"), op.get("description"))))) + "\n")
            params = op.get("parameters", [])
            if params:
                out.append("| Parameter | In | Type | Required | Description |\n|---|---|---|---|---|")
                for p in params:
                    required = "yes" if p.get("required") else "no"
                    out.append(f"| `{p['name']}` | {p['in']} | {_cell(_schema_words(p.get('schema', {})))} | "
                               f"{required} | {_cell(p.get('description', ''))} |")
                out.append("")
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            if body:
                out.append(f"Request body: {_schema_words(body)}\n")
            responses = op.get("responses", {})
            if responses:
                out.append("| Status | Body | Description |\n|---|---|---|")
                for code, r in responses.items():
                    schema = r.get("content", {}).get("application/json", {}).get("schema")
                    out.append(f"| {code} | {_cell(_schema_words(schema)) if schema else ''} | "
                               f"{_cell(r.get('description', ''))} |")
                out.append("")
    schemas = doc.get("components", {}).get("schemas", {})
    if schemas:
        out.append("## Schemas\n")
    for name, s in schemas.items():
        out.append(f"### {name}\n")
        if s.get("description"):
            out.append(_cell(s["description"]) + "\n")
        props = s.get("properties")
        if props:
            required = set(s.get("required", ()))
            out.append("| Field | Type | Required | Description |\n|---|---|---|---|")
            for field, p in props.items():
                needed = "yes" if field in required else "no"
                out.append(f"| `{field}` | {_cell(_schema_words(p))} | {needed} | "
                           f"{_cell(p.get('description', ''))} |")
            out.append("")
        elif s.get("enum") or s.get("type"):
            out.append(f"{_schema_words(s)}\n")
    return "\n".join(out)


def operator_openapi() -> dict:
    _setup_django()
    from controlplane.api import openapi

    return openapi.document()


def ingest_openapi() -> dict:
    _setup_django()
    from controlplane.ingest import openapi

    return openapi.openapi_schema()


# --- Prometheus metrics ----------------------------------------------------------------------------------

def metrics_reference() -> str:
    """Every family the registered collectors yield (on an empty database, with one supervised process so
    that ``manage.py serve``'s families appear too): name, type, labels, help."""
    _setup_django()
    from django.conf import settings
    from django.utils import timezone

    from controlplane.dashboard import metrics
    from controlplane.supervisor import STATE_FILE

    Path(settings.DATA_DIR, STATE_FILE).write_text(json.dumps(
        {"children": {"web": {"restarts": 0, "alive": True}}}))
    rows = ["| Metric | Type | Labels | Meaning |", "|---|---|---|---|"]
    now = timezone.now()
    for collector in (metrics.JobCollector(now), metrics.ControlPlaneCollector(now)):
        for fam in collector.collect():
            suffix = "_total" if fam.type == "counter" else ""
            labels = getattr(fam, "_labelnames", ())
            rows.append(f"| `{fam.name}{suffix}` | {fam.type} | {', '.join(f'`{x}`' for x in labels)} | "
                        f"{_cell(fam.documentation)} |")
    return "\n".join(rows)


# --- Command lines ---------------------------------------------------------------------------------------

def _cli_group():
    """The ``unbroken`` console script's click group, found through the entry point ``trainer/pyproject.toml``
    declares (so a moved command module is followed, and a missing one fails the build)."""
    import importlib
    import tomllib

    import click

    scripts = tomllib.loads((ROOT / "trainer" / "pyproject.toml").read_text())["project"]["scripts"]
    target = scripts["unbroken"]
    module = importlib.import_module(target.split(":")[0])
    groups = [v for v in vars(module).values() if isinstance(v, click.Group)]
    if not groups:  # the entry point is a thin function importing the group from a sibling module
        main = importlib.import_module(module.__name__ + ".main")
        groups = [v for v in vars(main).values() if isinstance(v, click.Group)]
    if len(groups) != 1:
        raise RuntimeError(f"{target}: expected one click group behind the console script, found {groups}")
    return groups[0]


# What an argument or option means where its parser gives no help text (click arguments take none). A
# parameter with neither fails the build, so a new one is described where it is added.
_PARAM_MEANINGS = {
    "JOB": "the job's id (`unbroken ls` lists them; shell completion offers them)",
    "URL": "the control plane's address, e.g. `https://unbroken.example.com`",
    "SCRIPT": "your script (`train.py`), module (`pkg.train`) or function (`pkg.train:main`): the spec's "
              "`entrypoint`",
    "ARGS": "what follows `--`: your script's own arguments (the spec's `args`)",
    "USERNAME": "an existing account (operator or viewer: a viewer's token can read, not act)",
    "unbroken ls --status": "only jobs in this status",
    "unbroken ls --limit": "at most this many jobs",
    "unbroken run --backend": "where the job runs (the spec's `backend`)",
    "unbroken restart --json": "print the API's `Command` as JSON",
    "unbroken inject --json": "print the API's `Command` as JSON",
    "unbroken stop --json": "print the API's `Command` as JSON",
    "manage.py serve --host": "the web server's address (default from `UNBROKEN_HOST`)",
    "manage.py serve --port": "the web server's port (default from `UNBROKEN_PORT`)",
    "manage.py serve --web-workers": "uvicorn worker processes (default from `UNBROKEN_WEB_WORKERS`)",
}


def _meaning(where: str, name: str, given: str | None) -> str:
    meaning = given or _PARAM_MEANINGS.get(f"{where} {name}") or _PARAM_MEANINGS.get(name)
    if not meaning:
        raise RuntimeError(f"{where} {name} has no help: give it one in its parser (or in _PARAM_MEANINGS)")
    return meaning


def _help_text(text: str | None) -> str:
    import inspect

    return _cell(" ".join(inspect.cleandoc(text or "").split("\n\n")[0].split()))


def cli_reference() -> str:
    """Every command of ``unbroken`` with its usage, arguments and options, from the click parser itself: its
    help line, each option's flags, type or choices, default and help as ``unbroken CMD --help`` prints
    them."""
    import click

    group = _cli_group()
    root = click.Context(group, info_name="unbroken")
    out = []
    for name in group.list_commands(root):
        cmd = group.get_command(root, name)
        ctx = click.Context(cmd, info_name=name, parent=root)
        usage = " ".join(["unbroken", name, *cmd.collect_usage_pieces(ctx)])
        out.append(f"### `unbroken {name}`\n\n{_help_text(cmd.help)}\n\n`{usage}`\n")
        rows = ["| Argument or option | Meaning |", "|---|---|"]
        for param in cmd.get_params(ctx):
            if isinstance(param, click.Argument):
                choices = getattr(param.type, "choices", None)
                meaning = ("one of " + ", ".join(f"`{c}`" for c in choices) if choices else
                           _meaning(f"unbroken {name}", param.human_readable_name, None))
                rows.append(f"| `{param.human_readable_name}` | {_cell(meaning)} |")
                continue
            if "--help" in param.opts:
                continue
            flags, text = param.get_help_record(ctx)
            if not param.help:
                extra = text.strip()
                text = _meaning(f"unbroken {name}", param.opts[-1], None) + (f" {extra}" if extra else "")
            rows.append(f"| {_code(flags)} | {_cell(text)} |")
        out.append("\n".join(rows) + "\n")
    version = next(p for p in group.params if isinstance(p, click.Option) and "--version" in p.opts)
    out.append(f"Every command also takes `-h`/`--help`; `unbroken {version.opts[0]}` prints the version.")
    return "\n".join(out)


# Options every Django command has: documented by Django, not here.
_DJANGO_COMMON = {"help", "version", "verbosity", "settings", "pythonpath", "traceback", "no_color",
                  "force_color", "skip_checks"}


def manage_reference() -> str:
    """The control plane's own ``manage.py`` commands (those its apps define), from their argparse parsers."""
    import argparse

    _setup_django()
    from django.core.management import get_commands, load_command_class

    out = []
    for name, app in sorted(get_commands().items()):
        if not app.startswith("controlplane"):
            continue
        cmd = load_command_class(app, name)
        parser = cmd.create_parser("manage.py", name)
        actions = [a for a in parser._actions if a.dest not in _DJANGO_COMMON]
        usage = ["python manage.py", name]
        rows = ["| Argument or option | Default | Meaning |", "|---|---|---|"]
        for a in actions:
            if a.option_strings:
                flag = ", ".join(a.option_strings)
                takes = not isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction))
                flag += f" {a.metavar or a.dest.upper()}" if takes else ""
                usage.append(flag.split(", ")[-1] if a.required else f"[{flag.split(', ')[-1]}]")
                default = "required" if a.required else ("" if a.default in (None, False, "") else
                                                          f"`{_cell(a.default)}`")
            else:
                flag = a.metavar or a.dest.upper()
                usage.append(flag)
                default = "required"
            meaning = _meaning(f"manage.py {name}", a.option_strings[-1] if a.option_strings else flag,
                               (a.help or "").replace("%(default)s", str(a.default)))
            rows.append(f"| {_code(flag)} | {default} | {_cell(meaning)} |")
        out.append(f"### `manage.py {name}`\n\n{_help_text(cmd.help)}\n\n`{' '.join(usage)}`\n")
        if len(rows) > 2:
            out.append("\n".join(rows) + "\n")
    return "\n".join(out)


# --- Import contracts ------------------------------------------------------------------------------------

def import_contracts() -> str:
    """The import-linter contracts of pyproject.toml, as `lint-imports` checks them."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    rows = ["| Contract | Kind | What it holds |", "|---|---|---|"]
    for c in contracts:
        if c["type"] == "layers":
            layers = [", ".join(f"`{m.strip()}`" for m in layer.split("|")) for layer in c["layers"]]
            where = ", ".join(c["containers"])
            held = " over ".join(layers) + f" in `{where}`: none imports a layer above it"
        elif c["type"] == "forbidden":
            held = f"`{', '.join(c['source_modules'])}` never imports `{', '.join(c['forbidden_modules'])}`"
        else:
            held = ", ".join(f"`{m}`" for m in c.get("ancestors", c.get("modules", ())))
        rows.append(f"| `{c['id']}`: {_cell(c['name'])} | {c['type']} | {_cell(held)} |")
    return "\n".join(rows)


GENERATORS = {
    "cli": cli_reference,
    "import-contracts": import_contracts,
    "manage-commands": manage_reference,
    "job-spec": spec_reference,
    "operator-api": lambda: openapi_markdown(operator_openapi()),
    "ingest-api": lambda: openapi_markdown(ingest_openapi()),
    "metrics": metrics_reference,
}


# --- MkDocs hook entry points ----------------------------------------------------------------------------

def on_page_markdown(markdown: str, page, config, files) -> str:
    def one(m: re.Match) -> str:
        name = m.group(1)
        if name not in GENERATORS:
            raise KeyError(f"{page.file.src_path}: no generator named {name!r} "
                           f"(have {', '.join(GENERATORS)})")
        return GENERATORS[name]()

    return MARKER.sub(one, markdown)


def on_files(files, config):
    """The two OpenAPI documents as files of the site, beside the pages that render them, for tools."""
    from mkdocs.structure.files import File

    for name, doc in (("operator-openapi.json", operator_openapi), ("ingest-openapi.json", ingest_openapi)):
        files.append(File.generated(config, f"reference/{name}", content=json.dumps(doc(), indent=1)))
    return files
