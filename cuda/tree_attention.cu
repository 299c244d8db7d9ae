// Tree attention for the verify step over vLLM's paged KV cache (TRITON_ATTN layout), every tree
// request of the step in one launch.
//
// Tree t (one request's n nodes, query rows start .. start+n-1; block-table / seq_lens row req):
// the request has kv_len = seq_lens[req] keys; the first ctx = kv_len - n are the committed prefix
// (visible to every node) and key ctx + i is tree node i, visible to node j iff i <= j and bit i of
// node j's ancestor bitmask is set (ancestor-or-self; bit i % 64 of word i / 64). With G = Hq / Hkv
// query heads per KV head:
//   out[start+j, hq] = sum_k softmax_k(scale q[start+j, hq] . K[k, hq/G]) V[k, hq/G]   (visible k)
// Key position p lives in block block_table[req, p / block_size], slot p % block_size of
// key_cache / value_cache [num_blocks, block_size, Hkv, D] (any strides, contiguous last dimension:
// vLLM's kv_cache.transpose(1, 2).split(D, -1)).
//
// Work split: a row of the (tree, KV head) problem is (node j, head g of the group), row m -> j =
// m / G, g = m % G, so the G heads that share a KV head share every K/V tile. CTA = 64 rows x one
// split of the keys; 4 warps x 16 rows; K/V tiles of TA_BN keys double-buffered with cp.async.
// 16-bit inputs: S = Q K^T and O += P V on tensor cores (mma.sync m16n8k16, float32 accumulation,
// P rounded to the input type before P V, as FlashAttention and vLLM's Triton kernel do).
// float32 inputs: the same fragments computed with FFMA from shared memory (exact float32).
// Softmax: online, base 2, float32, -inf safe (a split may hold no visible key of a row).
// Splits (flash-decoding): with few CTAs the keys of a row tile are split; each split writes its
// (O, m, l) partial to a workspace and a second launch (tree_attention_merge: a thread per output
// chunk of 4 values, so the whole GPU merges) combines them. One launch with one split, two with more.
//
// Pipeline: TA_STAGES K/V tiles in flight (cp.async groups; the first holds the Q tile too). A
// tile's keys are located from its first key once (one division by the block size and at most two
// block-table loads per tile, before any copy is issued, when a block holds a whole tile). The
// running output is rescaled only when some row of the warp has a new maximum.
//
// Compile-time constants (NVRTC -D): TFM_IN (0 float32, 1 bfloat16, 2 float16: q, caches, out),
// TA_D (head size, multiple of 32, <= 256), TA_BN (keys per tile, multiple of 16), TA_STAGES (K/V
// tiles in flight, 2..4), TA_MINB (CTAs per SM for __launch_bounds__), TA_PROFILE_SKIP (timing
// only, the outputs are then wrong: 1 = the K/V copies after the first tiles, 2 = S = Q K^T,
// 4 = O += P V). Host side: vllm_tfm/kernels/tree_attention.py.
#include "tfm_common.cuh"
#include "tfm_mma.cuh"

#ifndef TA_D
#define TA_D 128
#endif
#ifndef TA_BN
#define TA_BN 64
#endif
#ifndef TA_MINB
#define TA_MINB 1
#endif
#ifndef TA_STAGES
#define TA_STAGES 2
#endif
#ifndef TA_PROFILE_SKIP
#define TA_PROFILE_SKIP 0
#endif
#define TA_BM 64          // rows per CTA
#define TA_THREADS 128    // 4 warps x 16 rows
#define TA_MAX_SPLITS 64  // key splits per row tile
#define TA_MERGE_CHUNK 16  // splits the merge holds in registers at a time
#define TA_NT (TA_BN / 8)  // 8-key column tiles of S per warp
#define TA_DT (TA_D / 8)   // 8-column tiles of O per warp
#define TA_EPC (16 / (int)sizeof(tin))  // elements per 16-byte chunk
#define TA_CPR (TA_D / TA_EPC)          // chunks per row
#if TFM_IN == 0
#define TA_PITCH (TA_D + 4)  // shared row pitch (elements): rows 4 banks apart, 16-byte aligned
#else
#define TA_PITCH (TA_D + 8)
#endif
#define TA_SP_PITCH (TA_BN + 4)  // float32 path: per-warp P staging

