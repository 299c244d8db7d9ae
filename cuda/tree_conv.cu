// Short causal conv1d over a token tree, and its commit (DESIGN.md section 4, BRIEF conventions).
//
// tree_conv1d: node i's window, most recent first, is x_i, x_parent, x_grandparent, ... and,
// once the root is passed, the committed columns conv_state[slot, :, s+W-2], ..., [slot, :, s].
//   y_i = act(bias + sum_w weight[:, w] * window[W-1-w])      (weight[:, W-1] multiplies x_i)
// The state is only read.
// tree_conv_commit: conv_state[dst, :, d : d+W-1] = the last W-1 entries of
//   [conv_state[src, :, s : s+W-1] | x along the root..accepted path], oldest first;
// each thread owns one channel of one request and reads all its inputs before writing, so
// src == dst within a request is safe; when a slot is one request's destination and another's
// source the wrapper passes a snapshot of the sources as src_state (vllm_tfm/kernels/conv.py).
// tree_conv_commit_layers: the same block body (conv_commit_block, so bitwise the same results)
// for L layers of a step in one launch, each layer's operands from a device table of
// ConvCommitLayer rows (vllm_tfm/kernels/batched_commit.py); the plan, the accepted nodes, D and W
// are shared. Layers run concurrently: no layer's destination columns may be another layer's
// source columns (vLLM: layers that share a buffer belong to different KV-cache groups).
//
// Paths come from the host plan (vllm_tfm/kernels/plan.py): pair_j[pair_off[pos[i]] + e] is the
// node at depth e on the root..i path.
//
// Compile-time constants (NVRTC -D): TFM_IN (x / y type), CONV_ST (state type), CONV_WT
// (weight / bias type); 0 = float32, 1 = bfloat16, 2 = float16.
#include "tfm_common.cuh"

#ifndef CONV_ST
#define CONV_ST 1
#endif
#ifndef CONV_WT
#define CONV_WT 1
#endif

#define TFM_TYPE_0 float
#define TFM_TYPE_1 bf16s
#define TFM_TYPE_2 f16s
#define TFM_CAT_(a, b) a##b
#define TFM_CAT(a, b) TFM_CAT_(a, b)
typedef TFM_CAT(TFM_TYPE_, CONV_ST) tst;
typedef TFM_CAT(TFM_TYPE_, CONV_WT) twt;

#define CONV_THREADS 256
#define CONV_NPC 8     // nodes per CTA
#define CONV_WMAX 8    // largest supported conv width
// CONV_W (NVRTC -D; vllm_tfm/kernels/conv.py passes it unless VLLM_TFM_TREE_CONV_UNROLLED=0, where x and the conv
// state share a type): tree_conv1d with the conv width as a constant, its loads unrolled and all issued before the
// first use (the weights and every window entry of the CTA's nodes, the first being the node's own row); 0 (mixed
// types, the switch off, and the commit kernels' builds): the runtime width W <= CONV_WMAX, each node's window
// loaded in the loop that consumes it.
#ifndef CONV_W
#define CONV_W 0
#endif
#if CONV_W > CONV_WMAX
#error "CONV_W must be at most CONV_WMAX"
#endif
#if CONV_W > 0 && TFM_IN != CONV_ST
#error "CONV_W needs x and the conv state in one type (one pointer per window entry)"
#endif

#define CONV_SOFTPLUS_THRESHOLD 20.f  // vLLM's (and torch's F.softplus default): x past it is x

// Node i's output of channel c: into qk_out's q or k block for the first 2 qk_cols channels where qk_out is given,
// else into y.
__device__ __forceinline__ void conv_store(float acc, int i, int c, int D, tin* __restrict__ y,
                                           tin* __restrict__ qk_out, i64 qk_half, int qk_cols) {
  if (qk_out != nullptr && c < 2 * qk_cols) {
    const int half = c >= qk_cols;
    qk_out[(i64)half * qk_half + (i64)i * qk_cols + (c - half * qk_cols)] = from_f32<tin>(acc);
  } else {
    y[(i64)i * D + c] = from_f32<tin>(acc);
  }
}

