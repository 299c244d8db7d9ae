// The Weaver scorer's linear layers at a few rows (vllm_tfm/models/weaver_step.py): one launch per
// layer for M <= 16 activation rows (M = R x w scored nodes of a growth round), with the RMSNorm
// before it and the bias / SwiGLU / residual after it fused in:
//
//   s[m]  = 1 / sqrt(mean_k x[m, k]^2 + eps)        (WL_NORM = 1; else s[m] = 1)
//   z[m, n] = s[m] * sum_k W[n, k] x[m, k] + bias[n]   (the norm's scale is per row, so it moves
//                                                     out of the dot product: W (s x) = s (W x))
//   WL_MODE 0:  y[m, n] = z[m, n] (+ residual[m, n])          n < N
//   WL_MODE 1:  y[m, n] = silu(z[m, n]) * z[m, n + N]         n < N (W has 2 N rows: gate, up)
//
// At these M the layers are matrix-vector products bound by the weight bytes (the 27B drafter's
// qkv with its rotate_half rows: 6144 x 1024 bf16 = 12.6 MB per call). cuBLAS runs them at ~1.8 TB/s
// with a separate norm kernel before and elementwise kernels after (bench/results/weaver_profile*.json.gz);
// this kernel reads each weight row once at the copy bandwidth and does the rest in registers.
//
// One unit = WL_RW weight rows (mode 0: rows 2u, 2u + 1; mode 1: rows u and u + N, one output),
// run by WL_KSPLIT warps (1, 2 or 4; the wrapper splits K of layers with few units, so that enough
// weight loads are in flight): warp part p of the unit takes the steps j = p mod WL_KSPLIT of WL_STEP
// = 256 columns (512 with FP8 weights), lane l the columns k = WL_LC l + WL_STEP j, WL_LC = 8 (16)
// (16-byte loads of the weight rows; the activation rows, which every warp reads, come through L1);
// the parts' sums meet in shared memory, added in part order. The weight rows are read WL_G steps at a time,
// every load of a group issued before the group's first conversion. The norm's sum of squares is
// split over the block's warps (warp w sums the steps j = w mod WL_WARPS) and gathered through
// shared memory, so warps past the last unit run the loop on the last unit's rows for their share
// and write nothing. Then butterfly sums, and lane i < M x outputs writes one output. Float32
// throughout, one rounding to the output type. The additions are in a fixed order
// (deterministic), not the torch path's: results agree to float32 rounding of a sum of K products.
//
// WL_PDL = 1 (the wrapper launches with programmatic stream serialization): before pdl_wait, a
// block touches only its weight rows, which no kernel writes: each warp loads its first group into
// registers and asks the copy engine for the rest of its rows into L2. So the weight stream of
// this layer starts while the previous kernel of the stream still runs. After the wait the block
// lets the next kernel in (pdl_launch_dependents), which prefetches its own weights during this one.
//
// WL_W8 = 1: W is float8 e4m3 with one float32 scale per row (w_scale, weight-only FP8: half the
// bytes of bfloat16). A step is then 512 columns, a lane's 16 of them one 16-byte load of each weight
// row (the same bytes in flight per load as the 16-bit path; with 8-byte loads the layers whose K is
// split over warps ran slower than bfloat16), decoded exactly to float32 (tfm_common.cuh,
// e4m3x8_to_f32); the row's scale multiplies the finished dot product:
// z[m, n] = s[m] * w_scale[n] * sum_k W8[n, k] x[m, k] + bias[n]. K % 16 == 0.
//
// x_rows (not null): activation row m is x[clamp(x_rows[m], 0, x_table_rows - 1)] (a gather from a
// table such as the target's input embedding, fused into the layer; the clamp keeps an invalid
// token id in bounds). x_rows is read after pdl_wait (earlier kernels write it).
//
// Requirements (checked by the wrapper, vllm_tfm/kernels/weaver_linear.py): K % 8 == 0 (16 with WL_W8); W and x
// rows contiguous and 16-byte aligned (row strides multiples of 16 bytes); residual and y rows
// contiguous (read and written one element per lane); M == WL_M.
//
// Compile-time constants (NVRTC -D): TFM_IN, the type of x, bias, residual and y (0 float32,
// 1 bfloat16, 2 float16) and of W unless WL_W8; WL_M (1..16); WL_MODE (0 or 1); WL_NORM (0 or 1);
// WL_PDL (0 or 1); WL_KSPLIT (1, 2 or 4); WL_W8 (0 or 1).
#include "tfm_common.cuh"

