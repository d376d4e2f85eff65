"""Two roles: viewers (any logged-in user) see everything; operators also act.

An operator is a superuser or a member of the ``operators`` group.
"""

OPERATORS_GROUP = "operators"


def is_operator(user) -> bool:
    if not user or not user.is_authenticated or not user.is_active:
        return False
    return user.is_superuser or user.groups.filter(name=OPERATORS_GROUP).exists()
