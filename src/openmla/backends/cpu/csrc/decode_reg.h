// Decode from fp8 caches (fp8_e4m3, fp8_ds_mla) with float32 products, fp8 dequantised next to
// the products (decode.h sends dense float32 units here in builds whose widest vectors are
// AVX2's, with FMA and F16C: OPENMLA_REG_DEQUANT. AVX-512 builds keep the key buffer and
// brgemm's 512-bit float32 kernels: these 256-bit tiles would halve the FMA width there).
//
// Per key block (the keys a unit sees, at most DECODE_BLOCK), with Q^T [D][Mp] packed once:
//   scores: per group of SCORE_KR keys, their D values are dequantised into an L1 panel
//           (SCORE_KR x D floats, once per key) and a register tile of SCORE_KR keys x 16 query
//           columns accumulates K x Q^T over D (one broadcast key value per row of FMAs);
//   softmax: softmax_keys_major, as every decode unit (P^T [n][M] keys-major);
//   P x V:  per 16 latent columns, the block's fp8 bytes of those columns are widened into a
//           stripe (n x 16 floats, 16 KB at most: L1), 2^-8 times their values, and a register
//           tile of PV_MR query rows x 16 columns runs over the block's keys; 256 and the
//           per-group float32 scale are folded into P^T (one scaled copy per 128-value group).
// The whole key block is never widened: the stored bytes are read twice (scores, then P x V,
// from L2: a 256-key block of 656-byte records is 168 KB), each value converted once per pass.
//
// NVFP4 records (nvfp4_ds_mla, nvfp4_fp8rope) take the same tiles: the score panel row is the
// record's exact values (e2m1 nibbles through a 16-entry vpshufb table to int8, widened, times
// half the group's e4m3 scale; the rope part as stored), and a latent group is exactly a 16-column
// V stripe, so each stripe is built with its keys' scales already applied (exact products) and
// P^T is used as it is.
#pragma once

#include "softmax.h"

namespace openmla {

#if defined(OPENMLA_TEST_HOOKS)
// Test builds: switch the register-dequantising path off (to compare it with the widened one)
// and count the units it ran.
inline std::atomic<bool>& reg_dequant_switch() {
  static std::atomic<bool> on{true};
  return on;
}
inline std::atomic<int64_t>& reg_dequant_units() {
  static std::atomic<int64_t> n{0};
  return n;
}
#endif

#if defined(OPENMLA_AVX2_FP8) && !defined(CPU_CAPABILITY_AVX512)
#define OPENMLA_REG_DEQUANT 1
#endif

#if defined(OPENMLA_REG_DEQUANT)
// The register tiles' loops over their accumulators must unroll completely (GCC otherwise keeps
// the accumulator array in memory and stores it on every key).
#define OPENMLA_UNROLL _Pragma("GCC unroll 16")
constexpr int SCORE_KR = 6;  // keys per score tile: 6 keys x 16 columns = 12 accumulators of the 16 ymm registers
constexpr int PV_MR = 6;     // query rows per P x V tile: 6 rows x 16 latent columns = 12 accumulators

// Lanes [0, n) of a masked store.
inline __m256i lane_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// S[k][0:cols] = sum_d Kp[k][d] * QT[d][0:cols] for KR keys (cols <= 8 * NV; QT's columns past
// cols are zero padding, read but not stored).
template <int KR, int NV>
inline void score_tile(const float* Kp, int64_t ldk, const float* QT, int64_t ldq, int64_t D, float* S, int64_t lds,
                       int64_t cols) {
  __m256 acc[KR][NV];
  OPENMLA_UNROLL
  for (int k = 0; k < KR; ++k)
    OPENMLA_UNROLL
    for (int v = 0; v < NV; ++v) acc[k][v] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m256 q[NV];
    OPENMLA_UNROLL
    for (int v = 0; v < NV; ++v) q[v] = _mm256_loadu_ps(QT + d * ldq + 8 * v);
    OPENMLA_UNROLL
    for (int k = 0; k < KR; ++k) {
      const __m256 b = _mm256_broadcast_ss(Kp + k * ldk + d);
      OPENMLA_UNROLL
      for (int v = 0; v < NV; ++v) acc[k][v] = _mm256_fmadd_ps(b, q[v], acc[k][v]);
    }
  }
  OPENMLA_UNROLL
  for (int v = 0; v < NV; ++v) {
    const int64_t c = cols - 8 * v;
    OPENMLA_UNROLL
    for (int k = 0; k < KR; ++k) {
      if (c >= 8) _mm256_storeu_ps(S + k * lds + 8 * v, acc[k][v]);
      else if (c > 0) _mm256_maskstore_ps(S + k * lds + 8 * v, lane_mask(c), acc[k][v]);
    }
  }
}

