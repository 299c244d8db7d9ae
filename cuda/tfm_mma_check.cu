// Check kernel of the tf32 warp matrix primitives of tfm_mma.cuh (no model code uses it): one warp
// computes, from row-major float32 A [16][8], B [8][8] and C [16][8],
//   D1 = C + tf32(A) tf32(B)                    one mma_1688_tf32 on cvt.rna-rounded operands
//   D3 = C + A B by 3xTF32                      A_lo B_hi + A_hi B_lo + A_hi B_hi (split_tf32)
// and writes the split of every A element (hi, lo bits). tests/cpu/test_tf32_mma.py runs it through
// the CPU emulation and tests/gpu/test_kernels_gdn.py on the GPU, both against float64 matmuls.
#include "tfm_mma.cuh"

extern "C" __global__ void tfm_mma_tf32_check(const float* __restrict__ A, const float* __restrict__ B,
                                              const float* __restrict__ C, float* __restrict__ D1,
                                              float* __restrict__ D3, u32* __restrict__ a_hi,
                                              u32* __restrict__ a_lo) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if (threadIdx.x >= 32) return;
  const int ar[4] = {g, g + 8, g, g + 8}, ac[4] = {t, t, t + 4, t + 4};  // fragment coordinates
  u32 ah[4], al[4], a1[4];
  for (int i = 0; i < 4; ++i) {
    const float x = A[ar[i] * 8 + ac[i]];
    split_tf32(x, ah[i], al[i]);
    a1[i] = tf32_rna(x);
    a_hi[ar[i] * 8 + ac[i]] = ah[i];
    a_lo[ar[i] * 8 + ac[i]] = al[i];
  }
  u32 bh0, bl0, bh1, bl1;
  split_tf32(B[t * 8 + g], bh0, bl0);
  split_tf32(B[(t + 4) * 8 + g], bh1, bl1);
  const int cr[4] = {g, g, g + 8, g + 8}, cc[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  float c1[4], c3[4];
  for (int i = 0; i < 4; ++i) c1[i] = c3[i] = C[cr[i] * 8 + cc[i]];
  mma_1688_tf32(c1, a1, tf32_rna(B[t * 8 + g]), tf32_rna(B[(t + 4) * 8 + g]));
  mma_1688_tf32(c3, al, bh0, bh1);
  mma_1688_tf32(c3, ah, bl0, bl1);
  mma_1688_tf32(c3, ah, bh0, bh1);
  for (int i = 0; i < 4; ++i) {
    D1[cr[i] * 8 + cc[i]] = c1[i];
    D3[cr[i] * 8 + cc[i]] = c3[i];
  }
}
