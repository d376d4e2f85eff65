from django.apps import AppConfig


class IngestConfig(AppConfig):
    name = "controlplane.ingest"
    label = "ingest"
