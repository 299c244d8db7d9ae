// Gated DeltaNet verify over a token tree, version 6: one kernel per call, one CTA per
// (request, q/k head, 16 columns of V) for all value heads of the q/k head's group.
//
// Same function as cuda/gdn_tree_verify.cu (DESIGN.md section 4; the chunked delta rule of Yang et
// al., "Gated Delta Networks", ICLR 2025, restricted to ancestor pairs), for bfloat16 q/k/v and a
// float32 state:
//   X_ij = beta_i e^{G_i - G_j} khat_i . khat_j        j a strict ancestor of i
//   Y_ij = e^{G_i - G_j} qhat_i . khat_j               j an ancestor of i or i itself
//   (I + X) Delta = diag(beta) (V - diag(e^G) K S0^T)   forward substitution over the tree
//   O = diag(e^G) Q S0^T + Y Delta                       no state is written
//
// Why a new layout (bench/NOTES.md section 31): versions 3-5 spend, at n = 128 and batch 1, 8.8 us
// in a separate pairs kernel and ~9 us in a main kernel's prologue and epilogue, and every value
// head's CTAs load the q/k rows of their q/k head again (24 CTAs per q/k head at the 27B shape).
// Here a CTA of 512 threads stages the request's q and k rows of one q/k head once, computes the
// q/k products of every node with every earlier node on tensor cores (the lower triangle of
// K K^T and Q K^T, bf16 mma: exact products, float32 sums) and keeps those of ancestor pairs, and
// then serves the GROUP = HV / H value heads that share those rows:
//   phase 0  cp.async of the q, k and v rows; S0 rows (GROUP x 16 x K floats) into registers; the
//            plan's tables into shared memory (no dependent global loads past cu and pair_off)
//   phase 1  q norms; the gram blocks (16 x 16 lower-triangular tiles, m16n8k16 bf16, a warp per
//            tile; with G6_CLUSTER > 1 split over a cluster of the q/k head's CTAs), scattered to the
//            pair table (node i's ancestor at depth e is entry pair_off(i) + e); S0 split into three
//            bfloat16 parts (hi + mid + lo carries float32's 24 bits)
//   phase 2  per (node, value head): path gates and X, Y of the node's pairs (the deepest-first
//            running sum of versions 1-5, so exp never overflows), e^{G_i}
//   phase 3  the projections K S0^T and Q S0^T on tensor cores (m16n8k16 bf16, exact bf16 q/k times
//            each part, float32 sums: float32-accurate products), a warp per two 16-row tiles and
//            value head; R and e^G rq Q S0^T to shared
//   phase 4  the outputs (o, delta). G6_SOLVE = 1 (trees of depth <= 16, bench/NOTES.md sections 33-34): every node's
//            row of (I + X)^-1 and of Y (I + X)^-1 restricted to its path, by a back substitution
//            over the path per (node, value head) right after phase 2 (no level barriers), then o and
//            delta as gathers over the node's path of R rows, all rows in flight at once.
//            G6_SOLVE = 0: the level-by-level forward substitution, a CTA barrier per tree level.
//
// Compile-time constants (NVRTC -D): TFM_IN (must be 1, bfloat16), GDN_K, GDN_V, GDN_GROUP, G6_THREADS,
// G6_SOLVE, G6_PATH_REG, G6_CLUSTER.
// The plan (vllm_tfm/kernels/plan.py) and the state layout (V-first [slot, HV, V, K], read only)
// are those of the other versions.
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
// Timing only (bench/gdn_phases.py --variant 6): leave phases out so that differences of timings say
// what a phase costs (the outputs are then wrong). Bits: 1 = the gram tiles (phase 1's mma and
// scatter), 2 = the projections' k-loop (phase 3's ldmatrix and mma; the epilogue kept), 4 = the
// substitution and the output writes (phase 4), 8 = the pair coefficients (phase 2's path walks), 16 =
// phase 4's global stores of o and delta (its shared-memory work kept: a store survives only for an
// output whose first element is exactly -1e-30, which keeps the sums from being optimised away), 32 =
// the S0 rows' global loads (S0 taken as zeros: what waiting for them costs the phases after), 64 = the
// gram's scatter stores (kept for a product exactly -1e-30), 128 = the gram's k-loop (ldmatrix, mma), 256 = phase
// 2b alone (the path solve's back substitutions beside the projections; 8 leaves out phase 2 and 2b), so that
// with 2 it says which of the two bounds the projections' interval.
#ifndef GDN_PROFILE_SKIP
#define GDN_PROFILE_SKIP 0
#endif
// Parts of the S0 split the projections use (timing only: 2 drops the lo part, 16 bits of S0 instead
// of float32's 24; bench/gdn_timeline.py --s0-parts 2 measures what the third part costs).
#ifndef GDN_S0_PARTS
#define GDN_S0_PARTS 3
#endif
static_assert(GDN_S0_PARTS == 2 || GDN_S0_PARTS == 3, "two or three parts of S0");
// Phase 4 (the solve). 1 = path rows: a node's Delta and output are sums over its path,
//   Delta_i = sum_{j in P(i)} T_ij R_j,   O_i = e^{G_i} rq_i Q S0^T + sum_{j in P(i)} W_ij R_j,
//   T = (I + X)^-1 and W = Y (I + X)^-1, both supported on ancestor pairs. Row i of each depends only
//   on X restricted to P(i) (the ancestors of an ancestor are ancestors), so a thread computes it by
//   back substitution over the path: t_i = 1, t_e = -sum_{f > e on the path} t_f X_fe; w the same with
//   w starting from Y's row. No CTA barrier per tree level.
// 0 = levels: forward substitution level by level (a unit per (row, value head, 4 columns), a CTA
//   barrier per level), versions 1-5's order of sums (bench/gdn_timeline.py --solve levels).
// The wrapper picks one per call (vllm_tfm/kernels/gdn.py grouped_solve: paths for trees of depth <= 16,
// faster at every size bench/NOTES.md section 34 measured).
#ifndef G6_SOLVE
#define G6_SOLVE 0
#endif
static_assert(G6_SOLVE == 0 || G6_SOLVE == 1, "G6_SOLVE: 0 = levels, 1 = path rows");
// The path solve keeps a path of up to G6_PATH_REG entries (depth < G6_PATH_REG) in registers in phase
// 2b; deeper paths take a loop over shared memory (vllm_tfm/kernels/gdn.py PATH_SOLVE_MAX_DEPTH gives
// the path solve trees of at most this many levels).
#ifndef G6_PATH_REG
#define G6_PATH_REG 17
#endif
static_assert(G6_PATH_REG >= 1 && G6_PATH_REG <= 32, "path entries held in registers");
// CTAs per thread block cluster (vllm_tfm/kernels/gdn.py grouped_cluster; sm_90). The V / 16 CTAs of one
// (request, q/k head) differ only in their 16 V columns, yet each computed the whole gram (bench/NOTES.md
// sections 35, 44). With a cluster of G6_CLUSTER of them (consecutive along x; the launch sets the
// cluster dimension), CTA rank c computes the gram tiles c, c + G6_CLUSTER, ... and stores each kept
// product and k-norm scale into the shared memory of every CTA of the cluster (mapa), so each tile is
// computed once per cluster; a cluster barrier then stands where the CTA barrier B2 stood. The outputs
// are those of G6_CLUSTER = 1 bit for bit (the same tiles, the same arithmetic, on another SM).
#ifndef G6_CLUSTER
#define G6_CLUSTER 1
#endif
static_assert(G6_CLUSTER == 1 || G6_CLUSTER == 2 || G6_CLUSTER == 4 || G6_CLUSTER == 8, "cluster of 1, 2, 4 or 8 CTAs");
#if G6_CLUSTER > 1 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "G6_CLUSTER > 1 needs thread block clusters (sm_90)"
#endif
#define G6_BV 16        // V columns per value head and CTA
#define G6_DS G6_BV     // floats per D / O row
// Floats between two value heads' D (and O) blocks past their n16 rows: 16 puts the same row of
// consecutive heads in opposite halves of the 32 banks, so phase 4's float4 row loads of two heads
// in one quarter warp do not conflict (bench/NOTES.md section 34). -DG6_DPAD=0: timing only.
#ifndef G6_DPAD
#define G6_DPAD 16
#endif
static_assert(G6_DPAD == 0 || G6_DPAD == 16, "D / O head padding: 0 or 16 floats");
// Threads per CTA (NVRTC -D): 512 (one CTA per SM) or 256 (two CTAs per SM where the shared memory
// allows, so that one CTA's loads overlap the other's math: many CTAs, small trees).
#ifndef G6_THREADS
#define G6_THREADS 512
#endif
#define G6_WARPS (G6_THREADS / 32)
static_assert(G6_THREADS == 512 || G6_THREADS == 256, "512 or 256 threads per CTA");
#define G6_KP (GDN_K + 8)  // bf16 per staged row: 16-byte aligned rows, ldmatrix rows in distinct banks

