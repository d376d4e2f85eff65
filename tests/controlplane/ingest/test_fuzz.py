"""A schema-driven fuzzer (schemathesis) against the production app: the ASGI application with the
ingest fast path, the real database and heartbeat store, a valid job token.

The schema is loaded from ``/api/v1/openapi.json`` inside the test, as a fuzzer in CI would: its
time bounds (``sent_at``, every ``at``) are computed when the document is served, so what the fuzzer
generates within the schema is what the server accepts, up to the cross-field rules the schema
describes in words (``at`` at most MAX_FUTURE_S after ``sent_at``, ranks below the world size,
event data per kind), which are refused with 422. Every answer must be a declared status with a
body of the declared schema, and never a 5xx; what it accepts, the heartbeat flush can write.
"""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from controlplane.jobs.models import QuarantinedHeartbeat
from tests.controlplane.conftest import make_job, needs_postgres
from trainer.wire import MAX_RANK

# The fast path answers from its own thread with its own database connection: the test's rows must
# be committed (transaction=True), which needs a server database (PostgreSQL).
pytestmark = [needs_postgres(), pytest.mark.django_db(transaction=True), pytest.mark.postgres]

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
EXAMPLES = 250
# Every rank the schema allows exists, so generated beats get past the rank check and reach storage.
WORLD = {"procs_per_node": MAX_RANK}


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
def test_it_answers_a_schema_driven_fuzzer_with_declared_statuses_and_no_5xx(mode, hb_store):
    from controlplane.asgi import application

    job, token = make_job(spec=WORLD)
    schema = schemathesis.openapi.from_asgi("/api/v1/openapi.json", application)
    ingest = schema["/api/v1/jobs/{job_id}/ingest"]["POST"]
    auth = {"Authorization": f"Bearer {token}"}

    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=ingest.as_strategy(mode, path_parameters={"job_id": job.pk}))
    def fuzz(case):
        case.path_parameters = {"job_id": job.pk}  # the negative mode mutates path parameters too
        r = case.call_and_validate(headers=auth, checks=CHECKS)
        if r.status_code == 200:  # what was accepted can be written: the flush quarantines nothing
            hb_store.flush()
            assert not QuarantinedHeartbeat.objects.filter(job=job).exists(), case.body

    fuzz()
