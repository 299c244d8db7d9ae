// Gated DeltaNet verify over a token tree (DESIGN.md section 4), float32 math.
//
// For one request with n nodes in topological order, committed state S0 ([V, K], V-first as in
// vLLM), path gate G = M g (M = ancestor-or-self mask) and L2-normalised qhat, khat:
//   X_ij = beta_i e^{G_i - G_j} khat_i . khat_j        j a strict ancestor of i
//   Y_ij = e^{G_i - G_j} qhat_i . khat_j               j an ancestor of i or i itself
//   (I + X) Delta = diag(beta) (V - diag(e^G) K S0^T)   forward substitution over the tree
//   O = diag(e^G) Q S0^T + Y Delta                       no state is written
// (The algebra is the chunked delta rule of Yang et al., "Gated Delta Networks", ICLR 2025,
// restricted to ancestor pairs; the tree form and its proof are in DESIGN.md.)
//
// Two kernels, launched back to back by vllm_tfm/kernels/gdn.py:
//   gdn_tree_pairs        one warp per (node, q/k head): norms, path gates, X and Y for every
//                         (node, ancestor) pair, for each value head of the q/k head's group.
//   gdn_tree_verify_main  one CTA per (request, value head, BV columns of V): S0 rows to shared
//                         memory, projections K S0^T and Q S0^T for all nodes (fp32 FMA; version 3:
//                         tf32 tensor cores with the 3xTF32 split), then the level-by-level forward
//                         substitution and the outputs.
// The tree arrives as a host-built plan (vllm_tfm/kernels/plan.py): nodes in level order
// (request, depth, index) and, per node, its root..node path (`pair_j`, root first) at `pair_off`.
//
// Compile-time constants (NVRTC -D): TFM_IN (q/k/v/o element type), GDN_K, GDN_V, GDN_BV.
#include "tfm_common.cuh"

#ifndef GDN_K
#define GDN_K 128
#endif
#ifndef GDN_V
#define GDN_V 128
#endif
#ifndef GDN_BV
#define GDN_BV 32
#endif
// Version of the kernels (bench/NOTES.md): 1 = as first measured; 2 = fewer serial latencies
// (path indices preloaded per warp, prefetched q/k chunks, first pair window and first q/k chunk
// loaded together with S0, projection rows past the tree's end skipped); 3 = version 2 with the
// projections K S0^T and Q S0^T on tensor cores (mma.sync m16n8k8 tf32, 3xTF32 split for float32
// accuracy; 16-bit q/k are exact in tf32, so their products need only the split of S0: 2 mma);
// 4 = version 3 with, for 16-bit q/k, each projection tile's q and k rows staged whole (all K
// columns, as loaded, by cp.async) instead of in K chunks of 32 through registers: one global
// latency and two barriers per tile of 64 nodes instead of four and eight (float32 q/k: version 3);
// 5 = version 3 launched with programmatic dependent launch: the pairs kernel lets the main kernel
// start at once, and the main kernel waits for the pairs kernel's outputs (X, Y, G, norm scales)
// only after its first projection tile, so its prologue and projections overlap the pairs kernel.
#ifndef GDN_VARIANT
#define GDN_VARIANT 2
#endif
#if GDN_VARIANT >= 3
#include "tfm_mma.cuh"
#endif
// Version 4's whole-tile staging (16-bit q/k only).
#define GDN_TILE16 (GDN_VARIANT == 4 && TFM_IN != 0)
#define GDN_PDL (GDN_VARIANT >= 5)
// Timing only (bench/gdn_phases.py): leave phases of the main kernel out, so that differences of
// timings say what a phase costs (the outputs are then wrong). Bits: 1 = the projections' mma
// (versions 3 and 4; staging, loads and barriers kept); 2 = version 3's whole K-chunk loop (no q/k
// staging, loads or barriers; accumulators stay zero); 4 = the forward substitution and the output
// writes. 0, the default, is the kernel.
#ifndef GDN_PROFILE_SKIP
#define GDN_PROFILE_SKIP 0
#endif

#define GDN_THREADS 256
#if GDN_VARIANT >= 2
// Explicit register budgets (blocks per SM): without a minimum ptxas spilled v2 at 48-80
// registers; with a minimum of 1 it took up to 252 (one CTA per SM). Main: 3 CTAs (<= 80 regs)
// up to BV = 32 and 2 (<= 128) at BV = 64, as v1 had (2 for float32 inputs, whose prefetch
// registers spilled at 80); pairs: 2 (<= 128).
#define GDN_PAIRS_BOUNDS __launch_bounds__(GDN_THREADS, 2)
#define GDN_MAIN_BOUNDS __launch_bounds__(GDN_THREADS, (GDN_BV <= 32 && TFM_IN != 0 ? 3 : 2))
#else
#define GDN_PAIRS_BOUNDS __launch_bounds__(GDN_THREADS)
#define GDN_MAIN_BOUNDS __launch_bounds__(GDN_THREADS)
#endif
#define GDN_RT 64     // node rows per projection tile
#define GDN_KC 32     // K columns per staged chunk
#define GDN_PAIRS_WARPS 8

static_assert(GDN_K % 32 == 0, "K must be a multiple of 32");
static_assert(GDN_V % GDN_BV == 0, "BV must divide V");
static_assert(GDN_BV % 4 == 0 && GDN_BV >= 16 && GDN_BV <= 128, "BV must be 16, 32, 64 or 128");
static_assert(GDN_RT * GDN_KC / 8 == GDN_THREADS, "staging assumes one 8-element chunk per thread");

