// A full-graph tree step's topology tables, written on the device from the drafter's parents
// (vllm_tfm/kernels/step_topology.py; bench/NOTES.md section 41).
//
// A decode step that replays a full CUDA graph verifies R trees of n nodes each (request r's rows
// are r n .. r n + n - 1). Its graph reads three things that depend on the trees' shapes; the host
// used to build them from the proposal's host copy, after the drafter's end and before the
// forward's launch (runtime/full_graphs.py TreeGraphs.prepare_replay, hooks._tree_positions_and_counts):
//
// * the GDN plan (vllm_tfm/kernels/plan.py, TreePlan.build_into's fixed layout, int32):
//     cu [R + 1] | perm [T] | pos [T] | depth [T] | pair_off [T + 1] | pair_j [R cap] | req_of [T]
//   with T = R n, cap = n (n + 1) / 2; level order sorts a request's nodes by (depth, index);
//   pair_off is the running sum of depth + 1 over the global level order; pair_j lists each node's
//   root..node path (flat node indices) at its pair_off, zeros past the last path;
// * the tree attention's ancestor-or-self bitmasks (vllm_tfm/kernels/tree_attention.py,
//   TreeAttentionPlan.build_into): bits[t, w] bit j % 64 of word w = j / 64 set when local node j
//   lies on the root..t path (the plan's int32 meta stays as the layout wrote it);
// * the depth positions: positions[r n + k] = positions[r n] + depth(k) (RoPE of a tree row is its
//   root's position plus its depth; inputs.tree_positions), in each of pos_rows rows pos_ld apart
//   (1 row: 1-d RoPE; 3 rows: M-RoPE's temporal, height and width positions, vLLM's
//   mrope_positions [3, tokens], which a decode's text tokens advance together).
//
// Here they come from the proposal's parents on the device, stream-ordered after the drafter, so
// the host can launch the forward without its copy. Same tables, entry for entry (the wrapper's
// reference builds them with the host functions; tests/cpu/test_step_topology_kernel.py).
//
// parents: the proposal's local parents, int64 rows of n (row stride par_ld), -1 at the root; request
// r reads row rows[r] (rows == nullptr: row r). A malformed row (root not -1, a parent not before
// its child) counts into err[0] and its nodes get depth 0 with themselves as their only ancestor
// (memory safety; the host's later check of the same trees raises).
//
// One CTA of TOPO_THREADS threads (T <= TOPO_MAX_NODES, n <= TOPO_MAX_N: checked by the wrapper).
#include "tfm_common.cuh"

#define TOPO_THREADS 512
#define TOPO_MAX_NODES 2048  // 4 int tables of it in static shared memory (32 KB)
#define TOPO_MAX_N 128  // two bitmask words

