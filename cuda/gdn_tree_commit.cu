// Gated DeltaNet commit along the accepted path (DESIGN.md section 4), float32 math:
//   S* = e^{G_a} S0 + sum_{j in P(a)} e^{G_a - G_j} khat_j delta_j^T        (V-first: S[v, k])
// with a the deepest accepted node, P(a) its root..a path, delta from the verify.
// S0 = src_state[src[r]] is read in full (into registers) before dst_state[dst[r]] is written;
// each CTA owns a disjoint block of rows, so src == dst within a request is safe. When a slot is
// the destination of one request and the source of another, the wrapper passes a snapshot of
// the sources as src_state (vllm_tfm/kernels/gdn.py), so every S0 is still read before writing.
//
// Two entry points run the same block body (gdn_commit_block), so their results are bitwise equal:
// * gdn_tree_commit: one layer; grid (V / 16, HV, R), block 128.
// * gdn_tree_commit_layers: L layers of one step in one launch; each layer's operands (separate
//   allocations) come from a device table of GdnCommitLayer rows (vllm_tfm/kernels/batched_commit.py
//   builds it); grid (V / 16, HV, R * L), blockIdx.z = layer * R + r. The tree plan, the accepted
//   nodes and the scalars are shared by the layers (one compile-time K, V and k type per launch).
//   Layers run concurrently: no layer's destination rows may be another layer's source rows
//   (vLLM: layers that share a buffer belong to different KV-cache groups, whose slots differ).
// Dynamic shared memory = gdn_commit_smem_words(m_cap) * 4 for both.
// The path comes from the host plan (vllm_tfm/kernels/plan.py): pair_j[pair_off[pos[a]] ...] lists
// the root..a path, root first.
//
// Compile-time constants (NVRTC -D): TFM_IN (k element type), GDN_K, GDN_V.
#include "tfm_common.cuh"

#ifndef GDN_K
#define GDN_K 128
#endif
#ifndef GDN_V
#define GDN_V 128
#endif

#define CM_THREADS 128
#define CM_BV 16   // rows of V per CTA
#define CM_PC 32   // path entries per staged chunk
#define CM_NPT (CM_BV * GDN_K / (4 * CM_THREADS))  // float4 state chunks per thread
// Minimum CTAs per SM of gdn_tree_commit_layers (a register cap). Without one, ptxas (13.0) gave the
// batched entry 64 registers and 72 bytes of spills at K = 128 (or 141 registers with a bound of
// 1): its layer operands live in registers, where the one-layer entry reads them from the
// parameter bank. 8 at K = 128 (64 registers, no spill), 4 elsewhere (no spill at K = 32..256).
#define CM_LAYERS_MINB (GDN_K == 128 ? 8 : 4)

static_assert(GDN_K % 32 == 0, "K must be a multiple of 32");
static_assert(GDN_V % CM_BV == 0, "V must be a multiple of 16");
static_assert(CM_NPT >= 1 && (CM_BV * GDN_K) % (4 * CM_THREADS) == 0, "state chunking");

__host__ __device__ constexpr int cm_align4(int x) { return (x + 3) & ~3; }

__device__ __host__ inline int gdn_commit_smem_words(int m_cap) {
  return 3 * cm_align4(m_cap) + cm_align4(CM_PC * (GDN_K + 4)) + cm_align4(CM_PC * CM_BV) + 4;
}

