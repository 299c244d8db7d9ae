// Warp-level tensor-core and asynchronous-copy primitives (sm_80 and newer), as small functions:
//   ldsm_x4 / ldsm_x4_trans  ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16
//   mma_16816                mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32
//   mma_1688_tf32            mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32
//   tf32_rna / split_tf32    cvt.rna.tf32.f32, and x = hi + lo with both parts tf32 (3xTF32 products)
//   cp_async16 / cp_async4 / cp_async_commit / cp_async_wait<N>   cp.async.cg (16 bytes), .ca (4) and groups
//   pack_bf16x2 / split3_bf16x2  cvt.rn.bf16x2.f32, and a float pair as three bf16x2 parts (float32-accurate products)
//   stage_qk_rows            a request's q and k rows into shared memory by cp.async, padded rows zero
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"; lane l,
// g = l / 4, t = l % 4; each 32-bit register holds two 16-bit elements, the lower index in the low
// half):
//   A (16 x 16, row major): a0 = A[g][2t..2t+1], a1 = A[g+8][2t..], a2 = A[g][2t+8..], a3 = A[g+8][2t+8..]
//   B (16 x 8, "col"):      b0 = B[2t..2t+1][g], b1 = B[2t+8..2t+9][g]
//   C/D (16 x 8, float32):  c0 = C[g][2t], c1 = C[g][2t+1], c2 = C[g+8][2t], c3 = C[g+8][2t+1]
// m16n8k8 with .tf32 operands (PTX ISA, "Matrix Fragments for mma.m16n8k8", .tf32; one element per
// 32-bit register, the tf32 value in the upper 19 bits):
//   A (16 x 8, row major):  a0 = A[g][t], a1 = A[g+8][t], a2 = A[g][t+4], a3 = A[g+8][t+4]
//   B (8 x 8, "col"):       b0 = B[t][g], b1 = B[t+4][g]
//   C/D (16 x 8, float32):  as m16n8k16 above
// 3xTF32 (fp32-accurate products on tf32 tensor cores): a = a_hi + a_lo with a_hi = tf32(a),
// a_lo = tf32(a - a_hi); A B ~= A_lo B_hi + A_hi B_lo + A_hi B_hi (small terms first, float32
// accumulation; the dropped A_lo B_lo and the rounding of a_lo are ~2^-21 relative per product).
// cvt.rna: round to nearest, ties away from zero, to 10 mantissa bits (sm_80+ SASS: integer add of
// 0x1000 to finite values, then the low 13 bits cleared; inf and NaN only masked).
// ldmatrix .x4: lanes 8i..8i+7 give the row addresses (16 bytes each) of 8 x 8 matrix i; register i
// of lane l receives matrix i's row l / 4, columns 2(l % 4), 2(l % 4) + 1 (.trans: the transposed
// matrix's, i.e. rows 2(l % 4), 2(l % 4) + 1 of column l / 4).
//
// Under TFM_HOST_EMU (cuda/host_emu) the same functions are implemented on the CPU from the layouts
// above, so a kernel built on them runs, and is checked, without a GPU.
#pragma once
#include "tfm_common.cuh"

#ifndef TFM_HOST_EMU
__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 r;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row))
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_trans(u32 (&r)[4], const void* row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row))
               : "memory");
}
// c += A B with A, B of 16-bit type `bf16` (true) or f16 (false).
template <bool bf16>
__device__ __forceinline__ void mma_16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  if (bf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}
// c += A B, A 16 x 8 and B 8 x 8 of tf32 values in 32-bit registers (fragments above).
__device__ __forceinline__ void mma_1688_tf32(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// x rounded to tf32 (bits of a float32 whose low 13 bits are zero).
__device__ __forceinline__ u32 tf32_rna(float x) {
  u32 r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
// 16 bytes global -> shared, asynchronous (both addresses 16-byte aligned).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(smem)), "l"(gmem) : "memory");
}
// 4 bytes global -> shared, asynchronous (both addresses 4-byte aligned; through L1: .ca).
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(smem)), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#else
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], const void* row) { tfm_emu_ldmatrix_x4(r, row, false); }
__device__ __forceinline__ void ldsm_x4_trans(u32 (&r)[4], const void* row) { tfm_emu_ldmatrix_x4(r, row, true); }
template <bool bf16>
__device__ __forceinline__ void mma_16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  tfm_emu_mma_16816(c, a, b0, b1, bf16);
}
__device__ __forceinline__ void mma_1688_tf32(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  tfm_emu_mma_1688_tf32(c, a, b0, b1);
}
__device__ __forceinline__ u32 tf32_rna(float x) { return tfm_emu_cvt_rna_tf32(x); }
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) { tfm_emu_copy16(smem, gmem); }
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) { tfm_emu_copy_async(smem, gmem, 4); }
__device__ __forceinline__ void cp_async_commit() { tfm_emu_cp_commit(); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { tfm_emu_cp_wait(N); }
#endif

// x = hi + lo, both tf32 (lo = tf32(x - hi); x - hi is exact in float32).
__device__ __forceinline__ void split_tf32(float x, u32& hi, u32& lo) {
  hi = tf32_rna(x);
  lo = tf32_rna(x - __uint_as_float(hi));
}

// Two floats as one bf16x2 word (lo in the low half), each rounded to nearest even: one cvt.rn.bf16x2.f32
// (PTX ISA: d = {a -> upper half, b -> lower half}).
#ifndef TFM_HOST_EMU
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
#else
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
  return (u32)from_f32<bf16s>(lo).bits | ((u32)from_f32<bf16s>(hi).bits << 16);
}
#endif

// Two floats as three bf16x2 words: x = hi + mid + lo (each remainder is exact in float32), so three
// bf16 products with an exact bf16 operand sum to x's float32 product (versions 7 and 8 of the GDN verify).
__device__ __forceinline__ void split3_bf16x2(float2 x, u32& hi, u32& mid, u32& lo) {
  hi = pack_bf16x2(x.x, x.y);
  const float r0 = x.x - __uint_as_float(hi << 16), r1 = x.y - __uint_as_float(hi & 0xffff0000u);
  mid = pack_bf16x2(r0, r1);
  lo = pack_bf16x2(r0 - __uint_as_float(mid << 16), r1 - __uint_as_float(mid & 0xffff0000u));
}

// Rows 0 .. rows - 1 of one request's q and k for q/k head h (16-bit, [T, H, KDIM] from node bos on) into two
// staged [rows][KP] blocks by cp.async, rows n .. rows - 1 zero so that whole mma tiles read defined values
// (versions 7 and 8 of the GDN verify); the caller commits the group.
template <int KDIM, int KP, int THREADS>
__device__ __forceinline__ void stage_qk_rows(u16* qs, u16* ks, const tin* __restrict__ q, const tin* __restrict__ k,
                                              int bos, int n, int rows, int H, int h, int tid) {
  constexpr int CPR = KDIM / 8;  // 16-byte pieces of a row
  for (int c = tid; c < rows * CPR; c += THREADS) {
    const int row = c / CPR, col = (c % CPR) * 8;
    u16* dq = qs + row * KP + col;
    u16* dk = ks + row * KP + col;
    if (row < n) {
      const i64 src = ((i64)(bos + row) * H + h) * KDIM + col;
      cp_async16(dq, q + src);
      cp_async16(dk, k + src);
    } else {
      uint4 z;
      z.x = 0u; z.y = 0u; z.z = 0u; z.w = 0u;
      *reinterpret_cast<uint4*>(dq) = z;
      *reinterpret_cast<uint4*>(dk) = z;
    }
  }
}
