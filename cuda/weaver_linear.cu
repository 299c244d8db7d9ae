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
// The body is wl_layer of cuda/weaver_linear.cuh (cuda/weaver_step.cu runs it for every layer of a Weaver step).
//
// Compile-time constants (NVRTC -D): TFM_IN, the type of x, bias, residual and y (0 float32,
// 1 bfloat16, 2 float16) and of W unless WL_W8; WL_M (1..16); WL_MODE (0 or 1); WL_NORM (0 or 1);
// WL_PDL (0 or 1); WL_KSPLIT (1, 2 or 4); WL_W8 (0 or 1).
#include "weaver_linear.cuh"

#ifndef WL_MODE
#define WL_MODE 0
#endif
#ifndef WL_NORM
#define WL_NORM 0
#endif
#ifndef WL_PDL
#define WL_PDL 1
#endif
#ifndef WL_KSPLIT
#define WL_KSPLIT 1
#endif

extern "C" __global__ void __launch_bounds__(WL_WARPS * 32) weaver_linear(
    const tin* __restrict__ x, i64 x_ld, const twt* __restrict__ w, i64 w_ld, const tin* __restrict__ bias,
    const tin* __restrict__ residual, i64 res_ld, tin* __restrict__ y, i64 y_ld, int n_out, int k_dim, float eps,
    const float* __restrict__ w_scale, const i64* __restrict__ x_rows, i64 x_table_rows) {
#if WL_NORM
  __shared__ float s_ss[WL_WARPS * WL_M];  // each warp's share of every row's sum of squares
#else
  float* s_ss = nullptr;
#endif
#if WL_KSPLIT > 1
  __shared__ float s_acc[WL_WARPS * WL_M * WL_RW];  // each warp's partial dot products
#else
  float* s_acc = nullptr;
#endif
  wl_layer<WL_MODE, WL_NORM, WL_KSPLIT, WL_PDL != 0>(blockIdx.x, x, x_ld, w, w_ld, bias, residual, res_ld, y, y_ld,
                                                     n_out, k_dim, eps, w_scale, x_rows, x_table_rows, s_ss, s_acc);
}
