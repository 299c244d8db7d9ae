// The k largest entries of every row of a [rows, V] matrix, best first, ties to the lower index
// (vllm_tfm/kernels/topk_rows.py; its torch reference topk_rows_reference is the semantics): the DFlash
// candidates of the Weaver tree build (models/proposal_trees.py), k = 512 of V = 248320 logits per depth
// at the Qwen3.6-27B shape. torch.topk (on a float32 copy of the bf16 logits) took ~55 us at batch 1
// (15 rows) and ~330 us at batch 8 (120 rows) in the e2e kernel profile (bench/NOTES.md section 47).
//
// Order: values map to an order-preserving unsigned key (the usual radix-sort map: a negative value's
// bits inverted, a non-negative value's sign bit set), with -0.0 mapped to +0.0's key (they tie) and
// every NaN to the largest key (torch.topk puts NaN first too). The row's entries are then ordered by
// (key descending, index ascending); the first k are the output.
//
// Work: one thread block cluster of C CTAs per row (grid (C, rows), cluster (C, 1, 1)); CTA rank c holds
// entries [c chunk, (c + 1) chunk) of the row in shared memory (one read of the row from global memory).
// The k-th key T is found by radix selection over the cluster, most significant digit first (digits of
// 12 + 4 bits for 16-bit values, 12 + 12 + 8 for float32: 12-bit digits spread the entries of a pass
// over enough bins that the shared-memory histogram's atomics rarely collide within a warp):
//   each CTA counts its entries whose key matches the digits decided so far into a local histogram of
//   the next digit; barrier; CTA c sums bin slice c over the cluster's histograms (distributed shared
//   memory) and publishes the slice's total to every CTA; barrier; the CTA whose slice holds the
//   remaining rank finds the bin by a warp scan and publishes (bin, entries above it) to every CTA;
//   barrier. After the last digit every CTA knows T and c_gt, the number of keys > T in the row.
// Collection: each thread owns a contiguous run of its CTA's chunk (so thread order is index order),
// counts its keys > T and == T, and the block and cluster prefix sums give every entry its place in
// CTA 0's candidate buffer: keys > T anywhere in [0, c_gt) (their order does not matter yet), keys == T
// by index rank, the first k - c_gt of them at c_gt + rank (the lowest indices among the ties).
// CTA 0 then sorts the k candidates (key, reversed index) as one 64-bit composite by a bitonic sort in
// shared memory (padded to kp, a power of two, with zeros: no real composite is 0) and writes values
// (re-read from x, as float32) and indices.
//
// Races: a CTA's histogram is read by the others only between the first and second cluster barrier of a
// pass and zeroed in the next pass, after the third; the published slice totals, decision and counts are
// written before the barrier after which they are read, and rewritten only after a barrier every reader
// has passed (the argument is next to each barrier below).
//
// Compile-time constant (NVRTC -D): TK_IN, the element type of x: 0 float32, 1 bfloat16, 2 float16.
#include "tfm_common.cuh"

#ifndef TK_IN
#define TK_IN 1
#endif
#define TK_THREADS 256
#define TK_WARPS (TK_THREADS / 32)
#define TK_MAX_BINS 4096      // 12-bit digits
#define TK_MAX_CLUSTER 8
#define TK_MAX_K 1024
#define TK_LOADS 8            // 16-byte loads per thread in flight while the chunk is read
#define TK_MISC 64            // ints: [0, 8) slice totals, [8, 16) > T counts, [16, 24) == T counts,
                              // 24 decided bin, 25 entries above it, [32, 40) warp sums

#if TK_IN == 0
typedef u32 tk_raw;
#define TK_BITS 32
#define TK_PASSES 3
#elif TK_IN == 1 || TK_IN == 2
typedef u16 tk_raw;
#define TK_BITS 16
#define TK_PASSES 2
#else
#error "TK_IN must be 0 (float32), 1 (bfloat16) or 2 (float16)"
#endif

typedef unsigned long long tk_u64;

__device__ __forceinline__ int tk_digit_bits(int pass) { return pass == 0 ? 12 : (TK_BITS == 16 ? 4 : (pass == 1 ? 12 : 8)); }

