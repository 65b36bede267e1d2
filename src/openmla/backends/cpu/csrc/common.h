// Shared pieces of the native CPU kernels: per-thread scratch, the brgemm wrappers and their
// operand layouts, row conversion (including FP8 dequantisation), the mask's key intervals, the
// work queue, and the online-softmax step every attention kernel uses.
//
// Compute types: BFloat16 (brgemm with B in VNNI-2 layout: [K/2][ldb][2]) or float (plain B,
// [K][ldb]). Accumulation and softmax are float32 either way.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace openmla {

using at::BFloat16;
using at::Half;
using fVec = at::vec::Vectorized<float>;
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int64_t VL = fVec::size();

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

// Per-thread scratch ------------------------------------------------------------------
// Named slots of 64-byte aligned memory, grown on demand and kept across calls (a fresh
// allocation per block would page-fault on every touch). Contents are undefined on entry.
enum Slot { S_QT, S_SCORES, S_SCORES_T, S_PROBS, S_VPACK, S_KPACK, S_KEYS, S_ACC, S_ROWS, S_PTRS, NUM_SLOTS };

struct ThreadScratch {
  void* ptr[NUM_SLOTS] = {};
  size_t cap[NUM_SLOTS] = {};
  ~ThreadScratch() {
    for (auto* p : ptr) std::free(p);
  }
};

inline ThreadScratch& thread_scratch() {
  static thread_local ThreadScratch s;
  return s;
}

template <typename T>
T* scratch(Slot slot, int64_t n) {
  ThreadScratch& s = thread_scratch();
  size_t bytes = round_up(std::max<int64_t>(n, 1) * (int64_t)sizeof(T), 64);
  if (bytes > s.cap[slot]) {
    std::free(s.ptr[slot]);
    s.ptr[slot] = std::aligned_alloc(64, bytes);
    TORCH_CHECK(s.ptr[slot] != nullptr, "openmla cpu: out of memory for ", bytes, " bytes of scratch");
    s.cap[slot] = bytes;
  }
  return static_cast<T*>(s.ptr[slot]);
}

// GEMM: C[M,N] (+)= A[M,K] (row-major, lda) x B (packed, ldb columns) -------------------
inline void gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add, const BFloat16* A,
                 const BFloat16* B, float* C) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add, A, B, C, /*is_vnni=*/true);
}

inline void gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add, const float* A,
                 const float* B, float* C) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add, A, B, C, /*is_vnni=*/false);
}

// K-dimension granule of a packed B: pairs of rows for VNNI-2, single rows otherwise.
template <typename T>
constexpr int64_t k_pair() {
  return std::is_same_v<T, BFloat16> ? 2 : 1;
}

// Work queue: units taken dynamically (largest first, as the caller orders them) by every
// thread of ONE parallel region, so a busy core slows only its own share. ``work_s`` estimates
// the single-thread seconds of all units: small calls wake fewer threads (a parallel region
// costs microseconds on a quiet machine, a scheduler time slice on a busy one).
constexpr double MIN_THREAD_WORK_S = 50e-6;
constexpr double EST_FLOPS_PER_S = 5e11;  // per thread, conservative (AMX reaches ~9e11)
constexpr double EST_BYTES_PER_S = 5e9;   // per thread, from DRAM

template <typename F>
void run_units(int64_t n_units, double work_s, bool uses_vnni, const F& fn) {
  if (n_units <= 0) return;
  const int64_t threads = std::clamp<int64_t>((int64_t)std::ceil(work_s / MIN_THREAD_WORK_S), 1,
                                              std::min<int64_t>(at::get_num_threads(), n_units));
  std::atomic<int64_t> next{0};
  auto worker = [&](int64_t, int64_t) {
    for (int64_t u = next.fetch_add(1, std::memory_order_relaxed); u < n_units;
         u = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(u);
    }
    if (uses_vnni) at::native::cpublas::brgemm_release(true);  // AMX tile state
  };
  if (threads == 1) {
    worker(0, 1);
  } else {
    at::parallel_for(0, threads, 1, worker);
  }
}

