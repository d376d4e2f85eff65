from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    path("login/", auth_views.LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("api/v1/", include("controlplane.ingest.urls")),
    path("api/v1/", include("controlplane.api.urls")),
    path("account/", include("controlplane.api.account_urls")),
    path("", include("controlplane.dashboard.urls")),
]