// Programmatic dependent launch (version 5; tfm_common.cuh's pdl_launch_dependents / pdl_wait):
// the pairs kernel lets the main kernel start before it ends; the main kernel waits where it reads
// the pairs kernel's outputs. Other versions launch without it and compile neither instruction.
__device__ __forceinline__ void gdn_launch_dependents() {
#if GDN_PDL
  pdl_launch_dependents();
#endif
}
__device__ __forceinline__ void gdn_wait_prerequisites() {
#if GDN_PDL
  pdl_wait();
#endif
}

// q/k row of one head -> registers, K/32 elements per lane (coalesced across the warp).
__device__ __forceinline__ void load_row_lanes(const tin* __restrict__ row, int lane, float* out) {
#if GDN_K % 128 == 0
#pragma unroll
  for (int c = 0; c < GDN_K / 128; ++c) load4(row + c * 128 + lane * 4, out + c * 4);
#else
#pragma unroll
  for (int c = 0; c < GDN_K / 32; ++c) out[c] = to_f32(row[c * 32 + lane]);
#endif
}

// ---------------------------------------------------------------------------------------------
// Kernel 1: pair coefficients. grid (ceil(T / 8), H), block 256; warp w of block b handles the
// node at level-order position p = 8 b + w for q/k head h = blockIdx.y.
// Outputs: X, Y [HV][P] (P = total path entries of the plan), Gcum [T][HV] (G_i), rk, rq [H][T]
// (norm scales: khat = rk k, qhat = rq q, scale included in rq).
extern "C" __global__ void GDN_PAIRS_BOUNDS
gdn_tree_pairs(const tin* __restrict__ q, const tin* __restrict__ k,
               const float* __restrict__ g, const float* __restrict__ beta,
               const int* __restrict__ perm, const int* __restrict__ pair_off,
               const int* __restrict__ pair_j, const int* __restrict__ depth,
               float* __restrict__ X, float* __restrict__ Y, float* __restrict__ Gcum,
               float* __restrict__ rk_out, float* __restrict__ rq_out,
               int T, int H, int HV, i64 P, float scale, int use_l2norm) {
  gdn_launch_dependents();  // version 5: the main kernel may start now (it waits where it reads our outputs)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int p = blockIdx.x * GDN_PAIRS_WARPS + warp;
  const int h = blockIdx.y;
  if (p >= T) return;  // warp-uniform
  const int group = HV / H;  // value heads sharing q/k head h: hv = h * group + t, t < group <= 32
  const int i = perm[p];
  const i64 off = pair_off[p];
#if GDN_VARIANT >= 2
  const int d = (int)(pair_off[p + 1] - off) - 1;  // path length - 1: no load chained behind perm
#else
  const int d = depth[i];
#endif

  constexpr int EPL = GDN_K / 32;
  float qi[EPL], ki[EPL];
  load_row_lanes(q + ((i64)i * H + h) * GDN_K, lane, qi);
  load_row_lanes(k + ((i64)i * H + h) * GDN_K, lane, ki);
  float sq = 0.f, sk = 0.f;
#pragma unroll
  for (int e = 0; e < EPL; ++e) {
    sq = fmaf(qi[e], qi[e], sq);
    sk = fmaf(ki[e], ki[e], sk);
  }
  sq = warp_sum(sq);
  sk = warp_sum(sk);
  const float rki = use_l2norm ? l2norm_scale(sk) : 1.f;
  const float rqi = (use_l2norm ? l2norm_scale(sq) : 1.f) * scale;
  if (lane == 0) {
    rk_out[(i64)h * T + i] = rki;
    rq_out[(i64)h * T + i] = rqi;
  }

  const bool owns_head = lane < group;
  const int hv = h * group + (owns_head ? lane : 0);
  const float bi = owns_head ? beta[(i64)i * HV + hv] : 0.f;
  float* __restrict__ Xh = X + (i64)hv * P + off;
  float* __restrict__ Yh = Y + (i64)hv * P + off;
  // Walk the path deepest first: seg = G_i - G_j is then a running sum of the g of the nodes
  // strictly below j on the path (no cancellation; always <= 0, so exp never overflows).
  float seg = 0.f;
#if GDN_VARIANT >= 2
  // The first 32 path entries in one coalesced load (lane e holds entry e), so that the k-row
  // loads of an iteration do not wait behind a dependent pair_j load.
  const int pj_lane = lane <= d ? pair_j[off + lane] : i;
  constexpr int UNR = 8;
#else
  constexpr int UNR = 4;
#endif
  for (int e0 = d; e0 >= 0; e0 -= UNR) {
    int js[UNR];
    float kj[UNR][EPL], gj[UNR];
#pragma unroll
    for (int u = 0; u < UNR; ++u) {
      const int e = e0 - u;
#if GDN_VARIANT >= 2
      const int sj = __shfl_sync(0xffffffffu, pj_lane, e & 31);  // e is warp-uniform
      js[u] = e < 0 ? i : (e < 32 ? sj : pair_j[off + e]);
#else
      js[u] = e >= 0 ? pair_j[off + e] : i;
#endif
      load_row_lanes(k + ((i64)js[u] * H + h) * GDN_K, lane, kj[u]);
      gj[u] = (e >= 0 && owns_head) ? g[(i64)js[u] * HV + hv] : 0.f;
    }
    float dkk[UNR], dqk[UNR], dss[UNR];
#pragma unroll
    for (int u = 0; u < UNR; ++u) {
      dkk[u] = 0.f; dqk[u] = 0.f; dss[u] = 0.f;
#pragma unroll
      for (int c = 0; c < EPL; ++c) {
        dkk[u] = fmaf(ki[c], kj[u][c], dkk[u]);
        dqk[u] = fmaf(qi[c], kj[u][c], dqk[u]);
        dss[u] = fmaf(kj[u][c], kj[u][c], dss[u]);
      }
    }
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) {
#pragma unroll
      for (int u = 0; u < UNR; ++u) {
        dkk[u] += __shfl_xor_sync(0xffffffffu, dkk[u], m);
        dqk[u] += __shfl_xor_sync(0xffffffffu, dqk[u], m);
        dss[u] += __shfl_xor_sync(0xffffffffu, dss[u], m);
      }
    }
#pragma unroll
    for (int u = 0; u < UNR; ++u) {
      const int e = e0 - u;
      if (e >= 0 && owns_head) {
        const float rkj = use_l2norm ? l2norm_scale(dss[u]) : 1.f;
        const float f = expf(seg);
        Xh[e] = e < d ? bi * f * (dkk[u] * rki * rkj) : 0.f;
        Yh[e] = f * (dqk[u] * rqi * rkj);
        seg += gj[u];
      }
    }
  }
  if (owns_head) Gcum[(i64)i * HV + hv] = seg;  // seg = sum of g over the whole path = G_i
}

