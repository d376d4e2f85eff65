"""The notification outbox: controlplane.jobs.notifications, against a real local HTTP receiver."""

import json
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.core import mail
from django.utils import timezone

from controlplane.jobs import notifications
from controlplane.jobs.models import Notification
from controlplane.jobs.services import set_status
from tests.controlplane.conftest import make_job

pytestmark = pytest.mark.django_db


class Receiver:
    """A webhook endpoint on loopback that records what it gets; ``status`` sets its answer."""

    def __init__(self):
        self.received: list[tuple[dict, dict]] = []
        self.status = 200
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.received.append((json.loads(body), dict(self.headers)))
                self.send_response(outer.status)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(autouse=True)
def _locmem_email(settings):
    settings.EMAIL_BACKEND = "django.core.mail.backends.locmem.EmailBackend"


def test_it_sends_a_slack_compatible_webhook_once(receiver):
    job, _ = make_job(notify_webhook_url=receiver.url)
    notifications.enqueue(job, "recovered", "recovered:a0-ij1", "Job recovered in 4.2 s")
    notifications.enqueue(job, "recovered", "recovered:a0-ij1", "Job recovered in 4.2 s")  # same transition
    assert notifications.send_pending() == 1
    assert notifications.send_pending() == 0
    assert len(receiver.received) == 1
    payload, headers = receiver.received[0]
    assert payload == {"text": "Job recovered in 4.2 s"}
    assert headers["Content-Type"] == "application/json"
    assert headers["Idempotency-Key"].startswith("unbroken-notification-")
    assert Notification.objects.get().sent_at is not None


def test_it_sends_email(receiver):
    job, _ = make_job(notify_email="ops@example.com")
    notifications.enqueue(job, "stalled", "stalled:1", "Job is stalled")
    assert notifications.send_pending() == 1
    assert len(mail.outbox) == 1
    msg = mail.outbox[0]
    assert msg.to == ["ops@example.com"] and "stalled" in msg.subject and msg.body == "Job is stalled"
    assert msg.extra_headers["Message-ID"].startswith("<unbroken-notification-")


def test_it_stores_nothing_for_a_job_without_channels():
    job, _ = make_job()
    assert notifications.enqueue(job, "failed", "failed:1", "x") == 0
    assert not Notification.objects.exists()


def test_it_retries_a_failed_delivery_later_with_backoff(receiver):
    job, _ = make_job(notify_webhook_url=receiver.url)
    notifications.enqueue(job, "failed", "failed:1", "Job failed")
    receiver.status = 500
    assert notifications.send_pending() == 0
    n = Notification.objects.get()
    assert n.sent_at is None and n.attempts == 1 and "500" in n.last_error
    receiver.status = 200
    assert notifications.send_pending() == 0  # not due yet
    assert notifications.send_pending(now=timezone.now() + timedelta(seconds=31)) == 1
    assert len(receiver.received) == 2
    n.refresh_from_db()
    assert n.attempts == 2 and n.last_error == ""


def test_it_resends_after_a_sender_crashed_between_send_and_record(receiver, monkeypatch):
    """At-least-once: the receiver got it, the sender died before recording sent_at."""
    job, _ = make_job(notify_webhook_url=receiver.url)
    notifications.enqueue(job, "failed", "failed:1", "Job failed")
    real = notifications.deliver

    def deliver_then_crash(n):
        real(n)
        raise SystemExit("worker killed")

    monkeypatch.setattr(notifications, "deliver", deliver_then_crash)
    with pytest.raises(SystemExit):
        notifications.send_pending()
    monkeypatch.setattr(notifications, "deliver", real)
    assert notifications.send_pending() == 0  # the dead sender's claim still holds
    assert notifications.send_pending(now=timezone.now() + timedelta(seconds=31)) == 1
    assert [p for p, _ in receiver.received] == [{"text": "Job failed"}] * 2  # duplicated, never lost
    assert receiver.received[0][1]["Idempotency-Key"] == receiver.received[1][1]["Idempotency-Key"]


def test_it_lets_one_of_two_senders_claim_a_row(receiver):
    job, _ = make_job(notify_webhook_url=receiver.url)
    notifications.enqueue(job, "failed", "failed:1", "Job failed")
    stale = list(Notification.objects.all())
    assert notifications.send_pending() == 1
    # A second sender that read the row before the first claimed it: its conditional claim matches 0 rows.
    claim = Notification.objects.filter(pk=stale[0].pk, sent_at__isnull=True, claimed_at__isnull=True)
    assert claim.update(claimed_at=timezone.now()) == 0
    assert len(receiver.received) == 1


def test_it_gives_up_after_the_last_attempt(receiver):
    job, _ = make_job(notify_webhook_url=receiver.url)
    notifications.enqueue(job, "failed", "failed:1", "Job failed")
    Notification.objects.update(attempts=notifications.MAX_ATTEMPTS)
    assert notifications.send_pending(now=timezone.now() + timedelta(days=1)) == 0
    assert receiver.received == []


def test_it_notifies_a_failure_set_elsewhere_once(receiver):
    job, _ = make_job(notify_webhook_url=receiver.url, notify_email="ops@example.com")
    set_status(job, "failed", "job-level restarts used up")
    assert notifications.enqueue_missing_failures() == 2
    assert notifications.enqueue_missing_failures() == 0
    assert notifications.send_pending() == 2
    assert "job-level restarts used up" in receiver.received[0][0]["text"]
    assert len(mail.outbox) == 1