template <int KR>
inline void score_tiles(const float* Kp, int64_t ldk, const float* QT, int64_t ldq, int64_t D, float* S, int64_t M) {
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int64_t cols = std::min<int64_t>(16, M - m0);
    if (cols > 8) score_tile<KR, 2>(Kp, ldk, QT + m0, ldq, D, S + m0, M, cols);
    else score_tile<KR, 1>(Kp, ldk, QT + m0, ldq, D, S + m0, M, cols);
  }
}

// V stripe: the fp8 latent bytes [l0, l0 + 16) of n key rows as floats, 2^-8 times their
// values (NaN bytes read as 480: a visible NaN already made its scores NaN, and rows that do
// not see a key have P = 0): Vs [n][16], 32-byte aligned (aligned stores: some tunings split
// unaligned 256-bit ones), 64 bytes a key, in L1 for the tiles below.
inline void v_stripe(const uint8_t* const* rows, int64_t l0, int64_t n, float* Vs) {
  for (int64_t j = 0; j < n; ++j) {
    const __m256i h = e4m3_half(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[j] + l0))));
    _mm256_store_ps(Vs + 16 * j, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
    _mm256_store_ps(Vs + 16 * j + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
  }
}

// O[m][0:16] += sum_j PT[j][m] * Vs[j][0:16] for MR query rows.
template <int MR>
inline void pv_tile(const float* Vs, const float* PT, int64_t ldp, int64_t n, float* O, int64_t ldo) {
  __m256 acc[MR][2];
  OPENMLA_UNROLL
  for (int m = 0; m < MR; ++m) {
    acc[m][0] = _mm256_loadu_ps(O + m * ldo);
    acc[m][1] = _mm256_loadu_ps(O + m * ldo + 8);
  }
  for (int64_t j = 0; j < n; ++j) {
    const __m256 x0 = _mm256_load_ps(Vs + 16 * j), x1 = _mm256_load_ps(Vs + 16 * j + 8);
    const float* p = PT + j * ldp;
    OPENMLA_UNROLL
    for (int m = 0; m < MR; ++m) {
      const __m256 b = _mm256_broadcast_ss(p + m);
      acc[m][0] = _mm256_fmadd_ps(b, x0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(b, x1, acc[m][1]);
    }
  }
  OPENMLA_UNROLL
  for (int m = 0; m < MR; ++m) {
    _mm256_storeu_ps(O + m * ldo, acc[m][0]);
    _mm256_storeu_ps(O + m * ldo + 8, acc[m][1]);
  }
}

// Every query row's P x V over the 16 latent columns of the stripe Vs [n][16] (O points at the
// stripe's first column of row 0, rows L apart): near-equal groups of at most PV_MR rows.
inline void pv_stripe(const float* Vs, const float* PT, int64_t M, int64_t n, float* O, int64_t L) {
  const int64_t groups = ceil_div(M, PV_MR);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t m0 = M * g / groups;
    const float* p = PT + m0;
    float* o = O + m0 * L;
    switch (M * (g + 1) / groups - m0) {
      case 6: pv_tile<6>(Vs, p, M, n, o, L); break;
      case 5: pv_tile<5>(Vs, p, M, n, o, L); break;
      case 4: pv_tile<4>(Vs, p, M, n, o, L); break;
      case 3: pv_tile<3>(Vs, p, M, n, o, L); break;
      case 2: pv_tile<2>(Vs, p, M, n, o, L); break;
      default: pv_tile<1>(Vs, p, M, n, o, L); break;
    }
  }
}

