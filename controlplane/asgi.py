import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
django_application = get_asgi_application()

from controlplane.ingest.asgi import with_ingest  # noqa: E402  (needs Django set up)
from controlplane.ingest.liveness import with_liveness  # noqa: E402

# Ingest batches take a lean raw-ASGI path; every other request goes through Django. The process
# ticks the ingest beacon while it runs (outage grace: controlplane/jobs/outages.py).
application = with_liveness(with_ingest(django_application))
