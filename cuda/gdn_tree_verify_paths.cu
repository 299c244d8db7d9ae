// Gated DeltaNet verify over a token tree, version 8: trees of up to 128 nodes whose root..node paths have at
// most P8_PATH nodes (depth <= 16 by default: a DFlash block), one kernel per call, one CTA of 16 warps per
// (request, value head, P8_BV columns of V).
//
// The same function as versions 1-7 (DESIGN.md section 4; the chunked delta rule of Yang et al., "Gated Delta
// Networks", ICLR 2025, restricted to ancestor pairs), for bfloat16 q/k/v and a float32 state:
//   X_ij = beta_i e^{G_i - G_j} khat_i . khat_j           j a strict ancestor of i
//   Y_ij = e^{G_i - G_j} qhat_i . khat_j                  j an ancestor of i or i itself
//   R = diag(beta) (V - diag(e^G) K S0^T)
//   Delta = T R,  O = diag(e^G) Q S0^T + W R              T = (I + X)^-1, W = Y T; no state is written
// T and W are zero off the ancestor pairs, and row i of each depends only on X restricted to i's path
// p_0 (the root) .. p_{d-1} = i: T (I + X) = I and W (I + X) = Y give, from i towards the root,
//   T_{i p_a} = [a = d - 1] - sum_{b > a} T_{i p_b} X_{p_b p_a}
//   W_{i p_a} = Y_{i p_a}   - sum_{b > a} W_{i p_b} X_{p_b p_a}
// (version 6's path rows, section 33, here with both recursions per thread in registers: d^2 / 2 products a row
// and no barrier per tree level). Then Delta and O are sums over each node's path entries.
//
// Why another layout (bench/NOTES.md sections 74, 75): version 6 splits a (request, q/k head) over eight CTAs of
// 16 V columns, each of which loads all q and k rows and computes the whole gram and solve for three value heads;
// at n = 128 that decomposition alone costs 8 us a call with every product compiled out (section 56). Here a CTA
// serves one value head and 64 columns (batch 1 at the 27B shape: 96 CTAs, one wave). Each phase is bound by the
// instructions its warps issue (section 75: a phase took 4x its latency estimate and tracks its instruction count).
// The solve (norms, grams, scales and each node's rows of T and W), the same for the two CTAs of a value head and,
// up to the scales, for a q/k head's value heads, comes by default from a kernel of their own (gdn_tree_paths_solve,
// below: a CTA per request and q/k head, launched before this one, which programmatic dependent launch lets start
// early; this kernel waits for it only before it copies T and W in, after its projections). Measured on an H100
// (section 76, with the grams alone in a kernel of their own): 19.4 us at n = 128, batch 1 (version 6: 23.1), 109.1
// at batch 8 (167.4), 425.9 at batch 32 (656.2); section 77 for this layout.
//   phase 0  cp.async in three groups: the request's plan tables, g and beta; its q, k rows (rows n .. n16
//            zero); the CTA's S0 rows and v columns. Per node, once the tables are in: path entries, depth, the path
//            gate G (with P8_PREGRAM = 0 also each entry's owner and the ancestor bitmask, 128 bits); once q and k
//            are in, their norms (four threads a row); per path entry the local node index (and with P8_PREGRAM = 0
//            that node's first path entry)
//   phase 1  with P8_PREGRAM = 0 the lower triangles of K K^T and Q K^T here (p8_gram_tasks: a 16-row block and two
//            16-column blocks of both grams a task, bf16 mma on ldmatrix fragments, column blocks without an ancestor
//            pair skipped; with P8_CLUSTER = C a cluster of C of the q/k head's CTAs splits the tasks, each product
//            stored in every CTA), each ancestor
//            pair's raw product stored at its path entry, then each entry scaled (X: beta_i rk_i rk_j e^{G_i -
//            G_j}, Y: rq_i rk_j e^{G_i - G_j}). The projections [K; Q] S0^T as one GEMM (M = P8_BV rows of S0, N = 2
//            n16 nodes, K = GDN_K) on bf16 mma over a split of S0 into bf16 parts (K: P8_SPLIT = 3, float32-accurate;
//            Q: P8_QSPLIT = 2, each S0 element within 2^-17 of itself, as O is rounded to bf16), a warp per (16 rows,
//            64 or 32 node columns), the sums kept in registers. With P8_PREGRAM = 1, griddepcontrol.wait and T and W
//            by cp.async
//   phase 2  R and diag(e^G) Q S0^T from the GEMM's registers into shared memory (over the dead q / k / S0
//            rows); with P8_PREGRAM = 0 a thread per node runs its rows' back substitution (p8_path_rows)
//   phase 3  P8_OUTW nodes a warp: Delta_i = sum T_ij R_j, O_i = e^{G_i} q_i S0 + sum W_ij R_j over i's path
//            entries, four entries a step
//
// Compile-time constants (NVRTC -D): TFM_IN (must be 1, bfloat16), GDN_K (a multiple of 32), GDN_V, P8_BV (32 or
// 64), P8_PATH (most nodes on a path), P8_SPLIT and P8_QSPLIT (2 or 3 bf16 parts of S0 for K and Q), P8_OUTW (1, 2
// or 4 nodes a warp in phase 3), P8_PREGRAM (1: the solve kernel; 0: the solve here), P8_GWARPS (the solve kernel's
// warps a CTA), P8_WARPS
// (16, or 8 where two CTAs share an SM: vllm_tfm/kernels/gdn.py paths_warps); timing options P8_STAGES (2, or 1:
// S0 waited for with q and k), P8_CLUSTER (1 to 8, with P8_PREGRAM = 0) and P8_SKIP (wrong outputs: 1 no in-kernel
// gram mma, 2 no projection mma). The plan (vllm_tfm/kernels/plan.py: cu, perm, pos, depth, pair_off, pair_j) and the
// state layout (V-first [slot, HV, V, K] with unit K stride, read only) are those of the other versions;
// TreePlan.build refuses a parent after its child, so node order is topological. The wrapper
// (vllm_tfm/kernels/gdn.py paths_unsupported_reason) sends no tree of more than 128 nodes, no path longer than
// P8_PATH and no request of more than pcap path entries here.
#include "tfm_mma.cuh"

