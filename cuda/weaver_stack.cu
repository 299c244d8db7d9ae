// The Weaver scorer's whole block stack for one growth round in ONE cooperative launch
// (vllm_tfm/models/weaver.py, BatchedWeaverTreeScorer; vllm_tfm/kernels/weaver_stack.py):
//
//   x0      = token_in(rms_norm(emb))                                   [M, d]
//   per layer l (inputs x_in = x0 or the previous layer's x_out):
//     proj  = qkv_rot(rms_norm(x_in))                                   [M, 6 heads hd]
//     attn  = node attention of proj (RoPE, K/V and key-mask writes)    [M, heads hd]
//     x_mid = x_in + o_proj(attn)
//     h     = silu(gate(rms_norm(x_mid))) * up(rms_norm(x_mid))         [M, d_mlp]
//     x_out = x_mid + down(h)
//   qry     = query(rms_norm(x_last))                                   [M, n_q]
//
// with the norms folded into the projections (vllm_tfm/models/weaver_step.py). The per-op path runs
// these as 4 L + 2 weaver_linear launches and L weaver_node_attention launches (14 + 3 at the 27B
// drafter's three layers), each a few microseconds of launch, ramp and drain around ~2 us of weight
// reads (bench/results/weaver_profile*.json.gz: 112 weaver_linear launches per batch-1 build of 8
// rounds, ~6-7 us each). Here a grid of one block per SM runs the stages back to back, separated by
// grid barriers (tfm_common.cuh's grid_barrier), and streams every stage's weights into shared memory
// ahead of time: the weights depend on nothing computed, so a warp's copies for the next stages are in
// flight while it waits at a barrier or while attention runs.
//
// Linear stages: the arithmetic of weaver_linear.cu with WL_KSPLIT = 1, bit for bit. A unit is two
// weight rows (2u and 2u + 1, an odd N repeating the last; SwiGLU: gate row u and up row u + N), run
// by one warp: lane l takes the columns k = 8 l + 256 j, steps j ascending, products summed into one
// float32 chain per (row m, weight row), then butterfly sums; the RMSNorm's sum of squares is split
// over the block's warps 0-3 as weaver_linear splits it over its four warps (warp q: the steps
// j = q mod 4), summed in warp order; z = s acc (+ bias) (+ residual), or silu(z_gate) z_up. The
// global warp g of W (g = warp x blocks + block) takes the units g, g + W, ... of every stage.
//
// The weight stream. Each warp walks its chunks (stage, unit, 256 WS_CHUNK_STEPS columns of the
// unit's two rows) in the order it consumes them, all stages in a row. Lane l copies exactly the
// 16-byte pieces it will read (cp.async, 8 pieces per chunk, laid out [piece][lane] so a warp's reads
// are conflict-free), so a chunk needs only the lane's own cp.async.wait_group, no barrier. A ring of
// WS_NSLOT chunk slots per warp keeps WS_NSLOT - 1 chunks in flight: before consuming chunk c the lane
// waits for it, then issues chunk c + WS_NSLOT - 1 into the slot chunk c - 1 used.
//
// Attention stages: weaver_attention.cuh's device function, one (head, request) item per block at a
// time (items blockIdx.x, blockIdx.x + G, ...), identical to the weaver_node_attention launch.
//
// Memory ordering. Every activation of the round has its own buffer (emb, x0, and per layer proj,
// attn, x_mid, h, x_out; the wrapper places them 128-byte aligned), written once by one stage and read
// only after the grid barrier that follows it, through plain loads (never the read-only path): no
// block can hold a stale L1 line of a buffer it reads, since nothing of that buffer was in any block's
// L1 before it was written in this launch (L1 does not outlive a launch). K/V rows the attention writes
// are read by later launches only; key-mask rows written here are new nodes' rows, never read by this
// launch (the scorer's protocol).
//
// Requirements (checked by the wrapper): a cooperative launch of G <= (blocks the device holds at
// once) blocks of WS_THREADS threads; 16-bit activations and weights (bfloat16 or float16) or float32;
// every weight [N, K] contiguous with K % 8 == 0, 16-byte aligned; M = R w <= 16; the attention's
// requirements (weaver_attention.py); dynamic shared memory ws_smem_bytes.
//
// Compile-time constants (NVRTC -D): TFM_IN (0 float32, 1 bfloat16, 2 float16); WS_M (1..16), the
// rows; WS_LAYERS (1..4); WS_HD, the head dimension; WS_NSLOT (2..8), chunk slots per warp;
// WS_TIMELINE (0 / 1): thread 0 of every block writes the global timer at each stage's start and end
// (after the block's __syncthreads) into a.marks[block][2 stage + 0 / 1] (bench/weaver_stack.py
// --timeline; one more __syncthreads per stage, so timing only); WS_EARLY_EPILOGUE (1 / 0): a unit's
// bias and residual loads go out before its chunks, or (0, section 52's form) after its sums; WS_SYNC
// (0 / 1): the stages are separated by tfm_common.cuh's grid barrier (0, in its TFM_GRID_BARRIER form), or
// (1) by one counter per stage boundary: each block adds 1 with a release once its stage is done (no
// returned value, no reset, no generation word), and waits with acquire loads until all blocks have.
#include "tfm_common.cuh"
#include "tfm_mma.cuh"

