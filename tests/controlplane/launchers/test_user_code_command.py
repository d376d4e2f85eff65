"""A spec that runs the user's own code: validation and the launcher's command line."""

import os

import pytest

from controlplane.jobs.spec import JobSpec, SpecError
from controlplane.launchers.command import launch_args, launch_env


def _parsed(monkeypatch, **spec):
    launch = pytest.importorskip("trainer.launch")
    job = JobSpec.from_dict(spec)
    for k, v in launch_env(job).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(os.path, "isdir", lambda p: True)  # the working directory is on the job's machine
    return launch.parse(launch_args(job, node_rank=0, rdzv_endpoint="h:1", run_dir="/r", job_id=7, attempt=0,
                                    report_url="http://cp", working_dir=job.working_dir))


def test_it_runs_the_users_script_with_its_arguments(monkeypatch):
    ns, trainer_args, cfg = _parsed(monkeypatch, entrypoint="train.py", args=["--lr", "3e-4", "--"],
                                    working_dir="/srv/p", step_timeout_s=7)
    assert (ns.entrypoint, ns.workdir, ns.user_args) == ("train.py", "/srv/p", ["--lr", "3e-4", "--"])
    assert cfg.in_process is False and cfg.step_timeout == 7
    assert "--preset" not in trainer_args  # the built-in model's arguments are not passed


def test_the_built_in_model_runs_the_example_with_its_preset(monkeypatch):
    ns, _, _ = _parsed(monkeypatch)
    assert ns.entrypoint == "trainer.examples.synthetic:train" and ns.user_args[:2] == ["--preset", "tiny"]


def test_in_process_restart_is_off_for_ones_own_code_unless_asked(monkeypatch):
    assert JobSpec.from_dict({"entrypoint": "train.py"}).in_process is False
    assert _parsed(monkeypatch, entrypoint="train.py")[2].in_process is False
    cfg = _parsed(monkeypatch, entrypoint="pkg.train:train", in_process=True, checkpoint_interval=7)[2]
    assert cfg.in_process is True and cfg.ckpt_interval == 7
    with pytest.raises(SpecError) as e:  # drills only the SDK's full level can fire
        JobSpec.from_dict({"entrypoint": "t.py", "drills": [{"step": 5, "fault": "nan_loss", "rank": 0}]})
    assert "in-process restarts on" in e.value.errors["drills[0].fault"]
    assert JobSpec.from_dict({"entrypoint": "t.py", "in_process": True,
                              "drills": [{"step": 5, "fault": "nan_loss", "rank": 0}]}).drills


@pytest.mark.parametrize("spec, field, message", [
    ({"entrypoint": "a b"}, "entrypoint", "name a script"),
    ({"entrypoint": "pkg.mod:"}, "entrypoint", "name a script"),
    ({"args": ["x"]}, "args", "set entrypoint too"),
    ({"entrypoint": "t.py", "args": "--lr 1"}, "args", "list of strings"),
    ({"entrypoint": "t.py", "working_dir": "rel/dir"}, "working_dir", "absolute"),
    ({"entrypoint": "t.py", "env": {"WANDB_API_KEY": "x"}}, "env", "looks like a secret"),
    ({"entrypoint": "t.py", "in_process": True, "step_timeout_s": 8}, "step_timeout_s", "hard timeout"),
    ({"entrypoint": "t.py", "env": {"MASTER_PORT": "1"}}, "env", "set by the launcher"),
    ({"entrypoint": "t.py", "env": {"1BAD": "x"}}, "env", "names must be like"),
    ({"entrypoint": "t.py", "drills": [{"step": 5, "fault": "hang_collective", "rank": 0}]}, "drills[0].fault",
     "drilled with"),
])
def test_it_names_the_field_of_a_bad_user_code_spec(spec, field, message):
    with pytest.raises(SpecError) as e:
        JobSpec.from_dict(spec)
    assert message in e.value.errors[field], e.value.errors


def test_it_accepts_the_three_entrypoint_forms():
    for ep in ("train.py", "src/my train.py", "/abs/train.py", "pkg.train", "pkg.train:main"):
        assert JobSpec.from_dict({"entrypoint": ep}).entrypoint == ep
