"""Every setting of a Kubernetes job's spec arrives: over generated specs, the manifest the (fake) API server
receives, as the kubelet would run it, gives ``trainer.launch`` and each rank the spec's settings."""

import itertools

import pytest
from hypothesis import HealthCheck, given, settings

from controlplane.jobs.models import Job
from tests.spec_strategies import expected_launch, expected_settings, job_specs
from tests.trainer.test_spec_arrives import as_launched

from k8shelpers import NS

_K8S = {"namespace": NS, "image": "registry.example/trainer:1", "nvrx_version": "0.4.1"}
_ids = itertools.count(100)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=job_specs(backend="kubernetes", kubernetes=_K8S))
def test_the_manifest_hands_the_launcher_and_every_rank_the_whole_spec(spec, cluster, launcher, monkeypatch):
    pytest.importorskip("trainer.launch")
    pk = next(_ids)
    launcher.launch(Job(pk=pk, name="j", spec=spec.to_dict(), backend="kubernetes", attempt=0), token="t")
    (container,) = cluster.get("jobs", f"unbroken-{pk}")["spec"]["template"]["spec"]["containers"]
    # As the kubelet runs it: $(VAR) references expanded, $$ read as $.
    env = {e["name"]: e["value"].replace("$$", "$") for e in container["env"] if "value" in e}
    env.pop("UNBROKEN_TOKEN_FILE")  # the mounted Secret: not here
    argv = [
        a.replace("$(JOB_COMPLETION_INDEX)", "0")
        .replace("$(UNBROKEN_REPORT_URL)", "http://cp:8000")
        .replace("$$", "$")
        for a in container["args"]
    ]
    launcher_settings, rank = as_launched(spec, argv, env, monkeypatch)
    assert launcher_settings == expected_launch(spec)
    assert rank == expected_settings(spec)