static_assert(TFM_IN == 1, "version 6 takes bfloat16 q/k/v (float32 and float16 inputs run version 3)");
static_assert(GDN_K % 32 == 0 && GDN_V % G6_BV == 0, "K must be a multiple of 32 and V of 16");
static_assert(GDN_GROUP >= 1 && GDN_GROUP * 4 <= G6_THREADS, "value heads per q/k head");

// Timeline (bench/gdn_timeline.py): when the caller passes a buffer, thread 0 of each CTA writes the
// global timer (ns) and the SM clock at the kernel's start and after each phase's barrier.
#define G6_MARKS 6

__host__ __device__ constexpr int g6_align4(int x) { return (x + 3) & ~3; }
__host__ __device__ constexpr int g6_round16(int x) { return (x + 15) & ~15; }
__host__ __device__ constexpr int g6_max(int a, int b) { return a > b ? a : b; }
__host__ __device__ constexpr int g6_head_stride(int n16) { return n16 * G6_DS + G6_DPAD; }  // D / O, floats

struct G6Smem {
  u16 *qs, *ks, *s0, *vs;        // q, k rows [n16][KP]; S0 parts [3][GROUP][16][KP]; v [n][GROUP][16]
  float *D, *O, *kk, *qk;        // R then Delta, and e^G rq Q S0^T: [GROUP][n16][16]; raw pair products [pcap]
  float *X, *Y;                  // [GROUP][pcap] (G6_SOLVE 1: Y becomes W = Y (I + X)^-1 in phase 2b)
  float* T;                      // G6_SOLVE 1: (I + X)^-1 on the pair entries [GROUP][pcap]
  int* pj;                       // ancestor (global node index) of each pair entry [pcap]
  int* pa;                       // G6_SOLVE 1: first pair entry of each entry's ancestor [pcap]
  float *rk, *rq, *eg, *bt, *gl; // norm scales [n]; e^G, beta, g [GROUP][n]
  int *dep_n, *poff_n;           // by local node: depth, first pair entry
  int *node_p, *dep_p, *poff_p, *lvl;  // by level position: node, depth, first pair entry [n + 1]; first position of a depth
};