// grid (ceil(D / 256), ceil(T / 8)), block 256.
// Optional work of the same launch, each skipped when its output pointer is null (the GDN layer's
// prologue, vllm_tfm/vllm_plugin/runtime/gdn.py; bench/NOTES.md section 40):
// * qk_out: channels c < 2 qk_cols (q then k) of node i go to qk_out[(c / qk_cols) qk_half + i qk_cols
//   + c % qk_cols] instead of y (q and k as two contiguous [T, qk_cols] blocks, what the verify reads);
// * x_copy: x_copy[i x_copy_row + c] = x[i x_row + c] (the pre-conv rows kept for the commit);
// * g_out / beta_out: the gates of the T x HV (a, b) pairs, spread over the CTAs of blockIdx.y == 0,
//   with torch's float32 operations in torch's order (vllm_tfm/verify/gdn.py gdn_gates):
//   g = nea[h] * softplus(a + dtb[h]) (softplus(v) = v past 20, else log1p(exp(v))),
//   beta = 1 / (1 + exp(-b)).
extern "C" __global__ void __launch_bounds__(CONV_THREADS)
tree_conv1d(const tin* __restrict__ x, i64 x_row, const int* __restrict__ req_of,
            const int* __restrict__ cu, const int* __restrict__ pos, const int* __restrict__ depth,
            const int* __restrict__ pair_off, const int* __restrict__ pair_j,
            const tst* __restrict__ conv_state, i64 cs_slot, i64 cs_d, i64 cs_l,
            const int* __restrict__ state_idx, const int* __restrict__ window_start,
            const twt* __restrict__ weight, i64 w_d, i64 w_t, const twt* __restrict__ bias,
            i64 b_d, tin* __restrict__ y, int T, int D, int W, int silu_act,
            tin* __restrict__ qk_out, i64 qk_half, int qk_cols,
            tin* __restrict__ x_copy, i64 x_copy_row,
            const tin* __restrict__ ga, i64 ga_row, const tin* __restrict__ gb, i64 gb_row,
            const float* __restrict__ nea, const float* __restrict__ dtb,
            float* __restrict__ g_out, i64 g_row, float* __restrict__ beta_out, i64 beta_row, int HV) {
  // s_src[a][t] >= 0: flat node index of window entry t of node a; < 0: -(state column + 1).
  __shared__ int s_src[CONV_NPC][CONV_WMAX];
  __shared__ int s_slot[CONV_NPC];
  const int tid = threadIdx.x;
  const int node0 = blockIdx.y * CONV_NPC;
  if (g_out != nullptr && blockIdx.y == 0) {
    for (int e = blockIdx.x * CONV_THREADS + tid; e < T * HV; e += gridDim.x * CONV_THREADS) {
      const int row = e / HV, h = e - row * HV;
      const float v = to_f32(ga[(i64)row * ga_row + h]) + dtb[h];
      const float sp = v > CONV_SOFTPLUS_THRESHOLD ? v : log1pf(expf(v));
      g_out[(i64)row * g_row + h] = nea[h] * sp;
      beta_out[(i64)row * beta_row + h] = 1.f / (1.f + expf(-to_f32(gb[(i64)row * gb_row + h])));
    }
  }
  if (tid < CONV_NPC * W) {
    const int a = tid / W, t = tid % W;
    const int i = node0 + a;
    if (i < T) {
      const int r = req_of[i];
      const int d = depth[i];
      if (t <= d) {
        s_src[a][t] = pair_j[pair_off[pos[i]] + d - t];
      } else {
        const int s = window_start != nullptr ? window_start[r] : 0;
        s_src[a][t] = -(s + W - 2 - (t - d - 1) + 1);
      }
      if (t == 0) s_slot[a] = state_idx[r];
    }
  }
  __syncthreads();
  const int c = blockIdx.x * CONV_THREADS + tid;
  if (c >= D) return;
  // the weights (CONV_WMAX of them, zero past W, in the loop build) and the bias
  constexpr int WREG = CONV_W > 0 ? CONV_W : CONV_WMAX;
  float w[WREG];
#pragma unroll
  for (int t = 0; t < WREG; ++t) w[t] = CONV_W > 0 || t < W ? to_f32(weight[(i64)c * w_d + (i64)t * w_t]) : 0.f;
  const float b = bias != nullptr ? to_f32(bias[(i64)c * b_d]) : 0.f;
#if CONV_W > 0
  const int na = min(CONV_NPC, T - node0);
  // Every load first, then the arithmetic. Each entry's address is chosen first (a select, no branch) and loaded
  // unconditionally, so the 8 x CONV_W loads go to distinct registers with nothing to wait for between them (a load
  // from x or from the state in a branch of its own made the compiler consume each before the next: no faster than
  // the loop; bench/NOTES.md sections 70 and 71). Entries of nodes past T load x's row 0 of channel c (a valid
  // address; never used). Entry 0 is the node's own row (its path ends with itself), which the stash copies.
  tin win[CONV_NPC][CONV_W];
#pragma unroll
  for (int a = 0; a < CONV_NPC; ++a) {
#pragma unroll
    for (int t = 0; t < CONV_W; ++t) {
      const int src = a < na ? s_src[a][t] : 0;
      const tin* p = src >= 0 ? x + (i64)src * x_row + c
                              : conv_state + (i64)s_slot[a] * cs_slot + (i64)c * cs_d + (i64)(-src - 1) * cs_l;
      win[a][t] = *p;
    }
  }
#pragma unroll
  for (int a = 0; a < CONV_NPC; ++a) {
    if (a >= na) break;
    const int i = node0 + a;
    float acc = 0.f;
    // oldest window entry first: sum_w weight[w] * window[W-1-w], w ascending
#pragma unroll
    for (int wi = 0; wi < CONV_W; ++wi) acc = fmaf(w[wi], to_f32(win[a][CONV_W - 1 - wi]), acc);
    acc += b;
    if (silu_act) acc = silu(acc);
    if (x_copy != nullptr) x_copy[(i64)i * x_copy_row + c] = win[a][0];
    conv_store(acc, i, c, D, y, qk_out, qk_half, qk_cols);
  }
#else
  // the runtime width: each node's window loads are consumed in the loop that issues them
  for (int a = 0; a < CONV_NPC; ++a) {
    const int i = node0 + a;
    if (i >= T) break;
    float acc = 0.f;
    // oldest window entry first: sum_w weight[w] * window[W-1-w], w ascending
    for (int wi = 0; wi < W; ++wi) {
      const int t = W - 1 - wi;
      const int src = s_src[a][t];
      float val;
      if (src >= 0) {
        val = to_f32(x[(i64)src * x_row + c]);
      } else {
        val = to_f32(conv_state[(i64)s_slot[a] * cs_slot + (i64)c * cs_d + (i64)(-src - 1) * cs_l]);
      }
      acc = fmaf(w[wi], val, acc);
    }
    acc += b;
    if (silu_act) acc = silu(acc);
    if (x_copy != nullptr) x_copy[(i64)i * x_copy_row + c] = x[(i64)i * x_row + c];
    conv_store(acc, i, c, D, y, qk_out, qk_half, qk_cols);
  }
#endif
}

