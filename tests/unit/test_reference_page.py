"""docs/reference/index.md lists every public name with its real signature: the page, ``__all__`` and the code agree."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("api_reference", ROOT / "scripts" / "api_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("api_reference", module)
    spec.loader.exec_module(module)
    return module


def test_the_page_is_up_to_date() -> None:
    page = (ROOT / "docs" / "reference" / "index.md").read_text()
    assert page == generator().render(), "docs/reference/index.md is stale: run scripts/api_reference.py"


def test_every_public_name_is_listed_once_under_its_module() -> None:
    page = (ROOT / "docs" / "reference" / "index.md").read_text()
    sections = dict(re.findall(r"^## \[`([\w.]+)`\]\([\w.-]+\)\n\n(.*?)(?=^## |\Z)", page, re.MULTILINE | re.DOTALL))
    gen = generator()
    assert list(sections) == [name for name, _ in gen.MODULES]
    for module_name, body in sections.items():
        module = importlib.import_module(module_name)
        listed = re.findall(r"^- `(?:class |enum )?(\w+)", body, re.MULTILINE)
        expected = [name for name in module.__all__ if name != "__version__"]
        if module_name == "kafka2pc":
            expected.append("__version__")
        assert listed == expected, module_name


def test_signatures_leave_out_the_deprecated_arguments() -> None:
    page = (ROOT / "docs" / "reference" / "index.md").read_text()
    assert "lock_timeout_s=None" in page and "lock_timeout_ms" not in page
    assert "queue_full_timeout_s=30.0" in page and "queue_full_timeout=" not in page