#define WS_THREADS 256
#define WS_WARPS (WS_THREADS / 32)
#define WA_THREADS WS_THREADS
#ifndef WS_HD
#error "WS_HD (the head dimension) must be defined"
#endif
#define WA_HD WS_HD
#include "weaver_attention.cuh"

#ifndef WS_M
#define WS_M 2
#endif
#ifndef WS_LAYERS
#define WS_LAYERS 3
#endif
#ifndef WS_TIMELINE
#define WS_TIMELINE 0
#endif
#ifndef WS_EARLY_EPILOGUE
#define WS_EARLY_EPILOGUE 1
#endif
#ifndef WS_SYNC
#define WS_SYNC 0
#endif
#define WS_MAX_SYNCS 32  // stage counters in the scratch after the grid barrier's two ints (WS_SYNC 1)
#ifndef WS_NSLOT
#define WS_NSLOT 4
#endif
#if WS_M < 1 || WS_M > 16
#error "WS_M must be 1..16"
#endif
#define WS_MAX_LAYERS 4
#if WS_LAYERS < 1 || WS_LAYERS > WS_MAX_LAYERS
#error "WS_LAYERS must be 1..4"
#endif
#if WS_NSLOT < 2 || WS_NSLOT > 8
#error "WS_NSLOT must be 2..8"
#endif
#define WS_PIECES 8  // 16-byte pieces per lane and chunk
#if TFM_IN == 0
#define WS_CHUNK_STEPS 2  // a float32 step of one row is 2 pieces per lane
#else
#define WS_CHUNK_STEPS 4
#endif
#define WS_CHUNK_COLS (256 * WS_CHUNK_STEPS)
#define WS_NLIN (2 + 4 * WS_LAYERS)  // linear stages: token_in, 4 per layer, query
#define WS_NSTAGE (WS_NLIN + WS_LAYERS)  // and one attention stage per layer
static_assert(WS_NSTAGE - 1 <= WS_MAX_SYNCS, "a stage counter per boundary");

// One layer's weights and buffers (the wrapper's ctypes structure has the same fields in this order).
struct WSLayer {
  const tin* qkv_w;  // [6 heads hd, d]
  const tin* qkv_b;
  const tin* o_w;    // [d, heads hd]
  const tin* gu_w;   // [2 d_mlp, d]: gate rows, then up rows
  const tin* gu_b;
  const tin* down_w;  // [d, d_mlp]
  tin* kv;            // [2, R, heads, S, hd]
  tin* proj;          // [M, 6 heads hd]
  tin* attn;          // [M, heads hd]
  tin* x_mid;         // [M, d]
  tin* h;             // [M, d_mlp]
  tin* x_out;         // [M, d]
  float attn_eps, mlp_eps;
};

struct WSArgs {
  const tin* emb;  // [M, hidden]
  const tin* tok_w;  // [d, hidden]
  const tin* tok_b;
  const tin* qry_w;  // [n_q, d]
  const tin* qry_b;
  tin* x0;   // [M, d]
  tin* qry;  // [M, n_q]
  const tin* rope;  // [D, 2, 3, 1, hd]
  const i64* node_ids;
  const i64* parent_ids;
  const i64* depths;
  const unsigned char* valid;
  tin* key_bias;  // [R, n_slots + 2, cols]
  int* bar;       // grid barrier state (2 ints), then WS_MAX_SYNCS stage counters; zero before the launch
  float tok_eps, qry_eps, scale;
  int hidden, d, heads, d_mlp, n_q, S, p0, n_slots, cols, D, w, R;
  WSLayer layer[WS_MAX_LAYERS];
  long long* marks;  // WS_TIMELINE: [blocks][2 WS_NSTAGE]; else unused (null)
};

