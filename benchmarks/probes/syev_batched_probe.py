"""Is cuSOLVER's batched eigensolver (cusolverDnXsyevBatched, CUDA >= 12.6.2) a faster cold start than the block
method and torch.linalg.eigh (which calls it only for n <= 32 and loops over syevd above)? Called through ctypes
on the library torch loaded; times per synchronized call, residual and orthogonality of the worst matrix.

    python syev_batched_probe.py [--torchkern]   # the benchmark's shapes against torch.linalg.eigh (and torchkern)
    python syev_batched_probe.py --grid           # n x batch grid: cold and warm, cuSOLVER's batched against torchkern
    python syev_batched_probe.py --streams        # one syevd per matrix on k streams at once (large n)
"""
import ctypes
import sys

import torch

from _timing import per_call

SHAPES = [(256, 64), (64, 128), (64, 256), (8, 512), (16, 1024), (8, 1025)]


def _cusolver() -> ctypes.CDLL:
    torch.linalg.eigh(torch.eye(40, device="cuda"))  # torch loads libcusolver
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "libcusolver.so" in line})
    print("libcusolver:", paths)
    return ctypes.CDLL(paths[0])


class SyevBatched:
    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        self.handle, self.params = ctypes.c_void_p(), ctypes.c_void_p()
        assert lib.cusolverDnCreate(ctypes.byref(self.handle)) == 0
        assert lib.cusolverDnCreateParams(ctypes.byref(self.params)) == 0
        lib.cusolverDnSetStream(self.handle, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        self.buffers = {}

    def __call__(self, A: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, n, _ = A.shape
        dt = {torch.float32: 0, torch.float64: 1}[A.dtype]
        V = A.clone()  # symmetric: column-major = row-major; the vectors come back as rows of V
        w = torch.empty(B, n, device=A.device, dtype=A.dtype)
        info = torch.empty(B, device=A.device, dtype=torch.int32)
        i64 = ctypes.c_int64
        key = (B, n, dt)
        if key not in self.buffers:
            dev, host = ctypes.c_size_t(), ctypes.c_size_t()
            st = self.lib.cusolverDnXsyevBatched_bufferSize(
                self.handle, self.params, 1, 0, i64(n), dt, ctypes.c_void_p(V.data_ptr()), i64(n), dt,
                ctypes.c_void_p(w.data_ptr()), dt, ctypes.byref(dev), ctypes.byref(host), i64(B))
            assert st == 0, f"bufferSize status {st}"
            self.buffers[key] = (torch.empty(dev.value, dtype=torch.uint8, device=A.device),
                                 ctypes.create_string_buffer(max(host.value, 1)), dev.value, host.value)
            print(f"  workspace {B}x{n}^2: device {dev.value / 2**20:.1f} MiB, host {host.value} B")
        dbuf, hbuf, dn, hn = self.buffers[key]
        st = self.lib.cusolverDnXsyevBatched(
            self.handle, self.params, 1, 0, i64(n), dt, ctypes.c_void_p(V.data_ptr()), i64(n), dt,
            ctypes.c_void_p(w.data_ptr()), dt, ctypes.c_void_p(dbuf.data_ptr()), ctypes.c_size_t(dn), hbuf,
            ctypes.c_size_t(hn), ctypes.c_void_p(info.data_ptr()), i64(B))
        assert st == 0, f"status {st}"
        return w, V.transpose(1, 2)


def quality(A, w, V) -> tuple[float, float]:
    A64, w64, V64 = A.double(), w.double(), V.double()
    res = (A64 @ V64 - V64 * w64[:, None, :]).flatten(1).norm(dim=1) / A64.flatten(1).norm(dim=1)
    eye = torch.eye(A.shape[-1], device=A.device, dtype=torch.float64)
    orth = (V64.transpose(1, 2) @ V64 - eye).flatten(1).abs().amax(1)
    return res.max().item(), orth.max().item()


def matrices(B: int, n: int, dtype) -> torch.Tensor:
    X = torch.randn(B, n, 2 * n, device="cuda", dtype=torch.float64)
    G = X @ X.transpose(1, 2) / (2 * n) + 1e-3 * torch.eye(n, device="cuda", dtype=torch.float64)
    return G.to(dtype)


def warm_pair(B: int, n: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(A', Q0): statistics one optimizer step after those whose eigenvectors are Q0 (an EMA with beta 0.95)."""
    A = matrices(B, n, torch.float64)
    X = torch.randn(B, n, 2 * n, device="cuda", dtype=torch.float64)
    A2 = 0.95 * A + 0.05 * X @ X.transpose(1, 2) / (2 * n)
    return A2.to(dtype), torch.linalg.eigh(A)[1].to(dtype)


def grid() -> None:
    import torchkern
    print(torchkern.backend_info().backend)
    syev = SyevBatched(_cusolver())
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ms per synchronized call")
    print("dtype n B | syev cold | syev on Q0^T A Q0 (+2 float64 products) | Jacobi cold | Jacobi warm")
    for dtype in (torch.float32, torch.float64):
        for n in (33, 48, 64, 96, 128, 168, 192, 256, 384, 512, 768, 1024):
            for B in (1, 4, 16, 64, 256):
                if B * n * n > 2 ** 24 or (dtype == torch.float64 and n > 512):
                    continue
                A, Q0 = warm_pair(B, n, dtype)
                reps = 5 if B * n * n <= 2 ** 20 else 2
                cold = per_call(lambda: syev(A), reps)
                Q64 = Q0.double()

                def rotated():
                    M = (Q64.transpose(1, 2) @ A.double() @ Q64).to(dtype)
                    w, V = syev(M)
                    return w, (Q64 @ V.double()).to(dtype)
                w, V = rotated()
                r, o = quality(A, w, V)
                warm = per_call(rotated, reps)
                tk_cold = per_call(lambda: torch.ops.torchkern.eigh(A, None, "jacobi"), reps)
                tk_warm = per_call(lambda: torch.ops.torchkern.eigh(A, Q0, "jacobi"), reps)
                print(f"{str(dtype)[6:]} {n} {B} | {cold * 1e3:.3f} | {warm * 1e3:.3f} (res {r:.1e} orth {o:.1e}) "
                      f"| {tk_cold * 1e3:.3f} | {tk_warm * 1e3:.3f}", flush=True)


class SyevdStreams:
    """cusolverDnXsyevd per matrix, matrix i on stream i % k (a handle and a workspace per stream), joined."""

    def __init__(self, lib: ctypes.CDLL, k: int, n: int, dtype):
        self.lib, self.k, self.n = lib, k, n
        self.dt = {torch.float32: 0, torch.float64: 1}[dtype]
        self.streams = [torch.cuda.Stream() for _ in range(k)]
        self.handles, self.work = [], []
        params = ctypes.c_void_p()
        assert lib.cusolverDnCreateParams(ctypes.byref(params)) == 0
        self.params = params
        probe = torch.empty(n, n, device="cuda", dtype=dtype)
        w = torch.empty(n, device="cuda", dtype=dtype)
        for s in self.streams:
            h = ctypes.c_void_p()
            assert lib.cusolverDnCreate(ctypes.byref(h)) == 0
            lib.cusolverDnSetStream(h, ctypes.c_void_p(s.cuda_stream))
            dev, host = ctypes.c_size_t(), ctypes.c_size_t()
            st = lib.cusolverDnXsyevd_bufferSize(h, params, 1, 0, ctypes.c_int64(n), self.dt,
                                                  ctypes.c_void_p(probe.data_ptr()), ctypes.c_int64(n), self.dt,
                                                  ctypes.c_void_p(w.data_ptr()), self.dt, ctypes.byref(dev),
                                                  ctypes.byref(host))
            assert st == 0
            self.handles.append(h)
            self.work.append((torch.empty(dev.value, dtype=torch.uint8, device="cuda"),
                              ctypes.create_string_buffer(max(host.value, 1)), dev.value, host.value))
        print(f"  syevd workspace n={n}: device {dev.value / 2**20:.1f} MiB, host {host.value} B")

    def __call__(self, A: torch.Tensor):
        B, n, _ = A.shape
        V = A.clone()
        w = torch.empty(B, n, device=A.device, dtype=A.dtype)
        info = torch.empty(B, device=A.device, dtype=torch.int32)
        main = torch.cuda.current_stream()
        for s in self.streams:
            s.wait_stream(main)
        for i in range(B):
            j = i % self.k
            dbuf, hbuf, dn, hn = self.work[j]
            st = self.lib.cusolverDnXsyevd(
                self.handles[j], self.params, 1, 0, ctypes.c_int64(n), self.dt, ctypes.c_void_p(V[i].data_ptr()),
                ctypes.c_int64(n), self.dt, ctypes.c_void_p(w[i].data_ptr()), self.dt,
                ctypes.c_void_p(dbuf.data_ptr()), ctypes.c_size_t(dn), hbuf, ctypes.c_size_t(hn),
                ctypes.c_void_p(info[i].data_ptr()))
            assert st == 0
        for s in self.streams:
            main.wait_stream(s)
        return w, V.transpose(1, 2)


def streams() -> None:
    import torchkern
    print(torchkern.backend_info().backend)
    lib = _cusolver()
    syev = SyevBatched(lib)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; ms per synchronized call")
    for dtype in (torch.float32, torch.float64):
        for B, n in ((16, 1024), (8, 1025), (8, 1024), (4, 1024), (16, 768), (16, 512), (64, 512), (16, 384)):
            A, Q0 = warm_pair(B, n, dtype)
            row = [f"{str(dtype)[6:]} {B}x{n}^2"]
            for k in (1, 2, 4, 8, 16):
                if k > B:
                    continue
                run = SyevdStreams(lib, k, n, dtype)
                w, V = run(A)
                r, o = quality(A, w, V)
                row.append(f"k={k} {per_call(lambda: run(A), 2) * 1e3:.2f} (res {r:.0e} orth {o:.0e})")
            row.append(f"batched {per_call(lambda: syev(A), 2) * 1e3:.2f}")
            row.append(f"tk cold {per_call(lambda: torch.ops.torchkern.eigh(A, None, 'jacobi'), 2) * 1e3:.2f}")
            row.append(f"tk warm {per_call(lambda: torch.ops.torchkern.eigh(A, Q0, 'jacobi'), 2) * 1e3:.2f}")
            print(" | ".join(row), flush=True)


def main() -> None:
    if "--streams" in sys.argv:
        return streams()
    if "--grid" in sys.argv:
        return grid()
    use_torchkern = "--torchkern" in sys.argv
    if use_torchkern:
        import torchkern
        print(torchkern.backend_info())
    syev = SyevBatched(_cusolver())
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for dtype in (torch.float32, torch.float64):
        for B, n in SHAPES:
            if dtype == torch.float64 and n > 512:
                continue
            A = matrices(B, n, dtype)
            row = [f"{str(dtype)[6:]} {B}x{n}^2"]
            w, V = syev(A)
            torch.cuda.synchronize()
            t = per_call(lambda: syev(A), reps=5)
            r, o = quality(A, w, V)
            wt, _ = torch.linalg.eigh(A.double())
            ev = ((w.double() - wt).abs().amax() / wt.abs().amax()).item()
            row.append(f"syevBatched {t * 1e3:8.2f} ms (res {r:.1e} orth {o:.1e} eig {ev:.1e})")
            reps = 1 if n >= 256 else 3
            row.append(f"torch {per_call(lambda: torch.linalg.eigh(A), reps=reps) * 1e3:8.2f} ms")
            if use_torchkern:
                row.append(f"torchkern {per_call(lambda: torchkern.linalg.eigh(A), reps=3) * 1e3:8.2f} ms")
            print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
