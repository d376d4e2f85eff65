"""Notifications on job failed / stalled / restart storm / recovered: a transactional outbox.

``enqueue`` inserts one ``Notification`` row per configured channel (the job's webhook URL, its email),
in the same transaction as the transition it reports, keyed so a repeated transition is stored once.
``send_pending`` claims rows with a conditional UPDATE and sends them.

Delivery is at-least-once, not exactly-once. A sender that crashes after the receiver accepted a
message but before it recorded ``sent_at`` sends it again once the claim expires (``RETRY_S``).
Exactly-once is impossible with a plain webhook or SMTP server (neither takes part in our
transaction); we prefer a rare duplicate to a lost alert. Duplicates are detectable: webhooks carry an
``Idempotency-Key`` header and emails a ``Message-ID``, both derived from the row id.
"""

from __future__ import annotations

import json
import logging
import urllib.request
from datetime import datetime, timedelta

from django.conf import settings
from django.core.mail import EmailMessage
from django.db.models import F, Q
from django.utils import timezone

from controlplane.jobs.models import Job, JobStatus, Notification

log = logging.getLogger(__name__)

RETRY_S = 30.0  # first retry delay; also the claim lease (longer than one send can take)
MAX_RETRY_S = 3600.0
MAX_ATTEMPTS = 10
WEBHOOK_TIMEOUT_S = 10.0


def enqueue(job: Job, transition: str, key: str, text: str, *, now: datetime | None = None) -> int:
    """Store the notification of one transition for each of the job's channels. Call it inside the
    transaction that makes the transition. Returns the number of channels configured."""
    now = now or timezone.now()
    subject = f"[unbroken] job #{job.pk} {job.name}: {transition}"
    rows = []
    if job.notify_webhook_url:
        rows.append(Notification(job=job, transition=transition, transition_key=key[:100],
                                 channel=Notification.Channel.WEBHOOK, target=job.notify_webhook_url,
                                 payload={"text": text}, created_at=now))
    if job.notify_email:
        rows.append(Notification(job=job, transition=transition, transition_key=key[:100],
                                 channel=Notification.Channel.EMAIL, target=job.notify_email,
                                 payload={"subject": subject, "text": text}, created_at=now))
    if rows:
        Notification.objects.bulk_create(rows, ignore_conflicts=True)
    return len(rows)


def enqueue_missing_failures(*, now: datetime | None = None, window: timedelta = timedelta(days=1)) -> int:
    """Backstop for failures set by code that does not enqueue (launcher policy): every job that
    FAILED within ``window`` and has a channel gets its ``failed`` notification. Idempotent."""
    now = now or timezone.now()
    jobs = (Job.objects.filter(status=JobStatus.FAILED, status_changed_at__gte=now - window)
            .exclude(notify_webhook_url="", notify_email="")
            .exclude(notifications__transition__in=(Notification.Transition.FAILED, Notification.Transition.STORM)))
    n = 0
    for job in jobs:
        n += enqueue(job, Notification.Transition.FAILED, f"failed:{job.status_changed_at.timestamp():.3f}",
                     f"Job #{job.pk} {job.name} failed: {job.status_reason or 'no reason recorded'}", now=now)
    return n


def retry_delay_s(attempts: int) -> float:
    return min(RETRY_S * 2 ** max(0, attempts - 1), MAX_RETRY_S)


def send_pending(*, now: datetime | None = None, limit: int = 100) -> int:
    """Send what is due. Safe to run in several workers at once. Returns the number sent.

    1. Pick unsent rows that are unclaimed or whose claim expired (a crashed or failed sender).
    2. Claim each with ``UPDATE ... WHERE id = ? AND claimed_at IS NOT DISTINCT FROM <what we read>``:
       0 rows means another sender has it.
    3. Send, then record ``sent_at`` (a crash between the two repeats the send: at-least-once).
    4. On failure keep the claim time and the error; the row is retried after an exponential delay.
    """
    now = now or timezone.now()
    candidates = (Notification.objects.filter(sent_at__isnull=True, attempts__lt=MAX_ATTEMPTS)
                  .filter(Q(claimed_at__isnull=True) | Q(claimed_at__lt=now - timedelta(seconds=RETRY_S)))
                  .order_by("id")[:limit])
    sent = 0
    for n in candidates:
        if n.claimed_at is not None and now < n.claimed_at + timedelta(seconds=retry_delay_s(n.attempts)):
            continue
        claim = Notification.objects.filter(pk=n.pk, sent_at__isnull=True)
        claim = claim.filter(claimed_at__isnull=True) if n.claimed_at is None else claim.filter(claimed_at=n.claimed_at)
        if not claim.update(claimed_at=now, attempts=F("attempts") + 1):
            continue
        try:
            deliver(n)
        except Exception as e:  # noqa: BLE001 - any delivery failure is retried later
            log.warning("notification %s (%s to %s) failed: %s", n.pk, n.channel, n.target, e)
            Notification.objects.filter(pk=n.pk).update(last_error=str(e)[:2000])
            continue
        Notification.objects.filter(pk=n.pk).update(sent_at=timezone.now(), last_error="")
        sent += 1
    return sent


def deliver(n: Notification) -> None:
    if n.channel == Notification.Channel.WEBHOOK:
        body = json.dumps({"text": n.payload.get("text", "")}).encode()
        req = urllib.request.Request(n.target, data=body, method="POST", headers={  # noqa: S310 - operator's URL
            "Content-Type": "application/json", "User-Agent": "unbroken",
            "Idempotency-Key": f"unbroken-notification-{n.pk}"})
        with urllib.request.urlopen(req, timeout=WEBHOOK_TIMEOUT_S) as resp:  # noqa: S310 - operator's URL
            if not 200 <= resp.status < 300:
                raise RuntimeError(f"webhook answered {resp.status}")
    elif n.channel == Notification.Channel.EMAIL:
        host = settings.DEFAULT_FROM_EMAIL.rpartition("@")[2] or "localhost"
        EmailMessage(subject=n.payload.get("subject", "[unbroken]"), body=n.payload.get("text", ""),
                     to=[n.target], headers={"Message-ID": f"<unbroken-notification-{n.pk}@{host}>"}).send()
    else:
        raise ValueError(f"unknown channel {n.channel!r}")