#ifndef GDN_K
#define GDN_K 128
#endif
#ifndef GDN_V
#define GDN_V 128
#endif
#ifndef P8_BV
#define P8_BV 64
#endif
#ifndef P8_PATH
#define P8_PATH 17
#endif
#ifndef P8_SPLIT
#define P8_SPLIT 3                        // bf16 parts of S0 in the K projection (R, Delta: float32-accurate)
#endif
#ifndef P8_QSPLIT
#define P8_QSPLIT 2                       // and in the Q projection (O, rounded to bf16: 2^-17 relative a part sum)
#endif
#ifndef P8_WARPS
#define P8_WARPS 16                       // 8: two CTAs of up to 113 KB a SM (the wrapper's choice where they fit)
#endif
#ifndef P8_STAGES
#define P8_STAGES 2                       // copy groups after the tables: 2 = q / k, then S0 / v (1: all at once)
#endif
#ifndef P8_OUTW
#define P8_OUTW 4                         // nodes a warp serves at once in phase 3 (1, 2 or 4: 32, 16 or 8 lanes a node)
#endif
#ifndef P8_PREGRAM
#define P8_PREGRAM 1                      // 1: T and W from gdn_tree_paths_solve (0: solved in this kernel)
#endif
#ifndef P8_GWARPS
#define P8_GWARPS 16                      // warps of a gdn_tree_paths_solve CTA (one per request and q/k head)
#endif
#ifndef P8_CLUSTER
#define P8_CLUSTER 1                      // timing option: CTAs of a q/k head sharing the in-kernel grams (a cluster along x)
#endif
#ifndef P8_SKIP
#define P8_SKIP 0                         // timing only, wrong results: 1 = no in-kernel gram mma, 2 = no projection mma
#endif
#define P8_N 128                          // most nodes of a tree
#define P8_THREADS (32 * P8_WARPS)
#define P8_KP (GDN_K + 8)                 // bf16 per staged q / k row: a warp's B-fragment words in distinct banks
#define P8_SP (GDN_K + 8)                 // floats per staged S0 row: a half warp's float2 A-fragment loads miss each other
#define P8_RP (P8_BV + 4)                 // floats per row of R and of the Q projection: the fragment stores miss each other
#define P8_RT (P8_BV / 16)                // 16-row tiles of the CTA's S0 rows
#define P8_CB (P8_WARPS / P8_RT)          // column blocks of the GEMM's 2 P8_N node columns
#define P8_NPW (2 * P8_N / P8_CB)         // node columns of a warp's GEMM tile
#define P8_TPW (P8_NPW / 8)               // its 8-wide mma tiles
#define P8_KSTEPS (GDN_K / 16)
#define P8_MARKS 9
#define P8_SMARKS 6                       // timeline marks of the solve kernel

static_assert(TFM_IN == 1, "version 8 takes bfloat16 q/k/v");
static_assert(P8_BV == 32 || P8_BV == 64, "32 or 64 V columns per CTA");
static_assert(GDN_K % 16 == 0 && GDN_V % P8_BV == 0, "K must be a multiple of 16 and V of P8_BV");
static_assert((P8_SPLIT == 2 || P8_SPLIT == 3) && (P8_QSPLIT == 2 || P8_QSPLIT == 3), "S0 in two or three bf16 parts");
static_assert(P8_PATH >= 1 && P8_PATH <= P8_N, "a path has 1 to 128 nodes");
static_assert((P8_WARPS == 8 || P8_WARPS == 16) && P8_CB >= 2, "8 or 16 warps, every GEMM warp on one of K or Q");
static_assert(P8_THREADS >= 2 * P8_N, "a thread per (node, T or W)");
static_assert(P8_STAGES == 1 || P8_STAGES == 2, "one or two copy groups after the tables");
static_assert(P8_OUTW == 1 || P8_OUTW == 2 || P8_OUTW == 4, "1, 2 or 4 nodes a warp in phase 3");
static_assert(P8_PREGRAM == 0 || P8_PREGRAM == 1, "the solve in a kernel of its own (1) or in this one (0)");
static_assert(P8_CLUSTER >= 1 && P8_CLUSTER <= 8 && (P8_PREGRAM == 0 || P8_CLUSTER == 1),
              "a cluster of 1 to 8 CTAs, for the in-kernel grams");
#if P8_CLUSTER > 1 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "P8_CLUSTER > 1 needs thread block clusters (sm_90)"
#endif
static_assert(GDN_K % 32 == 0, "the norms' threads read K / 4 columns in 16-byte pieces");

__host__ __device__ constexpr int p8_align4(int x) { return (x + 3) & ~3; }
__host__ __device__ constexpr int p8_max(int a, int b) { return a > b ? a : b; }

// Words of dynamic shared memory for trees of at most n16 nodes (a multiple of 16) and requests of at most pcap
// path entries (vllm_tfm/kernels/gdn.py paths_smem_bytes mirrors this).
__host__ __device__ constexpr int p8_smem_words(int n16, int pcap) {
  return p8_max(n16 * P8_KP + P8_BV * P8_SP, 2 * n16 * P8_RP)  // q, k rows [2][n16][KP] bf16 and S0 [BV][SP]; later R, QS
         + n16 * P8_BV / 2                                      // v [n16][BV] bf16
         + (P8_PREGRAM ? 3 : 7) * p8_align4(pcap)               // T, W, pj (local node) by path entry; X, Y, pbase of pj,
                                                                // owner without the solve kernel
         + 13 * n16 + p8_align4(n16 + 1);                       // per node: rk rq G eG beta g pb plen perm anc[4]; pair_off
}

// Node i's path entries e0 .. e0 + d - 1 (flat node ids pj[e], root first): the ancestor bits of the local nodes
// (bit j of word j / 32: node j on i's path, i included; scalars, not an array: selects, no local memory), and
// per entry the caller's f(e, j).
template <class F>
__device__ __forceinline__ void p8_walk_path(const int* pj, int e0, int d, int bos, u32& b0, u32& b1, u32& b2, u32& b3,
                                             F f) {
  b0 = b1 = b2 = b3 = 0u;
#pragma unroll
  for (int x = 0; x < P8_PATH; ++x) {  // bounded (d <= P8_PATH): the loads issue together
    if (x >= d) break;
    const int e = e0 + x, j = pj[e] - bos;
    const u32 bit = 1u << (j & 31);
    b0 |= (j >> 5) == 0 ? bit : 0u;
    b1 |= (j >> 5) == 1 ? bit : 0u;
    b2 |= (j >> 5) == 2 ? bit : 0u;
    b3 |= (j >> 5) == 3 ? bit : 0u;
    f(e, j);
  }
}

