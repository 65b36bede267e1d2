// Moving cache rows into operands: row conversion (fp8 dequantisation included), the paged
// cache's addressing, prefetching, and the packed layouts of brgemm's B operand.
#pragma once

#include "common.h"

namespace openmla {

// Row conversion ------------------------------------------------------------------------
inline void zero_fill(void* dst, int64_t bytes) { std::memset(dst, 0, bytes); }

template <typename S, typename T>
inline void convert_row(const S* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<S, T>) {
    std::memcpy(dst, src, n * sizeof(T));
  } else if constexpr (std::is_same_v<T, float>) {  // bf16 / fp16 -> float
    using sVec = at::vec::Vectorized<S>;
    int64_t j = 0;
    for (; j + sVec::size() <= n; j += sVec::size()) {
      auto [lo, hi] = at::vec::convert_to_float<S>(sVec::loadu(src + j));
      lo.store(dst + j);
      hi.store(dst + j + fVec::size());
    }
    for (; j < n; ++j) dst[j] = static_cast<float>(src[j]);
  } else if constexpr (std::is_same_v<S, float>) {  // float -> bf16 / fp16
    at::vec::convert(src, dst, n);
  } else {
    for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<T>(static_cast<float>(src[j]));
  }
}

// Store 2 * VL floats into the compute type (bf16: one 32-value vector, rounded to nearest even).
template <typename T>
inline void store_pair(T* dst, const fVec& lo, const fVec& hi) {
  if constexpr (std::is_same_v<T, float>) {
    lo.store(dst);
    hi.store(dst + VL);
  } else {
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
    _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
#else
    at::vec::convert_from_float<T>(lo, hi).store(dst);
#endif
  }
}

// float8_e4m3fn -> float (one value).
inline float fp8_to_float(uint8_t b) {
  return static_cast<float>(c10::Float8_e4m3fn(b, c10::Float8_e4m3fn::from_bits()));
}

#if defined(CPU_CAPABILITY_AVX512)
// 32 float8_e4m3fn values as exact bf16 bits, built in 16-bit lanes (every e4m3 value is a bf16
// value): (magnitude << 4) + (120 << 7) for normals, a table for the 8 subnormals, 0x7fc0 for
// NaN, then the sign.
inline __m512i fp8x32_bf16_bits(const uint8_t* src) {
  alignas(64) static const uint16_t sub[32] = {0x0000, 0x3b00, 0x3b80, 0x3bc0, 0x3c00, 0x3c20, 0x3c40, 0x3c60};
  const __m512i m7f = _mm512_set1_epi16(0x7f);
  const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  const __m512i em = _mm512_and_si512(x, m7f);
  __m512i mag = _mm512_add_epi16(_mm512_slli_epi16(em, 4), _mm512_set1_epi16(120 << 7));
  mag = _mm512_mask_mov_epi16(mag, _mm512_cmplt_epu16_mask(em, _mm512_set1_epi16(8)),
                              _mm512_permutexvar_epi16(em, _mm512_load_si512(sub)));
  mag = _mm512_mask_mov_epi16(mag, _mm512_cmpeq_epi16_mask(em, m7f), _mm512_set1_epi16(0x7fc0));
  return _mm512_or_si512(mag, _mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x80)), 8));
}

// bf16 bits (16 of them, in a 256-bit half) -> float: the bits in the high half of each lane.
inline __m512 bf16_bits_to_float(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define OPENMLA_AVX2_FP8 1
// float8_e4m3fn on AVX2 by bit manipulation (F16C): the byte sign-extended to 16 bits, shifted
// left by 7 and masked with 0xBF80 is the float16 with the same sign, exponent field e and
// mantissa m, so vcvtph2ps gives exactly 2^-8 times the e4m3 value, subnormals (e = 0) included.
// NaN (0x7f / 0xff) lands on 1.875 (480 * 2^-8); e4m3_half_nan makes it a float16 NaN.
// (4 integer ops per 8 values, no table: measured against a 256-entry float table and
// _mm256_i32gather_ps in bench/RESULTS.md.)
inline __m128i e4m3_half(__m128i words) {  // 8 sign-extended bytes in 16-bit lanes
  return _mm_and_si128(_mm_slli_epi16(words, 7), _mm_set1_epi16((short)0xBF80));
}
inline __m256i e4m3_half(__m256i words) {  // 16 of them
  return _mm256_and_si256(_mm256_slli_epi16(words, 7), _mm256_set1_epi16((short)0xBF80));
}
inline __m128i e4m3_half_nan(__m128i h) {
  const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7fff)), _mm_set1_epi16(0x3f80));
  return _mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x7e00)));
}
// 8 values at src -> floats, 2^-8 times their values, NaN kept.
inline __m256 e4m3x8_scaled_down(const uint8_t* src) {
  return _mm256_cvtph_ps(e4m3_half_nan(e4m3_half(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src))))));
}
// The same for one value (tails), NaN kept.
inline float e4m3_scaled_down(uint8_t b) {
  return _cvtsh_ss((unsigned short)_mm_extract_epi16(e4m3_half_nan(e4m3_half(_mm_set1_epi16((short)(int8_t)b))), 0));
}
// 8 bfloat16 values -> floats.
inline __m256 bf16x8_float(const void* src) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))), 16));
}
// dst[j] = fp8(src[j]) * scale for n floats; ``up`` = 256 * scale, finite (the caller checks).
inline void e4m3_row_avx2(const uint8_t* src, float up, float* dst, int64_t n) {
  const __m256 vup = _mm256_set1_ps(up);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) _mm256_storeu_ps(dst + j, _mm256_mul_ps(e4m3x8_scaled_down(src + j), vup));
  for (; j < n; ++j) dst[j] = e4m3_scaled_down(src[j]) * up;
}
#endif

