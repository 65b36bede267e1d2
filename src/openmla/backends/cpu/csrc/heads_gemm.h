// Per-head products around decode attention: query absorption and the output projection.
//
//   out[t, h, 0:M] = W[h] [M, K] x x[t, h, 0:K]        (t < T, h < H)
//   out[t, h, M:M+copy] = x[t, h, K:K+copy]            (absorb's rope part, copied)
//
// absorb: x = q_rot, W = w_uk [H, L, Dn] (M = L, K = Dn, copy = R); unabsorb: x = out_lat,
// W = w_uv [H, Dv, L] (M = Dv, K = L, copy = 0).
//
// x's rows are brgemm's A operand, read in place. The weight is the B operand, W[h]^T, packed
// once per weight by pack_heads (the caller caches it) in blocks of HG_BLOCK_N columns, each
// block contiguous: [K/2][n][2] (VNNI-2, a 32-bit transpose of W's rows) for bf16, [K][n] for
// float. A unit is (head, column block, token block): one GEMM, whose float32 rows are converted
// straight into out (float32 outputs are written by the GEMM itself). Nothing is transposed or
// packed per call: at decode sizes (1-64 tokens) the weights are most of the bytes, and a pass
// over them per call would cost as much as the product.
#pragma once

#include "operands.h"

namespace openmla {

// Tuning, measured on a 2-core AMX Xeon (bench/RESULTS.md).
// Block sizes barely matter (within 10% from 64 to 512 columns, 32 to 128 tokens); software
// prefetch of the next unit's weights did not help.
constexpr int64_t HG_BLOCK_N = 256;  // weight rows (output columns) per unit: a 512-row head is two units
constexpr int64_t HG_BLOCK_T = 64;   // tokens per unit (brgemm M)

// W [H, M, K] (element (h, m, k) at w + h * w_sh + m * w_sm + k) -> packed: per head, per block
// of HG_BLOCK_N rows of W (n of them), W[h][n0:n0+n]^T as [K/g][n][g] (g = 2 for bf16, 1 for float).
template <typename T>
void pack_heads(const T* w, int64_t w_sh, int64_t w_sm, int64_t H, int64_t M, int64_t K, T* packed) {
  at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t n0 = 0; n0 < M; n0 += HG_BLOCK_N) {
        const int64_t n = std::min(HG_BLOCK_N, M - n0);
        pack_b_transposed<T>(w + h * w_sh + n0 * w_sm, w_sm, n, K, packed + h * K * M + n0 * K, n, 0);
      }
  });
}

struct HeadsGemmArgs {
  const void* x = nullptr;  // x[t, h, k] at x + t * x_st + h * x_sh + k (elements)
  int64_t x_st = 0, x_sh = 0;
  const void* packed = nullptr;  // pack_heads of W [H, M, K]
  void* out = nullptr;           // out[t, h, j] at out + t * o_st + h * o_sh + j
  int64_t o_st = 0, o_sh = 0;
  int64_t T = 0, H = 0, M = 0, K = 0, copy = 0;
};

template <typename T>
void run_heads_gemm(const HeadsGemmArgs& a) {
  if (a.T <= 0 || a.H <= 0) return;
  const int64_t n_blocks = ceil_div(a.M, HG_BLOCK_N), t_blocks = ceil_div(a.T, HG_BLOCK_T);
  const T* x = static_cast<const T*>(a.x);
  const T* packed = static_cast<const T*>(a.packed);
  T* out = static_cast<T*>(a.out);
  const double work_s = a.H * (2.0 * a.T * a.M * a.K / EST_FLOPS_PER_S + (double)a.M * a.K * sizeof(T) / EST_BYTES_PER_S);
  run_units(a.H * n_blocks * t_blocks, work_s, std::is_same_v<T, BFloat16>, [&](int64_t u) {
    const int64_t h = u / (n_blocks * t_blocks), nb = u / t_blocks % n_blocks, tb = u % t_blocks;
    const int64_t n0 = nb * HG_BLOCK_N, n = std::min(HG_BLOCK_N, a.M - n0);
    const int64_t t0 = tb * HG_BLOCK_T, m = std::min(HG_BLOCK_T, a.T - t0);
    const T* A = x + t0 * a.x_st + h * a.x_sh;
    const int64_t lda = m > 1 ? a.x_st : std::max(a.x_st, a.K);  // a single row's stride is arbitrary
    const T* B = packed + h * a.K * a.M + n0 * a.K;
    T* o = out + t0 * a.o_st + h * a.o_sh;
    if constexpr (std::is_same_v<T, float>) {
      gemm(m, n, a.K, lda, n, a.o_st, false, A, B, o + n0);
    } else {
      float* C = scratch<float>(S_ACC, m * n);
      gemm(m, n, a.K, lda, n, n, false, A, B, C);
      for (int64_t i = 0; i < m; ++i) {
        const float* c = C + i * n;
        T* d = o + i * a.o_st + n0;
        int64_t j = 0;
        for (; j + 2 * VL <= n; j += 2 * VL) store_pair(d + j, fVec::loadu(c + j), fVec::loadu(c + j + VL));
        convert_row(c + j, d + j, n - j);
      }
    }
    if (nb == 0 && a.copy > 0) {
      for (int64_t i = 0; i < m; ++i) std::memcpy(o + i * a.o_st + a.M, A + i * a.x_st + a.K, a.copy * sizeof(T));
    }
  });
}

}  // namespace openmla