// Order-preserving key of a value's bits (module comment).
__device__ __forceinline__ u32 tk_key(u32 b) {
#if TK_IN == 0
  const u32 mag = b & 0x7fffffffu;
  if (mag > 0x7f800000u) return 0xffffffffu;  // NaN
  if (mag == 0u) return 0x80000000u;          // -0.0 ties with +0.0
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
#else
  const u32 mag = b & 0x7fffu;
  const u32 inf = TK_IN == 1 ? 0x7f80u : 0x7c00u;
  if (mag > inf) return 0xffffu;
  if (mag == 0u) return 0x8000u;
  return (b & 0x8000u) ? (~b & 0xffffu) : (b | 0x8000u);
#endif
}

__device__ __forceinline__ float tk_value(tk_raw b) {
#if TK_IN == 0
  return __uint_as_float(b);
#elif TK_IN == 1
  return bf16_bits_to_f32(b);
#else
  return f16_bits_to_f32(b);
#endif
}

// Inclusive sum over the lanes of a warp (every lane calls it).
__device__ __forceinline__ int tk_warp_scan(int v, int lane) {
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int o = __shfl_sync(0xffffffffu, v, lane >= d ? lane - d : lane);
    if (lane >= d) v += o;
  }
  return v;
}

__host__ __device__ constexpr int tk_align16(int bytes) { return (bytes + 15) & ~15; }

// Dynamic shared memory of one CTA (the wrapper's topk_smem_bytes mirrors it).
__host__ __device__ inline int tk_smem_bytes(int chunk, int cluster, int kp) {
  return tk_align16(chunk * (int)sizeof(tk_raw)) + 4 * TK_MAX_BINS + 4 * (TK_MAX_BINS / cluster) + 8 * kp +
         4 * 2 * TK_THREADS + 4 * TK_MISC;
}

