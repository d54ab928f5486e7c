"""Compile and run the README's user-kernel example through torchkern_jit.load (needs a GPU)."""

import re
import tempfile
from pathlib import Path

import torch

import torchkern_jit

readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
source = re.search(r"```cpp\n// scale.cu\n(.*?)```", readme, re.S).group(1)
with tempfile.TemporaryDirectory() as tmp:
    path = Path(tmp) / "scale.cu"
    path.write_text(source)
    lib = torchkern_jit.load("my_ops", [path])
    x = torch.randn(1000, device="cuda")
    torch.testing.assert_close(torch.ops.my_ops.scale(x, 3.0), 3.0 * x)
    print(f"README user kernel: built={lib.built} in {lib.build_seconds:.1f} s, result correct")
