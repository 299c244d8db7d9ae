// One Weaver step of the batched tree scorer (vllm_tfm/models/weaver.py, BatchedWeaverTreeScorer with
// score_kernel) in ONE launch: the token_in linear (the embedding rows gathered), every layer's qkv
// linear, node attention, o_proj, gate_up (SwiGLU) and down, and the query linear, for the call's
// M = R x w rows. The per-kernel path launches these 2 + 5 L kernels one after another (at the 27B
// shape, 17 a growth round, ~120 a decode step); each costs a launch and a wait for the whole grid
// before the next may read its output, several times the time its weight bytes take (bench/NOTES.md
// sections 67, 70, 71).
//
// Here the blocks stay resident (a cooperative launch) and run the stages in order, with a grid
// barrier (tfm_common.cuh, grid_barrier) between each stage and the next: stage s's block vb of the
// per-kernel launch becomes the loop `for vb = blockIdx.x; vb < blocks(s); vb += gridDim.x` over the
// same device function with the same arguments: wl_layer of weaver_linear.cuh for the linears,
// wa_node_attention of weaver_attention.cuh for the attention (one (head, request) pair per vb). The
// K splits (WS_KS_*) are the per-kernel path's (vllm_tfm/kernels/weaver_linear.py, k_split), so every
// output is the per-kernel path's bit for bit. Weights are only read: at the start of a linear stage
// each block asks the copy engine to bring the next linear's rows of its units into L2 (prefetch_l2),
// so the next stage after the barrier starts on L2 hits.
//
// Activations live in the scratch buffers of WsParams: xa / xb ([M, d], the residual stream, ping-pong:
// o_proj reads xa and writes xb, down reads xb and writes xa), proj ([M, 6 d]: q, k, v and their
// rotate_half), att ([M, d]), act ([M, d_mlp]); out ([M, hidden]) receives the query. They are written in
// one stage and read in a later one only (never written and read in one stage).
//
// Compile-time constants (NVRTC -D): TFM_IN (activations: 0 float32, 1 bfloat16, 2 float16), WL_M (= M),
// WL_W8 (1: every weight e4m3 with row scales), WA_HD (head dim), WS_LAYERS (L, 1..WS_MAX_LAYERS), and the K
// splits WS_KS_TOK, WS_KS_QKV, WS_KS_O, WS_KS_GU, WS_KS_DN, WS_KS_QRY (1, 2 or 4).
// Requirements (checked by the wrapper, vllm_tfm/kernels/weaver_step.py): those of the linear kernel for
// every layer and of the attention kernel; R x heads <= the grid is not needed (vb loops).
#include "weaver_linear.cuh"
#define WA_THREADS (WL_WARPS * 32)
#include "weaver_attention.cuh"

#define WS_MAX_LAYERS 8
#ifndef WS_LAYERS
#error "WS_LAYERS (the Weaver's layer count) must be defined"
#endif
#if WS_LAYERS < 1 || WS_LAYERS > WS_MAX_LAYERS
#error "WS_LAYERS must be 1..WS_MAX_LAYERS"
#endif

// One linear layer's operands (vllm_tfm/kernels/weaver_step.py, WsLinear, mirrors it): weight [N', K]
// (rows contiguous), its e4m3 row scales (WL_W8) or null, bias [N'] or null, the norm's eps (NORM layers).
struct WsLinear {
  const twt* w;
  const float* scale;
  const tin* bias;
  float eps;
  int pad;
};

// Every operand of a step (WsParams in vllm_tfm/kernels/weaver_step.py mirrors it; passed by value).
struct WsParams {
  WsLinear token_in;  // [d, hidden]: the embedding rows -> the residual stream
  WsLinear qkv[WS_LAYERS];      // [6 d, d], norm
  WsLinear o[WS_LAYERS];        // [d, d], residual
  WsLinear gate_up[WS_LAYERS];  // [2 d_mlp, d], norm, SwiGLU
  WsLinear down[WS_LAYERS];     // [d, d_mlp], residual
  WsLinear query;               // [hidden, d], norm
  tin* kv[WS_LAYERS];           // each layer's K/V [2, R, heads, S, hd]
  const tin* embed;             // [embed_rows, hidden]
  const i64* tokens;            // [M]
  const tin* rope;              // [D, 2, 3, 1, hd]
  const i64* node_ids;          // [M] each (R x w, row-major)
  const i64* parent_ids;
  const i64* depths;
  const unsigned char* valid;
  tin* key_bias;                // [R, n_slots + 2, cols]
  tin* xa;
  tin* xb;
  tin* proj;
  tin* att;
  tin* act;
  tin* out;
  int* barrier;                 // two ints (grid_barrier)
  i64 embed_rows;
  int hidden, d, d_mlp, heads, R, w, S, p0, n_slots, cols, D;
  float attn_scale;
};

