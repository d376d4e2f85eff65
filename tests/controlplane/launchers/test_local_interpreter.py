"""A local job can name its interpreter (``python``): the preflight runs it and refuses the spec, naming the
field, when it cannot import ``unbroken`` and ``torch``."""

import subprocess
import sys

import pytest

from controlplane.jobs.models import Job
from controlplane.jobs.spec import JobSpec, SpecError
from controlplane.launchers.local import LocalLauncher


def preflight(**spec) -> list[str]:
    s = JobSpec(**spec)
    return LocalLauncher().preflight(Job(pk=1, spec=s.to_dict(), backend="local"))


def test_it_accepts_an_interpreter_that_imports_the_sdk_and_torch():
    assert not [p for p in preflight(python=sys.executable) if p.startswith("python")]


def test_it_refuses_an_interpreter_that_does_not_exist():
    (problem,) = [p for p in preflight(python="/nonexistent/bin/python") if p.startswith("python")]
    assert "cannot run" in problem and "pip install ./trainer" in problem


def test_it_refuses_an_environment_without_torch(tmp_path):
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    (problem,) = [
        p for p in preflight(python=str(tmp_path / "venv" / "bin" / "python")) if p.startswith("python")
    ]
    assert "cannot import unbroken and torch" in problem and "No module named" in problem  # the reason, too


@pytest.mark.parametrize(
    "spec",
    [
        {"python": "python3"},
        {"backend": "kubernetes", "python": "/usr/bin/python", "kubernetes": {"namespace": "train"}},
    ],
)
def test_the_spec_names_the_field_of_a_bad_interpreter(spec):
    with pytest.raises(SpecError) as e:
        JobSpec.from_dict(spec)
    assert "absolute path" in e.value.errors["python"]
