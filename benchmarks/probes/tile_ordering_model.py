"""CPU model (2026-11-26, ninth session) behind csrc/linalg/jacobi_tiles.cuh, the block method's tile solver.

`python tile_ordering_model.py convergence [N]`: the block method in numpy (blocks of 32, one cyclic sweep per
64 x 64 tile, rotation threshold tol ||A|| / N), outer sweeps to reach tol for the circle ordering of the old tile
solver and the XOR ordering of the new one (round mu pairs x with x ^ mu), on five spectrum classes.
`python tile_ordering_model.py banks`: shared-memory wavefronts of the new kernel's accesses per sweep (phase 1's
pair entries, the 4 x 4 blocks of A by ordered group pairs, V's rows), against the conflict-free count, for the
index layouts x -> phys(x) and row strides tried."""
import itertools
import sys

import numpy as np


def times_x(a):  # GF(2^6) = GF(2)[x] / (x^6 + x + 1)
    return ((a << 1) ^ 0b1000011) if a & 32 else a << 1


def subspaces():  # x^i GF(4), i < 21: a spread of GF(2)^6 into 21 planes
    a, w = 1, 1
    for _ in range(21):
        w = times_x(w)
    for _ in range(21):
        yield a, w
        a, w = times_x(a), times_x(w)


def xor_rounds(m=64):
    for a, w in subspaces():
        for mu in (a, w, a ^ w):
            yield [(x, x ^ mu) for x in range(m) if x < x ^ mu]