#ifndef WL_M
#define WL_M 2
#endif
#ifndef WL_MODE
#define WL_MODE 0
#endif
#ifndef WL_NORM
#define WL_NORM 0
#endif
#if WL_M < 1 || WL_M > 16
#error "WL_M must be 1..16"
#endif

#ifndef WL_PDL
#define WL_PDL 1
#endif
#ifndef WL_KSPLIT
#define WL_KSPLIT 1
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
#if WL_KSPLIT != 1 && WL_KSPLIT != 2 && WL_KSPLIT != 4
#error "WL_KSPLIT must be 1, 2 or 4"
#endif
#define WL_UNITS_PER_BLOCK (WL_WARPS / WL_KSPLIT)
#if WL_MODE == 0
#define WL_OUTS 2  // outputs per warp and row m
#elif WL_MODE == 1
#define WL_OUTS 1
#else
#error "WL_MODE must be 0 (linear) or 1 (SwiGLU)"
#endif

extern "C" __global__ void __launch_bounds__(WL_WARPS * 32) weaver_linear(
    const tin* __restrict__ x, i64 x_ld, const twt* __restrict__ w, i64 w_ld, const tin* __restrict__ bias,
    const tin* __restrict__ residual, i64 res_ld, tin* __restrict__ y, i64 y_ld, int n_out, int k_dim, float eps,
    const float* __restrict__ w_scale, const i64* __restrict__ x_rows, i64 x_table_rows) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int part = warp % WL_KSPLIT;  // this warp's share of K: the steps j = part mod WL_KSPLIT
#if WL_MODE == 0
  const int units = (n_out + 1) / 2;
#else
  const int units = n_out;
#endif
  const int unit = blockIdx.x * WL_UNITS_PER_BLOCK + warp / WL_KSPLIT;
  const bool has_unit = unit < units;
  const int u = has_unit ? unit : units - 1;  // this warp's unit (past the end: the last)
#if WL_MODE == 0
  const int row0 = 2 * u, row1 = 2 * u + 1 < n_out ? 2 * u + 1 : 2 * u;  // an odd N repeats the last row
#else
  const int row0 = u, row1 = u + n_out;
#endif
  const twt* __restrict__ w0 = w + (i64)row0 * w_ld;
  const twt* __restrict__ w1 = w + (i64)row1 * w_ld;
  // lane l's columns: k = WL_LC l + WL_STEP j for the steps j = part + WL_KSPLIT i, WL_G of them per group
  constexpr int kStride = WL_STEP * WL_KSPLIT;      // between a warp's consecutive steps
  constexpr int kGroup = WL_STEP * WL_KSPLIT * WL_G;  // between a warp's consecutive groups
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
#if WL_PDL
  if (has_unit && part == 0 && lane == 0 && k_dim > kGroup) {
    const u32 rest = (u32)((k_dim - kGroup) * (int)sizeof(twt));
    prefetch_l2(w0 + kGroup, rest);
    if (row1 != row0) prefetch_l2(w1 + kGroup, rest);
  }
  pdl_wait();               // x, the residual and y belong to earlier kernels of the stream
  pdl_launch_dependents();  // the next kernel may start (it waits likewise before reading our y)
#endif
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
#if WL_NORM
        // step j = k / WL_STEP (lane * WL_LC < WL_STEP): its squares are summed by warp j mod WL_WARPS,
        // which runs step j (j mod WL_KSPLIT = part), so the block's warps sum every step once
        const bool sum_squares = (((k / WL_STEP) % WL_WARPS) == warp);