// One linear stage (kept in shared memory so that the weight stream can index stages at run time).
struct WSLin {
  const tin* w;
  const tin* bias;
  const tin* x;    // [M, k]
  const tin* res;  // [M, n] or null
  tin* y;          // [M, n]
  int n, k, mode, norm;
  float eps;
  int units;
};

__device__ __forceinline__ WSLin ws_make(const tin* w, const tin* bias, const tin* x, const tin* res, tin* y, int n,
                                         int k, int mode, int norm, float eps) {
  WSLin L;
  L.w = w;
  L.bias = bias;
  L.x = x;
  L.res = res;
  L.y = y;
  L.n = n;
  L.k = k;
  L.mode = mode;
  L.norm = norm;
  L.eps = eps;
  L.units = mode == 0 ? (n + 1) / 2 : n;
  return L;
}

// Linear stage s (a compile-time constant after unrolling: the parameter struct is indexed statically).
__device__ __forceinline__ WSLin ws_stage(const WSArgs& a, int s) {
  if (s == 0) return ws_make(a.tok_w, a.tok_b, a.emb, nullptr, a.x0, a.d, a.hidden, 0, 1, a.tok_eps);
  const int ahd = a.heads * WS_HD;
  if (s == WS_NLIN - 1)
    return ws_make(a.qry_w, a.qry_b, a.layer[WS_LAYERS - 1].x_out, nullptr, a.qry, a.n_q, a.d, 0, 1, a.qry_eps);
  const int l = (s - 1) / 4, j = (s - 1) % 4;
  const WSLayer& L = a.layer[l];
  const tin* x_in = l == 0 ? a.x0 : a.layer[l > 0 ? l - 1 : 0].x_out;
  if (j == 0) return ws_make(L.qkv_w, L.qkv_b, x_in, nullptr, L.proj, 6 * ahd, a.d, 0, 1, L.attn_eps);
  if (j == 1) return ws_make(L.o_w, nullptr, L.attn, x_in, L.x_mid, a.d, ahd, 0, 0, 0.0f);
  if (j == 2) return ws_make(L.gu_w, L.gu_b, L.x_mid, nullptr, L.h, a.d_mlp, a.d, 1, 1, L.mlp_eps);
  return ws_make(L.down_w, nullptr, L.h, L.x_mid, L.x_out, a.d, a.d_mlp, 0, 0, 0.0f);
}

__device__ __forceinline__ void ws_rows(const WSLin& L, int u, int& row0, int& row1) {
  if (L.mode == 0) {
    row0 = 2 * u;
    row1 = 2 * u + 1 < L.n ? 2 * u + 1 : 2 * u;  // an odd N repeats the last row
  } else {
    row0 = u;
    row1 = u + L.n;
  }
}

// The warp's weight-stream cursor: the next chunk to issue (stage, unit, chunk of the unit's K).
struct WSCursor {
  int s, u, c;
};

__device__ __forceinline__ void ws_skip_empty(const WSLin* s_lin, WSCursor& p, int gw) {
  while (p.s < WS_NLIN && gw >= s_lin[p.s].units) ++p.s;
}