// The work of one CTA: rows v0 .. v0 + CM_BV - 1 of value head hv of request r's state.
__device__ __forceinline__ void
gdn_commit_block(const tin* __restrict__ k, const float* __restrict__ g,
                 const float* __restrict__ delta, const int* __restrict__ cu,
                 const int* __restrict__ pos, const int* __restrict__ depth,
                 const int* __restrict__ pair_off, const int* __restrict__ pair_j,
                 const int* __restrict__ accepted, const float* src_state,
                 const int* __restrict__ src_idx, i64 ss_slot, i64 ss_head, i64 ss_v,
                 float* dst_state, const int* __restrict__ dst_idx, i64 ds_slot,
                 i64 ds_head, i64 ds_v, int H, int HV, int m_cap, int use_l2norm,
                 const int v0, const int hv, const int r) {
  TFM_DYNAMIC_SMEM(float4, smem_f4);
  if (dynamic_smem_bytes() < (u32)gdn_commit_smem_words(m_cap) * 4u) __trap();
  float* base = reinterpret_cast<float*>(smem_f4);
  int* s_path = reinterpret_cast<int*>(base);   // [m_cap] global node of each path entry
  float* s_g = base + cm_align4(m_cap);         // [m_cap] g of each path entry
  float* s_w = s_g + cm_align4(m_cap);          // [m_cap] e^{G_a - G_j}
  float* s_kn = s_w + cm_align4(m_cap);         // [PC][K+4] khat of a chunk of path entries
  float* s_c = s_kn + cm_align4(CM_PC * (GDN_K + 4));  // [PC][BV] e^{G_a - G_j} delta_j[v]
  float* s_ega = s_c + cm_align4(CM_PC * CM_BV);       // [1] e^{G_a}

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int h = hv / (HV / H);
  const int bos = cu[r];

  // S0 rows first: 16-byte loads, a warp covers contiguous K of one row.
  const float* S0 = src_state + (i64)src_idx[r] * ss_slot + (i64)hv * ss_head + (i64)v0 * ss_v;
  float4 s0[CM_NPT];
#pragma unroll
  for (int t = 0; t < CM_NPT; ++t) {
    const int idx = tid + t * CM_THREADS;
    const int row = idx / (GDN_K / 4), c4 = (idx % (GDN_K / 4)) * 4;
    s0[t] = *reinterpret_cast<const float4*>(S0 + (i64)row * ss_v + c4);
  }

  const int a = bos + accepted[r];
  const int m = depth[a] + 1;
  const int off = pair_off[pos[a]];
  for (int e = tid; e < m; e += CM_THREADS) {
    const int j = pair_j[off + e];
    s_path[e] = j;
    s_g[e] = g[(i64)j * HV + hv];
  }
  __syncthreads();
  if (tid == 0) {  // suffix sums from a upward: G_a - G_j sums the g strictly below j
    float seg = 0.f;
    for (int e = m - 1; e >= 0; --e) {
      s_w[e] = expf(seg);
      seg += s_g[e];
    }
    s_ega[0] = expf(seg);
  }
  __syncthreads();

  float4 acc[CM_NPT];
#pragma unroll
  for (int t = 0; t < CM_NPT; ++t) acc[t] = make_float4(0.f, 0.f, 0.f, 0.f);

  for (int c0 = 0; c0 < m; c0 += CM_PC) {
    const int cnt = min(CM_PC, m - c0);
    // one warp per path entry: khat_j into shared memory, then e^{G_a-G_j} delta_j[v0:v0+BV]
    for (int e = warp; e < cnt; e += CM_THREADS / 32) {
      const int j = s_path[c0 + e];
      const tin* __restrict__ krow = k + ((i64)j * H + h) * GDN_K;
      float kv[GDN_K / 32];
      float ss = 0.f;
#pragma unroll
      for (int c = 0; c < GDN_K / 32; ++c) {
        kv[c] = to_f32(krow[c * 32 + lane]);
        ss = fmaf(kv[c], kv[c], ss);
      }
      ss = warp_sum(ss);
      const float rk = use_l2norm ? l2norm_scale(ss) : 1.f;
#pragma unroll
      for (int c = 0; c < GDN_K / 32; ++c) s_kn[e * (GDN_K + 4) + c * 32 + lane] = kv[c] * rk;
      if (lane < CM_BV)
        s_c[e * CM_BV + lane] = s_w[c0 + e] * delta[((i64)j * HV + hv) * GDN_V + v0 + lane];
    }
    __syncthreads();
    for (int e = 0; e < cnt; ++e) {
#pragma unroll
      for (int t = 0; t < CM_NPT; ++t) {
        const int idx = tid + t * CM_THREADS;
        const int row = idx / (GDN_K / 4), c4 = (idx % (GDN_K / 4)) * 4;
        const float cv = s_c[e * CM_BV + row];
        const float4 kn = *reinterpret_cast<const float4*>(s_kn + e * (GDN_K + 4) + c4);
        acc[t].x = fmaf(cv, kn.x, acc[t].x);
        acc[t].y = fmaf(cv, kn.y, acc[t].y);
        acc[t].z = fmaf(cv, kn.z, acc[t].z);
        acc[t].w = fmaf(cv, kn.w, acc[t].w);
      }
    }
    __syncthreads();
  }

  const float ega = s_ega[0];
  float* S1 = dst_state + (i64)dst_idx[r] * ds_slot + (i64)hv * ds_head + (i64)v0 * ds_v;
#pragma unroll
  for (int t = 0; t < CM_NPT; ++t) {
    const int idx = tid + t * CM_THREADS;
    const int row = idx / (GDN_K / 4), c4 = (idx % (GDN_K / 4)) * 4;
    float4 out;
    out.x = fmaf(ega, s0[t].x, acc[t].x);
    out.y = fmaf(ega, s0[t].y, acc[t].y);
    out.z = fmaf(ega, s0[t].z, acc[t].z);
    out.w = fmaf(ega, s0[t].w, acc[t].w);
    *reinterpret_cast<float4*>(S1 + (i64)row * ds_v + c4) = out;
  }
}

