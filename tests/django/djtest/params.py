"""Test parameters of the Django app's tests: the database aliases, each with its ``django_db`` marker."""

from __future__ import annotations

from typing import Any

import pytest

#: database alias -> the kind the rest of the suite calls it.
ALIASES = {"default": "sqlite", "pg": "postgresql", "maria": "mariadb"}


def on(*aliases: str) -> list[Any]:
    """Parameters of ``alias``, each with its ``django_db`` marker (only that database is set up and flushed)."""
    return [pytest.param(a, id=ALIASES[a], marks=pytest.mark.django_db(transaction=True, databases=[a]))
            for a in (aliases or tuple(ALIASES))]
