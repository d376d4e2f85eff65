"""Mint an operator API token for a user and print it once (for scripts, CI and ``unbroken login``)."""

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from controlplane.api.tokens import mint_api_token
from controlplane.jobs.roles import is_operator


class Command(BaseCommand):
    help = "Create an API token for USERNAME and print it (shown once; only its hash is stored)."

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--name", default="command line",
                            help="what the token is for (shown in its list)")

    def handle(self, *args, username: str, name: str, **options):
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"no user {username!r}: create it first (manage.py ensure_operator or the "
                               "admin)")
        if not user.is_active:
            raise CommandError(f"user {username!r} is inactive: its tokens would be refused")
        row, token = mint_api_token(user=user, name=name, requested_by=None)
        role = "operator" if is_operator(user) else "viewer (this token can read, not act)"
        self.stderr.write(f"API token {row.name!r} for {username}, {role}; shown once, store it now:")
        self.stdout.write(token)
