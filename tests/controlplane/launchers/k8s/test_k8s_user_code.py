"""The user's own training code on Kubernetes: the pod runs the user's image with the launcher (PID 1, or
under a wrapper that execs it) wrapping the entrypoint; env and working directory from the spec; the
launcher's final exits (2: refused flags, 3: code cannot start) end the job without a job-level restart;
what the spec alone shows to be wrong is refused before anything is created."""

import json
import os
import pathlib
import subprocess
import sys
import tomllib

import pytest

from controlplane.jobs.models import Fault, Job, JobStatus
from controlplane.jobs.spec import JobSpec
from controlplane.launchers import manifests, services, tasks
from controlplane.launchers.base import LaunchError
from trainer.jobspec import ENV_SPEC

from k8shelpers import NS, k8s_spec, make_job
from kfake import validate_object

OWNER = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "unbroken-42", "uid": "u-1"}}
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/my-llm:3"
WRAPPER = ["bash", "-c", 'source /opt/env.sh && exec "$@"', "--"]


def user_spec(**overrides):
    k8s = {"image": IMAGE, **overrides.pop("kubernetes", {})}
    fields = {"entrypoint": "train.py", "args": ["--config", "configs/7b.yaml", "--lr=3e-4"],
              "working_dir": "/workspace/llm", "env": {"HF_HOME": "/cache/hf", "NCCL_DEBUG": "INFO"},
              "in_process": False, **overrides}
    return k8s_spec(kubernetes=k8s, **fields)


def render(spec, token="ubk_tok_do_not_leak"):
    return manifests.render(spec, job_id=42, attempt=1, token=token, report_url="http://ingest:8000",
                            owner=OWNER)


def pod_container(workload):
    spec = workload["spec"]
    if workload["kind"] == "JobSet":
        spec = spec["replicatedJobs"][0]["template"]["spec"]
    return spec["template"]["spec"]["containers"][0]


def kubelet_expand(text: str, env: dict[str, str]) -> str:
    """What the kubelet does to command, args and env values: $(NAME) -> value when NAME is defined,
    $$ -> $, anything else as written (k8s.io/kubernetes third_party/forked/golang/expansion)."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i) and (j := text.find(")", i + 2)) != -1:
            out.append(env.get(text[i + 2:j], text[i:j + 1]))
            i = j + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


# -- manifests as data ------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_jobset", [False, True])
def test_it_renders_valid_objects_for_the_users_code(use_jobset):
    objs = render(user_spec(kubernetes={"use_jobset": use_jobset, "command": WRAPPER}))
    for obj in objs:
        assert validate_object(obj) == [], obj["kind"]
    c = pod_container(objs[0])
    assert c["image"] == IMAGE
    assert c["workingDir"] == "/workspace/llm"


def test_it_runs_the_launcher_wrapping_the_entrypoint_as_pid_1():
    job, _, _ = render(user_spec())
    c = pod_container(job)
    assert c["command"] == ["python", "-m", "trainer.launch"]  # no shell in between: the launcher is PID 1
    args = c["args"]
    assert args[args.index("--workdir") + 1] == "/workspace/llm"
    assert args[args.index("--report-url") + 1] == "$(UNBROKEN_REPORT_URL)"
    assert "--" not in args and "--entrypoint" not in args  # the code, its arguments, settings: in the spec
    (spec_env,) = [e["value"] for e in c["env"] if e["name"] == ENV_SPEC]
    spec = JobSpec.decode(kubelet_expand(spec_env, {}))
    assert (spec.entrypoint, spec.in_process) == ("train.py", False)
    assert spec.args == ("--config", "configs/7b.yaml", "--lr=3e-4")


def test_the_user_code_pod_argv_parses_with_the_trainers_own_launcher(tmp_path, monkeypatch):
    """What trainer.launch receives after the kubelet's expansion: the node rank and URL expanded, the
    spec's own text (with $ signs) exactly as written."""
    launch = pytest.importorskip("trainer.launch")
    spec = user_spec(entrypoint="src/train$$v2.py", working_dir=str(tmp_path / "w$dir"),
                     args=["--name=$(HOSTNAME)-run", "--cost", "$$5", "--"])
    os.makedirs(spec.working_dir)
    env = {"JOB_COMPLETION_INDEX": "1", "UNBROKEN_REPORT_URL": "http://cp:8000", "HOSTNAME": "pod-1"}
    argv = [kubelet_expand(a, env) for a in manifests.container_args(spec, job_id=42, attempt=1)]
    (c,) = manifests.pod_template(spec, job_id=42, attempt=1)["spec"]["containers"]
    (spec_env,) = [e["value"] for e in c["env"] if e["name"] == ENV_SPEC]
    monkeypatch.setenv(ENV_SPEC, kubelet_expand(spec_env, env))
    ns, _, cfg = launch.parse(argv)
    assert (ns.node_rank, cfg.report_url, cfg.in_process) == (1, "http://cp:8000", False)
    assert (ns.entrypoint, ns.workdir) == ("src/train$$v2.py", spec.working_dir)
    assert ns.user_args == ["--name=$(HOSTNAME)-run", "--cost", "$$5", "--"]


