"""Device probe (2026-11-27, fifteenth session): the block method's sweeps as a device-side loop (a CUDA graph's
WHILE node) against the host round trip per sweep, A/B on one host.

    python eigh_device_loop_probe.py OLD_SRC NEW_SRC [ROUNDS]

Each round runs both trees (alternating, each in its own process): the block method's calls (per synchronized
call, and how long the host is held by a call it does not wait for), then K-FAC's and Adam's training step on the
optimizer benchmark's MLP (4 x 1024, batch 1024; K-FAC's refresh decomposes eight 1025^2 factors, warm).
"""
import os
import subprocess
import sys

CHILD = r"""
import time, torch
from _timing import bench_mlp_data, best_ms_per_step, mse_steps, per_call
import torchkern
from torchkern.optim import KFAC
from torchkern.optim.bench import _mlp

dev = "cuda"
torch.manual_seed(0)
line = []
for B, n, warm in ((16, 1024, False), (8, 1025, True), (64, 256, False), (4, 200, True)):
    A = torch.randn(B, n, n, device=dev)
    A = A @ A.mT / n
    Q0 = torch.linalg.qr(torch.randn(B, n, n, device=dev))[0] if warm else None
    if warm:  # a basis of a nearby matrix, as an optimizer's: the exact one of A minus a small change
        Q0 = torch.linalg.eigh(A + 1e-3 * (A @ A) / n)[1]
    fn = lambda: torch.ops.torchkern.eigh(A, Q0, "jacobi", None)  # the op: linalg.eigh's NaN check waits
    ms = per_call(fn, 3) * 1e3
    torch.cuda.synchronize()
    t = time.perf_counter(); fn(); held = (time.perf_counter() - t) * 1e3; torch.cuda.synchronize()
    w, V = fn()
    res = ((A @ V - V * w[:, None, :]).flatten(1).norm(dim=1) / A.flatten(1).norm(dim=1)).max().item()
    line.append(f"{B}x{n}{' warm' if warm else ''}: {ms:.2f} ms (host held {held:.2f}, residual {res:.1e})")
print("  eigh jacobi: " + "; ".join(line), flush=True)
x, y = bench_mlp_data(dev)
out = []
for name, make in (("adam", lambda m: torch.optim.Adam(m.parameters(), lr=1e-3)),
                   ("kfac", lambda m: KFAC(m, lr=1e-3)),
                   ("kfac_eager", lambda m: KFAC(m, lr=1e-3, cuda_graph=False))):
    m = _mlp(1024, 4, dev)
    opt = make(m)
    out.append(f"{name}={best_ms_per_step(mse_steps(m, opt, x, y, set_to_none=False), 100):.3f}")
print("  ms/step: " + " ".join(out), flush=True)
"""


def main() -> None:
    old, new = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    here = os.path.dirname(os.path.abspath(__file__))
    for r in range(rounds):
        for label, src in (("old", old), ("new", new)):
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(src), here]))
            print(f"round {r} {label} ({src})", flush=True)
            subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=here, check=False)


if __name__ == "__main__":
    main()