// Masks ----------------------------------------------------------------------------------
// Same kinds and rule as openmla.masks: each query sees one interval of key positions.
enum MaskKind : int64_t { CAUSAL = 0, NULL_MASK = 1, SLIDING_CAUSAL = 2, SLIDING_NONCAUSAL = 3, CHUNKED = 4 };

struct Mask {
  int64_t kind = CAUSAL, window = 0, chunk = 0;
  // Keys [lo, hi) that can be visible to queries at positions q_lo..q_hi (exact when q_lo == q_hi).
  std::pair<int64_t, int64_t> key_range(int64_t q_lo, int64_t q_hi, int64_t kv_len) const {
    int64_t lo = 0, hi = kv_len;
    if (kind != NULL_MASK && kind != SLIDING_NONCAUSAL) hi = std::min(kv_len, q_hi + 1);
    if (kind == SLIDING_CAUSAL || kind == SLIDING_NONCAUSAL) {
      lo = std::max<int64_t>(0, q_lo - window + 1);
    } else if (kind == CHUNKED) {
      lo = (q_lo / chunk) * chunk;
    }
    return {lo, std::max(lo, hi)};
  }
};

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

// float8_e4m3fn -> float. Vectorised: the 7 magnitude bits shifted into a float's exponent and
// mantissa read as 2^-120 times the value for normals; subnormals (exponent 0) are m * 2^-9;
// 0x7f is NaN.
inline float fp8_to_float(uint8_t b) {
  return static_cast<float>(c10::Float8_e4m3fn(b, c10::Float8_e4m3fn::from_bits()));
}

// dst[j] = fp8(src[j]) * scale for n values (rounded once, as float32 x * scale).
#if defined(CPU_CAPABILITY_AVX512)
inline __m512 dequant_fp8_x16(const uint8_t* src, __m512 vscale) {
  const __m512i m7f = _mm512_set1_epi32(0x7f), m80 = _mm512_set1_epi32(0x80), eight = _mm512_set1_epi32(8);
  __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  __m512i em = _mm512_and_si512(x, m7f);
  __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, m80), 24);
  __m512 normal = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(em, 20)), _mm512_set1_ps(1.329227995784916e36f));  // 2^120
  __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(1.0f / 512.0f));
  __m512 mag = _mm512_mask_mov_ps(normal, _mm512_cmplt_epi32_mask(em, eight), sub);
  mag = _mm512_mask_mov_ps(mag, _mm512_cmpeq_epi32_mask(em, m7f), _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
  return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag), sign)), vscale);
}
#endif

template <typename T>
inline void dequant_fp8(const uint8_t* src, float scale, T* dst, int64_t n) {
  int64_t j = 0;
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 vscale = _mm512_set1_ps(scale);
  if constexpr (std::is_same_v<T, float>) {
    for (; j + 16 <= n; j += 16) _mm512_storeu_ps(dst + j, dequant_fp8_x16(src + j, vscale));
  } else {
    for (; j + 32 <= n; j += 32) {
      fVec lo(dequant_fp8_x16(src + j, vscale)), hi(dequant_fp8_x16(src + j + 16, vscale));
      at::vec::convert_from_float<T>(lo, hi).store(dst + j);
    }
  }
#endif
  for (; j < n; ++j) dst[j] = static_cast<T>(fp8_to_float(src[j]) * scale);
}

