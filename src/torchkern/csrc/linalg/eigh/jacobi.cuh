// Cyclic two-sided Jacobi for symmetric matrices, one matrix per thread block, every sweep in one launch.
//
// The matrix A (m x m, compute type TA) and the eigenvector accumulator V (m x m, always double) live in
// shared memory; m = n rounded up to even (an odd n gets a zero row and column, which no rotation ever
// touches: its off-diagonal entries are exactly zero). A sweep is m - 1 rounds of the round-robin
// ("circle") ordering: in round r the m / 2 disjoint pairs are (r, m - 1) and ((r + k) mod (m - 1),
// (r - k) mod (m - 1)) for k = 1 .. m/2 - 1, so every pair meets once per sweep and the rotations of a round
// commute. A round: thread k < m/2 computes pair k's rotation and writes the pair's own 2 x 2 block of A,
// while the other warps apply the previous round's rotations to V (its tables are double-buffered; V is not
// read by the rotations, so this hides their dependent chain of divisions and square roots, which the whole
// block would otherwise wait for) (barrier); then every thread applies the round's rotations to its other 2 x 2 blocks
// of A (rows of pair k1 x columns of pair k2: J1^T X J2 for k1 < k2, written to both triangles, so A stays
// exactly symmetric; each entry owned by one thread, so no barrier between the two sides) (barrier). The last
// round's rotation of V follows the last sweep.
//
// Row slices: V <- V J mixes columns within each row, so the rows of V can live in different
// blocks. With `split` > 1, each of a matrix's `split` blocks holds all of A and a slice of V's rows, and
// repeats the A work and the rotations of the others: the same instructions on the same data give bitwise the
// same A, rotations and stopping decisions in every block, with no communication. A batch too small to fill
// the GPU (64 x 128^2 on 132 multiprocessors) then uses the idle ones for V (double, and as much
// shared-memory traffic per round as A's float). 64 x 128^2, float32: 2.2 (H200) to 2.4 ms (H100) with the
// slices, the triangle and V beside the rotations, against 3.3 without them.
//
// Rotation of pair (p, q) (Rutishauser's formulas): theta = (a_qq - a_pp) / (2 a_pq),
// t = sign(theta) / (|theta| + sqrt(1 + theta^2)), c = 1 / sqrt(1 + t^2), s = t c; a_pp -= t a_pq,
// a_qq += t a_pq, a_pq = 0 exactly. V is rotated in double with (c, s) renormalized to c^2 + s^2 = 1 in
// double: in float32, V accumulated over ~8 sweeps of n rotations each loses orthogonality like
// 2 n sqrt(sweeps) eps (4e-5 at n = 128, measured in an emulation), far above the 1e-5 wanted; in double
// the loss is invisible after the final rounding to float32.
//
// Entries with |a_pq| <= thr are not rotated (thr = tol ||A||_F / m for a whole matrix, so a sweep without
// rotations leaves an off-diagonal norm <= tol ||A||_F). A whole matrix stops as soon as its off-diagonal
// norm, summed after each sweep (m^2 loads, against the m^3 of a sweep), is <= tol ||A||_F, or after
// max_sweeps: this saves the last sweep of a rule that looks at the entries as the sweep reaches them, which
// learns of convergence one sweep late (a sweep that only confirms it: 1 of 4 to 5 from a warm start).
// Input is scaled by a power of two so that max |a_ij| is in [0.5, 1) (nothing overflows or underflows
// in theta^2 or the norms; the scaling is exact) and symmetrized (a_ij + a_ji) / 2.
//
// Bank conflicts: A and V have odd row strides (m + 1), so the V update (lanes over rows, one column) is
// conflict-free; in the A update the lanes of a warp take consecutive pairs k2, whose columns are
// consecutive (mod m - 1).
//
// One matrix per block (Problem: where each lives, `split` blocks each); outputs the eigenvalues ascending and
// the eigenvectors as columns, in TA; a matrix with a NaN or Inf entry gets NaN outputs. (The block method's
// 64 x 64 subproblems have their own kernel: jacobi_tiles.cuh.)
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "torchkern/launch.cuh"
#include "torchkern/reduce.cuh"