// Issue the cursor's chunk into `slot` (this lane's pieces only), advance the cursor, commit a group
// (an empty one past the last chunk, so that every consumption waits on the same group count).
__device__ __forceinline__ void ws_issue(uint4* slot, const WSLin* s_lin, WSCursor& p, int gw, int nwarps, int lane) {
  if (p.s < WS_NLIN) {
    const WSLin& L = s_lin[p.s];
    int row0, row1;
    ws_rows(L, p.u, row0, row1);
    const tin* w0 = L.w + (i64)row0 * L.k;
    const tin* w1 = L.w + (i64)row1 * L.k;
#pragma unroll
    for (int st = 0; st < WS_CHUNK_STEPS; ++st) {
      const int k = p.c * WS_CHUNK_COLS + 256 * st + 8 * lane;
      if (k < L.k) {
#if TFM_IN == 0
        cp_async16(slot + (4 * st + 0) * 32 + lane, w0 + k);
        cp_async16(slot + (4 * st + 1) * 32 + lane, w0 + k + 4);
        cp_async16(slot + (4 * st + 2) * 32 + lane, w1 + k);
        cp_async16(slot + (4 * st + 3) * 32 + lane, w1 + k + 4);
#else
        cp_async16(slot + (2 * st + 0) * 32 + lane, w0 + k);
        cp_async16(slot + (2 * st + 1) * 32 + lane, w1 + k);
#endif
      }
    }
    if (++p.c * WS_CHUNK_COLS >= L.k) {
      p.c = 0;
      p.u += nwarps;
      if (p.u >= L.units) {
        ++p.s;
        p.u = gw;
        ws_skip_empty(s_lin, p, gw);
      }
    }
  }
  cp_async_commit();
}

// Eight activation elements -> float32 through a plain global load (see "Memory ordering").
__device__ __forceinline__ void ws_load8(const tin* p, float* o) {
#if TFM_IN == 0
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
  o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
#else
  raw8 r;
  r.v = *reinterpret_cast<const uint4*>(p);
  decode8(r, o);
#endif
}

// The boundary `k` (0, 1, ...) between two stages: every block's writes of the stage before are visible to
// every block after it (WS_SYNC above).
__device__ __forceinline__ void ws_stage_sync(int* bar, int k, int nblocks) {
#if WS_SYNC == 0
  (void)k;
  grid_barrier(bar, nblocks);
#else
  int* cnt = bar + 2 + k;
  __syncthreads();
  if (threadIdx.x == 0) {
    red_add_release_gpu(cnt, 1);
    while (ld_acquire_gpu(cnt) < nblocks) {
    }
  }
  __syncthreads();
#endif
}

// A unit's epilogue operands for output (m_out, n): mode 0 bias[n] -> e0 and res[m_out, n] -> e1 (n < N);
// mode 1 bias[row0] -> e0 and bias[row1] -> e2. Absent operands leave their zero.
__device__ __forceinline__ void ws_epilogue_operands(const WSLin& L, int n, int row0, int row1, int m_out, float& e0,
                                                     float& e1, float& e2) {
  if (L.mode == 0) {
    if (n < L.n) {
      if (L.bias != nullptr) e0 = to_f32(L.bias[n]);
      if (L.res != nullptr) e1 = to_f32(L.res[(i64)m_out * L.n + n]);
    }
  } else if (L.bias != nullptr) {
    e0 = to_f32(L.bias[row0]);
    e2 = to_f32(L.bias[row1]);
  }
}

