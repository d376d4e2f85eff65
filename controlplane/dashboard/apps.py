from django.apps import AppConfig


class DashboardConfig(AppConfig):
    name = "controlplane.dashboard"
    label = "dashboard"

    def ready(self) -> None:
        from controlplane.dashboard.report import standalone_html
        from controlplane.jobs import resilience_report

        resilience_report.serve_html(lambda r, base_url: standalone_html(r, base_url=base_url))
