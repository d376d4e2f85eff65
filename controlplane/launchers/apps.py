from django.apps import AppConfig


class LaunchersConfig(AppConfig):
    name = "controlplane.launchers"
    label = "launchers"

    def ready(self) -> None:
        # The domain asks for launches, restarts and stops through its port; this app carries them out.
        from controlplane.jobs.launcher_port import launcher_requested
        from controlplane.launchers.tasks import on_launcher_requested

        launcher_requested.connect(on_launcher_requested, dispatch_uid="launchers.on_launcher_requested")
