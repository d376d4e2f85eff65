from django.urls import path

from controlplane.api import views

app_name = "api"
urlpatterns = [
    path("jobs", views.jobs, name="jobs"),
    path("jobs/<int:job_id>", views.job_detail, name="job"),
    path("jobs/<int:job_id>/goodput", views.job_goodput, name="goodput"),
    path("jobs/<int:job_id>/report", views.job_report, name="report"),
    path("jobs/<int:job_id>/resilience-checks", views.job_checks, name="checks"),
    path("jobs/<int:job_id>/ranks", views.job_ranks, name="ranks"),
    path("jobs/<int:job_id>/faults", views.job_faults, name="faults"),
    path("jobs/<int:job_id>/faults/<int:fault_id>", views.job_fault, name="fault"),
    path("jobs/<int:job_id>/cycles", views.job_cycles, name="cycles"),
    path("jobs/<int:job_id>/checkpoints", views.job_checkpoints, name="checkpoints"),
    path("jobs/<int:job_id>/commands", views.job_commands, name="commands"),
    path("jobs/<int:job_id>/samples", views.job_samples, name="samples"),
    path("jobs/<int:job_id>/audit", views.job_audit, name="audit"),
    path("jobs/<int:job_id>/quarantined", views.job_quarantined, name="quarantined"),
    path("jobs/<int:job_id>/log", views.job_log, name="log"),
    path("operator/openapi.json", views.openapi, name="openapi"),
]
