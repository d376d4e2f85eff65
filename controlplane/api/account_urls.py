from django.urls import path

from controlplane.api import account

app_name = "account"
urlpatterns = [
    path("tokens/", account.tokens, name="tokens"),
    path("tokens/<int:token_id>/revoke/", account.token_revoke, name="token_revoke"),
]
