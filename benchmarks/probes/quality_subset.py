"""Device probe (2026-11-26, fifth session): the quality suite for AdamW and Shampoo with its variants only (no plots;
the table on stdout, quality.json under $OUT/q). Arguments: task names (default: all four)."""
import os
import sys

sys.path.insert(0, "src")
from torchkern.optim import quality  # noqa: E402

quality.main(out_dir=os.environ["OUT"] + "/q", optimizers=("adamw", "shampoo"), plots=False,
             tasks=tuple(sys.argv[1:]) or None)
