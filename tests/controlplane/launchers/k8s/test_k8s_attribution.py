"""One failure, one primary fault, on Kubernetes (the loopback fake API server): the ranks of the pod that
survived report their gloo errors first; the pod that failed (OOM kill, eviction, a lost node) is seen by
the launcher's poll after them and becomes the primary fault, the ranks' errors its consequences."""

import time

import pytest
from django.utils import timezone

from controlplane.jobs import evidence, ingestion
from controlplane.jobs.models import Fault
from controlplane.launchers import services
from tests.controlplane.conftest import batch, ev
from trainer.wire import FaultClass, parse_batch

from test_k8s_supervise import launched

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("use_fake_cluster")]

GLOO = ("RuntimeError('[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [10.0.0.1]:40123: "
        "Connection reset by peer')")


def _peer_errors(job, ranks) -> None:
    t = time.time() - 1
    events = [ev(f"g{r}", "fault", {"fault": "exception", "detected_by": "launcher", "rank": r, "message": GLOO,
                                     "interruption": "exit 1", "step": 40}, at=t, rank=r) for r in ranks]
    ingestion.record_batch(job, parse_batch(batch(None, events), now=time.time(), world_size=job.world_size),
                           now=timezone.now())


@pytest.mark.parametrize(("act", "cls", "words"), [
    (lambda c, p: c.terminate(p, exit_code=137, reason="OOMKilled"), FaultClass.OOM_KILLED, "OOM kill"),
    (lambda c, p: c.evict(p), FaultClass.EVICTED, "eviction"),
    (lambda c, p: c.lose_node(p), FaultClass.NODE_LOST, "lost node"),
], ids=["oom_killed", "evicted", "node_lost"])
def test_the_failed_pod_is_the_primary_and_the_peers_gloo_errors_its_consequences(cluster, act, cls, words):
    job, (p0, p1) = launched(cluster, max_job_restarts=1)
    _peer_errors(job, range(8))  # node rank 0's ranks: their peers on node rank 1 went away
    assert Fault.objects.filter(job=job, primary__isnull=True).count() == 1  # all it knows so far
    act(cluster, p1)
    services.supervise_job(job=job)
    (primary,) = Fault.objects.filter(job=job, primary__isnull=True)
    assert primary.fault_class == cls and primary.detected_by == "launcher"
    echoes = Fault.objects.filter(job=job, primary=primary, link="consequence")
    assert echoes.count() == 8
    assert echoes.order_by("rank").first().why == (
        f"rank 0: gloo connection reset — a consequence of node rank 1's pod (ranks 8-15)'s {words}")
    summary = evidence.fault_evidence(Fault.objects.select_related("cycle").get(pk=primary.pk)).summary
    assert summary.endswith("were a consequence.") and "rank 0's gloo connection reset" in summary
