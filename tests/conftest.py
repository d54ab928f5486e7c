import os
import sys
from pathlib import Path

# Make tests/testing.py importable as `testing` from every test module.
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("PYTHONHASHSEED", "0")
