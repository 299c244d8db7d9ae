// One lockstep round of the Weaver tree growth (vllm_tfm/tree/weaver_padded.py, WeaverGrowth:
// _push then _materialise) for every request of a batch in ONE launch: one CTA per request.
//
// The torch round is ~42 small kernels (sorts, gathers, scatters over a few hundred frontier
// slots); at the 27B shape the Weaver build runs 16 rounds per decode step, so the builder alone is
// ~680 launches of ~3 us each. This kernel does the same work on the same tensors:
//
// push (the scorer's output for the m nodes of the last round): for each row i, x = out[i] if
//   valid[i] else -inf; any valid entry that is not <= 0 (NaN included) clears *fine; the top c
//   entries in the order (value descending, index ascending) -- torch.sort(stable=True)'s order --
//   become the node's children in frontier slots node[i] * c + rank:
//     fi[slot] = (token cand[d_i * K + col], depth_words[i] + step[d_i][rank]), word 0 set to
//                DEAD_BIT alone when the value is -inf;
//     ff[slot] = (score[i] + value, value) in float64.
// materialise: alive = word 0 < DEAD_BIT; take = min(left, width, alive count); the first w slots
//   in the order (path score descending with dead slots at -inf, rank-path words ascending, slot
//   ascending) -- padded.sort_by_key's order -- are sel[0..w-1]; column j < take becomes node
//   budget + 1 - left + j (others go to the trash column n_cap), node_slot[node] = sel[j], word 0 of
//   sel[j] (trash slot for j >= take) becomes DEAD_BIT, left -= take, and the next round's scorer
//   inputs are written: node, parent = sel / c, token, depth clamped to dmax, (depth, words),
//   path score, expand = (j < take) & (depth < max_depth) & (left > 0); n_alive, take, room.
//
// In place: the next round's inputs may be the very buffers this round reads (node, d,
// depth_words, score, valid = expand): every input is read in phase 1, every output written after a
// block barrier. Blocks touch only their own request's rows (and *fine, which they only clear).
//
// NaN in a valid row: *fine is cleared (the growth raises at its first host sync); the children
// chosen for such a row are then unspecified (never read).
//
// Compile-time constant (NVRTC -D): WR_OUT, the type of out: 0 float32, 1 bfloat16, 2 float16,
// 3 float64.
#include "tfm_common.cuh"

#ifndef WR_OUT
#define WR_OUT 0
#endif

#define WR_THREADS 128
#define WR_WARPS (WR_THREADS / 32)
#define WR_DEAD_BIT (1LL << 62)
#define WR_MAX_WORDS 4  // rank-path words (1 + W <= 5 int64 per slot)
#define WR_BATCH 4      // frontier slots a thread loads at once in phase 2

#if WR_OUT == 0
typedef float tout;
#elif WR_OUT == 1
typedef bf16s tout;
#elif WR_OUT == 2
typedef f16s tout;
#elif WR_OUT == 3
typedef double tout;
#else
#error "WR_OUT must be 0 (float32), 1 (bfloat16), 2 (float16) or 3 (float64)"
#endif

__device__ __forceinline__ double out_value(float x) { return (double)x; }
__device__ __forceinline__ double out_value(double x) { return x; }
__device__ __forceinline__ double out_value(bf16s x) { return (double)to_f32(x); }
__device__ __forceinline__ double out_value(f16s x) { return (double)to_f32(x); }

__device__ __forceinline__ i64 wr_min(i64 a, i64 b) { return a < b ? a : b; }
__device__ __forceinline__ double wr_inf() { return __longlong_as_double(0x7ff0000000000000LL); }

// Per-request limit: the tensor's entry when given, else the scalar.
__device__ __forceinline__ i64 per_request(const i64* __restrict__ t, i64 all, int r) { return t ? t[r] : all; }

// Is frontier slot a before slot b in the materialise order? Keys in shared memory.
__device__ __forceinline__ bool slot_before(int a, int b, const double* sc, const i64* wd, int nw) {
  const double sa = sc[a], sb = sc[b];
  if (sa != sb) return sa > sb;
  for (int t = 0; t < nw; ++t) {
    const i64 x = wd[a * nw + t], y = wd[b * nw + t];
    if (x != y) return x < y;
  }
  return a < b;
}

// Is entry (va, a) before (vb, b) in the push order (value descending, index ascending)?
__device__ __forceinline__ bool entry_before(double va, int a, double vb, int b) {
  return va > vb || (va == vb && a < b);
}

