"""Every setting of a job's spec arrives: over generated specs, what ``trainer.launch`` and each rank make
of the argv and environment the local launcher gives them equals the spec (the rank's first event carries
its settings), for the built-in model and for a user's entrypoint. The Kubernetes side, through the
manifest the fake API server receives: tests/controlplane/launchers/k8s/test_k8s_spec_arrives.py."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings

from controlplane.launchers.command import launch_args, launch_env
from tests.spec_strategies import expected_launch, expected_settings, job_specs
from tests.trainer.conftest import launch_spec
from trainer import launch
from trainer.config import parse_config
from trainer.jobspec import JobSpec


def as_launched(spec: JobSpec, argv: list[str], env: dict[str, str], monkeypatch) -> tuple[dict, dict]:
    """(the launcher's settings, a rank's) from ``argv`` and ``env`` as ``trainer.launch`` and
    ``trainer.shim`` parse them."""
    with monkeypatch.context() as m:
        for k, v in env.items():
            m.setenv(k, v)
        m.delenv("UNBROKEN_LOCAL_CKPT_DIR", raising=False)
        ns, trainer_args, cfg = launch.parse(argv)
        rank = parse_config(trainer_args, env={**os.environ})
    got = {k: getattr(ns, k) for k in expected_launch(spec)}
    if not spec.entrypoint:
        got["user_args"] = None
    assert rank.settings() == cfg.settings()
    return got, rank.settings()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=job_specs(backend="local"))
def test_it_hands_the_launcher_and_every_rank_the_whole_spec(spec, monkeypatch):
    argv = launch_args(
        spec,
        node_rank=0,
        rdzv_endpoint="127.0.0.1:29400",
        run_dir="/tmp/run",
        job_id=3,
        attempt=0,
        report_url="http://cp:8000",
        working_dir="/",
    )
    launcher, rank = as_launched(spec, argv, launch_env(spec), monkeypatch)
    assert launcher == expected_launch(spec)
    assert rank == expected_settings(spec)


SCRIPT = "import time\nfor i in range(5):\n    print(f'step {i} loss 1.0', flush=True)\n    time.sleep(0.2)\n"


@pytest.mark.slow
@pytest.mark.nvrx
@pytest.mark.parametrize("user_code", [False, True], ids=["built-in model", "user entrypoint"])
@settings(
    max_examples=1,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(drawn=job_specs(backend="local", procs_per_node=2, max_steps=12, user_code=False))
def test_a_real_rank_reports_the_settings_of_its_spec(drawn, user_code, tmp_path_factory, receiver):
    """Real processes (2 ranks, gloo on CPU): each rank's first event carries the settings it runs with."""
    run_dir = tmp_path_factory.mktemp("run")
    data = drawn.to_dict()  # made quick and fault-free enough to run here; its other settings as drawn
    data.update(
        steps=min(drawn.steps, 12),
        drills=[],
        failure_policy=[],
        fork_ranks=False,
        node_agent=False,
        checkpoint_timeout_s=max(drawn.checkpoint_timeout_s, 60.0),
    )
    if user_code:
        (run_dir / "train.py").write_text(SCRIPT)
        data.update(entrypoint="train.py", args=["--quick"], working_dir=str(run_dir))
    spec = JobSpec.from_dict(data)
    run = launch_spec(run_dir, spec, report_url=receiver.url)
    started = [e for e in receiver.events("rank_started") if e["data"]["restart_count"] == 0]
    assert sorted(e["rank"] for e in started) == [0, 1], run.log[-3000:]
    for e in started:
        assert e["data"]["settings"] == expected_settings(spec), run.log[-3000:]
