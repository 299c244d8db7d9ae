// Shared helpers for the vllm-tfm kernels: element types, conversions, vector loads, reductions.
//
// Compiled by NVRTC (vllm_tfm/kernels/loader.py) without any system or CUDA header: only built-in
// types and intrinsics are used. The element type of q/k/v/x is chosen at compile time with
// -DTFM_IN=0 (float32), 1 (bfloat16) or 2 (float16); all arithmetic is float32.
#pragma once

typedef long long i64;
typedef unsigned int u32;
typedef unsigned short u16;

#ifndef TFM_IN
#define TFM_IN 1
#endif

// 16-bit storage types (bit patterns; converted to float32 for every operation).
struct bf16s { u16 bits; };
struct f16s { u16 bits; };

#if TFM_IN == 0
typedef float tin;
#elif TFM_IN == 1
typedef bf16s tin;
#elif TFM_IN == 2
typedef f16s tin;
#else
#error "TFM_IN must be 0 (float32), 1 (bfloat16) or 2 (float16)"
#endif

__device__ __forceinline__ float bf16_bits_to_f32(u32 b) { return __uint_as_float(b << 16); }

// Inline PTX of the shared helpers. TFM_HOST_EMU is defined by the CPU emulation harness
// (cuda/host_emu/), which runs these sources as C++ threads to check them without a GPU.
#ifndef TFM_HOST_EMU
__device__ __forceinline__ float f16_bits_to_f32(u32 b) {
  float f;
  unsigned short h = (unsigned short)b;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ u16 f32_to_f16_bits(float x) {
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
}
// Bytes of dynamic shared memory this launch received.
__device__ __forceinline__ u32 dynamic_smem_bytes() {
  u32 r;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r));
  return r;
}
#define TFM_DYNAMIC_SMEM(type, name) extern __shared__ type name[]
// Programmatic dependent launch (PTX ISA "griddepcontrol", sm_90). A kernel launched with programmatic
// stream serialization (vllm_tfm/kernels/loader.py, launch(..., programmatic=True)) may start while
// the previous kernel of its stream still runs: once that kernel has executed pdl_launch_dependents
// in every block, or its blocks have exited. pdl_wait returns when the previous kernel has completed
// and its memory is visible; a kernel so launched reads or writes nothing the previous kernels
// touch before it. Without the launch attribute both are no-ops (the stream serialises anyway).
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
// Fetch `bytes` (a multiple of 16) from a 16-byte aligned global address into L2, by the copy engine
// (PTX cp.async.bulk.prefetch.L2, sm_90): no registers, no completion to wait for.
__device__ __forceinline__ void prefetch_l2(const void* p, u32 bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}
// Thread block clusters (PTX ISA: %cluster_ctarank, barrier.cluster, mapa; sm_90). A kernel launched
// with a cluster dimension (vllm_tfm/kernels/loader.py, launch(..., cluster=C)) has its C CTAs resident
// together; each can store into the others' shared memory through cluster_map's generic address. The
// barrier is split: every thread of every CTA of the cluster arrives, then waits. `release` orders this
// thread's earlier stores (its remote ones included) before the arrival, the wait acquires them all;
// the relaxed arrival orders nothing (a CTA only says it has started, before a peer stores into it).
__device__ __forceinline__ u32 cluster_ctarank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ u32 cluster_nctarank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_arrive_relaxed() { asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
// The generic address of the same shared-memory location (p: this CTA's shared memory) in CTA `rank`.
template <typename T>
__device__ __forceinline__ T* cluster_map(T* p, u32 rank) {
  unsigned long long out;
  asm volatile("mapa.u64 %0, %1, %2;" : "=l"(out) : "l"(p), "r"(rank));
  return reinterpret_cast<T*>(out);
}
// Per-CTA timelines of the benchmarks (bench/gdn_timeline.py): the global timer in ns and the SM's clock.
__device__ __forceinline__ long long globaltimer_ns() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ long long sm_clock() { return clock64(); }
#else
__device__ __forceinline__ long long globaltimer_ns() { return 0; }
__device__ __forceinline__ long long sm_clock() { return 0; }
// the emulation runs kernels one after another, which is the order pdl_wait guarantees
__device__ __forceinline__ void pdl_wait() {}
__device__ __forceinline__ void pdl_launch_dependents() {}
__device__ __forceinline__ void prefetch_l2(const void*, u32) {}
#define TFM_DYNAMIC_SMEM(type, name) type* name = reinterpret_cast<type*>(tfm_emu_dynamic_smem())
#endif

// A CTA of a thread block cluster of C CTAs (C as compiled; 1: no cluster) starting: it traps when launched with
// another cluster size, arrives (relaxed) so that its peers may store into its shared memory once all have (their
// cluster_wait), and returns its rank in the cluster.
template <int C>
__device__ __forceinline__ int cluster_start() {
  if constexpr (C > 1) {
    if (cluster_nctarank() != C) __trap();  // launched with another cluster size than compiled for
    cluster_arrive_relaxed();
    return (int)cluster_ctarank();
  } else {
    return 0;
  }
}

// A benchmark's per-CTA timeline (bench/gdn_timeline.py): thread 0 of each CTA writes the global timer and the
// SM clock at mark m into entries 2 m, 2 m + 1 of its CTA's `marks` pairs of `timeline` (nothing when null).
struct CtaTimeline {
  long long* p;
  __device__ __forceinline__ void mark(int m) const {
    if (p != nullptr) {
      p[2 * m] = globaltimer_ns();
      p[2 * m + 1] = sm_clock();
    }
  }
};
__device__ __forceinline__ CtaTimeline cta_timeline(long long* timeline, int marks) {
  const bool writes = timeline != nullptr && threadIdx.x == 0;
  return CtaTimeline{writes ? timeline + ((i64)(blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * (2 * marks)
                            : nullptr};
}

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16s x) { return bf16_bits_to_f32(x.bits); }
__device__ __forceinline__ float to_f32(f16s x) { return f16_bits_to_f32(x.bits); }

// float32 -> storage type, round to nearest even (NaN stays NaN), as torch's .to() does.
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16s from_f32<bf16s>(float x) {
  u32 u = __float_as_uint(x);
  bf16s r;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    r.bits = (u16)((u >> 16) | 0x0040u);  // quiet NaN
  } else {
    u += 0x7fffu + ((u >> 16) & 1u);
    r.bits = (u16)(u >> 16);
  }
  return r;
}
template <> __device__ __forceinline__ f16s from_f32<f16s>(float x) {
  f16s r;
  r.bits = f32_to_f16_bits(x);
  return r;
}

// Four consecutive elements -> float32. The pointer must be aligned to 4 elements.
__device__ __forceinline__ void load4(const float* __restrict__ p, float* o) {
  float4 v = *reinterpret_cast<const float4*>(p);
  o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w;
}
__device__ __forceinline__ void load4(const bf16s* __restrict__ p, float* o) {
  uint2 v = *reinterpret_cast<const uint2*>(p);
  o[0] = __uint_as_float(v.x << 16); o[1] = __uint_as_float(v.x & 0xffff0000u);
  o[2] = __uint_as_float(v.y << 16); o[3] = __uint_as_float(v.y & 0xffff0000u);
}
__device__ __forceinline__ void load4(const f16s* __restrict__ p, float* o) {
  uint2 v = *reinterpret_cast<const uint2*>(p);
  o[0] = f16_bits_to_f32(v.x & 0xffffu); o[1] = f16_bits_to_f32(v.x >> 16);
  o[2] = f16_bits_to_f32(v.y & 0xffffu); o[3] = f16_bits_to_f32(v.y >> 16);
}

// Eight consecutive elements -> float32. The pointer must be aligned to 8 elements for 16-bit
// types and to 4 elements for float32.
__device__ __forceinline__ void load8(const float* __restrict__ p, float* o) {
  load4(p, o);
  load4(p + 4, o + 4);
}
__device__ __forceinline__ void bf16x8_to_f32(uint4 v, float* o) {
  o[0] = __uint_as_float(v.x << 16); o[1] = __uint_as_float(v.x & 0xffff0000u);
  o[2] = __uint_as_float(v.y << 16); o[3] = __uint_as_float(v.y & 0xffff0000u);
  o[4] = __uint_as_float(v.z << 16); o[5] = __uint_as_float(v.z & 0xffff0000u);
  o[6] = __uint_as_float(v.w << 16); o[7] = __uint_as_float(v.w & 0xffff0000u);
}
__device__ __forceinline__ void f16x8_to_f32(uint4 v, float* o) {
  o[0] = f16_bits_to_f32(v.x & 0xffffu); o[1] = f16_bits_to_f32(v.x >> 16);
  o[2] = f16_bits_to_f32(v.y & 0xffffu); o[3] = f16_bits_to_f32(v.y >> 16);
  o[4] = f16_bits_to_f32(v.z & 0xffffu); o[5] = f16_bits_to_f32(v.z >> 16);
  o[6] = f16_bits_to_f32(v.w & 0xffffu); o[7] = f16_bits_to_f32(v.w >> 16);
}
__device__ __forceinline__ void load8(const bf16s* __restrict__ p, float* o) {
  bf16x8_to_f32(*reinterpret_cast<const uint4*>(p), o);
}
__device__ __forceinline__ void load8(const f16s* __restrict__ p, float* o) {
  f16x8_to_f32(*reinterpret_cast<const uint4*>(p), o);
}

// Eight consecutive elements of the kernel's input type as loaded (16 bytes of a 16-bit type, 32
// of float32), converted later by decode8: a kernel can issue all its loads before it converts any.
#if TFM_IN == 0
struct raw8 { float4 lo, hi; };
__device__ __forceinline__ raw8 load_raw8(const tin* __restrict__ p) {
  raw8 r;
  r.lo = *reinterpret_cast<const float4*>(p);
  r.hi = *reinterpret_cast<const float4*>(p + 4);
  return r;
}
__device__ __forceinline__ void decode8(const raw8& r, float* o) {
  o[0] = r.lo.x; o[1] = r.lo.y; o[2] = r.lo.z; o[3] = r.lo.w;
  o[4] = r.hi.x; o[5] = r.hi.y; o[6] = r.hi.z; o[7] = r.hi.w;
}
#else
struct raw8 { uint4 v; };
__device__ __forceinline__ raw8 load_raw8(const tin* __restrict__ p) {
  raw8 r;
  r.v = *reinterpret_cast<const uint4*>(p);
  return r;
}
__device__ __forceinline__ void decode8(const raw8& r, float* o) {
#if TFM_IN == 1
  bf16x8_to_f32(r.v, o);
#else
  f16x8_to_f32(r.v, o);
#endif
}
#endif

// Float8 e4m3 (the "fn" variant: no infinities, largest finite 448) -> float32, exact. Two values
// in a 16-bit word (the low byte first): on sm_89 and newer one cvt to f16x2 (every e4m3 value is
// an f16 value), elsewhere (and in the CPU emulation) bit arithmetic: the e4m3 sign, exponent and
// mantissa placed in an f16's bits give the value times 2^-8, subnormals included. NaN (0x7f, 0xff)
// is not preserved by the latter; the weights these decode are finite by construction.
#if !defined(TFM_HOST_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
__device__ __forceinline__ void e4m3x2_to_f32(u32 v, float* o) {
  u32 h2;
  unsigned short in = (unsigned short)v;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
  o[0] = f16_bits_to_f32(h2 & 0xffffu);
  o[1] = f16_bits_to_f32(h2 >> 16);
}
#else
__device__ __forceinline__ float e4m3_bits_to_f32(u32 b) {
  return f16_bits_to_f32(((b & 0x80u) << 8) | ((b & 0x7fu) << 7)) * 256.0f;
}
__device__ __forceinline__ void e4m3x2_to_f32(u32 v, float* o) {
  o[0] = e4m3_bits_to_f32(v & 0xffu);
  o[1] = e4m3_bits_to_f32((v >> 8) & 0xffu);
}
#endif
// Eight consecutive e4m3 values (8 bytes, the first in the lowest byte) -> float32.
__device__ __forceinline__ void e4m3x8_to_f32(uint2 v, float* o) {
  e4m3x2_to_f32(v.x & 0xffffu, o);
  e4m3x2_to_f32(v.x >> 16, o + 2);
  e4m3x2_to_f32(v.y & 0xffffu, o + 4);
  e4m3x2_to_f32(v.y >> 16, o + 6);
}

// Sum over the 32 lanes of a warp; every lane receives the total.
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// L2-norm scale as in vLLM/FLA: x * rsqrt(sum x^2 + 1e-6). Precise division and square root
// (NVRTC's defaults, no fast math) so that float32 results track a float64 reference.
__device__ __forceinline__ float l2norm_scale(float sum_sq) { return 1.0f / sqrtf(sum_sq + 1e-6f); }

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }
