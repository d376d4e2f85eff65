"""Create the first operator account (idempotent). Its password comes from UNBROKEN_OPERATOR_PASSWORD
or is generated and printed once, when the account is created."""

import os
import secrets

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.core.management.base import BaseCommand

from controlplane.jobs.roles import OPERATORS_GROUP


class Command(BaseCommand):
    help = "Create the operators group and an operator account if missing."

    def handle(self, *args, **options):
        group, _ = Group.objects.get_or_create(name=OPERATORS_GROUP)
        username = os.environ.get("UNBROKEN_OPERATOR_USERNAME", "operator")
        User = get_user_model()
        user = User.objects.filter(username=username).first()
        if user is not None:
            user.groups.add(group)
            self.stdout.write(f"Operator account '{username}' exists (password unchanged).")
            return
        password = os.environ.get("UNBROKEN_OPERATOR_PASSWORD") or secrets.token_urlsafe(12)
        user = User.objects.create_user(username=username, password=password)
        user.groups.add(group)
        if os.environ.get("UNBROKEN_OPERATOR_PASSWORD"):
            self.stdout.write(f"Created operator '{username}' with the password from UNBROKEN_OPERATOR_PASSWORD.")
        else:
            self.stdout.write(self.style.WARNING(
                f"Created operator '{username}' with password: {password}\n"
                "  (shown once; change it in the admin, or set UNBROKEN_OPERATOR_PASSWORD next time)"))