namespace torchkern {
namespace jacobi {

template <typename TA>
struct Pair2 {
  TA x, y;
};

// One launch's matrices and outputs (G = gridDim.x / split problems).
template <typename TA>
struct Problem {
  const TA* A;           // matrix g: A + g batch_stride, rows ld apart, n x n
  int64_t batch_stride;  // elements between matrices
  int split;             // blocks per matrix, each with a slice of V's rows
  int ld;                // row stride of the input
  int n;                 // matrix size
  int max_sweeps;
  double tol;            // the stopping tolerance relative to ||A||_F
  TA* w;                 // [G, n] eigenvalues ascending
  TA* V;                 // [G, n, n] eigenvectors as columns (each block writes its slice's rows)
};

// Rows of V per block when a problem of size n is split over `split` blocks.
__host__ __device__ inline int slice_rows(int n, int split) { return (n + split - 1) / split; }

// Shared memory of one block: V's rows of the block's slice (double), A (TA), then the rotation tables.
template <typename TA>
struct Layout {
  int m, h, ld;
  size_t v_off, a_off, pq_off, cs_off, csd_off, rot_off, bytes;
  __host__ __device__ Layout(int n, int v_rows) {
    m = n + (n & 1);
    h = m / 2;
    ld = m + 1;
    const size_t mm = size_t(m) * ld;
    v_off = 0;
    a_off = v_off + size_t(v_rows) * ld * sizeof(double);
    // the tables of two rounds (V is rotated by the previous round's while this round's are computed)
    pq_off = align16(a_off + mm * sizeof(TA));
    cs_off = align16(pq_off + size_t(2 * h) * sizeof(int2));
    csd_off = align16(cs_off + size_t(2 * h) * sizeof(Pair2<TA>));
    rot_off = align16(csd_off + size_t(2 * h) * sizeof(Pair2<double>));
    bytes = align16(rot_off + size_t(m) * sizeof(int));  // rot (2h = m ints), reused as the sort's permutation
  }
  __host__ __device__ static size_t align16(size_t x) { return (x + 15) & ~size_t(15); }
};

template <typename TA>
__device__ __forceinline__ TA scale2(TA x, int e) {
  return ldexp(x, e);  // exact for a power-of-two scaling (barring underflow of negligible entries)
}

template <typename TA, int THREADS>
__global__ void __launch_bounds__(THREADS) jacobi_kernel(const Problem<TA> pr) {
  constexpr int kWarps = THREADS / 32;
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ double red_d[kWarps];  // kStaticSmem bounds these two
  __shared__ TA red_a[kWarps];
  const int n = pr.n;
  const int v_rows = slice_rows(n, pr.split);
  const Layout<TA> lay(n, v_rows);
  const int m = lay.m, h = lay.h, ld = lay.ld;
  double* V = reinterpret_cast<double*>(smem + lay.v_off);
  TA* A = reinterpret_cast<TA*>(smem + lay.a_off);
  int2* tab_pq = reinterpret_cast<int2*>(smem + lay.pq_off);
  Pair2<TA>* tab_cs = reinterpret_cast<Pair2<TA>*>(smem + lay.cs_off);
  Pair2<double>* tab_csd = reinterpret_cast<Pair2<double>*>(smem + lay.csd_off);
  int* tab_rot = reinterpret_cast<int*>(smem + lay.rot_off);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int64_t g = blockIdx.x / pr.split;  // the matrix
  const TA* src = pr.A + g * pr.batch_stride;
  // this block's rows of V: r0 .. r0 + nr - 1
  const int r0 = static_cast<int>(blockIdx.x % pr.split) * v_rows, nr = min(v_rows, n - r0);

  // Load (zero padding), the largest |a| (NaN-propagating: it also detects non-finite input), V = I.
  TA amax = TA(0);
  for (int i = tid; i < m * m; i += THREADS) {
    const int r = i / m, c = i - r * m;
    const TA v = (r < n && c < n) ? src[int64_t(r) * pr.ld + c] : TA(0);
    A[r * ld + c] = v;
    amax = nan_max(amax, fabs(v));
  }
  for (int i = tid; i < nr * m; i += THREADS) {
    const int r = i / m, c = i - r * m;
    V[r * ld + c] = r0 + r == c ? 1.0 : 0.0;
  }
  amax = block_reduce<THREADS, TA, true>(amax, red_a);  // its barriers also publish A and V
  if (!isfinite(amax)) {  // uniform: NaN outputs
    if (r0 == 0)
      for (int i = tid; i < n; i += THREADS) pr.w[g * n + i] = TA(NAN);
    for (int i = tid; i < nr * n; i += THREADS) pr.V[(g * n + r0) * n + i] = TA(NAN);
    return;
  }
  int e = 0;
  frexp(amax, &e);  // amax = f 2^e, f in [0.5, 1) (e = 0 for a zero matrix)
  // Scale by 2^-e and symmetrize; each unordered pair (r, c) is handled by the thread of (r, c), r <= c.
  double norm2 = 0.0, off2 = 0.0;
  for (int i = tid; i < m * m; i += THREADS) {
    const int r = i / m, c = i - r * m;
    if (r == c) {
      const TA v = scale2(A[r * ld + c], -e);
      A[r * ld + c] = v;
      norm2 += double(v) * v;
    } else if (r < c) {
      const TA v = TA(0.5) * scale2(A[r * ld + c], -e) + TA(0.5) * scale2(A[c * ld + r], -e);
      A[r * ld + c] = v;
      A[c * ld + r] = v;
      norm2 += 2.0 * double(v) * v;
      off2 += 2.0 * double(v) * v;
    }
  }
  norm2 = block_reduce<THREADS, double>(norm2, red_d);
  off2 = block_reduce<THREADS, double>(off2, red_d);
  // Threshold below which an entry is not rotated, and the stopping bound on the off-diagonal norm^2.
  const double tol_norm = pr.tol * sqrt(norm2);
  const TA thr = static_cast<TA>(tol_norm / m);
  const double stop2 = tol_norm * tol_norm;

  // V <- V J for the round whose tables start at `buf` (h entries each), on this block's rows (padding rows stay
  // zero: only rows below n): lanes over pairs (each loads its pair's rotation once; consecutive pairs have
  // consecutive columns), warps first_warp.. over rows.
  const auto rotate_v = [&](int buf, int first_warp) {
    for (int k = lane; k < h; k += 32) {
      if (!tab_rot[buf + k]) continue;
      const int2 pq = tab_pq[buf + k];
      const Pair2<double> cs = tab_csd[buf + k];
      for (int i = warp - first_warp; i < nr; i += kWarps - first_warp) {
        double* row = V + i * ld;
        const double vp = row[pq.x], vq = row[pq.y];
        row[pq.x] = cs.x * vp - cs.y * vq;
        row[pq.y] = cs.y * vp + cs.x * vq;
      }
    }
  };
  // The warps that compute a round's rotations, and the round count (its parity picks the table buffer).
  const int rot_warps = (h + 31) / 32;
  int rounds = 0;
  for (int sweep = 0; sweep < pr.max_sweeps; ++sweep) {
    if (off2 <= stop2) break;  // uniform: every thread has the same sum
    for (int r = 0; r < m - 1; ++r, ++rounds) {
      // this round's tables; the previous round's (V's rotation, done now by the warps that compute none)
      const int buf = (rounds & 1) * h, prev = h - buf;
      if (tid < h) {
        const int k = tid;
        int p = r, q = m - 1;
        if (k > 0) {
          p = r + k;
          if (p >= m - 1) p -= m - 1;
          q = r - k;
          if (q < 0) q += m - 1;
        }
        const TA apq = A[p * ld + q], app = A[p * ld + p], aqq = A[q * ld + q];
        const bool rot = fabs(apq) > thr;
        Pair2<TA> cs{TA(1), TA(0)};
        Pair2<double> csd{1.0, 0.0};
        if (rot) {
          const TA theta = (aqq - app) / (TA(2) * apq);
          const TA t = copysign(TA(1), theta) / (fabs(theta) + sqrt(TA(1) + theta * theta));
          const TA c = TA(1) / sqrt(TA(1) + t * t);
          cs = {c, t * c};
          // V's (c, s) renormalized in double: c^2 + s^2 = 1 + d with |d| a few ulp of TA, so
          // 1 / sqrt(1 + d) = 1 - d/2 + 3d^2/8 to within d^3 (three FMAs instead of a double sqrt and division
          // on the chain every other warp waits for)
          const double d = fma(double(cs.x), double(cs.x), fma(double(cs.y), double(cs.y), -1.0));
          const double inv = fma(d, fma(d, 0.375, -0.5), 1.0);
          csd = {cs.x * inv, cs.y * inv};
          // the pair's own 2 x 2 block of A (no other thread touches it this round): the rotated diagonal and
          // an exact zero
          A[p * ld + p] = app - t * apq;
          A[q * ld + q] = aqq + t * apq;
          A[p * ld + q] = TA(0);
          A[q * ld + p] = TA(0);
        }
        tab_pq[buf + k] = make_int2(p, q);
        tab_cs[buf + k] = cs;
        tab_csd[buf + k] = csd;
        tab_rot[buf + k] = rot;
      } else if (rounds > 0 && warp >= rot_warps) {
        rotate_v(prev, rot_warps);  // V reads nothing this phase writes
      }
      __syncthreads();  // the round's rotations are in the tables, and V has the previous round's
      // A <- J^T A J on the other 2 x 2 blocks: rows (p1, q1) of pair k1 x columns (p2, q2) of pair k2, k1 < k2,
      // each also stored transposed. The triangle's rows k1 = i and h - 2 - i form line i, h blocks long (the
      // middle row of an even h alone), and the threads take the lines' blocks in order: all warps full but the
      // last (64 x 128^2: exactly two passes of 1024 threads); lanes take consecutive k2 (consecutive columns,
      // and rows an odd stride apart for the transposed stores: no bank conflicts).
      const int lines = h / 2, line_step = THREADS / h, j_step = THREADS % h;
      for (int line = tid / h, j = tid % h; line < lines;) {
        const bool first = j < h - 1 - line;
        const int k1 = first ? line : h - 2 - line, k2 = first ? line + 1 + j : j;
        if ((first || k1 != line) && (tab_rot[buf + k1] || tab_rot[buf + k2])) {  // else none, or both identity
          const int2 pq1 = tab_pq[buf + k1], pq2 = tab_pq[buf + k2];
          const Pair2<TA> cs1 = tab_cs[buf + k1], cs2 = tab_cs[buf + k2];
          TA* rp = A + pq1.x * ld;
          TA* rq = A + pq1.y * ld;
          const TA x00 = rp[pq2.x], x01 = rp[pq2.y], x10 = rq[pq2.x], x11 = rq[pq2.y];
          // rows: (J1^T X)_p = c1 x_p - s1 x_q, (J1^T X)_q = s1 x_p + c1 x_q
          const TA y00 = cs1.x * x00 - cs1.y * x10, y01 = cs1.x * x01 - cs1.y * x11;
          const TA y10 = cs1.y * x00 + cs1.x * x10, y11 = cs1.y * x01 + cs1.x * x11;
          // columns: (Y J2)_p = c2 y_p - s2 y_q, (Y J2)_q = s2 y_p + c2 y_q
          const TA z00 = cs2.x * y00 - cs2.y * y01, z01 = cs2.y * y00 + cs2.x * y01;
          const TA z10 = cs2.x * y10 - cs2.y * y11, z11 = cs2.y * y10 + cs2.x * y11;
          rp[pq2.x] = z00;
          rp[pq2.y] = z01;
          rq[pq2.x] = z10;
          rq[pq2.y] = z11;
          TA* rp2 = A + pq2.x * ld;
          TA* rq2 = A + pq2.y * ld;
          rp2[pq1.x] = z00;
          rq2[pq1.x] = z01;
          rp2[pq1.y] = z10;
          rq2[pq1.y] = z11;
        }
        line += line_step;
        j += j_step;
        if (j >= h) {
          j -= h;
          ++line;
        }
      }
      __syncthreads();  // A is complete before the next round reads it
    }
    off2 = 0.0;
    for (int i = tid; i < m * m; i += THREADS) {
      const int r = i / m, c = i - r * m;
      const TA v = A[r * ld + c];
      if (r != c) off2 += double(v) * v;
    }
    off2 = block_reduce<THREADS, double>(off2, red_d);
  }

  if (rounds > 0) {  // the last round's rotation of V
    rotate_v(((rounds - 1) & 1) * h, 0);
    __syncthreads();
  }
  // Ascending order by ranks: the rank of d_j among d_0..d_{n-1}, ties broken by index.
  int* perm = tab_rot;  // the tables are free now (V's last rotation ended with a barrier)
  TA* w = pr.w + g * n;
  for (int j = tid; j < n; j += THREADS) {
    const TA dj = A[j * ld + j];
    int rank = 0;
    for (int i = 0; i < n; ++i) {
      const TA di = A[i * ld + i];
      rank += (di < dj) || (di == dj && i < j);
    }
    perm[rank] = j;
    if (r0 == 0) w[rank] = scale2(dj, e);
  }
  __syncthreads();
  TA* out = pr.V + (g * n + r0) * n;
  for (int i = tid; i < nr * n; i += THREADS) {
    const int r = i / n, c = i - r * n;
    out[i] = static_cast<TA>(V[r * ld + perm[c]]);
  }
}

// Threads per block for an n x n problem: a round's work is ~m^2 / 4 2 x 2 blocks of A and m^2 / 2 rotations of V
// entries; with one block per multiprocessor (the shared memory of V and A), more warps hide the latency of
// the round's dependent loads and barriers (H100, float32: 64 x 128^2 3.86 -> 3.40 ms with 1024 threads instead
// of 512, 256 x 64^2 1.40 -> 1.03 ms with 512 instead of 256).
constexpr int threads_for(int n) { return n + (n & 1) <= 32 ? 128 : n + (n & 1) <= 64 ? 512 : 1024; }

// Static shared memory of the kernel (the reduction scratch), at most.
constexpr size_t kStaticSmem = 2 * 32 * sizeof(double);

template <typename TA>
inline size_t smem_bytes(int n, int split = 1) {
  return Layout<TA>(n, slice_rows(n, split)).bytes;
}

// Whether an n x n problem fits in one block's shared memory on the current device (with all of V).
template <typename TA>
inline bool fits(int64_t n) {
  return n >= 1 && n <= (1 << 12) && smem_bytes<TA>(static_cast<int>(n)) + kStaticSmem <= smem_optin_bytes();
}

// Blocks per matrix for a batch of B matrices of size n: enough to give every multiprocessor a block
// (each repeats the A work, so no more than that), at most kMaxSplit, and no block without rows of V.
constexpr int kMaxSplit = 8;
inline int split_for(int64_t B, int n) {
  const int fill = static_cast<int>(min_of<int64_t>(kMaxSplit, max_of<int64_t>(1, sm_count() / B)));
  return slice_rows(n, slice_rows(n, fill));  // the blocks that rows of fill-way slices need
}

// Launches G problems of size pr.n (which must fit), pr.split blocks each, on THREADS-thread blocks, with the
// kernel's shared memory opted in once per device (to the most the device allows).
template <typename TA, int THREADS>
cudaError_t run(const Problem<TA>& pr, int64_t G, cudaStream_t stream) {
  const auto kernel = jacobi_kernel<TA, THREADS>;
  static int opted_in[kCachedDevices] = {};
  opt_in_smem(opted_in, kernel, smem_optin_bytes() - kStaticSmem);
  kernel<<<static_cast<unsigned>(G * pr.split), THREADS, smem_bytes<TA>(pr.n, pr.split), stream>>>(pr);
  return cudaGetLastError();
}

// The whole-matrix launch with threads_for(n) threads; the instantiations live in eigh_small_{f32,f64}.cu
// (one compile each).
template <typename TA>
cudaError_t launch_whole(const Problem<TA>& pr, int64_t G, cudaStream_t stream);

template <typename TA>
cudaError_t launch_whole_impl(const Problem<TA>& pr, int64_t G, cudaStream_t stream) {
  switch (threads_for(pr.n)) {
    case 128: return run<TA, 128>(pr, G, stream);
    case 512: return run<TA, 512>(pr, G, stream);
    default: return run<TA, 1024>(pr, G, stream);
  }
}

template <>
cudaError_t launch_whole<float>(const Problem<float>& pr, int64_t G, cudaStream_t stream);
template <>
cudaError_t launch_whole<double>(const Problem<double>& pr, int64_t G, cudaStream_t stream);

}  // namespace jacobi
}  // namespace torchkern
