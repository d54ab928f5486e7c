"""Device probe (2026-11-27, fourteenth session): K-FAC's training step on the optimizer benchmark's MLP (4 x 1024,
batch 1024), Adam beside it on the same host.

    python kfac_step_probe.py             # ROUNDS (2) rounds: bfloat16 / float32 products, CUDA graph / eager,
                                          # without refreshes, refresh="qr"; the synchronized cost of each step
                                          # around a refresh; TRACE=1: a torch.profiler trace of a refresh step
                                          # ($OUT/kfac_refresh_trace.json)
    python kfac_step_probe.py --tol       # the refresh's eigh at looser tolerances (sweeps, residual), K-FAC's step
    python kfac_step_probe.py --anatomy   # where the step goes: GPU busy time and top kernels per step, the refresh
                                          # alone, its eigh alone (sweeps from a profile), the every-step products at
                                          # float32 / TF32 / bfloat16 (call 1, on the thirteenth session's K-FAC)
"""
import os
import sys
import time

import torch

from _timing import bench_mlp_data, best_ms_per_step, mse_steps, per_call

sys.path.insert(0, "../../src")
from torchkern import linalg
from torchkern.optim import KFAC
from torchkern.optim.bench import _mlp

dev = "cuda"
print("torch", torch.__version__, torch.cuda.get_device_name(), flush=True)
x, y = bench_mlp_data(dev)


