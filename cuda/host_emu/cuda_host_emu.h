// CPU emulation of the small part of CUDA the vllm-tfm kernels use, to run them without a GPU.
//
// Not a simulator of timing or of the memory model: every CUDA thread of a block is a std::thread,
// __syncthreads is a std::barrier over the block, warp shuffles exchange through a per-warp buffer
// between two warp barriers, __shared__ variables are process-wide statics (blocks run one after
// another), and dynamic shared memory is one buffer per block launch. A kernel source is compiled
// as C++20 with this header force-included and TFM_HOST_EMU defined (see emulate.py beside this).
// What it checks: indexing, bounds (with -fsanitize=address), barrier placement, the host-side
// sizes (shared memory words) and the arithmetic, against the torch reference.
#pragma once

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
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
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }

namespace tfm_emu {
struct BlockCtx {
  std::barrier<>* block_bar;
  std::vector<std::unique_ptr<std::barrier<>>>* warp_bars;
  std::vector<float>* shfl_buf;  // [warps * 32]
  unsigned char* smem;
  unsigned smem_bytes;
};
inline thread_local dim3 t_threadIdx, t_blockIdx;
inline dim3 g_blockDim, g_gridDim;
inline thread_local BlockCtx* t_ctx = nullptr;
}  // namespace tfm_emu

#define threadIdx (tfm_emu::t_threadIdx)
#define blockIdx (tfm_emu::t_blockIdx)
#define blockDim (tfm_emu::g_blockDim)
#define gridDim (tfm_emu::g_gridDim)

inline void* tfm_emu_dynamic_smem() { return tfm_emu::t_ctx->smem; }
inline unsigned dynamic_smem_bytes() { return tfm_emu::t_ctx->smem_bytes; }

inline void __syncthreads() { tfm_emu::t_ctx->block_bar->arrive_and_wait(); }

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

[[noreturn]] inline void __trap() {
  std::fprintf(stderr, "tfm_emu: __trap() in block (%u,%u,%u) thread %u\n", blockIdx.x, blockIdx.y, blockIdx.z,
               threadIdx.x);
  std::abort();
}

inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float f16_bits_to_f32(unsigned b) {
  _Float16 h; unsigned short s = (unsigned short)b; std::memcpy(&h, &s, 2); return (float)h;
}
inline unsigned short f32_to_f16_bits(float x) {
  _Float16 h = (_Float16)x; unsigned short s; std::memcpy(&s, &h, 2); return s;
}
using std::min;
using std::max;

namespace tfm_emu {
// Run `body` as a grid of blocks, each block's threads concurrently (1-D blocks only).
inline void run(dim3 grid, dim3 block, unsigned smem_bytes, const std::function<void()>& body) {
  g_gridDim = grid;
  g_blockDim = block;
  const unsigned nthreads = block.x * block.y * block.z;
  if (block.y != 1 || block.z != 1 || nthreads % 32 != 0) {
    std::fprintf(stderr, "tfm_emu: only 1-D blocks of whole warps are emulated\n");
    std::abort();
  }
  std::vector<unsigned char> smem(std::max(smem_bytes, 1u));
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        std::barrier<> block_bar(nthreads);
        std::vector<std::unique_ptr<std::barrier<>>> warp_bars;
        for (unsigned w = 0; w < nthreads / 32; ++w) warp_bars.emplace_back(new std::barrier<>(32));
        std::vector<float> shfl(nthreads);
        // poison shared memory so that a read of something nothing wrote shows up as NaN
        std::memset(smem.data(), 0xff, smem.size());
        BlockCtx ctx{&block_bar, &warp_bars, &shfl, smem.data(), smem_bytes};
        std::vector<std::thread> threads;
        threads.reserve(nthreads);
        for (unsigned t = 0; t < nthreads; ++t) {
          threads.emplace_back([&, t] {
            t_ctx = &ctx;
            t_threadIdx = dim3{t, 0, 0};
            t_blockIdx = dim3{bx, by, bz};
            body();
            // an exited thread no longer takes part in barriers (as on sm_70+)
            ctx.block_bar->arrive_and_drop();
            (*ctx.warp_bars)[t / 32]->arrive_and_drop();
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

// One exported launcher per kernel: extern "C" emu_<name>(grid, block, smem, void** params),
// taking the same parameter array as cuLaunchKernel.
#define TFM_EMU_EXPORT(name)                                                                      \
  extern "C" void emu_##name(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,    \
                             unsigned bz, unsigned smem, void** params) {                        \
    tfm_emu::launch_packed(&name, gx, gy, gz, bx, by, bz, smem, params);                        \
  }