// The work of one CTA: channels blockIdx.x * 256 .. of request r.
__device__ __forceinline__ void
conv_commit_block(const tin* __restrict__ x, i64 x_row, const int* __restrict__ cu,
                  const int* __restrict__ pos, const int* __restrict__ depth,
                  const int* __restrict__ pair_off, const int* __restrict__ pair_j,
                  const int* __restrict__ accepted, const tst* src_state,
                  const int* __restrict__ src_idx, i64 ss_slot, i64 ss_d, i64 ss_l,
                  const int* __restrict__ src_start, tst* dst_state, const int* __restrict__ dst_idx,
                  i64 ds_slot, i64 ds_d, i64 ds_l, const int* __restrict__ dst_start, int D, int W,
                  const int r) {
  // s_src[e] for e < W-1: the e-th of the last W-1 entries (oldest first); >= 0 a flat node
  // index, < 0 -(source state column + 1).
  __shared__ int s_src[CONV_WMAX];
  const int tid = threadIdx.x;
  if (tid < W - 1) {
    const int a = cu[r] + accepted[r];
    const int d = depth[a];
    const int e = d + 1 + tid;  // index into [committed (W-1) | path (d+1)]
    if (e < W - 1) {
      const int s = src_start != nullptr ? src_start[r] : 0;
      s_src[tid] = -(s + e + 1);
    } else {
      s_src[tid] = pair_j[pair_off[pos[a]] + e - (W - 1)];
    }
  }
  __syncthreads();
  const int c = blockIdx.x * CONV_THREADS + tid;
  if (c >= D) return;
  const i64 sbase = (i64)src_idx[r] * ss_slot + (i64)c * ss_d;
  float vals[CONV_WMAX];
#pragma unroll
  for (int e = 0; e < CONV_WMAX - 1; ++e) {
    if (e < W - 1) {
      const int src = s_src[e];
      vals[e] = src >= 0 ? to_f32(x[(i64)src * x_row + c])
                         : to_f32(src_state[sbase + (i64)(-src - 1) * ss_l]);
    }
  }
  const int dcol = dst_start != nullptr ? dst_start[r] : 0;
  const i64 dbase = (i64)dst_idx[r] * ds_slot + (i64)c * ds_d + (i64)dcol * ds_l;
#pragma unroll
  for (int e = 0; e < CONV_WMAX - 1; ++e) {
    if (e < W - 1) dst_state[dbase + (i64)e * ds_l] = from_f32<tst>(vals[e]);
  }
}

