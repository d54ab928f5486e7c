"""What a warm `import torchkern` adds over `import torch` (the bar: <= 0.3 s, manifest verification included).

Timed inside fresh processes after torch is imported, so the interpreter's and torch's own start-up
(seconds on some hosts, and noisy) do not enter the difference. Run after the kernels are built.
"""

import statistics
import subprocess
import sys


def seconds(code: str) -> float:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


torch_only = statistics.median(
    seconds("import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)") for _ in range(5))
added = statistics.median(
    seconds("import time, torch; t = time.perf_counter(); import torchkern; print(time.perf_counter() - t)")
    for _ in range(7))
print(f"warm import: torch {torch_only:.3f} s; import torchkern after it adds {added:.3f} s (median of 7 processes)")
