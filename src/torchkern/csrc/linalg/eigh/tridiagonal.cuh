// eigh's tridiagonal solver (float32 compute; eigh_tridiagonal.cu drives it): A = Q T Q^T by Householder
// reflections (sytrd_kernel), the eigenpairs of T in float64 (split_kernel, bisect_kernel, inverse_iteration_kernel),
// and the eigenvectors of A = Q Z by the reflections' compact WY form (panel_t_kernel here, the products in
// eigh_tridiagonal.cu).
// docs/design.md, "Symmetric eigensolver", has the method and why each step is done as it is.
//
// Why this shape: a 1024^2 matrix takes about 4/3 n^3 flops to reduce, but the reduction is a sequence of n
// matrix-vector products with the trailing matrix, each depending on the last. One thread block per matrix would
// leave most of the GPU idle for the 16 matrices of a typical batch and stream the trailing matrix through one
// multiprocessor; a cluster of K blocks (sm_90) shares each matrix's columns (chunks of 32, dealt round-robin),
// so that each block streams 1/K of it, and the blocks exchange the few vectors a step needs through distributed
// shared memory. The eigenvectors of T come from inverse iteration in float64: T's eigenvalues by bisection to
// about 4 eps64 ||T||, each eigenvector from two solves with T - lambda I, independently per eigenvalue. Two
// computed eigenvectors are orthogonal to about eps64 ||T|| / gap, which float32 results never see for gaps
// above 1e-8 ||T||; below that (clusters), T has split where its off-diagonal is negligible, and within an
// unreduced block the float32-level noise separates the eigenvalues enough (docs/design.md has the measurements).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../cluster.cuh"
#include "torchkern/reduce.cuh"

