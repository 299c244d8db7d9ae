// The Weaver node attention of one (head, request) as a device function, called by
// cuda/weaver_attention.cu (one launch per layer).
// The method, the arithmetic and the shared-memory layout are described in weaver_attention.cu.
#pragma once
#include "tfm_common.cuh"
#include "tfm_mma.cuh"

#ifndef WA_HD
#error "WA_HD (the head dimension) must be defined"
#endif
#ifndef WA_THREADS
#define WA_THREADS 128
#endif
#define WA_WARPS (WA_THREADS / 32)
#define WA_ROW_VEC (WA_HD * (int)sizeof(tin) / 16)  // 16-byte pieces of a K / V row
#define WA_PAIRS ((WA_HD + 63) / 64)                // element pairs per lane: d = 2 lane + 64 t
#define WA_KEY_ITERS 9                              // key columns per lane: cols <= 32 WA_KEY_ITERS

__device__ __forceinline__ float wa_neg_inf() { return __int_as_float(0xff800000); }

// x * c + r * s with torch's roundings: the product rounded to the storage type (mul), then
// t + r * s as one float32 fused multiply-add rounded again (addcmul_ as nvcc compiles it).
__device__ __forceinline__ tin rope_value(tin x, tin rx, tin c, tin s) {
  const tin t = from_f32<tin>(to_f32(x) * to_f32(c));
  return from_f32<tin>(fmaf(to_f32(rx), to_f32(s), to_f32(t)));
}

// Two consecutive elements (the first at an even index: 4- or 8-byte aligned) in one load.
__device__ __forceinline__ void wa_load_pair(const float* p, float (&o)[2]) {
  const float2 v = *reinterpret_cast<const float2*>(p);
  o[0] = v.x;
  o[1] = v.y;
}
template <typename T>
__device__ __forceinline__ void wa_load_pair(const T* p, T (&o)[2]) {
  const u32 v = *reinterpret_cast<const u32*>(p);
  o[0].bits = (u16)(v & 0xffffu);
  o[1].bits = (u16)(v >> 16);
}

// q . k in float32 over WA_HD elements in element order: q float32 in shared memory, k a staged row
// (16-byte aligned), read 16 bytes at a time with tfm_common.cuh's load4 / load8.
__device__ __forceinline__ float wa_key_dot(const float* q, const tin* k) {
  constexpr int E = 16 / (int)sizeof(tin);  // elements per 16-byte piece
  float acc = 0.0f;
#pragma unroll
  for (int c = 0; c < WA_HD; c += E) {
    float kv[E];
    if constexpr (E == 4) load4(k + c, kv); else load8(k + c, kv);
#pragma unroll
    for (int e = 0; e < E; e += 4) {
      const float4 q4 = *reinterpret_cast<const float4*>(q + c + e);
      acc = fmaf(q4.x, kv[e], acc);
      acc = fmaf(q4.y, kv[e + 1], acc);
      acc = fmaf(q4.z, kv[e + 2], acc);
      acc = fmaf(q4.w, kv[e + 3], acc);
    }
  }
  return acc;
}

