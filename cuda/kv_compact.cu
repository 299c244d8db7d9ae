// K/V compaction of the accepted tree paths, every full-attention layer of one KV-cache group in ONE
// launch (vllm_tfm/kernels/kv_compact.py; its torch reference kv_compact_reference is the semantics).
//
// After a tree step, accepted path node k of a request moves from token row src_rows[m] to token row
// dst_rows[m] (m = r * Dmax + k, runtime/commit.py compaction_rows): for every layer, the cache bytes
// of slot slot_mapping[src] are copied to slot slot_mapping[dst], where slot s lives at block s / bs,
// offset s % bs of the logical [num_blocks, H, bs, 2 * head_size] TRITON_ATTN cache (any strides).
// The kernel copies bytes: the dtype does not matter, only its size (fp8 and the per-token-head scale
// padding of vLLM's quantised caches move like bf16 values).
//
// Layout of the work: one CTA per (column slice, layer). A column slice is KVC_LANES consecutive
// "units" (KVC_UNIT bytes each: 16-byte vector copies when the last dimension is contiguous and every
// stride and base is 16-byte aligned, else the largest size that divides them, down to one element)
// of a token row's H x 2 head_size content; lane l of every warp owns unit 32 x + l, the warps share
// out the moves: warp w holds moves w P .. w P + P - 1 (P = KVC_PER_THREAD) of the round in registers.
// At the Qwen3.6-27B shape (4 KV heads x 2 x 256 x 2 B = 4 KB per row and layer, 256 units) that is
// 8 slices x 16 layers = 128 CTAs: one wave on the H200's 132 SMs whatever the batch. The job is a
// few hundred KB at batch 1 (16 layers x <= 16 rows x 4 KB read and as much written), so it is
// latency-bound: every thread issues all its loads (up to P x 16 B) before any store, i.e. one
// memory round trip for the loads, then the stores. (A CTA per (request, layer) would need the
// requests' boundaries, which the flat row lists do not carry; splitting the columns instead keeps
// every move of a layer's slice in one CTA, so one barrier orders all its loads before all its stores.)
//
// Ordering (why the result equals the reference's "gather everything, then scatter everything"):
// * Different CTAs touch disjoint bytes: another layer (the wrapper refuses overlapping caches) or
//   other units of the rows (the wrapper refuses a layout whose elements overlap).
// * Within a CTA, a round's moves are all loaded (each thread its units of its P moves), then the
//   __syncthreads, then all stored: no store of the round can precede a load of the round, whatever
//   the rows are. The wrapper sizes the CTA (up to KVC_MAX_WARPS warps) so that one round holds all
//   moves up to KVC_ROUND = 128 of them (batch 8 at Dmax 16); then the kernel equals the reference
//   for ANY input.
// * More moves than KVC_ROUND take several rounds, in list order. Still exact for the lists
//   compaction_rows makes: within a request, move k reads row base + a_k with a_k >= k + 1 (a depth
//   k + 1 node has local index >= k + 1) and writes row base + 1 + k, so a move of a later round
//   (k' > k) reads a row >= base + k' + 1 > base + 1 + k: never a row an earlier round wrote. What an
//   earlier round read was read before its barrier, so a later round's stores cannot overtake it.
//   Padding entries copy the root row onto itself and are skipped (below); requests have disjoint
//   rows, and distinct rows have distinct slots.
// * A move whose two slots are equal is skipped: it would copy bytes onto themselves (no other
//   move writes that slot: destinations are distinct), so skipping it changes nothing.
// * A move whose row or slot is out of range (a row not in slot_mapping, a slot < 0 such as vLLM's
//   padding slot -1, a block past num_blocks) is skipped too: memory safety; no legal input has one.
#include "tfm_common.cuh"

#ifndef KVC_UNIT
#define KVC_UNIT 16
#endif
#define KVC_LANES 32         // units per CTA: one per lane of a warp
#define KVC_PER_THREAD 8     // moves a thread holds in registers per round
#define KVC_MAX_WARPS 16
#define KVC_ROUND (KVC_MAX_WARPS * KVC_PER_THREAD)  // 128 moves per round at most

