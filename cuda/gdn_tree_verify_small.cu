// Gated DeltaNet verify over a token tree, version 7: trees of at most 32 nodes (the runtime's B = 16
// trees have 17), one kernel per call, one CTA per (request, q/k head, S7_BV columns of V) for all value
// heads of the q/k head's group, a warp per (value head, 16 rows of V, half of K).
//
// The same function as versions 1-6 (DESIGN.md section 4; the chunked delta rule of Yang et al., "Gated
// Delta Networks", ICLR 2025, restricted to ancestor pairs), for bfloat16 q/k/v and a float32 state:
//   X_ij = beta_i e^{G_i - G_j} khat_i . khat_j        j a strict ancestor of i
//   Y_ij = e^{G_i - G_j} qhat_i . khat_j               j an ancestor of i or i itself
//   (I + X) Delta = diag(beta) (V - diag(e^G) K S0^T)   forward substitution over the tree
//   O = diag(e^G) Q S0^T + Y Delta                       no state is written
//
// Why another layout (bench/NOTES.md section 73): at n = 16 version 6 takes 10.4 us at batch 1 and 44 us
// at batch 8 on an H100 against a bytes floor of 1.2 / 9.7 us (S0 is 64 KB per value head); its CTAs of
// 256-512 threads and ~100 KB of shared memory, built for n = 128, run batch 8's 1,024 CTAs in waves of one
// or two CTAs per SM with their latencies exposed. Here a CTA is 4 GROUP S7_BV threads (384 at the 27B
// shape with the wrapper's S7_BV = 32: ~60 KB, two per SM), and every n x n quantity is a 32 x 32 block
// indexed by the request's local node index
// (TreePlan.build refuses a parent that does not precede its child, so ancestors come first):
//   phase 0  S0's rows straight into registers in the mma A-fragment layout (issued first: their DRAM
//            latency overlaps the rest of the phase); q, k rows (cp.async, rows past n zero), the CTA's v
//            columns, and the request's plan tables, g and beta into shared memory with one round of
//            copies; then per (node, value head) the ancestor bitmask and the path gate G (a sum over the
//            path) from shared memory
//   phase 1  q / k norms (a warp per row); the lower-triangle 16 x 8 tiles of K K^T and Q K^T (bf16 mma:
//            exact products, float32 sums); the projections K S0^T and Q S0^T (bf16 mma on a three-part
//            split of S0, small parts first: float32-accurate), a warp per (value head, 16 V rows, half
//            of K: the warps' instruction streams are what bounds this phase)
//   phase 2  X, Y (zero off the ancestor pairs and above the diagonal) and the raw projections to shared
//            memory (the projections over the q / k rows, which are dead by then; the second half of K's
//            sums added after a barrier)
//   phase 3  a thread per (value head, V column): Delta by forward substitution in node order and O, the
//            32 x 32 loops unrolled so that Delta stays in registers, rows past n skipped
//
// Compile-time constants (NVRTC -D): TFM_IN (must be 1, bfloat16), GDN_K, GDN_V, GDN_GROUP, S7_BV.
// The plan (vllm_tfm/kernels/plan.py: cu, perm, pair_off, pair_j) and the state layout (V-first
// [slot, HV, V, K] with unit K stride, read only) are those of the other versions. The wrapper
// (vllm_tfm/kernels/gdn.py small_unsupported_reason) sends no tree of more than 32 nodes here.
#include "tfm_mma.cuh"