// q / k norm scales of staged rows 0 .. n - 1: rk_i = 1 / |k_i| and rq_i = scale / |q_i| (with use_l2norm; else 1 and
// scale), four threads a row, a quarter of K each (no warp-wide reduction chain); rk[i * stride], rq[i * stride].
template <int THREADS>
__device__ __forceinline__ void p8_norms(const u16* qs, const u16* ks, int n, int n16, float scale, int use_l2norm,
                                         int tid, float* rk, float* rq, int stride) {
  for (int base = 0; base < 4 * n16; base += THREADS) {
    const int i = (base + tid) >> 2, part = (base + tid) & 3;
    float sk = 0.0f, sq = 0.0f;
    if (i < n) {
#pragma unroll
      for (int c = part * (GDN_K / 4); c < (part + 1) * (GDN_K / 4); c += 8) {
        const uint4 wk = *reinterpret_cast<const uint4*>(ks + i * P8_KP + c);
        const uint4 wq = *reinterpret_cast<const uint4*>(qs + i * P8_KP + c);
        const u32 kw[4] = {wk.x, wk.y, wk.z, wk.w}, qw[4] = {wq.x, wq.y, wq.z, wq.w};
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const float k0 = bf16_bits_to_f32(kw[t] & 0xffffu), k1 = bf16_bits_to_f32(kw[t] >> 16);
          const float q0 = bf16_bits_to_f32(qw[t] & 0xffffu), q1 = bf16_bits_to_f32(qw[t] >> 16);
          sk = fmaf(k0, k0, fmaf(k1, k1, sk));
          sq = fmaf(q0, q0, fmaf(q1, q1, sq));
        }
      }
    }
    sk += __shfl_xor_sync(0xffffffffu, sk, 1);
    sq += __shfl_xor_sync(0xffffffffu, sq, 1);
    sk += __shfl_xor_sync(0xffffffffu, sk, 2);
    sq += __shfl_xor_sync(0xffffffffu, sq, 2);
    if (i < n && part == 0) {
      rk[i * stride] = use_l2norm ? l2norm_scale(sk) : 1.0f;
      rq[i * stride] = use_l2norm ? scale * l2norm_scale(sq) : scale;
    }
  }
}

// Gram tasks of a lower triangle of 16-row blocks: row block mt has (mt + 2) / 2 tasks, task (mt, c) covering the
// column blocks 2c and 2c + 1 (the latter only if <= mt); *mt and *nt0 for task u.
__device__ __forceinline__ void p8_task_block(int u, int& mt, int& nt0) {
  mt = 0;
  while (u >= (mt + 2) / 2) {
    u -= (mt + 2) / 2;
    ++mt;
  }
  nt0 = 2 * u;
}

// The grams' products for the ancestor pairs of one request's tree, from its q and k rows staged [n16][KP]: a task
// (p8_task_block) is a 16-row block mt and two 16-column blocks nt0, nt0 + 1 <= mt of both K K^T and Q K^T, whose
// A fragments (k and q rows of mt) and B fragments (k rows of the column blocks) are each loaded once a k-step: 4
// ldmatrix for 8 mma (section 77: the phase was bound by shared-memory reads at 2 ldmatrix for 2 mma). Warp `warp`
// of `warps` takes tasks warp, warp + warps, ... of those with task % stride == rank (a cluster's CTAs split them).
// Fragments by ldmatrix: A rows mt 16 + (lane & 15) at column half lane >> 4; B (two 8-column mma tiles) rows
// nt 16 + (lane & 7) + 8 (lane >> 4) at column half (lane >> 3) & 1. Each ancestor pair's raw product goes to
// store(gram, e, value), gram 0 = K K^T, 1 = Q K^T, with e its path entry (i's first entry + j's depth; K K^T's
// diagonal too, at the entry X never reads); column blocks without an ancestor pair are skipped.
template <class Store>
__device__ __forceinline__ void p8_gram_tasks(const u16* qs, const u16* ks, const u32* anc, const int* pb,
                                              const int* plen, int n, int warp, int warps, int lane, int rank,
                                              int stride, Store store) {
  const int gq = lane >> 2, tq = lane & 3;
  const int nt16 = (n + 15) / 16;
  int tasks = 0;
  for (int m = 0; m < nt16; ++m) tasks += (m + 2) / 2;
  for (int lt = warp; lt * stride + rank < tasks; lt += warps) {
    int mt, nt0;
    p8_task_block(lt * stride + rank, mt, nt0);
    // this lane's rows i0, i0 + 8 and, in column block nt0 + b and its 8-column tile t, columns j0 + 16 b + 8 t and
    // + 1: table reads first
    const int i0 = mt * 16 + gq, j0 = nt0 * 16 + 2 * tq;
    const bool ok0 = i0 < n, ok1 = i0 + 8 < n;  // rows past n: their table words are not written
    const bool has2 = nt0 + 1 <= mt;  // a second column block in the lower triangle
    u32 keep = 0u;  // bit 8 b + 4 t + 2 r + c: (i0 + 8 r, j0 + 16 b + 8 t + c) is an ancestor pair
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        if (b == 1 && !has2) continue;
        const int jt = j0 + 16 * b + 8 * t;
        const u32 a0 = anc[i0 * 4 + (jt >> 5)] >> (jt & 31), a1 = anc[(i0 + 8) * 4 + (jt >> 5)] >> (jt & 31);
        keep |= ((ok0 ? a0 & 3u : 0u) | (ok1 ? (a1 & 3u) << 2 : 0u)) << (8 * b + 4 * t);
      }
    const bool two = __any_sync(0xffffffffu, (keep >> 8) != 0u);
    if (!__any_sync(0xffffffffu, keep != 0u)) continue;  // no ancestor pair in the task: no products
    const u16* ak = ks + (mt * 16 + (lane & 15)) * P8_KP + (lane >> 4) * 8;
    const u16* aq = qs + (mt * 16 + (lane & 15)) * P8_KP + (lane >> 4) * 8;
    const u16* bptr = ks + (nt0 * 16 + (lane & 7) + ((lane >> 4) << 3)) * P8_KP + ((lane >> 3) & 1) * 8;
    float acc[2][2][2][4];  // [gram][column block][tile][fragment]
#pragma unroll
    for (int x = 0; x < 16; ++x) acc[x >> 3][(x >> 2) & 1][(x >> 1) & 1][0] = acc[x >> 3][(x >> 2) & 1][(x >> 1) & 1][1] =
        acc[x >> 3][(x >> 2) & 1][(x >> 1) & 1][2] = acc[x >> 3][(x >> 2) & 1][(x >> 1) & 1][3] = 0.0f;
    if (two) {
#pragma unroll
      for (int s = 0; s < ((P8_SKIP & 1) ? 0 : P8_KSTEPS); ++s) {
        u32 a[2][4], b0[4], b1[4];
        ldsm_x4(a[0], ak + s * 16);
        ldsm_x4(a[1], aq + s * 16);
        ldsm_x4(b0, bptr + s * 16);
        ldsm_x4(b1, bptr + 16 * P8_KP + s * 16);
#pragma unroll
        for (int gm = 0; gm < 2; ++gm) {
          mma_16816<true>(acc[gm][0][0], a[gm], b0[0], b0[1]);
          mma_16816<true>(acc[gm][0][1], a[gm], b0[2], b0[3]);
          mma_16816<true>(acc[gm][1][0], a[gm], b1[0], b1[1]);
          mma_16816<true>(acc[gm][1][1], a[gm], b1[2], b1[3]);
        }
      }
    } else {
#pragma unroll
      for (int s = 0; s < ((P8_SKIP & 1) ? 0 : P8_KSTEPS); ++s) {
        u32 a[2][4], b0[4];
        ldsm_x4(a[0], ak + s * 16);
        ldsm_x4(a[1], aq + s * 16);
        ldsm_x4(b0, bptr + s * 16);
#pragma unroll
        for (int gm = 0; gm < 2; ++gm) {
          mma_16816<true>(acc[gm][0][0], a[gm], b0[0], b0[1]);
          mma_16816<true>(acc[gm][0][1], a[gm], b0[2], b0[3]);
        }
      }
    }
    const int at0 = pb[i0], at1 = pb[i0 + 8];
#pragma unroll
    for (int b = 0; b < 2; ++b)
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        if (b == 1 && !has2) continue;
        const int jt = j0 + 16 * b + 8 * t;
        const int dj0 = plen[jt] - 1, dj1 = plen[jt + 1] - 1;
#pragma unroll
        for (int e = 0; e < 4; ++e)  // i's path entry for its ancestor j (at j's depth)
          if ((keep >> (8 * b + 4 * t + e)) & 1u) {
            const int at = ((e >> 1) ? at1 : at0) + ((e & 1) ? dj1 : dj0);
            store(0, at, acc[0][b][t][e]);
            store(1, at, acc[1][b][t][e]);
          }
      }
  }
}