static_assert(TA_D % 32 == 0 && TA_D <= 256, "TA_D must be a multiple of 32, at most 256");
static_assert(TA_BN % 16 == 0 && TA_BN <= 128, "TA_BN must be a multiple of 16, at most 128");
static_assert(TA_STAGES >= 2 && TA_STAGES <= 4, "TA_STAGES must be 2, 3 or 4");

__device__ __forceinline__ float ta_neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ void ta_zero16(void* p) {
  uint4 z;
  z.x = z.y = z.z = z.w = 0u;
  *reinterpret_cast<uint4*>(p) = z;
}

// Two consecutive output elements (the pointer is aligned to two elements).
__device__ __forceinline__ void ta_store2(float* p, float a, float b) {
  float2 v;
  v.x = a;
  v.y = b;
  *reinterpret_cast<float2*>(p) = v;
}
template <typename T>
__device__ __forceinline__ void ta_store2(T* p, float a, float b) {
  *reinterpret_cast<u32*>(p) = (u32)from_f32<T>(a).bits | ((u32)from_f32<T>(b).bits << 16);
}
// Four consecutive output elements (aligned to four elements).
__device__ __forceinline__ void ta_store4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
template <typename T>
__device__ __forceinline__ void ta_store4(T* p, float4 v) {
  uint2 w;
  w.x = (u32)from_f32<T>(v.x).bits | ((u32)from_f32<T>(v.y).bits << 16);
  w.y = (u32)from_f32<T>(v.z).bits | ((u32)from_f32<T>(v.w).bits << 16);
  *reinterpret_cast<uint2*>(p) = w;
}

#if TFM_IN != 0
// Round to the input type and pack two values (lower index in the low half).
__device__ __forceinline__ u32 ta_pack2(float a, float b) {
  return (u32)from_f32<tin>(a).bits | ((u32)from_f32<tin>(b).bits << 16);
}
#endif

// Dynamic shared memory (bytes) for the host: Q tile, TA_STAGES K and V stages, float32 P staging.
// Mirrored by tree_attention_smem_bytes in vllm_tfm/kernels/tree_attention.py.
//   (TA_BM + 2 TA_STAGES TA_BN) TA_PITCH sizeof(tin) + (TFM_IN == 0 ? 4 x 16 x TA_SP_PITCH x 4 : 0)