// Every query row's P x V over latent columns [l0, l0 + 16) of an fp8 cache: the stripe
// converted once, then pv_stripe.
inline void pv_rows(const uint8_t* const* rows, int64_t l0, const float* PT, int64_t M, int64_t n, float* O, int64_t L,
                    float* Vs) {
  v_stripe(rows, l0, n, Vs);
  pv_stripe(Vs, PT, M, n, O + l0, L);
}

// NVFP4 V stripe: latent group g (columns [16g, 16g + 16)) of n key rows as their exact values,
// e2m1 times the e4m3 scale, with a NaN scale read as 0 (a key the query does not see has P = 0
// and must add 0; a visible one already made its scores NaN). Vs [n][16], 32-byte aligned.
inline void v_stripe_nvfp4(int64_t fmt, const uint8_t* const* rows, int64_t g, int64_t n, float* Vs) {
  const float* tab = e4m3_table(/*finite=*/true);
  const int64_t at = nv_scale_at(fmt, g);
  for (int64_t j = 0; j < n; ++j) {
    const __m128i c = e2m1x16_twice(rows[j] + 8 * g);
    const __m256 half = _mm256_set1_ps(0.5f * tab[rows[j][at]]);
    _mm256_store_ps(Vs + 16 * j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), half));
    _mm256_store_ps(Vs + 16 * j + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(c, c))), half));
  }
}

// NVFP4 score panel row: the record's 576 values, exact (NaN scales kept).
inline void panel_row_nvfp4(int64_t fmt, const uint8_t* src, float* dst) {
  nvfp4_latent(fmt, src, dst);
  if (fmt == FMT_NVFP4_DS) {
    for (int64_t j = 0; j < NV_ROPE; j += 8) _mm256_storeu_ps(dst + NV_LATENT + j, bf16x8_float(src + NV_DS_ROPE + 2 * j));
    return;
  }
  const __m256 up = _mm256_set1_ps(256.f);  // undoes e4m3x8_scaled_down's 2^-8 (exact; NaN kept)
  for (int64_t j = 0; j < NV_ROPE; j += 8)
    _mm256_storeu_ps(dst + NV_LATENT + j, _mm256_mul_ps(e4m3x8_scaled_down(src + NV_FR_ROPE + j), up));
}

// Whether any of the n fp8 bytes at src is a NaN (0x7f / 0xff).
inline bool has_e4m3_nan(const uint8_t* src, int64_t n) {
  const __m256i m7f = _mm256_set1_epi8(0x7f);
  __m256i any = _mm256_setzero_si256();
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m256i x = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j)), m7f);
    any = _mm256_or_si256(any, _mm256_cmpeq_epi8(x, m7f));
  }
  bool nan = !_mm256_testz_si256(any, any);
  for (; j < n; ++j) nan |= (src[j] & 0x7f) == 0x7f;
  return nan;
}

// n fp8 values at src times ``up`` (256 times their scale) into dst (32-byte aligned): NaN bytes
// already ruled out by has_e4m3_nan; ``up`` 1 skips the multiply.
inline void panel_e4m3(const uint8_t* src, float up, float* dst, int64_t n) {
  const __m256 vup = _mm256_set1_ps(up);
  int64_t j = 0;
  if (up == 1.f) {
    for (; j + 8 <= n; j += 8)
      _mm256_store_ps(dst + j, _mm256_cvtph_ps(e4m3_half(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + j))))));
  } else {
    for (; j + 8 <= n; j += 8)
      _mm256_store_ps(dst + j, _mm256_mul_ps(_mm256_cvtph_ps(e4m3_half(_mm_cvtepi8_epi16(
                                                 _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + j))))), vup));
  }
  for (; j < n; ++j) dst[j] = _cvtsh_ss((unsigned short)_mm_extract_epi16(e4m3_half(_mm_set1_epi16((short)(int8_t)src[j])), 0)) * up;
}

