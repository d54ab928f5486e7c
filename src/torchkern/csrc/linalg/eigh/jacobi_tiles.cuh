// The block method's subproblems (eigh_block_method.cu): per block-row pair, its 64 x 64 diagonal tile of the
// float64 matrix gets TORCHKERN_EIGH_INNER_SWEEPS cyclic Jacobi sweeps, and the product of their rotations is
// returned as U (the tile's eigenvector estimate, columns in the tile's index order, unsorted: close to the identity
// once the matrix is nearly diagonal, so that the block rows keep their meaning). One thread block per tile, A and the
// rotation accumulator V in shared memory.
//
// Ordering. Round mu (1 .. 63) pairs index x with x ^ mu: its 32 pairs are disjoint and the 63 rounds meet every
// pair once (mu = x ^ y). The rounds go in 21 triples {a, b, a ^ b}: with 0, each is a 2-dimensional subspace S
// of GF(2)^6 (the multiples of GF(4) = {0, 1, w, w^2} by x^i in GF(64) = GF(2)[x] / (x^6 + x + 1), i < 21, w =
// x^21: they partition the 63 masks), so a triple's three rounds only mix indices within the 16 cosets x ^ S
// ("groups" of four). A triple is one step of two phases: warp 0 runs the three rounds on the 16 groups' 4 x 4
// diagonal blocks of A (lanes 2G, 2G + 1 one rotation each per round) and accumulates each group's product Q_G
// (barrier); then warps 0-7 turn every off-diagonal 4 x 4 block of A into Q_G1^T A_G1G2 Q_G2 while warps 8-15
// take V's rows to V_G Q_G (barrier). Against one round at a time on 2 x 2 blocks with the circle ordering (as
// jacobi.cuh does): a third of the barriers, no rotation tables, and each step's accesses to A and V in 4 x 4
// blocks; on one H100 the block method at 64 x 256^2 took 10.9 ms against 13.0, 16 x 1024^2 118 against 130 ms.
// Phase 1 (the rotations' dependent chains, one warp) is what the others wait for.
// Convergence: in a numpy model of the block method (n = 256, tol 1e-6 and 1e-13; random, 1e8-conditioned,
// clustered, rank-8 and nearly diagonal spectra) this ordering took within one outer sweep of the circle method's
// count, either way.
//
// Rotation of pair (p, q), d = a_qq - a_pp, a gap r = sqrt(d^2 + 4 a_pq^2): t = tan(phi) = 2 a_pq sign(d) / (|d| +
// r) (Rutishauser's t without theta), so with u = |d| + r, c = u / sqrt(u^2 + 4 a_pq^2) and s = 2 a_pq sign(d) /
// sqrt(u^2 + 4 a_pq^2), and the new diagonal is the 2 x 2 block's eigenvalues (a_pp + a_qq)/2 -+ sign(d) r/2
// (a_pp - t a_pq, a_qq + t a_pq); a_pq = 0 exactly. Two reciprocal square roots and no division on the chain.
// The diagonal's absolute error is then a few ulp of the block's largest entry rather than of the entry itself,
// which only steers later angles of this tile's sweep: the block method applies U to the whole matrix itself.
// Q is rotated with (c, s) renormalized to c^2 + s^2 = 1 (as in jacobi.cuh). Entries with |a_pq| <= thr (from the
// caller, relative to the whole matrix) are not rotated, and a group without rotations leaves its blocks and V's
// columns alone. A matrix that has converged (active == 0) gets U = I at once.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "launchers.h"
#include "torchkern/launch.cuh"
#include "torchkern/reduce.cuh"