// grid (row tiles of the largest tree, Hkv x splits, trees), block 128.
// meta [4, trees] int32: request, first query row, nodes n, first bitmask row (prefix sum of n).
extern "C" __global__ void __launch_bounds__(TA_THREADS, TA_MINB)
tree_attention(const tin* __restrict__ q, i64 q_row, i64 q_head,
               const tin* __restrict__ kc, i64 k_blk, i64 k_tok, i64 k_head,
               const tin* __restrict__ vc, i64 v_blk, i64 v_tok, i64 v_head,
               const int* __restrict__ block_table, i64 bt_row, const int* __restrict__ seq_lens,
               const int* __restrict__ meta, const unsigned long long* __restrict__ bits, int words,
               tin* __restrict__ out, i64 o_row, i64 o_head,
               float* __restrict__ ws_o, float* __restrict__ ws_ml,
               int num_trees, int hkv, int group, int block_size, int splits, int mtiles, float scale_log2) {
  TFM_DYNAMIC_SMEM(uint4, smem_raw);
  tin* sQ = reinterpret_cast<tin*>(smem_raw);
  tin* sK0 = sQ + TA_BM * TA_PITCH;           // stage s at sK0 + s TA_BN TA_PITCH
  tin* sV0 = sK0 + TA_STAGES * TA_BN * TA_PITCH;
#if TFM_IN == 0
  float* sP = reinterpret_cast<float*>(sV0 + TA_STAGES * TA_BN * TA_PITCH);
#endif

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gq = lane >> 2, tq = lane & 3;
  const int mt = blockIdx.x, tree = blockIdx.z;
  const int h = blockIdx.y / splits, split = blockIdx.y - h * splits;
  const int req = meta[tree], start = meta[num_trees + tree];
  const int n = meta[2 * num_trees + tree], noff = meta[3 * num_trees + tree];
  const int rows = n * group;
  const int m0 = mt * TA_BM;
  if (m0 >= rows) return;  // the tree has fewer row tiles (uniform over the CTA and its splits)
  const int ctx = seq_lens[req] - n;
  const int j_last = min(n - 1, (m0 + TA_BM - 1) / group);
  const int kv_end = ctx + j_last + 1;  // no row of this tile sees a key at or past kv_end
  const int ntiles = (kv_end + TA_BN - 1) / TA_BN;
  const int tps = (ntiles + splits - 1) / splits;
  const int t_begin = split * tps;
  const int t_end = min(ntiles, t_begin + tps);
  const int* bt = block_table + (i64)req * bt_row;
  const i64 kh = (i64)h * k_head, vh = (i64)h * v_head;

  // This thread's two rows: C-fragment rows gq and gq + 8 of its warp.
  int node[2];
  bool valid[2];
  const unsigned long long* brow[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int m = m0 + warp * 16 + gq + 8 * r;
    valid[r] = m < rows;
    node[r] = m / group;
    brow[r] = bits + (i64)(noff + (valid[r] ? node[r] : 0)) * words;
  }

  float o[TA_DT][4];
#pragma unroll
  for (int dt = 0; dt < TA_DT; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.f;
  float mrow[2] = {ta_neg_inf(), ta_neg_inf()};
  float lrow[2] = {0.f, 0.f};

  // K/V tile `it` -> stage `st`: keys it*TA_BN .. +TA_BN-1; keys at or past kv_end are zeros.
  // With blocks of at least TA_BN keys a tile spans two blocks at most: their two block-table
  // entries are loaded once, before any copy; thread tid then copies chunk tid % TA_CPR of rows
  // tid / TA_CPR + k TA_THREADS / TA_CPR. Otherwise (or when TA_CPR does not divide TA_THREADS),
  // chunk by chunk with a block-table lookup each.
  auto load_tile = [&](int it, int st) {
    if ((TA_PROFILE_SKIP & 1) && it >= t_begin + TA_STAGES - 1) return;
    tin* dk = sK0 + st * TA_BN * TA_PITCH;
    tin* dv = sV0 + st * TA_BN * TA_PITCH;
    const int p0 = it * TA_BN;  // < kv_end: the tile holds a key
    if constexpr (TA_THREADS % TA_CPR == 0) {
      if (block_size >= TA_BN) {
        constexpr int RPP = TA_THREADS / TA_CPR;  // rows per pass
        const int kr0 = tid / TA_CPR, ch = tid - kr0 * TA_CPR;
        const int lb0 = p0 / block_size, s0 = p0 - lb0 * block_size;
        const int split_row = block_size - s0;  // rows from here on are in the next block
        const i64 b0 = (i64)bt[lb0];
        const i64 b1 = split_row < TA_BN && p0 + split_row < kv_end ? (i64)bt[lb0 + 1] : 0;
#pragma unroll
        for (int kr = kr0; kr < TA_BN; kr += RPP) {
          tin* sk = dk + kr * TA_PITCH + ch * TA_EPC;
          tin* sv = dv + kr * TA_PITCH + ch * TA_EPC;
          if (p0 + kr < kv_end) {
            const bool next = kr >= split_row;
            const i64 blk = next ? b1 : b0;
            const i64 slot = next ? kr - split_row : s0 + kr;
            cp_async16(sk, kc + blk * k_blk + slot * k_tok + kh + ch * TA_EPC);
            cp_async16(sv, vc + blk * v_blk + slot * v_tok + vh + ch * TA_EPC);
          } else {
            ta_zero16(sk);
            ta_zero16(sv);
          }
        }
        return;
      }
    }
    for (int c = tid; c < TA_BN * TA_CPR; c += TA_THREADS) {
      const int kr = c / TA_CPR, ch = c - kr * TA_CPR;
      const int p = p0 + kr;
      tin* sk = dk + kr * TA_PITCH + ch * TA_EPC;
      tin* sv = dv + kr * TA_PITCH + ch * TA_EPC;
      if (p < kv_end) {
        const int lb = p / block_size;
        const i64 blk = (i64)bt[lb];
        const i64 slot = (i64)(p - lb * block_size);
        cp_async16(sk, kc + blk * k_blk + slot * k_tok + kh + ch * TA_EPC);
        cp_async16(sv, vc + blk * v_blk + slot * v_tok + vh + ch * TA_EPC);
      } else {
        ta_zero16(sk);
        ta_zero16(sv);
      }
    }
  };

  if (t_begin < t_end) {
    for (int c = tid; c < TA_BM * TA_CPR; c += TA_THREADS) {
      const int r = c / TA_CPR, ch = c - r * TA_CPR;
      const int m = m0 + r;
      tin* dst = sQ + r * TA_PITCH + ch * TA_EPC;
      if (m < rows) {
        const int j = m / group, g = m - j * group;
        cp_async16(dst, q + (i64)(start + j) * q_row + (i64)(h * group + g) * q_head + ch * TA_EPC);
      } else {
        ta_zero16(dst);
      }
    }
#pragma unroll
    for (int s = 0; s < TA_STAGES - 1; ++s) {  // one group per stage; the first holds Q too
      if (t_begin + s < t_end) load_tile(t_begin + s, s);
      cp_async_commit();
    }

    for (int it = t_begin; it < t_end; ++it) {
      const int st = (it - t_begin) % TA_STAGES;
      const int nxt = it + TA_STAGES - 1;
      if (nxt < t_end) load_tile(nxt, (nxt - t_begin) % TA_STAGES);
      cp_async_commit();
      cp_async_wait<TA_STAGES - 1>();  // Q and tile `it` have landed (this thread's copies) ...
      __syncthreads();                 // ... and every thread's
      const tin* sK = sK0 + st * TA_BN * TA_PITCH;
      const tin* sV = sV0 + st * TA_BN * TA_PITCH;
      const int key0 = it * TA_BN;

      // S = Q K^T for the warp's 16 rows x TA_BN keys (C fragments)
      float s[TA_NT][4];
#pragma unroll
      for (int nt = 0; nt < TA_NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#if TFM_IN != 0
      {
        const tin* qrow = sQ + (warp * 16 + (lane & 15)) * TA_PITCH + (lane >> 4) * 8;
        const tin* krow = sK + (lane & 7) * TA_PITCH + (lane >> 3) * 8;
#pragma unroll
        for (int kk = 0; kk < ((TA_PROFILE_SKIP & 2) ? 0 : TA_D); kk += 32) {
          u32 a0[4], a1[4];
          ldsm_x4(a0, qrow + kk);
          ldsm_x4(a1, qrow + kk + 16);
#pragma unroll
          for (int nt = 0; nt < TA_NT; ++nt) {
            u32 b[4];
            ldsm_x4(b, krow + nt * 8 * TA_PITCH + kk);
            mma_16816<TFM_IN == 1>(s[nt], a0, b[0], b[1]);
            mma_16816<TFM_IN == 1>(s[nt], a1, b[2], b[3]);
          }
        }
      }
#else
      {
        const float* q0 = sQ + (warp * 16 + gq) * TA_PITCH;
        const float* q1 = q0 + 8 * TA_PITCH;
#pragma unroll 2
        for (int d = 0; d < TA_D; d += 4) {
          const float4 qa = *reinterpret_cast<const float4*>(q0 + d);
          const float4 qb = *reinterpret_cast<const float4*>(q1 + d);
#pragma unroll
          for (int nt = 0; nt < TA_NT; ++nt) {
            const float* k0 = sK + (nt * 8 + 2 * tq) * TA_PITCH + d;
            const float4 ka = *reinterpret_cast<const float4*>(k0);
            const float4 kb = *reinterpret_cast<const float4*>(k0 + TA_PITCH);
            s[nt][0] = fmaf(qa.w, ka.w, fmaf(qa.z, ka.z, fmaf(qa.y, ka.y, fmaf(qa.x, ka.x, s[nt][0]))));
            s[nt][1] = fmaf(qa.w, kb.w, fmaf(qa.z, kb.z, fmaf(qa.y, kb.y, fmaf(qa.x, kb.x, s[nt][1]))));
            s[nt][2] = fmaf(qb.w, ka.w, fmaf(qb.z, ka.z, fmaf(qb.y, ka.y, fmaf(qb.x, ka.x, s[nt][2]))));
            s[nt][3] = fmaf(qb.w, kb.w, fmaf(qb.z, kb.z, fmaf(qb.y, kb.y, fmaf(qb.x, kb.x, s[nt][3]))));
          }
        }
      }
#endif

      // scale (base 2), mask, running max
      const bool tree_tile = key0 + TA_BN > ctx;  // holds tree keys (or keys past kv_end)
      float mx[2] = {ta_neg_inf(), ta_neg_inf()};
#pragma unroll
      for (int nt = 0; nt < TA_NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          float v = s[nt][e] * scale_log2;
          if (tree_tile) {
            const int i = key0 + nt * 8 + 2 * tq + (e & 1) - ctx;
            if (i >= 0) {
              const bool vis = valid[r] && i <= node[r] && ((brow[r][i >> 6] >> (i & 63)) & 1ull);
              if (!vis) v = ta_neg_inf();
            }
          }
          s[nt][e] = v;
          mx[r] = fmaxf(mx[r], v);
        }
      }
      float ref[2], alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        const float m_new = fmaxf(mrow[r], mx[r]);
        ref[r] = m_new == ta_neg_inf() ? 0.f : m_new;
        alpha[r] = exp2f(mrow[r] - ref[r]);
        mrow[r] = m_new;
        lrow[r] *= alpha[r];
      }
      if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {  // x 1 is exact: skipped
#pragma unroll
        for (int dt = 0; dt < TA_DT; ++dt) {
          o[dt][0] *= alpha[0];
          o[dt][1] *= alpha[0];
          o[dt][2] *= alpha[1];
          o[dt][3] *= alpha[1];
        }
      }
#pragma unroll
      for (int nt = 0; nt < TA_NT; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = exp2f(s[nt][e] - ref[e >> 1]);
      }

      // O += P V
#if TFM_IN != 0
      {
        const tin* vrow = sV + ((lane & 7) + ((lane >> 3) & 1) * 8) * TA_PITCH + (lane >> 4) * 8;
#pragma unroll
        for (int ks = 0; ks < ((TA_PROFILE_SKIP & 4) ? 0 : TA_BN / 16); ++ks) {
          u32 a[4];
          a[0] = ta_pack2(s[2 * ks][0], s[2 * ks][1]);
          a[1] = ta_pack2(s[2 * ks][2], s[2 * ks][3]);
          a[2] = ta_pack2(s[2 * ks + 1][0], s[2 * ks + 1][1]);
          a[3] = ta_pack2(s[2 * ks + 1][2], s[2 * ks + 1][3]);
          // the row sums use the rounded weights that multiply V
#pragma unroll
          for (int w = 0; w < 4; ++w) {
            const float lo = to_f32(tin{(u16)(a[w] & 0xffffu)});
            const float hi = to_f32(tin{(u16)(a[w] >> 16)});
            lrow[w & 1] += lo + hi;
          }
#pragma unroll
          for (int dp = 0; dp < TA_D / 16; ++dp) {
            u32 b[4];
            ldsm_x4_trans(b, vrow + ks * 16 * TA_PITCH + dp * 16);
            mma_16816<TFM_IN == 1>(o[2 * dp], a, b[0], b[1]);
            mma_16816<TFM_IN == 1>(o[2 * dp + 1], a, b[2], b[3]);
          }
        }
      }
#else
      {
        float* sPw = sP + warp * 16 * TA_SP_PITCH;
#pragma unroll
        for (int nt = 0; nt < TA_NT; ++nt) {
          ta_store2(sPw + gq * TA_SP_PITCH + nt * 8 + 2 * tq, s[nt][0], s[nt][1]);
          ta_store2(sPw + (gq + 8) * TA_SP_PITCH + nt * 8 + 2 * tq, s[nt][2], s[nt][3]);
          lrow[0] += s[nt][0] + s[nt][1];
          lrow[1] += s[nt][2] + s[nt][3];
        }
        __syncwarp();
        for (int k = 0; k < TA_BN; ++k) {
          const float p0 = sPw[gq * TA_SP_PITCH + k];
          const float p1 = sPw[(gq + 8) * TA_SP_PITCH + k];
          const float* vr = sV + k * TA_PITCH + 2 * tq;
#pragma unroll
          for (int dt = 0; dt < TA_DT; ++dt) {
            const float2 v = *reinterpret_cast<const float2*>(vr + dt * 8);
            o[dt][0] = fmaf(p0, v.x, o[dt][0]);
            o[dt][1] = fmaf(p0, v.y, o[dt][1]);
            o[dt][2] = fmaf(p1, v.x, o[dt][2]);
            o[dt][3] = fmaf(p1, v.y, o[dt][3]);
          }
        }
      }
#endif
      __syncthreads();  // stage `st` (and the P staging) is free for the next copies
    }
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 1);
    lrow[r] += __shfl_xor_sync(0xffffffffu, lrow[r], 2);
  }

  if (splits == 1) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (!valid[r]) continue;
      const float inv = lrow[r] > 0.f ? 1.f / lrow[r] : 0.f;
      const int m = m0 + warp * 16 + gq + 8 * r;
      const int j = node[r], g = m - j * group;
      tin* dst = out + (i64)(start + j) * o_row + (i64)(h * group + g) * o_head + 2 * tq;