// dst[j] = fp8(src[j]) * scale for n values, rounded once from float32 (as the reference's
// fp8 -> float32, times the float32 scale, then the compute type).
template <typename T>
inline void dequant_fp8(const uint8_t* src, float scale, T* dst, int64_t n) {
  int64_t j = 0;
#if defined(CPU_CAPABILITY_AVX512)
  const fVec vscale(scale);
  for (; j + 32 <= n; j += 32) {
    const __m512i b = fp8x32_bf16_bits(src + j);
    const fVec lo = fVec(bf16_bits_to_float(_mm512_castsi512_si256(b))) * vscale;
    const fVec hi = fVec(bf16_bits_to_float(_mm512_extracti64x4_epi64(b, 1))) * vscale;
    store_pair(dst + j, lo, hi);
  }
#elif defined(OPENMLA_AVX2_FP8)
  // v * 2^-8 * (256 * scale) is v * scale rounded once, while 256 * scale is finite (any scale
  // a write stores: amax / 448 <= 7.6e35).
  if constexpr (std::is_same_v<T, float>) {
    if (std::abs(scale * 256.f) <= std::numeric_limits<float>::max()) {
      e4m3_row_avx2(src, scale * 256.f, dst, n);
      return;
    }
  }
#endif
  for (; j < n; ++j) dst[j] = static_cast<T>(fp8_to_float(src[j]) * scale);
}

// float8_e4m3fn -> the compute type, exact (no scale).
template <typename T>
inline void fp8_to_exact(const uint8_t* src, T* dst, int64_t n) {
  int64_t j = 0;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, BFloat16>) {
    for (; j + 32 <= n; j += 32) _mm512_storeu_si512(dst + j, fp8x32_bf16_bits(src + j));
  }
#endif
  if (j < n) dequant_fp8(src + j, 1.f, dst + j, n - j);
}

// Cache formats (openmla.fp8, openmla.nvfp4): native entries, fp8_e4m3 (entry / kv_scale),
// fp8_ds_mla records (L fp8 latent values, L/128 float32 scales, R bfloat16 rope values), or the
// two NVFP4 records (L = 512, R = 64 only; see the NVFP4 section below). Their codes, CacheFormat
// (FMT_*), are in the generated codes.h (openmla.kernel_codes).
constexpr int64_t DS_GROUP = 128;

// NVFP4 records (openmla.nvfp4) ----------------------------------------------------------
// The latent as 512 e2m1 codes, two per byte (value 2i in the LOW nibble of byte i), one e4m3
// scale per 16 values (value = e2m1 * scale, exact in float32 and in bf16), then:
//   nvfp4_ds_mla (432 bytes): scales at [256, 288) in group order, 16 zero bytes, 64 bf16 rope
//                             values at [304, 432);
//   nvfp4_fp8rope (352 bytes): 64 e4m3 rope values (unscaled) at [256, 320), the scales at
//                             [320, 352), group g's at byte 320 + 8 * (g & 3) + (g >> 2).
constexpr int64_t NV_LATENT = 512, NV_ROPE = 64, NV_GROUP = 16, NV_GROUPS = NV_LATENT / NV_GROUP, NV_DATA = NV_LATENT / 2;
constexpr int64_t NV_DS_SCALES = NV_DATA, NV_DS_ROPE = NV_DATA + NV_GROUPS + 16, NV_DS_BYTES = NV_DS_ROPE + 2 * NV_ROPE;
constexpr int64_t NV_FR_ROPE = NV_DATA, NV_FR_SCALES = NV_DATA + NV_ROPE, NV_FR_BYTES = NV_FR_SCALES + NV_GROUPS;

