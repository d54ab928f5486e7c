"""The probes' timers (GPU, synchronized around the timed calls, so they include the host's launch time when the
host is the bottleneck)."""
import time

import torch
import torch.nn.functional as F


def per_call(fn, reps: int = 10) -> float:
    """Seconds per call of ``fn``, after one warm-up call, over ``reps`` back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def gpu_ms(fn, reps: int = 20) -> float:
    """GPU milliseconds per call of ``fn`` by CUDA events around ``reps`` back-to-back calls, after one warm-up
    call (the host's time is hidden while the queue stays full)."""
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / reps


def best_ms_per_step(run, steps: int, warmup: int = 20, repeats: int = 2) -> float:
    """The best of ``repeats`` timings of ``run(steps)`` (``steps`` training steps), in ms per step."""
    run(warmup)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run(steps)
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / steps * 1e3)
    return best


def mse_steps(model, opt, x, y, set_to_none: bool = True):
    """``run(n)`` for :func:`best_ms_per_step`: n training steps of ``model`` on the MSE of (x, y)."""
    def run(n):
        for _ in range(n):
            opt.zero_grad(set_to_none=set_to_none)
            F.mse_loss(model(x), y).backward()
            opt.step()
    return run


def print_quality_step_times(makers: dict, device) -> None:
    """ms per training step of each ``makers[name](model, lr)`` at lr 1e-3 on the quality suite's four tasks (its
    own minibatches), one line per task."""
    from torchkern.optim import quality

    for tname in ("regression", "classification", "cnn", "transformer"):
        task = quality.TASKS[tname](device, quick=False)
        out = []
        for name, make in makers.items():
            torch.manual_seed(0)
            model = task.make_model()
            opt = make(model, 1e-3)
            next_batch = task.batches(torch.Generator().manual_seed(0))

            def run(n):
                for _ in range(n):
                    x, y = next_batch()
                    opt.zero_grad(set_to_none=True)
                    task.loss(model(x), y).backward()
                    opt.step()
            out.append(f"{name}={best_ms_per_step(run, 100):.3f}")
        print(tname, "ms/step:", " ".join(out), flush=True)


def bench_mlp_data(device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """The optimizer benchmark's inputs and targets (torchkern.optim.bench: 1024 x 1024 each, the same seed)."""
    g = torch.Generator(device=device).manual_seed(1)
    return torch.randn(1024, 1024, device=device, generator=g), torch.randn(1024, 1024, device=device, generator=g)


def warm_start_statistics(batch: int, n: int, seed: int, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """The eigh probes' matrices: float64 statistics P = Z Z^T / n one optimizer step later, A = P + 1e-2 ||P||_2 N
    (N = W W^T scaled to unit spectral norm; Z, W standard normal), and P's eigenbasis, a warm start for A."""
    g = torch.Generator(device=device).manual_seed(seed)
    Z = torch.randn(batch, n, n, device=device, dtype=torch.float64, generator=g)
    prev = Z @ Z.mT / n
    N = torch.randn(batch, n, n, device=device, dtype=torch.float64, generator=g)
    N = N @ N.mT
    N = N / torch.linalg.matrix_norm(N, 2)[:, None, None]
    return prev + 1e-2 * torch.linalg.matrix_norm(prev, 2)[:, None, None] * N, torch.linalg.eigh(prev)[1]


def power_step_inputs(k: int, n: int, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The power-step probes' inputs: float32 statistics S one step past those whose eigenbasis is Q0 (S = Z Z^T / 2n
    plus 0.05 W W^T / n, Z, W standard normal), and X, the unit-norm columns of Q0^T S Q0 in float64 (what a
    Cholesky QR pass of the power step factors)."""
    g = torch.Generator(device=device).manual_seed(0)
    Z = torch.randn(k, n, 2 * n, device=device, generator=g)
    S = Z @ Z.mT / (2 * n)
    Q0 = torch.linalg.eigh(S.double())[1].float()
    W = torch.randn(k, n, n, device=device, generator=g)
    S = S + 0.05 * (W @ W.mT / n)
    M = (Q0.mT @ (S @ Q0)).double()
    return S, Q0, M / torch.linalg.vector_norm(M, dim=-2, keepdim=True)