#pragma unroll
      for (int dt = 0; dt < TA_DT; ++dt) ta_store2(dst + dt * 8, o[dt][2 * r] * inv, o[dt][2 * r + 1] * inv);
    }
    return;
  }

  // split: write this split's partial (unnormalised O, running max m in base 2, sum l)
  const i64 slot = ((i64)tree * hkv + h) * mtiles + mt;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const i64 prow = (slot * splits + split) * TA_BM + warp * 16 + gq + 8 * r;
    if (t_begin < t_end) {
      float* wo = ws_o + prow * TA_D + 2 * tq;
#pragma unroll
      for (int dt = 0; dt < TA_DT; ++dt) ta_store2(wo + dt * 8, o[dt][2 * r], o[dt][2 * r + 1]);
    }
    if (tq == 0) {
      ws_ml[2 * prow] = mrow[r];
      ws_ml[2 * prow + 1] = lrow[r];
    }
  }
}

// The merge of up to TA_MERGE_CHUNK splits: every split's (m, l) loaded in one round, its O in a second.
__device__ __forceinline__ float4 ta_merge_few(const float* __restrict__ ws_o, const float* __restrict__ ws_ml, i64 row0,
                                               int d4, int splits) {
  float ms[TA_MERGE_CHUNK], ls[TA_MERGE_CHUNK];
#pragma unroll
  for (int sp = 0; sp < TA_MERGE_CHUNK; ++sp) {
    if (sp < splits) {
      ms[sp] = ws_ml[2 * (row0 + (i64)sp * TA_BM)];
      ls[sp] = ws_ml[2 * (row0 + (i64)sp * TA_BM) + 1];
    }
  }
  float mm = ta_neg_inf();
#pragma unroll
  for (int sp = 0; sp < TA_MERGE_CHUNK; ++sp)
    if (sp < splits) mm = fmaxf(mm, ms[sp]);
  float w[TA_MERGE_CHUNK];
  float big_l = 0.f;
#pragma unroll
  for (int sp = 0; sp < TA_MERGE_CHUNK; ++sp) {
    if (sp < splits) {
      w[sp] = ms[sp] == ta_neg_inf() ? 0.f : exp2f(ms[sp] - mm);
      big_l += w[sp] * ls[sp];  // as the merge inside the split kernel wrote it (same contraction)
    }
  }
  const float inv = big_l > 0.f ? 1.f / big_l : 0.f;
  float4 v[TA_MERGE_CHUNK];
#pragma unroll
  for (int sp = 0; sp < TA_MERGE_CHUNK; ++sp) {
    if (sp < splits) {
      w[sp] *= inv;
      if (w[sp] != 0.f) v[sp] = *reinterpret_cast<const float4*>(ws_o + (row0 + (i64)sp * TA_BM) * TA_D + d4 * 4);
    }
  }
  float4 acc;
  acc.x = acc.y = acc.z = acc.w = 0.f;
#pragma unroll
  for (int sp = 0; sp < TA_MERGE_CHUNK; ++sp) {
    if (sp < splits && w[sp] != 0.f) {
      acc.x = fmaf(w[sp], v[sp].x, acc.x);
      acc.y = fmaf(w[sp], v[sp].y, acc.y);
      acc.z = fmaf(w[sp], v[sp].z, acc.z);
      acc.w = fmaf(w[sp], v[sp].w, acc.w);
    }
  }
  return acc;
}