inline bool is_nvfp4(int64_t fmt) { return fmt == FMT_NVFP4_DS || fmt == FMT_NVFP4_FP8ROPE; }

// Byte offset of group g's e4m3 scale within a record.
inline int64_t nv_scale_at(int64_t fmt, int64_t g) {
  return fmt == FMT_NVFP4_DS ? NV_DS_SCALES + g : NV_FR_SCALES + 8 * (g & 3) + (g >> 2);
}

// The float value of every e4m3 byte (NaN for 0x7f / 0xff); ``finite``: NaN bytes read as 0 (for
// P x V, where a key the query does not see must add 0: a visible NaN scale already made the
// key's scores NaN).
inline const float* e4m3_table(bool finite = false) {
  struct Tables {
    float exact[256], fin[256];
    Tables() {
      for (int b = 0; b < 256; ++b) {
        exact[b] = fp8_to_float((uint8_t)b);
        fin[b] = std::isnan(exact[b]) ? 0.f : exact[b];
      }
    }
  };
  static const Tables t;
  return finite ? t.fin : t.exact;
}

// e2m1 code -> value (bit 3 the sign).
constexpr float E2M1_VALUES[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

#if defined(OPENMLA_AVX2_FP8)
// The 16 codes of one group (8 bytes at src) as int8 twice their values (-12 .. 12), in value
// order: the nibbles split and interleaved, then one vpshufb through a 16-entry table.
inline __m128i e2m1x16_twice(const uint8_t* src) {
  const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m128i m = _mm_set1_epi8(0x0F);
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
  const __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
  return _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));
}
// One group's 16 values as floats, times ``half`` (half the group's scale): exact.
inline void e2m1x16_store(const uint8_t* src, __m256 half, float* dst) {
  const __m128i c = e2m1x16_twice(src);
  _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), half));
  _mm256_storeu_ps(dst + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(c, c))), half));
}
#endif

// A record's 512 latent values as floats (a NaN scale makes its group NaN, as the reference).
inline void nvfp4_latent(int64_t fmt, const uint8_t* src, float* dst) {
  const float* tab = e4m3_table();
  for (int64_t g = 0; g < NV_GROUPS; ++g) {
    const float s = tab[src[nv_scale_at(fmt, g)]];
#if defined(OPENMLA_AVX2_FP8)
    e2m1x16_store(src + 8 * g, _mm256_set1_ps(0.5f * s), dst + NV_GROUP * g);
#else
    for (int64_t i = 0; i < NV_GROUP / 2; ++i) {
      const uint8_t b = src[8 * g + i];
      dst[NV_GROUP * g + 2 * i] = E2M1_VALUES[b & 0xF] * s;
      dst[NV_GROUP * g + 2 * i + 1] = E2M1_VALUES[b >> 4] * s;
    }
#endif
  }
}

// A record's 64 rope values as floats (bf16, or e4m3 unscaled).
inline void nvfp4_rope(int64_t fmt, const uint8_t* src, float* dst) {
  if (fmt == FMT_NVFP4_DS) {
    convert_row(reinterpret_cast<const BFloat16*>(src + NV_DS_ROPE), dst, NV_ROPE);
    return;
  }
  const float* tab = e4m3_table();
  for (int64_t j = 0; j < NV_ROPE; ++j) dst[j] = tab[src[NV_FR_ROPE + j]];
}

struct PagedCache {
  const uint8_t* base = nullptr;  // one layer's storage
  int64_t page_stride = 0;        // bytes between pages
  int64_t row_stride = 0;         // bytes between the rows of a page
  int64_t page_size = 1;
  int64_t fmt = FMT_BF16;
  float kv_scale = 1.f;
  int64_t L = 0, R = 0;  // latent and rope widths: an entry is L + R values
  const int32_t* table = nullptr;  // block_table [B, table_stride]
  int64_t table_stride = 0;
  bool e4m3_unscaled = false;  // read fp8_e4m3 entries without kv_scale (the caller folds it in)

