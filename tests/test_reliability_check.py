"""tests/reliability_check.py, the CPU script of what a careful new user tries at the API's edges, runs clean."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "reliability_check.py"


@pytest.mark.slow
def test_every_scenario_holds():
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600)
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert [line.split()[:2] for line in lines[:-1]] == [["ok", str(n)] for n in range(1, 13)], out.stdout
    assert lines[-1].startswith("12 of 12 held"), out.stdout
