// Greedy tree acceptance of a ragged batch in ONE launch (vllm_tfm/kernels/greedy_accept.py; its torch
// reference tree_greedy_accept_reference, which is vllm_tfm.verify.sampling's greedy walk, is the semantics).
//
// A request's tree is accepted greedily: from the root, the walk moves to the first child (in node index
// order) whose draft token equals the target's argmax at the current node, until no child does; the
// bonus token is the argmax at the last node. The torch path takes ~45 small launches for this at batch 1
// (the children table, pointer doubling, the path gathers, vLLM's int32 layout); a tree step of the 27B
// shape spent ~0.1 ms of device time in them (bench/NOTES.md section 67).
//
// One CTA per request, GA_THREADS threads:
//   1. s_next[i] = n (no accepted child) for every local node i;
//   2. every non-root node i whose draft token equals target[parent] is a candidate step of its parent:
//      atomicMin(s_next[parent], i) leaves the first such child in index order;
//   3. thread 0 walks s_next from the root (a node's next is a larger index, so the walk ends);
//   4. all threads write the outputs: accepted local nodes (-1 padded to dmax), the accepted count, the
//      last node, the bonus, the output tokens (drafts, bonus, -1) as int64 and as vLLM's int32
//      sampled_token_ids [R, sampled_cols] (-1 past dmax + 1).
// Inputs: target [T] int64 (argmax of every logits row), parents [T] int64 local (-1 at each root), cu
// [R + 1] int64 (cu[r + 1] - cu[r] <= GA_MAX_N, checked by the wrapper), drafts [T - R] (int32 or int64,
// drafts_i64) in request order: local node i >= 1 of request r is drafts[cu[r] - r - 1 + i]. A parent
// that is not an earlier node of the request is never stepped to (memory safety; no legal tree has one).
#include "tfm_common.cuh"

#define GA_THREADS 128
#define GA_MAX_N 1024  // nodes per request (B <= 1023)

extern "C" __global__ void __launch_bounds__(GA_THREADS)
tree_greedy_accept(const i64* __restrict__ target, const i64* __restrict__ parents,
                   const i64* __restrict__ cu, const void* __restrict__ drafts, int drafts_i64, int dmax,
                   i64* __restrict__ accepted, i64* __restrict__ num_accepted, i64* __restrict__ last_node,
                   i64* __restrict__ bonus, i64* __restrict__ out_tokens, int* __restrict__ sampled,
                   int sampled_cols) {
  __shared__ int s_next[GA_MAX_N];
  __shared__ int s_path[GA_MAX_N];
  __shared__ int s_depth;
  const int r = blockIdx.x, tid = threadIdx.x;
  const i64 base = cu[r];
  const int n = (int)(cu[r + 1] - base);
  const i64 dbase = base - r - 1;  // drafts index of local node i >= 1: dbase + i
  const i64* d64 = reinterpret_cast<const i64*>(drafts);
  const int* d32 = reinterpret_cast<const int*>(drafts);

  for (int i = tid; i < n; i += GA_THREADS) s_next[i] = n;
  __syncthreads();
  for (int i = 1 + tid; i < n; i += GA_THREADS) {
    const i64 p = parents[base + i];
    if (p < 0 || p >= i) continue;
    const i64 tok = drafts_i64 ? d64[dbase + i] : (i64)d32[dbase + i];
    if (tok == target[base + p]) atomicMin(&s_next[(int)p], i);
  }
  __syncthreads();
  if (tid == 0) {
    int cur = 0, d = 0;
    while (d < dmax && s_next[cur] < n) {
      cur = s_next[cur];
      s_path[d++] = cur;
    }
    s_depth = d;
  }
  __syncthreads();

  const int d = s_depth;
  const int last = d ? s_path[d - 1] : 0;
  const i64 b = target[base + last];
  if (tid == 0) {
    num_accepted[r] = d;
    last_node[r] = last;
    bonus[r] = b;
  }
  for (int k = tid; k < dmax; k += GA_THREADS) accepted[(i64)r * dmax + k] = k < d ? s_path[k] : -1;
  const int cols = max(dmax + 1, sampled_cols);
  for (int k = tid; k < cols; k += GA_THREADS) {
    i64 v = -1;
    if (k < d) {
      const int i = s_path[k];
      v = drafts_i64 ? d64[dbase + i] : (i64)d32[dbase + i];
    } else if (k == d) {
      v = b;
    }
    if (k <= dmax) out_tokens[(i64)r * (dmax + 1) + k] = v;
    if (k < sampled_cols) sampled[(i64)r * sampled_cols + k] = (int)v;
  }
}