// Words of dynamic shared memory (vllm_tfm/kernels/gdn.py mirrors this in grouped_smem_bytes).
__host__ __device__ inline int g6_smem_words(int n_cap, int pcap) {
  const int n16 = g6_round16(n_cap);
  const int dw = GDN_GROUP * g6_head_stride(n16);  // D (and O)
  return 2 * g6_align4(n16 * G6_KP / 2) + g6_align4(3 * GDN_GROUP * G6_BV * G6_KP / 2) +
         g6_align4(n_cap * GDN_GROUP * G6_BV / 2) + g6_max(2 * dw, 2 * g6_align4(pcap)) +
         (1 + G6_SOLVE + (2 + G6_SOLVE) * GDN_GROUP) * g6_align4(pcap) + (2 + 3 * GDN_GROUP) * g6_align4(n_cap) + 2 * g6_align4(n_cap) +
         2 * g6_align4(n_cap) + g6_align4(n_cap + 1) + g6_align4(n_cap + 2);
}

__device__ inline G6Smem g6_carve(float* base, int n_cap, int pcap) {
  G6Smem s;
  const int n16 = g6_round16(n_cap);
  const int dw = GDN_GROUP * g6_head_stride(n16);
  float* p = base;
  s.qs = reinterpret_cast<u16*>(p); p += g6_align4(n16 * G6_KP / 2);
  s.ks = reinterpret_cast<u16*>(p); p += g6_align4(n16 * G6_KP / 2);
  s.s0 = reinterpret_cast<u16*>(p); p += g6_align4(3 * GDN_GROUP * G6_BV * G6_KP / 2);
  s.vs = reinterpret_cast<u16*>(p); p += g6_align4(n_cap * GDN_GROUP * G6_BV / 2);
  // the raw pair products live until phase 2, D and O from phase 3 on: one region
  s.D = p; s.O = p + dw;
  s.kk = p; s.qk = p + g6_align4(pcap);
  p += g6_max(2 * dw, 2 * g6_align4(pcap));
  s.pj = reinterpret_cast<int*>(p); p += g6_align4(pcap);
  s.pa = reinterpret_cast<int*>(p); p += G6_SOLVE * g6_align4(pcap);
  s.X = p; p += GDN_GROUP * g6_align4(pcap);
  s.Y = p; p += GDN_GROUP * g6_align4(pcap);
  s.T = p; p += G6_SOLVE * GDN_GROUP * g6_align4(pcap);
  s.rk = p; p += g6_align4(n_cap);
  s.rq = p; p += g6_align4(n_cap);
  s.eg = p; p += GDN_GROUP * g6_align4(n_cap);
  s.bt = p; p += GDN_GROUP * g6_align4(n_cap);
  s.gl = p; p += GDN_GROUP * g6_align4(n_cap);
  s.dep_n = reinterpret_cast<int*>(p); p += g6_align4(n_cap);
  s.poff_n = reinterpret_cast<int*>(p); p += g6_align4(n_cap);
  s.node_p = reinterpret_cast<int*>(p); p += g6_align4(n_cap);
  s.dep_p = reinterpret_cast<int*>(p); p += g6_align4(n_cap);
  s.poff_p = reinterpret_cast<int*>(p); p += g6_align4(n_cap + 1);
  s.lvl = reinterpret_cast<int*>(p); p += g6_align4(n_cap + 2);
  return s;
}

// Piece idx of the CTA's S0 rows (float4 pieces, whole rows of K per warp): value head t, row, column.
__device__ __forceinline__ void g6_s0_piece(int idx, int& t, int& row, int& c4) {
  t = idx / (G6_BV * (GDN_K / 4));
  const int rem = idx % (G6_BV * (GDN_K / 4));
  row = rem / (GDN_K / 4);
  c4 = (rem % (GDN_K / 4)) * 4;
}

// float32 -> bfloat16 bits, round to nearest even (finite inputs: S0 is a finite state).
__device__ __forceinline__ u16 g6_bf16_rn(float x) {
  u32 u = __float_as_uint(x);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (u16)(u >> 16);
}

// x = hi + mid + lo in bfloat16 (each remainder is exact in float32: x - hi and (x - hi) - mid lose
// nothing), so that three bf16 products with an exact bf16 operand give x's float32 product.
__device__ __forceinline__ void g6_split3(float x, u16& hi, u16& mid, u16& lo) {
  hi = g6_bf16_rn(x);
  const float r1 = x - bf16_bits_to_f32(hi);
  mid = g6_bf16_rn(r1);
  lo = g6_bf16_rn(r1 - bf16_bits_to_f32(mid));
}

// Phase 4's writes of 4 columns of one (node, value head) row: o rounded to bfloat16, delta in float32.
__device__ __forceinline__ void g6_store_row(tin* __restrict__ o, float* __restrict__ delta_out, i64 orow, float4 out,
                                             float4 dl) {
  if ((GDN_PROFILE_SKIP & 16) && out.x != -1e-30f) return;
  uint2 packed;
  packed.x = (u32)from_f32<tin>(out.x).bits | ((u32)from_f32<tin>(out.y).bits << 16);
  packed.y = (u32)from_f32<tin>(out.z).bits | ((u32)from_f32<tin>(out.w).bits << 16);
  *reinterpret_cast<uint2*>(o + orow) = packed;
  if (delta_out != nullptr) *reinterpret_cast<float4*>(delta_out + orow) = dl;
}

// p (this CTA's shared memory) in cluster CTA `rank`; p itself without clusters.
template <typename T>
__device__ __forceinline__ T* g6_peer(T* p, int rank) {
#if G6_CLUSTER > 1
  return cluster_map(p, (u32)rank);
#else
  (void)rank;
  return p;
#endif
}