#ifndef GDN_K
#define GDN_K 128
#endif
#ifndef GDN_V
#define GDN_V 128
#endif
#ifndef GDN_GROUP
#define GDN_GROUP 3
#endif
#ifndef S7_BV
#define S7_BV 16
#endif
#define S7_N 32                               // most nodes of a tree
#define S7_RT (S7_BV / 16)                    // 16-row tiles of V per value head
#define S7_WARPS (2 * GDN_GROUP * S7_RT)      // a warp per (value head, 16 rows, half of K)
#define S7_THREADS (32 * S7_WARPS)
#define S7_KP (GDN_K + 8)                     // bf16 per staged q / k row: rows in distinct banks
#define S7_PS (S7_BV + 4)                     // floats per projection row: the mma stores miss each other
#define S7_XS (S7_N * S7_N + 16)              // floats per value head's X (Y): two heads' rows 16 banks apart
#define S7_KSTEPS (GDN_K / 16)
#define S7_KHALF (S7_KSTEPS / 2)              // 16-wide K steps of a warp's half of K
#define S7_TASKS 12                           // gram tiles: 6 lower-triangle 16 x 8 tiles of K K^T and of Q K^T
#define S7_TPW ((S7_TASKS + S7_WARPS - 1) / S7_WARPS)

static_assert(TFM_IN == 1, "version 7 takes bfloat16 q/k/v");
static_assert(GDN_K % 32 == 0 && GDN_V % S7_BV == 0, "K must be a multiple of 32 and V of S7_BV");
static_assert(S7_BV == 16 || S7_BV == 32, "16 or 32 V columns per value head and CTA");
static_assert(S7_THREADS <= 1024, "at most 1024 threads: GROUP * S7_BV <= 256");
// phase 0's staging of the request's tables (in the X region, written only in phase 2): perm, pair_off,
// pair_j (at most N (N + 1) / 2 path entries), g [GROUP][N]
#define S7_STAGE (S7_N + (S7_N + 4) + S7_N * (S7_N + 1) / 2 + GDN_GROUP * S7_N)
static_assert(S7_STAGE <= GDN_GROUP * S7_XS, "the staged tables fit the X region");

// Timeline (bench/gdn_timeline.py --variant 7): when the caller passes a buffer, thread 0 of each CTA writes
// the global timer (ns) and the SM clock at the kernel's start, after phase 0's copies, after its masks and
// gates, after phase 1, after phase 2 and at the end of its phase 3.
#define S7_MARKS 6

__host__ __device__ constexpr int s7_align4(int x) { return (x + 3) & ~3; }
__host__ __device__ constexpr int s7_max(int a, int b) { return a > b ? a : b; }

// Words of dynamic shared memory (vllm_tfm/kernels/gdn.py small_smem_bytes mirrors this).
__host__ __device__ constexpr int s7_smem_words() {
  return s7_max(S7_N * S7_KP, 2 * GDN_GROUP * S7_N * S7_PS)   // q, k rows [2][N][KP] bf16; later PK, PQ
         + 2 * GDN_GROUP * S7_XS                                // X, Y [GROUP][XS]
         + s7_align4(S7_N * GDN_GROUP * S7_BV / 2)              // v [N][GROUP][BV] bf16
         + (4 + 3 * GDN_GROUP) * S7_N;                          // rk, rq, anc (2 N: see below); G, e^G, beta [GROUP][N]
}

// The 32-bit word of two bf16 at (row, col) of a staged [N][KP] q / k block.
__device__ __forceinline__ u32 s7_word(const u16* rows, int row, int col) {
  return *reinterpret_cast<const u32*>(rows + row * S7_KP + col);
}