// grid (ceil(D / 256), R), block 256.
extern "C" __global__ void __launch_bounds__(CONV_THREADS)
tree_conv_commit(const tin* __restrict__ x, i64 x_row, const int* __restrict__ cu,
                 const int* __restrict__ pos, const int* __restrict__ depth,
                 const int* __restrict__ pair_off, const int* __restrict__ pair_j,
                 const int* __restrict__ accepted, const tst* src_state,
                 const int* __restrict__ src_idx, i64 ss_slot, i64 ss_d, i64 ss_l,
                 const int* __restrict__ src_start, tst* dst_state, const int* __restrict__ dst_idx,
                 i64 ds_slot, i64 ds_d, i64 ds_l, const int* __restrict__ dst_start, int D, int W) {
  conv_commit_block(x, x_row, cu, pos, depth, pair_off, pair_j, accepted, src_state, src_idx,
                    ss_slot, ss_d, ss_l, src_start, dst_state, dst_idx, ds_slot, ds_d, ds_l,
                    dst_start, D, W, blockIdx.y);
}

// One row of the layer table of tree_conv_commit_layers: 14 64-bit words in this order
// (CONV_LAYER_FIELDS in vllm_tfm/kernels/batched_commit.py mirrors it; a CPU test compares them).
struct ConvCommitLayer {
  const tin* x;
  i64 x_row;
  const tst* src_state;
  const int* src_idx;    // [R]
  i64 ss_slot, ss_d, ss_l;
  const int* src_start;  // [R] or null
  tst* dst_state;
  const int* dst_idx;    // [R]
  i64 ds_slot, ds_d, ds_l;
  const int* dst_start;  // [R] or null
};

// grid (ceil(D / 256), R * L), block 256; blockIdx.y = layer * R + r.
extern "C" __global__ void __launch_bounds__(CONV_THREADS)
tree_conv_commit_layers(const ConvCommitLayer* __restrict__ layers, int R,
                        const int* __restrict__ cu, const int* __restrict__ pos,
                        const int* __restrict__ depth, const int* __restrict__ pair_off,
                        const int* __restrict__ pair_j, const int* __restrict__ accepted, int D,
                        int W) {
  const int layer = blockIdx.y / R, r = blockIdx.y - layer * R;
  const ConvCommitLayer L = layers[layer];
  conv_commit_block(L.x, L.x_row, cu, pos, depth, pair_off, pair_j, accepted, L.src_state,
                    L.src_idx, L.ss_slot, L.ss_d, L.ss_l, L.src_start, L.dst_state, L.dst_idx,
                    L.ds_slot, L.ds_d, L.ds_l, L.dst_start, D, W, r);
}