extern "C" __global__ void __launch_bounds__(G6_THREADS, 512 / G6_THREADS)
gdn_tree_verify_grouped(const tin* __restrict__ q, const tin* __restrict__ k, const tin* __restrict__ v,
                        const float* __restrict__ g, const float* __restrict__ beta, const int* __restrict__ perm,
                        const int* __restrict__ pair_off, const int* __restrict__ pair_j, const int* __restrict__ cu,
                        const float* __restrict__ state, const void* __restrict__ state_idx, int sidx64,
                        i64 st_slot, i64 st_head, i64 st_v, tin* __restrict__ o, float* __restrict__ delta_out,
                        int H, int HV, int n_cap, int pcap, float scale, int use_l2norm,
                        long long* __restrict__ timeline) {
  TFM_DYNAMIC_SMEM(float4, smem_f4);
  if (dynamic_smem_bytes() < (u32)g6_smem_words(n_cap, pcap) * 4u) __trap();
  const G6Smem sm = g6_carve(reinterpret_cast<float*>(smem_f4), n_cap, pcap);

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int v0 = blockIdx.x * G6_BV;
  const int h = blockIdx.y;
  const int r = blockIdx.z;
  const CtaTimeline tl = cta_timeline(timeline, G6_MARKS);
  tl.mark(0);
  const int bos = cu[r];
  const int n = cu[r + 1] - bos;
  if (n <= 0) return;  // the whole cluster: its CTAs share the request
  const int crank = cluster_start<G6_CLUSTER>();
  const int n16 = g6_round16(n);
  const int hv0 = h * GDN_GROUP;  // value heads hv0 .. hv0 + GROUP - 1
  const i64 slot = sidx64 ? reinterpret_cast<const i64*>(state_idx)[r] : (i64)reinterpret_cast<const int*>(state_idx)[r];

  // ---- phase 0: copies in flight together.
  constexpr int CPR = GDN_K / 8;  // 16-byte pieces per q/k row
  for (int c = tid; c < n16 * CPR; c += G6_THREADS) {
    const int row = c / CPR, col = (c % CPR) * 8;
    u16* dq = sm.qs + row * G6_KP + col;
    u16* dk = sm.ks + row * G6_KP + col;
    if (row < n) {
      const i64 src = ((i64)(bos + row) * H + h) * GDN_K + col;
      cp_async16(dq, q + src);
      cp_async16(dk, k + src);
    } else {  // rows past the tree's end: zeros, so the 16-row tiles read defined values
      uint4 z;
      z.x = 0u; z.y = 0u; z.z = 0u; z.w = 0u;
      *reinterpret_cast<uint4*>(dq) = z;
      *reinterpret_cast<uint4*>(dk) = z;
    }
  }
  for (int c = tid; c < n * GDN_GROUP * 2; c += G6_THREADS) {  // v: 16 columns = two 16-byte pieces per (node, head)
    const int i = c / (GDN_GROUP * 2), t = (c / 2) % GDN_GROUP, half = c % 2;
    cp_async16(sm.vs + (i * GDN_GROUP + t) * G6_BV + half * 8,
               v + ((i64)(bos + i) * HV + hv0 + t) * GDN_V + v0 + half * 8);
  }
  // the request's pair table (global node indices: readers subtract bos), g and beta of its nodes
  const int pbase = pair_off[bos];
  const int cnt = pair_off[bos + n] - pbase;
  for (int e = tid; e < cnt; e += G6_THREADS) cp_async4(sm.pj + e, pair_j + pbase + e);
  for (int c = tid; c < n * GDN_GROUP; c += G6_THREADS) {
    const int t = c / n, i = c % n;
    cp_async4(sm.gl + t * n_cap + i, g + (i64)(bos + i) * HV + hv0 + t);
    cp_async4(sm.bt + t * n_cap + i, beta + (i64)(bos + i) * HV + hv0 + t);
  }
  cp_async_commit();
  // S0 rows v0 .. v0 + 15 of each value head: whole rows per warp (coalesced), held in registers
  // until the end of phase 1 splits them (their DRAM latency overlaps the norms and the gram).
  constexpr int S0_F4 = GDN_GROUP * G6_BV * (GDN_K / 4);
  constexpr int S0_PER = (S0_F4 + G6_THREADS - 1) / G6_THREADS;
  float4 s0r[S0_PER];
#pragma unroll
  for (int u = 0; u < S0_PER; ++u) {
    const int idx = tid + u * G6_THREADS;
    if (idx < S0_F4) {
      int t, row, c4;
      g6_s0_piece(idx, t, row, c4);
      s0r[u] = (GDN_PROFILE_SKIP & 32) ? make_float4(0.f, 0.f, 0.f, 0.f)
                                         : *reinterpret_cast<const float4*>(state + slot * st_slot + (i64)(hv0 + t) * st_head +
                                                                            (i64)(v0 + row) * st_v + c4);
    }
  }
  // plan tables by local node (pairs, paths) and, G6_SOLVE 0, by level position (the level solve)
  for (int p = tid; p < n; p += G6_THREADS) {
    const int node = perm[bos + p] - bos;
    const int off = pair_off[bos + p] - pbase;
    const int d = pair_off[bos + p + 1] - pbase - off - 1;
    sm.dep_n[node] = d;
    sm.poff_n[node] = off;
    if (!G6_SOLVE) {
      sm.node_p[p] = node;
      sm.poff_p[p] = off;
      sm.dep_p[p] = d;
    }
  }
  if (!G6_SOLVE && tid == 0) sm.poff_p[n] = cnt;
  cp_async_wait<0>();
  __syncthreads();  // B1: rows and tables visible
  tl.mark(1);

  // ---- phase 1.
  for (int p = tid; p < (G6_SOLVE ? 0 : n); p += G6_THREADS) {  // first level position of each depth (phase 4, levels)
    if (p == 0 || sm.dep_p[p] != sm.dep_p[p - 1]) sm.lvl[sm.dep_p[p]] = p;
  }
  if (!G6_SOLVE && tid == 0) sm.lvl[sm.dep_p[n - 1] + 1] = n;
  // q norms: 4 lanes per node, K / 4 elements each
  for (int base = 0; base < n * 4; base += G6_THREADS) {  // warp-uniform bound (shuffles below)
    const int u = base + tid;
    const int i = u >> 2, part = u & 3;
    float sq = 0.f;
    if (i < n) {
      const u16* row = sm.qs + i * G6_KP + part * (GDN_K / 4);
#pragma unroll
      for (int c = 0; c < GDN_K / 4; c += 8) {  // 16-byte loads: 8 elements each
        const uint4 w = *reinterpret_cast<const uint4*>(row + c);
        const u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float lo = __uint_as_float(ws[e] << 16), hi = __uint_as_float(ws[e] & 0xffff0000u);
          sq = fmaf(lo, lo, sq);
          sq = fmaf(hi, hi, sq);
        }
      }
    }
    sq += __shfl_xor_sync(0xffffffffu, sq, 1);
    sq += __shfl_xor_sync(0xffffffffu, sq, 2);
    if (i < n && part == 0) sm.rq[i] = (use_l2norm ? l2norm_scale(sq) : 1.f) * scale;
  }
  // gram: 16 x 16 tiles (a, b), b <= a, of K K^T and Q K^T; a warp per tile, round robin (a warp per
  // row tile and two column tiles shared the row tile's ldmatrix but was slower: the triangle's
  // imbalance over the warps, section 31). With a cluster, this CTA's tiles are crank, crank + G6_CLUSTER, ...
  // and every kept product goes to all the cluster's CTAs.