def test_it_runs_the_launcher_under_the_specs_wrapper():
    plain = pod_container(render(user_spec())[0])
    wrapped = pod_container(render(user_spec(kubernetes={"command": WRAPPER}))[0])
    assert [kubelet_expand(c, {}) for c in wrapped["command"]] == [*WRAPPER, "python", "-m", "trainer.launch"]
    assert wrapped["args"] == plain["args"]


def test_it_wraps_the_built_in_model_too_and_changes_nothing_without_a_wrapper():
    builtin = pod_container(render(k8s_spec())[0])
    assert builtin["command"] == ["python", "-m", "trainer.launch"]
    assert "workingDir" not in builtin and "--entrypoint" not in builtin["args"]
    assert pod_container(render(k8s_spec(kubernetes={"command": ["tini", "--"]}))[0])["command"] == \
        ["tini", "--", "python", "-m", "trainer.launch"]


@pytest.mark.parametrize("wrapper,execs", [
    (WRAPPER, True),
    (["sh", "-ec", 'export OMP_NUM_THREADS=4; exec "$@"', "wrapper"], True),
    (["env", "A=1", "bash", "-lc", 'exec env B=2 "${@}"', "--"], True),
    # (bash may exec the last command of a -c script by itself; a status check after it prevents that)
    (["bash", "-c", 'source /opt/env.sh; "$@"; exit $?', "--"], False),
    (["bash", "-c", 'exec "$@"'], False),
])
def test_a_wrapper_passes_the_check_only_when_it_really_execs_the_launcher(tmp_path, wrapper, execs):
    """Run the pod's command for real, with a stand-in for the launcher that prints its pid and argv: an
    accepted wrapper has replaced itself by it (same pid: PID 1 in a container) with the argv intact."""
    (tmp_path / "env.sh").write_text("export FROM_ENV_SH=1\n")
    wrapper = [w.replace("/opt/env.sh", str(tmp_path / "env.sh")) for w in wrapper]
    spec = user_spec(kubernetes={"command": wrapper})
    command = [kubelet_expand(c, {}) for c in manifests.container_command(spec)]
    assert command[-3:] == ["python", "-m", "trainer.launch"]
    stand_in = [sys.executable, "-c", "import json, os, sys; print(json.dumps([os.getpid(), sys.argv[1:]]))"]
    proc = subprocess.Popen([*command[:-3], *stand_in, "--nnodes", "2"], stdout=subprocess.PIPE, text=True,
                            env={"PATH": os.environ["PATH"]})
    out, _ = proc.communicate(timeout=30)
    ran = json.loads(out) if out.strip() else None  # bash -c 'exec "$@"' python -c: invalid option
    assert (ran == [proc.pid, ["--nnodes", "2"]]) is execs
    assert (manifests.spec_problems(spec) == []) is execs