// A warp's projection tiles (C fragments: rows = its 16 V rows, columns = 8 nodes a tile) into PK, PQ
// [GROUP][N][PS] (ADD: added to what the other half of K stored).
template <bool ADD>
__device__ __forceinline__ void s7_projection_rows(float* PK, float* PQ, const float (&pk)[4][4], const float (&pq)[4][4],
                                                   int ntiles, int wh, int wr, int gq, int tq) {
  constexpr int at[4] = {0, S7_PS, 8, S7_PS + 8};  // c0: (row, node), c1: (row, node + 1), c2, c3: row + 8
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    if (t < ntiles) {
      float* dk = PK + (wh * S7_N + t * 8 + 2 * tq) * S7_PS + wr + gq;
      float* dq = PQ + (wh * S7_N + t * 8 + 2 * tq) * S7_PS + wr + gq;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        dk[at[e]] = ADD ? dk[at[e]] + pk[t][e] : pk[t][e];
        dq[at[e]] = ADD ? dq[at[e]] + pq[t][e] : pq[t][e];
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(S7_THREADS)
gdn_tree_verify_small(const tin* __restrict__ q, const tin* __restrict__ k, const tin* __restrict__ v,
                      const float* __restrict__ g, const float* __restrict__ beta, const int* __restrict__ perm,
                      const int* __restrict__ pair_off, const int* __restrict__ pair_j,
                      const int* __restrict__ cu, const float* __restrict__ state, const void* __restrict__ state_idx,
                      int sidx64, i64 st_slot, i64 st_head, i64 st_v, tin* __restrict__ o,
                      float* __restrict__ delta_out, int H, int HV, float scale, int use_l2norm,
                      long long* __restrict__ timeline) {
  TFM_DYNAMIC_SMEM(float4, smem_f4);
  if (dynamic_smem_bytes() < (u32)s7_smem_words() * 4u) __trap();
  float* base = reinterpret_cast<float*>(smem_f4);
  u16* qs = reinterpret_cast<u16*>(base);                    // [N][KP], by local node
  u16* ks = qs + S7_N * S7_KP;
  float* PK = base;                                          // after phase 1: [GROUP][N][PS] raw S0 k_j
  float* PQ = base + GDN_GROUP * S7_N * S7_PS;
  float* X = base + s7_max(S7_N * S7_KP, 2 * GDN_GROUP * S7_N * S7_PS);  // [GROUP][XS]: row i, column j
  float* Y = X + GDN_GROUP * S7_XS;
  u16* vs = reinterpret_cast<u16*>(Y + GDN_GROUP * S7_XS);   // [N][GROUP][BV]
  float* rk = Y + GDN_GROUP * S7_XS + s7_align4(S7_N * GDN_GROUP * S7_BV / 2);
  float* rq = rk + S7_N;
  u32* anc = reinterpret_cast<u32*>(rq + S7_N);              // bit j: node j on the root..i path (i included)
  // anc's second N words are unused (a table build 2 dropped); kept: removing them moves every later offset,
  // and this layout is the one the GPU tests and compute-sanitizer ran (bench/NOTES.md section 73)
  float* Gs = reinterpret_cast<float*>(anc + 2 * S7_N);      // [GROUP][N] path gates
  float* eG = Gs + GDN_GROUP * S7_N;                         // e^{G}
  float* bt = eG + GDN_GROUP * S7_N;                         // beta
  int* perm_s = reinterpret_cast<int*>(X);                   // phase 0 only (staging in the X region)
  int* poff_s = perm_s + S7_N;
  int* pj_s = poff_s + S7_N + 4;
  float* gl = reinterpret_cast<float*>(pj_s + S7_N * (S7_N + 1) / 2);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int gq = lane >> 2, tq = lane & 3;  // mma fragment coordinates
  const int v0 = blockIdx.x * S7_BV, h = blockIdx.y, r = blockIdx.z;
  const CtaTimeline tl = cta_timeline(timeline, S7_MARKS);
  tl.mark(0);
  const int bos = cu[r];
  const int n = cu[r + 1] - bos;
  if (n <= 0) return;
  if (n > S7_N) __trap();  // the wrapper sends larger trees to versions 6 and 3
  const int hv0 = h * GDN_GROUP;
  const i64 slot = sidx64 ? reinterpret_cast<const i64*>(state_idx)[r] : (i64)reinterpret_cast<const int*>(state_idx)[r];

  // ---- phase 0. This warp's S0 rows first, in the A-fragment layout of m16n8k16 (rows gq, gq + 8;
  // columns 2 tq, 2 tq + 8 of each 16-wide K step of its half of K): every element loaded once, 32-byte
  // pieces per quad.
  const int wk = warp & 1, wv = warp >> 1;  // this warp's half of K; its (value head, 16 rows)
  const int wh = wv / S7_RT, wr = (wv % S7_RT) * 16;  // the value head (in the group) and first row
  float2 s0r[S7_KHALF][4];
  {
    const float* s0 = state + slot * st_slot + (i64)(hv0 + wh) * st_head + (i64)(v0 + wr + gq) * st_v + 2 * tq +
                      wk * (GDN_K / 2);
#pragma unroll
    for (int s = 0; s < S7_KHALF; ++s) {
      s0r[s][0] = *reinterpret_cast<const float2*>(s0 + s * 16);
      s0r[s][1] = *reinterpret_cast<const float2*>(s0 + 8 * st_v + s * 16);
      s0r[s][2] = *reinterpret_cast<const float2*>(s0 + s * 16 + 8);
      s0r[s][3] = *reinterpret_cast<const float2*>(s0 + 8 * st_v + s * 16 + 8);
    }
  }
  // q / k rows (rows n .. N - 1 zero: the tiles read defined values), v columns, the request's tables
  stage_qk_rows<GDN_K, S7_KP, S7_THREADS>(qs, ks, q, k, bos, n, S7_N, H, h, tid);
  constexpr int VPR = S7_BV / 8;  // 16-byte pieces of a (node, value head)'s columns
  for (int c = tid; c < n * GDN_GROUP * VPR; c += S7_THREADS) {
    const int i = c / (GDN_GROUP * VPR), t = (c / VPR) % GDN_GROUP, part = c % VPR;
    cp_async16(vs + (i * GDN_GROUP + t) * S7_BV + part * 8,
               v + ((i64)(bos + i) * HV + hv0 + t) * GDN_V + v0 + part * 8);
  }
  const int pbase = pair_off[bos];
  const int cnt = pair_off[bos + n] - pbase;  // path entries of the request's nodes
  for (int c = tid; c < cnt; c += S7_THREADS) cp_async4(pj_s + c, pair_j + pbase + c);
  for (int c = tid; c <= n; c += S7_THREADS) {
    cp_async4(poff_s + c, pair_off + bos + c);
    if (c < n) cp_async4(perm_s + c, perm + bos + c);
  }
  for (int c = tid; c < n * GDN_GROUP; c += S7_THREADS) {
    const int i = c / GDN_GROUP, t = c % GDN_GROUP;
    cp_async4(gl + t * S7_N + i, g + (i64)(bos + i) * HV + hv0 + t);
    cp_async4(bt + t * S7_N + i, beta + (i64)(bos + i) * HV + hv0 + t);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  tl.mark(1);
  // per (node, value head): ancestor bits and path gate. The level position p holds node perm[p] - bos,
  // whose path (root first) is pair_j's entries pair_off[p] .. pair_off[p + 1] - 1.
  for (int c = tid; c < n * GDN_GROUP; c += S7_THREADS) {
    const int p = c % n, t = c / n;
    const int i = perm_s[p] - bos;
    u32 bits = 0u;
    float gsum = 0.0f;
    for (int e = poff_s[p] - pbase; e < poff_s[p + 1] - pbase; ++e) {
      const int j = pj_s[e] - bos;
      bits |= 1u << j;
      gsum += gl[t * S7_N + j];
    }
    if (t == 0) anc[i] = bits;
    Gs[t * S7_N + i] = gsum;
    eG[t * S7_N + i] = expf(gsum);
  }
  __syncthreads();
  tl.mark(2);

  // ---- phase 1. Norm scales: a warp per row.
  for (int i = warp; i < n; i += S7_WARPS) {
    float sk = 0.0f, sq = 0.0f;
    for (int c = lane * 2; c < GDN_K; c += 64) {
      const u32 wk = s7_word(ks, i, c), wq = s7_word(qs, i, c);
      const float k0 = bf16_bits_to_f32(wk & 0xffffu), k1 = bf16_bits_to_f32(wk >> 16);
      const float q0 = bf16_bits_to_f32(wq & 0xffffu), q1 = bf16_bits_to_f32(wq >> 16);
      sk = fmaf(k0, k0, fmaf(k1, k1, sk));
      sq = fmaf(q0, q0, fmaf(q1, q1, sq));
    }
    sk = warp_sum(sk);
    sq = warp_sum(sq);
    if (lane == 0) {
      rk[i] = use_l2norm ? l2norm_scale(sk) : 1.0f;
      rq[i] = use_l2norm ? scale * l2norm_scale(sq) : scale;
    }
  }
  // Gram tiles: task u = (gram, tile), gram 0 = K K^T, 1 = Q K^T; tiles (m16 row block, n8 column block)
  // of the lower triangle: (0,0) (0,1) (1,0) (1,1) (1,2) (1,3). Warp w takes tasks w, w + WARPS, ...
  float gacc[S7_TPW][4];
#pragma unroll
  for (int u = 0; u < S7_TPW; ++u) {
    gacc[u][0] = gacc[u][1] = gacc[u][2] = gacc[u][3] = 0.0f;
    const int task = warp + u * S7_WARPS;
    if (task >= S7_TASKS) continue;
    const int tile = task % 6, gram = task / 6;
    const int mt = tile < 2 ? 0 : 1, nt = tile < 2 ? tile : tile - 2;
    if (mt * 16 >= n || nt * 8 >= n) continue;
    const u16* arows = gram == 0 ? ks : qs;
#pragma unroll
    for (int s = 0; s < S7_KSTEPS; ++s) {
      const int c = s * 16 + 2 * tq;
      u32 a[4];
      a[0] = s7_word(arows, mt * 16 + gq, c);
      a[1] = s7_word(arows, mt * 16 + gq + 8, c);
      a[2] = s7_word(arows, mt * 16 + gq, c + 8);
      a[3] = s7_word(arows, mt * 16 + gq + 8, c + 8);
      mma_16816<true>(gacc[u], a, s7_word(ks, nt * 8 + gq, c), s7_word(ks, nt * 8 + gq, c + 8));
    }
  }
  // Projections of this warp's 16 rows of S0: column j of K S0^T (Q S0^T) is S0 k_j (S0 q_j), node tiles of 8
  const int ntiles = (n + 7) / 8;
  float pk[4][4], pq[4][4];
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    pk[t][0] = pk[t][1] = pk[t][2] = pk[t][3] = 0.0f;
    pq[t][0] = pq[t][1] = pq[t][2] = pq[t][3] = 0.0f;
  }
#pragma unroll
  for (int s = 0; s < S7_KHALF; ++s) {
    u32 ahi[4], amid[4], alo[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) split3_bf16x2(s0r[s][e], ahi[e], amid[e], alo[e]);
    const int c = wk * (GDN_K / 2) + s * 16 + 2 * tq;
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      if (t < ntiles) {
        const u32 kb0 = s7_word(ks, t * 8 + gq, c), kb1 = s7_word(ks, t * 8 + gq, c + 8);
        const u32 qb0 = s7_word(qs, t * 8 + gq, c), qb1 = s7_word(qs, t * 8 + gq, c + 8);
        mma_16816<true>(pk[t], alo, kb0, kb1);
        mma_16816<true>(pk[t], amid, kb0, kb1);
        mma_16816<true>(pk[t], ahi, kb0, kb1);
        mma_16816<true>(pq[t], alo, qb0, qb1);
        mma_16816<true>(pq[t], amid, qb0, qb1);
        mma_16816<true>(pq[t], ahi, qb0, qb1);
      }
    }
  }
  __syncthreads();  // every read of the q / k rows is done: PK, PQ overwrite them; the norms are in
  tl.mark(3);

  // ---- phase 2. Raw projections by (value head, node, column): the first half of K's sums stored here,
  // the second half's added after the next barrier (a + b either way: deterministic).
  if (wk == 0) s7_projection_rows<false>(PK, PQ, pk, pq, ntiles, wh, wr, gq, tq);
  // X and Y of the computed tiles for every value head; zero off the ancestor pairs, above the diagonal
  // and past n (phase 3 reads whole float4 groups of a row up to its diagonal).
#pragma unroll
  for (int u = 0; u < S7_TPW; ++u) {
    const int task = warp + u * S7_WARPS;
    if (task >= S7_TASKS) continue;
    const int tile = task % 6, gram = task / 6;
    const int mt = tile < 2 ? 0 : 1, nt = tile < 2 ? tile : tile - 2;
    if (mt * 16 >= n || nt * 8 >= n) continue;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = mt * 16 + gq + (e >> 1) * 8, j = nt * 8 + 2 * tq + (e & 1);
      const bool pair = i < n && j < n && ((anc[i] >> j) & 1u) && (gram == 1 || j < i);
      const float prod = gacc[u][e] * rk[j] * (gram == 0 ? rk[i] : rq[i]);
      float* dst = (gram == 0 ? X : Y) + i * S7_N + j;
#pragma unroll
      for (int t = 0; t < GDN_GROUP; ++t) {
        float val = 0.0f;
        if (pair) {
          const float dec = expf(Gs[t * S7_N + i] - Gs[t * S7_N + j]);  // j on i's path: G_i <= G_j, no overflow
          val = gram == 0 ? bt[t * S7_N + i] * dec * prod : dec * prod;
        }
        dst[t * S7_XS] = val;
      }
    }
  }
  __syncthreads();
  if (wk == 1) s7_projection_rows<true>(PK, PQ, pk, pq, ntiles, wh, wr, gq, tq);
  __syncthreads();
  tl.mark(4);

  // ---- phase 3. A thread per (value head, column): Delta by forward substitution in node order, then O.
  if (tid >= GDN_GROUP * S7_BV) return;
  const int th = tid / S7_BV, col = tid % S7_BV;
  const float* Xh = X + th * S7_XS;
  const float* Yh = Y + th * S7_XS;
  const float* PKh = PK + th * S7_N * S7_PS + col;
  const float* PQh = PQ + th * S7_N * S7_PS + col;
  const float* eGh = eG + th * S7_N;
  const float* bth = bt + th * S7_N;
  const i64 ocol = (i64)(hv0 + th) * GDN_V + v0 + col;
  float d[S7_N];
#pragma unroll
  for (int i = 0; i < S7_N; ++i) d[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < S7_N; ++i) {
    if (i >= n) break;
    const float vi = bf16_bits_to_f32(vs[(i * GDN_GROUP + th) * S7_BV + col]);
    float acc = bth[i] * (vi - eGh[i] * rk[i] * PKh[i * S7_PS]);
#pragma unroll
    for (int j4 = 0; j4 < i; j4 += 4) {
      const float4 x = *reinterpret_cast<const float4*>(Xh + i * S7_N + j4);
      acc = fmaf(-x.x, d[j4], acc);
      if (j4 + 1 < i) acc = fmaf(-x.y, d[j4 + 1], acc);
      if (j4 + 2 < i) acc = fmaf(-x.z, d[j4 + 2], acc);
      if (j4 + 3 < i) acc = fmaf(-x.w, d[j4 + 3], acc);
    }
    d[i] = acc;
  }
#pragma unroll
  for (int i = 0; i < S7_N; ++i) {
    if (i >= n) break;
    float acc = eGh[i] * rq[i] * PQh[i * S7_PS];
#pragma unroll
    for (int j4 = 0; j4 <= i; j4 += 4) {
      const float4 y = *reinterpret_cast<const float4*>(Yh + i * S7_N + j4);
      acc = fmaf(y.x, d[j4], acc);
      if (j4 + 1 <= i) acc = fmaf(y.y, d[j4 + 1], acc);
      if (j4 + 2 <= i) acc = fmaf(y.z, d[j4 + 2], acc);
      if (j4 + 3 <= i) acc = fmaf(y.w, d[j4 + 3], acc);
    }
    const i64 row = (i64)(bos + i) * HV * GDN_V + ocol;
    o[row] = from_f32<tin>(acc);
    if (delta_out != nullptr) delta_out[row] = d[i];
  }
  tl.mark(5);
}
