// The layer body of cuda/weaver_linear.cu as a device function, shared by its kernel (one launch per
// layer) and cuda/weaver_step.cu (every layer of a Weaver step in one launch). The method, the
// arithmetic and the requirements are described in weaver_linear.cu.
//
// Compile-time constants of the including source (NVRTC -D): TFM_IN, WL_M (1..16), WL_W8 (0 or 1).
// Per layer (template parameters of wl_layer): MODE (0 linear, 1 SwiGLU), NORM (0 or 1), KSPLIT (1, 2
// or 4), PDL (the programmatic-dependent-launch prologue: first loads, the L2 prefetch, the wait).
#pragma once
#include "tfm_common.cuh"

#ifndef WL_M
#define WL_M 2
#endif
#if WL_M < 1 || WL_M > 16
#error "WL_M must be 1..16"
#endif
#ifndef WL_W8
#define WL_W8 0
#endif

#define WL_WARPS 4  // the wrapper's WARPS
#define WL_RW 2     // weight rows per warp
#define WL_G 4      // steps per group of weight loads (2 x WL_G 16-byte loads per lane; 32 for float32)
#if WL_W8
#define WL_LC 16    // columns per lane and step
typedef unsigned char twt;  // e4m3 bytes
struct wraw { uint4 v; };
__device__ __forceinline__ wraw load_w(const twt* __restrict__ p) {
  wraw r;
  r.v = *reinterpret_cast<const uint4*>(p);
  return r;
}
__device__ __forceinline__ void decode_w(const wraw& r, float* o) {
  uint2 lo, hi;
  lo.x = r.v.x;
  lo.y = r.v.y;
  hi.x = r.v.z;
  hi.y = r.v.w;
  e4m3x8_to_f32(lo, o);
  e4m3x8_to_f32(hi, o + 8);
}
#else
#define WL_LC 8
typedef tin twt;
typedef raw8 wraw;
__device__ __forceinline__ wraw load_w(const twt* __restrict__ p) { return load_raw8(p); }
__device__ __forceinline__ void decode_w(const wraw& r, float* o) { decode8(r, o); }
#endif
#define WL_STEP (32 * WL_LC)  // columns per step of a warp

// Units (of WL_RW weight rows, one warp per unit and K part) of a layer with n_out outputs.
template <int MODE>
__device__ __forceinline__ int wl_units(int n_out) {
  return MODE == 0 ? (n_out + 1) / 2 : n_out;
}

// Blocks of WL_WARPS warps a layer takes.
template <int MODE, int KSPLIT>
__device__ __forceinline__ int wl_blocks(int n_out) {
  constexpr int upb = WL_WARPS / KSPLIT;
  return (wl_units<MODE>(n_out) + upb - 1) / upb;
}

// The weight rows of block vb's units into L2 (the copy engine; no registers, nothing to wait for):
// lane 0 of each unit's part-0 warp asks for its whole rows.
template <int MODE, int KSPLIT>
__device__ __forceinline__ void wl_prefetch(int vb, const twt* __restrict__ w, i64 w_ld, int n_out, int k_dim) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int unit = vb * (WL_WARPS / KSPLIT) + warp / KSPLIT;
  if (lane != 0 || warp % KSPLIT != 0 || unit >= wl_units<MODE>(n_out)) return;
  const int row0 = MODE == 0 ? 2 * unit : unit;
  const int row1 = MODE == 0 ? (2 * unit + 1 < n_out ? 2 * unit + 1 : 2 * unit) : unit + n_out;
  const u32 bytes = (u32)(k_dim * (int)sizeof(twt));
  prefetch_l2(w + (i64)row0 * w_ld, bytes);
  if (row1 != row0) prefetch_l2(w + (i64)row1 * w_ld, bytes);
}