// ---------------------------------------------------------------------------------------------
// Kernel 2: projections, forward substitution, outputs.
// grid (V / BV, HV, R), block 256, dynamic shared memory = gdn_verify_smem_words(n_cap, pcap) * 4
// (vllm_tfm/kernels/gdn.py computes the same number; the kernel traps if it got less).

__host__ __device__ constexpr int align4(int x) { return (x + 3) & ~3; }

// Words of one staged q (or k) buffer: a K chunk of the tile's rows as float32 [RT][KC+4], or
// (version 4, 16-bit q/k) the tile's whole rows as loaded [RT][K+8] (16-byte aligned rows, and
// fragment reads of 8 consecutive rows land in 8 distinct bank quads).
__host__ __device__ constexpr int gdn_stage_words() {
#if GDN_TILE16
  return align4(GDN_RT * (GDN_K + 8) / 2);
#else
  return align4(GDN_RT * (GDN_KC + 4));
#endif
}

// Eight consecutive q/k elements kept as loaded (16 or 32 bytes), converted only when stored to
// shared memory: a prefetch into these registers does not stall on a conversion.
#if TFM_IN == 0
struct Raw8 { float4 a, b; };
__device__ __forceinline__ void raw8_load(const float* __restrict__ p, Raw8& r) {
  r.a = *reinterpret_cast<const float4*>(p);
  r.b = *reinterpret_cast<const float4*>(p + 4);
}
__device__ __forceinline__ void raw8_zero(Raw8& r) { r.a = make_float4(0.f, 0.f, 0.f, 0.f); r.b = r.a; }
__device__ __forceinline__ void raw8_store(const Raw8& r, float* dst) {
  *reinterpret_cast<float4*>(dst) = r.a;
  *reinterpret_cast<float4*>(dst + 4) = r.b;
}
#else
struct Raw8 { uint4 u; };
__device__ __forceinline__ void raw8_load(const tin* __restrict__ p, Raw8& r) { r.u = *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ void raw8_zero(Raw8& r) { r.u.x = 0u; r.u.y = 0u; r.u.z = 0u; r.u.w = 0u; }
#if TFM_IN == 1
__device__ __forceinline__ float raw_lo(u32 w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float raw_hi(u32 w) { return __uint_as_float(w & 0xffff0000u); }
#else
__device__ __forceinline__ float raw_lo(u32 w) { return f16_bits_to_f32(w & 0xffffu); }
__device__ __forceinline__ float raw_hi(u32 w) { return f16_bits_to_f32(w >> 16); }
#endif
__device__ __forceinline__ void raw8_store(const Raw8& r, float* dst) {
  *reinterpret_cast<float4*>(dst) = make_float4(raw_lo(r.u.x), raw_hi(r.u.x), raw_lo(r.u.y), raw_hi(r.u.y));
  *reinterpret_cast<float4*>(dst + 4) = make_float4(raw_lo(r.u.z), raw_hi(r.u.z), raw_lo(r.u.w), raw_hi(r.u.w));
}
#endif

struct VerifySmem {
  float *S, *D, *O, *stq, *stk, *px, *py, *eg, *bt, *rk, *rq;
  int *pj, *poff, *dep, *node, *lvl;
};

__device__ __host__ inline int gdn_verify_smem_words(int n_cap, int pcap) {
  return align4(GDN_BV * (GDN_K + 4)) + 2 * align4(n_cap * GDN_BV) +
         2 * gdn_stage_words() + 3 * align4(pcap) + 4 * align4(n_cap) +
         align4(n_cap + 1) + 2 * align4(n_cap) + align4(n_cap + 2);
}

__device__ inline VerifySmem carve_verify_smem(float* base, int n_cap, int pcap) {
  VerifySmem s;
  float* p = base;
  s.S = p;   p += align4(GDN_BV * (GDN_K + 4));   // S0 rows [BV][K+4]
  s.D = p;   p += align4(n_cap * GDN_BV);         // U, then Delta [n][BV]
  s.O = p;   p += align4(n_cap * GDN_BV);         // e^G rq Q S0^T [n][BV]
  s.stq = p; p += gdn_stage_words();  // staged q [RT][KC+4] float32 (version 4, 16-bit: [RT][K+8] as loaded)
  s.stk = p; p += gdn_stage_words();  // staged k, likewise
  s.px = p;  p += align4(pcap);                   // X of the staged pair window
  s.py = p;  p += align4(pcap);                   // Y of the staged pair window
  s.pj = reinterpret_cast<int*>(p); p += align4(pcap);  // local ancestor index of each pair
  s.eg = p;  p += align4(n_cap);                  // e^{G_i} by local node
  s.bt = p;  p += align4(n_cap);                  // beta_i
  s.rk = p;  p += align4(n_cap);                  // k norm scale
  s.rq = p;  p += align4(n_cap);                  // q norm scale (times `scale`)
  s.poff = reinterpret_cast<int*>(p); p += align4(n_cap + 1);  // pair offsets by level position
  s.dep = reinterpret_cast<int*>(p);  p += align4(n_cap);      // depth by level position
  s.node = reinterpret_cast<int*>(p); p += align4(n_cap);      // local node by level position
  s.lvl = reinterpret_cast<int*>(p);  p += align4(n_cap + 2);  // first position of each depth
  return s;
}

#if GDN_VARIANT >= 3
// One k-step of 8 of both projections for a warp's 16 rows (versions 3 and 4): B = S0^T fragments
// from the S0 rows in shared memory (column kcol + ft of row ncol0 + 8 j + g), split into tf32
// hi + lo; A = the q / k fragments (ql / kl, float32 inputs only: A's small terms, first).
template <int NT>
__device__ __forceinline__ void project_k8(const float* __restrict__ S, int kcol, int ncol0, int fg, int ft,
                                           const u32 (&qh)[4], const u32 (&ql)[4], const u32 (&kh)[4],
                                           const u32 (&kl)[4], float (&aq)[NT][4], float (&ak)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const float* __restrict__ fb = S + (ncol0 + j * 8 + fg) * (GDN_K + 4) + kcol + ft;
    u32 bh0, bl0, bh1, bl1;
    split_tf32(fb[0], bh0, bl0);
    split_tf32(fb[4], bh1, bl1);
#if TFM_IN == 0
    mma_1688_tf32(aq[j], ql, bh0, bh1);
    mma_1688_tf32(ak[j], kl, bh0, bh1);
#endif
    mma_1688_tf32(aq[j], qh, bl0, bl1);
    mma_1688_tf32(ak[j], kh, bl0, bl1);
    mma_1688_tf32(aq[j], qh, bh0, bh1);
    mma_1688_tf32(ak[j], kh, bh0, bh1);
  }
}
#endif

extern "C" __global__ void GDN_MAIN_BOUNDS
gdn_tree_verify_main(const tin* __restrict__ q, const tin* __restrict__ k,
                     const tin* __restrict__ v, const float* __restrict__ beta,
                     const float* __restrict__ Gcum, const float* __restrict__ rk_in,
                     const float* __restrict__ rq_in, const float* __restrict__ X,
                     const float* __restrict__ Y, const int* __restrict__ perm,
                     const int* __restrict__ pair_off, const int* __restrict__ pair_j,
                     const int* __restrict__ depth, const int* __restrict__ cu,
                     const float* __restrict__ state, const void* __restrict__ state_idx, int sidx64,
                     i64 st_slot, i64 st_head, i64 st_v, tin* __restrict__ o,
                     float* __restrict__ delta_out, int T, int H, int HV, i64 P, int n_cap,
                     int pcap) {
  TFM_DYNAMIC_SMEM(float4, smem_f4);
  if (dynamic_smem_bytes() < (u32)gdn_verify_smem_words(n_cap, pcap) * 4u) __trap();
  const VerifySmem sm = carve_verify_smem(reinterpret_cast<float*>(smem_f4), n_cap, pcap);

  const int tid = threadIdx.x;
  const int v0 = blockIdx.x * GDN_BV;
  const int hv = blockIdx.y;
  const int r = blockIdx.z;
  const int bos = cu[r];
  const int n = cu[r + 1] - bos;
  if (n <= 0) return;
  const int h = hv / (HV / H);
  // state_indices as the caller gave them: int64 (sidx64 = 1) or int32
  const i64 slot = sidx64 ? reinterpret_cast<const i64*>(state_idx)[r] : (i64)reinterpret_cast<const int*>(state_idx)[r];
#if !GDN_TILE16
  const int st_row = tid / (GDN_KC / 8), st_col = (tid % (GDN_KC / 8)) * 8;  // q/k staging: row, column
#endif
  const float* __restrict__ Xh = X + (i64)hv * P;
  const float* __restrict__ Yh = Y + (i64)hv * P;
#if GDN_TILE16
  // Version 4: the whole first tile's q and k rows (16-byte cp.async pieces straight into shared
  // memory, rows past the tree's end zeroed), in flight together with S0's loads.
  u16* __restrict__ sq16 = reinterpret_cast<u16*>(sm.stq);
  u16* __restrict__ sk16 = reinterpret_cast<u16*>(sm.stk);
  constexpr int SROW = GDN_K + 8;       // u16 per staged row
  constexpr int CPR = GDN_K / 8;        // 16-byte pieces per row
  static_assert((GDN_RT * CPR) % GDN_THREADS == 0, "whole-tile staging: pieces per thread");
  auto stage_tile = [&](int t0) {
#pragma unroll
    for (int c = tid; c < GDN_RT * CPR; c += GDN_THREADS) {
      const int row = c / CPR, col = (c % CPR) * 8;
      u16* dq = sq16 + row * SROW + col;
      u16* dk = sk16 + row * SROW + col;
      if (t0 + row < n) {
        const i64 src = ((i64)(bos + t0 + row) * H + h) * GDN_K + col;
        cp_async16(dq, q + src);
        cp_async16(dk, k + src);
      } else {
        uint4 z;
        z.x = 0u; z.y = 0u; z.z = 0u; z.w = 0u;
        *reinterpret_cast<uint4*>(dq) = z;
        *reinterpret_cast<uint4*>(dk) = z;
      }
    }
    cp_async_commit();
  };
  stage_tile(0);
#endif
#if GDN_VARIANT >= 2
  // Loads with no dependence on each other go out together with S0's: the first q/k chunk of
  // the first projection tile, and the first pair window when the request's pairs fit one.
#if !GDN_TILE16
  Raw8 pq, pk;
  if (st_row < n) {
    const i64 row = ((i64)(bos + st_row) * H + h) * GDN_K + st_col;
    raw8_load(q + row, pq);
    raw8_load(k + row, pk);
  } else {
    raw8_zero(pq);
    raw8_zero(pk);
  }
#endif
  const int pbase = pair_off[bos];
  const bool one_window = pair_off[bos + n] - pbase <= pcap;
  if (one_window) {
    const int cnt0 = pair_off[bos + n] - pbase;
    for (int e = tid; e < cnt0; e += GDN_THREADS) {
      sm.pj[e] = pair_j[pbase + e] - bos;
#if !GDN_PDL  // version 5: X and Y are the pairs kernel's, read after the wait below
      sm.px[e] = Xh[pbase + e];
      sm.py[e] = Yh[pbase + e];
#endif
    }
  }
#endif

  // ---- S0 rows [v0, v0 + BV) -> shared, 16-byte loads along K.
  const float* __restrict__ S0 = state + slot * st_slot + (i64)hv * st_head + (i64)v0 * st_v;
  for (int idx = tid; idx < GDN_BV * (GDN_K / 4); idx += GDN_THREADS) {
    const int row = idx / (GDN_K / 4), c4 = (idx % (GDN_K / 4)) * 4;
    const float4 val = *reinterpret_cast<const float4*>(S0 + (i64)row * st_v + c4);
    *reinterpret_cast<float4*>(sm.S + row * (GDN_K + 4) + c4) = val;
  }
  // ---- per-node scalars (local node index) and level-order tables (local position).
  for (int i = tid; i < n; i += GDN_THREADS) {
    const i64 gi = (i64)(bos + i);
#if !GDN_PDL  // version 5: G and the norm scales are the pairs kernel's, read after the wait below
    sm.eg[i] = expf(Gcum[gi * HV + hv]);
#endif
    sm.bt[i] = beta[gi * HV + hv];
#if !GDN_PDL
    sm.rk[i] = rk_in[(i64)h * T + gi];
    sm.rq[i] = rq_in[(i64)h * T + gi];
#endif
    const int node = perm[bos + i];
    sm.node[i] = node - bos;
#if GDN_VARIANT >= 2
    sm.dep[i] = pair_off[bos + i + 1] - pair_off[bos + i] - 1;  // depth without the perm -> depth chain
#else
    sm.dep[i] = depth[node];
#endif
    sm.poff[i] = pair_off[bos + i];
  }
  if (tid == 0) sm.poff[n] = pair_off[bos + n];
  __syncthreads();
  for (int p = tid; p < n; p += GDN_THREADS) {
    if (p == 0 || sm.dep[p] != sm.dep[p - 1]) sm.lvl[sm.dep[p]] = p;
  }
  if (tid == 0) sm.lvl[sm.dep[n - 1] + 1] = n;
  // (the barrier at the top of the projection loop orders these writes before their use)

#if GDN_VARIANT >= 3
  // ---- projections on tensor cores: warp w computes rows [16 (w % 4), +16) of the tile of 64 nodes
  // and columns [BV/2 (w / 4), +BV/2) of both K S0^T and Q S0^T as BV/16 m16n8 tiles
  // (A = staged q/k rows, B = S0^T: B[k][v] = S[v][k], i.e. the "col" operand straight from the
  // S0 rows). Float32 q/k: A_lo B_hi + A_hi B_lo + A_hi B_hi; 16-bit q/k (exact in tf32, A_lo = 0):
  // A B_lo + A B_hi. Fragment reads from the padded rows (stride KC + 4 and K + 4 words; version 4:
  // K + 8 16-bit values) hit distinct banks. Version 3 stages K chunks of 32 through registers
  // (two barriers and one global latency each); version 4 waits once per tile for the whole rows
  // that cp.async brought, and issues the next tile's copies as soon as every warp is done with
  // this one (they fly during the epilogue). Both issue the same mma in the same order.
  constexpr int NT = GDN_BV / 16;
  const int warp = tid >> 5, lane = tid & 31, fg = lane >> 2, ft = lane & 3;
  const int mrow = (warp & 3) * 16, ncol0 = (warp >> 2) * (GDN_BV / 2);
  for (int t0 = 0; t0 < n; t0 += GDN_RT) {
    float aq[NT][4], ak[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) { aq[j][e] = 0.f; ak[j][e] = 0.f; }
    const bool active = t0 + mrow < n;  // warp-uniform: m16 tiles past the tree's end are skipped
#if GDN_TILE16
    cp_async_wait<0>();
    __syncthreads();  // the tile's rows (and, first time, S0 / tables / window) visible to every thread
    if (active && !(GDN_PROFILE_SKIP & 1)) {
      constexpr int AOFF[4] = {0, 8 * SROW, 4, 8 * SROW + 4};  // a0..a3
#pragma unroll 4
      for (int kk = 0; kk < GDN_K; kk += 8) {
        const u16* __restrict__ fq = sq16 + (mrow + fg) * SROW + kk + ft;
        const u16* __restrict__ fk = sk16 + (mrow + fg) * SROW + kk + ft;
        u32 qh[4], kh[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {  // 16-bit values widened to float32 bits: exact in tf32
#if TFM_IN == 1
          qh[e] = (u32)fq[AOFF[e]] << 16;
          kh[e] = (u32)fk[AOFF[e]] << 16;
#else
          qh[e] = __float_as_uint(f16_bits_to_f32(fq[AOFF[e]]));
          kh[e] = __float_as_uint(f16_bits_to_f32(fk[AOFF[e]]));
#endif
        }
        project_k8<NT>(sm.S, kk, ncol0, fg, ft, qh, qh, kh, kh, aq, ak);
      }
    }
    if (t0 + GDN_RT < n) {
      __syncthreads();  // every warp done with the staged tile before it is overwritten
      stage_tile(t0 + GDN_RT);
    }
#else
    for (int kc = 0; kc < ((GDN_PROFILE_SKIP & 2) ? 0 : GDN_K); kc += GDN_KC) {
      __syncthreads();  // previous chunk consumed (and, first time, S0 / tables / window written)
      raw8_store(pq, sm.stq + st_row * (GDN_KC + 4) + st_col);
      raw8_store(pk, sm.stk + st_row * (GDN_KC + 4) + st_col);
      __syncthreads();
      {  // prefetch the next chunk (or the next tile's first) while this one is used
        int nkc = kc + GDN_KC, nt0 = t0;
        if (nkc == GDN_K) { nkc = 0; nt0 = t0 + GDN_RT; }
        if (nt0 < n) {
          const int i = nt0 + st_row;
          if (i < n) {
            const i64 row = ((i64)(bos + i) * H + h) * GDN_K + nkc + st_col;
            raw8_load(q + row, pq);
            raw8_load(k + row, pk);
          } else {
            raw8_zero(pq);
            raw8_zero(pk);
          }
        }
      }
      if (active && !(GDN_PROFILE_SKIP & 1)) {
#pragma unroll
        for (int kk = 0; kk < GDN_KC; kk += 8) {
          const float* __restrict__ fq = sm.stq + (mrow + fg) * (GDN_KC + 4) + kk + ft;
          const float* __restrict__ fk = sm.stk + (mrow + fg) * (GDN_KC + 4) + kk + ft;
          constexpr int AOFF[4] = {0, 8 * (GDN_KC + 4), 4, 8 * (GDN_KC + 4) + 4};  // a0..a3
          u32 qh[4], kh[4], ql[4], kl[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
#if TFM_IN == 0
            split_tf32(fq[AOFF[e]], qh[e], ql[e]);
            split_tf32(fk[AOFF[e]], kh[e], kl[e]);
#else  // bf16 / f16 widened to float32: low 13 bits already zero (ql / kl unused)
            qh[e] = __float_as_uint(fq[AOFF[e]]);
            kh[e] = __float_as_uint(fk[AOFF[e]]);
            ql[e] = 0u;
            kl[e] = 0u;
#endif
          }
          project_k8<NT>(sm.S, kc + kk, ncol0, fg, ft, qh, ql, kh, kl, aq, ak);
        }
      }
    }
#endif  // GDN_TILE16
#if GDN_PDL
    if (t0 == 0) {  // first use of the pairs kernel's outputs: wait for it here, after the first tile's mma
      gdn_wait_prerequisites();
      for (int i = tid; i < n; i += GDN_THREADS) {
        const i64 gi = (i64)(bos + i);
        sm.eg[i] = expf(Gcum[gi * HV + hv]);
        sm.rk[i] = rk_in[(i64)h * T + gi];
        sm.rq[i] = rq_in[(i64)h * T + gi];
      }
      if (one_window) {
        const int cnt0 = pair_off[bos + n] - pbase;
        for (int e = tid; e < cnt0; e += GDN_THREADS) {
          sm.px[e] = Xh[pbase + e];
          sm.py[e] = Yh[pbase + e];
        }
      }
      __syncthreads();
    }
#endif
    // U = beta (v - e^G rk K S0^T) and QSe = e^G rq Q S0^T; accumulator element e of tile j is
    // row mrow + fg (+8 for e >= 2), column ncol0 + 8 j + 2 ft + (e & 1).
    if (active) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = t0 + mrow + fg + 8 * half;
        if (i < n) {
          const float eg = sm.eg[i], bt = sm.bt[i], rki = sm.rk[i], rqi = sm.rq[i];
          const tin* __restrict__ vrow = v + ((i64)(bos + i) * HV + hv) * GDN_V + v0;
#pragma unroll
          for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const int col = ncol0 + j * 8 + 2 * ft + c;
              const float vv = to_f32(vrow[col]);
              sm.D[i * GDN_BV + col] = bt * (vv - eg * (rki * ak[j][2 * half + c]));
              sm.O[i * GDN_BV + col] = eg * (rqi * aq[j][2 * half + c]);
            }
        }
      }
    }
  }
