from django.urls import path

from controlplane.api import views

app_name = "api"
urlpatterns = [
    path("jobs", views.jobs, name="jobs"),
    path("jobs/<int:job_id>", views.job_detail, name="job"),
    path("jobs/<int:job_id>/commands", views.job_commands, name="commands"),
]