#if G6_CLUSTER > 1
  cluster_wait();  // every CTA of the cluster has started
#endif
  {
    const int nb = n16 / 16;
    const int tiles = nb * (nb + 1) / 2;
    const int fg = lane >> 2, ft = lane & 3;
    for (int lt = warp; lt * G6_CLUSTER + crank < ((GDN_PROFILE_SKIP & 1) ? 0 : tiles); lt += G6_WARPS) {
      const int tile = lt * G6_CLUSTER + crank;
      int a = 0, b = tile;
      while (b > a) { b -= a + 1; ++a; }
      float ck[2][4], cq[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) { ck[j][e] = 0.f; cq[j][e] = 0.f; }
      const int arow = a * 16 + (lane & 15), acol = (lane >> 4) * 8;
      const int brow = b * 16 + (lane & 7) + ((lane >> 4) << 3), bcol = ((lane >> 3) & 1) * 8;
#pragma unroll 4
      for (int k0 = 0; k0 < ((GDN_PROFILE_SKIP & 128) ? 0 : GDN_K); k0 += 16) {
        u32 fk[4], fq[4], fb[4];
        ldsm_x4(fk, sm.ks + arow * G6_KP + k0 + acol);
        ldsm_x4(fq, sm.qs + arow * G6_KP + k0 + acol);
        ldsm_x4(fb, sm.ks + brow * G6_KP + k0 + bcol);
        mma_16816<true>(ck[0], fk, fb[0], fb[1]);
        mma_16816<true>(ck[1], fk, fb[2], fb[3]);
        mma_16816<true>(cq[0], fq, fb[0], fb[1]);
        mma_16816<true>(cq[1], fq, fb[2], fb[3]);
      }
      // keep the ancestor pairs: j is i's ancestor iff i's path entry at depth(j) is j. Branch-free
      // table loads at clamped indices (two rounds of 8 independent loads per lane), then the stores.
      {
        const int* __restrict__ dep_n = sm.dep_n;
        const int* __restrict__ poff_n = sm.poff_n;
        const int* __restrict__ pj = sm.pj;
        float* __restrict__ kk = sm.kk;
        float* __restrict__ qk = sm.qk;
        int ii[2], di[2], oi[2], dj[2][2];
#pragma unroll
        for (int h2 = 0; h2 < 2; ++h2) {
          ii[h2] = a * 16 + fg + 8 * h2;
          const int ic = ii[h2] < n ? ii[h2] : n - 1;
          di[h2] = dep_n[ic];
          oi[h2] = poff_n[ic];
        }
#pragma unroll
        for (int jt = 0; jt < 2; ++jt)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int j = b * 16 + jt * 8 + 2 * ft + c;
            dj[jt][c] = dep_n[j < n ? j : n - 1];
          }
        int dst[2][4];
#pragma unroll
        for (int jt = 0; jt < 2; ++jt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int h2 = e >> 1, c = e & 1;
            const int i = ii[h2], j = b * 16 + jt * 8 + 2 * ft + c;
            const int d = dj[jt][c] < di[h2] ? dj[jt][c] : di[h2];  // in i's pair range
            const int pjv = pj[oi[h2] + d];  // unconditional: a valid entry of (clamped) i
            const bool anc = (i < n) & (j <= i) & (dj[jt][c] <= di[h2]) & (pjv == bos + j);
            dst[jt][e] = anc ? oi[h2] + d : -1;
          }
#pragma unroll
        for (int cr = 0; cr < G6_CLUSTER; ++cr) {  // this CTA, or each CTA of the cluster
          float* __restrict__ kkd = g6_peer(kk, cr);
          float* __restrict__ qkd = g6_peer(qk, cr);
          float* __restrict__ rkd = g6_peer(sm.rk, cr);
#pragma unroll
          for (int jt = 0; jt < 2; ++jt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const bool keep = !(GDN_PROFILE_SKIP & 64) || ck[jt][e] == -1e-30f;
              if (keep && dst[jt][e] >= 0) {
                kkd[dst[jt][e]] = ck[jt][e];
                qkd[dst[jt][e]] = cq[jt][e];
              }
              const int i = ii[e >> 1];
              if (a == b && i < n && i == b * 16 + jt * 8 + 2 * ft + (e & 1)) rkd[i] = use_l2norm ? l2norm_scale(ck[jt][e]) : 1.f;
            }
        }
      }
    }
  }