extern "C" __global__ void __launch_bounds__(CM_THREADS)
gdn_tree_commit(const tin* __restrict__ k, const float* __restrict__ g,
                const float* __restrict__ delta, const int* __restrict__ cu,
                const int* __restrict__ pos, const int* __restrict__ depth,
                const int* __restrict__ pair_off, const int* __restrict__ pair_j,
                const int* __restrict__ accepted, const float* src_state,
                const int* __restrict__ src_idx, i64 ss_slot, i64 ss_head, i64 ss_v,
                float* dst_state, const int* __restrict__ dst_idx, i64 ds_slot,
                i64 ds_head, i64 ds_v, int H, int HV, int m_cap, int use_l2norm) {
  gdn_commit_block(k, g, delta, cu, pos, depth, pair_off, pair_j, accepted, src_state, src_idx,
                   ss_slot, ss_head, ss_v, dst_state, dst_idx, ds_slot, ds_head, ds_v, H, HV,
                   m_cap, use_l2norm, blockIdx.x * CM_BV, blockIdx.y, blockIdx.z);
}

// One row of the layer table of gdn_tree_commit_layers: 13 64-bit words in this order
// (GDN_LAYER_FIELDS in vllm_tfm/kernels/batched_commit.py mirrors it; a CPU test compares them).
struct GdnCommitLayer {
  const tin* k;          // [T, H, K] contiguous
  const float* g;        // [T, HV] contiguous
  const float* delta;    // [T, HV, V] contiguous
  const float* src_state;
  const int* src_idx;    // [R]
  i64 ss_slot, ss_head, ss_v;
  float* dst_state;
  const int* dst_idx;    // [R]
  i64 ds_slot, ds_head, ds_v;
};

extern "C" __global__ void __launch_bounds__(CM_THREADS, CM_LAYERS_MINB)
gdn_tree_commit_layers(const GdnCommitLayer* __restrict__ layers, int R,
                       const int* __restrict__ cu, const int* __restrict__ pos,
                       const int* __restrict__ depth, const int* __restrict__ pair_off,
                       const int* __restrict__ pair_j, const int* __restrict__ accepted, int H,
                       int HV, int m_cap, int use_l2norm) {
  const int layer = blockIdx.z / R, r = blockIdx.z - layer * R;
  const GdnCommitLayer L = layers[layer];
  gdn_commit_block(L.k, L.g, L.delta, cu, pos, depth, pair_off, pair_j, accepted, L.src_state,
                   L.src_idx, L.ss_slot, L.ss_head, L.ss_v, L.dst_state, L.dst_idx, L.ds_slot,
                   L.ds_head, L.ds_v, H, HV, m_cap, use_l2norm, blockIdx.x * CM_BV, blockIdx.y, r);
}
