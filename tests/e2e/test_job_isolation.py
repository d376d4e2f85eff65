"""A job stays a job (issue 33), with a real local job run as an unprivileged account: its rank cannot read
the control plane's secret key file or SQLite database, gets none of the control plane's environment, and
what it prints (its ingest token, an API key, a password) reaches no viewer; its token dies with its
attempt."""

import base64
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.db import connection

from controlplane.jobs import services
from controlplane.jobs.models import Job, JobStatus
from controlplane.jobs.spec import JobSpec
from controlplane.launchers.local import LocalLauncher
from controlplane.launchers.services import supervise_all
from tests.helpers import end_job, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

API_KEY = "sk-" + "Q7x" * 10
SCRIPT = """
import os, sys
token = open(os.environ["UNBROKEN_TOKEN_FILE"]).read().strip()
print("my ingest token is", token, flush=True)
print("OPENAI_API_KEY=" + open("api_key.txt").read().strip(), flush=True)  # a secret kept in a file
print({"DB_PASS": "hunter2-hunter2", "steps": 3}, flush=True)
print("ctx.step(step + 1, loss=loss_v, tokens=tokens))", flush=True)
for name, path in (("key", sys.argv[1]), ("database", sys.argv[2])):
    try:
        open(path, "rb").read(1)
        print("READ", name, "ALLOWED", flush=True)
    except OSError as e:
        print("READ", name, "DENIED", e.errno, flush=True)
print("UID", os.getuid(), flush=True)
print("ENVNAMES", " ".join(sorted(os.environ)), flush=True)
"""


@pytest.fixture()
def job_dirs(e2e_settings):
    """A data directory and a working directory the job's account may reach (pytest's tmp_path is 0700)."""
    root = Path(tempfile.mkdtemp(prefix="unbroken-isolation-", dir="/tmp"))
    root.chmod(0o755)
    (root / "code").mkdir(mode=0o755)
    (root / "code" / "leaky.py").write_text(SCRIPT)
    (root / "code" / "leaky.py").chmod(0o644)
    (root / "code" / "api_key.txt").write_text(API_KEY)
    (root / "code" / "api_key.txt").chmod(0o644)
    e2e_settings.DATA_DIR = root / "data"
    e2e_settings.DATA_DIR.mkdir(mode=0o755)
    e2e_settings.JOB_USER = "nobody"
    yield root
    os.system(f"rm -rf '{root}'")  # noqa: S605 - our own temporary directory