// Block blockIdx.x's share of one linear stage: the per-kernel launch's blocks vb = blockIdx.x mod gridDim.x.
template <int MODE, int NORM, int KSPLIT>
__device__ __forceinline__ void ws_linear(const WsLinear& L, const tin* x, i64 x_ld, const tin* residual, tin* y,
                                          int n_out, int k_dim, const i64* x_rows, i64 x_table_rows, float* s_ss,
                                          float* s_acc) {
  const int nb = wl_blocks<MODE, KSPLIT>(n_out);
  for (int vb = blockIdx.x; vb < nb; vb += gridDim.x) {
    wl_layer<MODE, NORM, KSPLIT, false>(vb, x, x_ld, L.w, k_dim, L.bias, residual, n_out, y, n_out, n_out, k_dim, L.eps,
                                        L.scale, x_rows, x_table_rows, s_ss, s_acc);
    __syncthreads();  // the block's shared memory is the next unit's
  }
}

// The rows of block blockIdx.x's units of a later linear stage into L2.
template <int MODE, int KSPLIT>
__device__ __forceinline__ void ws_prefetch(const WsLinear& L, int n_out, int k_dim) {
  const int nb = wl_blocks<MODE, KSPLIT>(n_out);
  for (int vb = blockIdx.x; vb < nb; vb += gridDim.x) wl_prefetch<MODE, KSPLIT>(vb, L.w, k_dim, n_out, k_dim);
}

// grid: any number of blocks that are resident together (the wrapper: a cooperative launch of at most the
// device's resident blocks); block WL_WARPS x 32 threads; dynamic shared memory: the attention's
// (attention_smem_bytes), at least the linears' sums (WL_WARPS x WL_M x 3 floats).
extern "C" __global__ void __launch_bounds__(WL_WARPS * 32) weaver_step(const WsParams p) {
  TFM_DYNAMIC_SMEM(uint4, s_raw);
  float* s_ss = reinterpret_cast<float*>(s_raw);  // [WL_WARPS][WL_M]
  float* s_acc = s_ss + WL_WARPS * WL_M;          // [WL_WARPS][WL_M][WL_RW]
  const int d = p.d;
  ws_prefetch<0, WS_KS_TOK>(p.token_in, d, p.hidden);
  ws_prefetch<0, WS_KS_QKV>(p.qkv[0], 6 * d, d);
  // the embedding rows of the call's tokens (clamped) -> xa
  ws_linear<0, 1, WS_KS_TOK>(p.token_in, p.embed, p.hidden, nullptr, p.xa, d, p.hidden, p.tokens, p.embed_rows, s_ss,
                             s_acc);
  grid_barrier(p.barrier);
#pragma unroll 1
  for (int l = 0; l < WS_LAYERS; ++l) {
    ws_prefetch<0, WS_KS_O>(p.o[l], d, d);
    ws_linear<0, 1, WS_KS_QKV>(p.qkv[l], p.xa, d, nullptr, p.proj, 6 * d, d, nullptr, 0, s_ss, s_acc);
    grid_barrier(p.barrier);
    ws_prefetch<1, WS_KS_GU>(p.gate_up[l], p.d_mlp, d);
    for (int item = blockIdx.x; item < p.heads * p.R; item += gridDim.x) {  // the per-kernel grid (heads, R)
      const int h = item % p.heads, r = item / p.heads;
      wa_node_attention(h, r, p.R, s_raw, p.proj, 6 * (i64)d, p.rope, p.node_ids, p.parent_ids, p.depths, p.valid,
                        p.kv[l], p.key_bias, p.att, p.w, p.heads, p.S, p.p0, p.n_slots, p.cols, p.D, p.attn_scale,
                        l == 0);
      __syncthreads();  // the block's shared memory is the next pair's
    }
    grid_barrier(p.barrier);
    ws_linear<0, 0, WS_KS_O>(p.o[l], p.att, d, p.xa, p.xb, d, d, nullptr, 0, s_ss, s_acc);
    grid_barrier(p.barrier);
    ws_prefetch<0, WS_KS_DN>(p.down[l], d, p.d_mlp);
    ws_linear<1, 1, WS_KS_GU>(p.gate_up[l], p.xb, d, nullptr, p.act, p.d_mlp, d, nullptr, 0, s_ss, s_acc);
    grid_barrier(p.barrier);
    if (l + 1 < WS_LAYERS) {
      ws_prefetch<0, WS_KS_QKV>(p.qkv[l + 1], 6 * d, d);
    } else {
      ws_prefetch<0, WS_KS_QRY>(p.query, p.hidden, d);
    }
    ws_linear<0, 0, WS_KS_DN>(p.down[l], p.act, p.d_mlp, p.xb, p.xa, d, p.d_mlp, nullptr, 0, s_ss, s_acc);
    grid_barrier(p.barrier);
  }
  ws_linear<0, 1, WS_KS_QRY>(p.query, p.xa, d, nullptr, p.out, p.hidden, d, nullptr, 0, s_ss, s_acc);
}
