"""The package's seams: no import circle, no layer importing one above it (tools/import_graph.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "import_graph.py"


def test_no_import_circle_and_no_upward_import() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    last = result.stdout.splitlines()[-1]
    assert last == "0 circle(s), upward import(s) or import(s) past the engine's face", result.stdout
    assert result.returncode == 0
