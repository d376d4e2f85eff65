from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "controlplane.jobs"
    label = "jobs"

    def ready(self) -> None:
        from controlplane.jobs import logins  # noqa: F401 - connects the lockout audit (axes signal)
