import os
import sys
import zlib
from pathlib import Path

import pytest
import torch

# Make tests/testing.py importable as `testing` from every test module.
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("PYTHONHASHSEED", "0")

import testing  # noqa: E402  (importable from here on)


@pytest.fixture(autouse=True)
def _inputs_seeded_by_test(request):
    """Each test's random inputs (testing.randn and torch's global generator) come from a seed of its own id, so a
    failure reproduces with the same inputs whichever tests ran before it on the same worker (pytest-xdist)."""
    seed = zlib.crc32(request.node.nodeid.encode())
    testing._GENERATOR.manual_seed(seed)
    torch.manual_seed(seed)