def test_it_passes_the_specs_env_as_plain_values_and_lets_it_tune_our_defaults():
    spec = user_spec(env={"HF_HOME": "/cache/hf", "NCCL_DEBUG": "INFO", "PRICE": "$(POD_NAME)$$"})
    env = pod_container(render(spec)[0])["env"]
    names = [e["name"] for e in env]
    assert len(names) == len(set(names))  # NCCL_DEBUG replaced in place, not defined twice
    by_name = {e["name"]: e for e in env}
    assert by_name["HF_HOME"] == {"name": "HF_HOME", "value": "/cache/hf"}
    assert by_name["NCCL_DEBUG"] == {"name": "NCCL_DEBUG", "value": "INFO"}
    assert kubelet_expand(by_name["PRICE"]["value"], {"POD_NAME": "p"}) == "$(POD_NAME)$$"
    assert names.index("JOB_COMPLETION_INDEX") < names.index("HF_HOME")  # ours first


def test_it_never_puts_the_token_on_a_command_line_or_in_a_plain_env_value():
    for spec in (user_spec(), user_spec(kubernetes={"command": WRAPPER, "use_jobset": True})):
        workload, *_, secret = render(spec, token="ubk_tok_do_not_leak")
        c = pod_container(workload)
        assert "ubk_tok_do_not_leak" not in json.dumps(workload)
        plain = " ".join([*c["command"], *c["args"], *(e.get("value", "") for e in c["env"])])
        assert "ubk_tok" not in plain and "ingest:8000" not in plain  # both only in the Secret
        refs = [e["valueFrom"]["secretKeyRef"] for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})]
        assert refs == [{"name": secret["metadata"]["name"], "key": manifests.REPORT_URL_KEY}]


