"""Local jobs run apart from the control plane (issue 33): an environment from an allowlist, and, when the
control plane is root, an account of their own that cannot read the secret key file or the database."""

import os
import re
import subprocess
from pathlib import Path

import pytest
from django.db import connection

from controlplane.jobs.models import Job
from controlplane.launchers.isolation import account_problems, job_account, prepare_run_dir, rank_env
from controlplane.launchers.local import LocalLauncher, _as_account

pytestmark = pytest.mark.django_db
PROBE = """
import os, sys
for path in sys.argv[1:]:
    try:
        open(path, "rb").read(1)
        print("ALLOWED", path)
    except OSError as e:
        print("DENIED", e.errno, path)
print("UID", os.getuid())
open(os.path.join(os.environ["HOME"], "written"), "w").write("ok")
"""


def test_it_builds_the_ranks_environment_from_an_allowlist():
    inherited = {"PATH": "/usr/bin", "HOME": "/root", "LANG": "C.UTF-8", "CUDA_VISIBLE_DEVICES": "0",
                 "NCCL_DEBUG": "WARN", "DATABASE_URL": "postgres://u:p@db/x",
                 "REDIS_URL": "redis://:pw@r:6379",
                 "UNBROKEN_SECRET_KEY_FILE": "/var/secret_key", "UNBROKEN_EMAIL_PASSWORD": "x",
                 "AWS_SECRET_ACCESS_KEY": "y", "DJANGO_SETTINGS_MODULE": "controlplane.settings",
                 "NCCL_IB_TOKEN": "z", "UNBROKEN_CKPT_SAVER": "process"}
    env = rank_env(inherited, {"MY_FLAG": "1"}, home="/data/jobs/1/home")
    assert env == {"PATH": "/usr/bin", "HOME": "/data/jobs/1/home", "LANG": "C.UTF-8",
                   "CUDA_VISIBLE_DEVICES": "0", "NCCL_DEBUG": "WARN", "UNBROKEN_CKPT_SAVER": "process",
                   "MY_FLAG": "1"}


def test_the_trainer_settings_the_docs_say_an_operator_may_set_for_every_job_reach_the_ranks():
    """docs/reference/environment.md lists the trainer's settings one may set "in the ranks' environment (the
    spec's env) or the launcher's": set in the control plane's, each must pass the allowlist (bench-chaos's
    journal once did not, and its comparison saw no event sent)."""
    text = (Path(__file__).resolve().parents[3] / "docs" / "reference" / "environment.md").read_text()
    section = text.split("## Trainer side: settings you may set", 1)[1].split("\n## ", 1)[0]
    names = re.findall(r"^\| `(UNBROKEN_[A-Z_]+)` \|", section, flags=re.M)
    assert len(names) >= 5, section
    settable = [n for n in names if "set by the launcher" not in section.split(f"`{n}`", 1)[1].split("\n")[0]]
    env = rank_env({n: "1" for n in settable}, {}, home="/h")
    assert [n for n in settable if n not in env] == []


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another account needs root")
def test_a_process_started_as_the_job_account_reads_neither_the_key_file_nor_the_database(settings, tmp_path,
                                                                                           monkeypatch):
    """The launcher's own steps (account, run directory, environment), with the system Python as the rank:
    this machine's venv Python may sit where the account cannot run it (tests/e2e/test_job_isolation.py runs
    a whole job where it can)."""
    settings.JOB_USER = "nobody"
    data = Path("/tmp") / f"unbroken-account-{os.getpid()}"
    data.mkdir(mode=0o755, exist_ok=True)
    try:
        settings.DATA_DIR = data
        key_file = data / "secret_key"
        key_file.write_text("the-control-plane-secret-key")
        key_file.chmod(0o644)
        monkeypatch.setenv("UNBROKEN_SECRET_KEY_FILE", str(key_file))
        # The embedded default's database is a file beside the key; PostgreSQL's is behind its own server.
        database = Path(str(connection.settings_dict["NAME"])) if connection.vendor == "sqlite" else key_file
        database.chmod(0o644)
        account = job_account()
        assert account is not None and account.uid == 65534
        run_dir = data / "jobs" / "1"
        run_dir.mkdir(parents=True)
        (run_dir / "home").mkdir()
        prepare_run_dir(run_dir, account)
        assert key_file.stat().st_mode & 0o777 == 0o600 and database.stat().st_mode & 0o777 == 0o600
        out = subprocess.run(["/usr/bin/python3", "-c", PROBE, str(key_file), str(database)], cwd=run_dir,
                             env=rank_env(dict(os.environ), {}, home=str(run_dir / "home")),
                             capture_output=True, text=True, timeout=30, check=True,
                             **_as_account(account)).stdout
        assert f"DENIED 13 {key_file}" in out and f"DENIED 13 {database}" in out, out
        assert "UID 65534" in out
        assert (run_dir / "home" / "written").read_text() == "ok"  # its own run directory is its own
    finally:
        subprocess.run(["rm", "-rf", str(data)], check=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another account needs root")
def test_preflight_names_what_the_job_account_cannot_reach(settings, tmp_path):
    settings.JOB_USER = "nobody"
    problems = account_problems(job_account(), [tmp_path])  # pytest's tmp_path: /tmp/pytest-of-root is 0700
    assert problems and "out of reach of the account jobs run as, nobody (UNBROKEN_JOB_USER)" in problems[0]
    settings.JOB_USER = "no-such-account-here"
    job = Job(spec={"procs_per_node": 1}, backend="local")
    assert any("is not an account on this machine" in p for p in LocalLauncher().preflight(job))
    settings.JOB_USER = "root"  # the operator's explicit choice: the control plane's rights
    assert job_account() is None


def test_the_env_check_looks_at_values_too():
    from controlplane.jobs.spec import JobSpec, SpecError

    for name, value in (("OPENAI_KEY", "sk-" + "a" * 30), ("AWS_KEY_ID", "AKIAABCDEFGHIJKLMNOP"),
                        ("DB_PASS", "hunter2"), ("GH", "ghp_" + "b" * 36), ("X", "ubk_" + "c" * 43)):
        with pytest.raises(SpecError) as e:
            JobSpec.from_dict({"env": {name: value}})
        assert "looks like a secret" in e.value.errors["env"], name
    JobSpec.from_dict({"env": {"HF_HOME": "/data/hf", "NCCL_DEBUG": "INFO", "RUN_NAME": "sk-short"}})


@pytest.mark.skipif(os.geteuid() != 0, reason="switching to another account needs root")
def test_unset_it_isolates_jobs_where_nobody_can_run_this_python_and_runs_them_as_root_elsewhere(settings):
    """The default must run the demo on any machine: `nobody` when it can run the control plane's Python
    and trainer, the control plane's own user otherwise (a Python under a 0700 /root); named, it refuses."""
    import pwd
    import sys

    from django.conf import settings as django_settings

    from controlplane.launchers.base import LaunchError
    from controlplane.launchers.isolation import Account

    settings.JOB_USER = ""
    pw = pwd.getpwnam("nobody")
    nobody = Account(name="nobody", uid=pw.pw_uid, gid=pw.pw_gid)
    reachable = not account_problems(nobody, [Path(sys.executable), Path(django_settings.BASE_DIR) / "trainer"])
    assert job_account() == (nobody if reachable else None)
    settings.JOB_USER = "no-such-account-here"
    with pytest.raises(LaunchError, match="not an account on this machine"):
        job_account()