namespace torchkern {
namespace jacobi {
namespace tiles {

constexpr int kM = 64;           // tile size (2 EIGH_BLOCK)
constexpr int kGroups = kM / 4;  // cosets of a step's subspace
constexpr int kSteps = 21;       // triples per sweep (63 rounds)
constexpr int kThreads = 512;    // warp 0: the rotations; then warps 0-7 A's blocks, warps 8-15 V's rows
constexpr int kLd = kM + 3;      // A's and V's row stride in doubles (with phys below: bank conflicts, next note)
constexpr int kQld = 17;         // Q_G's stride: odd, so lanes reading different groups' Q hit distinct banks

// Bank conflicts. A warp's accesses go over the members of one local index k of 16 groups: 16 indices that agree
// in the two bits the step's representatives keep clear (lo, hi below), and a double's bank pair is its element
// offset mod 16, which only sees an index's low four bits. So an index x is stored at phys(x) = x with bits 4-5
// folded into the low four (x ^ 5 (x >> 4): linear over GF(2), bijective), and each step takes bits (lo, hi)
// whose removal leaves the low four bits of phys a bijection of the other four (every step has such a pair). With
// kLd = 67, a model of the kernel's accesses (phase 1's pair entries, the blocks' loads and stores, V's rows) gives
// 1.04 times the conflict-free wavefronts, against 1.94 with phys = x (and, in Nsight Compute, 2.4 for the loads
// and 5.9 for the stores of a layout without phys and with one block per two threads).
__host__ __device__ constexpr int phys(int x) { return x ^ (5 * (x >> 4)); }

// Multiplication by x in GF(2^6) = GF(2)[x] / (x^6 + x + 1) (x is primitive: its powers are the 63 masks).
constexpr int times_x(int a) { return (a & 32) ? ((a << 1) ^ 0b1000011) : (a << 1); }

// A step's groups. Its subspace {0, a, b2, a ^ b2} (with a bit lo or hi set in a and clear in b2, and the other
// set in b2) meets every coset in one member with bits lo and hi clear: the representative of group G is G with
// zeros inserted at lo and hi, its members rep ^ {0, a, b2, a ^ b2} (local indices 0 .. 3), and the step's rounds
// a, b2, a ^ b2 pair the local indices (0, 1)(2, 3), (0, 2)(1, 3), (0, 3)(1, 2).
struct Step {
  int a, b2, lo, hi;
  __host__ __device__ constexpr int rep(int G) const {
    const int r = ((G >> lo) << (lo + 1)) | (G & ((1 << lo) - 1));
    return ((r >> hi) << (hi + 1)) | (r & ((1 << hi) - 1));
  }
  __host__ __device__ constexpr int member(int r, int k) const {
    return r ^ ((k & 1) ? a : 0) ^ ((k & 2) ? b2 : 0);
  }
};

// Whether removing bits lo, hi leaves the low four bits of phys a bijection of the other four (rank 4 over GF(2)).
constexpr bool conflict_free(int lo, int hi) {
  int rows[4] = {}, n = 0;
  for (int bit = 0; bit < 6; ++bit)
    if (bit != lo && bit != hi) rows[n++] = phys(1 << bit) & 15;
  int rank = 0;
  for (int bit = 0; bit < 4; ++bit) {
    int pivot = -1;
    for (int i = rank; i < 4; ++i)
      if ((rows[i] >> bit) & 1) pivot = i;
    if (pivot < 0) continue;
    const int t = rows[pivot];
    rows[pivot] = rows[rank];
    rows[rank] = t;
    for (int i = 0; i < 4; ++i)
      if (i != rank && ((rows[i] >> bit) & 1)) rows[i] ^= t;
    ++rank;
  }
  return rank == 4;
}

// The sweep's steps: subspace i is x^i GF(4) = {0, x^i, x^i w, x^i (w + 1)} (w = x^21, a cube root of unity), with
// the first basis and bit pair (over the orderings of its elements, then the bits) that conflict_free takes.
struct Plan {
  Step step[kSteps];
};
constexpr Plan make_plan() {
  Plan plan{};
  int a = 1, w = 1;
  for (int i = 0; i < kSteps; ++i) w = times_x(w);
  for (int i = 0; i < kSteps; ++i, a = times_x(a), w = times_x(w)) {
    const int elems[3] = {a, w, a ^ w};
    bool found = false;
    for (int e1 = 0; e1 < 3 && !found; ++e1) {
      for (int e2 = 0; e2 < 3 && !found; ++e2) {
        if (e1 == e2) continue;
        const int u = elems[e1];
        for (int pa = 0; pa < 6 && !found; ++pa) {
          if (!((u >> pa) & 1)) continue;
          const int v = ((elems[e2] >> pa) & 1) ? elems[e2] ^ u : elems[e2];
          for (int pb = 0; pb < 6 && !found; ++pb) {
            if (pb == pa || !((v >> pb) & 1)) continue;
            const int lo = pa < pb ? pa : pb, hi = pa < pb ? pb : pa;
            if (conflict_free(lo, hi)) {
              plan.step[i] = Step{u, v, lo, hi};
              found = true;
            }
          }
        }
      }
    }
    if (!found) plan.step[i] = Step{0, 0, 0, 0};  // make_plan_is_complete below rejects this at compile time
  }
  return plan;
}
constexpr bool make_plan_is_complete() {
  const Plan plan = make_plan();
  bool seen[64] = {};
  for (int i = 0; i < kSteps; ++i) {  // the 63 rounds meet every pair once, and every step's groups partition
    const Step st = plan.step[i];
    if (st.a == 0) return false;
    const int masks[3] = {st.a, st.b2, st.a ^ st.b2};
    for (int m : masks) {
      if (m <= 0 || m >= 64 || seen[m]) return false;
      seen[m] = true;
    }
    bool hit[64] = {};
    for (int G = 0; G < kGroups; ++G)
      for (int k = 0; k < 4; ++k) {
        const int x = st.member(st.rep(G), k);
        if (x < 0 || x >= 64 || hit[x]) return false;
        hit[x] = true;
      }
  }
  return true;
}
static_assert(make_plan_is_complete(), "the tile sweep's plan must cover every pair once with conflict-free groups");
__constant__ Plan kPlan = make_plan();

using BlockBuffers = eigh::BlockBuffers;  // (launchers.h: the host fills them)

struct Tiles {
  const BlockBuffers* buf;
  int from;              // tile g: buf->a[from] + (g / per) batch_stride + (g % per) tile_stride, rows ld apart
  int64_t batch_stride;  // elements between matrices
  int64_t tile_stride;   // elements between the tiles of one matrix
  int per;               // tiles per matrix
  int ld;                // row stride of the input
  int max_sweeps;
  double stop_scale;     // after a sweep, a tile stops when 2 sum a_pq^2 over it <= (stop_scale thr)^2
};

// Shared memory: A (rows and columns at phys) and V (rows as they are, columns at phys), kM x kLd doubles each;
// per group Q_G, its members' phys indices and a flag (any rotation).
constexpr size_t kQOff = 2 * size_t(kM) * kLd * sizeof(double);
constexpr size_t kMembersOff = kQOff + size_t(kGroups) * kQld * sizeof(double);
constexpr size_t kFlagOff = kMembersOff + size_t(kGroups) * sizeof(int4);
constexpr size_t kSmem = kFlagOff + kGroups * sizeof(int);

__global__ void __launch_bounds__(kThreads, 2) tile_kernel(const Tiles pr) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ double red[kThreads / 32];
  double* A = reinterpret_cast<double*>(smem);
  double* V = A + kM * kLd;
  double* Q = reinterpret_cast<double*>(smem + kQOff);
  int4* members = reinterpret_cast<int4*>(smem + kMembersOff);
  int* rotated = reinterpret_cast<int*>(smem + kFlagOff);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t g = blockIdx.x, mat = g / pr.per;
  const BlockBuffers& buf = *pr.buf;
  double* u = buf.U + g * kM * kM;
  if (!buf.active[mat]) {  // converged: U = I leaves the whole matrix exactly as it is
    for (int i = tid; i < kM * kM; i += kThreads) __stwb(u + i, (i / kM == i % kM) ? 1.0 : 0.0);
    return;
  }
  const double* src = buf.a[pr.from] + mat * pr.batch_stride + (g - mat * pr.per) * pr.tile_stride;
  double amax = 0.0;  // NaN-propagating: it also detects non-finite input
  for (int i = tid; i < kM * kM; i += kThreads) {
    const int r = i / kM, c = i % kM;
    const double v = __ldg(src + int64_t(r) * pr.ld + c);  // (global: src comes from a generic pointer)
    A[phys(r) * kLd + phys(c)] = v;
    V[r * kLd + phys(c)] = r == c ? 1.0 : 0.0;
    amax = nan_max(amax, fabs(v));
  }
  amax = block_reduce<kThreads, double, true>(amax, red);  // its barriers also publish A and V
  if (!isfinite(amax)) {  // uniform (never from the block method, which zeroes such matrices)
    for (int i = tid; i < kM * kM; i += kThreads) __stwb(u + i, NAN);
    return;
  }
  // Scale by 2^-e (max |a| in [0.5, 1): nothing in d^2 + 4 a^2 or the sums overflows or underflows) and symmetrize.
  int e = 0;
  frexp(amax, &e);
  for (int i = tid; i < kM * kM; i += kThreads) {
    const int r = i / kM, c = i % kM;
    double* rc = A + phys(r) * kLd + phys(c);
    double* cr = A + phys(c) * kLd + phys(r);
    if (r == c) {
      *rc = ldexp(*rc, -e);
    } else if (r < c) {
      const double v = 0.5 * ldexp(*rc, -e) + 0.5 * ldexp(*cr, -e);
      *rc = v;
      *cr = v;
    }
  }
  const double thr = ldexp(buf.thr[mat], -e);
  const double stop2 = (pr.stop_scale * thr) * (pr.stop_scale * thr);
  __syncthreads();