// The merge of more splits (long contexts), TA_MERGE_CHUNK splits at a time in registers; the same sums,
// in split order, as ta_merge_few at <= TA_MERGE_CHUNK splits (bit for bit), one more round of loads.
__device__ __forceinline__ float4 ta_merge_many(const float* __restrict__ ws_o, const float* __restrict__ ws_ml, i64 row0,
                                                int d4, int splits) {
  float mm = ta_neg_inf();
  for (int s0 = 0; s0 < splits; s0 += TA_MERGE_CHUNK) {
    float ms[TA_MERGE_CHUNK];
#pragma unroll
    for (int c = 0; c < TA_MERGE_CHUNK; ++c)
      if (s0 + c < splits) ms[c] = ws_ml[2 * (row0 + (i64)(s0 + c) * TA_BM)];
#pragma unroll
    for (int c = 0; c < TA_MERGE_CHUNK; ++c)
      if (s0 + c < splits) mm = fmaxf(mm, ms[c]);
  }
  float big_l = 0.f;
  for (int s0 = 0; s0 < splits; s0 += TA_MERGE_CHUNK) {
    float ms[TA_MERGE_CHUNK], ls[TA_MERGE_CHUNK];
#pragma unroll
    for (int c = 0; c < TA_MERGE_CHUNK; ++c) {
      if (s0 + c < splits) {
        ms[c] = ws_ml[2 * (row0 + (i64)(s0 + c) * TA_BM)];
        ls[c] = ws_ml[2 * (row0 + (i64)(s0 + c) * TA_BM) + 1];
      }
    }
#pragma unroll
    for (int c = 0; c < TA_MERGE_CHUNK; ++c) {
      if (s0 + c < splits) {
        const float w = ms[c] == ta_neg_inf() ? 0.f : exp2f(ms[c] - mm);
        big_l += w * ls[c];  // as the merge inside the split kernel wrote it (same contraction)
      }
    }
  }
  const float inv = big_l > 0.f ? 1.f / big_l : 0.f;
  float4 acc;
  acc.x = acc.y = acc.z = acc.w = 0.f;
  for (int s0 = 0; s0 < splits; s0 += TA_MERGE_CHUNK) {
    float w[TA_MERGE_CHUNK];
    float4 v[TA_MERGE_CHUNK];
#pragma unroll
    for (int c = 0; c < TA_MERGE_CHUNK; ++c) {
      if (s0 + c < splits) {
        const float ms = ws_ml[2 * (row0 + (i64)(s0 + c) * TA_BM)];
        w[c] = (ms == ta_neg_inf() ? 0.f : exp2f(ms - mm)) * inv;
        if (w[c] != 0.f) v[c] = *reinterpret_cast<const float4*>(ws_o + (row0 + (i64)(s0 + c) * TA_BM) * TA_D + d4 * 4);
      }
    }
#pragma unroll
    for (int c = 0; c < TA_MERGE_CHUNK; ++c) {
      if (s0 + c < splits && w[c] != 0.f) {
        acc.x = fmaf(w[c], v[c].x, acc.x);
        acc.y = fmaf(w[c], v[c].y, acc.y);
        acc.z = fmaf(w[c], v[c].z, acc.z);
        acc.w = fmaf(w[c], v[c].w, acc.w);
      }
    }
  }
  return acc;
}