def anatomy() -> None:
    makers = {"adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
              "kfac": lambda m: KFAC(m, lr=1e-3),
              "kfac_norefresh": lambda m: KFAC(m, lr=1e-3, inv_update_freq=10 ** 6),
              "kfac_qr": lambda m: KFAC(m, lr=1e-3, refresh="qr")}
    opts = {}
    line = []
    for name, make in makers.items():
        m = _mlp(1024, 4, dev)
        opt = make(m)
        opts[name] = (m, opt)
        run = mse_steps(m, opt, x, y, set_to_none=False)
        wall = best_ms_per_step(run, 100)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); run(100); e.record(); torch.cuda.synchronize()
        line.append(f"{name}={wall:.3f} (gpu span {s.elapsed_time(e) / 100:.3f})")
    print("ms/step:", " ".join(line), flush=True)

    # GPU busy time of one Adam step and one K-FAC step without a refresh: is the step host-bound?
    from torch.profiler import ProfilerActivity, profile

    for name in ("adam", "kfac_norefresh", "kfac"):
        m, opt = opts[name]
        run = mse_steps(m, opt, x, y, set_to_none=False)
        run(10); torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            run(10); torch.cuda.synchronize()
        ka = prof.key_averages()
        busy = sum(k.self_device_time_total for k in ka if k.device_type.name == "CUDA") / 1e3 / 10
        print(f"{name}: GPU busy {busy:.3f} ms/step (10 steps, one refresh for kfac)", flush=True)
        rows = sorted((k for k in ka if k.device_type.name == "CUDA"), key=lambda k: -k.self_device_time_total)[:14]
        for k in rows:
            print(f"   {k.self_device_time_total / 1e3 / 10:8.3f} ms/step {k.count / 10:6.1f}/step  {k.key[:90]}")

    # the refresh alone and its eigh alone
    m, opt = opts["kfac"]
    layers = opt._layers
    for label, fn in (("refresh (_update_eigen)", lambda: opt._update_eigen(True, {})),):
        print(f"{label}: {per_call(fn, 5) * 1e3:.2f} ms", flush=True)
    from torchkern.optim.kfac import _pad, _pad_basis

    fs = [opt.state[l.weight][k] for l in layers for k in ("A", "G")]
    qs = [opt.state[l.weight]["Q" + k] for l in layers for k in ("A", "G")]
    n = max(f.shape[0] for f in fs)
    S = torch.stack([_pad(f, n) for f in fs])
    Q0 = torch.stack([_pad_basis(q, n) for q in qs])
    for label, fn in (("eigh 8x1025 warm", lambda: linalg.eigh(S, Q0)),
                      ("eigh 8x1025 cold", lambda: linalg.eigh(S)),
                      ("eigh 8x1025 cold jacobi", lambda: linalg.eigh(S, solver="jacobi")),
                      ("eigh 4xA 1025 warm", lambda: linalg.eigh(S[0::2], Q0[0::2])),
                      ("eigh 4xG 1024 warm", lambda: linalg.eigh(torch.stack(fs[1::2]), torch.stack(qs[1::2]))),
                      ("torch.linalg.eigh 8x1025", lambda: torch.linalg.eigh(S))):
        ms = per_call(fn, 3) * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(); torch.cuda.synchronize()
        ka = [k for k in prof.key_averages() if k.device_type.name == "CUDA"]
        sweeps = sum(k.count for k in ka if "offdiag_rows" in k.key)
        busy = sum(k.self_device_time_total for k in ka) / 1e3
        tiles = sum(k.self_device_time_total for k in ka if "tiles" in k.key or "tile" in k.key) / 1e3
        rounds = sum(k.self_device_time_total for k in ka if "block_round" in k.key) / 1e3
        print(f"{label}: {ms:.2f} ms, GPU busy {busy:.2f}, sweeps {sweeps}, tile solves {tiles:.2f}, "
              f"rounds {rounds:.2f}", flush=True)
    # off-diagonal of the warm-rotated matrix: how far from diagonal is a 10-step-old basis?
    R = Q0.double().mT @ S.double() @ Q0.double()
    off = (R - torch.diag_embed(R.diagonal(dim1=1, dim2=2))).flatten(1).norm(dim=1) / R.flatten(1).norm(dim=1)
    print("warm start's relative off-diagonal norm per factor:", " ".join(f"{v:.1e}" for v in off.tolist()))

    # the every-step products: factors (a^T a, g^T g) and the preconditioning (4 products per layer)
    a = torch.randn(1024, 1025, device=dev)
    Gr = torch.randn(4, 1024, 1025, device=dev)
    QG, QA = torch.linalg.qr(torch.randn(4, 1024, 1024, device=dev))[0], torch.linalg.qr(torch.randn(4, 1025, 1025,
                                                                                                     device=dev))[0]
    dG, dA = torch.rand(4, 1024, device=dev), torch.rand(4, 1025, device=dev)
    for prec in ("fp32", "tf32", "bf16"):
        torch.backends.cuda.matmul.allow_tf32 = prec == "tf32"
        if prec == "bf16":
            a16 = a.bfloat16()
            fac = lambda: [torch.mm(a16.T, a16, out_dtype=torch.float32) for _ in range(8)]
            def pre():
                V = torch.bmm(torch.bmm(QG.mT.bfloat16(), Gr.bfloat16(), out_dtype=torch.float32).bfloat16(),
                              QA.bfloat16(), out_dtype=torch.float32)
                V = V / (dG[:, :, None] * dA[:, None, :] + 1e-3)
                return torch.bmm(torch.bmm(QG.bfloat16(), V.bfloat16(), out_dtype=torch.float32).bfloat16(),
                                 QA.mT.bfloat16(), out_dtype=torch.float32)
        else:
            fac = lambda: [a.T @ a for _ in range(8)]
            pre = lambda: linalg.kron_precondition(Gr, (QG, dG), (QA, dA), 1e-3)
        print(f"{prec}: 8 factor products {per_call(fac, 10) * 1e3:.3f} ms, preconditioning 4 layers "
              f"{per_call(pre, 10) * 1e3:.3f} ms", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False


def step_ab() -> None:
    makers = {"adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
              "kfac_bf16": lambda m: KFAC(m, lr=1e-3, precision="bf16"),
              "kfac_fp32": lambda m: KFAC(m, lr=1e-3, precision="fp32"),
              "kfac_fp32_eager": lambda m: KFAC(m, lr=1e-3, precision="fp32", cuda_graph=False),
              "kfac_bf16_eager": lambda m: KFAC(m, lr=1e-3, precision="bf16", cuda_graph=False),
              "kfac_norefresh": lambda m: KFAC(m, lr=1e-3, inv_update_freq=10 ** 6, precision="bf16"),
              "kfac_fp32_norefresh": lambda m: KFAC(m, lr=1e-3, inv_update_freq=10 ** 6, precision="fp32"),
              "kfac_qr": lambda m: KFAC(m, lr=1e-3, refresh="qr", precision="bf16")}
    opts = {}
    for rnd in range(int(os.environ.get("ROUNDS", 2))):
        line = []
        for name, make in makers.items():
            if name not in opts:
                m = _mlp(1024, 4, dev)
                opts[name] = (m, make(m))
            m, opt = opts[name]
            ms = best_ms_per_step(mse_steps(m, opt, x, y, set_to_none=False), 100)
            line.append(f"{name}={ms:.3f}")
        print(f"round {rnd} ms/step:", " ".join(line), flush=True)
    m, opt = opts["kfac_bf16"]
    print("kfac graph replays", opt._graph.replays, "errors", opt._graph.errors, flush=True)

    # per step, synchronized after each: the refresh step against the others
    run = mse_steps(m, opt, x, y, set_to_none=False)
    torch.cuda.synchronize()
    times = []
    for i in range(20):
        t = time.perf_counter(); run(1); torch.cuda.synchronize(); times.append((time.perf_counter() - t) * 1e3)
    print("kfac synchronized steps (ms):", " ".join(f"{t:.2f}" for t in times), "| steps mod 10 at the first:",
          (opt.steps - 20) % 10, flush=True)

    if not os.environ.get("TRACE"):
        return
    from torch.profiler import ProfilerActivity, profile

    while opt.steps % 10 != 9:
        run(1)
    run(1)  # ends one before a refresh: the next step refreshes
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        run(2); torch.cuda.synchronize()
    prof.export_chrome_trace(os.path.join(os.environ.get("OUT", "."), "kfac_refresh_trace.json"))
    ka = [k for k in prof.key_averages() if k.device_type.name == "CUDA"]
    for k in sorted(ka, key=lambda k: -k.self_device_time_total)[:12]:
        print(f"   {k.self_device_time_total / 1e3:8.3f} ms {k.count:5d}x  {k.key[:90]}")


def tolerance() -> None:
    """The refresh's eigh at looser stopping tolerances: on the eight factors and bases of a real refresh (captured
    from a K-FAC run), time, sweeps (from a profile) and residual per tol; then K-FAC's step with each."""
    from torch.profiler import ProfilerActivity, profile

    from torchkern.optim import kfac as kfac_module

    m = _mlp(1024, 4, dev)
    opt = KFAC(m, lr=1e-3, eigh_tol=None)  # (the fourteenth session's call 8 ran before eigh_tol, at full accuracy)
    run = mse_steps(m, opt, x, y, set_to_none=False)
    run(95)
    captured, real = [], kfac_module.eigh

    def grab(S, Q0=None, tol=None):
        if Q0 is not None:
            captured.append((S.clone(), Q0.clone()))
        return real(S, Q0, tol)

    kfac_module.eigh = grab
    while not captured:
        run(1)
    kfac_module.eigh = real
    S, Q0 = captured[0]
    norm = S.double().flatten(1).norm(dim=1)
    for tol in (None, 1e-5, 1e-4, 1e-3, 1e-2):
        ms = per_call(lambda: linalg.eigh(S, Q0, tol=tol), 3) * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            w, V = linalg.eigh(S, Q0, tol=tol)
            torch.cuda.synchronize()
        sweeps = sum(k.count for k in prof.key_averages() if "offdiag_rows" in k.key)
        Sd, Vd = S.double(), V.double()
        res = ((Sd @ Vd - Vd * w.double().unsqueeze(-2)).flatten(1).norm(dim=1) / norm).max().item()
        print(f"refresh eigh 8x1025 tol {tol}: {ms:.2f} ms, sweeps {sweeps}, residual {res:.1e}", flush=True)
    ma = _mlp(1024, 4, dev)
    oa = torch.optim.Adam(ma.parameters(), lr=1e-3)
    for rnd in range(2):
        line = [f"adam={best_ms_per_step(mse_steps(ma, oa, x, y, set_to_none=False), 100):.3f}"]
        for tol in (None, 1e-4, 1e-3):
            mk = _mlp(1024, 4, dev)
            ok = KFAC(mk, lr=1e-3, eigh_tol=tol)
            line.append(f"kfac tol {tol}={best_ms_per_step(mse_steps(mk, ok, x, y, False), 100):.3f}")
        print(f"round {rnd} ms/step:", " ".join(line), flush=True)


if __name__ == "__main__":
    {"--anatomy": anatomy, "--tol": tolerance}.get(sys.argv[-1], step_ab)()