// The products' scales, a thread per (value head, path entry), X and Y of the entry together (one exponential):
// X_ij = beta_i rk_i rk_j e^{G_i - G_j} k_i . k_j (j a strict ancestor), Y_ij = rq_i rk_j e^{G_i - G_j} q_i . k_j from
// the raw products xin, yin into xout, yout (the same arrays or others) + gv A for value heads gv < groups; j on i's
// path: G_i <= G_j, no overflow. pown[e] / pj[e]: entry e's node and its ancestor (local); bt, Gs: beta and the path
// gates by value head and node ([groups][n16]).
__device__ __forceinline__ void p8_scale_entries(const float* xin, const float* yin, float* xout, float* yout,
                                                 const int* pown, const int* pj, const float* rk, const float* rq,
                                                 const float* bt, const float* Gs, int cnt, int groups, int A, int n16,
                                                 int tid, int threads) {
  for (int c = tid; c < groups * cnt; c += threads) {
    const int gv = c / cnt, e = c - gv * cnt;
    const int i = pown[e], j = pj[e];
    const float ex = expf(Gs[gv * n16 + i] - Gs[gv * n16 + j]), rkj = rk[j];
    const float x = xin[e], y = yin[e];
    if (j != i) xout[gv * A + e] = x * (bt[gv * n16 + i] * rk[i] * rkj * ex);  // X has no diagonal
    yout[gv * A + e] = y * (rq[i] * rkj * ex);
  }
}

// Node i's rows of T and W over its path entries e0 .. e0 + d - 1 into tout[e], wout[e] (shared or global memory):
// back substitution along the path in registers, both rows from one read of each X entry (section 77: the reads'
// bank conflicts bound the phase). Distances u from the node (0 = the node itself, u = d - 1 - b for path position
// b); X_{p_b p_a} is path entry pbp[e0 + b] + a, = xb[u] - w with w = d - 1 - a and xb[u] = pbp[e0 + d - 1 - u] +
// d - 1. Xp, Yp: the scaled products by entry.
__device__ __forceinline__ void p8_path_rows(float* tout, float* wout, const float* Xp, const float* Yp, const int* pbp,
                                             int e0, int d) {
  int xb[P8_PATH];
  float tv[P8_PATH], wv[P8_PATH];
#pragma unroll
  for (int u = 0; u < P8_PATH; ++u) xb[u] = u < d ? pbp[e0 + d - 1 - u] + d - 1 : 0;
  tv[0] = 1.0f;
  wv[0] = Yp[e0 + d - 1];
  tout[e0 + d - 1] = tv[0];
  wout[e0 + d - 1] = wv[0];
#pragma unroll
  for (int w = 1; w < P8_PATH; ++w) {
    if (w >= d) break;
    float st = 0.0f, sw = Yp[e0 + d - 1 - w];
#pragma unroll
    for (int u = 0; u < w; ++u) {
      const float x = Xp[xb[u] - w];
      st = fmaf(-tv[u], x, st);
      sw = fmaf(-wv[u], x, sw);
    }
    tv[w] = st;
    wv[w] = sw;
    tout[e0 + d - 1 - w] = st;
    wout[e0 + d - 1 - w] = sw;
  }
}

// The projections' k loop of one warp: C += S0 rows x node rows^T for its first PAIRS pairs of 8-node mma tiles
// (their rows staged, zero past n), S0 in PARTS bf16 parts, small parts first, float32 sums. A fragments: the warp's
// 16 S0 rows as float2 pairs (arow: row gq, column 2 tq), split here; B fragments by ldmatrix as in p8_gram_tasks
// (bptr: row (lane & 7) + 8 (lane >> 4), column half (lane >> 3) & 1). No branch inside: PAIRS is a template argument
// (p8_project_upto), so the .sync.aligned ldmatrix and mma need no convergence barriers.
template <int PARTS, int PAIRS>
__device__ __forceinline__ void p8_project(float (&pacc)[P8_TPW][4], const float* arow, const u16* bptr) {
#pragma unroll 1
  for (int s = 0; s < ((P8_SKIP & 2) ? 0 : P8_KSTEPS); ++s) {
    const float2 x0 = *reinterpret_cast<const float2*>(arow + s * 16);
    const float2 x1 = *reinterpret_cast<const float2*>(arow + 8 * P8_SP + s * 16);
    const float2 x2 = *reinterpret_cast<const float2*>(arow + s * 16 + 8);
    const float2 x3 = *reinterpret_cast<const float2*>(arow + 8 * P8_SP + s * 16 + 8);
    u32 ahi[4], amid[4], alo[4];
    split3_bf16x2(x0, ahi[0], amid[0], alo[0]);
    split3_bf16x2(x1, ahi[1], amid[1], alo[1]);
    split3_bf16x2(x2, ahi[2], amid[2], alo[2]);
    split3_bf16x2(x3, ahi[3], amid[3], alo[3]);
#pragma unroll
    for (int tp = 0; tp < PAIRS; ++tp) {
      u32 b[4];
      ldsm_x4(b, bptr + tp * 16 * P8_KP + s * 16);
#pragma unroll
      for (int x = 0; x < 2; ++x) {
        if (PARTS == 3) mma_16816<true>(pacc[2 * tp + x], alo, b[2 * x], b[2 * x + 1]);
        mma_16816<true>(pacc[2 * tp + x], amid, b[2 * x], b[2 * x + 1]);
        mma_16816<true>(pacc[2 * tp + x], ahi, b[2 * x], b[2 * x + 1]);
      }
    }
  }
}