#if G6_CLUSTER > 1
  cluster_arrive();  // this CTA's pair products and norm scales are in every CTA of the cluster
#endif
  // S0 parts to shared memory: [part][t][row][KP], part 0 = lo, 1 = mid, 2 = hi (between the cluster
  // barrier's arrival and its wait: work of this CTA alone)
  constexpr int PART = GDN_GROUP * G6_BV * G6_KP;
#pragma unroll
  for (int u = 0; u < S0_PER; ++u) {
    const int idx = tid + u * G6_THREADS;
    if (idx < S0_F4) {
      int t, row, c4;
      g6_s0_piece(idx, t, row, c4);
      const float xs[4] = {s0r[u].x, s0r[u].y, s0r[u].z, s0r[u].w};
      u16 hi[4], mid[4], lo[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) g6_split3(xs[c], hi[c], mid[c], lo[c]);
      const int off = (t * G6_BV + row) * G6_KP + c4;
      uint2 w;
      w.x = (u32)lo[0] | ((u32)lo[1] << 16); w.y = (u32)lo[2] | ((u32)lo[3] << 16);
      *reinterpret_cast<uint2*>(sm.s0 + off) = w;
      w.x = (u32)mid[0] | ((u32)mid[1] << 16); w.y = (u32)mid[2] | ((u32)mid[3] << 16);
      *reinterpret_cast<uint2*>(sm.s0 + PART + off) = w;
      w.x = (u32)hi[0] | ((u32)hi[1] << 16); w.y = (u32)hi[2] | ((u32)hi[3] << 16);
      *reinterpret_cast<uint2*>(sm.s0 + 2 * PART + off) = w;
    }
  }
#if G6_CLUSTER > 1
  cluster_wait();  // B2 over the cluster: all pair products and norm scales visible
#else
  __syncthreads();  // B2: pair products and norm scales visible
#endif
  tl.mark(2);

  // ---- phase 2: X, Y per value head; e^{G_i}.
  for (int c = tid; c < ((GDN_PROFILE_SKIP & 8) ? 0 : n * GDN_GROUP); c += G6_THREADS) {
    const int t = c / n, i = c % n;
    const int d = sm.dep_n[i], ob = sm.poff_n[i];
    const float bi = sm.bt[t * n_cap + i], rki = sm.rk[i], rqi = sm.rq[i];
    float* __restrict__ Xt = sm.X + t * g6_align4(pcap);
    float* __restrict__ Yt = sm.Y + t * g6_align4(pcap);
    // restrict: the loads below never read what this loop writes, so consecutive entries' loads can
    // be in flight together
    const int* __restrict__ pj = sm.pj;
    const float* __restrict__ rk = sm.rk;
    const float* __restrict__ kk = sm.kk;
    const float* __restrict__ qk = sm.qk;
    const float* __restrict__ gl = sm.gl + t * n_cap;
    const int* __restrict__ poff_n = sm.poff_n;
    int* __restrict__ pa = sm.pa;
    float seg = 0.f;  // sum of g strictly below the entry on the path: G_i - G_j, always <= 0
#pragma unroll 4
    for (int e = d; e >= 0; --e) {
      const int j = pj[ob + e] - bos;
      const float f = expf(seg), rkj = rk[j];
      Xt[ob + e] = e < d ? bi * f * (kk[ob + e] * rki * rkj) : 0.f;
      Yt[ob + e] = f * (qk[ob + e] * rqi * rkj);
#if G6_SOLVE
      if (t == 0) pa[ob + e] = poff_n[j];
#endif
      seg += gl[j];
    }
    sm.eg[t * n_cap + i] = expf(seg);  // seg = G_i
  }
  __syncthreads();  // B3: X, Y, e^G, S0 parts visible (the pair products' region is free now)
  tl.mark(3);

