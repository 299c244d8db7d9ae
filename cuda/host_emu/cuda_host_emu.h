// CPU emulation of the small part of CUDA the vllm-tfm kernels use, to run them without a GPU.
//
// Not a simulator of timing or of the memory model: every CUDA thread of a block is a std::thread,
// __syncthreads is a std::barrier over the block, warp shuffles exchange through a per-warp buffer
// between two warp barriers, __shared__ variables are process-wide statics (blocks run one after
// another), and dynamic shared memory is one buffer per block. A thread block cluster's blocks run
// concurrently (so a clustered kernel must keep to dynamic shared memory), with a std::barrier over
// all their threads for barrier.cluster and mapa as pointer arithmetic between their buffers. The
// warp-level matrix ops of cuda/tfm_mma.cuh (ldmatrix, mma.sync m16n8k16 and m16n8k8.tf32) exchange
// their operands through a per-warp buffer and follow the PTX ISA's fragment layouts; cvt.rna.tf32
// is the hardware's bit arithmetic; a cp.async copies only when a wait_group completes its group (so
// a missing wait reads poisoned shared memory); atomics are host atomics. A kernel source is compiled
// as C++20 with this header force-included and TFM_HOST_EMU defined (see emulate.py beside this).
// What it checks: indexing, bounds (with -fsanitize=address), barrier placement, cp.async waits, the
// host-side sizes (shared memory words) and the arithmetic, against the torch reference.
#pragma once

#include <algorithm>
#include <atomic>
#include <barrier>
#include <deque>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline float2 make_float2(float a, float b) { return float2{a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }

namespace tfm_emu {
struct BlockCtx {
  std::barrier<>* block_bar;
  std::vector<std::unique_ptr<std::barrier<>>>* warp_bars;
  std::vector<float>* shfl_buf;  // [warps * 32]
  std::vector<std::uint64_t>* xchg;  // [threads * 8]: operands of the warp-collective matrix ops
  unsigned char* smem;
  unsigned smem_bytes;
};
// A cluster's CTAs run concurrently (their threads together), each with its own shared memory.
struct ClusterCtx {
  std::barrier<>* bar;                  // every thread of every CTA of the cluster
  std::vector<unsigned char*> smem;     // by rank
  unsigned size;
};
inline thread_local dim3 t_threadIdx, t_blockIdx;
inline dim3 g_blockDim, g_gridDim;
inline unsigned g_cluster_x = 1;  // CTAs per cluster along x for the next launch (tfm_emu_set_cluster)
inline thread_local BlockCtx* t_ctx = nullptr;
inline thread_local ClusterCtx* t_cluster = nullptr;
inline thread_local unsigned t_crank = 0;
inline thread_local std::optional<std::barrier<>::arrival_token> t_cluster_token;
}  // namespace tfm_emu

#define threadIdx (tfm_emu::t_threadIdx)
#define blockIdx (tfm_emu::t_blockIdx)
#define blockDim (tfm_emu::g_blockDim)
#define gridDim (tfm_emu::g_gridDim)

inline void* tfm_emu_dynamic_smem() { return tfm_emu::t_ctx->smem; }
inline unsigned dynamic_smem_bytes() { return tfm_emu::t_ctx->smem_bytes; }

inline void __syncthreads() { tfm_emu::t_ctx->block_bar->arrive_and_wait(); }

// Thread block clusters: the rank along x, the split cluster barrier (an arrival keeps its token until
// the thread's wait) and a peer CTA's copy of a shared-memory address.
inline unsigned cluster_ctarank() { return tfm_emu::t_crank; }
inline unsigned cluster_nctarank() { return tfm_emu::t_cluster->size; }
inline void cluster_arrive() {
  if (tfm_emu::t_cluster_token) {
    std::fprintf(stderr, "tfm_emu: barrier.cluster.arrive twice without a wait\n");
    std::abort();
  }
  tfm_emu::t_cluster_token.emplace(tfm_emu::t_cluster->bar->arrive());
}
inline void cluster_arrive_relaxed() { cluster_arrive(); }
inline void cluster_wait() {
  if (!tfm_emu::t_cluster_token) {
    std::fprintf(stderr, "tfm_emu: barrier.cluster.wait without an arrival\n");
    std::abort();
  }
  tfm_emu::t_cluster->bar->wait(std::move(*tfm_emu::t_cluster_token));
  tfm_emu::t_cluster_token.reset();
}
template <typename T>
inline T* cluster_map(T* p, unsigned rank) {
  const auto* c = reinterpret_cast<const unsigned char*>(p);
  const auto* base = tfm_emu::t_ctx->smem;
  if (c < base || c >= base + tfm_emu::t_ctx->smem_bytes || rank >= tfm_emu::t_cluster->size) {
    std::fprintf(stderr, "tfm_emu: mapa of an address outside shared memory or to rank %u\n", rank);
    std::abort();
  }
  return reinterpret_cast<T*>(tfm_emu::t_cluster->smem[rank] + (c - base));
}