// grid (R), block WR_THREADS, dynamic shared memory (F (1 + nw) + WR_WARPS (K + c)) * 8 + WR_WARPS c * 4
// bytes.
extern "C" __global__ void __launch_bounds__(WR_THREADS)
weaver_round(const tout* __restrict__ out, i64 out_r, i64 out_m, const unsigned char* __restrict__ valid, i64 valid_r,
             const i64* node_in, i64 node_r, const i64* d_in, i64 d_r, const i64* dw_in, i64 dw_r, i64 dw_m,
             const double* score_in, i64 score_r,
             const i64* __restrict__ cand_flat, const i64* __restrict__ step,
             i64* __restrict__ fi, double* __restrict__ ff, i64* __restrict__ node_slot, i64* __restrict__ left,
             unsigned char* __restrict__ fine,
             const i64* __restrict__ width_r, i64 width_all, const i64* __restrict__ depth_r, i64 depth_all,
             const i64* __restrict__ budget1_r, i64 budget1_all,
             i64* node_o, i64* parent_o, i64* tok_o, i64* d_o, i64* dw_o, double* score_o, unsigned char* expand_o,
             i64* __restrict__ n_alive_o, i64* __restrict__ take_o, unsigned char* __restrict__ room_o,
             int m, int K, int c, int nw, int F, int n_cap, int w, int dmax) {
  TFM_DYNAMIC_SMEM(double, s_score);            // [F] sort score (-inf for dead slots)
  i64* s_words = reinterpret_cast<i64*>(s_score + F);  // [F, nw] rank-path words, then per warp a row
  // [WR_WARPS, K], its children's values [WR_WARPS, c] and indices [WR_WARPS, c] (int32)
  __shared__ int s_sel[64];                     // the selected slots (w <= 64)
  __shared__ int s_red[WR_WARPS];
  __shared__ int s_alive;
  const int r = blockIdx.x, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int ci = 2 + nw;
  i64* fir = fi + (i64)r * F * ci;
  double* ffr = ff + (i64)r * F * 2;
  const double inf = wr_inf();
  if (tid == 0) s_alive = 0;

  // ---- phase 1: push the children of the m scored rows. A warp stages its row once in shared
  // memory (as the float64 values compared), picks the c children one after another from there
  // (every selection's scan and butterfly read shared memory), keeps them in shared memory, and
  // writes all c children's frontier slots at once afterwards: their loads (candidate ids, rank
  // steps) are then issued together instead of two dependent round trips per child.
  double* s_row = reinterpret_cast<double*>(s_words + (i64)F * nw) + (i64)warp * K;  // [K] per warp
  double* s_cv = reinterpret_cast<double*>(s_words + (i64)F * nw) + (i64)WR_WARPS * K + (i64)warp * c;  // [c]
  int* s_ci = reinterpret_cast<int*>(reinterpret_cast<double*>(s_words + (i64)F * nw) + (i64)WR_WARPS * (K + c))
              + warp * c;  // [c]
  for (int i = warp; i < m; i += WR_WARPS) {
    const bool v = valid[r * valid_r + i] != 0;
    const tout* row = out + r * out_r + i * out_m;
    const i64 node = node_in[r * node_r + i];
    const int d = (int)d_in[r * d_r + i];
    const double sc = score_in[r * score_r + i];
    i64 dwi[1 + WR_MAX_WORDS];
#pragma unroll
    for (int t = 0; t <= WR_MAX_WORDS; ++t) dwi[t] = t <= nw ? dw_in[r * dw_r + i * dw_m + t] : 0;
    bool bad = false;
    for (int k = lane; k < K; k += 32) {
      const double x = v ? out_value(row[k]) : -inf;
      if (v && !(x <= 0.0)) bad = true;
      s_row[k] = x;
    }
    __syncwarp();
    double pv = inf;  // the previous child (value, index); +inf / -1: none yet
    int pi = -1;
    for (int j = 0; j < c; ++j) {
      int bi = -1;
      double bv = 0.0;
#pragma unroll 4
      for (int k = lane; k < K; k += 32) {
        const double x = s_row[k];
        if (!(x < pv || (x == pv && k > pi))) continue;  // not after the previous child
        if (bi < 0 || x > bv) { bi = k; bv = x; }        // lanes scan k upwards: ties keep the lower k
      }
      for (int o = 16; o > 0; o >>= 1) {
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (oi >= 0) {
          const double ov = s_row[oi];
          if (bi < 0 || entry_before(ov, oi, bv, bi)) { bi = oi; bv = ov; }
        }
      }
      if (bi < 0) { bi = j; bv = -inf; }  // only after NaN (flagged): any in-range child
      if (lane == 0) { s_ci[j] = bi; s_cv[j] = bv; }
      pv = bv;
      pi = bi;
    }
    __syncwarp();
    for (int j = lane; j < c; j += 32) {  // child j of the row: frontier slot node * c + j
      const int bi = s_ci[j];
      const double bv = s_cv[j];
      const i64 slot = node * c + j;
      const i64 tok = cand_flat[(i64)r * (dmax + 1) * K + (i64)d * K + bi];
      i64 val[1 + WR_MAX_WORDS];
#pragma unroll
      for (int t = 0; t <= WR_MAX_WORDS; ++t) val[t] = t <= nw ? step[((i64)d * c + j) * (1 + nw) + t] : 0;
      fir[slot * ci] = tok;
#pragma unroll
      for (int t = 0; t <= WR_MAX_WORDS; ++t) {  // word t + 1: the depth, then the rank-path words
        if (t <= nw) fir[slot * ci + 1 + t] = (t == 1 && bv == -inf) ? WR_DEAD_BIT : dwi[t] + val[t];
      }
      ffr[slot * 2] = sc + bv;
      ffr[slot * 2 + 1] = bv;
    }
    for (int o = 16; o > 0; o >>= 1) bad |= __shfl_xor_sync(0xffffffffu, (int)bad, o) != 0;
    if (bad && lane == 0) *fine = 0;
    __syncwarp();  // every lane is done with s_row, s_ci, s_cv before the warp's next row
  }
  __syncthreads();

  // ---- phase 2: load the frontier keys (a batch of slots' loads per thread at once), count the
  // alive slots
  int mine = 0;
  for (int base = tid; base < F; base += WR_THREADS * WR_BATCH) {
    i64 wd[WR_BATCH][WR_MAX_WORDS];
    double scv[WR_BATCH];
#pragma unroll
    for (int u = 0; u < WR_BATCH; ++u) {
      const int s = base + u * WR_THREADS;
      if (s < F) {
#pragma unroll
        for (int t = 0; t < WR_MAX_WORDS; ++t) wd[u][t] = (t == 0 || t < nw) ? fir[s * ci + 2 + t] : 0;  // word 0: the alive mark
        scv[u] = ffr[s * 2];
      }
    }
#pragma unroll
    for (int u = 0; u < WR_BATCH; ++u) {
      const int s = base + u * WR_THREADS;
      if (s < F) {
        const bool alive = wd[u][0] < WR_DEAD_BIT;
        mine += alive;
        s_score[s] = alive ? scv[u] : -inf;
#pragma unroll
        for (int t = 0; t < WR_MAX_WORDS; ++t) {
          if (t < nw) s_words[s * nw + t] = wd[u][t];
        }
      }
    }
  }
  if (mine) atomicAdd(&s_alive, mine);
  __syncthreads();
  const i64 left0 = left[r];
  const i64 n_alive = s_alive;
  const i64 cap = wr_min(left0, per_request(width_r, width_all, r));
  const i64 take = wr_min(cap, n_alive);

  // ---- phase 3: the first w slots in the materialise order, one block-wide argmin each
  int prev = -1;
  for (int j = 0; j < w; ++j) {
    int best = -1;
    for (int s = tid; s < F; s += WR_THREADS) {
      if (prev >= 0 && !slot_before(prev, s, s_score, s_words, nw)) continue;
      if (best < 0 || slot_before(s, best, s_score, s_words, nw)) best = s;
    }
    for (int o = 16; o > 0; o >>= 1) {
      const int ob = __shfl_xor_sync(0xffffffffu, best, o);
      if (ob >= 0 && (best < 0 || slot_before(ob, best, s_score, s_words, nw))) best = ob;
    }
    if (lane == 0) s_red[warp] = best;
    __syncthreads();
    if (tid == 0) {
      int b = s_red[0];
      for (int q = 1; q < WR_WARPS; ++q) {
        const int o = s_red[q];
        if (o >= 0 && (b < 0 || slot_before(o, b, s_score, s_words, nw))) b = o;
      }
      s_sel[j] = b;  // F >= w: always found
    }
    __syncthreads();
    prev = s_sel[j];
  }

  // ---- phase 4: nodes, the next round's scorer inputs, dead marks
  const i64 left1 = left0 - take;
  const bool room = left1 > 0;
  const int j = tid;
  int s = 0;
  bool ok = false;
  i64 tok = 0, depth = 0, words[WR_MAX_WORDS] = {0, 0, 0, 0};
  double score = 0.0;
  if (j < w) {  // read every selected slot before any is marked dead
    s = s_sel[j];
    ok = j < take;
    tok = fir[s * ci];
    depth = fir[s * ci + 1];
    for (int t = 0; t < nw; ++t) words[t] = fir[s * ci + 2 + t];
    score = ffr[s * 2];
  }
  __syncthreads();
  if (j < w) {
    const i64 node = ok ? per_request(budget1_r, budget1_all, r) - left0 + j : n_cap;
    const i64 dcl = wr_min(depth, (i64)dmax);
    if (ok) {  // a column past take names the trash node: nothing reads its node_slot, its slot stays dead
      node_slot[(i64)r * (n_cap + 1) + node] = s;
      fir[s * ci + 2] = WR_DEAD_BIT;
    }
    const i64 o = (i64)r * w + j;
    node_o[o] = node;
    parent_o[o] = s / c;
    tok_o[o] = tok;
    d_o[o] = dcl;
    dw_o[o * (1 + nw)] = depth;
    for (int t = 0; t < nw; ++t) dw_o[o * (1 + nw) + 1 + t] = words[t];
    score_o[o] = score;
    expand_o[o] = (ok && dcl < per_request(depth_r, depth_all, r) && room) ? 1 : 0;
  }
  if (tid == 0) {
    left[r] = left1;
    n_alive_o[r] = n_alive;
    take_o[r] = take;
    room_o[r] = room ? 1 : 0;
  }
}