// p8_project for a warp's `pairs` (1 .. P) live pairs of tiles.
template <int PARTS, int P = P8_TPW / 2>
__device__ __forceinline__ void p8_project_upto(int pairs, float (&pacc)[P8_TPW][4], const float* arow, const u16* bptr) {
  if (pairs == P) {
    p8_project<PARTS, P>(pacc, arow, bptr);
  } else if constexpr (P > 1) {
    p8_project_upto<PARTS, P - 1>(pairs, pacc, arow, bptr);
  }
}

extern "C" __global__ void __launch_bounds__(P8_THREADS, 16 / P8_WARPS)
gdn_tree_verify_paths(const tin* __restrict__ q, const tin* __restrict__ k, const tin* __restrict__ v,
                      const float* __restrict__ g, const float* __restrict__ beta, const int* __restrict__ perm,
                      const int* __restrict__ pair_off, const int* __restrict__ pair_j, const int* __restrict__ cu,
                      const float* __restrict__ state, const void* __restrict__ state_idx, int sidx64, i64 st_slot,
                      i64 st_head, i64 st_v, tin* __restrict__ o, float* __restrict__ delta_out, int H, int HV,
                      int n16, int pcap, float scale, int use_l2norm, const float* __restrict__ tw, int num_pairs,
                      long long* __restrict__ timeline) {
  TFM_DYNAMIC_SMEM(float4, smem_f4);
  if (dynamic_smem_bytes() < (u32)p8_smem_words(n16, pcap) * 4u) __trap();
  float* base = reinterpret_cast<float*>(smem_f4);
  u16* qs = reinterpret_cast<u16*>(base);                       // [n16][KP], by local node
  u16* ks = qs + n16 * P8_KP;
  float* s0s = base + n16 * P8_KP;                              // [BV][SP]: the CTA's rows of S0
  float* RS = base;                                             // phase 2 on: [n16][RP] R
  float* QS = base + n16 * P8_RP;                               // [n16][RP] e^{G_i} qhat_i . S0 row
  const int r1 = p8_max(n16 * P8_KP + P8_BV * P8_SP, 2 * n16 * P8_RP);
  u16* vs = reinterpret_cast<u16*>(base + r1);                  // [n16][BV]
  float* Tp = base + r1 + n16 * P8_BV / 2;                      // by the request's path entry e (0 .. cnt - 1)
  float* Wp = Tp + p8_align4(pcap);
  int* pj = reinterpret_cast<int*>(Wp + p8_align4(pcap));        // entry e's node: flat (as copied), then local
  float* Xp = reinterpret_cast<float*>(pj + p8_align4(pcap));    // without the solve kernel (P8_PREGRAM = 0): X, Y,
  float* Yp = Xp + p8_align4(pcap);
  int* pbp = reinterpret_cast<int*>(Yp + p8_align4(pcap));       // the first path entry of entry e's node,
  int* pown = pbp + p8_align4(pcap);                             // the node whose path entry e is
  float* rk = reinterpret_cast<float*>(pj + (P8_PREGRAM ? 1 : 5) * p8_align4(pcap));  // per local node
  float* rq = rk + n16;
  float* Gs = rq + n16;                                          // path gate: sum of g over root .. i
  float* eG = Gs + n16;
  float* bt = eG + n16;
  float* gl = bt + n16;
  int* pb = reinterpret_cast<int*>(gl + n16);                    // first path entry of node i
  int* plen = pb + n16;                                          // its path's nodes (depth + 1)
  int* perm_s = plen + n16;                                      // level position -> flat node
  u32* anc = reinterpret_cast<u32*>(perm_s + n16);               // [n16][4]: bit j, node j on i's path (i included)
  int* poff = reinterpret_cast<int*>(anc + 4 * n16);             // pair_off of the request's positions [n + 1]

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gq = lane >> 2, tq = lane & 3;  // mma fragment coordinates
  // grid (HV / H * GDN_V / P8_BV, H, R): the CTAs of a q/k head consecutive along x (a cluster shares their grams)
  const int h = blockIdx.y, r = blockIdx.z;
  const int hv = h * (HV / H) + blockIdx.x / (GDN_V / P8_BV), v0 = (blockIdx.x % (GDN_V / P8_BV)) * P8_BV;
  const CtaTimeline tl = cta_timeline(timeline, P8_MARKS);
  tl.mark(0);
  const int bos = cu[r];
  const int n = cu[r + 1] - bos;
  if (n <= 0) return;  // the whole cluster: its CTAs serve one request
  const int crank = cluster_start<P8_CLUSTER>();
  if (n > n16 || n16 > P8_N) __trap();  // the wrapper sizes n16 for the plan's largest tree
  const int pbase = pair_off[bos];
  const int cnt = pair_off[bos + n] - pbase;  // path entries of the request's nodes
  if (cnt > pcap) __trap();
  const i64 slot = sidx64 ? reinterpret_cast<const i64*>(state_idx)[r] : (i64)reinterpret_cast<const int*>(state_idx)[r];

  // ---- phase 0. Group 1: the tables; group 2: q, k, S0, v.
  for (int c = tid; c < cnt; c += P8_THREADS) cp_async4(pj + c, pair_j + pbase + c);
  for (int c = tid; c <= n; c += P8_THREADS) {
    cp_async4(poff + c, pair_off + bos + c);
    if (c < n) {
      cp_async4(perm_s + c, perm + bos + c);
      cp_async4(gl + c, g + (i64)(bos + c) * HV + hv);
      cp_async4(bt + c, beta + (i64)(bos + c) * HV + hv);
    }
  }
  cp_async_commit();
  stage_qk_rows<GDN_K, P8_KP, P8_THREADS>(qs, ks, q, k, bos, n, n16, H, h, tid);
#if P8_STAGES == 2
  cp_async_commit();  // q, k: their own group, so that the norms and grams need not wait for S0
#endif
  constexpr int SPR = GDN_K / 4;  // 16-byte pieces of an S0 row
  const float* s0g = state + slot * st_slot + (i64)hv * st_head + (i64)v0 * st_v;
  for (int c = tid; c < P8_BV * SPR; c += P8_THREADS) {
    const int row = c / SPR, col = (c % SPR) * 4;
    cp_async16(s0s + row * P8_SP + col, s0g + (i64)row * st_v + col);
  }
  constexpr int VPR = P8_BV / 8;  // 16-byte pieces of a node's v columns
  for (int c = tid; c < n * VPR; c += P8_THREADS) {
    const int i = c / VPR, part = c % VPR;
    cp_async16(vs + i * P8_BV + part * 8, v + ((i64)(bos + i) * HV + hv) * GDN_V + v0 + part * 8);
  }
  cp_async_commit();
  cp_async_wait<P8_STAGES>();  // the tables
  __syncthreads();
  // per node (by level position p: node perm[p] - bos, whose path, root first, is pair_j's entries
  // pair_off[p] .. pair_off[p + 1] - 1): first entry, path length, ancestor bits, path gate
  for (int p = tid; p < n; p += P8_THREADS) {
    const int i = perm_s[p] - bos;
    const int e0 = poff[p] - pbase, d = poff[p + 1] - poff[p];
    if (d > P8_PATH) __trap();  // the wrapper sends no deeper tree here
    u32 b0, b1, b2, b3;
    float gsum = 0.0f;
    p8_walk_path(pj, e0, d, bos, b0, b1, b2, b3, [&](int e, int j) {
      gsum += gl[j];
#if !P8_PREGRAM
      pown[e] = i;
#endif
    });
    pb[i] = e0;
    plen[i] = d;
#if !P8_PREGRAM  // the ancestor bits: the in-kernel grams' tile skips
    anc[i * 4] = b0;
    anc[i * 4 + 1] = b1;
    anc[i * 4 + 2] = b2;
    anc[i * 4 + 3] = b3;
#endif
    Gs[i] = gsum;
    eG[i] = expf(gsum);
  }
  cp_async_wait<P8_STAGES - 1>();  // q and k (and with one stage S0 and v)
  __syncthreads();
  tl.mark(1);
  p8_norms<P8_THREADS>(qs, ks, n, n16, scale, use_l2norm, tid, rk, rq, 1);
  // path entries: the local node, and where that node's own path entries start (the recursions' X lookups)
  for (int e = tid; e < cnt; e += P8_THREADS) {
    const int j = pj[e] - bos;
    pj[e] = j;
#if !P8_PREGRAM
    pbp[e] = pb[j];
#endif
  }
  __syncthreads();
  tl.mark(2);

#if !P8_PREGRAM
  // ---- phase 1. The grams (p8_gram_tasks), each ancestor pair's raw product stored at its path entry (with
  // P8_CLUSTER = C a cluster of C of the q/k head's CTAs splits the tasks, each product stored in every CTA); scaled
  // below
#if P8_CLUSTER > 1
  cluster_wait();  // every CTA of the cluster has started
#endif
  p8_gram_tasks(qs, ks, anc, pb, plen, n, warp, P8_WARPS, lane, crank, P8_CLUSTER, [&](int gram, int e, float val) {
    float* at = (gram == 0 ? Xp : Yp) + e;
#if P8_CLUSTER > 1
#pragma unroll
    for (int c = 0; c < P8_CLUSTER; ++c) *cluster_map(at, (u32)c) = val;  // every CTA's copy
#else
    *at = val;
#endif
  });
#endif
  tl.mark(3);  // warp 0's gram tasks
#if P8_STAGES == 2
  cp_async_wait<0>();  // S0 and v
#endif
#if P8_CLUSTER > 1
  cluster_arrive();  // this CTA's products stored in every CTA (release), and every CTA's here (acquire);
  cluster_wait();    // no shared memory of a peer is touched after this
#else
  __syncthreads();
#endif
  tl.mark(4);  // every warp's gram tasks; S0 and v in
#if !P8_PREGRAM
  p8_scale_entries(Xp, Yp, Xp, Yp, pown, pj, rk, rq, bt, Gs, cnt, 1, 0, n16, tid, P8_THREADS);
#endif
  tl.mark(5);  // warp 0's scales
  // Projections: C = S0 [K; Q]^T, rows = this warp's 16 S0 rows, columns = its P8_NPW node columns of K
  // (columns 0 .. P8_N - 1) or Q (P8_N ..). S0's parts small first, float32 sums.
  const int rt = warp % P8_RT, cb = warp / P8_RT;
  const int mat = (cb * P8_NPW) / P8_N, nb = (cb * P8_NPW) % P8_N;
  const u16* brows = mat == 0 ? ks : qs;
  float pacc[P8_TPW][4];
#pragma unroll
  for (int t = 0; t < P8_TPW; ++t) pacc[t][0] = pacc[t][1] = pacc[t][2] = pacc[t][3] = 0.0f;
  if (nb < n) {
    const float* arow = s0s + (rt * 16 + gq) * P8_SP + 2 * tq;
    const u16* bptr = brows + (nb + (lane & 7) + ((lane >> 4) << 3)) * P8_KP + ((lane >> 3) & 1) * 8;
    const int pairs = min(P8_TPW / 2, (n - nb + 15) / 16);  // pairs of 8-node tiles with a node < n
    if (mat == 0)
      p8_project_upto<P8_SPLIT>(pairs, pacc, arow, bptr);
    else
      p8_project_upto<P8_QSPLIT>(pairs, pacc, arow, bptr);
  }
#if P8_PREGRAM
  // the value head's rows of T and W by path entry, gdn_tree_paths_solve's (launched before this kernel, which
  // programmatic dependent launch lets start early: everything above reads only what earlier kernels wrote), in
  // while phase 2 writes R
  pdl_wait();
  const float* twx = tw + (i64)hv * 2 * num_pairs + pbase;
  for (int c = tid; c < cnt; c += P8_THREADS) {
    cp_async4(Tp + c, twx + c);
    cp_async4(Wp + c, twx + num_pairs + c);
  }
  cp_async_commit();
#endif
  __syncthreads();  // every read of the q / k / S0 rows is done: R and QS overwrite them
  tl.mark(6);

  // ---- phase 2. R_i = beta_i (v_i - e^{G_i} khat_i . S0 row) and e^{G_i} qhat_i . S0 row, by (node, column):
  // a lane's two nodes per tile, their factors read into registers before its stores (which may alias them)
  if (nb < n) {
    float* dst = mat == 0 ? RS : QS;
#pragma unroll
    for (int t = 0; t < P8_TPW; ++t) {
      const int ia = nb + t * 8 + 2 * tq;  // nodes ia, ia + 1; columns rt 16 + gq, + 8
      float sc[2], bb[2], vv[4];
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const bool live = ia + c < n;
        sc[c] = live ? eG[ia + c] * (mat == 0 ? rk[ia + c] : rq[ia + c]) : 0.0f;
        bb[c] = live && mat == 0 ? bt[ia + c] : 0.0f;
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = ia + (e & 1), col = rt * 16 + gq + (e >> 1) * 8;
        vv[e] = i < n && mat == 0 ? bf16_bits_to_f32(vs[i * P8_BV + col]) : 0.0f;
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = ia + (e & 1), col = rt * 16 + gq + (e >> 1) * 8;
        if (i < n) dst[i * P8_RP + col] = mat == 0 ? bb[e & 1] * (vv[e] - sc[e & 1] * pacc[t][e]) : sc[e & 1] * pacc[t][e];
      }
    }
  }