// Cache formats (openmla.fp8): native entries, fp8_e4m3 (entry / kv_scale), or fp8_ds_mla
// records (L fp8 latent values, L/128 float32 scales, R bfloat16 rope values).
enum CacheFormat : int64_t { FMT_BF16 = 0, FMT_F16 = 1, FMT_F32 = 2, FMT_E4M3 = 3, FMT_DS_MLA = 4 };
constexpr int64_t DS_GROUP = 128;

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

  int64_t width() const { return L + R; }
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
      case FMT_E4M3: dequant_fp8(src + c0, kv_scale, dst, c1 - c0); break;
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
template <typename T>
void pack_b_rows(const T* const* rows, int64_t K, int64_t K_pad, int64_t N, T* dst, int64_t tail_bytes = 0) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t k = 0; k < K_pad; ++k) {
      const float* r = k < K ? rows[k] : nullptr;
      if (r) std::memcpy(dst + k * N, r, N * sizeof(float));
      else zero_fill(dst + k * N, N * sizeof(float));
    }
  } else {
    for (int64_t k = 0; k < K_pad; k += 2) {
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

// Online softmax -------------------------------------------------------------------------
// Lazy rescaling: a row's reference only moves when a block's max exceeds it by this margin
// (e^8 ~ 3e3 stays exact in float32 sums and relative in bf16), so the accumulator is
// rescaled rarely and the P x V product adds straight into it.
constexpr float RESCALE_MARGIN = 8.f;

// Lane-wise max without NaN propagation (scores are finite or -inf).
inline fVec fast_max(const fVec& a, const fVec& b) {
#if defined(CPU_CAPABILITY_AVX512)
  return fVec(_mm512_max_ps(a, b));
#elif defined(CPU_CAPABILITY_AVX2)
  return fVec(_mm256_max_ps(a, b));
#else
  return at::vec::maximum(a, b);
#endif
}

inline float reduce_max(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return fast_max(x, y); }, v);
}

inline float reduce_sum(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, v);
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

// e^x for probabilities: for bf16 P the fast polynomial (relative error ~1e-4, far below
// bf16's 4e-3 rounding), for float32 the 2-ulp one.
template <typename T>
inline fVec prob_exp(const fVec& x) {
  if constexpr (std::is_same_v<T, float>) {
    return x.exp_u20();
  } else {
    return x.fexp_u20();
  }
}

// If the row's max ``mx`` passes its reference by the margin, move the reference there and
// rescale the row's sum and accumulator (a first visible block just zeroes the accumulator).
inline void raise_reference(float mx, float& ref, float& sum, float* o, int64_t Dv) {
  if (!(mx > ref + RESCALE_MARGIN)) return;
  if (ref == NEG_INF) {
    zero_fill(o, Dv * sizeof(float));
  } else {
    const float f = std::exp(ref - mx);
    sum *= f;
    at::vec::map([f](fVec x) { return x * fVec(f); }, o, o, Dv);
  }
  ref = mx;
}

// One block of scores, query-major: S [M][lds] raw scores (float), row m sees columns
// [c0[m], c1[m]) (others count as masked). Updates the row's reference ``ref`` and sum ``sum``,
// rescales its accumulator row O[m][0:Dv] when the reference moves, and writes probabilities
// P [M][ldp] (columns [0, n_pad), zero outside the visible ones; n_pad a multiple of 2 * VL)
// in the compute type.
template <typename T>
void softmax_block(const float* S, int64_t lds, int64_t M, int64_t n_pad, const int32_t* c0, const int32_t* c1, float scale,
                   float* ref, float* sum, float* O, int64_t ldo, int64_t Dv, T* P, int64_t ldp) {
  const fVec vzero(0.f);
  for (int64_t m = 0; m < M; ++m) {
    const float* s = S + m * lds;
    T* p = P + m * ldp;
    const int64_t a = c0[m], b = c1[m];
    if (a >= b) {
      zero_fill(p, n_pad * sizeof(T));
      continue;
    }
    // max of scale * s over [a, b): the max of s, or its min for a negative scale
    const bool pos = scale >= 0.f;
    fVec vext(pos ? NEG_INF : -NEG_INF);
    int64_t j = a;
    for (; j + VL <= b; j += VL) vext = pos ? fast_max(vext, fVec::loadu(s + j)) : at::vec::minimum(vext, fVec::loadu(s + j));
    float ext = pos ? reduce_max(vext) : -reduce_max(fVec(0.f) - vext);
    for (; j < b; ++j) ext = pos ? std::max(ext, s[j]) : std::min(ext, s[j]);
    const float mx = ext * scale;
    if (!(mx > NEG_INF)) {  // only -inf scores
      zero_fill(p, n_pad * sizeof(T));
      continue;
    }
    raise_reference(mx, ref[m], sum[m], O + m * ldo, Dv);
    const fVec vscale(scale), vneg_r(-ref[m]);
    fVec vsum = vzero;
    auto expo = [&](int64_t j0) {  // e^(scale * s - ref) over VL columns from j0, 0 where not visible
      if (j0 + VL <= a || j0 >= b) return vzero;
      fVec e = prob_exp<T>(at::vec::fmadd(fVec::loadu(s + j0), vscale, vneg_r));
      if (j0 < a || j0 + VL > b) {
        alignas(64) float t[VL];
        e.store(t);
        for (int64_t i = 0; i < VL; ++i)
          if (j0 + i < a || j0 + i >= b) t[i] = 0.f;
        e = fVec::loadu(t);
      }
      vsum = vsum + e;
      return e;
    };
    for (j = 0; j < n_pad; j += 2 * VL) {
      if (j + 2 * VL <= a || j >= b) {
        zero_fill(p + j, 2 * VL * sizeof(T));
        continue;
      }
      const fVec lo = expo(j), hi = expo(j + VL);
      store_pair(p + j, lo, hi);
    }
    sum[m] += reduce_sum(vsum);
  }
}