// The splits' merge, a launch after the split kernel's (same stream): thread (row r, float4 column
// c) of row tile `slot` = (tree, KV head, row tile) sums its column over the splits. Weight of split
// s for row r: w_s = 2^(m_s - M) / L with M = max m_s and L = sum 2^(m_s - M) l_s (an empty split,
// or one no key of which row r sees, has m_s = -inf: weight 0, its O is neither written nor read).
// All of a thread's loads of one phase are in flight together; sums in split order.
// grid (ceil(TA_BM TA_D / 4 / TA_THREADS), slots), block TA_THREADS.
template <bool MANY>
__device__ __forceinline__ void ta_merge_tile(const float* __restrict__ ws_o, const float* __restrict__ ws_ml,
                                              const int* __restrict__ meta, tin* __restrict__ out, i64 o_row, i64 o_head,
                                              int num_trees, int hkv, int group, int splits, int mtiles) {
  const int slot = blockIdx.y;
  const int mt = slot % mtiles, h = (slot / mtiles) % hkv, tree = slot / (mtiles * hkv);
  const int start = meta[num_trees + tree], n = meta[2 * num_trees + tree];
  const int idx = blockIdx.x * TA_THREADS + threadIdx.x;
  const int r = idx / (TA_D / 4), d4 = idx - r * (TA_D / 4);
  const int m = mt * TA_BM + r;
  if (r >= TA_BM || m >= n * group) return;
  const i64 row0 = (i64)slot * splits * TA_BM + r;  // partial row of split 0; split s at + s TA_BM
  const float4 acc = MANY ? ta_merge_many(ws_o, ws_ml, row0, d4, splits) : ta_merge_few(ws_o, ws_ml, row0, d4, splits);
  const int j = m / group, g = m - j * group;
  ta_store4(out + (i64)(start + j) * o_row + (i64)(h * group + g) * o_head + d4 * 4, acc);
}

