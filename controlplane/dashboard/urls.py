from django.urls import path

from controlplane.dashboard import actions, assets, metrics, report, resilience_check, views

app_name = "dashboard"
urlpatterns = [
    path("", views.jobs, name="jobs"),
    path("jobs/table/", views.jobs_table, name="jobs_table"),
    path("jobs/live/", views.jobs_live, name="jobs_live"),
    path("jobs/new/", actions.job_new, name="job_new"),
    path("jobs/<int:job_id>/", views.job_detail, name="job"),
    path("jobs/<int:job_id>/live/", views.job_live, name="job_live"),
    path("jobs/<int:job_id>/faults/<int:fault_id>/", views.fault_detail, name="fault"),
    path("jobs/<int:job_id>/part/<slug:name>/", views.job_part, name="job_part"),
    path("jobs/<int:job_id>/report/", report.report_page, name="job_report"),
    path("jobs/<int:job_id>/check/", resilience_check.job_check, name="job_check"),
    path("jobs/<int:job_id>/stop/", actions.job_stop, name="job_stop"),
    path("jobs/<int:job_id>/restart/", actions.job_restart, name="job_restart"),
    path("jobs/<int:job_id>/inject/", actions.job_inject, name="job_inject"),
    path("metrics", metrics.metrics, name="metrics"),
    path("assets/plotly-<str:version>.min.js", assets.plotly_js, name="plotly_js"),
]
