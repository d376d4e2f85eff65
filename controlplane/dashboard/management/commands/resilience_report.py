"""``manage.py resilience_report <job> --out report.html``: the job's resilience report as one
self-contained HTML file (the page's content, plotly inlined, no network), or ``--json`` for the API's
document. The same ``build_report`` as the page and ``GET /api/v1/jobs/<id>/report``."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
from django.core.management.base import BaseCommand, CommandError

from controlplane.dashboard.report import standalone_html
from controlplane.jobs import projection
from controlplane.jobs.models import Job
from controlplane.jobs.resilience_report import build_report


class Command(BaseCommand):
    help = "Write a job's resilience report as a self-contained HTML file (or JSON)."

    def add_arguments(self, parser):
        parser.add_argument("job", type=int, help="the job's id")
        parser.add_argument("--out", required=True,
                            help="the file to write (report.html, or .json with --json)")
        parser.add_argument("--json", action="store_true", help="write the API's JSON document instead")
        parser.add_argument("--gpus", type=int, default=projection.LLAMA3.gpus,
                            help="GPUs to project goodput at (default: %(default)s)")
        parser.add_argument("--rate", default="", metavar="N/DAYS/GPUS",
                            help="failure rate: N interruptions in DAYS days on GPUS GPUs "
                                 "(default: Llama 3's 419/54/16384)")
        parser.add_argument("--base-url", default="",
                            help="prefix for the file's links, e.g. https://unbroken.example")

    def handle(self, *args, job: int, out: str, gpus: int, rate: str, base_url: str, **options):
        the_job = Job.objects.filter(pk=job).first()
        if the_job is None:
            raise CommandError(f"no job {job}: list them with the API (GET /api/v1/jobs) or the jobs page")
        if gpus < 1:
            raise CommandError("--gpus must be at least 1")
        t0 = time.perf_counter()
        report = build_report(the_job, gpus=gpus, rate=_rate(rate))
        if options["json"]:
            text = msgspec.json.encode(report)
        else:
            text = standalone_html(report, base_url=base_url).encode()
        Path(out).write_bytes(text)
        self.stdout.write(f"wrote {out} ({len(text) / 1e6:.1f} MB) in {time.perf_counter() - t0:.2f} s")


def _rate(text: str) -> projection.FailureRate:
    if not text:
        return projection.LLAMA3
    try:
        n, days, gpus = text.split("/")
        return projection.FailureRate(interruptions=float(n), days=float(days), gpus=int(gpus),
                                      source=f"given: {n} interruptions in {days} days on {gpus} GPUs")
    except ValueError as e:
        raise CommandError(f"--rate {text!r}: expected N/DAYS/GPUS, e.g. 419/54/16384 ({e})") from None