#if G6_SOLVE
  // ---- phase 2b: per (node i, value head t), row i of T = (I + X)^-1 and of W = Y (I + X)^-1 on i's
  // path, by back substitution from i's own entry (depth d) to the root's (depth 0):
  //   t_d = 1, w_d = Y_ii;  t_e = -sum_{f = e+1..d} t_f X_{P_f, e},  w_e = Y_{i,e} - sum_{f = e+1..d} w_f X_{P_f, e}
  // (P_f: i's ancestor at depth f; its pair entry e is the same node as i's entry e, and its entries
  // 0 .. f-1 are one contiguous row of X). Y's row i is read by this item only, so W overwrites it.
  // Items go to the warps that have no phase-3 item (at 128 nodes and GROUP = 3: 4 of 16 warps, which
  // then run alongside the projections instead of before them on 8 of their warps, bench/NOTES.md
  // sections 33-34), from the last thread down; when every warp has a phase-3 item, to all threads.
  {
    const int p3_items = ((n16 / 16 + 1) / 2) * GDN_GROUP;  // phase 3's work items, a warp each
    const int b2_threads = G6_THREADS - (p3_items < G6_WARPS ? p3_items * 32 : 0);
    const int c0 = G6_THREADS - 1 - tid;
    const int b2_end = (c0 < b2_threads && !(GDN_PROFILE_SKIP & (8 | 256))) ? n * GDN_GROUP : 0;
    for (int c = c0; c < b2_end; c += b2_threads) {
      const int t = c / n, i = c % n;
      const int d = sm.dep_n[i], ob = sm.poff_n[i];
      const float* __restrict__ Xt = sm.X + t * g6_align4(pcap);
      float* __restrict__ Wt = sm.Y + t * g6_align4(pcap);
      float* __restrict__ Tt = sm.T + t * g6_align4(pcap);
      if (d < G6_PATH_REG) {
        // Paths of up to G6_PATH_REG entries in registers, right-looking: once t_f and w_f are final
        // (f from the deepest up), subtract their share from every shallower entry. No load depends
        // on a computed value, so the X rows' loads are all independent of each other.
        int pf[G6_PATH_REG];
        float at[G6_PATH_REG], aw[G6_PATH_REG];
#pragma unroll
        for (int e = 0; e < G6_PATH_REG; ++e) {
          pf[e] = e <= d ? sm.pa[ob + e] : 0;
          aw[e] = e <= d ? Wt[ob + e] : 0.f;
          at[e] = 0.f;
        }
#pragma unroll
        for (int f = G6_PATH_REG - 1; f >= 1; --f) {
          if (f <= d) {
            const float tf = f == d ? 1.f : -at[f], wf = aw[f];
            const float* __restrict__ xrow = Xt + pf[f];
#pragma unroll
            for (int e = 0; e < f; ++e) {
              const float x = xrow[e];
              at[e] = fmaf(tf, x, at[e]);
              aw[e] = fmaf(-wf, x, aw[e]);
            }
          }
        }
#pragma unroll
        for (int e = 0; e < G6_PATH_REG; ++e) {
          if (e <= d) {
            Tt[ob + e] = e == d ? 1.f : -at[e];
            Wt[ob + e] = aw[e];
          }
        }
      } else {  // deeper paths (the level solve's trees, forced by -DG6_SOLVE=1): left-looking, in shared memory
        Tt[ob + d] = 1.f;
        for (int e = d - 1; e >= 0; --e) {
          float st = 0.f, sw = 0.f;
          for (int f = e + 1; f <= d; ++f) {
            const float x = Xt[sm.pa[ob + f] + e];
            st = fmaf(Tt[ob + f], x, st);
            sw = fmaf(Wt[ob + f], x, sw);
          }
          Tt[ob + e] = -st;
          Wt[ob + e] -= sw;
        }
      }
    }
  }
#endif

  // ---- phase 3: projections. Work item = (two 16-row tiles, value head t): both tiles' q and k
  // rows against the head's 16 S0 rows, eight m16n8 accumulators. Per k-step of 16: four ldmatrix of
  // q/k tiles and three of the S0 parts (lo, mid, hi: small terms first, per accumulator) feed 24 mma
  // (shared-memory traffic per mma a third of one tile per item; the ldmatrix bandwidth, 512 bytes
  // per x4 at 128 bytes per clock, bounds this phase, section 31).
  {
    const int nb = n16 / 16;
    const int items = ((nb + 1) / 2) * GDN_GROUP;
    const int fg = lane >> 2, ft = lane & 3;
    for (int it = warp; it < items; it += G6_WARPS) {
      const int t = it % GDN_GROUP, a0 = (it / GDN_GROUP) * 2;
      const bool two = a0 + 1 < nb;  // warp-uniform: the pair's second tile exists
      float acc[2][2][2][4];  // [tile][q, k][n8][element]
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int jb = 0; jb < 2; ++jb)
#pragma unroll
          for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[r][jb][j][e] = 0.f;
      const int acol = (lane >> 4) * 8;
      const int brow = t * G6_BV + (lane & 7) + ((lane >> 4) << 3), bcol = ((lane >> 3) & 1) * 8;
#pragma unroll 1
      for (int k0 = 0; k0 < ((GDN_PROFILE_SKIP & 2) ? 0 : GDN_K); k0 += 16) {
        u32 fa[2][2][4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if (r == 0 || two) {
            const int arow = (a0 + r) * 16 + (lane & 15);
            ldsm_x4(fa[r][0], sm.qs + arow * G6_KP + k0 + acol);
            ldsm_x4(fa[r][1], sm.ks + arow * G6_KP + k0 + acol);
          }
        }
#pragma unroll
        for (int part = 3 - GDN_S0_PARTS; part < 3; ++part) {
          u32 fb[4];
          ldsm_x4(fb, sm.s0 + part * PART + brow * G6_KP + k0 + bcol);
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            if (r == 0 || two) {
#pragma unroll
              for (int jb = 0; jb < 2; ++jb) {
                mma_16816<true>(acc[r][jb][0], fa[r][jb], fb[0], fb[1]);
                mma_16816<true>(acc[r][jb][1], fa[r][jb], fb[2], fb[3]);
              }
            }
          }
        }
      }
      // R = beta (v - e^G rk K S0^T) and e^G rq Q S0^T; element e of tile j: row fg (+8), column 8 j + 2 ft + (e & 1)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int i = (a0 + r) * 16 + fg + 8 * half;
          if ((r == 0 || two) && i < n) {
            const float eg = sm.eg[t * n_cap + i], bt = sm.bt[t * n_cap + i], rki = sm.rk[i], rqi = sm.rq[i];
            float* __restrict__ drow = sm.D + t * g6_head_stride(n16) + i * G6_DS;
            float* __restrict__ orow = sm.O + t * g6_head_stride(n16) + i * G6_DS;
#pragma unroll
            for (int j = 0; j < 2; ++j)
#pragma unroll
              for (int c = 0; c < 2; ++c) {
                const int col = j * 8 + 2 * ft + c;
                const float vv = bf16_bits_to_f32(sm.vs[(i * GDN_GROUP + t) * G6_BV + col]);
                drow[col] = bt * (vv - eg * (rki * acc[r][1][j][2 * half + c]));
                orow[col] = eg * (rqi * acc[r][0][j][2 * half + c]);
              }
          }
        }
      }
    }
  }
  __syncthreads();  // B4: R and the Q projections visible
  tl.mark(4);

  // ---- phase 4: a unit per (row, value head ut, 4 columns uq), RPAR rows in flight.
  constexpr int UPR = GDN_GROUP * (G6_BV / 4);  // units per row
  constexpr int RPAR = G6_THREADS / UPR;        // rows in flight
  const int rsub = tid / UPR, ut = (tid / (G6_BV / 4)) % GDN_GROUP, uq = tid % (G6_BV / 4);
  const float* __restrict__ Ot = sm.O + ut * g6_head_stride(n16) + uq * 4;