// One linear stage: the norm's partial sums (warps 0-3), then the warp's units chunk by chunk from the
// ring, the epilogue of weaver_linear.cu. `consumed` counts the warp's chunks consumed so far.
__device__ __forceinline__ void ws_linear(int s, const WSLin* s_lin, float* s_ss, uint4* ring, WSCursor& p,
                                          int& consumed, int gw, int nwarps, int warp, int lane) {
  const WSLin& L = s_lin[s];
  const int k_dim = L.k;
  if (L.norm) {
    if (warp < 4) {  // every row's loads of a step in flight together, then one chain per row
      float ss[WS_M];
#pragma unroll
      for (int m = 0; m < WS_M; ++m) ss[m] = 0.0f;
      for (int j = warp; 256 * j < k_dim; j += 4) {
        const int k = 256 * j + 8 * lane;
        if (k < k_dim) {
          float v[WS_M][8];
#pragma unroll
          for (int m = 0; m < WS_M; ++m) ws_load8(L.x + (i64)m * k_dim + k, v[m]);
#pragma unroll
          for (int m = 0; m < WS_M; ++m) {
#pragma unroll
            for (int e = 0; e < 8; ++e) ss[m] = fmaf(v[m][e], v[m][e], ss[m]);
          }
        }
      }
#pragma unroll
      for (int m = 0; m < WS_M; ++m) {
        const float t = warp_sum(ss[m]);
        if (lane == 0) s_ss[warp * 16 + m] = t;
      }
    }
    __syncthreads();
  }
  // lane i < WS_M x outputs writes output (m, o) of each unit; mode 0: two outputs per row, mode 1: one
  const int outs = L.mode == 0 ? 2 : 1;
  const bool writer = lane < WS_M * outs;
  const int m_out = writer ? lane / outs : 0, o = writer ? lane - m_out * outs : 0;
  for (int u = gw; u < L.units; u += nwarps) {
    int row0, row1;
    ws_rows(L, u, row0, row1);
    const int n = L.mode == 0 ? (o == 0 ? row0 : 2 * u + 1) : row0;
    // The epilogue's operands (bias, residual) depend on nothing the unit computes (WS_EARLY_EPILOGUE):
    // their loads go out before the unit's chunks, so that their round trip (the bias from DRAM: cold
    // lines) overlaps the chunks instead of following the sums; the values and the order of the sums
    // are the same either way.
    float e0 = 0.0f, e1 = 0.0f, e2 = 0.0f;  // mode 0: bias[n], res[m, n]; mode 1: bias[row0], bias[row1]
#if WS_EARLY_EPILOGUE
    if (writer) ws_epilogue_operands(L, n, row0, row1, m_out, e0, e1, e2);
#endif
    float acc[WS_M][2];
#pragma unroll
    for (int m = 0; m < WS_M; ++m) acc[m][0] = acc[m][1] = 0.0f;
    for (int c = 0; c * WS_CHUNK_COLS < k_dim; ++c) {
      cp_async_wait<WS_NSLOT - 2>();  // chunk `consumed` has landed (this lane's pieces)
      ws_issue(ring + ((consumed + WS_NSLOT - 1) % WS_NSLOT) * (WS_PIECES * 32), s_lin, p, gw, nwarps, lane);
      const uint4* slot = ring + (consumed % WS_NSLOT) * (WS_PIECES * 32);
      ++consumed;
#pragma unroll
      for (int st = 0; st < WS_CHUNK_STEPS; ++st) {
        const int k = c * WS_CHUNK_COLS + 256 * st + 8 * lane;
        if (k < k_dim) {
          raw8 ra, rb;
#if TFM_IN == 0
          ra.lo = *reinterpret_cast<const float4*>(slot + (4 * st + 0) * 32 + lane);
          ra.hi = *reinterpret_cast<const float4*>(slot + (4 * st + 1) * 32 + lane);
          rb.lo = *reinterpret_cast<const float4*>(slot + (4 * st + 2) * 32 + lane);
          rb.hi = *reinterpret_cast<const float4*>(slot + (4 * st + 3) * 32 + lane);
#else
          ra.v = slot[(2 * st + 0) * 32 + lane];
          rb.v = slot[(2 * st + 1) * 32 + lane];
#endif
          float a[8], b[8];
          decode8(ra, a);
          decode8(rb, b);
#pragma unroll
          for (int m = 0; m < WS_M; ++m) {
            float v[8];
            ws_load8(L.x + (i64)m * k_dim + k, v);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              acc[m][0] = fmaf(a[j], v[j], acc[m][0]);
              acc[m][1] = fmaf(b[j], v[j], acc[m][1]);
            }
          }
        }
      }
    }
#pragma unroll
    for (int m = 0; m < WS_M; ++m) {
      acc[m][0] = warp_sum(acc[m][0]);
      acc[m][1] = warp_sum(acc[m][1]);
    }
    if (writer) {
      float z0 = 0.0f, z1 = 0.0f;
#pragma unroll
      for (int m = 0; m < WS_M; ++m) {
        if (m == m_out) {
          z0 = acc[m][0];
          z1 = acc[m][1];
        }
      }
      float sc = 1.0f;
      if (L.norm) {
        float t = 0.0f;
#pragma unroll
        for (int q = 0; q < 4; ++q) t += s_ss[q * 16 + m_out];  // weaver_linear's warp order
        sc = 1.0f / sqrtf(t / (float)k_dim + L.eps);
      }
#if !WS_EARLY_EPILOGUE
      ws_epilogue_operands(L, n, row0, row1, m_out, e0, e1, e2);
#endif
      if (L.mode == 0) {
        if (n < L.n) {
          float val = sc * (o == 0 ? z0 : z1);
          if (L.bias != nullptr) val += e0;
          if (L.res != nullptr) val += e1;
          L.y[(i64)m_out * L.n + n] = from_f32<tin>(val);
        }
      } else {
        float g = sc * z0, up = sc * z1;
        if (L.bias != nullptr) {
          g += e0;
          up += e2;
        }
        L.y[(i64)m_out * L.n + row0] = from_f32<tin>(silu(g) * up);
      }
    }
  }
}