#if P8_PREGRAM
  cp_async_wait<0>();  // T and W
#else
  if (tid < n) p8_path_rows(Tp, Wp, Xp, Yp, pbp, pb[tid], plen[tid]);  // a thread per node
#endif
  __syncthreads();
  tl.mark(7);

  // ---- phase 3. P8_OUTW nodes a warp, LPN = 32 / P8_OUTW lanes a node, CPN columns a lane (two or fewer:
  // adjacent; four or more: runs of four, LPN 4 apart, so that a quarter warp's float4 loads miss each other):
  // Delta_i and O_i over i's path entries, four entries a step with all their loads issued first (entries past
  // the path: weight 0 on the node's own R).
  constexpr int LPN = 32 / P8_OUTW;
  constexpr int CPN = P8_BV / LPN;
  static_assert(CPN == 1 || CPN == 2 || CPN % 4 == 0, "1, 2, 4 or 8 V columns a lane");
  const int sub = lane / LPN, ln = lane % LPN;
  const int col0 = CPN >= 4 ? ln * 4 : ln * CPN;  // the lane's first column; column c: col0 + (c / 4) 4 LPN + c % 4
  for (int ib = P8_OUTW * warp; ib < n; ib += P8_OUTW * P8_WARPS) {
    const int i = ib + sub;
    const bool live = i < n;
    const int e0 = live ? pb[i] : 0, last = live ? e0 + plen[i] - 1 : -1;
    float dl[CPN], ol[CPN];
#pragma unroll
    for (int c = 0; c < CPN; ++c) {
      dl[c] = 0.0f;
      ol[c] = live ? QS[i * P8_RP + col0 + (CPN >= 4 ? (c / 4) * 4 * LPN + c % 4 : c)] : 0.0f;
    }
    for (int e = e0; e <= last; e += 4) {
      int jj[4];
      float te[4], we[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int eu = e + u <= last ? e + u : last;
        jj[u] = pj[eu];
        te[u] = e + u <= last ? Tp[eu] : 0.0f;
        we[u] = e + u <= last ? Wp[eu] : 0.0f;
      }
      float rj[4][CPN];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float* src = RS + jj[u] * P8_RP + col0;
        if constexpr (CPN >= 4) {
#pragma unroll
          for (int c = 0; c < CPN; c += 4) {
            const float4 r4 = *reinterpret_cast<const float4*>(src + (c / 4) * 4 * LPN);
            rj[u][c] = r4.x;
            rj[u][c + 1] = r4.y;
            rj[u][c + 2] = r4.z;
            rj[u][c + 3] = r4.w;
          }
        } else if constexpr (CPN == 2) {
          const float2 r2 = *reinterpret_cast<const float2*>(src);
          rj[u][0] = r2.x;
          rj[u][CPN - 1] = r2.y;
        } else {
          rj[u][0] = src[0];
        }
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
#pragma unroll
        for (int c = 0; c < CPN; ++c) {
          dl[c] = fmaf(te[u], rj[u][c], dl[c]);
          ol[c] = fmaf(we[u], rj[u][c], ol[c]);
        }
      }
    }
    if (!live) continue;
    const i64 row = ((i64)(bos + i) * HV + hv) * GDN_V + v0 + col0;
    if constexpr (CPN >= 4) {
#pragma unroll
      for (int c = 0; c < CPN; c += 4) {
        uint2 o4;
        o4.x = (u32)from_f32<tin>(ol[c]).bits | ((u32)from_f32<tin>(ol[c + 1]).bits << 16);
        o4.y = (u32)from_f32<tin>(ol[c + 2]).bits | ((u32)from_f32<tin>(ol[c + 3]).bits << 16);
        *reinterpret_cast<uint2*>(o + row + (c / 4) * 4 * LPN) = o4;
        if (delta_out != nullptr)
          *reinterpret_cast<float4*>(delta_out + row + (c / 4) * 4 * LPN) = make_float4(dl[c], dl[c + 1], dl[c + 2], dl[c + 3]);
      }
    } else if constexpr (CPN == 2) {
      *reinterpret_cast<u32*>(o + row) = (u32)from_f32<tin>(ol[0]).bits | ((u32)from_f32<tin>(ol[CPN - 1]).bits << 16);
      if (delta_out != nullptr) *reinterpret_cast<float2*>(delta_out + row) = make_float2(dl[0], dl[CPN - 1]);
    } else {
      o[row] = from_f32<tin>(ol[0]);
      if (delta_out != nullptr) delta_out[row] = dl[0];
    }
  }
  tl.mark(8);
}