// The attention of head h of request r (of R) for the call's w nodes, by the block's WA_THREADS
// threads, with s_raw the block's dynamic shared memory (wa_smem_bytes). One block barrier inside:
// every thread of the block calls it with the same (h, r). `proj` and `out` are not restrict here
// (the kernel's own parameters are).
__device__ __forceinline__ void wa_node_attention(
    int h, int r, int R, uint4* s_raw, const tin* proj, i64 proj_ld, const tin* __restrict__ rope,
    const i64* __restrict__ node_ids, const i64* __restrict__ parent_ids, const i64* __restrict__ depths,
    const unsigned char* __restrict__ valid, tin* kv, tin* key_bias, tin* out,
    int w, int heads, int S, int p0, int n_slots, int cols, int D, float scale, int write_mask) {
  const int span = p0 + n_slots;
  uint4* s_k = s_raw;                                                // [span][WA_ROW_VEC + 1] (padded rows)
  tin* s_v = reinterpret_cast<tin*>(s_k + span * (WA_ROW_VEC + 1));  // [span][WA_HD]
  float* s_q = reinterpret_cast<float*>(s_v + span * WA_HD);         // [w][WA_HD]
  float* s_vs = s_q + w * WA_HD;                                     // [w][WA_HD]: own v
  float* s_p = s_vs + w * WA_HD;                                     // [w][span]
  float* s_own = s_p + w * span;                                     // [w]: own score
  int* s_key = reinterpret_cast<int*>(s_own + w);                    // [w]: own key column
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const i64 head_stride = (i64)S * WA_HD;
  tin* kh = kv + ((i64)r * heads + h) * head_stride;               // kv[0, r, h]
  tin* vh = kv + ((i64)(R + r) * heads + h) * head_stride;         // kv[1, r, h]
  const int nb = n_slots + 2;
  const i64 part_stride = (i64)heads * WA_HD;                      // q -> k -> v columns of proj

  // ---- A: K and V of the span keys into shared memory, every copy in flight at once (cp.async)
  {
    const uint4* ksrc = reinterpret_cast<const uint4*>(kh);
    const uint4* vsrc = reinterpret_cast<const uint4*>(vh);
    uint4* vdst = reinterpret_cast<uint4*>(s_v);
    for (int e = tid; e < span * WA_ROW_VEC; e += WA_THREADS) {
      const int j = e / WA_ROW_VEC, c = e - j * WA_ROW_VEC;
      cp_async16(s_k + j * (WA_ROW_VEC + 1) + c, ksrc + e);
      cp_async16(vdst + e, vsrc + e);
    }
    cp_async_commit();
  }
  // Launched with programmatic dependent launch (vllm_tfm/kernels/weaver_attention.py), the copies above may run
  // while the qkv linear before it still does: they read only cache rows that kernels before that linear wrote (the
  // prompt pass, earlier calls' node rows). Everything below reads its output (proj) or writes.
  pdl_wait();

  // ---- B: one warp per node: q, k, v rotated (lane l: the element pairs 2 l + 64 t), the valid
  //      node's k and v into the cache, q and own v to shared memory, the own key's score
  for (int i = warp; i < w; i += WA_WARPS) {
    const i64 row = (i64)r * w + i;
    const bool ok = valid[row] != 0;
    const int key = p0 + (ok ? (int)node_ids[row] : n_slots);    // invalid: the trash column (= span)
    i64 dep = depths[row];
    dep = dep < 0 ? 0 : (dep >= D ? D - 1 : dep);
    i64 par = parent_ids[row] % nb;
    if (par < 0) par += nb;
    const tin* brow = key_bias + ((i64)r * nb + par) * cols;
    const tin* pr = proj + row * proj_ld + (i64)h * WA_HD;
    const tin* cs = rope + dep * 6 * WA_HD;  // rope[dep, 0 (cos) / 1 (sin), part, 0, :]
    // every load first (the parent's mask row, lane j + 32 m; two elements per load of the rows
    // and the table), then the arithmetic
    tin bias[WA_KEY_ITERS];
#pragma unroll
    for (int m = 0; m < WA_KEY_ITERS; ++m) {
      const int j = lane + 32 * m;
      if (j < cols) bias[m] = brow[j];
    }
    tin xr[WA_PAIRS][3][2][2], tr[WA_PAIRS][3][2][2];  // [t][part][x, rot / cos, sin][element]
#pragma unroll
    for (int t = 0; t < WA_PAIRS; ++t) {
      const int d = 2 * lane + 64 * t;
      if (d < WA_HD) {
#pragma unroll
        for (int part = 0; part < 3; ++part) {
#pragma unroll
          for (int u = 0; u < 2; ++u) {
            wa_load_pair(pr + (part + 3 * u) * part_stride + d, xr[t][part][u]);
            wa_load_pair(cs + (part + 3 * u) * WA_HD + d, tr[t][part][u]);
          }
        }
      }
    }
    float own = 0.0f;  // this lane's part of q . k
#pragma unroll
    for (int t = 0; t < WA_PAIRS; ++t) {
      const int d = 2 * lane + 64 * t;
      if (d < WA_HD) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          tin x[3];
#pragma unroll
          for (int part = 0; part < 3; ++part)
            x[part] = rope_value(xr[t][part][0][c], xr[t][part][1][c], tr[t][part][0][c], tr[t][part][1][c]);
          s_q[i * WA_HD + d + c] = to_f32(x[0]);
          s_vs[i * WA_HD + d + c] = to_f32(x[2]);
          own = fmaf(to_f32(x[0]), to_f32(x[1]), own);
          if (ok) {
            kh[(i64)key * WA_HD + d + c] = x[1];
            vh[(i64)key * WA_HD + d + c] = x[2];
          }
        }
      }
    }
    own = warp_sum(own);
    if (lane == 0) {
      s_own[i] = own * scale;
      s_key[i] = key;
    }
    // the mask over the span (0 for the own key) for phase C; the valid node's key-mask row (the
    // call's first layer): the parent's row plus its own column
    float* prow = s_p + i * span;
    tin* dst = key_bias + ((i64)r * nb + (key - p0)) * cols;
    const bool mask_row = write_mask && h == 0 && ok;
