"""Device probe (2026-11-26): where K-FAC's and the large eigh's time goes, and whether cuSOLVER's syevd calls
overlap when they run on several streams. Prints a table; not part of the benchmark suite."""
import math, sys, threading, time
import torch
import torch.nn.functional as F
from torch import nn

dev = "cuda"


def bench(fn, reps=5, warm=1):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2] * 1e3


def stats(batch, n, dtype=torch.float32, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(batch, n, n, device=dev, dtype=torch.float64, generator=g))
    lam = torch.logspace(0, -3, n, device=dev, dtype=torch.float64)
    G = (Q * lam) @ Q.mT
    return (0.5 * (G + G.mT)).to(dtype)


def streamed_eigh(A, k, fn=torch.linalg.eigh):
    """fn on each matrix of A, spread over k streams, one host thread per stream."""
    main = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in range(k)]
    out = [None] * A.shape[0]

    def work(i):
        s = streams[i]
        s.wait_stream(main)
        with torch.cuda.stream(s):
            for j in range(i, A.shape[0], k):
                out[j] = fn(A[j])
    ths = [threading.Thread(target=work, args=(i,)) for i in range(k)]
    for t in ths: t.start()
    for t in ths: t.join()
    for s in streams: main.wait_stream(s)
    return out


def streamed_nothreads(A, k, fn):
    main = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in range(k)]
    out = []
    for s in streams: s.wait_stream(main)
    for j in range(A.shape[0]):
        with torch.cuda.stream(streams[j % k]):
            out.append(fn(A[j]))
    for s in streams: main.wait_stream(s)
    return out


print("torch", torch.__version__, torch.cuda.get_device_name())
try:
    print("preferred linalg lib:", torch.backends.cuda.preferred_linalg_library())
except Exception as e:
    print("preferred", e)
rows = []
for dtype in (torch.float32, torch.float64):
    for (b, n) in ((16, 1024), (8, 1025), (64, 256), (64, 128)):
        A = stats(b, n, dtype)
        r = {"case": f"{b}x{n} {str(dtype)[6:]}"}
        r["batched"] = bench(lambda: torch.linalg.eigh(A), reps=3)
        r["ex_nosync"] = bench(lambda: torch.linalg.eigh(A) if False else torch._linalg_eigh(A), reps=3)
        for k in (2, 4, 8, 16):
            if k <= b:
                r[f"thr{k}"] = bench(lambda: streamed_eigh(A, k, lambda X: torch._linalg_eigh(X)), reps=3)
        r["streams8_nothr"] = bench(lambda: streamed_nothreads(A, 8, lambda X: torch._linalg_eigh(X)), reps=3)
        if n >= 1024:
            r["eigvalsh"] = bench(lambda: torch.linalg.eigvalsh(A), reps=3)
        rows.append(r)
        print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)

# magma, if this torch has it
try:
    torch.backends.cuda.preferred_linalg_library("magma")
    A = stats(16, 1024)
    print("magma 16x1024 f32:", bench(lambda: torch.linalg.eigh(A), reps=3))
except Exception as e:
    print("magma:", type(e).__name__, str(e)[:200])
finally:
    torch.backends.cuda.preferred_linalg_library("default")

# K-FAC step anatomy on the optimizer benchmark's MLP
sys.path.insert(0, "src")
import torchkern
from torchkern.optim import KFAC, Shampoo, SOAP
print(torchkern.backend_info() if hasattr(torchkern, "backend_info") else "")


def mlp():
    torch.manual_seed(0)
    layers = []
    for i in range(4):
        layers.append(nn.Linear(1024, 1024))
        if i < 3: layers.append(nn.ReLU())
    return nn.Sequential(*layers).to(dev)


g = torch.Generator(device=dev).manual_seed(1)
x = torch.randn(1024, 1024, device=dev, generator=g); y = torch.randn(1024, 1024, device=dev, generator=g)


def trainer(opt, model, n):
    def f():
        for _ in range(n):
            opt.zero_grad(set_to_none=False)
            F.mse_loss(model(x), y).backward()
            opt.step()
    return f


for name, make in (("adam", lambda m: torch.optim.Adam(m.parameters(), lr=1e-3)),
                   ("kfac", lambda m: KFAC(m, lr=1e-3)),
                   ("kfac_norefresh", lambda m: KFAC(m, lr=1e-3)),
                   ("shampoo", lambda m: Shampoo(m.parameters(), lr=1e-3, precondition_frequency=20)),
                   ("soap", lambda m: SOAP(m.parameters(), lr=1e-3))):
    m = mlp(); opt = make(m)
    f = trainer(opt, m, 100)
    f()
    if name == "kfac_norefresh":
        opt.inv_update_freq = 10 ** 9
    ms = bench(f, reps=3)
    print(f"train {name}: {ms / 100:.3f} ms/step", flush=True)
    if name in ("kfac", "shampoo", "adam"):
        from torch.profiler import profile, ProfilerActivity
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            trainer(opt, m, 20)(); torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=10, max_name_column_width=60))

# warm eigh at the K-FAC sizes: Q0 one K-FAC refresh old
m = mlp(); opt = KFAC(m, lr=1e-3); trainer(opt, m, 11)()
st = [opt.state[l.weight] for l in opt._layers]
S = torch.stack([torchkern.optim.kfac._pad(s["A"], 1025) for s in st] + [torchkern.optim.kfac._pad(s["G"], 1025) for s in st])
Q0 = torch.stack([torchkern.optim.kfac._pad_basis(s["QA"], 1025) for s in st] + [torchkern.optim.kfac._pad_basis(s["QG"], 1025) for s in st])
trainer(opt, m, 10)()
S2 = torch.stack([torchkern.optim.kfac._pad(s["A"], 1025) for s in st] + [torchkern.optim.kfac._pad(s["G"], 1025) for s in st])
print("kfac factors changed by", ((S2 - S).flatten(1).norm(dim=1) / S.flatten(1).norm(dim=1)).tolist())
print("warm torchkern eigh 8x1025:", bench(lambda: torch.ops.torchkern.eigh(S2, Q0), reps=3))
print("cold torchkern eigh 8x1025:", bench(lambda: torch.ops.torchkern.eigh(S2, None), reps=3))
import os
if os.environ.get("OUT"):  # one A and one G factor (layer 2) for CPU experiments
    for i, tag in ((1, "A1"), (5, "G1")):
        torch.save({"S": S[i].cpu(), "S2": S2[i].cpu(), "Q0": Q0[i].cpu()}, f"{os.environ['OUT']}/kfac_{tag}.pt")
