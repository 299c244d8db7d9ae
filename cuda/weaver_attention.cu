// One Weaver layer's attention for the nodes of one scorer call (vllm_tfm/models/weaver.py,
// BatchedWeaverTreeScorer), RoPE, K/V write and key mask included, in ONE launch: one CTA per
// (head, request).
//
// The torch path per layer is five kernels (RoPE as a mul and an addcmul over the qkv GEMM's
// output and its rotate_half rows, the K/V scatter into the per-request cache, SDPA with the
// additive key mask, the [R, heads, w, hd] -> [R w, heads hd] copy) plus, once per call, the
// gather / scatter / scatter of the nodes' key-mask rows; at R x w = 2 nodes each is a few
// microseconds of launch-bound work (bench/results/weaver_profile*.json.gz). Bytes per CTA: the
// prompt's and the node slots' K and V of one head (2 (1 + D + max_nodes) hd elements, 25 KB at the
// 27B drafter shape), the w rows' q/k/v and rotate_half rows: latency-bound, not bandwidth-bound.
//
// For node i = (request r, column i) of the call, head h (proj rows n = r w + i, viewed
// [R w, 2, 3, heads, hd]: (q, k, v), then their rotate_half rows):
//   slot = node_ids[r, i] if valid[r, i] else n_slots (the trash slot); key = p0 + slot;
//   q, k, v = x * cos + rot(x) * sin from rope[d, 0 / 1, part] ([D, 2, 3, 1, hd]: cos, sin of the
//          node's position for q and k, cos 1 and sin 0 for v; d = depths clamped to [0, D - 1]),
//          rounded to the activation dtype after the product and after the sum, as torch's mul
//          and addcmul_;
//   valid nodes write k, v to kv[0 / 1, r, h, key];
//   bias[j] = 0 if j == key else key_bias[r, parent mod (n_slots + 2), j], j < span = p0 + n_slots
//          (the parent's row: the prompt and the parent's ancestors-or-self; -1 -> row n_slots + 1,
//          the prompt only);
//   out[n, h hd : (h + 1) hd] = softmax(q . K[j] scale + bias[j]) . V over j < span, in float32
//          (probabilities not rounded), rounded once.
// With write_mask (the call's first layer), CTA h = 0 of request r writes the valid nodes' rows:
//   key_bias[r, slot, j] = bias[j] for j < cols. Those rows are new nodes' (never a parent of a
// node of the same call, the scorer's protocol), so no CTA of the launch reads them.
//
// Invalid rows: computed on clamped inputs, no K/V or mask write, output unspecified.
//
// Shared memory (dynamic): q of the w rows (float32, [w][hd]), one probability row per warp
// ([WA_WARPS][span] float32), then K and V of the span keys as stored ([span][hd + pad] each: rows
// padded to an odd number of 4-byte words, so that lanes reading one key each hit distinct banks).
//
// Requirements (checked by the wrapper, vllm_tfm/kernels/weaver_attention.py): hd even with rows
// of hd elements a multiple of 16 bytes; kv [2, R, heads, S, hd], key_bias [R, n_slots + 2, cols]
// proj [R w, 6 heads hd] and rope contiguous; node ids < n_slots for valid rows.
//
// Compile-time constant (NVRTC -D): TFM_IN, the activations' type (0 float32, 1 bfloat16,
// 2 float16).
#include "tfm_common.cuh"

#define WA_THREADS 128
#define WA_WARPS (WA_THREADS / 32)
#define WA_PAD (4 / (int)sizeof(tin))  // elements appended to a staged K / V row: one 4-byte word

__device__ __forceinline__ float wa_neg_inf() { return __int_as_float(0xff800000); }

// x * c + r * s with torch's roundings: the product rounded to the storage type (mul), then
// t + r * s as one float32 fused multiply-add rounded again (addcmul_ as nvcc compiles it).
__device__ __forceinline__ tin rope_value(tin x, tin rx, tin c, tin s) {
  const tin t = from_f32<tin>(to_f32(x) * to_f32(c));
  return from_f32<tin>(fmaf(to_f32(rx), to_f32(s), to_f32(t)));
}

// q . K[j] in float32 over hd elements: q float32 in shared memory (16-byte aligned, hd % 4 == 0),
// the key a staged row of 4-byte words (one element each for float32, two for 16-bit types).
__device__ __forceinline__ float key_dot(const float* q, const u32* kr, int hd, float) {
  float acc = 0.0f;
  for (int t = 0; t < hd; t += 4) {
    const float4 q4 = *reinterpret_cast<const float4*>(q + t);
    acc = fmaf(q4.x, __uint_as_float(kr[t]), acc);
    acc = fmaf(q4.y, __uint_as_float(kr[t + 1]), acc);
    acc = fmaf(q4.z, __uint_as_float(kr[t + 2]), acc);
    acc = fmaf(q4.w, __uint_as_float(kr[t + 3]), acc);
  }
  return acc;
}
__device__ __forceinline__ float2 word_to_f32(u32 v, bf16s) {
  float2 f;
  f.x = __uint_as_float(v << 16);
  f.y = __uint_as_float(v & 0xffff0000u);
  return f;
}
__device__ __forceinline__ float2 word_to_f32(u32 v, f16s) {
  float2 f;
  f.x = f16_bits_to_f32(v & 0xffffu);
  f.y = f16_bits_to_f32(v >> 16);
  return f;
}
template <typename T>
__device__ __forceinline__ float key_dot(const float* q, const u32* kr, int hd, T tag) {
  float acc = 0.0f;
  for (int t = 0; t < hd; t += 4) {
    const float4 q4 = *reinterpret_cast<const float4*>(q + t);
    const float2 a = word_to_f32(kr[t / 2], tag), b = word_to_f32(kr[t / 2 + 1], tag);
    acc = fmaf(q4.x, a.x, acc);
    acc = fmaf(q4.y, a.y, acc);
    acc = fmaf(q4.z, b.x, acc);
    acc = fmaf(q4.w, b.y, acc);
  }
  return acc;
}