namespace torchkern {
namespace tridiagonal {

constexpr int kPanel = 32;        // reflections per panel (the trailing matrix is updated once a panel)
constexpr int kChunk = 32;        // columns a block owns at a time (one warp's coalesced row segment)
constexpr int kThreads = 512;     // sytrd_kernel's block
constexpr int kMaxCluster = 8;    // blocks per matrix (the portable cluster size)
constexpr int kUpdateCols = 128;  // the panel update: own columns per pass (4 row groups of 128 threads)
constexpr int kUpdateRows = 64;   // ... and rows staged per pass
constexpr int kTridThreads = 128; // split, bisection and inverse iteration kernels
constexpr int kPrefetch = 12;     // row i + 1 in registers, kPrefetch entries a thread: n <= kPrefetch * kThreads
static_assert(kPanel == kChunk, "a panel's rows are one chunk of columns, which one block owns (sytrd_kernel's PW)");
static_assert(2 * kPanel * kMaxCluster <= kThreads, "sytrd_kernel sums the cluster's partial dots a thread each");

// Own columns: block `rank` of K owns chunks rank, rank + K, ...; local index u -> column.
__device__ __forceinline__ int own_column(int u, int rank, int K) {
  return kChunk * (rank + K * (u / kChunk)) + u % kChunk;
}

// The first local index whose chunk holds columns >= c.
__device__ __forceinline__ int first_own(int c, int rank, int K) {
  const int chunk = c / kChunk;
  return chunk <= rank ? 0 : (chunk - rank + K - 1) / K * kChunk;
}

// Shared memory of sytrd_kernel in floats (the layout is in the kernel) for K blocks per matrix: most of it caches
// the panel's V and W rows of the block's own columns, which every step reads.
__host__ __device__ inline int own_capacity(int n, int K) {
  return kChunk * (((n + kChunk - 1) / kChunk + K - 1) / K);
}
__host__ __device__ inline int sytrd_part_floats(int n, int K) {
  const int M = own_capacity(n, K);
  return M > 4 * kThreads ? M : 4 * kThreads;
}
__host__ __device__ inline int sytrd_smem_floats(int n, int K) {
  const int M = own_capacity(n, K), vec = (n + 3) / 4 * 4;
  return 2 * kPanel * M + 2 * kUpdateRows * kPanel + 2 * kPanel * kPanel + 2 * M + vec + sytrd_part_floats(n, K) +
         6 * kPanel + 32;
}

struct SytrdArgs {
  float* A;     // [B, ld, ld], the matrix in its first n rows and columns, both triangles; ends with reflection i in
                // row i, columns i + 1 .. n - 1 (v[i + 1] = 1 stored)
  float* Wt;    // [B, kPanel, ld] workspace: the panel's W (rows of W^T)
  double* d;    // [B, n] T's diagonal
  double* e;    // [B, n] T's off-diagonal (e[n - 1] untouched)
  float* tau;   // [B, n] reflection factors (tau[n - 1] untouched)
  int n, ld;    // ld: n rounded up to whole chunks (16-byte rows, and a chunk's columns never pass the row)
};

// Householder tridiagonalization, LAPACK's blocked lower form (sytrd/latrd) with the trailing matrix in full
// storage: step i updates row i (= column i) with the panel's earlier reflections, H_i = I - tau v v^T maps its
// part below the diagonal to e_i, and w = tau (A v - V W^T v - W V^T v) - tau/2 (w^T v) v goes into the panel's W;
// once a panel A -= V W^T + W V^T. Each block handles its own columns, with their rows of V and W in shared memory
// (every step reads them); per step three cluster barriers: after the row update (every block gathers row i),
// after A v and the partial sums of W^T v and V^T v, after the partial sums of w^T v. Every block keeps the panel
// rows of V and (the owner stores them into every block) of W, and computes the w[i + 1] that the next step's row
// update needs itself (from row i + 1, by symmetry), so that no fourth barrier waits for its owner. K is a power of
// two. A step is short: what limits it is latency (barriers, round trips to memory), so A v reads A 16 bytes a
// thread, eight rows at a time, row i + 1 is loaded at the start of the step, and sums over the cluster are one
// remote load a thread and shuffles.
__global__ void __launch_bounds__(kThreads) sytrd_kernel(SytrdArgs args, int K) {
  extern __shared__ __align__(16) float smem[];
  const int n = args.n, ld = args.ld, rank = cluster_rank(), tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t b = blockIdx.x / K;
  float* A = args.A + b * int64_t(ld) * ld;
  float* Wt = args.Wt + b * int64_t(kPanel) * ld;
  const int chunks = (n + kChunk - 1) / kChunk;
  const int M = rank < chunks ? (chunks - rank + K - 1) / K * kChunk : 0;  // own columns (the last may pass n)
  const int Mcap = own_capacity(n, K), vec = (n + 3) / 4 * 4;
  float* Vc = smem;                            // [kPanel][Mcap] V[t][l] of own columns t
  float* Wc = Vc + kPanel * Mcap;              // [kPanel][Mcap] W[t][l]
  float* row_v = Wc + kPanel * Mcap;           // [kUpdateRows][kPanel] the panel update's row factors
  float* row_w = row_v + kUpdateRows * kPanel; // [kUpdateRows][kPanel]
  float* PV = row_w + kUpdateRows * kPanel;    // [kPanel][kPanel] V[p + r][l], the panel's rows
  float* PW = PV + kPanel * kPanel;            // [kPanel][kPanel] W[p + r][l] (written by the rows' owner)
  float* rloc = PW + kPanel * kPanel;          // [Mcap] own part of row i (read by the cluster)
  float* yown = rloc + Mcap;                   // [Mcap] own part of A v, then of w
  float* v = yown + Mcap;                      // [vec] row i, then v
  float* part = v + vec;                       // A v's partial sums
  float* pd = part + sytrd_part_floats(n, K);  // [2 kPanel] partial W^T v, V^T v (read by the cluster)
  float* dots = pd + 2 * kPanel;               // [2 kPanel] their sums
  float* sw = dots + 2 * kPanel;               // [kPanel] W[i][l]
  float* sv = sw + kPanel;                     // [kPanel] V[i][l]
  float* scal = sv + kPanel;                   // [8]: partial w^T v (read by the cluster), w[i + 1] before the v term
  float* red = scal + 8;                       // [kThreads / 32] reductions
  float w_next = 0.f;  // w_{j}[i + 1] of the previous step, the same in every block

  for (int p = 0; p < n; p += kPanel) {
    const int jn = min(kPanel, n - p);
    for (int j = 0; j < jn; ++j) {
      const int i = p + j;
      // Row i with the panel's earlier reflections: r_t = A[i][t] - sum_l (V[t][l] W[i][l] + W[t][l] V[i][l]).
      if (tid < j) {
        sw[tid] = tid == j - 1 ? w_next : PW[tid * kPanel + j];
        sv[tid] = PV[tid * kPanel + j];
      }
      __syncthreads();
      for (int u = first_own(i, rank, K) + tid; u < M; u += kThreads) {
        const int t = own_column(u, rank, K);
        float r = 0.f;
        if (t >= i && t < n) {
          r = A[int64_t(i) * ld + t];
          for (int l = 0; l < j; ++l) {
            r = fmaf(-Vc[l * Mcap + u], sw[l], r);
            r = fmaf(-Wc[l * Mcap + u], sv[l], r);
          }
          if (i == n - 1) args.d[b * n + i] = r;
        }
        rloc[u] = r;
      }
      if (i == n - 1) break;
      cluster_sync();  // (1) every block's part of row i is there

      const bool next_in_panel = j + 1 < jn;  // (the panel's last step has no next row to prepare)
      float next_row[kPrefetch];
#pragma unroll
      for (int k = 0; k < kPrefetch; ++k) {
        const int s = i + 1 + tid + k * kThreads;
        next_row[k] = next_in_panel && s < n ? A[int64_t(i + 1) * ld + s] : 0.f;
      }
      for (int t = i + tid; t < n; t += kThreads) {
        const int c = t / kChunk;
        v[t] = cluster_peer(rloc, c % K)[c / K * kChunk + t % kChunk];
      }
      __syncthreads();
      float ss = 0.f;
      for (int t = i + 2 + tid; t < n; t += kThreads) ss = fmaf(v[t], v[t], ss);
      ss = block_reduce<kThreads>(ss, red);  // the same order in every block: the same reflection everywhere
      const float alpha = v[i + 1], diag = v[i];
      float tau = 0.f, beta = alpha, scale = 0.f;
      if (ss > 0.f) {  // H maps (alpha, x) to (beta, 0); H = I where x = 0 already
        const double bt = -copysign(sqrt(double(alpha) * alpha + double(ss)), double(alpha));
        tau = static_cast<float>((bt - alpha) / bt);
        scale = static_cast<float>(1.0 / (alpha - bt));
        beta = static_cast<float>(bt);
      }
      __syncthreads();
      for (int t = i + 1 + tid; t < n; t += kThreads) v[t] = t == i + 1 ? 1.f : v[t] * scale;
      if (rank == 0 && tid == 0) {
        args.d[b * n + i] = diag;
        args.e[b * n + i] = beta;
        args.tau[b * n + i] = tau;
      }
      __syncthreads();

      // v into A's row i, the cache and the panel rows; y_t = sum_s A[s][t] v_s for own t > i (the panel's
      // starting A), four columns a thread, row groups of G.
      const int u1 = first_own(i + 1, rank, K), Ma = M - u1;
      for (int u = u1 + tid; u < M; u += kThreads) {
        const int t = own_column(u, rank, K);
        const bool in = t > i && t < n;
        Vc[j * Mcap + u] = in ? v[t] : 0.f;
        if (in) A[int64_t(i) * ld + t] = v[t];
      }
      if (tid < kPanel) PV[j * kPanel + tid] = p + tid > i && p + tid < n ? v[p + tid] : 0.f;
      if (Ma > 0) {
        const int quads = Ma / 4, G = quads >= kThreads ? 1 : kThreads / quads;
        for (int idx = tid; idx < G * quads; idx += kThreads) {
          const int qd = idx % quads, h = idx / quads, t = own_column(u1 + 4 * qd, rank, K);
          float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
          if (t + 3 > i && t < n) {
            const float* col = A + t;
            int s = i + 1 + h;
            for (; s + 7 * G < n; s += 8 * G) {  // eight 16-byte loads in flight a thread
              float4 a[8];
#pragma unroll
              for (int k = 0; k < 8; ++k) a[k] = *reinterpret_cast<const float4*>(col + int64_t(s + k * G) * ld);
#pragma unroll
              for (int k = 0; k < 8; ++k) {
                const float vk = v[s + k * G];
                acc.x = fmaf(a[k].x, vk, acc.x);
                acc.y = fmaf(a[k].y, vk, acc.y);
                acc.z = fmaf(a[k].z, vk, acc.z);
                acc.w = fmaf(a[k].w, vk, acc.w);
              }
            }
            for (; s + 3 * G < n; s += 4 * G) {
              const float4 a0 = *reinterpret_cast<const float4*>(col + int64_t(s) * ld);
              const float4 a1 = *reinterpret_cast<const float4*>(col + int64_t(s + G) * ld);
              const float4 a2 = *reinterpret_cast<const float4*>(col + int64_t(s + 2 * G) * ld);
              const float4 a3 = *reinterpret_cast<const float4*>(col + int64_t(s + 3 * G) * ld);
              const float v0 = v[s], v1 = v[s + G], v2 = v[s + 2 * G], v3 = v[s + 3 * G];
              acc.x = fmaf(a0.x, v0, fmaf(a1.x, v1, fmaf(a2.x, v2, fmaf(a3.x, v3, acc.x))));
              acc.y = fmaf(a0.y, v0, fmaf(a1.y, v1, fmaf(a2.y, v2, fmaf(a3.y, v3, acc.y))));
              acc.z = fmaf(a0.z, v0, fmaf(a1.z, v1, fmaf(a2.z, v2, fmaf(a3.z, v3, acc.z))));
              acc.w = fmaf(a0.w, v0, fmaf(a1.w, v1, fmaf(a2.w, v2, fmaf(a3.w, v3, acc.w))));
            }
            for (; s < n; s += G) {
              const float4 a0 = *reinterpret_cast<const float4*>(col + int64_t(s) * ld);
              const float v0 = v[s];
              acc.x = fmaf(a0.x, v0, acc.x);
              acc.y = fmaf(a0.y, v0, acc.y);
              acc.z = fmaf(a0.z, v0, acc.z);
              acc.w = fmaf(a0.w, v0, acc.w);
            }
          }
          *reinterpret_cast<float4*>(part + h * Ma + 4 * qd) = acc;
        }
      }
      // Partial W^T v (even) and V^T v (odd) over own rows s > i, a warp per sum, from the caches.
      for (int q = warp; q < 2 * j; q += kThreads / 32) {
        const float* src = ((q & 1) ? Vc : Wc) + (q / 2) * Mcap;
        float acc = 0.f;
        for (int uu = lane; uu < Ma; uu += 32) {
          const int s = own_column(u1 + uu, rank, K);
          if (s > i && s < n) acc = fmaf(src[u1 + uu], v[s], acc);
        }
        acc = warp_sum(acc);
        if (lane == 0) pd[q] = acc;
      }
      // y(i + 1) from row i + 1, by every block (the next step's w[i + 1])
      float yi = 0.f;
#pragma unroll
      for (int k = 0; k < kPrefetch; ++k) {
        const int s = i + 1 + tid + k * kThreads;
        if (s < n) yi = fmaf(next_row[k], v[s], yi);
      }
      yi = block_reduce<kThreads>(yi, red);  // (also orders A v's partial sums before their reduction)
      if (Ma > 0) {
        const int quads = Ma / 4, G = quads >= kThreads ? 1 : kThreads / quads;
        for (int uu = tid; uu < Ma; uu += kThreads) {
          float y = 0.f;
          for (int h = 0; h < G; ++h) y += part[h * Ma + uu];
          yown[u1 + uu] = y;
        }
      }
      cluster_sync();  // (2) the partial sums are there

      {  // dots[q] = the cluster's sum of pd[q]: thread q K + r loads block r's, K lanes add (2 kPanel K <= kThreads)
        const int q = tid / K, r = tid % K;
        float x = q < 2 * j ? cluster_peer(pd, r)[q] : 0.f;
        for (int m = K / 2; m > 0; m /= 2) x += __shfl_xor_sync(0xffffffffu, x, m);
        if (r == 0 && q < 2 * j) dots[q] = x;
      }
      __syncthreads();
      if (warp == 0 && next_in_panel) {  // w[i + 1] before the v term, the same in every block
        const float term = lane < j ? fmaf(PV[lane * kPanel + j + 1], dots[2 * lane],
                                           PW[lane * kPanel + j + 1] * dots[2 * lane + 1])
                                    : 0.f;
        const float c = yi - warp_sum(term);
        if (lane == 0) scal[1] = tau * c;
      }
      float pw = 0.f;
      for (int u = u1 + tid; u < M; u += kThreads) {
        const int t = own_column(u, rank, K);
        float w = 0.f;
        if (t > i && t < n) {
          float c = yown[u];
          for (int l = 0; l < j; ++l) {
            c = fmaf(-Vc[l * Mcap + u], dots[2 * l], c);
            c = fmaf(-Wc[l * Mcap + u], dots[2 * l + 1], c);
          }
          w = tau * c;
          pw = fmaf(w, v[t], pw);
        }
        yown[u] = w;
      }
      pw = block_reduce<kThreads>(pw, red);
      if (tid == 0) scal[0] = pw;
      cluster_sync();  // (3) the partial sums of w^T v are there

      const float total = warp_sum(lane < K ? cluster_peer(scal, lane)[0] : 0.f);  // every warp the same sum
      const float half = 0.5f * tau * total;
      w_next = next_in_panel ? scal[1] - half : 0.f;  // v[i + 1] = 1
      for (int u = u1 + tid; u < M; u += kThreads) {
        const int t = own_column(u, rank, K);
        const bool in = t > i && t < n;
        const float w = !in ? 0.f : t == i + 1 && next_in_panel ? w_next : fmaf(-half, v[t], yown[u]);
        Wc[j * Mcap + u] = w;
        if (!in) continue;
        Wt[int64_t(j) * ld + t] = w;
        if (t < p + kPanel) {  // a panel row: into every block's PW (read after the next barriers)
          for (int r = 0; r < K; ++r) cluster_peer(PW, r)[j * kPanel + t - p] = w;
        }
      }
      __syncthreads();
    }
    const int q = p + kPanel;
    if (q >= n) break;
    cluster_sync();  // (4) the panel's V and W are there
    // A[s][t] -= sum_l V[s][l] W[t][l] + W[s][l] V[t][l] for s, t >= q, own columns t: a thread keeps its column's
    // 64 factors in registers and streams the rows' factors from shared memory, two rows at a time.
    constexpr int kGroups = kThreads / kUpdateCols;
    const int group = tid / kUpdateCols, c = tid % kUpdateCols;
    for (int cu = first_own(q, rank, K); cu < M; cu += kUpdateCols) {
      const int u = cu + c, t = u < M ? own_column(u, rank, K) : n;
      const bool mine = t >= q && t < n;
      float mw[kPanel], mv[kPanel];
#pragma unroll
      for (int l = 0; l < kPanel; ++l) {
        mw[l] = mine ? Wc[l * Mcap + u] : 0.f;
        mv[l] = mine ? Vc[l * Mcap + u] : 0.f;
      }
      for (int s0 = q; s0 < n; s0 += kUpdateRows) {
        const int rows = min(kUpdateRows, n - s0);
        __syncthreads();  // the previous rows' factors are read
        for (int idx = tid; idx < kPanel * kUpdateRows; idx += kThreads) {
          const int l = idx / kUpdateRows, r = idx % kUpdateRows;
          const bool ok = r < rows;
          row_v[r * kPanel + l] = ok ? A[int64_t(p + l) * ld + s0 + r] : 0.f;
          row_w[r * kPanel + l] = ok ? Wt[int64_t(l) * ld + s0 + r] : 0.f;
        }
        __syncthreads();
        if (!mine) continue;
        for (int r = group; r < rows; r += 2 * kGroups) {
          const int r2 = r + kGroups;
          const bool two = r2 < rows;
          float* a0 = A + int64_t(s0 + r) * ld + t;
          float* a1 = A + int64_t(s0 + (two ? r2 : r)) * ld + t;
          float acc0 = *a0, acc1 = *a1;
          const float4* rv0 = reinterpret_cast<const float4*>(row_v + r * kPanel);
          const float4* rw0 = reinterpret_cast<const float4*>(row_w + r * kPanel);
          const float4* rv1 = reinterpret_cast<const float4*>(row_v + (two ? r2 : r) * kPanel);
          const float4* rw1 = reinterpret_cast<const float4*>(row_w + (two ? r2 : r) * kPanel);
#pragma unroll
          for (int l4 = 0; l4 < kPanel / 4; ++l4) {
            const float4 x0 = rv0[l4], y0 = rw0[l4], x1 = rv1[l4], y1 = rw1[l4];
            const int l = 4 * l4;
            acc0 = fmaf(-x0.x, mw[l], fmaf(-y0.x, mv[l], acc0));
            acc1 = fmaf(-x1.x, mw[l], fmaf(-y1.x, mv[l], acc1));
            acc0 = fmaf(-x0.y, mw[l + 1], fmaf(-y0.y, mv[l + 1], acc0));
            acc1 = fmaf(-x1.y, mw[l + 1], fmaf(-y1.y, mv[l + 1], acc1));
            acc0 = fmaf(-x0.z, mw[l + 2], fmaf(-y0.z, mv[l + 2], acc0));
            acc1 = fmaf(-x1.z, mw[l + 2], fmaf(-y1.z, mv[l + 2], acc1));
            acc0 = fmaf(-x0.w, mw[l + 3], fmaf(-y0.w, mv[l + 3], acc0));
            acc1 = fmaf(-x1.w, mw[l + 3], fmaf(-y1.w, mv[l + 3], acc1));
          }
          *a0 = acc0;
          if (two) *a1 = acc1;
        }
      }
      __syncthreads();
    }
    cluster_sync();  // (5) the trailing matrix is updated everywhere
  }
  cluster_sync();  // no block leaves while another may read its shared memory
}

// ------------------------------------------------------------------------------------------------ T's eigenpairs
constexpr double kEps64 = 2.220446049250313e-16;
constexpr double kPivMin = 1e-290;  // Sturm sequences: a pivot this small counts as -kPivMin (LAPACK's pivmin)

// One block per matrix: bounds[b] = {gl, gu, tnorm} (Gershgorin, widened by the bisection's tolerance), the
// off-diagonal entries at or below eps64 ||T|| set to zero (T splits there: no eigenvector couples the blocks), and
// for every row its unreduced block [lo, hi).
__global__ void __launch_bounds__(kTridThreads)
    split_kernel(const double* __restrict__ d, double* __restrict__ e, double* __restrict__ bounds,
                 int* __restrict__ lo, int* __restrict__ hi, int n) {
  extern __shared__ double se[];  // [n] the split off-diagonal, then [kTridThreads / 32] reductions
  double* scratch = se + n;
  const int64_t b = blockIdx.x;
  const double* db = d + b * n;
  double* eb = e + b * n;
  double low = 0.0, high = 0.0;
  for (int i = threadIdx.x; i < n; i += kTridThreads) {
    const double r = (i > 0 ? fabs(eb[i - 1]) : 0.0) + (i < n - 1 ? fabs(eb[i]) : 0.0);
    low = fmax(low, -(db[i] - r));
    high = fmax(high, db[i] + r);
  }
  low = -block_reduce<kTridThreads, double, true>(low, scratch);
  high = block_reduce<kTridThreads, double, true>(high, scratch);
  double tnorm = fmax(fabs(low), fabs(high));
  if (!(tnorm > 0.0)) tnorm = 1.0;  // T = 0: every block is 1 x 1
  for (int i = threadIdx.x; i < n; i += kTridThreads) {
    const double x = i < n - 1 ? eb[i] : 0.0;
    se[i] = fabs(x) <= kEps64 * tnorm ? 0.0 : x;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += kTridThreads) {
    eb[i] = se[i];
    int l = i, h = i;
    while (l > 0 && se[l - 1] != 0.0) --l;
    while (h < n - 1 && se[h] != 0.0) ++h;
    lo[b * n + i] = l;
    hi[b * n + i] = h + 1;
  }
  if (threadIdx.x == 0) {
    const double widen = 2.0 * kEps64 * tnorm * n + 2.0 * kPivMin;
    bounds[3 * b] = low - widen;
    bounds[3 * b + 1] = high + widen;
    bounds[3 * b + 2] = tnorm;
  }
}

// Thread k: the (k - lo)-th eigenvalue of row k's block by bisection on Sturm counts (LAPACK's stebz without its
// refinements), to 4 eps64 ||T||; a 1 x 1 block's is its diagonal entry, exactly. (Three interleaved counts a step,
// quadrisection, took 5.3 ms against bisection's 4.1 at 16 x 1024^2: the divisions' throughput, not their latency,
// is the limit.)
__global__ void __launch_bounds__(kTridThreads)
    bisect_kernel(const double* __restrict__ d, const double* __restrict__ e, const double* __restrict__ bounds,
                  const int* __restrict__ lo, const int* __restrict__ hi, double* __restrict__ lam, int n) {
  extern __shared__ double sh[];  // [n] d, [n] e^2
  double* sd = sh;
  double* se2 = sh + n;
  const int64_t b = blockIdx.y;
  for (int i = threadIdx.x; i < n; i += kTridThreads) {
    sd[i] = d[b * n + i];
    const double x = e[b * n + i];
    se2[i] = x * x;
  }
  __syncthreads();
  const int k = blockIdx.x * kTridThreads + threadIdx.x;
  if (k >= n) return;
  const int l0 = lo[b * n + k], h0 = hi[b * n + k], j = k - l0;
  if (h0 - l0 == 1) {
    lam[b * n + k] = sd[k];
    return;
  }
  double low = bounds[3 * b], high = bounds[3 * b + 1];
  const double tol = 4.0 * kEps64 * bounds[3 * b + 2] + kPivMin;
  for (int it = 0; it < 128 && high - low > tol; ++it) {
    const double mid = 0.5 * (low + high);
    double q = sd[l0] - mid;
    if (fabs(q) < kPivMin) q = -kPivMin;
    int count = q < 0.0;
    for (int i = l0 + 1; i < h0; ++i) {
      q = (sd[i] - mid) - se2[i - 1] / q;
      if (fabs(q) < kPivMin) q = -kPivMin;
      count += q < 0.0;
    }
    if (count > j) high = mid;
    else low = mid;
  }
  lam[b * n + k] = 0.5 * (low + high);
}

// A start vector entry in (-1, 1) for (row i, eigenvector k): an integer hash, the same on every run.
__device__ __forceinline__ double start_entry(int i, int k) {
  uint64_t x = (uint64_t(uint32_t(i)) << 32) ^ uint32_t(k) ^ 0x9e3779b97f4a7c15ull;
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return double(x >> 11) * (2.0 / 9007199254740992.0) - 1.0;
}

// Thread kk: the eigenvector of the kk-th smallest eigenvalue (sorted[kk], of block position order[kk]) by two
// steps of inverse iteration on its block, LU with partial pivoting of T - lambda I (LAPACK's lagtf/lagts; a zero
// pivot becomes eps64 ||T||), into column kk of Z (zero outside the block: Z comes zeroed). The elimination is
// redone for the second solve (it needs the multipliers, which are not kept); U's pivots (as reciprocals), first
// upper diagonal and the row swaps go to U0, U1, swaps for the back substitution. One division a row at most (a
// swapped row's pivot is an off-diagonal entry, whose reciprocal the block shares). Layout [b][i][kk]: a warp's
// accesses are consecutive.
__global__ void __launch_bounds__(kTridThreads)
    inverse_iteration_kernel(const double* __restrict__ d, const double* __restrict__ e,
                             const double* __restrict__ bounds, const int* __restrict__ lo,
                             const int* __restrict__ hi, const double* __restrict__ sorted,
                             const int64_t* __restrict__ order, double* __restrict__ Z, double* __restrict__ U0,
                             double* __restrict__ U1, uint8_t* __restrict__ swaps, int n) {
  extern __shared__ double sh[];  // [n] d, [n] e, [n] 1 / e
  double* sd = sh;
  double* se = sh + n;
  double* inv_e = sh + 2 * n;
  const int64_t b = blockIdx.y;
  for (int i = threadIdx.x; i < n; i += kTridThreads) {
    sd[i] = d[b * n + i];
    se[i] = e[b * n + i];
    inv_e[i] = se[i] != 0.0 ? 1.0 / se[i] : 0.0;
  }
  __syncthreads();
  const int kk = blockIdx.x * kTridThreads + threadIdx.x;
  if (kk >= n) return;
  const int k = static_cast<int>(order[b * n + kk]);
  const int l0 = lo[b * n + k], h0 = hi[b * n + k];
  const int64_t base = b * int64_t(n) * n + kk;  // + i * n: entry i of column kk
  if (h0 - l0 == 1) {
    Z[base + int64_t(l0) * n] = 1.0;
    return;
  }
  const double lambda = sorted[b * n + kk], tiny = kEps64 * bounds[3 * b + 2];
  double inv_norm = 1.0;
  for (int pass = 0; pass < 2; ++pass) {
    // forward: eliminate and apply to the right-hand side (pass 0: the start vector; 1: the normalized first solve)
    double a = sd[l0] - lambda, up = se[l0];
    double x = pass == 0 ? start_entry(l0, kk) : Z[base + int64_t(l0) * n] * inv_norm;
#pragma unroll 4
    for (int r = l0; r < h0 - 1; ++r) {
      const double c = se[r], an = sd[r + 1] - lambda, bn = r + 1 < h0 - 1 ? se[r + 1] : 0.0;
      const double xn = pass == 0 ? start_entry(r + 1, kk) : Z[base + int64_t(r + 1) * n] * inv_norm;
      const int64_t at = base + int64_t(r) * n;
      if (fabs(a) < fabs(c)) {  // swap rows r and r + 1
        const double mu = a * inv_e[r];
        U0[at] = inv_e[r];
        U1[at] = an;
        swaps[at] = 1;
        Z[at] = xn;
        a = fma(-mu, an, up);
        up = -mu * bn;
        x = fma(-mu, xn, x);
      } else {
        const double rp = 1.0 / (a != 0.0 ? a : tiny);
        const double mu = c * rp;
        U0[at] = rp;
        U1[at] = up;
        swaps[at] = 0;
        Z[at] = x;
        a = fma(-mu, up, an);
        up = bn;
        x = fma(-mu, x, xn);
      }
    }
    if (fabs(a) < tiny) a = a < 0.0 ? -tiny : tiny;
    // back substitution (x_{r+2} enters where rows r and r + 1 were swapped: U's second upper diagonal is e[r + 1])
    double x1 = x / a, x2 = 0.0, ss = x1 * x1;
    Z[base + int64_t(h0 - 1) * n] = x1;
#pragma unroll 4
    for (int r = h0 - 2; r >= l0; --r) {
      const int64_t at = base + int64_t(r) * n;
      double s = fma(-U1[at], x1, Z[at]);
      if (swaps[at]) s = fma(-se[r + 1], x2, s);
      const double xr = s * U0[at];
      Z[at] = xr;
      ss = fma(xr, xr, ss);
      x2 = x1;
      x1 = xr;
    }
    inv_norm = 1.0 / sqrt(ss);
  }
  for (int r = l0; r < h0; ++r) Z[base + int64_t(r) * n] *= inv_norm;
}

// One block (32 x 32 threads) per (panel, matrix): the panel's T in the compact WY form H_p .. H_{p+31} = I - V T V^T
// (LAPACK's larft, forward, columnwise): G = V^T V from the reflections in A's rows (float64 sums of exact products),
// then T's columns in order, T[j][j] = tau_j, T[0:j, j] = -tau_j T[0:j, 0:j] G[0:j, j]. Rows past n - 2 hold no
// reflection (zero).
constexpr int kTCols = 128;
__global__ void __launch_bounds__(kPanel * kPanel)
    panel_t_kernel(const float* __restrict__ A, const float* __restrict__ tau, double* __restrict__ T, int n, int ld) {
  __shared__ float rows[kPanel][kTCols + 1];
  __shared__ double G[kPanel][kPanel + 1], Ts[kPanel][kPanel + 1];
  const int panel = blockIdx.x, p = panel * kPanel, x = threadIdx.x, y = threadIdx.y;
  const int64_t b = blockIdx.y;
  const float* Ab = A + b * int64_t(ld) * ld;
  double g = 0.0;
  for (int t0 = p + 1; t0 < n; t0 += kTCols) {
    __syncthreads();
    for (int c = x; c < kTCols; c += kPanel) {
      const int t = t0 + c, r = p + y;
      rows[y][c] = (r < n - 1 && t > r && t < n) ? Ab[int64_t(r) * ld + t] : 0.f;
    }
    __syncthreads();
    for (int c = 0; c < kTCols; ++c) g = fma(double(rows[y][c]), double(rows[x][c]), g);
  }
  G[y][x] = g;
  Ts[y][x] = 0.0;
  __syncthreads();
  if (y == 0) {
    const int a = x;
    for (int j = 0; j < kPanel; ++j) {
      const double tj = p + j < n - 1 ? double(tau[b * n + p + j]) : 0.0;
      if (a < j) {
        double s = 0.0;
        for (int c = a; c < j; ++c) s = fma(Ts[a][c], G[c][j], s);
        Ts[a][j] = -tj * s;
      } else if (a == j) {
        Ts[a][a] = tj;
      }
      __syncwarp();
    }
  }
  __syncthreads();
  T[((b * gridDim.x + panel) * kPanel + y) * kPanel + x] = Ts[y][x];
}

}  // namespace tridiagonal
}  // namespace torchkern
