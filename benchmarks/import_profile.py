"""Where a warm ``import torchkern`` spends its time (torch already imported)."""

import cProfile
import io
import pstats
import time

import torch  # noqa: F401  (not part of torchkern's cost)

start = time.perf_counter()
profile = cProfile.Profile()
profile.enable()
import torchkern  # noqa: E402,F401

profile.disable()
print(f"import torchkern after torch: {time.perf_counter() - start:.3f} s")
out = io.StringIO()
pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(18)
print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:4000])