// Up to TA_MERGE_CHUNK splits (ta_merge_few, 93 registers), and more (ta_merge_many): two entry points, so
// that the common case keeps the smaller kernel (one with both paths took 113 registers and ran ~1 us slower
// per call at one tree, bench/NOTES.md section 44). The wrapper launches the one the split count needs.
extern "C" __global__ void __launch_bounds__(TA_THREADS)
tree_attention_merge(const float* __restrict__ ws_o, const float* __restrict__ ws_ml,
                     const int* __restrict__ meta, tin* __restrict__ out, i64 o_row, i64 o_head,
                     int num_trees, int hkv, int group, int splits, int mtiles) {
  if (splits > TA_MERGE_CHUNK) __trap();  // the wrapper launches tree_attention_merge_many for these
  ta_merge_tile<false>(ws_o, ws_ml, meta, out, o_row, o_head, num_trees, hkv, group, splits, mtiles);
}

extern "C" __global__ void __launch_bounds__(TA_THREADS)
tree_attention_merge_many(const float* __restrict__ ws_o, const float* __restrict__ ws_ml,
                          const int* __restrict__ meta, tin* __restrict__ out, i64 o_row, i64 o_head,
                          int num_trees, int hkv, int group, int splits, int mtiles) {
  ta_merge_tile<true>(ws_o, ws_ml, meta, out, o_row, o_head, num_trees, hkv, group, splits, mtiles);
}
