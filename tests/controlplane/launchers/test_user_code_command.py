"""A spec that runs the user's own code: validation and the launcher's command line."""

import pytest

from controlplane.jobs.spec import JobSpec, SpecError
from controlplane.launchers.command import launch_args


def _args(**spec) -> list[str]:
    return launch_args(JobSpec.from_dict(spec), node_rank=0, rdzv_endpoint="h:1", run_dir="/r", job_id=7,
                       attempt=0, report_url="http://cp")


def test_it_runs_the_users_script_with_its_arguments_after_the_shims_flags():
    args = _args(entrypoint="train.py", args=["--lr", "3e-4", "--"], working_dir="/srv/p", step_timeout_s=7)
    i = args.index("--")
    assert args[:i][-4:] == ["--entrypoint", "train.py", "--workdir", "/srv/p"]
    shim, user = args[i + 1:len(args) - 3], args[-3:]
    assert user == ["--lr", "3e-4", "--"] and shim[-1] == "--"
    assert "--no-in-process" in shim and shim[shim.index("--step-timeout") + 1] == "7"
    assert "--preset" not in shim  # the built-in model's flags are not passed


def test_the_built_in_model_keeps_its_command():
    args = _args()
    assert "--entrypoint" not in args and args[args.index("--preset") + 1] == "tiny"
    assert args.count("--") == 1


def test_in_process_restart_is_off_for_ones_own_code_unless_asked():
    assert JobSpec.from_dict({"entrypoint": "train.py"}).in_process is False
    assert "--no-in-process" in _args(entrypoint="train.py")
    args = _args(entrypoint="pkg.train:train", in_process=True, checkpoint_interval=7)
    assert "--in-process" in args and args[args.index("--ckpt-interval") + 1] == "7"
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