#else
  // ---- projections: each thread owns RPT rows x 4 columns (v = tx + c * NTX) of K S0^T and
  // Q S0^T for the current tile of 64 nodes.
  constexpr int NTX = GDN_BV / 4;
  constexpr int NTY = GDN_THREADS / NTX;
  constexpr int RPT = GDN_RT / NTY;
  static_assert(RPT >= 1 && GDN_RT % NTY == 0, "tile shape");
  const int tx = tid % NTX, ty = tid / NTX;

#if GDN_VARIANT >= 2
  for (int t0 = 0; t0 < n; t0 += GDN_RT) {
    float aq[RPT][4], ak[RPT][4];
#pragma unroll
    for (int m = 0; m < RPT; ++m)
#pragma unroll
      for (int c = 0; c < 4; ++c) { aq[m][c] = 0.f; ak[m][c] = 0.f; }
    const bool active = t0 + ty < n;  // rows ty + m NTY past the tree's end are skipped

    for (int kc = 0; kc < GDN_K; kc += GDN_KC) {
      __syncthreads();  // previous chunk consumed (and, first time, S0 / tables / window written)
      raw8_store(pq, sm.stq + st_row * (GDN_KC + 4) + st_col);
      raw8_store(pk, sm.stk + st_row * (GDN_KC + 4) + st_col);
      __syncthreads();
      {  // prefetch the next chunk (or the next tile's first) while this one is used
        int nkc = kc + GDN_KC, nt0 = t0;
        if (nkc == GDN_K) { nkc = 0; nt0 = t0 + GDN_RT; }
        if (nt0 < n) {
          const int i = nt0 + st_row;
          if (i < n) {
            const i64 row = ((i64)(bos + i) * H + h) * GDN_K + nkc + st_col;
            raw8_load(q + row, pq);
            raw8_load(k + row, pk);
          } else {
            raw8_zero(pq);
            raw8_zero(pk);
          }
        }
      }
      if (active) {
#pragma unroll
        for (int kk = 0; kk < GDN_KC; kk += 4) {
          float4 s[4];
#pragma unroll
          for (int c = 0; c < 4; ++c)
            s[c] = *reinterpret_cast<const float4*>(sm.S + (tx + c * NTX) * (GDN_K + 4) + kc + kk);
#pragma unroll
          for (int m = 0; m < RPT; ++m) {
            if (t0 + ty + m * NTY < n) {
              const float4 a = *reinterpret_cast<const float4*>(sm.stq + (ty + m * NTY) * (GDN_KC + 4) + kk);
              const float4 b = *reinterpret_cast<const float4*>(sm.stk + (ty + m * NTY) * (GDN_KC + 4) + kk);
#pragma unroll
              for (int c = 0; c < 4; ++c) {
                aq[m][c] = fmaf(a.x, s[c].x, aq[m][c]);
                aq[m][c] = fmaf(a.y, s[c].y, aq[m][c]);
                aq[m][c] = fmaf(a.z, s[c].z, aq[m][c]);
                aq[m][c] = fmaf(a.w, s[c].w, aq[m][c]);
                ak[m][c] = fmaf(b.x, s[c].x, ak[m][c]);
                ak[m][c] = fmaf(b.y, s[c].y, ak[m][c]);
                ak[m][c] = fmaf(b.z, s[c].z, ak[m][c]);
                ak[m][c] = fmaf(b.w, s[c].w, ak[m][c]);
              }
            }
          }
        }
      }
    }
#else
  for (int t0 = 0; t0 < n; t0 += GDN_RT) {
    float aq[RPT][4], ak[RPT][4];
#pragma unroll
    for (int m = 0; m < RPT; ++m)
#pragma unroll
      for (int c = 0; c < 4; ++c) { aq[m][c] = 0.f; ak[m][c] = 0.f; }

    for (int kc = 0; kc < GDN_K; kc += GDN_KC) {
      __syncthreads();  // previous chunk consumed (and, first time, S0 / tables written)
      {
        float tq[8], tk[8];
        const int i = t0 + st_row;
        if (i < n) {
          const i64 row = ((i64)(bos + i) * H + h) * GDN_K + kc + st_col;
          load8(q + row, tq);
          load8(k + row, tk);
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) { tq[e] = 0.f; tk[e] = 0.f; }
        }
        float* dq = sm.stq + st_row * (GDN_KC + 4) + st_col;
        float* dk = sm.stk + st_row * (GDN_KC + 4) + st_col;
        *reinterpret_cast<float4*>(dq) = make_float4(tq[0], tq[1], tq[2], tq[3]);
        *reinterpret_cast<float4*>(dq + 4) = make_float4(tq[4], tq[5], tq[6], tq[7]);
        *reinterpret_cast<float4*>(dk) = make_float4(tk[0], tk[1], tk[2], tk[3]);
        *reinterpret_cast<float4*>(dk + 4) = make_float4(tk[4], tk[5], tk[6], tk[7]);
      }
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < GDN_KC; kk += 4) {
        float4 s[4];
#pragma unroll
        for (int c = 0; c < 4; ++c)
          s[c] = *reinterpret_cast<const float4*>(sm.S + (tx + c * NTX) * (GDN_K + 4) + kc + kk);
#pragma unroll
        for (int m = 0; m < RPT; ++m) {
          const float4 a = *reinterpret_cast<const float4*>(sm.stq + (ty + m * NTY) * (GDN_KC + 4) + kk);
          const float4 b = *reinterpret_cast<const float4*>(sm.stk + (ty + m * NTY) * (GDN_KC + 4) + kk);
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            aq[m][c] = fmaf(a.x, s[c].x, aq[m][c]);
            aq[m][c] = fmaf(a.y, s[c].y, aq[m][c]);
            aq[m][c] = fmaf(a.z, s[c].z, aq[m][c]);
            aq[m][c] = fmaf(a.w, s[c].w, aq[m][c]);
            ak[m][c] = fmaf(b.x, s[c].x, ak[m][c]);
            ak[m][c] = fmaf(b.y, s[c].y, ak[m][c]);
            ak[m][c] = fmaf(b.z, s[c].z, ak[m][c]);
            ak[m][c] = fmaf(b.w, s[c].w, ak[m][c]);
          }
        }
      }
    }
