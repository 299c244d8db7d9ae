// One Weaver layer's attention for the nodes of one scorer call (vllm_tfm/models/weaver.py,
// BatchedWeaverTreeScorer), RoPE, K/V write and key mask included, in ONE launch: one CTA per
// (head, request).
//
// The torch path per layer is five kernels (RoPE as a mul and an addcmul over the qkv GEMM's
// output and its rotate_half rows, the K/V scatter into the per-request cache, SDPA with the
// additive key mask, the [R, heads, w, hd] -> [R w, heads hd] copy) plus, once per call, the
// gather / scatter / scatter of the nodes' key-mask rows; at R x w = 2 nodes each is a few
// microseconds of launch-bound work (bench/results/weaver_profile*.json.gz). Bytes per CTA: the
// prompt's and the node slots' K and V of one head (2 (1 + D + max_nodes) hd elements, 25 KB at the
// 27B drafter shape), the w rows' q/k/v and rotate_half rows: latency-bound, not bandwidth-bound.
//
// For node i = (request r, column i) of the call, head h (proj rows n = r w + i, viewed
// [R w, 2, 3, heads, hd]: (q, k, v), then their rotate_half rows):
//   slot = node_ids[r, i] if valid[r, i] else n_slots (the trash slot); key = p0 + slot;
//   q, k, v = x * cos + rot(x) * sin from rope[d, 0 / 1, part] ([D, 2, 3, 1, hd]: cos, sin of the
//          node's position for q and k, cos 1 and sin 0 for v; d = depths clamped to [0, D - 1]),
//          rounded to the activation dtype after the product and after the sum, as torch's mul
//          and addcmul_;
//   valid nodes write k, v to kv[0 / 1, r, h, key];
//   bias[j] = 0 if j == key else key_bias[r, parent mod (n_slots + 2), j], j < span = p0 + n_slots
//          (the parent's row: the prompt and the parent's ancestors-or-self; -1 -> row n_slots + 1,
//          the prompt only);
//   out[n, h hd : (h + 1) hd] = softmax(q . K[j] scale + bias[j]) . V over j < span, in float32
//          (probabilities not rounded), rounded once.
// With write_mask (the call's first layer), CTA h = 0 of request r writes the valid nodes' rows:
//   key_bias[r, slot, j] = bias[j] for j < cols. Those rows are new nodes' (never a parent of a
// node of the same call, the scorer's protocol), so no CTA of the launch reads them.
//
// Invalid rows: computed on clamped inputs, no K/V or mask write, output unspecified.
//
// Layout of the work. Version 1 (bench/NOTES.md section 28) staged K and V in a loop whose every
// 16-byte load waited before its shared store, and ran RoPE in a loop of dependent loads: two chains
// of ~12 global round trips per thread, 10-13 us per call on the H200 for ~25 KB per CTA. Now no
// global load waits for another past the node's indices (bench/NOTES.md section 38):
//   A  all threads: K (rows padded by 16 bytes: lanes reading one key each with 16-byte loads hit
//      distinct banks) and V of the span keys into shared memory by cp.async, all in flight at once;
//   B  one warp per node, overlapping A: the parent's mask row (lane j + 32 m) and the node's q, k,
//      v with their rotate_half rows and the table's cos / sin (lane l: element pairs 2 l + 64 t),
//      all loaded before any is used; RoPE; the valid node's k, v into the cache; q, own v, the own
//      key's score (a warp sum) and the mask to shared memory; the first layer's mask row;
//   C  after the one CTA barrier, one warp per node from shared memory only: scores with lanes over
//      keys (q . k in float32, element order), softmax by shuffles, then the output with lanes over
//      element pairs, the visible keys' V (a warp-uniform skip of zero probabilities) plus the own v,
//      divided by the sum and rounded once.
// The node's own K and V are taken from phase B, never from the staged rows (staged before the
// cache write).
//
// Shared memory (dynamic): K of the span keys ([span][hd] + 16 bytes per row), V ([span][hd]), float32
// q and own v of the w rows ([w][hd] each), the mask / probability rows ([w][span]), the own score
// and own key column per row ([w] each).
//
// Requirements (checked by the wrapper, vllm_tfm/kernels/weaver_attention.py): hd even with rows
// of hd elements a multiple of 16 bytes; kv [2, R, heads, S, hd], key_bias [R, n_slots + 2, cols]
// proj [R w, 6 heads hd] and rope contiguous; node ids < n_slots for valid rows; cols <= 32 WA_KEY_ITERS.
//
// Compile-time constants (NVRTC -D): TFM_IN, the activations' type (0 float32, 1 bfloat16,
// 2 float16); WA_HD, the head dimension hd.
#include "weaver_attention.cuh"

extern "C" __global__ void __launch_bounds__(WA_THREADS) weaver_node_attention(
    const tin* __restrict__ proj, i64 proj_ld, const tin* __restrict__ rope,
    const i64* __restrict__ node_ids, const i64* __restrict__ parent_ids, const i64* __restrict__ depths,
    const unsigned char* __restrict__ valid, tin* kv, tin* key_bias, tin* __restrict__ out,
    int w, int heads, int hd, int S, int p0, int n_slots, int cols, int D, float scale, int write_mask) {
  (void)hd;  // WA_HD
  // the next kernel (the o_proj linear, launched with programmatic dependent launch) may start now:
  // it loads its weights during this kernel and waits for its completion before reading our output;
  // this kernel, so launched too (VLLM_TFM_WEAVER_CHAIN_PDL), stages its K / V rows before its own wait
  pdl_launch_dependents();
  TFM_DYNAMIC_SMEM(uint4, s_raw);
  // proj and out are restrict here (written by no other block of this launch)
  wa_node_attention(blockIdx.x, blockIdx.y, gridDim.y, s_raw, proj, proj_ld, rope, node_ids, parent_ids, depths,
                    valid, kv, key_bias, out, w, heads, S, p0, n_slots, cols, D, scale, write_mask);
}