  int64_t width() const { return L + R; }
  // Bytes of one stored entry.
  int64_t stored_bytes() const {
    switch (fmt) {
      case FMT_BF16: case FMT_F16: return 2 * (L + R);
      case FMT_F32: return 4 * (L + R);
      case FMT_E4M3: return L + R;
      case FMT_NVFP4_DS: return NV_DS_BYTES;
      case FMT_NVFP4_FP8ROPE: return NV_FR_BYTES;
      default: return L + 4 * (L / DS_GROUP) + 2 * R;
    }
  }
  // One layer's pages [P, S, W] (unit last stride) holding entries of L + R values in format fmt;
  // the block table is the caller's (a rows write has none). Checks what every caller needs.
  static PagedCache of(const at::Tensor& pages, int64_t fmt, double kv_scale, int64_t L, int64_t R) {
    TORCH_CHECK(pages.device().is_cpu() && pages.dim() == 3 && pages.stride(2) == 1,
                "openmla cpu: pages must be [P, S, W] with unit last stride");
    TORCH_CHECK(fmt >= FMT_BF16 && fmt <= FMT_NVFP4_FP8ROPE, "openmla cpu: unknown cache format ", fmt);
    TORCH_CHECK(!is_nvfp4(fmt) || (L == NV_LATENT && R == NV_ROPE),
                "openmla cpu: NVFP4 records hold L = 512 and R = 64 (", L, " and ", R, " given)");
    PagedCache c;
    const int64_t elem = pages.element_size();
    c.base = static_cast<const uint8_t*>(pages.data_ptr());
    c.page_stride = pages.stride(0) * elem;
    c.row_stride = pages.stride(1) * elem;
    c.page_size = pages.size(1);
    c.fmt = fmt;
    c.kv_scale = static_cast<float>(kv_scale);
    c.L = L;
    c.R = R;
    TORCH_CHECK(pages.size(2) * elem >= c.stored_bytes(), "openmla cpu: pages rows hold ", pages.size(2) * elem,
                " bytes, the format stores ", c.stored_bytes());
    return c;
  }
  const uint8_t* phys(int64_t row) const { return base + (row / page_size) * page_stride + (row % page_size) * row_stride; }
  const uint8_t* logical(int64_t b, int64_t pos) const {
    int64_t page = table[b * table_stride + pos / page_size];
    return base + page * page_stride + (pos % page_size) * row_stride;
  }

  // Entry columns [c0, c1) of the stored row ``src`` as T (dequantised).
  template <typename T>
  void load(const uint8_t* src, T* dst, int64_t c0, int64_t c1) const {
    switch (fmt) {
      case FMT_BF16: convert_row(reinterpret_cast<const BFloat16*>(src) + c0, dst, c1 - c0); break;
      case FMT_F16: convert_row(reinterpret_cast<const Half*>(src) + c0, dst, c1 - c0); break;
      case FMT_F32: convert_row(reinterpret_cast<const float*>(src) + c0, dst, c1 - c0); break;
      case FMT_E4M3:
        if (e4m3_unscaled) fp8_to_exact(src + c0, dst, c1 - c0);
        else dequant_fp8(src + c0, kv_scale, dst, c1 - c0);
        break;
      case FMT_NVFP4_DS:
      case FMT_NVFP4_FP8ROPE: {  // the record decoded whole (exact in float32 and bf16), the columns kept
        alignas(64) float row[NV_LATENT + NV_ROPE];
        if (c0 < NV_LATENT) nvfp4_latent(fmt, src, row);
        if (c1 > NV_LATENT) nvfp4_rope(fmt, src, row + NV_LATENT);
        convert_row(row + c0, dst, c1 - c0);
        break;
      }
      default: {  // fp8_ds_mla
        const uint8_t* scales = src + L;
        for (int64_t g0 = c0; g0 < std::min(c1, L); g0 = (g0 / DS_GROUP + 1) * DS_GROUP) {
          int64_t g1 = std::min({c1, L, (g0 / DS_GROUP + 1) * DS_GROUP});
          float s;
          std::memcpy(&s, scales + 4 * (g0 / DS_GROUP), 4);
          dequant_fp8(src + g0, s, dst + (g0 - c0), g1 - g0);
        }
        if (c1 > L) {
          const BFloat16* rope = reinterpret_cast<const BFloat16*>(src + L + 4 * (L / DS_GROUP));
          int64_t r0 = std::max(c0, L);
          convert_row(rope + (r0 - L), dst + (r0 - c0), c1 - r0);
        }
      }
    }
  }
};

// Ask for memory ahead of use (into L2), one request per 64-byte line.
inline void prefetch_bytes(const uint8_t* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 2);
}

// Operand packing ------------------------------------------------------------------------
constexpr int64_t PACK_AHEAD = 16;  // rows the streaming pack prefetches ahead

