"""The import graph: `lint-imports` keeps the contracts in pyproject.toml ([tool.importlinter]).

Dependencies point one way (api, dashboard, ingest over launchers over jobs), nothing in controlplane/ or
trainer/ imports in a circle (lazy imports inside functions count), and trainer/ never imports the
control plane or Django.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo"], cwd=tree,
                          env={"PYTHONPATH": str(tree)}, capture_output=True, text=True, timeout=300)


def copy_tree(dest: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
    for part in ("controlplane", "trainer"):
        shutil.copytree(ROOT / part, dest / part, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", dest)
    return dest


def test_the_import_contracts_are_kept():
    out = lint_imports(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def test_it_fails_on_an_upward_import_inside_a_function(tmp_path):
    tree = copy_tree(tmp_path)
    with open(tree / "controlplane/jobs/services.py", "a") as f:
        f.write("\n\ndef _reach_up():\n    from controlplane.launchers import tasks  # noqa: F401\n")
    out = lint_imports(tree)
    assert out.returncode != 0
    assert "controlplane.jobs.services -> controlplane.launchers.tasks" in out.stdout


def test_it_fails_on_a_circle_between_siblings(tmp_path):
    tree = copy_tree(tmp_path)
    with open(tree / "controlplane/launchers/base.py", "a") as f:
        f.write("\n\ndef _circle():\n    from controlplane.launchers import local  # noqa: F401\n")
    out = lint_imports(tree)
    assert out.returncode != 0
    assert "No cycles are allowed in controlplane.launchers" in out.stdout


def test_it_fails_when_the_trainer_imports_django(tmp_path):
    tree = copy_tree(tmp_path)
    with open(tree / "trainer/wire.py", "a") as f:
        f.write("\n\ndef _django():\n    import django  # noqa: F401\n")
    out = lint_imports(tree)
    assert out.returncode != 0
    assert "trainer.wire -> django" in out.stdout