#endif
    // U = beta (v - e^G rk K S0^T) and QSe = e^G rq Q S0^T for the tile's rows.
#pragma unroll
    for (int m = 0; m < RPT; ++m) {
      const int i = t0 + ty + m * NTY;
      if (i < n) {
        const float eg = sm.eg[i], bt = sm.bt[i], rki = sm.rk[i], rqi = sm.rq[i];
        const tin* __restrict__ vrow = v + ((i64)(bos + i) * HV + hv) * GDN_V + v0;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int col = tx + c * NTX;
          const float vv = to_f32(vrow[col]);
          sm.D[i * GDN_BV + col] = bt * (vv - eg * (rki * ak[m][c]));
          sm.O[i * GDN_BV + col] = eg * (rqi * aq[m][c]);
        }
      }
    }
  }
#endif  // GDN_VARIANT >= 3
  __syncthreads();

  // ---- forward substitution level by level; pairs staged in windows of <= pcap entries.
#if GDN_VARIANT >= 2
  // 16 lanes per row (2-4 columns each at BV = 32-64): twice v1's rows in flight per level, so
  // wide levels take half the rounds of dependent shared-memory reads.
  constexpr int LPR = GDN_BV < 16 ? GDN_BV : 16;  // lanes per row
#else
  constexpr int LPR = GDN_BV < 32 ? GDN_BV : 32;  // lanes per row
