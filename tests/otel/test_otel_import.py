"""Without the ``[otel]`` extra, importing kafka2pc.otel says which extra to install."""

from __future__ import annotations

import subprocess
import sys


def test_missing_opentelemetry_names_the_extra() -> None:
    code = "import sys; sys.modules['opentelemetry'] = None; import kafka2pc.otel"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "ImportError: kafka2pc.otel needs OpenTelemetry: pip install 'kafka2pc[otel]'" in result.stderr


def test_import_kafka2pc_does_not_import_opentelemetry() -> None:
    code = "import sys, kafka2pc; assert not any(m.startswith('opentelemetry') for m in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