extern "C" __global__ void __launch_bounds__(WA_THREADS) weaver_node_attention(
    const tin* __restrict__ proj, i64 proj_ld, const tin* __restrict__ rope,
    const i64* __restrict__ node_ids, const i64* __restrict__ parent_ids, const i64* __restrict__ depths,
    const unsigned char* __restrict__ valid, tin* kv, tin* key_bias, tin* __restrict__ out,
    int w, int heads, int hd, int S, int p0, int n_slots, int cols, int D, float scale, int write_mask) {
  TFM_DYNAMIC_SMEM(float, s_q);           // [w][hd]
  float* s_p = s_q + w * hd;               // [WA_WARPS][span]
  const int span = p0 + n_slots;
  const int row_e = hd + WA_PAD;           // elements per staged row
  tin* s_k = reinterpret_cast<tin*>(s_p + WA_WARPS * span);  // [span][row_e]
  tin* s_v = s_k + span * row_e;
  const int h = blockIdx.x, r = blockIdx.y, R = gridDim.y;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const i64 head_stride = (i64)S * hd;
  tin* kh = kv + ((i64)r * heads + h) * head_stride;               // kv[0, r, h]
  tin* vh = kv + ((i64)(R + r) * heads + h) * head_stride;         // kv[1, r, h]
  const int nb = n_slots + 2;

  // ---- stage K and V of the span keys (16-byte global loads, 4-byte shared stores)
  const int vec = 16 / (int)sizeof(tin);   // elements per 16-byte load
  const int per_row = hd / vec;
  for (int e = tid; e < 2 * span * per_row; e += WA_THREADS) {
    const int which = e / (span * per_row), rem = e - which * span * per_row;
    const int j = rem / per_row, c0 = (rem - j * per_row) * vec;
    const uint4 val = *reinterpret_cast<const uint4*>((which ? vh : kh) + (i64)j * hd + c0);
    u32* dst = reinterpret_cast<u32*>((which ? s_v : s_k) + j * row_e + c0);
    dst[0] = val.x; dst[1] = val.y; dst[2] = val.z; dst[3] = val.w;
  }
  __syncthreads();

  // ---- RoPE of q and k; the valid nodes' k and v into the cache and the staged rows
  for (int e = tid; e < w * 3 * hd; e += WA_THREADS) {
    const int i = e / (3 * hd), rem = e - i * 3 * hd;
    const int part = rem / hd, d = rem - part * hd;
    const i64 row = (i64)r * w + i;
    const tin* p = proj + row * proj_ld + (i64)part * heads * hd + (i64)h * hd + d;
    i64 dep = depths[row];
    dep = dep < 0 ? 0 : (dep >= D ? D - 1 : dep);
    const tin* cs = rope + (dep * 6 + part) * hd + d;  // rope[dep, 0 (cos), part, 0, d]; sin 3 hd on
    const tin x = rope_value(p[0], p[(i64)3 * heads * hd], cs[0], cs[3 * hd]);
    if (part == 0) {
      s_q[i * hd + d] = to_f32(x);
    } else if (valid[row]) {
      const int key = p0 + (int)node_ids[row];
      (part == 1 ? kh : vh)[(i64)key * hd + d] = x;
      (part == 1 ? s_k : s_v)[key * row_e + d] = x;
    }
  }
  __syncthreads();

  // ---- attention: one warp per node row; lanes over keys for the scores, over dims for the output
  const u32* kw = reinterpret_cast<const u32*>(s_k);
  const int row_w = row_e * (int)sizeof(tin) / 4;  // 4-byte words per staged row
  float* prow = s_p + warp * span;
  for (int i = warp; i < w; i += WA_WARPS) {
    const i64 row = (i64)r * w + i;
    const bool v = valid[row] != 0;
    const int key = p0 + (v ? (int)node_ids[row] : n_slots);
    i64 par = parent_ids[row] % nb;
    if (par < 0) par += nb;
    const tin* brow = key_bias + ((i64)r * nb + par) * cols;
    const float* q = s_q + i * hd;
    float mx = wa_neg_inf();
    for (int j = lane; j < span; j += 32) {
      const float b = j == key ? 0.0f : to_f32(brow[j]);
      float sc = wa_neg_inf();
      if (b != wa_neg_inf()) {
        const float acc = key_dot(q, kw + j * row_w, hd, tin{});
        sc = acc * scale + b;
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
    __syncwarp();
    for (int d = lane; d < hd; d += 32) {
      float acc = 0.0f;
      for (int j = 0; j < span; ++j) acc = fmaf(prow[j], to_f32(s_v[j * row_e + d]), acc);
      out[row * heads * hd + (i64)h * hd + d] = from_f32<tin>(acc / l);
    }
    __syncwarp();  // the probability row is reused by the warp's next node
  }

  // ---- the valid nodes' key-mask rows (first layer of the call only)
  if (write_mask && h == 0) {
    for (int e = tid; e < w * cols; e += WA_THREADS) {
      const int i = e / cols, j = e - i * cols;
      const i64 row = (i64)r * w + i;
      if (!valid[row]) continue;
      const int slot = (int)node_ids[row];
      i64 par = parent_ids[row] % nb;
      if (par < 0) par += nb;
      const tin b = key_bias[((i64)r * nb + par) * cols + j];
      key_bias[((i64)r * nb + slot) * cols + j] = j == p0 + slot ? from_f32<tin>(0.0f) : b;
    }
  }
}