def circle_rounds(m=64):
    M = m - 1
    for r in range(M):
        yield [(r, m - 1)] + [((r + k) % M, (r - k) % M) for k in range(1, m // 2)]


def rotate(A, V, pairs, thr):  # one round's rotations (disjoint pairs), Rutishauser's formulas
    p, q = (np.array(v) for v in zip(*pairs))
    apq, app, aqq = A[p, q], A[p, p], A[q, q]
    rot = np.abs(apq) > thr
    theta = np.where(rot, (aqq - app) / (2 * np.where(rot, apq, 1)), 0)
    t = np.where(rot, np.where(theta >= 0, 1, -1) / (np.abs(theta) + np.sqrt(1 + theta ** 2)), 0)
    c, s = 1 / np.sqrt(1 + t * t), t / np.sqrt(1 + t * t)
    for M in (A, V):
        Mp, Mq = M[:, p].copy(), M[:, q].copy()
        M[:, p], M[:, q] = c * Mp - s * Mq, s * Mp + c * Mq
    Ap, Aq = A[p, :].copy(), A[q, :].copy()
    A[p, :], A[q, :] = c[:, None] * Ap - s[:, None] * Aq, s[:, None] * Ap + c[:, None] * Aq
    A[p, q] = np.where(rot, 0, A[p, q])
    A[q, p] = A[p, q]


def off(A):
    return np.linalg.norm(A - np.diag(np.diag(A)))


def block_method_sweeps(A0, order, tol, b=32, max_sweeps=40):
    A, N = A0.copy(), len(A0)
    P, nrm = N // b, np.linalg.norm(A0)
    for sweep in range(max_sweeps):
        if off(A) <= tol * nrm:
            return sweep
        for r in range(P - 1):
            J = np.zeros((N, N))
            for k, l in [(r, P - 1)] + [((r + i) % (P - 1), (r - i) % (P - 1)) for i in range(1, P // 2)]:
                idx = np.r_[k * b:(k + 1) * b, l * b:(l + 1) * b]
                T, U = A[np.ix_(idx, idx)].copy(), np.eye(2 * b)
                for pairs in order(2 * b):
                    rotate(T, U, pairs, tol * nrm / N)
                J[np.ix_(idx, idx)] = U
            A = J.T @ A @ J
    return max_sweeps


def spectra(n, rng):
    Q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    X = rng.standard_normal((n, n))
    W = rng.standard_normal((n, 8))
    E = rng.standard_normal((n, n)) * 1e-3
    return {"gaussian": (X + X.T) / 2, "cond 1e8": Q @ np.diag(np.logspace(0, -8, n)) @ Q.T,
            "clustered": Q @ np.diag(np.r_[np.ones(n // 2), 1 + 1e-6 * rng.standard_normal(n // 2)]) @ Q.T,
            "rank 8": W @ W.T, "nearly diagonal": np.diag(np.linspace(1, 2, n)) + (E + E.T) / 2}


def phys(x, fold):
    return x ^ (fold * (x >> 4))


def plan(fold):
    """The kernel's make_plan: per subspace, the first basis (u, v2) and pivot bits (pa set in u, pb in v2) whose
    removal leaves the low four bits of phys a bijection; without one (fold = 0), the lowest bits of (a, w)."""
    for a, w in subspaces():
        choices = []
        for u, v in itertools.permutations((a, w, a ^ w), 2):
            for pa in (bit for bit in range(6) if (u >> bit) & 1):
                v2 = v ^ u if (v >> pa) & 1 else v
                for pb in (bit for bit in range(6) if bit != pa and (v2 >> bit) & 1):
                    free = [phys(1 << bit, fold) & 15 for bit in range(6) if bit not in (pa, pb)]
                    choices.append((_gf2_rank(free) == 4, u, v2, min(pa, pb), max(pa, pb)))
        good = [c for c in choices if c[0]]
        yield (good or choices)[0][1:]


def _gf2_rank(vectors):
    rank, rows = 0, list(vectors)
    for bit in range(4):
        pivot = next((r for r in rows if (r >> bit) & 1), None)
        if pivot is not None:
            rows.remove(pivot)
            rows = [r ^ pivot if (r >> bit) & 1 else r for r in rows]
            rank += 1
    return rank


def wavefronts(offsets):  # one warp's 8-byte accesses: the most distinct addresses on one bank pair
    banks = {}
    for d in offsets:
        if d is not None:
            banks.setdefault(d % 16, set()).add(d)
    return max(len(s) for s in banks.values())


def bank_model(fold, ld):
    total = ideal = 0
    for u, v2, lo, hi in plan(fold):
        def member(G, k):
            r = ((G >> lo) << (lo + 1)) | (G & ((1 << lo) - 1))
            r = ((r >> hi) << (hi + 1)) | (r & ((1 << hi) - 1))
            return phys(r ^ (u if k & 1 else 0) ^ (v2 if k & 2 else 0), fold)
        for pairs in (((0, 1), (2, 3)), ((0, 2), (1, 3)), ((0, 3), (1, 2))):  # phase 1
            total += wavefronts([ld * member(G, pairs[h][0]) + member(G, pairs[h][1]) for G in range(16)
                                 for h in range(2)])
            ideal += 2
        for warp, k, l in itertools.product(range(8), range(4), range(4)):  # phase 2a: X loads (stores alike)
            total += wavefronts([ld * member(G1, k) + member(G2, l) if G1 != G2 else None
                                 for G1 in (2 * warp, 2 * warp + 1) for G2 in range(16)])
            ideal += 2
        for G, half, k in itertools.product(range(16), range(2), range(4)):  # phase 2b: V's rows
            total += wavefronts([ld * i + member(G, k) for i in range(32 * half, 32 * half + 32)])
            ideal += 2
    return total, ideal


if __name__ == "__main__":
    if sys.argv[1:2] == ["convergence"]:
        n = int(sys.argv[2]) if len(sys.argv) > 2 else 256
        for name, A in spectra(n, np.random.default_rng(1)).items():
            for tol in (1e-6, 1e-13):
                sweeps = [block_method_sweeps(A, order, tol) for order in (circle_rounds, xor_rounds)]
                print(f"{name:16s} tol {tol:.0e}: outer sweeps circle {sweeps[0]}, xor {sweeps[1]}", flush=True)
    else:
        for fold, ld in ((0, 65), (5, 65), (5, 67)):
            total, ideal = bank_model(fold, ld)
            print(f"phys = x ^ {fold} (x >> 4), row stride {ld}: {total} wavefronts per sweep, "
                  f"{total / ideal:.2f}x the conflict-free {ideal}")