// Transpose src [rows][cols] (ld_src) into dst [cols][rows] (ld_dst).
template <typename T>
void transpose(const T* src, int64_t ld_src, T* dst, int64_t ld_dst, int64_t rows, int64_t cols) {
  if constexpr (std::is_same_v<T, float>) {
    at::vec::transpose_mxn<float>(src, ld_src, dst, ld_dst, (int)rows, (int)cols);
  } else {
    for (int64_t i = 0; i < rows; i += 32)
      for (int64_t j = 0; j < cols; j += 32)
        at::vec::transpose_mxn<T>(src + i * ld_src + j, ld_src, dst + j * ld_dst + i, ld_dst, (int)std::min<int64_t>(32, rows - i),
                                  (int)std::min<int64_t>(32, cols - j));
  }
}

// The online softmax step on keys-major scores: S [rows][M] (ld M) holds one block's raw scores,
// query column m sees block rows [lo[m], hi[m]). Vectorised across query columns (no horizontal
// reductions). Updates ``ref``/``sum``, rescales accumulator rows O[m] as softmax_block does, and
// writes the probabilities query-major, P [M][n_pad] in the compute type (zeros where not
// visible), through the keys-major scratch PT [n_pad][M].
template <typename T>
void softmax_keys_major(const float* S, int64_t M, int64_t rows, int64_t n_pad, const int32_t* lo, const int32_t* hi,
                        float scale, float* ref, float* sum, float* O, int64_t ldo, int64_t Dv, T* PT, T* P) {
  using iVec = at::vec::Vectorized<int32_t>;
  const fVec vscale(scale), vneg(NEG_INF), vzero(0.f);
  alignas(64) float bm[VL];
  for (int64_t c = 0; c < M; c += VL) {
    const int64_t w = std::min<int64_t>(VL, M - c);
    int64_t glo = n_pad, ghi = 0, alo = 0, ahi = n_pad;  // union and intersection of the columns' rows
    for (int64_t m = c; m < c + w; ++m) {
      if (lo[m] < hi[m]) {
        glo = std::min<int64_t>(glo, lo[m]);
        ghi = std::max<int64_t>(ghi, hi[m]);
      }
      alo = std::max<int64_t>(alo, lo[m]);
      ahi = std::min<int64_t>(ahi, hi[m]);
    }
    const iVec vlo = iVec::loadu(lo + c, w), vhi = iVec::loadu(hi + c, w);
    auto visible = [&](int64_t j) {  // lanes whose column sees row j, as a float mask
      const iVec vj(static_cast<int32_t>(j));
      return at::vec::cast<float>(((vlo <= vj) & (vj < vhi)));
    };
    fVec vmax = vneg;
    for (int64_t j = glo; j < ghi; ++j) {
      const fVec x = fVec::loadu(S + j * M + c, w) * vscale;
      vmax = (j >= alo && j < ahi) ? fast_max(vmax, x) : fVec::blendv(vmax, fast_max(vmax, x), visible(j));
    }
    vmax.store(bm);
    for (int64_t m = c; m < c + w; ++m) {
      if (lo[m] < hi[m]) raise_reference(bm[m - c], ref[m], sum[m], O + m * ldo, Dv);
    }
    const fVec vref = fVec::loadu(ref + c, w);
    fVec vsum = vzero;
    for (int64_t j = 0; j < n_pad; ++j) {
      T* dst = PT + j * M + c;
      if (j < glo || j >= ghi) {
        zero_fill(dst, w * sizeof(T));
        continue;
      }
      fVec e = prob_exp<T>(fVec::loadu(S + j * M + c, w) * vscale - vref);
      if (!(j >= alo && j < ahi)) e = fVec::blendv(vzero, e, visible(j));
      vsum = vsum + e;
      if constexpr (std::is_same_v<T, float>) {
        e.store(dst, w);
      } else {
        at::vec::convert_from_float<T>(e, vzero).store(dst, w);
      }
    }
    alignas(64) float add[VL];
    vsum.store(add);
    for (int64_t m = c; m < c + w; ++m) sum[m] += add[m - c];
  }
  transpose<T>(PT, M, P, n_pad, n_pad, M);
}