// The tree solve for version 8 (P8_PREGRAM = 1): one CTA per (request, q/k head) computes, for each of the q/k head's
// G = HV / H value heads, every node's rows of T = (I + X)^-1 and W = Y T over its path, which the verify kernel then
// copies in instead of solving (its two CTAs of a value head solved the same rows twice; here the work is done once
// and beside the verify CTAs' copies and projections; bench/NOTES.md section 77). Steps, by the verify kernel's
// functions (so that P8_PREGRAM = 0 gives the same bits): the request's q and k rows, plan tables, g and beta into
// shared memory; per node its path (p8_walk_path) and per value head its path gate G; the norms (p8_norms); the
// grams' raw products (p8_gram_tasks, one read of each staged row); per value head the scales (p8_scale_entries)
// and the path rows (p8_path_rows), written to tw[hv][0][pair_off[pos[i]] + depth[j]] (T) and tw[hv][1][...] (W)
// for each ancestor pair (i, j). Each entry is written once; a fixed-layout plan's padding entries stay as they are.
// Grid (1, H, R), 32 P8_GWARPS threads, dynamic shared memory p8_solve_smem_words(n16, pcap, G) words. `timeline`
// (bench/gdn_timeline.py; null otherwise): thread 0's global timer and SM clock at P8_SMARKS points: the CTA's start,
// after the tables and per-node paths, after the entries and q / k (barrier), after the norms and grams (barrier),
// after the scales (barrier), at warp 0's end.
__host__ __device__ constexpr int p8_solve_smem_words(int n16, int pcap, int groups) {
  return n16 * P8_KP                              // q, k rows [2][n16][KP] bf16
         + (5 + 2 * groups) * p8_align4(pcap)     // by path entry: pj, pbp, pown, raw X, Y; scaled X, Y per value head
         + p8_align4(n16 + 1)                     // pair_off of the request's positions
         + 9 * n16                                // per node: perm, pb, plen, anc[4], rk, rq
         + 3 * groups * n16;                      // per value head and node: g, beta, G
}