// B from K rows (rows[k], N values each; nullptr or k >= K: zeros), K_pad rows in all.
// BFloat16: VNNI-2 [K_pad/2][N][2]; float: [K_pad][N]. ``tail_bytes``: also prefetch that many
// bytes after each row's N values (the rest of a cache entry, read next by the score GEMM).
// ``pack_b_rows_range`` packs rows [k0, k1) only (k0, k1 even for bf16), so a caller can spread
// one block's pack over other work.
template <typename T>
void pack_b_rows_range(const T* const* rows, int64_t K, int64_t k0, int64_t k1, int64_t N, T* dst, int64_t tail_bytes = 0) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t k = k0; k < k1; ++k) {
      const float* r = k < K ? rows[k] : nullptr;
      if (r) std::memcpy(dst + k * N, r, N * sizeof(float));
      else zero_fill(dst + k * N, N * sizeof(float));
    }
  } else {
    for (int64_t k = k0; k < k1; k += 2) {
      const uint16_t* a = k < K ? reinterpret_cast<const uint16_t*>(rows[k]) : nullptr;
      const uint16_t* b = k + 1 < K ? reinterpret_cast<const uint16_t*>(rows[k + 1]) : nullptr;
      uint16_t* d = reinterpret_cast<uint16_t*>(dst) + k * N;
      if (tail_bytes) {  // streaming from memory: ask for the rows PACK_AHEAD ahead, whole
        for (int64_t r = k + PACK_AHEAD; r < std::min(K, k + PACK_AHEAD + 2); ++r)
          if (rows[r]) prefetch_bytes(reinterpret_cast<const uint8_t*>(rows[r]), N * (int64_t)sizeof(T) + tail_bytes);
        if (k < PACK_AHEAD) {
          for (int64_t r = k; r < std::min(K, k + 2); ++r)
            if (rows[r]) prefetch_bytes(reinterpret_cast<const uint8_t*>(rows[r] + N), tail_bytes);
        }
      }
      if (!a && !b) {
        zero_fill(d, 2 * N * sizeof(uint16_t));
        continue;
      }
      int64_t n = 0;
#if defined(CPU_CAPABILITY_AVX512)
      alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
      alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                      24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
      const __m512i vlo = _mm512_load_si512(lo_idx), vhi = _mm512_load_si512(hi_idx);
      for (; n + 32 <= N; n += 32) {
        __m512i va = a ? _mm512_loadu_si512(a + n) : _mm512_setzero_si512();
        __m512i vb = b ? _mm512_loadu_si512(b + n) : _mm512_setzero_si512();
        _mm512_storeu_si512(d + 2 * n, _mm512_permutex2var_epi16(va, vlo, vb));
        _mm512_storeu_si512(d + 2 * n + 32, _mm512_permutex2var_epi16(va, vhi, vb));
      }
#endif
      for (; n < N; ++n) {
        d[2 * n] = a ? a[n] : 0;
        d[2 * n + 1] = b ? b[n] : 0;
      }
    }
  }
}

template <typename T>
void pack_b_rows(const T* const* rows, int64_t K, int64_t K_pad, int64_t N, T* dst, int64_t tail_bytes = 0) {
  pack_b_rows_range(rows, K, 0, K_pad, N, dst, tail_bytes);
}

// B = X^T from N source rows of K values (row n at src + n * ld_src): columns [n_off, n_off + N)
// of a packed B with ldb columns. BFloat16: VNNI-2 (a 32-bit transpose; K and ld_src even);
// float: a plain transpose.
template <typename T>
void pack_b_transposed(const T* src, int64_t ld_src, int64_t N, int64_t K, T* dst, int64_t ldb, int64_t n_off) {
  if (N <= 0) return;
  constexpr int64_t g = k_pair<T>();
  at::vec::transpose_mxn<float>(reinterpret_cast<const float*>(src), ld_src / g, reinterpret_cast<float*>(dst) + n_off, ldb,
                                static_cast<int>(N), static_cast<int>(K / g));
}

// Zero columns [n0, n1) of every row of a packed B with K rows and ldb columns.
template <typename T>
void zero_b_columns(T* dst, int64_t K, int64_t ldb, int64_t n0, int64_t n1) {
  if (n1 <= n0) return;
  constexpr int64_t g = k_pair<T>();
  for (int64_t k = 0; k < K / g; ++k) zero_fill(dst + (k * ldb + n0) * g, (n1 - n0) * g * sizeof(T));
}

}  // namespace openmla