def _ingest(base: str, job: Job, token: str) -> int:
    body = json.dumps({"v": 1, "sent_at": time.time(), "source": "forged", "heartbeats": [], "events": []})
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    req = urllib.request.Request(f"{base}/api/v1/jobs/{job.pk}/ingest", data=body.encode(), method="POST",
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _python_nobody_can_run(settings, root: Path) -> str:
    """The interpreter the job names (its ``python``): this one where ``nobody`` can run it, else a virtual
    environment built under ``root`` from the system's Python of the same version, seeing this environment's
    packages (a pyenv Python under a 0700 /root, as here, is out of every other account's reach; an operator
    in that spot names such an environment the same way). Skips when neither can serve."""
    from controlplane.launchers.isolation import account_problems, job_account

    if os.geteuid() != 0:
        pytest.skip("switching a job to another account needs root")
    settings.JOB_USER = "nobody"
    account = job_account()
    trainer = Path(settings.BASE_DIR) / "trainer"
    if not account_problems(account, [Path(sys.executable), trainer]):
        return ""
    system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    packages = Path(sysconfig.get_paths()["purelib"])
    problems = account_problems(account, [system, packages, trainer])
    if problems:
        pytest.skip(problems[0])
    venv = root / "python"
    subprocess.run([str(system), "-m", "venv", "--without-pip", str(venv)], check=True)
    (own,) = venv.glob("lib/python3*/site-packages")
    (own / "unbroken-env.pth").write_text(f"import site; site.addsitedir({str(packages)!r})\n")
    for p in [venv, *venv.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644 | (p.stat().st_mode & 0o111))
    return str(venv / "bin" / "python")


def _run_leaky_job(settings, job_dirs, monkeypatch, python: str = "") -> tuple[Job, str, str]:
    """Run the script above to its end; returns (job, its token, the raw log)."""
    key_file = job_dirs / "data" / "secret_key"
    key_file.write_text("the-control-plane-secret-key")
    key_file.chmod(0o644)  # as careless as it gets: the launcher makes it the control plane's alone
    monkeypatch.setenv("UNBROKEN_SECRET_KEY_FILE", str(key_file))
    monkeypatch.setenv("REDIS_URL_OF_THE_CONTROL_PLANE", "redis://:pw@cp:6379/0")
    monkeypatch.setenv("UNBROKEN_EMAIL_PASSWORD", "mail-secret-123")
    database = str(connection.settings_dict["NAME"])
    spec = JobSpec(entrypoint="leaky.py", working_dir=str(job_dirs / "code"), procs_per_node=1, steps=10,
                   in_process=False, step_timeout_s=5.0, heartbeat_interval_s=0.5,
                   args=(str(key_file), database), python=python)
    job = services.create_job(name="leaky", spec=spec, created_by=None)

    def done() -> bool:
        supervise_all()
        job.refresh_from_db()
        return job.status in (JobStatus.SUCCEEDED, JobStatus.FAILED)

    wait_for(done, timeout_s=240, what=f"job {job.pk} to finish")
    raw = LocalLauncher().log_tail(job, max_bytes=64000)
    assert job.status == JobStatus.SUCCEEDED, (job.status_reason, raw)
    token = (Path(settings.DATA_DIR) / "jobs" / str(job.pk) / "token").read_text().strip()
    assert token.startswith("ubk_") and token in raw and API_KEY in raw  # printed; the raw file is root's
    env_names = next(line for line in raw.splitlines() if line.startswith("ENVNAMES")).split()[1:]
    for name in ("UNBROKEN_SECRET_KEY_FILE", "REDIS_URL_OF_THE_CONTROL_PLANE", "UNBROKEN_EMAIL_PASSWORD",
                 "UNBROKEN_SECRET_KEY", "DJANGO_SETTINGS_MODULE", "UNBROKEN_DATA_DIR", "DATABASE_URL",
                 "REDIS_URL"):
        assert name not in env_names, env_names
    return job, token, raw


def test_a_viewer_reads_no_secret_a_job_printed_and_its_token_dies_with_the_attempt(
        e2e_settings, celery_beat_thread, job_dirs, monkeypatch, client):
    e2e_settings.JOB_USER = "root"  # the suite's account (this part does not need another one)
    job, token, _ = _run_leaky_job(e2e_settings, job_dirs, monkeypatch)
    try:
        User.objects.create_user("viewer", password="correct horse battery")
        client.login(username="viewer", password="correct horse battery")
        page = "".join(client.get(url).content.decode() for url in (f"/jobs/{job.pk}/",
                                                                    f"/jobs/{job.pk}/part/log/"))
        auth = {"HTTP_AUTHORIZATION": "Basic " + base64.b64encode(b"viewer:correct horse battery").decode()}
        api = client.get(f"/api/v1/jobs/{job.pk}/log", **auth).json()["text"]
        for shown in (page, api):
            assert "my ingest token is" in shown
            for secret in (token, token[4:], API_KEY, "hunter2-hunter2"):
                assert secret not in shown
        assert "my ingest token is [redacted]" in api and "OPENAI_API_KEY=[redacted]" in api, api
        assert "tokens=tokens))" in api, api  # code stays code
        # The finished attempt's token is refused (the ingest cache holds a row for at most 2 s).
        wait_for(lambda: _ingest(e2e_settings.PUBLIC_URL, job, token) == 401, timeout_s=10,
                 what="the finished attempt's token to be refused")
    finally:
        end_job(job)


def test_a_local_rank_reads_neither_the_key_file_nor_the_database(e2e_settings, celery_beat_thread, job_dirs,
                                                                  monkeypatch):
    python = _python_nobody_can_run(e2e_settings, job_dirs)
    job, _, raw = _run_leaky_job(e2e_settings, job_dirs, monkeypatch, python)
    try:
        assert "UID 65534" in raw, raw
        assert "READ key DENIED 13" in raw, raw
        if connection.vendor == "sqlite":  # PostgreSQL is a server: the rank gets no DATABASE_URL (above)
            assert "READ database DENIED 13" in raw, raw
    finally:
        end_job(job)