// x: rows of V entries, row r at x + r * row_stride (elements); chunk: entries per CTA (a multiple of 8,
// cluster * chunk >= V); vec: 16-byte loads (x and row_stride * sizeof aligned to 16 bytes);
// out_val / out_idx: [rows, k] contiguous. 1 <= k <= min(V, TK_MAX_K), kp the power of two >= max(k, 2).
extern "C" __global__ void __launch_bounds__(TK_THREADS, 2)
topk_rows(const tk_raw* __restrict__ x, i64 row_stride, int V, int k, int kp, int chunk, int vec,
          float* __restrict__ out_val, i64* __restrict__ out_idx) {
  TFM_DYNAMIC_SMEM(uint4, smem_u4);
  const int C = (int)cluster_nctarank(), rank = (int)cluster_ctarank();
  if (C > TK_MAX_CLUSTER || (int)dynamic_smem_bytes() < tk_smem_bytes(chunk, C, kp)) __trap();
  char* p = reinterpret_cast<char*>(smem_u4);
  tk_raw* data = reinterpret_cast<tk_raw*>(p);
  p += tk_align16(chunk * (int)sizeof(tk_raw));
  int* hist = reinterpret_cast<int*>(p);
  p += 4 * TK_MAX_BINS;
  int* tot = reinterpret_cast<int*>(p);  // this CTA's slice of the cluster's histogram
  p += 4 * (TK_MAX_BINS / C);
  tk_u64* cand = reinterpret_cast<tk_u64*>(p);  // CTA 0: the k candidates, then kp - k zeros
  p += 8 * kp;
  int* scan = reinterpret_cast<int*>(p);  // [0, T) exclusive > T prefixes, [T, 2T) == T prefixes
  p += 4 * 2 * TK_THREADS;
  int* misc = reinterpret_cast<int*>(p);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const i64 row = blockIdx.y;
  const int lo = rank * chunk;
  const int n = max(0, min(chunk, V - lo));
  const tk_raw* src = x + row * row_stride + lo;

  // The chunk into shared memory.
  // (TK_LOADS loads per thread issued before their stores: one memory round trip per TK_LOADS x 4 KB)
  if (vec) {
    constexpr int PER16 = 16 / (int)sizeof(tk_raw);
    const int nv = n / PER16;
    for (int i0 = 0; i0 < nv; i0 += TK_LOADS * TK_THREADS) {
      uint4 r[TK_LOADS];
#pragma unroll
      for (int u = 0; u < TK_LOADS; ++u) {
        const int i = i0 + u * TK_THREADS + tid;
        if (i < nv) r[u] = reinterpret_cast<const uint4*>(src)[i];
      }
#pragma unroll
      for (int u = 0; u < TK_LOADS; ++u) {
        const int i = i0 + u * TK_THREADS + tid;
        if (i < nv) reinterpret_cast<uint4*>(data)[i] = r[u];
      }
    }
    for (int i = nv * PER16 + tid; i < n; i += TK_THREADS) data[i] = src[i];
  } else {
    for (int i0 = 0; i0 < n; i0 += TK_LOADS * TK_THREADS) {
      tk_raw r[TK_LOADS];
#pragma unroll
      for (int u = 0; u < TK_LOADS; ++u) {
        const int i = i0 + u * TK_THREADS + tid;
        if (i < n) r[u] = src[i];
      }
#pragma unroll
      for (int u = 0; u < TK_LOADS; ++u) {
        const int i = i0 + u * TK_THREADS + tid;
        if (i < n) data[i] = r[u];
      }
    }
  }
  if (rank == 0)
    for (int i = k + tid; i < kp; i += TK_THREADS) cand[i] = 0ull;

  // Radix selection of the k-th key: prefix = the digits decided so far, above = the row's keys greater
  // than every key with that prefix. Every thread of every CTA holds the same values.
  u32 prefix = 0u;
  int above = 0;
  int shift = TK_BITS;
  for (int pass = 0; pass < TK_PASSES; ++pass) {
    const int w = tk_digit_bits(pass);
    shift -= w;
    const int nb = 1 << w;
    for (int b = tid; b < nb; b += TK_THREADS) hist[b] = 0;  // no CTA reads it now (third barrier below)
    __syncthreads();  // zeroed (and, in pass 0, the chunk stored) before the counts
    for (int i = tid; i < n; i += TK_THREADS) {
      const u32 key = tk_key(data[i]);
      if (pass == 0 || (key >> (shift + w)) == prefix) atomicAdd(&hist[(key >> shift) & (u32)(nb - 1)], 1);
    }
    // (1) every histogram complete; the previous pass's decision read by every thread
    cluster_arrive();
    cluster_wait();
    const int per = nb / C, b0 = rank * per;
    for (int j = tid; j < per; j += TK_THREADS) {  // the C remote loads of a bin issued together
      int v[TK_MAX_CLUSTER];
#pragma unroll
      for (int r = 0; r < TK_MAX_CLUSTER; ++r) v[r] = r < C ? cluster_map(hist, (u32)r)[b0 + j] : 0;
      int s = 0;
#pragma unroll
      for (int r = 0; r < TK_MAX_CLUSTER; ++r) s += v[r];
      tot[j] = s;
    }
    int s = 0;
    for (int j = tid; j < per; j += TK_THREADS) s += tot[j];  // this thread's own tot entries
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) s += __shfl_xor_sync(0xffffffffu, s, d);
    if (lane == 0) misc[32 + warp] = s;
    __syncthreads();
    if (tid < C) {
      int total = 0;
      for (int wi = 0; wi < TK_WARPS; ++wi) total += misc[32 + wi];
      cluster_map(misc, (u32)tid)[rank] = total;  // slice total to CTA tid
    }
    // (2) the slice totals everywhere, the histograms read (they are zeroed next pass, after (3))
    cluster_arrive();
    cluster_wait();
    const int remaining = k - above;  // rank (1-based) of the k-th key among the keys with this prefix
    int sl = 0, cum = 0;
    for (int r = C - 1; r >= 0; --r) {  // slices from the highest bins down
      if (cum + misc[r] >= remaining) {
        sl = r;
        break;
      }
      cum += misc[r];
    }
    if (rank == sl && warp == 0) {  // the bin, scanning the slice from its highest bin down
      const int g = (per + 31) / 32;
      const int j0 = lane * g, j1 = min(per, j0 + g);  // descending positions: bin per - 1 - j
      int ls = 0;
      for (int j = j0; j < j1; ++j) ls += tot[per - 1 - j];
      const int incl = tk_warp_scan(ls, lane), excl = incl - ls;
      const int target = remaining - cum;
      if (excl < target && target <= incl) {
        int c = excl;
        for (int j = j0; j < j1; ++j) {
          const int t = tot[per - 1 - j];
          if (c + t >= target) {
            for (int r = 0; r < C; ++r) {
              int* m = cluster_map(misc, (u32)r);
              m[24] = b0 + per - 1 - j;
              m[25] = above + cum + c;
            }
            break;
          }
          c += t;
        }
      }
    }
    // (3) the decision everywhere; every CTA's slice totals read (rewritten next pass, after (1))
    cluster_arrive();
    cluster_wait();
    prefix = (prefix << w) | (u32)misc[24];
    above = misc[25];
  }
  const u32 T = prefix;
  const int c_gt = above, need_eq = k - above;

  // Collection: thread tid owns entries [a, e) of the chunk.
  const int run = (n + TK_THREADS - 1) / TK_THREADS;
  const int a = min(n, tid * run), e = min(n, a + run);
  int ngt = 0, neq = 0;