inline float __shfl_xor_sync(unsigned /*mask*/, float v, int m) {
  const unsigned tid = threadIdx.x;
  const unsigned warp = tid / 32, lane = tid % 32;
  auto& buf = *tfm_emu::t_ctx->shfl_buf;
  auto& bar = *(*tfm_emu::t_ctx->warp_bars)[warp];
  buf[warp * 32 + lane] = v;
  bar.arrive_and_wait();
  const float r = buf[warp * 32 + (lane ^ (unsigned)m)];
  bar.arrive_and_wait();
  return r;
}

// The int overload (butterfly exchanges of indices): the same exchange through the float buffer, bit for bit.
inline int __shfl_xor_sync(unsigned mask, int v, int m) {
  float f;
  std::memcpy(&f, &v, 4);
  const float r = __shfl_xor_sync(mask, f, m);
  int out;
  std::memcpy(&out, &r, 4);
  return out;
}

// Lane `src` (0..31) of the warp's value; every lane of the warp must call it (as with a full mask).
inline int __shfl_sync(unsigned /*mask*/, int v, int src) {
  const unsigned tid = threadIdx.x;
  const unsigned warp = tid / 32, lane = tid % 32;
  auto& buf = *tfm_emu::t_ctx->shfl_buf;
  auto& bar = *(*tfm_emu::t_ctx->warp_bars)[warp];
  float f;
  std::memcpy(&f, &v, 4);
  buf[warp * 32 + lane] = f;
  bar.arrive_and_wait();
  const float r = buf[warp * 32 + ((unsigned)src & 31u)];
  bar.arrive_and_wait();
  int out;
  std::memcpy(&out, &r, 4);
  return out;
}

// Whether any lane of the warp passes a non-zero predicate; every lane must call it (a full mask).
inline int __any_sync(unsigned /*mask*/, int pred) {
  const unsigned tid = threadIdx.x;
  const unsigned warp = tid / 32, lane = tid % 32;
  auto& buf = *tfm_emu::t_ctx->shfl_buf;
  auto& bar = *(*tfm_emu::t_ctx->warp_bars)[warp];
  buf[warp * 32 + lane] = pred ? 1.f : 0.f;
  bar.arrive_and_wait();
  int any = 0;
  for (unsigned l = 0; l < 32; ++l) any |= buf[warp * 32 + l] != 0.f;
  bar.arrive_and_wait();
  return any;
}

[[noreturn]] inline void __trap() {
  std::fprintf(stderr, "tfm_emu: __trap() in block (%u,%u,%u) thread %u\n", blockIdx.x, blockIdx.y, blockIdx.z,
               threadIdx.x);
  std::abort();
}

inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline double __longlong_as_double(long long i) { double d; std::memcpy(&d, &i, 8); return d; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float f16_bits_to_f32(unsigned b) {
  _Float16 h; unsigned short s = (unsigned short)b; std::memcpy(&h, &s, 2); return (float)h;
}
inline unsigned short f32_to_f16_bits(float x) {
  _Float16 h = (_Float16)x; unsigned short s; std::memcpy(&s, &h, 2); return s;
}
inline void __syncwarp(unsigned /*mask*/ = 0xffffffffu) {
  (*tfm_emu::t_ctx->warp_bars)[threadIdx.x / 32]->arrive_and_wait();
}

// Global atomics and fences (blocks run one after another; the threads of a block concurrently).
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline int atomicExch(int* p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
inline int atomicMin(int* p, int v) {
  int old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (v < old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
  }
  return old;
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// cp.async: a copy is recorded in the thread's open group and happens only when a wait_group
// completes its group (commit_group closes the open group; wait_group N completes the oldest
// committed groups until at most N remain; copies not yet committed stay pending, as on the GPU).
// So shared memory read before its wait still holds the poison of `run` (NaN for floats), and a
// slot overwritten before its copy was consumed shows the later copy. Pending copies complete when
// the thread exits.
namespace tfm_emu {
struct PendingCopy {
  void* dst;
  const void* src;
  unsigned bytes;
};
inline thread_local std::vector<PendingCopy> t_cp_open;
inline thread_local std::deque<std::vector<PendingCopy>> t_cp_groups;
inline void cp_complete(const std::vector<PendingCopy>& group) {
  for (const PendingCopy& c : group) std::memcpy(c.dst, c.src, c.bytes);
}
inline void cp_flush() {
  while (!t_cp_groups.empty()) {
    cp_complete(t_cp_groups.front());
    t_cp_groups.pop_front();
  }
  cp_complete(t_cp_open);
  t_cp_open.clear();
}
}  // namespace tfm_emu
inline void tfm_emu_copy_async(void* dst, const void* src, unsigned bytes) {
  tfm_emu::t_cp_open.push_back(tfm_emu::PendingCopy{dst, src, bytes});
}
inline void tfm_emu_copy16(void* dst, const void* src) { tfm_emu_copy_async(dst, src, 16); }
inline void tfm_emu_cp_commit() {
  tfm_emu::t_cp_groups.push_back(std::move(tfm_emu::t_cp_open));
  tfm_emu::t_cp_open.clear();
}
inline void tfm_emu_cp_wait(unsigned n) {
  while (tfm_emu::t_cp_groups.size() > n) {
    tfm_emu::cp_complete(tfm_emu::t_cp_groups.front());
    tfm_emu::t_cp_groups.pop_front();
  }
}

namespace tfm_emu {
// Every lane of the warp publishes `n` words, the warp synchronises, `body` reads any lane's words
// (slot(lane, k)), the warp synchronises again.
template <typename F>
inline void warp_exchange(const std::uint64_t* mine, int n, F&& body) {
  const unsigned tid = threadIdx.x, warp = tid / 32;
  auto& buf = *t_ctx->xchg;
  auto& bar = *(*t_ctx->warp_bars)[warp];
  for (int k = 0; k < n; ++k) buf[tid * 8 + k] = mine[k];
  bar.arrive_and_wait();
  body([&](unsigned lane, int k) { return buf[(warp * 32 + lane) * 8 + k]; });
  bar.arrive_and_wait();
}
inline float half_bits_to_float(unsigned bits, bool bf16) {
  return bf16 ? __uint_as_float((bits & 0xffffu) << 16) : f16_bits_to_f32(bits & 0xffffu);
}
}  // namespace tfm_emu

// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16, from the PTX ISA: lanes 8i..8i+7 give the
// addresses of the 8 rows (8 x 16 bits each) of matrix i; register i of lane l holds matrix i's
// elements (row l/4, columns 2(l%4), 2(l%4)+1), or with .trans (rows 2(l%4), 2(l%4)+1, column l/4);
// the first element in the low 16 bits.
inline void tfm_emu_ldmatrix_x4(unsigned (&r)[4], const void* row, bool trans) {
  const std::uint64_t mine = reinterpret_cast<std::uintptr_t>(row);
  const unsigned lane = threadIdx.x % 32;
  tfm_emu::warp_exchange(&mine, 1, [&](auto slot) {
    auto elem = [&](unsigned mat, unsigned rr, unsigned cc) -> unsigned {
      const auto* p = reinterpret_cast<const unsigned short*>(static_cast<std::uintptr_t>(slot(mat * 8 + rr, 0)));
      return p[cc];
    };
    for (unsigned i = 0; i < 4; ++i) {
      unsigned lo, hi;
      if (!trans) {
        lo = elem(i, lane / 4, 2 * (lane % 4));
        hi = elem(i, lane / 4, 2 * (lane % 4) + 1);
      } else {
        lo = elem(i, 2 * (lane % 4), lane / 4);
        hi = elem(i, 2 * (lane % 4) + 1, lane / 4);
      }
      r[i] = lo | (hi << 16);
    }
  });
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16|f16}: c += A (16x16) B (16x8), fragments as in the
// PTX ISA (see cuda/tfm_mma.cuh). Products of 16-bit values are exact in float64; the sum is rounded
// once to float32 (the tensor core's internal accumulation order is not specified).
inline void tfm_emu_mma_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1, bool bf16) {
  const std::uint64_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
  const unsigned lane = threadIdx.x % 32;
  float d[4];
  tfm_emu::warp_exchange(mine, 6, [&](auto slot) {
    // A[row][k]: owner lane (row % 8) * 4 + (k % 8) / 2, register (row >= 8) + 2 (k >= 8), half k % 2
    auto A = [&](unsigned row, unsigned k) {
      const unsigned owner = (row % 8) * 4 + (k % 8) / 2;
      const unsigned reg = (row >= 8 ? 1u : 0u) + (k >= 8 ? 2u : 0u);
      return tfm_emu::half_bits_to_float(static_cast<unsigned>(slot(owner, reg) >> (16 * (k % 2))), bf16);
    };
    // B[k][col]: owner lane col * 4 + (k % 8) / 2, register 4 + (k >= 8), half k % 2
    auto B = [&](unsigned k, unsigned col) {
      const unsigned owner = col * 4 + (k % 8) / 2;
      const unsigned reg = 4u + (k >= 8 ? 1u : 0u);
      return tfm_emu::half_bits_to_float(static_cast<unsigned>(slot(owner, reg) >> (16 * (k % 2))), bf16);
    };
    for (unsigned e = 0; e < 4; ++e) {
      const unsigned row = lane / 4 + (e >= 2 ? 8u : 0u), col = 2 * (lane % 4) + (e % 2);
      double acc = 0.0;
      for (unsigned k = 0; k < 16; ++k) acc += static_cast<double>(A(row, k)) * static_cast<double>(B(k, col));
      d[e] = static_cast<float>(static_cast<double>(c[e]) + acc);
    }
  });
  for (int e = 0; e < 4; ++e) c[e] = d[e];
}

// cvt.rna.tf32.f32 as the sm_80+ hardware does it: a finite x gets 0x1000 added to its bits (round
// to nearest, ties away from zero; a carry moves into the exponent, the largest floats become inf),
// then the low 13 bits are cleared; inf and NaN are only masked.
inline unsigned tfm_emu_cvt_rna_tf32(float x) {
  unsigned u = __float_as_uint(x);
  if (std::fabs(x) < INFINITY) u += 0x1000u;
  return u & 0xffffe000u;
}

// mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32: c += A (16x8) B (8x8), fragments as in the PTX
// ISA (see cuda/tfm_mma.cuh). Each operand is the tf32 value of its register's upper 19 bits (the
// low 13 bits are not used); products of tf32 values are exact in float64 and the sum is rounded
// once to float32. The tensor core's own accumulation order and internal precision are not
// specified by NVIDIA (hardware results may differ in the last bits of the float32 sum).
inline void tfm_emu_mma_1688_tf32(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  const std::uint64_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
  const unsigned lane = threadIdx.x % 32;
  float d[4];
  tfm_emu::warp_exchange(mine, 6, [&](auto slot) {
    auto tf = [](std::uint64_t w) { return static_cast<double>(__uint_as_float(static_cast<unsigned>(w) & 0xffffe000u)); };
    // A[row][k]: owner lane (row % 8) * 4 + k % 4, register (row >= 8) + 2 (k >= 4)
    auto A = [&](unsigned row, unsigned k) {
      return tf(slot((row % 8) * 4 + k % 4, (row >= 8 ? 1 : 0) + (k >= 4 ? 2 : 0)));
    };
    // B[k][col]: owner lane col * 4 + k % 4, register 4 + (k >= 4)
    auto B = [&](unsigned k, unsigned col) { return tf(slot(col * 4 + k % 4, 4 + (k >= 4 ? 1 : 0))); };
    for (unsigned e = 0; e < 4; ++e) {
      const unsigned row = lane / 4 + (e >= 2 ? 8u : 0u), col = 2 * (lane % 4) + (e % 2);
      double acc = 0.0;
      for (unsigned k = 0; k < 8; ++k) acc += A(row, k) * B(k, col);
      d[e] = static_cast<float>(static_cast<double>(c[e]) + acc);
    }
  });
  for (int e = 0; e < 4; ++e) c[e] = d[e];
}

using std::min;
using std::max;

namespace tfm_emu {
// Run `body` as a grid of blocks, each block's threads concurrently (1-D blocks only). With clusters
// (g_cluster_x > 1) the g_cluster_x blocks of a cluster (consecutive along x) run concurrently.
inline void run(dim3 grid, dim3 block, unsigned smem_bytes, const std::function<void()>& body) {
  g_gridDim = grid;
  g_blockDim = block;
  const unsigned nthreads = block.x * block.y * block.z;
  const unsigned csize = g_cluster_x;
  if (block.y != 1 || block.z != 1 || nthreads % 32 != 0) {
    std::fprintf(stderr, "tfm_emu: only 1-D blocks of whole warps are emulated\n");
    std::abort();
  }
  if (csize < 1 || grid.x % csize != 0) {
    std::fprintf(stderr, "tfm_emu: grid.x %u is not a multiple of the cluster size %u\n", grid.x, csize);
    std::abort();
  }
  std::vector<std::vector<unsigned char>> smem(csize, std::vector<unsigned char>(std::max(smem_bytes, 1u)));
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned cx = 0; cx < grid.x / csize; ++cx) {
        std::barrier<> cluster_bar(nthreads * csize);
        ClusterCtx cluster{&cluster_bar, {}, csize};
        std::vector<std::unique_ptr<std::barrier<>>> block_bars;
        std::vector<std::vector<std::unique_ptr<std::barrier<>>>> warp_bars(csize);
        std::vector<std::vector<float>> shfl(csize, std::vector<float>(nthreads));
        std::vector<std::vector<std::uint64_t>> xchg(csize, std::vector<std::uint64_t>(nthreads * 8));
        std::vector<BlockCtx> ctx;
        ctx.reserve(csize);
        for (unsigned rank = 0; rank < csize; ++rank) {
          block_bars.emplace_back(new std::barrier<>(nthreads));
          for (unsigned w = 0; w < nthreads / 32; ++w) warp_bars[rank].emplace_back(new std::barrier<>(32));
          // poison shared memory so that a read of something nothing wrote shows up as NaN
          std::memset(smem[rank].data(), 0xff, smem[rank].size());
          cluster.smem.push_back(smem[rank].data());
          ctx.push_back(BlockCtx{block_bars[rank].get(), &warp_bars[rank], &shfl[rank], &xchg[rank], smem[rank].data(),
                                 smem_bytes});
        }
        std::vector<std::thread> threads;
        threads.reserve(nthreads * csize);
        for (unsigned rank = 0; rank < csize; ++rank)
          for (unsigned t = 0; t < nthreads; ++t) {
            threads.emplace_back([&, t, rank] {
              t_ctx = &ctx[rank];
              t_cluster = &cluster;
              t_crank = rank;
              t_cluster_token.reset();
              t_threadIdx = dim3{t, 0, 0};
              t_blockIdx = dim3{cx * csize + rank, by, bz};
              body();
              cp_flush();
              // an exited thread no longer takes part in barriers (as on sm_70+)
              t_ctx->block_bar->arrive_and_drop();
              (*t_ctx->warp_bars)[t / 32]->arrive_and_drop();
              cluster_bar.arrive_and_drop();
            });
          }
        for (auto& th : threads) th.join();
      }
}

template <typename... Args, std::size_t... I>
void call_packed(void (*fn)(Args...), void** params, std::index_sequence<I...>) {
  fn(*reinterpret_cast<std::remove_cv_t<std::remove_reference_t<Args>>*>(params[I])...);
}

template <typename... Args>
void launch_packed(void (*fn)(Args...), unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned smem, void** params) {
  run(dim3{gx, gy, gz}, dim3{bx, by, bz}, smem,
      [&] { call_packed(fn, params, std::index_sequence_for<Args...>{}); });
}
}  // namespace tfm_emu

// The cluster size along x of the launches that follow (emulate.py sets it before each launch).
extern "C" void tfm_emu_set_cluster(unsigned cx) { tfm_emu::g_cluster_x = cx; }

// One exported launcher per kernel: extern "C" emu_<name>(grid, block, smem, void** params),
// taking the same parameter array as cuLaunchKernel.
#define TFM_EMU_EXPORT(name)                                                                      \
  extern "C" void emu_##name(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,    \
                             unsigned bz, unsigned smem, void** params) {                        \
    tfm_emu::launch_packed(&name, gx, gy, gz, bx, by, bz, smem, params);                        \
  }
