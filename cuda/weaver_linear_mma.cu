// The Weaver scorer's linear layers (the function of cuda/weaver_linear.cu, same parameters) on bf16 /
// f16 tensor cores, for 16-bit activations and weights and up to 32 activation rows:
//
//   s[m]  = 1 / sqrt(mean_k x[m, k]^2 + eps)        (WL_NORM = 1; else s[m] = 1)
//   z[m, n] = s[m] * sum_k W[n, k] x[m, k] + bias[n]
//   WL_MODE 0:  y[m, n] = z[m, n] (+ residual[m, n])          n < N
//   WL_MODE 1:  y[m, n] = silu(z[m, n]) * z[m, n + N]         n < N (W has 2 N rows: gate, up)
//
// Why: cuda/weaver_linear.cu reads every activation row in every warp and does 8 conversions and
// 16-24 float32 FMAs per activation element per two weight rows, so its time grows with the rows
// (bench/results/weaver_linear.json: qkv 3.9 us at 1 row, 5.9 at 4, 11.0 at 8; weight-read floor 3.0).
// Here the products run on mma.m16n8k16 (bf16 or f16 operands: exact products, float32 sums), so a
// warp's instructions per weight byte do not grow with the rows up to 8 (one n-tile), and slowly after.
//
// A CTA owns a tile of 16 weight rows (WL_MODE 0: rows 16 b .. 16 b + 15; WL_MODE 1: gate rows
// 8 b .. 8 b + 7 as the tile's rows 0..7 and their up rows N + 8 b .. as rows 8..15, so that a lane
// holds the gate and up sums of one output) and all M activation rows (n-tiles of 8); its WLM_WARPS
// warps split K: warp w takes the 32-element steps w, w + WLM_WARPS, ...; the partial fragments are
// summed in warp order through shared memory (deterministic), then warp 0 writes the tile's outputs.
//
// The k order inside an mma is free as long as A and B use the same one, so lane (g = l / 4,
// t = l % 4) loads 16 bytes (8 consecutive k) of weight rows g and g + 8 and of activation row g of
// each n-tile, and two mma cover the 32 k of a step: mma 0 takes the pairs (8 t, 8 t + 1) and
// (8 t + 2, 8 t + 3) as the fragment's k pairs (2 t, 2 t + 1) and (2 t + 8, 2 t + 9), mma 1 the
// pairs 8 t + 4 .. 8 t + 7 (fragment layouts in cuda/tfm_mma.cuh). The sum of squares of each
// activation row is accumulated from the same loads (each element is loaded by one lane of the CTA).
//
// Requirements (checked by the wrapper, vllm_tfm/kernels/weaver_linear.py): 16-bit types; K % 8 == 0;
// W and x rows contiguous and 16-byte aligned; residual and y rows contiguous; M == WL_M <= 32.
//
// Compile-time constants (NVRTC -D): TFM_IN (1 bfloat16, 2 float16); WL_M (1..32); WL_MODE (0 or 1);
// WL_NORM (0 or 1).
#include "tfm_common.cuh"
#include "tfm_mma.cuh"

#ifndef WL_M
#define WL_M 2
#endif
#ifndef WL_MODE
#define WL_MODE 0
#endif
#ifndef WL_NORM
#define WL_NORM 0
#endif
#if WL_M < 1 || WL_M > 32
#error "WL_M must be 1..32"
#endif
#if TFM_IN == 0
#error "weaver_linear_mma takes 16-bit types (bfloat16 or float16)"
#endif
#if WL_MODE != 0 && WL_MODE != 1
#error "WL_MODE must be 0 (linear) or 1 (SwiGLU)"
#endif

#define WLM_WARPS 8                 // the wrapper's MMA_WARPS
#define WLM_NT ((WL_M + 7) / 8)     // n-tiles of 8 activation rows
#define WLM_BF16 (TFM_IN == 1)
#define WLM_U (WLM_NT == 1 ? 8 : 4)  // 32-element steps per load group of a warp

__device__ __forceinline__ void wlm_add_squares(u32 v, float& ss) {
  float a, b;
#if WLM_BF16
  a = __uint_as_float(v << 16);
  b = __uint_as_float(v & 0xffff0000u);
#else
  a = f16_bits_to_f32(v & 0xffffu);
  b = f16_bits_to_f32(v >> 16);
#endif
  ss = fmaf(a, a, ss);
  ss = fmaf(b, b, ss);
}