#if G6_SOLVE
  // Path solve: outputs as gathers over each node's path (T, W rows from phase 2b, R rows from phase
  // 3), every row in flight, no barrier.
  if (!(GDN_PROFILE_SKIP & 4) && rsub < RPAR) {
    const float* __restrict__ Tt = sm.T + ut * g6_align4(pcap);
    const float* __restrict__ Wt = sm.Y + ut * g6_align4(pcap);
    const float* __restrict__ Dt = sm.D + ut * g6_head_stride(n16) + uq * 4;
    for (int i = rsub; i < n; i += RPAR) {
      const int d = sm.dep_n[i], ob = sm.poff_n[i];
      float4 dl = make_float4(0.f, 0.f, 0.f, 0.f), ao = *reinterpret_cast<const float4*>(Ot + i * G6_DS);
#pragma unroll 4
      for (int e = 0; e <= d; ++e) {
        const int j = sm.pj[ob + e] - bos;
        const float tv = Tt[ob + e], wv = Wt[ob + e];
        const float4 rj = *reinterpret_cast<const float4*>(Dt + j * G6_DS);
        dl.x = fmaf(tv, rj.x, dl.x); dl.y = fmaf(tv, rj.y, dl.y); dl.z = fmaf(tv, rj.z, dl.z); dl.w = fmaf(tv, rj.w, dl.w);
        ao.x = fmaf(wv, rj.x, ao.x); ao.y = fmaf(wv, rj.y, ao.y); ao.z = fmaf(wv, rj.z, ao.z); ao.w = fmaf(wv, rj.w, ao.w);
      }
      g6_store_row(o, delta_out, ((i64)(bos + i) * HV + hv0 + ut) * GDN_V + v0 + uq * 4, ao, dl);
    }
  }
#else
  // Level solve: forward substitution level by level, one CTA barrier per level.
  const float* __restrict__ Xt = sm.X + ut * g6_align4(pcap);
  const float* __restrict__ Yt = sm.Y + ut * g6_align4(pcap);
  float* __restrict__ Dt = sm.D + ut * g6_head_stride(n16) + uq * 4;
  int s = 0;
  while (!(GDN_PROFILE_SKIP & 4) && s < n) {
    const int d = sm.dep_p[s];
    const int e_end = sm.lvl[d + 1];
    if (rsub < RPAR) {
      for (int pp = s + rsub; pp < e_end; pp += RPAR) {
        const int i = sm.node_p[pp];
        const int ob = sm.poff_p[pp];
        float4 ax = make_float4(0.f, 0.f, 0.f, 0.f), ay = ax;
#pragma unroll 4
        for (int e = 0; e < d; ++e) {
          const int j = sm.pj[ob + e] - bos;
          const float xv = Xt[ob + e], yv = Yt[ob + e];
          const float4 dj = *reinterpret_cast<const float4*>(Dt + j * G6_DS);
          ax.x = fmaf(xv, dj.x, ax.x); ax.y = fmaf(xv, dj.y, ax.y); ax.z = fmaf(xv, dj.z, ax.z); ax.w = fmaf(xv, dj.w, ax.w);
          ay.x = fmaf(yv, dj.x, ay.x); ay.y = fmaf(yv, dj.y, ay.y); ay.z = fmaf(yv, dj.z, ay.z); ay.w = fmaf(yv, dj.w, ay.w);
        }
        const float yself = Yt[ob + d];
        const float4 ri = *reinterpret_cast<const float4*>(Dt + i * G6_DS);
        const float4 oi = *reinterpret_cast<const float4*>(Ot + i * G6_DS);
        float4 dl;
        dl.x = ri.x - ax.x; dl.y = ri.y - ax.y; dl.z = ri.z - ax.z; dl.w = ri.w - ax.w;
        *reinterpret_cast<float4*>(Dt + i * G6_DS) = dl;
        const float4 out = make_float4(oi.x + ay.x + yself * dl.x, oi.y + ay.y + yself * dl.y,
                                       oi.z + ay.z + yself * dl.z, oi.w + ay.w + yself * dl.w);
        g6_store_row(o, delta_out, ((i64)(bos + i) * HV + hv0 + ut) * GDN_V + v0 + uq * 4, out, dl);
      }
    }
    __syncthreads();
    s = e_end;
  }
#endif
  if (timeline != nullptr) {  // uniform: the end of the CTA's last warp
    __syncthreads();
    tl.mark(5);
  }
}