#pragma unroll 8
  for (int i = a; i < e; ++i) {
    const u32 key = tk_key(data[i]);
    ngt += key > T;
    neq += key == T;
  }
  const int igt = tk_warp_scan(ngt, lane), ieq = tk_warp_scan(neq, lane);
  if (lane == 31) {
    scan[warp] = igt;               // warp totals (scan's slots are free until the prefixes below)
    scan[TK_THREADS + warp] = ieq;
  }
  __syncthreads();
  int wgt = 0, weq = 0, bgt = 0, beq = 0;
  for (int wi = 0; wi < TK_WARPS; ++wi) {
    const int tg = scan[wi], te = scan[TK_THREADS + wi];
    if (wi < warp) {
      wgt += tg;
      weq += te;
    }
    bgt += tg;
    beq += te;
  }
  if (tid < C) {
    int* m = cluster_map(misc, (u32)tid);
    m[8 + rank] = bgt;
    m[16 + rank] = beq;
  }
  // (4) the cluster's counts everywhere
  cluster_arrive();
  cluster_wait();
  int gt_base = 0, eq_base = 0;
  for (int r = 0; r < rank; ++r) {
    gt_base += misc[8 + r];
    eq_base += misc[16 + r];
  }
  tk_u64* out = cluster_map(cand, 0u);
  int gi = gt_base + wgt + igt - ngt, ei = eq_base + weq + ieq - neq;
  for (int i = a; i < e; ++i) {
    const u32 key = tk_key(data[i]);
    const tk_u64 comp = ((tk_u64)key << 32) | (tk_u64)(0xffffffffu - (u32)(lo + i));
    if (key > T) {
      out[gi++] = comp;
    } else if (key == T) {
      if (ei < need_eq) out[c_gt + ei] = comp;
      ++ei;
    }
  }
  // (5) every candidate stored in CTA 0; nothing reads another CTA's memory after this
  cluster_arrive();
  cluster_wait();
  if (rank != 0) return;

  // Bitonic sort of the kp composites, descending.
  for (int size = 2; size <= kp; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      __syncthreads();
      for (int t = tid; t < kp / 2; t += TK_THREADS) {
        const int i = 2 * t - (t & (stride - 1)), j = i + stride;
        const bool up = (i & size) == 0;
        const tk_u64 A = cand[i], B = cand[j];
        if ((A < B) == up) {
          cand[i] = B;
          cand[j] = A;
        }
      }
    }
  }
  __syncthreads();
  const tk_raw* xr = x + row * row_stride;
  for (int t = tid; t < k; t += TK_THREADS) {
    const i64 idx = (i64)(0xffffffffu - (u32)(cand[t] & 0xffffffffull));
    out_idx[row * k + t] = idx;
    out_val[row * k + t] = tk_value(xr[idx]);
  }
}