extern "C" __global__ void __launch_bounds__(WLM_WARPS * 32, 1) weaver_linear_mma(
    const tin* __restrict__ x, i64 x_ld, const tin* __restrict__ w, i64 w_ld, const tin* __restrict__ bias,
    const tin* __restrict__ residual, i64 res_ld, tin* __restrict__ y, i64 y_ld, int n_out, int k_dim, float eps) {
  __shared__ float s_c[WLM_WARPS - 1][WLM_NT][4][32];  // partial fragments of warps 1..WLM_WARPS - 1
  __shared__ float s_ss[WLM_WARPS - 1][WLM_NT][32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#if WL_MODE == 0
  const int rows_total = n_out;
  const int r_lo = 16 * blockIdx.x + g, r_hi = r_lo + 8;
  const int l_lo = r_lo < rows_total ? r_lo : rows_total - 1, l_hi = r_hi < rows_total ? r_hi : rows_total - 1;
#else
  const int u = 8 * blockIdx.x + g;  // output column of this lane's gate / up rows
  const int uc = u < n_out ? u : n_out - 1;
  const int l_lo = uc, l_hi = uc + n_out;
#endif
  const tin* __restrict__ w_lo = w + (i64)l_lo * w_ld + 8 * t;
  const tin* __restrict__ w_hi = w + (i64)l_hi * w_ld + 8 * t;
  const tin* x_row[WLM_NT];
  bool x_ok[WLM_NT];
#pragma unroll
  for (int nt = 0; nt < WLM_NT; ++nt) {
    const int m = 8 * nt + g;
    x_ok[nt] = m < WL_M;
    x_row[nt] = x + (i64)(x_ok[nt] ? m : 0) * x_ld + 8 * t;
  }
  float c[WLM_NT][4];
  float ss[WLM_NT];
#pragma unroll
  for (int nt = 0; nt < WLM_NT; ++nt) {
    c[nt][0] = c[nt][1] = c[nt][2] = c[nt][3] = 0.0f;
    ss[nt] = 0.0f;
  }
  const int steps = (k_dim + 31) / 32;
  uint4 zero;
  zero.x = zero.y = zero.z = zero.w = 0u;
  // WLM_U steps per group: every load of a group is issued before its first mma
  for (int s0 = warp; s0 < steps; s0 += WLM_U * WLM_WARPS) {
    uint4 a_lo[WLM_U], a_hi[WLM_U], xv[WLM_U][WLM_NT];
#pragma unroll
    for (int q = 0; q < WLM_U; ++q) {
      // out-of-range pieces load a valid address (k = 0) and are zeroed after the load: no branch
      // between the loads, so they all go out before the first mma
      const int k_raw = 32 * (s0 + q * WLM_WARPS);
      const bool k_ok = k_raw + 8 * t < k_dim;  // K % 8 == 0: a lane's 8 elements are all in or all out
      const int k = k_ok ? k_raw : 0;
      a_lo[q] = *reinterpret_cast<const uint4*>(w_lo + k);
      a_hi[q] = *reinterpret_cast<const uint4*>(w_hi + k);
#pragma unroll
      for (int nt = 0; nt < WLM_NT; ++nt) xv[q][nt] = *reinterpret_cast<const uint4*>(x_row[nt] + k);
      if (!k_ok) a_lo[q] = a_hi[q] = zero;
#pragma unroll
      for (int nt = 0; nt < WLM_NT; ++nt)
        if (!(k_ok && x_ok[nt])) xv[q][nt] = zero;
    }
#pragma unroll
    for (int q = 0; q < WLM_U; ++q) {
      const u32 a0[4] = {a_lo[q].x, a_hi[q].x, a_lo[q].y, a_hi[q].y};
      const u32 a1[4] = {a_lo[q].z, a_hi[q].z, a_lo[q].w, a_hi[q].w};
#pragma unroll
      for (int nt = 0; nt < WLM_NT; ++nt) {
        mma_16816<WLM_BF16>(c[nt], a0, xv[q][nt].x, xv[q][nt].y);
        mma_16816<WLM_BF16>(c[nt], a1, xv[q][nt].z, xv[q][nt].w);
#if WL_NORM
        wlm_add_squares(xv[q][nt].x, ss[nt]);
        wlm_add_squares(xv[q][nt].y, ss[nt]);
        wlm_add_squares(xv[q][nt].z, ss[nt]);
        wlm_add_squares(xv[q][nt].w, ss[nt]);
#endif
      }
    }
  }
  if (warp > 0) {
#pragma unroll
    for (int nt = 0; nt < WLM_NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s_c[warp - 1][nt][e][lane] = c[nt][e];
      s_ss[warp - 1][nt][lane] = ss[nt];
    }
  }
  __syncthreads();
  if (warp > 0) return;
#pragma unroll
  for (int q = 0; q < WLM_WARPS - 1; ++q) {
#pragma unroll
    for (int nt = 0; nt < WLM_NT; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) c[nt][e] += s_c[q][nt][e][lane];
      ss[nt] += s_ss[q][nt][lane];
    }
  }
  // fragment c[nt]: c0 = (tile row g, m = 8 nt + 2 t), c1 = (g, m + 1), c2 = (g + 8, m), c3 = (g + 8, m + 1)
#pragma unroll
  for (int nt = 0; nt < WLM_NT; ++nt) {
    float sq = ss[nt];  // activation row 8 nt + g: its lanes t = 0..3 hold parts
    sq += __shfl_xor_sync(0xffffffffu, sq, 1);
    sq += __shfl_xor_sync(0xffffffffu, sq, 2);
    // the two rows of this lane's columns: activation rows 8 nt + 2 t (lane 8 t) and 8 nt + 2 t + 1 (8 t + 4)
    const float sq0 = __shfl_sync(0xffffffffu, sq, 8 * t), sq1 = __shfl_sync(0xffffffffu, sq, 8 * t + 4);
#if WL_NORM
    const float sc[2] = {1.0f / sqrtf(sq0 / (float)k_dim + eps), 1.0f / sqrtf(sq1 / (float)k_dim + eps)};
#else
    (void)sq0;
    (void)sq1;
    const float sc[2] = {1.0f, 1.0f};
#endif
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = 8 * nt + 2 * t + h;
      if (m >= WL_M) continue;
#if WL_MODE == 0
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int n = half ? r_hi : r_lo;
        if (n >= n_out) continue;
        float val = sc[h] * c[nt][2 * half + h];
        if (bias != nullptr) val += to_f32(bias[n]);
        if (residual != nullptr) val += to_f32(residual[(i64)m * res_ld + n]);
        y[(i64)m * y_ld + n] = from_f32<tin>(val);
      }
#else
      if (u < n_out) {
        float gate = sc[h] * c[nt][h], up = sc[h] * c[nt][2 + h];
        if (bias != nullptr) {
          gate += to_f32(bias[u]);
          up += to_f32(bias[u + n_out]);
        }
        y[(i64)m * y_ld + u] = from_f32<tin>(silu(gate) * up);
      }
#endif
    }
  }
}