extern "C" __global__ void __launch_bounds__(32 * P8_GWARPS)
gdn_tree_paths_solve(const tin* __restrict__ q, const tin* __restrict__ k, const float* __restrict__ g,
                     const float* __restrict__ beta, const int* __restrict__ perm, const int* __restrict__ pair_off,
                     const int* __restrict__ pair_j, const int* __restrict__ cu, float* __restrict__ tw, int H, int HV,
                     int n16, int pcap, int num_pairs, float scale, int use_l2norm, long long* __restrict__ timeline) {
  TFM_DYNAMIC_SMEM(float4, smem_f4);
  const int groups = HV / H;
  if (dynamic_smem_bytes() < (u32)p8_solve_smem_words(n16, pcap, groups) * 4u) __trap();
  const int A = p8_align4(pcap);
  u16* qs = reinterpret_cast<u16*>(smem_f4);  // [n16][KP], by local node
  u16* ks = qs + n16 * P8_KP;
  int* pj = reinterpret_cast<int*>(smem_f4) + n16 * P8_KP;  // by path entry: the node's ancestor, flat then local
  int* pbp = pj + A;                                         // the first path entry of that ancestor
  int* pown = pbp + A;                                       // the entry's node
  float* Xr = reinterpret_cast<float*>(pown + A);            // raw products
  float* Yr = Xr + A;
  float* Xs = Yr + A;                                        // [G][A] scaled, by value head
  float* Ys = Xs + groups * A;
  int* poff = reinterpret_cast<int*>(Ys + groups * A);
  int* perm_s = poff + p8_align4(n16 + 1);
  int* pb = perm_s + n16;
  int* plen = pb + n16;
  u32* anc = reinterpret_cast<u32*>(plen + n16);             // [n16][4]
  float* rk = reinterpret_cast<float*>(anc + 4 * n16);
  float* rq = rk + n16;
  float* gl = rq + n16;                                      // [G][n16]
  float* bt = gl + groups * n16;                             // [G][n16]
  float* Gs = bt + groups * n16;                             // [G][n16]
  constexpr int THREADS = 32 * P8_GWARPS;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const CtaTimeline tl = cta_timeline(timeline, P8_SMARKS);
  tl.mark(0);
  pdl_launch_dependents();  // the verify kernel may start: it reads tw only after its pdl_wait
  const int h = blockIdx.y, r = blockIdx.z;
  const int bos = cu[r], n = cu[r + 1] - bos;
  if (n <= 0) {
    for (int m = 1; m < P8_SMARKS; ++m) tl.mark(m);
    return;
  }
  if (n > n16 || n16 > P8_N) __trap();
  const int pbase = pair_off[bos];
  const int cnt = pair_off[bos + n] - pbase;
  if (cnt > pcap) __trap();
  for (int c = tid; c < cnt; c += THREADS) cp_async4(pj + c, pair_j + pbase + c);
  for (int c = tid; c <= n; c += THREADS) {
    cp_async4(poff + c, pair_off + bos + c);
    if (c < n) cp_async4(perm_s + c, perm + bos + c);
  }
  for (int c = tid; c < groups * n; c += THREADS) {  // value head h G + c / n of node c % n
    const int gv = c / n, i = c % n;
    cp_async4(gl + gv * n16 + i, g + (i64)(bos + i) * HV + h * groups + gv);
    cp_async4(bt + gv * n16 + i, beta + (i64)(bos + i) * HV + h * groups + gv);
  }
  cp_async_commit();
  const int rows = (n + 15) & ~15;  // whole 16-row tiles, rows n .. rows - 1 zero
  stage_qk_rows<GDN_K, P8_KP, THREADS>(qs, ks, q, k, bos, n, rows, H, h, tid);
  cp_async_commit();
  cp_async_wait<1>();  // the tables, g and beta
  __syncthreads();
  // a thread per (value head, node): the path gate G in the verify kernel's order; value head 0's threads also the
  // node's first path entry, path length, ancestor bits and its entries' owner
  for (int t = tid; t < groups * n; t += THREADS) {
    const int gv = t / n, p = t - gv * n;
    const int i = perm_s[p] - bos;
    const int e0 = poff[p] - pbase, d = poff[p + 1] - poff[p];
    if (d > P8_PATH) __trap();
    float gsum = 0.0f;
    if (gv == 0) {
      u32 b0, b1, b2, b3;
      p8_walk_path(pj, e0, d, bos, b0, b1, b2, b3, [&](int e, int j) {
        gsum += gl[j];
        pown[e] = i;
      });
      pb[i] = e0;
      plen[i] = d;
      anc[i * 4] = b0;
      anc[i * 4 + 1] = b1;
      anc[i * 4 + 2] = b2;
      anc[i * 4 + 3] = b3;
    } else {
#pragma unroll
      for (int x = 0; x < P8_PATH; ++x) {
        if (x >= d) break;
        gsum += gl[gv * n16 + pj[e0 + x] - bos];
      }
    }
    Gs[gv * n16 + i] = gsum;
  }
  __syncthreads();
  tl.mark(1);
  for (int e = tid; e < cnt; e += THREADS) {
    const int j = pj[e] - bos;
    pj[e] = j;
    pbp[e] = pb[j];
  }
  cp_async_wait<0>();  // q and k
  __syncthreads();
  tl.mark(2);
  p8_norms<THREADS>(qs, ks, n, rows, scale, use_l2norm, tid, rk, rq, 1);
  p8_gram_tasks(qs, ks, anc, pb, plen, n, warp, P8_GWARPS, lane, 0, 1,
                [&](int gram, int e, float val) { (gram == 0 ? Xr : Yr)[e] = val; });
  __syncthreads();
  tl.mark(3);
  p8_scale_entries(Xr, Yr, Xs, Ys, pown, pj, rk, rq, bt, Gs, cnt, groups, A, n16, tid, THREADS);
  __syncthreads();
  tl.mark(4);
  for (int t = tid; t < groups * n; t += THREADS) {  // a thread per (value head, node)
    const int gv = t / n, i = t - gv * n;
    float* out = tw + (i64)(h * groups + gv) * 2 * num_pairs + pbase;
    p8_path_rows(out, out + num_pairs, Xs + gv * A, Ys + gv * A, pbp, pb[i], plen[i]);
  }
  tl.mark(5);
}