#endif
  constexpr int CPL = GDN_BV / LPR;               // columns per lane
  constexpr int RPAR = GDN_THREADS / LPR;         // rows in flight
  const int rsub = tid / LPR, lcol = tid % LPR;

  int p0 = 0;
  while (!(GDN_PROFILE_SKIP & 4) && p0 < n) {
    const int base = sm.poff[p0];
    int p1;
    if (sm.poff[n] - base <= pcap) {
      p1 = n;
    } else {  // largest p1 with poff[p1] - base <= pcap; p1 > p0 since pcap >= max depth + 1
      int lo = p0 + 1, hi = n;
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (sm.poff[mid] - base <= pcap) lo = mid; else hi = mid - 1;
      }
      p1 = lo;
    }
    const int cnt = sm.poff[p1] - base;
#if GDN_VARIANT >= 2
    if (p0 != 0 || !one_window) {  // else staged at the start (then p1 = n and cnt is the same)
#endif
    for (int e = tid; e < cnt; e += GDN_THREADS) {
      sm.pj[e] = pair_j[base + e] - bos;
      sm.px[e] = Xh[base + e];
      sm.py[e] = Yh[base + e];
    }
    __syncthreads();
#if GDN_VARIANT >= 2
    }
#endif

    int s = p0;
    while (s < p1) {
      const int d = sm.dep[s];
      const int e_end = min(p1, sm.lvl[d + 1]);
      for (int pp = s + rsub; pp < e_end; pp += RPAR) {
        const int i = sm.node[pp];
        const int ob = sm.poff[pp] - base;
        float ax[CPL], ay[CPL];
#pragma unroll
        for (int c = 0; c < CPL; ++c) { ax[c] = 0.f; ay[c] = 0.f; }
#pragma unroll 4
        for (int t = 0; t < d; ++t) {
          const int j = sm.pj[ob + t];
          const float xv = sm.px[ob + t], yv = sm.py[ob + t];
#pragma unroll
          for (int c = 0; c < CPL; ++c) {
            const float dj = sm.D[j * GDN_BV + lcol + c * LPR];
            ax[c] = fmaf(xv, dj, ax[c]);
            ay[c] = fmaf(yv, dj, ay[c]);
          }
        }
        const float yself = sm.py[ob + d];
        const i64 orow = ((i64)(bos + i) * HV + hv) * GDN_V + v0;
#pragma unroll
        for (int c = 0; c < CPL; ++c) {
          const int col = lcol + c * LPR;
          const float dl = sm.D[i * GDN_BV + col] - ax[c];
          sm.D[i * GDN_BV + col] = dl;
          const float out = sm.O[i * GDN_BV + col] + ay[c] + yself * dl;
          o[orow + col] = from_f32<tin>(out);
          if (delta_out != nullptr) delta_out[orow + col] = dl;
        }
      }
      __syncthreads();
      s = e_end;
    }
    p0 = p1;
  }
}