#endif
#pragma unroll
        for (int m = 0; m < WL_M; ++m) {
#pragma unroll
          for (int h = 0; h < WL_LC; h += 8) load8(x + xoff[m] + k + h, v + h);
#pragma unroll
          for (int j = 0; j < WL_LC; ++j) {
            acc[m][0] = fmaf(a[j], v[j], acc[m][0]);
            acc[m][1] = fmaf(b[j], v[j], acc[m][1]);
          }
#if WL_NORM
          if (sum_squares) {
#pragma unroll
            for (int j = 0; j < WL_LC; ++j) ss[m] = fmaf(v[j], v[j], ss[m]);
          }
#endif
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
#if WL_NORM
    ss[m] = warp_sum(ss[m]);
#endif
  }
#if WL_NORM || WL_KSPLIT > 1
#if WL_NORM
  __shared__ float s_ss[WL_WARPS][WL_M];  // each warp's share of every row's sum of squares
#endif
#if WL_KSPLIT > 1
  __shared__ float s_acc[WL_WARPS][WL_M][WL_RW];  // each warp's partial dot products
#endif
  if (lane == 0) {
#pragma unroll
    for (int m = 0; m < WL_M; ++m) {
#if WL_NORM
      s_ss[warp][m] = ss[m];
#endif
#if WL_KSPLIT > 1
      s_acc[warp][m][0] = acc[m][0];
      s_acc[warp][m][1] = acc[m][1];
#endif
    }
  }
  __syncthreads();
#pragma unroll
  for (int m = 0; m < WL_M; ++m) {
#if WL_NORM
    float t = 0.0f;
#pragma unroll
    for (int q = 0; q < WL_WARPS; ++q) t += s_ss[q][m];  // the same order in every warp
    ss[m] = t;
#endif
#if WL_KSPLIT > 1
    const int first = warp - part;  // the unit's part-0 warp
    float t0 = 0.0f, t1 = 0.0f;
#pragma unroll
    for (int q = 0; q < WL_KSPLIT; ++q) {  // the parts in order
      t0 += s_acc[first + q][m][0];
      t1 += s_acc[first + q][m][1];
    }
    acc[m][0] = t0;
    acc[m][1] = t1;
#endif
  }
#endif
  if (part != 0) return;  // the unit's part-0 warp writes its outputs
  // lane i < WL_M * WL_OUTS writes output (m, o) = (i / WL_OUTS, i % WL_OUTS)
  if (!has_unit || lane >= WL_M * WL_OUTS) return;
  const int m_out = lane / WL_OUTS, o = lane - m_out * WL_OUTS;
  float z0 = 0.0f, z1 = 0.0f, s = 1.0f;
#pragma unroll
  for (int m = 0; m < WL_M; ++m) {
    if (m == m_out) {
      z0 = acc[m][0];
      z1 = acc[m][1];
#if WL_NORM
      s = 1.0f / sqrtf(ss[m] / (float)k_dim + eps);
#endif
    }
  }
#if WL_MODE == 0
  const int n = o == 0 ? row0 : 2 * u + 1;
  if (n >= n_out) return;
  float val = s * (o == 0 ? z0 : z1);
#if WL_W8
  val *= w_scale[n];
#endif
  if (bias != nullptr) val += to_f32(bias[n]);
  if (residual != nullptr) val += to_f32(residual[(i64)m_out * res_ld + n]);
#else
  const int n = row0;
  float g = s * z0, up = s * z1;
#if WL_W8
  g *= w_scale[row0];
  up *= w_scale[row1];
#endif
  if (bias != nullptr) {
    g += to_f32(bias[row0]);
    up += to_f32(bias[row1]);
  }
  float val = silu(g) * up;
#endif
  y[(i64)m_out * y_ld + n] = from_f32<tin>(val);
}
