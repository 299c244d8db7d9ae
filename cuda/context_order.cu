// The DFlash drafter's context order of a tree step's rows in ONE launch (vllm_tfm/kernels/context_order.py;
// its torch reference dflash_context_order_reference is the semantics).
//
// After a tree step the drafter must see, per request, the rows before the root, the root, the accepted path
// in depth order, then the request's other rows in their order (the rejected tree nodes, which the drafter
// overwrites). The torch reference sorts keys (~20 small launches and a radix sort, ~0.1 ms of a batch-1 27B
// step's drafting: bench/NOTES.md section 68); here each row computes where it goes.
//
// One thread per row t of the T scheduled rows, request r = req_index[t] (rows of a request contiguous and in
// request order, vLLM's batch layout), root row base = row_base[r], local = t - base:
//   * local <= 0 (the root and the rows before it) stays in place: perm[t] = t;
//   * an accepted node (local == accepted[r, c], valid entries >= 0, in depth order) of rank k (1 + the valid
//     entries before column c) goes to base + k;
//   * any other row goes after the path: base + L + local - P, with L the request's valid entries and P those
//     whose local index is below local (the rows it no longer has in front of it).
// perm[dest] = t, so perm lists the rows in their new order (the reference's argsort). A destination outside
// [0, T) (inconsistent inputs; never from a legal step) is skipped (memory safety).
// Inputs int64: req_index [T], row_base [R], accepted [R, dmax] (-1 padding); output perm int64 [T].
#include "tfm_common.cuh"

#define CO_THREADS 128

extern "C" __global__ void __launch_bounds__(CO_THREADS)
dflash_context_order(const i64* __restrict__ req_index, const i64* __restrict__ row_base,
                     const i64* __restrict__ accepted, int dmax, int num_rows, i64* __restrict__ perm) {
  const int t = blockIdx.x * CO_THREADS + threadIdx.x;
  if (t >= num_rows) return;
  const i64 r = req_index[t];
  const i64 base = row_base[r];
  const i64 local = (i64)t - base;
  if (local <= 0) {
    perm[t] = t;
    return;
  }
  const i64* acc = accepted + r * (i64)dmax;
  int valid = 0, below = 0, rank = 0;
  for (int c = 0; c < dmax; ++c) {
    const i64 node = acc[c];
    if (node < 0) continue;
    ++valid;
    if (node < local) ++below;
    if (node == local && rank == 0) rank = valid;
  }
  const i64 dest = rank ? base + rank : base + valid + local - below;
  if (dest >= 0 && dest < num_rows) perm[dest] = t;
}