// Finished row: out = O / sum (zeros when nothing was seen), lse = ref + log(sum) (-inf then),
// and with a sink logit (not NaN) out *= 1 / (1 + e^(sink - lse)); the LSE leaves it out.
template <typename OutT>
void finish_row(const float* O, int64_t Dv, float ref, float sum, float sink, OutT* out, float* lse) {
  if (!(sum > 0.f)) {
    zero_fill(out, Dv * sizeof(OutT));
    *lse = NEG_INF;
    return;
  }
  const float l = ref + std::log(sum);
  float f = 1.f / sum;
  if (!std::isnan(sink)) f /= 1.f + std::exp(sink - l);
  *lse = l;
  if constexpr (std::is_same_v<OutT, float>) {
    at::vec::map([f](fVec x) { return x * fVec(f); }, out, O, Dv);
  } else {
    float tmp[256];
    for (int64_t j = 0; j < Dv; j += 256) {
      int64_t m = std::min<int64_t>(256, Dv - j);
      at::vec::map([f](fVec x) { return x * fVec(f); }, tmp, O + j, m);
      convert_row(tmp, out + j, m);
    }
  }
}

// Merge of normalised partial results over disjoint key sets: o = sum_p w_p o_p / sum_p w_p,
// w_p = e^(lse_p - max), lse = max + log(sum_p w_p); all-empty rows give zeros and -inf.
// Leaves the merged row in ``acc`` (unnormalised: returns (ref, sum) with acc = o * sum).
inline std::pair<float, float> merge_parts(const float* const* o, const float* lse, int64_t parts, int64_t Dv, float* acc) {
  float mx = NEG_INF;
  for (int64_t p = 0; p < parts; ++p) mx = std::max(mx, lse[p]);
  zero_fill(acc, Dv * sizeof(float));
  if (!(mx > NEG_INF)) return {NEG_INF, 0.f};
  float total = 0.f;
  for (int64_t p = 0; p < parts; ++p) {
    if (!(lse[p] > NEG_INF)) continue;
    const float w = std::exp(lse[p] - mx);
    total += w;
    at::vec::map2([w](fVec a, fVec x) { return a + x * fVec(w); }, acc, acc, o[p], Dv);
  }
  return {mx, total};
}

}  // namespace openmla
