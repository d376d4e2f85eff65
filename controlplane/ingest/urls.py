from django.urls import path

from controlplane.ingest import views

app_name = "ingest"
urlpatterns = [
    path("jobs/<int:job_id>/ingest", views.ingest, name="ingest"),
    path("openapi.json", views.openapi, name="openapi"),
]
