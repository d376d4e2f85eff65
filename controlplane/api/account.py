"""The user menu's "API tokens" page (``/account/tokens/``; here, beside the API the tokens are for): list
your tokens, mint one (shown once, on the answer to the POST, never stored or redirected to), revoke one.
Every account may mint its own: a viewer's token reads only."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_http_methods, require_POST

from controlplane.api.models import ApiToken
from controlplane.api.tokens import mint_api_token, revoke_api_token
from controlplane.jobs.roles import is_operator


@never_cache
@login_required
@require_http_methods(["GET", "POST"])
def tokens(request):
    minted = None
    if request.method == "POST":
        name = (request.POST.get("name") or "").strip()[:100] or "command line"
        row, minted = mint_api_token(user=request.user, name=name, requested_by=request.user,
                                     remote_addr=request.META.get("REMOTE_ADDR") or None)
        minted = {"row": row, "token": minted}
    return render(request, "account/tokens.html", {
        "tokens": ApiToken.objects.filter(user=request.user),
        "minted": minted,
        "operator": is_operator(request.user),
        "server": request.build_absolute_uri("/").rstrip("/"),
    })


@login_required
@require_POST
def token_revoke(request, token_id: int):
    token = get_object_or_404(ApiToken, pk=token_id, user=request.user)
    addr = request.META.get("REMOTE_ADDR") or None
    if revoke_api_token(token=token, requested_by=request.user, remote_addr=addr):
        messages.success(request, f"Revoked {token.name} ({token.prefix}…): scripts that send it are refused "
                                  "now.")
    return redirect("account:tokens")