extern "C" __global__ void __launch_bounds__(TOPO_THREADS)
tree_step_topology(const i64* __restrict__ parents, i64 par_ld, const int* __restrict__ rows, int R, int n,
                   int* __restrict__ plan, i64* __restrict__ bits, int words, i64* __restrict__ positions,
                   int pos_rows, i64 pos_ld, int* __restrict__ err) {
  __shared__ int s_par[TOPO_MAX_NODES];
  __shared__ int s_depth[TOPO_MAX_NODES];
  __shared__ int s_lpos[TOPO_MAX_NODES];   // level position within the request
  __shared__ int s_len[TOPO_MAX_NODES];    // path length (depth + 1) at each global level position
  __shared__ int s_part[TOPO_THREADS + 1]; // scan partials
  const int T = R * n, tid = threadIdx.x;
  const int cap = n * (n + 1) / 2;
  int* cu = plan;
  int* perm = cu + R + 1;
  int* pos = perm + T;
  int* depth = pos + T;
  int* pair_off = depth + T;
  int* pair_j = pair_off + T + 1;
  int* req_of = pair_j + R * cap;

  // parents into shared memory, checked
  int bad = 0;
  for (int t = tid; t < T; t += TOPO_THREADS) {
    const int r = t / n, k = t - r * n;
    const i64 row = rows ? (i64)rows[r] : (i64)r;
    const i64 p = parents[row * par_ld + k];
    const bool ok = k == 0 ? p == -1 : (p >= 0 && p < k);
    bad += ok ? 0 : 1;
    s_par[t] = ok ? (int)p : -2;  // -2: malformed
  }
  if (bad) atomicAdd(err, bad);
  __syncthreads();

  // depths and ancestor-or-self bitmasks (a walk to the root: parents precede their children)
  for (int t = tid; t < T; t += TOPO_THREADS) {
    const int r = t / n, k = t - r * n, base = r * n;
    i64 w0 = 0, w1 = 0;
    int d = 0, j = k;
    bool broken = false;
    while (j >= 0) {
      if (j < 64) w0 |= (i64)1 << j; else w1 |= (i64)1 << (j - 64);
      const int p = s_par[base + j];
      if (p == -2) { broken = true; break; }
      if (p >= 0) ++d;
      j = p;
    }
    if (broken) { d = 0; w0 = k < 64 ? (i64)1 << k : 0; w1 = k < 64 ? 0 : (i64)1 << (k - 64); }
    s_depth[t] = d;
    depth[t] = d;
    req_of[t] = r;
    bits[(i64)t * words] = w0;
    if (words > 1) bits[(i64)t * words + 1] = w1;
    if (positions != nullptr && k > 0)  // roots (k = 0) are read, never written: no race with these reads
      for (int q = 0; q < pos_rows; ++q) positions[q * pos_ld + t] = positions[q * pos_ld + (i64)r * n] + d;
  }
  for (int r = tid; r <= R; r += TOPO_THREADS) cu[r] = r * n;
  __syncthreads();

  // level order within each request: by depth, then index
  for (int t = tid; t < T; t += TOPO_THREADS) {
    const int r = t / n, k = t - r * n, base = r * n, d = s_depth[t];
    int lp = 0;
    for (int j = 0; j < n; ++j) {
      const int dj = s_depth[base + j];
      lp += (dj < d || (dj == d && j < k)) ? 1 : 0;
    }
    s_lpos[t] = lp;
    pos[t] = base + lp;
    perm[base + lp] = t;
    s_len[base + lp] = d + 1;
  }
  __syncthreads();

  // pair_off: exclusive running sum of the path lengths in global level order (each thread a chunk)
  const int chunk = (T + TOPO_THREADS - 1) / TOPO_THREADS;
  const int lo = tid * chunk < T ? tid * chunk : T, hi = lo + chunk < T ? lo + chunk : T;
  int sum = 0;
  for (int p = lo; p < hi; ++p) sum += s_len[p];
  s_part[tid] = sum;
  __syncthreads();
  if (tid == 0) {
    int run = 0;
    for (int i = 0; i < TOPO_THREADS; ++i) { const int v = s_part[i]; s_part[i] = run; run += v; }
    s_part[TOPO_THREADS] = run;
  }
  __syncthreads();
  int run = s_part[tid];
  for (int p = lo; p < hi; ++p) {
    const int v = s_len[p];
    s_len[p] = run;  // now the offset
    pair_off[p] = run;
    run += v;
  }
  const int total = s_part[TOPO_THREADS];
  if (tid == 0) pair_off[T] = total;
  __syncthreads();

  // pair_j: each node's root..node path at its offset; zeros after the last path
  for (int t = tid; t < T; t += TOPO_THREADS) {
    const int r = t / n, base = r * n;
    const int off = s_len[base + s_lpos[t]];
    int e = s_depth[t], j = t - base;
    if (s_par[t] == -2 || e == 0) { pair_j[off] = t; continue; }
    while (j >= 0 && e >= 0) {
      pair_j[off + e] = base + j;
      j = s_par[base + j];
      --e;
    }
  }
  for (int i = total + tid; i < R * cap; i += TOPO_THREADS) pair_j[i] = 0;
}
