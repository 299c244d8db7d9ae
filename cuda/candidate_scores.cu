// The Weaver scorer's candidate scores (vllm_tfm/models/weaver.py, BatchedWeaverTreeScorer): for
// every scored node n = (request r, column i) at depth d = depths[r, i] and every candidate k < K,
//
//     out[n, k] = float(cand_logits[r, d, k]) + sum_h table[cand_ids[r, d, k], h] * queries[n, h]
//
// (the DFlash logit plus the lm_head row of the candidate dotted with the Weaver's query), in
// float32 from the stored values. The torch path gathers the K lm_head rows of every node
// (index_select: R w K H elements written), converts them to float32 (written again, twice the
// bytes) and runs a batched GEMV over them; this kernel reads each row once and writes only the
// scores. At the 27B shape (H = 5120, K = 512, bfloat16) a row is 10 KB and a call at R x w nodes
// reads R w K 10 KB (10.5 MB at R w = 2, 84 MB at 16): bandwidth-bound, no data reuse but the query.
//
// One warp per (node, candidate): lane l accumulates h = 8 l + 256 j (16-byte loads of the row and
// of the query, which all warps of a CTA share through L1), then a butterfly sum. The order of the
// additions is fixed (per lane in h order, then the butterfly), so results are deterministic and
// agree with a float64 reference to float32 rounding of a sum of H products.
//
// Requirements (checked by the wrapper, vllm_tfm/kernels/candidate_scores.py): H % 8 == 0, the
// table's and the queries' rows 16-byte aligned (so a row is a whole number of prefetch_l2's 16-byte
// units); cand_ids, cand_logits [R, D, K] and out [R w, K] contiguous. Depths are clamped to [0, D - 1] and ids to [0, table_rows - 1] (memory safety; the
// scorer passes clamped depths and the DFlash top-K ids of the same vocabulary).
//
// Compile-time constants (NVRTC -D): TFM_IN, the table's and the queries' type (0 float32,
// 1 bfloat16, 2 float16); CS_LOGIT, the type of cand_logits (same codes).
#include "tfm_common.cuh"

#ifndef CS_LOGIT
#define CS_LOGIT 0
#endif

#if CS_LOGIT == 0
typedef float tlogit;
#elif CS_LOGIT == 1
typedef bf16s tlogit;
#elif CS_LOGIT == 2
typedef f16s tlogit;
#else
#error "CS_LOGIT must be 0 (float32), 1 (bfloat16) or 2 (float16)"
#endif

#define CS_WARPS 4  // candidates per CTA (one warp each); the wrapper's WARPS

extern "C" __global__ void __launch_bounds__(CS_WARPS * 32) candidate_scores(
    const tin* __restrict__ table, i64 table_rows, i64 table_ld,
    const i64* __restrict__ cand_ids, const tlogit* __restrict__ cand_logits,
    const i64* __restrict__ depths, i64 depths_ld,
    const tin* __restrict__ queries, i64 queries_ld,
    float* __restrict__ out, int w, int D, int K, int H) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n = blockIdx.y;
  const int k = blockIdx.x * CS_WARPS + warp;
  if (k >= K) return;
  const int r = n / w, i = n - r * w;
  i64 d = depths[(i64)r * depths_ld + i];
  d = d < 0 ? 0 : (d >= D ? D - 1 : d);
  const i64 e = ((i64)r * D + d) * K + k;
  i64 id = cand_ids[e];
  id = id < 0 ? 0 : (id >= table_rows ? table_rows - 1 : id);
  const tin* __restrict__ row = table + id * table_ld;
  // Launched with programmatic dependent launch (VLLM_TFM_WEAVER_CHAIN_PDL), this block may start while the query
  // linear before it still runs: the ids, depths and the table are older (the DFlash top-K, the growth round before
  // the call, weights), so the row is fetched into L2 first; the query is read after the wait.
  if (lane == 0) prefetch_l2(row, (u32)(H * (int)sizeof(tin)));
  pdl_wait();
  const tin* __restrict__ q = queries + (i64)n * queries_ld;
  float acc = 0.0f;
#pragma unroll 4
  for (int h = lane * 8; h < H; h += 256) {
    float a[8], b[8];
    load8(row + h, a);
    load8(q + h, b);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc = fmaf(a[j], b[j], acc);
  }
  acc = warp_sum(acc);
  if (lane == 0) out[(i64)n * K + k] = to_f32(cand_logits[e]) + acc;
}
