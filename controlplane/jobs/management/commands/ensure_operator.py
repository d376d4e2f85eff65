"""Create the first operator account (idempotent). Its password comes from UNBROKEN_OPERATOR_PASSWORD
or is generated and printed once, when the account is created."""

import os
import secrets

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

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
        try:  # the project's validators (settings.AUTH_PASSWORD_VALIDATORS), as for any password
            validate_password(password, user=User(username=username))
        except ValidationError as e:
            raise CommandError("UNBROKEN_OPERATOR_PASSWORD is refused: " + " ".join(e.messages)) from None
        user = User.objects.create_user(username=username, password=password)
        user.groups.add(group)
        if os.environ.get("UNBROKEN_OPERATOR_PASSWORD"):
            self.stdout.write(f"Created operator '{username}' with the password from UNBROKEN_OPERATOR_PASSWORD.")
        else:
            self.stdout.write(self.style.WARNING(
                f"Created operator '{username}' with password: {password}\n"
                "  (shown once; change it in the admin, or set UNBROKEN_OPERATOR_PASSWORD next time)"))