#pragma unroll
    for (int m = 0; m < WA_KEY_ITERS; ++m) {
      const int j = lane + 32 * m;
      if (j < span) prow[j] = j == key ? 0.0f : to_f32(bias[m]);
      if (mask_row && j < cols) dst[j] = j == key ? from_f32<tin>(0.0f) : bias[m];
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the staged K / V rows, every node's q, own v and own score

  // ---- C: one warp per node: scores with lanes over keys, softmax, the mask row, then the
  //      output with lanes over element pairs
  for (int i = warp; i < w; i += WA_WARPS) {
    const i64 row = (i64)r * w + i;
    const int key = s_key[i];
    const float own_score = s_own[i];
    const float* q = s_q + i * WA_HD;
    float* prow = s_p + i * span;
    float mx = wa_neg_inf();
    for (int j = lane; j < span; j += 32) {
      const float b = prow[j];  // the mask, from phase B
      float sc = wa_neg_inf();
      if (j == key) {
        sc = own_score;  // its staged row predates this call's write: the score from phase B
      } else if (b != wa_neg_inf()) {
        sc = wa_key_dot(q, reinterpret_cast<const tin*>(s_k + j * (WA_ROW_VEC + 1))) * scale + b;
      }
      prow[j] = sc;
      mx = fmaxf(mx, sc);
    }
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float l = 0.0f;
    for (int j = lane; j < span; j += 32) {
      const float pj = expf(prow[j] - mx);  // masked keys: exp(-inf) = 0
      prow[j] = pj;
      l += pj;
    }
    l = warp_sum(l);
    const float p_own = key < span ? expf(own_score - mx) : 0.0f;  // = prow[key]
    __syncwarp();  // the probability row, for every lane
    float acc[2 * WA_PAIRS];
#pragma unroll
    for (int u = 0; u < 2 * WA_PAIRS; ++u) acc[u] = 0.0f;
    for (int j = 0; j < span; ++j) {
      const float pj = prow[j];
      if (pj == 0.0f || j == key) continue;  // the same j for every lane: no divergence
      const tin* vr = s_v + j * WA_HD;
#pragma unroll
      for (int t = 0; t < WA_PAIRS; ++t) {
        const int d = 2 * lane + 64 * t;
        if (d < WA_HD) {
          tin v2[2];
          wa_load_pair(vr + d, v2);
          acc[2 * t] = fmaf(pj, to_f32(v2[0]), acc[2 * t]);
          acc[2 * t + 1] = fmaf(pj, to_f32(v2[1]), acc[2 * t + 1]);
        }
      }
    }
    const float* vs = s_vs + i * WA_HD;
    tin* o = out + row * heads * WA_HD + (i64)h * WA_HD;
#pragma unroll
    for (int t = 0; t < WA_PAIRS; ++t) {
      const int d = 2 * lane + 64 * t;
      if (d < WA_HD) {
        o[d] = from_f32<tin>(fmaf(p_own, vs[d], acc[2 * t]) / l);
        o[d + 1] = from_f32<tin>(fmaf(p_own, vs[d + 1], acc[2 * t + 1]) / l);
      }
    }
  }
}