#if KVC_UNIT == 16
typedef uint4 kvc_unit;
#elif KVC_UNIT == 8
typedef uint2 kvc_unit;
#elif KVC_UNIT == 4
typedef u32 kvc_unit;
#elif KVC_UNIT == 2
typedef u16 kvc_unit;
#elif KVC_UNIT == 1
typedef unsigned char kvc_unit;
#else
#error "KVC_UNIT must be 1, 2, 4, 8 or 16 (bytes per copy)"
#endif

// layers: [L] base addresses of the caches (one table row per layer, grid y); every layer has the same
// shape and strides. slot_mapping: [num_slots] slot of each token row; src_rows / dst_rows: [num_moves].
// Strides in bytes: s_block (dim 0), s_head (dim 1), s_tok (dim 2), s_unit (between consecutive units
// of a head's 2 * head_size content: KVC_UNIT when the last dimension is contiguous, else its stride).
extern "C" __global__ void __launch_bounds__(KVC_MAX_WARPS * 32)
kv_compact_layers(const i64* __restrict__ layers, const i64* __restrict__ slot_mapping, i64 num_slots,
                  const i64* __restrict__ src_rows, const i64* __restrict__ dst_rows, int num_moves,
                  i64 num_blocks, int block_size, i64 s_block, i64 s_head, i64 s_tok, i64 s_unit,
                  int units_per_head, int units_per_row) {
  // byte offsets (within a layer) of the round's sources and destinations; -1: skip the move
  __shared__ i64 s_src[KVC_ROUND];
  __shared__ i64 s_dst[KVC_ROUND];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int cap = (int)(blockDim.x >> 5) * KVC_PER_THREAD;  // moves per round (<= blockDim.x)
  const int u = (int)blockIdx.x * KVC_LANES + lane;
  const bool mine = u < units_per_row;
  const int h = mine ? u / units_per_head : 0;
  const int c = mine ? u - h * units_per_head : 0;
  char* const base = reinterpret_cast<char*>(layers[blockIdx.y]) + (i64)h * s_head + (i64)c * s_unit;
  const i64 num_cache_slots = num_blocks * (i64)block_size;

  for (int r0 = 0; r0 < num_moves; r0 += cap) {
    if (tid < cap) {
      const int m = r0 + tid;
      i64 so = -1, dof = -1;
      if (m < num_moves) {
        const i64 sr = src_rows[m], dr = dst_rows[m];
        if (sr >= 0 && sr < num_slots && dr >= 0 && dr < num_slots) {
          const i64 ss = slot_mapping[sr], ds = slot_mapping[dr];
          if (ss != ds && ss >= 0 && ds >= 0 && ss < num_cache_slots && ds < num_cache_slots) {
            so = (ss / block_size) * s_block + (ss % block_size) * s_tok;
            dof = (ds / block_size) * s_block + (ds % block_size) * s_tok;
          }
        }
      }
      s_src[tid] = so;
      s_dst[tid] = dof;
    }
    __syncthreads();

    // every load of the round ...
    kvc_unit v[KVC_PER_THREAD];
    i64 dst[KVC_PER_THREAD];
#pragma unroll
    for (int j = 0; j < KVC_PER_THREAD; ++j) {
      const int k = warp * KVC_PER_THREAD + j;
      const i64 so = s_src[k], d = s_dst[k];
      dst[j] = mine && so >= 0 ? d : -1;
      if (dst[j] >= 0) v[j] = *reinterpret_cast<const kvc_unit*>(base + so);
    }
    __syncthreads();  // ... has read its bytes before any store of the round (ordering, above)
#pragma unroll
    for (int j = 0; j < KVC_PER_THREAD; ++j)
      if (dst[j] >= 0) *reinterpret_cast<kvc_unit*>(base + dst[j]) = v[j];
    __syncthreads();  // the next round rewrites s_src / s_dst
  }
}