def test_it_mounts_the_users_secrets_as_read_only_files():
    spec = user_spec(kubernetes={"secrets": ["my-llm-secrets", "wandb"], "use_jobset": True})
    workload = render(spec)[0]
    assert validate_object(workload) == []
    c = pod_container(workload)
    pod = workload["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for name in ("my-llm-secrets", "wandb"):
        mount = mounts[f"/var/run/secrets/user/{name}"]
        assert mount["readOnly"] is True
        assert volumes[mount["name"]]["secret"]["secretName"] == name
    assert not any("secretKeyRef" in e.get("valueFrom", {}) and e["name"] != "UNBROKEN_REPORT_URL" for e in c["env"])


def test_the_spec_refuses_secret_names_that_are_not_secret_names():
    from controlplane.jobs.spec import SpecError
    for bad in (["My_Secret"], ["a", "a"], [f"s{i}" for i in range(17)], "my-secret"):
        with pytest.raises(SpecError) as e:
            user_spec(kubernetes={"secrets": bad})
        assert "kubernetes.secrets" in e.value.errors


# -- the docs: deploy/README.md section 8 and the example Dockerfile --------------------------------------

DEPLOY = pathlib.Path(__file__).resolve().parents[4] / "deploy"


def test_the_readmes_example_spec_renders_valid_manifests():
    text = (DEPLOY / "README.md").read_text()
    section = text[text.index("## 8. Your own training image"):text.index("## 9. Tests")]
    example = json.loads(section.split("```json\n", 1)[1].split("```", 1)[0])
    spec = JobSpec.from_dict(example)
    assert spec.entrypoint and manifests.spec_problems(spec) == []
    for obj in render(spec):
        assert validate_object(obj) == []
    wrapper = json.loads("{" + section.split("```json\n")[2].split("```", 1)[0] + "}")["command"]
    assert manifests.spec_problems(user_spec(kubernetes={"command": wrapper})) == []


def test_the_example_dockerfile_installs_the_sdk_distribution_the_launcher_comes_from():
    dockerfile = (DEPLOY / "trainer-image" / "Dockerfile.user-example").read_text()
    project = tomllib.loads((DEPLOY.parent / "trainer" / "pyproject.toml").read_text())["project"]
    wheel = project["name"].replace("-", "_")
    assert f"/tmp/wheels/{wheel}-*.whl)[nvrx]" in dockerfile and "nvrx" in project["optional-dependencies"]
    assert "import unbroken, trainer.launch" in dockerfile
    instructions = [line.split()[0] for line in dockerfile.splitlines() if line and line[0] not in "# "]
    assert "CMD" not in instructions and "ENTRYPOINT" not in instructions  # the control plane sets the command
    assert instructions[:2] == ["ARG", "FROM"]


# -- launch against the fake API server (strict schemas) ---------------------------------------------------


def test_it_launches_the_users_code_through_the_strict_api_server(cluster, launcher):
    job = make_job(entrypoint="pkg.train:main", args=["--steps", "100"], working_dir="/app",
                   env={"WANDB_MODE": "offline"}, in_process=False,
                   kubernetes={"image": IMAGE, "command": WRAPPER})
    launcher.launch(job, token="ubk_secret")
    c = cluster.get("jobs", "unbroken-7")["spec"]["template"]["spec"]["containers"][0]
    assert [kubelet_expand(a, {}) for a in c["command"]] == [*WRAPPER, "python", "-m", "trainer.launch"]
    (spec_env,) = [e["value"] for e in c["env"] if e["name"] == ENV_SPEC]
    spec = JobSpec.decode(kubelet_expand(spec_env, {}))
    assert (spec.entrypoint, spec.args) == ("pkg.train:main", ("--steps", "100"))
    assert c["workingDir"] == "/app"
    assert {"name": "WANDB_MODE", "value": "offline"} in c["env"]
    assert "ubk_secret" not in json.dumps(c)


def test_it_refuses_to_launch_what_the_spec_shows_would_fail_and_creates_nothing(cluster, launcher):
    job = make_job(entrypoint="train.py", in_process=False,
                   kubernetes={"image": IMAGE, "command": ["bash", "-c", 'python "$@"', "--"]})
    with pytest.raises(LaunchError, match=r'kubernetes.command: .*end it with exec "\$@"'):
        launcher.launch(job, token="t")
    assert cluster.requests("POST") == []


# -- poll: exits that a restart would only repeat ---------------------------------------------------------


@pytest.fixture()
def user_pods(cluster, launcher):
    launcher.launch(make_job(entrypoint="train.py", in_process=False, kubernetes={"image": IMAGE}), token="t")
    pods = cluster.start_pods()
    for i, pod in enumerate(pods):
        cluster.run(pod, f"ip-10-0-0-{i}")
    return pods


@pytest.mark.parametrize("code,message,want", [
    (3, "launcher ERROR trainer.launch: cannot start train.py: the script train.py does not exist in /app",
     "the training code cannot start (exit 3): launcher ERROR trainer.launch: cannot start train.py"),
    (2, "Traceback ...\ntrainer.launch: error: --workdir /app/x: no such directory",
     "the launcher refused the job's settings (exit 2): trainer.launch: error: --workdir /app/x"),
])
def test_it_fails_without_a_restart_when_the_code_cannot_start(cluster, launcher, user_pods, code, message,
                                                               want):
    p0, p1 = user_pods
    cluster.terminate(p0, exit_code=code, message=message)
    cluster.fail_job()
    # The Job controller deletes node 1's pod and its launcher exits 143 (in this order on a cluster; the
    # fake drops a terminating pod whose status is patched, so the status comes first here).
    cluster.terminate(p1, exit_code=143)
    cluster.emu.hold_deletions = True
    cluster.core.delete_namespaced_pod(p1, NS)
    assert cluster.get("pods", p1)["metadata"]["deletionTimestamp"]
    result = launcher.poll(make_job())
    assert (result.state, result.retryable) == ("failed", False)
    assert want in result.reason and "node rank 0" in result.reason and "start a new job" in result.reason
    assert result.faults == []  # the launcher reported the cause itself; node 1's deletion is a consequence


@pytest.mark.parametrize("code,reason", [(1, "Error"), (137, "OOMKilled"), (143, "Error")])
def test_other_failures_stay_retryable(cluster, launcher, user_pods, code, reason):
    cluster.terminate(user_pods[1], exit_code=code, reason=reason)
    result = launcher.poll(make_job())
    assert (result.state, result.retryable) == ("failed", True)
    assert len(result.faults) == 1


@pytest.mark.django_db
def test_the_control_plane_fails_the_job_instead_of_restarting_it(cluster, use_fake_cluster):
    job = Job.objects.create(name="mine", backend="kubernetes", status=JobStatus.LAUNCHING,
                             spec=user_spec(max_job_restarts=3).to_dict())
    tasks.launch(job.pk)
    job.refresh_from_db()
    (p0, p1) = cluster.start_pods(f"unbroken-{job.pk}")
    cluster.terminate(p0, exit_code=3, message="cannot start train.py: the script train.py does not exist")
    assert services.supervise_job(job=job) == "failed"
    job.refresh_from_db()
    assert (job.status, job.attempt) == (JobStatus.FAILED, 0)
    assert "cannot start" in job.status_reason
    assert cluster.get("jobs", f"unbroken-{job.pk}")["metadata"]["labels"][manifests.L_ATTEMPT] == "0"
    assert not Fault.objects.filter(job=job).exists()


# -- preflight: what the spec alone shows -----------------------------------------------------------------


@pytest.mark.parametrize("overrides,field,message", [
    ({"kubernetes": {"command": ["bash", "-c", 'source /opt/env.sh && "$@"', "--"]}},
     "kubernetes.command", "launcher never gets SIGTERM"),
    ({"kubernetes": {"command": ["bash", "-c", "source /opt/env.sh", "--"]}},
     "kubernetes.command", "never runs its arguments"),
    ({"kubernetes": {"command": ["bash", "-c", 'exec "$@"']}}, "kubernetes.command",
     'add "--" after the script'),
    ({"kubernetes": {"command": ["bash"]}}, "kubernetes.command", "without -c or a script"),
    ({"kubernetes": {"command": ["python", "-m", "trainer.launch"]}}, "kubernetes.command", "leave them out"),
    ({"kubernetes": {"command": ["env", "HF_TOKEN=hf_abc", "tini", "--"]}}, "kubernetes.command",
     "HF_TOKEN=... puts a secret on the command line"),
    ({"kubernetes": {"image": "ghcr.io/unbroken/trainer:latest"}}, "kubernetes.image",
     "name the image with your code"),
    ({"entrypoint": "~/train.py"}, "entrypoint", "no shell expands"),
    ({"working_dir": "/home/$USER/llm"}, "working_dir", "no shell expands"),
    ({"env": {"POD_IP": "10.0.0.1"}}, "env", "POD_IP is set by the pod"),
])
def test_preflight_names_the_field_to_fix(cluster, launcher, overrides, field, message):
    cluster.ready()
    problems = launcher.preflight(make_job(**{"entrypoint": "train.py", "in_process": False,
                                              "kubernetes": {"image": IMAGE}, **overrides}))
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{field}: ") and message in problems[0]


@pytest.mark.parametrize("overrides", [
    {"kubernetes": {"image": IMAGE, "command": WRAPPER}},
    {"kubernetes": {"image": IMAGE, "command": ["/bin/bash", "/opt/wrap.sh"]}},  # a script file: unseen
    {"kubernetes": {"image": IMAGE, "secrets": ["my-llm-secrets"], "command": [  # deploy/README.md
        "bash", "-c", 'export HF_TOKEN=$(cat /var/run/secrets/user/my-llm-secrets/hf-token) && exec "$@"', "--"]}},
    {"kubernetes": {"image": IMAGE}, "entrypoint": "/opt/llm/train.py", "working_dir": ""},
])
def test_preflight_passes_a_sound_user_code_job(cluster, launcher, overrides):
    cluster.ready()
    assert launcher.preflight(make_job(**{"entrypoint": "train.py", "in_process": False, **overrides})) == []
    assert launcher.preflight(make_job(kubernetes={"image": "ghcr.io/unbroken/trainer:latest"})) == []