extern "C" __global__ void __launch_bounds__(WS_THREADS, 1) weaver_stack(WSArgs a) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  // warps numbered block-minor (g = warp G + block): a stage's units spread over every block before
  // a block's second warp takes one, so stages of few units (o_proj, down: d / 2) keep every SM streaming
  const int gw = warp * gridDim.x + blockIdx.x, nwarps = gridDim.x * WS_WARPS, nblocks = gridDim.x;
  TFM_DYNAMIC_SMEM(uint4, s_raw);
  uint4* ring = s_raw + warp * (WS_NSLOT * WS_PIECES * 32);  // this warp's chunk slots
  WSLin* s_lin = reinterpret_cast<WSLin*>(s_raw + WS_WARPS * WS_NSLOT * WS_PIECES * 32);
  constexpr int lin_vec = (WS_NLIN * (int)sizeof(WSLin) + 15) / 16;
  float* s_ss = reinterpret_cast<float*>(reinterpret_cast<uint4*>(s_lin) + lin_vec);  // [4][16]
  uint4* s_attn = reinterpret_cast<uint4*>(s_ss + 64);
#pragma unroll
  for (int s = 0; s < WS_NLIN; ++s)
    if (tid == s) s_lin[s] = ws_stage(a, s);
  __syncthreads();

  // the first WS_NSLOT - 1 chunks of the warp's stream
  WSCursor p{0, gw, 0};
  ws_skip_empty(s_lin, p, gw);
#pragma unroll 1
  for (int i = 0; i < WS_NSLOT - 1; ++i) ws_issue(ring + i * (WS_PIECES * 32), s_lin, p, gw, nwarps, lane);
  int consumed = 0;
  int sync = 0;  // stage boundaries passed
  // stage j's start and end marks (WS_TIMELINE), in the order the stages run; no code without it
  long long* marks = WS_TIMELINE ? a.marks + (i64)blockIdx.x * (2 * WS_NSTAGE) : nullptr;
  int stage = 0;
  const auto mark_start = [&]() {
    if (WS_TIMELINE && tid == 0) marks[2 * stage] = tfm_globaltimer();
  };
  const auto mark_end = [&]() {
    if (WS_TIMELINE) {
      __syncthreads();
      if (tid == 0) marks[2 * stage + 1] = tfm_globaltimer();
    }
    ++stage;
  };

  mark_start();
  ws_linear(0, s_lin, s_ss, ring, p, consumed, gw, nwarps, warp, lane);
  mark_end();
#pragma unroll
  for (int l = 0; l < WS_LAYERS; ++l) {
    ws_stage_sync(a.bar, sync++, nblocks);
    mark_start();
    ws_linear(1 + 4 * l, s_lin, s_ss, ring, p, consumed, gw, nwarps, warp, lane);
    mark_end();
    ws_stage_sync(a.bar, sync++, nblocks);
    mark_start();
    const WSLayer& L = a.layer[l];
    for (int item = blockIdx.x; item < a.heads * a.R; item += nblocks) {
      wa_node_attention(item % a.heads, item / a.heads, a.R, s_attn, L.proj, (i64)(6 * a.heads * WS_HD), a.rope,
                        a.node_ids, a.parent_ids, a.depths, a.valid, L.kv, a.key_bias, L.attn, a.w, a.heads, a.S,
                        a.p0, a.n_slots, a.cols, a.D, a.scale, l == 0 ? 1 : 0);
      __syncthreads();  // the staged rows of this item, before the next item's copies
    }
    mark_end();
#pragma unroll
    for (int j = 2; j <= 4; ++j) {  // o_proj, gate_up, down
      ws_stage_sync(a.bar, sync++, nblocks);
      mark_start();
      ws_linear(j + 4 * l, s_lin, s_ss, ring, p, consumed, gw, nwarps, warp, lane);
      mark_end();
    }
  }
  ws_stage_sync(a.bar, sync++, nblocks);
  mark_start();
  ws_linear(WS_NLIN - 1, s_lin, s_ss, ring, p, consumed, gw, nwarps, warp, lane);
  mark_end();
  cp_async_wait<0>();  // the empty groups past the stream's end
}