  for (int sweep = 0; sweep < pr.max_sweeps; ++sweep) {
    double swept = 0.0;  // sum of a_pq^2 over this thread's rotations of the sweep
    for (int step = 0; step < kSteps; ++step) {
      if (warp == 0) {  // phase 1: lanes 2G, 2G + 1 take one of group G's pairs each round
        const Step st = kPlan.step[step];
        const int G = lane / 2, h = lane % 2, rep = st.rep(G);
        if (h == 0)
          members[G] = make_int4(phys(st.member(rep, 0)), phys(st.member(rep, 1)), phys(st.member(rep, 2)),
                                 phys(st.member(rep, 3)));
        double* q = Q + G * kQld;  // Q_G, row-major 4 x 4
#pragma unroll
        for (int i = 8 * h; i < 8 * h + 8; ++i) q[i] = (i / 4 == i % 4) ? 1.0 : 0.0;
        bool any = false;
#pragma unroll
        for (int round = 0; round < 3; ++round) {
          __syncwarp();  // Q_G's identity, or the previous round's block of A, is in place
          // the round's pairs (local indices): (0, 1)(2, 3), (0, 2)(1, 3), (0, 3)(1, 2); this lane's is (p, r)
          const int p = h == 0 ? 0 : (round == 0 ? 2 : 1), r = h == 0 ? round + 1 : (round == 2 ? 2 : 3);
          const int xp = phys(st.member(rep, p)), xr = phys(st.member(rep, r));
          const double apq = A[xp * kLd + xr];
          swept += apq * apq;
          double c = 1.0, s = 0.0;
          if (fabs(apq) > thr) {
            any = true;
            const double app = A[xp * kLd + xp], aqq = A[xr * kLd + xr];
            const double d = aqq - app, a2 = 4.0 * apq * apq, h2 = fma(d, d, a2);
            const double root = h2 * rsqrt(h2);  // sqrt(d^2 + 4 a_pq^2), the 2 x 2 block's eigenvalue gap
            const double uu = fabs(d) + root, w = rsqrt(fma(uu, uu, a2));
            c = uu * w;
            s = (d < 0.0 ? -2.0 * apq : 2.0 * apq) * w;
            const double mid = 0.5 * (app + aqq), half = (d < 0.0 ? -0.5 : 0.5) * root;
            A[xp * kLd + xp] = mid - half;  // the block's eigenvalues (a_pp - t a_pq, a_qq + t a_pq without t)
            A[xr * kLd + xr] = mid + half;
            A[xp * kLd + xr] = 0.0;
            A[xr * kLd + xp] = 0.0;
            // Q_G's columns p, r with (c, s) renormalized: c^2 + s^2 = 1 + dd, 1 / sqrt(1 + dd) = 1 - dd/2 +
            // 3 dd^2/8 to within dd^3
            const double dd = fma(c, c, fma(s, s, -1.0)), inv = fma(dd, fma(dd, 0.375, -0.5), 1.0);
            const double cq = c * inv, sq = s * inv;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const double qp = q[i * 4 + p], qr = q[i * 4 + r];
              q[i * 4 + p] = cq * qp - sq * qr;
              q[i * 4 + r] = sq * qp + cq * qr;
            }
          }
          // the block of rows (p0, r0) and columns (p1, r1) takes both rotations: J_0^T X J_1 (lane h = 0)
          const double c1 = __shfl_xor_sync(0xffffffffu, c, 1), s1 = __shfl_xor_sync(0xffffffffu, s, 1);
          const int yp = __shfl_xor_sync(0xffffffffu, xp, 1), yr = __shfl_xor_sync(0xffffffffu, xr, 1);
          if (h == 0 && (s != 0.0 || s1 != 0.0)) {
            double* rp = A + xp * kLd;
            double* rr = A + xr * kLd;
            const double x00 = rp[yp], x01 = rp[yr], x10 = rr[yp], x11 = rr[yr];
            const double y00 = c * x00 - s * x10, y01 = c * x01 - s * x11;  // rows: J_0^T X
            const double y10 = s * x00 + c * x10, y11 = s * x01 + c * x11;
            const double z00 = c1 * y00 - s1 * y01, z01 = s1 * y00 + c1 * y01;  // columns: Y J_1
            const double z10 = c1 * y10 - s1 * y11, z11 = s1 * y10 + c1 * y11;
            rp[yp] = z00;
            rp[yr] = z01;
            rr[yp] = z10;
            rr[yr] = z11;
            A[yp * kLd + xp] = z00;
            A[yr * kLd + xp] = z01;
            A[yp * kLd + xr] = z10;
            A[yr * kLd + xr] = z11;
          }
        }
        const bool partner = __shfl_xor_sync(0xffffffffu, any, 1);  // every lane (not behind `any ||`)
        if (h == 0) rotated[G] = any || partner;
      }
      __syncthreads();  // the diagonal blocks, Q_G, the members and the flags are in place
      if (warp < kThreads / 64) {
        // phase 2a: lane (G1, G2), G1 != G2, owns block (G1, G2) of A and reads and writes only it. Both owners of a
        // pair compute the block of (L, H) = (min, max) as Q_L^T X Q_H, X = A_LH (= A_HL^T bitwise), in the same
        // order, and store it in their orientation: A stays exactly symmetric, with no barrier between them.
        const int G1 = 2 * warp + lane / 16, G2 = lane % 16;
        if (G1 != G2 && (rotated[G1] || rotated[G2])) {
          const bool low = G1 < G2;
          const int4 m1 = members[G1], m2 = members[G2];
          const int4 xl = low ? m1 : m2, xh = low ? m2 : m1;
          const int L[4] = {xl.x, xl.y, xl.z, xl.w}, H[4] = {xh.x, xh.y, xh.z, xh.w};
          const double* ql = Q + (low ? G1 : G2) * kQld;
          const double* qh = Q + (low ? G2 : G1) * kQld;
          const auto at = [&](int k, int l) -> double& { return low ? A[L[k] * kLd + H[l]] : A[H[l] * kLd + L[k]]; };
          double w[4][4];  // Q_L^T X
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            double x[4];
#pragma unroll
            for (int l = 0; l < 4; ++l) x[l] = at(k, l);
#pragma unroll
            for (int rho = 0; rho < 4; ++rho) {
              const double qk = ql[k * 4 + rho];
#pragma unroll
              for (int l = 0; l < 4; ++l) w[rho][l] = k == 0 ? qk * x[l] : fma(qk, x[l], w[rho][l]);
            }
          }
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            double qh_j[4];
#pragma unroll
            for (int l = 0; l < 4; ++l) qh_j[l] = qh[l * 4 + j];
#pragma unroll
            for (int rho = 0; rho < 4; ++rho) {
              double z = w[rho][0] * qh_j[0];
#pragma unroll
              for (int l = 1; l < 4; ++l) z = fma(w[rho][l], qh_j[l], z);
              at(rho, j) = z;
            }
          }
        }
      } else {
        // phase 2b: V_G <- V_G Q_G, warp 8 + t takes groups 2t, 2t + 1; lane i rows i and 32 + i (Q_G's loads
        // are broadcasts)
#pragma unroll 1
        for (int G = 2 * (warp - kThreads / 64); G < 2 * (warp - kThreads / 64) + 2; ++G) {
          if (!rotated[G]) continue;
          const int4 m = members[G];
          const int x[4] = {m.x, m.y, m.z, m.w};
          const double* q = Q + G * kQld;
          double* r0 = V + lane * kLd;
          double* r1 = V + (32 + lane) * kLd;
          double v0[4], v1[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            v0[k] = r0[x[k]];
            v1[k] = r1[x[k]];
          }
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            double z0 = v0[0] * q[j], z1 = v1[0] * q[j];
#pragma unroll
            for (int k = 1; k < 4; ++k) {
              const double qk = q[4 * k + j];
              z0 = fma(v0[k], qk, z0);
              z1 = fma(v1[k], qk, z1);
            }
            r0[x[j]] = z0;
            r1[x[j]] = z1;
          }
        }
      }
      __syncthreads();  // A and V are complete before the next step reads them
    }
    if (pr.max_sweeps > 1) {
      swept = block_reduce<kThreads, double>(swept, red);
      if (2.0 * swept <= stop2) break;  // uniform: every thread has the same sum
    }
  }
  for (int i = tid; i < kM * kM; i += kThreads) __stwb(u + i, V[(i / kM) * kLd + phys(i % kM)]);
}

// Whether the kernel's shared memory (dynamic, and the reduction scratch) fits a block on the current device.
inline bool fits() { return kSmem + sizeof(double) * (kThreads / 32) <= smem_optin_bytes(); }

// The kernel's shared memory, opted in once per device.
inline void opt_in() {
  static int opted_in[kCachedDevices] = {};
  opt_in_smem(opted_in, tile_kernel, kSmem);
}

// Launches G tiles (the caller checks the launch's error).
inline void launch(const Tiles& pr, int64_t G, cudaStream_t stream) {
  opt_in();
  tile_kernel<<<static_cast<unsigned>(G), kThreads, kSmem, stream>>>(pr);
}

}  // namespace tiles
}  // namespace jacobi
}  // namespace torchkern