// One fp8 cache row's D = L + R values as floats (the score panel row, 32-byte aligned):
// fp8_e4m3 as 2^-8 times its values (decode folds kv_scale, and here 256, into the softmax
// scale: ``E4M3_PANEL_SCALE``), fp8_ds_mla times its group scales, the bf16 rope part as is.
// A row holding a NaN byte goes through dequant_fp8, which keeps it.
constexpr float E4M3_PANEL_SCALE = 256.f;
inline void panel_row(const PagedCache& c, const uint8_t* src, float* dst) {
  if (is_nvfp4(c.fmt)) return panel_row_nvfp4(c.fmt, src, dst);
  const bool nan = has_e4m3_nan(src, c.fmt == FMT_E4M3 ? c.L + c.R : c.L);
  if (c.fmt == FMT_E4M3) {
    if (nan) dequant_fp8(src, 1.f / E4M3_PANEL_SCALE, dst, c.L + c.R);
    else panel_e4m3(src, 1.f, dst, c.L + c.R);
    return;
  }
  const uint8_t* scales = src + c.L;
  for (int64_t g = 0; g < c.L / DS_GROUP; ++g) {
    float s;
    std::memcpy(&s, scales + 4 * g, 4);
    // v * 2^-8 * (256 s) is v * s rounded once while 256 s is finite (any scale a write stores)
    if (!nan && std::abs(s * 256.f) <= std::numeric_limits<float>::max()) panel_e4m3(src + g * DS_GROUP, s * 256.f, dst + g * DS_GROUP, DS_GROUP);
    else dequant_fp8(src + g * DS_GROUP, s, dst + g * DS_GROUP, DS_GROUP);
  }
  const uint8_t* rope = scales + 4 * (c.L / DS_GROUP);
  int64_t j = 0;
  for (; j + 8 <= c.R; j += 8) _mm256_storeu_ps(dst + c.L + j, bf16x8_float(rope + 2 * j));
  for (; j < c.R; ++j) {
    BFloat16 v;
    std::memcpy(&v, rope + 2 * j, 2);
    dst[c.L + j] = static_cast<float>(v);
  }
}

// The float factor of key row ``src``'s latent group g in P x V: 256 (undoing e4m3_half's 2^-8)
// times the group's scale for fp8_ds_mla.
inline float pv_factor(const PagedCache& c, const uint8_t* src, int64_t g) {
  if (c.fmt == FMT_E4M3) return 256.f;
  float s;
  std::memcpy(&s, src + c.L + 4 * g, 4);
  return s * 256.f;
}

// PTg[j][m] = PT[j][m] * factor(j), 0 where P is 0 (a NaN or infinite scale stays out of rows
// that do not see the key).
inline void scale_probs(const float* PT, int64_t n, int64_t M, const float* factor, float* PTg) {
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m256 f = _mm256_set1_ps(factor[j]);
    const float* p = PT + j * M;
    float* d = PTg + j * M;
    int64_t m = 0;
    for (; m + 8 <= M; m += 8) {
      const __m256 x = _mm256_loadu_ps(p + m);
      _mm256_storeu_ps(d + m, _mm256_and_ps(_mm256_mul_ps(x, f), _mm256_cmp_ps(x, zero, _CMP_NEQ_UQ)));
    }
    for (; m < M; ++m) d[m] = p[m] == 0.f ? 0.f : p[m] * factor[j];
  }
}

// Latent columns [l0, l1) that no 16-wide stripe covers (fp8_e4m3 with L % 16 != 0); O [M][ldo].
inline void pv_tail(const uint8_t* const* rows, int64_t l0, int64_t l1, const float* PT, int64_t M, int64_t n, float* O,
                    int64_t ldo) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t l = l0; l < l1; ++l) {
      float acc = O[m * ldo + l];
      for (int64_t j = 0; j < n; ++j)
        acc += PT[j * M + m] * _cvtsh_ss((unsigned short)_mm_extract_epi16(e4m3_half(_mm_set1_epi16((short)(int8_t)rows[j][l])), 0));
      O[m * ldo + l] = acc;
    }
}
#endif

}  // namespace openmla
