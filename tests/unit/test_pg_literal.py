"""The PostgreSQL literals the dual write's combined state update is built from (no database needed)."""

from __future__ import annotations

from datetime import datetime

import pytest
from kafka2pc.recipes.dual_write._store._postgres import _pg_literal


@pytest.mark.parametrize(
    ("value", "literal"),
    [
        (None, "NULL"),
        ("plain", "'plain'"),
        ("o'brien", "'o''brien'"),
        ("''", "''''''"),
        ("back\\slash\\'", "'back\\slash\\'''"),  # standard-conforming: a backslash is just a character
        ("é ü 😀", "'é ü 😀'"),
        (datetime(2026, 11, 22, 22, 5, 40, 319812), "'2026-11-22 22:05:40.319812'"),
        (datetime(2026, 11, 22, 22, 5, 40), "'2026-11-22 22:05:40'"),
    ],
)
def test_values_are_quoted_verbatim_with_quotes_doubled(value: str | datetime | None, literal: str) -> None:
    assert _pg_literal(value) == literal


def test_nul_is_refused_rather_than_sent() -> None:
    with pytest.raises(ValueError, match="NUL"):
        _pg_literal("a\0b")
