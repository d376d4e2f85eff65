"""The ``unbroken`` command against a live server, for everything that needs no training process: refused
specs named per field, credentials, an unreachable server, ``login``, ``--json`` against the OpenAPI types,
commands, and the spec it builds from its flags."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import time

import pytest

from controlplane.jobs import services
from controlplane.jobs.models import AuditEntry, Command, Job
from controlplane.jobs.spec import JobSpec
from tests.cli.conftest import EXAMPLES, in_pty, make_user, read_pty, token_for, unbroken, validate

pytestmark = pytest.mark.django_db(transaction=True)
PLAIN = str(EXAMPLES / "plain_fsdp.py")


def test_it_names_the_refused_field_and_its_flag(operator_env):
    out = unbroken(operator_env, "run", "--drill", "100:sigkill:5", PLAIN, "--", "--steps", "300")
    assert out.returncode == 2, out
    assert "drills[0].rank (--drill): must be a rank of this job: 0..1" in out.stderr
    out = unbroken(operator_env, "run", "--nproc-per-node", "0", "--steps", "50", PLAIN)
    assert out.returncode == 2, out
    assert "procs_per_node (--nproc-per-node): must be at least 1" in out.stderr
    out = unbroken(operator_env, "run", "--set", "stall_timeout_s=\"soon\"", PLAIN)
    assert out.returncode == 2
    assert "stall_timeout_s (--set stall_timeout_s=...): must be a number" in out.stderr
    assert Job.objects.count() == 0


def test_it_refuses_a_script_that_is_not_there_before_asking_the_server(cli_env):
    out = unbroken({**cli_env, "UNBROKEN_URL": "http://127.0.0.1:9", "UNBROKEN_API_TOKEN": "ubk_x"},
                   "run", "no_such_train.py")
    assert out.returncode == 2
    assert "no_such_train.py: no such file here" in out.stderr


def test_it_says_the_server_is_unreachable(cli_env):
    out = unbroken({**cli_env, "UNBROKEN_URL": "http://127.0.0.1:9", "UNBROKEN_API_TOKEN": "ubk_x"}, "ls")
    assert out.returncode == 4
    assert "cannot reach http://127.0.0.1:9" in out.stderr and "Traceback" not in out.stderr


def test_it_says_the_token_was_refused(cli_env, live_server):
    make_user("op", operator=True)
    out = unbroken({**cli_env, "UNBROKEN_URL": live_server.url, "UNBROKEN_API_TOKEN": "ubk_wrong"}, "ls")
    assert out.returncode == 3
    assert "token was refused" in out.stderr


def test_it_says_how_to_log_in(cli_env):
    out = unbroken(cli_env, "ls")
    assert out.returncode == 3 and "unbroken login URL" in out.stderr


def test_it_refuses_a_viewers_token_an_action(cli_env, live_server):
    job = services.create_job(name="j", spec=JobSpec(steps=50), created_by=None, launch=False)
    token = token_for(make_user("v", operator=False))
    env = {**cli_env, "UNBROKEN_URL": live_server.url, "UNBROKEN_API_TOKEN": token}
    assert unbroken(env, "ls").returncode == 0
    out = unbroken(env, "stop", str(job.pk))
    assert out.returncode == 3 and "only operators" in out.stderr
    assert not Command.objects.exists()


def test_it_logs_in_and_keeps_the_token_to_the_user(cli_env, live_server, tmp_path):
    token = token_for(make_user("op", operator=True))
    bad = unbroken(cli_env, "login", live_server.url, "--token-stdin", input="ubk_wrong\n")
    assert bad.returncode == 3 and not (tmp_path / "config" / "config.json").exists()
    out = unbroken(cli_env, "login", live_server.url + "/", "--token-stdin", input=token + "\n")
    assert out.returncode == 0, out
    path = tmp_path / "config" / "config.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert json.loads(path.read_text()) == {"url": live_server.url, "token": token}
    assert token not in out.stdout + out.stderr
    assert unbroken(cli_env, "ls").returncode == 0  # no environment: the stored credentials


def test_its_json_is_the_operator_apis_types(operator_env):
    job = services.create_job(name="j", spec=JobSpec(steps=50), created_by=None, launch=False)
    out = unbroken(operator_env, "ls", "--json")
    assert out.returncode == 0, out
    listed = json.loads(out.stdout)
    validate(listed, "JobList")
    assert [j["id"] for j in listed["jobs"]] == [job.pk]
    detail = json.loads(unbroken(operator_env, "status", str(job.pk), "--json").stdout)
    validate(detail, "JobDetail")
    validate(json.loads(unbroken(operator_env, "logs", str(job.pk), "--json").stdout), "Log")
    human = unbroken(operator_env, "ls")
    assert f"{job.pk}" in human.stdout and "pending" in human.stdout and "0/50" in human.stdout
    validate(json.loads(unbroken(operator_env, "report", str(job.pk), "--json").stdout), "Report")
    report = unbroken(operator_env, "report", str(job.pk))
    assert report.returncode == 0 and f"/jobs/{job.pk}/report/" in report.stdout and "saves:" in report.stdout, report


def test_it_writes_the_report_as_one_html_file(operator_env, tmp_path):
    job = services.create_job(name="j", spec=JobSpec(steps=50), created_by=None, launch=False)
    path = tmp_path / "report.html"
    out = unbroken(operator_env, "report", str(job.pk), "--html", str(path), "--gpus", "1024")
    assert out.returncode == 0 and "wrote" in out.stdout, out
    html = path.read_text()
    assert html.lower().startswith("<!doctype html>") and "Plotly" in html and f"Resilience report #{job.pk}" in html
    # Self-contained: nothing it loads comes from elsewhere (links to the job's pages may point back).
    assert not re.search(r'<(?:script|link|img)[^>]+(?:src|href)="https?://', html)
    missing = unbroken(operator_env, "report", "999999", "--html", str(tmp_path / "none.html"))
    assert missing.returncode == 2 and "no job 999999" in missing.stderr
    assert not (tmp_path / "none.html").exists()


def test_it_issues_commands_and_they_are_audited_as_the_tokens_user(operator_env):
    job = services.create_job(name="j", spec=JobSpec(steps=50), created_by=None, launch=False)
    out = unbroken(operator_env, "restart", str(job.pk), "--level", "in_job", "--json")
    assert out.returncode == 0, out
    validate(json.loads(out.stdout), "Command")
    out = unbroken(operator_env, "inject", str(job.pk), "sigkill", "--rank", "1")
    assert out.returncode == 0 and "inject_fault sigkill on rank 1" in out.stdout, out
    out = unbroken(operator_env, "inject", str(job.pk), "sigkill", "--rank", "7")
    assert out.returncode == 2 and "rank" in out.stderr, out
    assert unbroken(operator_env, "stop", str(job.pk)).returncode == 0
    assert AuditEntry.objects.filter(job=job, action="job.stop", actor__username="op").exists()
    assert unbroken(operator_env, "status", "no-such").returncode == 2
    missing = unbroken(operator_env, "status", "999999")
    assert missing.returncode == 2 and "no job 999999" in missing.stderr


def test_it_builds_the_spec_the_forms_own_script_preset_builds(operator_env, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import unbroken\n\n@unbroken.entrypoint\ndef train(ctx):\n    pass\n")
    out = unbroken(operator_env, "run", "--no-wait", "--nproc-per-node", "2", "--steps", "300", "--drill",
                   "100:sigkill:1", "--env", "MY_FLAG=1", "--name", "mine", str(script), "--", "--lr", "3e-4",
                   cwd=tmp_path)
    assert out.returncode == 0, out
    job = Job.objects.get()
    assert out.stdout.startswith(f"Job {job.pk}: {operator_env['UNBROKEN_URL']}/jobs/{job.pk}/")
    spec = JobSpec.from_dict(job.spec)
    assert (spec.entrypoint, spec.args, spec.working_dir) == (str(script), ("--lr", "3e-4"), str(tmp_path))
    assert spec.procs_per_node == 2 and spec.steps == 300 and spec.env == {"MY_FLAG": "1"}
    assert [(d.step, d.fault, d.rank) for d in spec.drills] == [(100, "sigkill", 1)]
    assert spec.in_process  # --level auto: the script is an SDK entrypoint (Level 2)
    assert job.name == "mine" and job.created_by.username == "op"


def _wait_for_screen(proc, master, screen: bytearray, pattern: bytes, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not re.search(pattern, screen):
        assert time.monotonic() < deadline and proc.poll() is None, screen.decode(errors="replace")[-2000:]
        read_pty(master, screen)
        time.sleep(0.1)


def test_it_asks_on_ctrl_c_whether_to_stop_or_detach(operator_env, tmp_path):
    # No worker runs here, so the job stays launching: the watch only ends by the user's choice.
    proc, master = in_pty(["run", "--steps", "50", PLAIN], {**operator_env, "TERM": "xterm"}, tmp_path)
    screen = bytearray()
    try:
        _wait_for_screen(proc, master, screen, rb"job \d+ launching")
        job = Job.objects.get()
        proc.send_signal(signal.SIGINT)
        _wait_for_screen(proc, master, screen, rb"Stop the job, detach")
        os.write(master, b"stop\n")
        _wait_for_screen(proc, master, screen, rb"stop requested \(command \d+")
        assert Command.objects.filter(job=job, kind="stop", issued_by__username="op").exists()
        proc.send_signal(signal.SIGINT)
        _wait_for_screen(proc, master, screen, rb"(?s)stop requested.*Stop the job, detach")
        os.write(master, b"detach\n")
        assert proc.wait(timeout=30) == 0
        read_pty(master, screen)
        assert f"detached: job {job.pk} keeps running".encode() in screen
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