// The layer's work of block vb (blockIdx.x of the one-layer kernel): WL_WARPS / KSPLIT units. s_ss
// ([WL_WARPS][WL_M] floats, with NORM) and s_acc ([WL_WARPS][WL_M][WL_RW], with KSPLIT > 1) are the
// block's shared memory; the block's threads all call it (one block barrier inside where either is used).
template <int MODE, int NORM, int KSPLIT, bool PDL>
__device__ __forceinline__ void wl_layer(
    int vb, const tin* __restrict__ x, i64 x_ld, const twt* __restrict__ w, i64 w_ld, const tin* __restrict__ bias,
    const tin* __restrict__ residual, i64 res_ld, tin* __restrict__ y, i64 y_ld, int n_out, int k_dim, float eps,
    const float* __restrict__ w_scale, const i64* __restrict__ x_rows, i64 x_table_rows, float* s_ss, float* s_acc) {
  static_assert(MODE == 0 || MODE == 1, "MODE must be 0 (linear) or 1 (SwiGLU)");
  static_assert(KSPLIT == 1 || KSPLIT == 2 || KSPLIT == 4, "KSPLIT must be 1, 2 or 4");
  constexpr int kUnitsPerBlock = WL_WARPS / KSPLIT;
  constexpr int kOuts = MODE == 0 ? 2 : 1;  // outputs per warp and row m
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int part = warp % KSPLIT;  // this warp's share of K: the steps j = part mod KSPLIT
  const int units = wl_units<MODE>(n_out);
  const int unit = vb * kUnitsPerBlock + warp / KSPLIT;
  const bool has_unit = unit < units;
  const int u = has_unit ? unit : units - 1;  // this warp's unit (past the end: the last)
  // MODE 0: rows 2u, 2u + 1 (an odd N repeats the last row); MODE 1: the gate row u and the up row u + N
  const int row0 = MODE == 0 ? 2 * u : u;
  const int row1 = MODE == 0 ? (2 * u + 1 < n_out ? 2 * u + 1 : 2 * u) : u + n_out;
  const twt* __restrict__ w0 = w + (i64)row0 * w_ld;
  const twt* __restrict__ w1 = w + (i64)row1 * w_ld;
  // lane l's columns: k = WL_LC l + WL_STEP j for the steps j = part + KSPLIT i, WL_G of them per group
  constexpr int kStride = WL_STEP * KSPLIT;      // between a warp's consecutive steps
  constexpr int kGroup = WL_STEP * KSPLIT * WL_G;  // between a warp's consecutive groups
  const int k_first = lane * WL_LC + WL_STEP * part;
  // the first group of weight loads, and the rest of the rows into L2 (weights: no kernel writes them)
  wraw ra[WL_G], rb[WL_G];
#pragma unroll
  for (int s = 0; s < WL_G; ++s) {
    const int k = k_first + kStride * s;
    if (k < k_dim) {
      ra[s] = load_w(w0 + k);
      rb[s] = load_w(w1 + k);
    }
  }
  if constexpr (PDL) {
    if (has_unit && part == 0 && lane == 0 && k_dim > kGroup) {
      const u32 rest = (u32)((k_dim - kGroup) * (int)sizeof(twt));
      prefetch_l2(w0 + kGroup, rest);
      if (row1 != row0) prefetch_l2(w1 + kGroup, rest);
    }
    pdl_wait();               // x, the residual and y belong to earlier kernels of the stream
    pdl_launch_dependents();  // the next kernel may start (it waits likewise before reading our y)
  }
  // activation row m: x + xoff[m] (a clamped gather through x_rows, read after the wait)
  i64 xoff[WL_M];
#pragma unroll
  for (int m = 0; m < WL_M; ++m) {
    i64 r = m;
    if (x_rows != nullptr) {
      r = x_rows[m];
      r = r < 0 ? 0 : (r >= x_table_rows ? x_table_rows - 1 : r);
    }
    xoff[m] = r * x_ld;
  }
  float acc[WL_M][WL_RW];
  float ss[WL_M];
#pragma unroll
  for (int m = 0; m < WL_M; ++m) {
    acc[m][0] = 0.0f;
    acc[m][1] = 0.0f;
    ss[m] = 0.0f;
  }
  for (int k0 = k_first;;) {
#pragma unroll
    for (int s = 0; s < WL_G; ++s) {
      const int k = k0 + kStride * s;
      if (k < k_dim) {
        float a[WL_LC], b[WL_LC], v[WL_LC];
        decode_w(ra[s], a);
        decode_w(rb[s], b);
        // step j = k / WL_STEP (lane * WL_LC < WL_STEP): its squares are summed by warp j mod WL_WARPS,
        // which runs step j (j mod KSPLIT = part), so the block's warps sum every step once
        const bool sum_squares = NORM && (((k / WL_STEP) % WL_WARPS) == warp);
#pragma unroll
        for (int m = 0; m < WL_M; ++m) {
#pragma unroll
          for (int h = 0; h < WL_LC; h += 8) load8(x + xoff[m] + k + h, v + h);
#pragma unroll
          for (int j = 0; j < WL_LC; ++j) {
            acc[m][0] = fmaf(a[j], v[j], acc[m][0]);
            acc[m][1] = fmaf(b[j], v[j], acc[m][1]);
          }
          if constexpr (NORM) {
            if (sum_squares) {
#pragma unroll
              for (int j = 0; j < WL_LC; ++j) ss[m] = fmaf(v[j], v[j], ss[m]);
            }
          }
        }
      }
    }
    k0 += kGroup;
    if (k0 >= k_dim) break;
#pragma unroll
    for (int s = 0; s < WL_G; ++s) {  // the next group, all loads before its first use
      const int k = k0 + kStride * s;
      if (k < k_dim) {
        ra[s] = load_w(w0 + k);
        rb[s] = load_w(w1 + k);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < WL_M; ++m) {
    acc[m][0] = warp_sum(acc[m][0]);
    acc[m][1] = warp_sum(acc[m][1]);
    if constexpr (NORM) ss[m] = warp_sum(ss[m]);
  }
  if constexpr (NORM || KSPLIT > 1) {
    // s_ss[warp][m]: each warp's share of every row's sum of squares; s_acc[warp][m][r]: each warp's partial dot products
    if (lane == 0) {
#pragma unroll
      for (int m = 0; m < WL_M; ++m) {
        if constexpr (NORM) s_ss[warp * WL_M + m] = ss[m];
        if constexpr (KSPLIT > 1) {
          s_acc[(warp * WL_M + m) * WL_RW] = acc[m][0];
          s_acc[(warp * WL_M + m) * WL_RW + 1] = acc[m][1];
        }
      }
    }
    __syncthreads();
#pragma unroll
    for (int m = 0; m < WL_M; ++m) {
      if constexpr (NORM) {
        float t = 0.0f;
#pragma unroll
        for (int q = 0; q < WL_WARPS; ++q) t += s_ss[q * WL_M + m];  // the same order in every warp
        ss[m] = t;
      }
      if constexpr (KSPLIT > 1) {
        const int first = warp - part;  // the unit's part-0 warp
        float t0 = 0.0f, t1 = 0.0f;
#pragma unroll
        for (int q = 0; q < KSPLIT; ++q) {  // the parts in order
          t0 += s_acc[((first + q) * WL_M + m) * WL_RW];
          t1 += s_acc[((first + q) * WL_M + m) * WL_RW + 1];
        }
        acc[m][0] = t0;
        acc[m][1] = t1;
      }
    }
  }
  if (part != 0) return;  // the unit's part-0 warp writes its outputs
  // lane i < WL_M * kOuts writes output (m, o) = (i / kOuts, i % kOuts)
  if (!has_unit || lane >= WL_M * kOuts) return;
  const int m_out = lane / kOuts, o = lane - m_out * kOuts;
  float z0 = 0.0f, z1 = 0.0f, s = 1.0f;
#pragma unroll
  for (int m = 0; m < WL_M; ++m) {
    if (m == m_out) {
      z0 = acc[m][0];
      z1 = acc[m][1];
      if constexpr (NORM) s = 1.0f / sqrtf(ss[m] / (float)k_dim + eps);
    }
  }
  float val;
  int n;
  if constexpr (MODE == 0) {
    n = o == 0 ? row0 : 2 * u + 1;
    if (n >= n_out) return;
    val = s * (o == 0 ? z0 : z1);
#if WL_W8
    val *= w_scale[n];
#endif
    if (bias != nullptr) val += to_f32(bias[n]);
    if (residual != nullptr) val += to_f32(residual[(i64)m_out * res_ld + n]);
  } else {
    n = row0;
    float g = s * z0, up = s * z1;
#if WL_W8
    g *= w_scale[row0];
    up *= w_scale[row1];
#endif
    if (bias != nullptr) {
      g += to_f32(bias[row0]);
      up += to_f32(bias[row1]);
    }
    val = silu(g) * up;
  }
  y[(i64)m_out * y_ld + n] = from_f32<tin>(val);
}
