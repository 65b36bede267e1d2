// DeepSeek-V4 shared-KV attention (openmla.v4, openmla/shared_kv_spec.py states the math).
//
// One entry of D values per token is both key and value (K = V). Query row t (sequence b,
// position p) reads the raw entries of its sliding window (positions max(0, p - window + 1) .. p)
// and, in the same softmax, compressed entries: every w < (p + 1) / rate (by rule), or the
// entries listed in row t of the indices that the rule allows (-1: unused slot; a repeated
// entry counts twice). A per-head sink adds e^sink to the denominator only; the LSE leaves it out.
//
// Work is cut into units of one query row x a block of its heads (every head of a row sees the
// same keys, so one gathered key block serves M heads). A unit walks its keys in blocks of at
// most SKV_BLOCK rows, found by physical row in the paged stores (row pointers; float32 entries
// are read in place, bf16 / fp16 ones converted into a float32 key buffer):
//   scores  S[n][M] = K[n][D] x Q^T[D][M]     (keys-major; register tiles of SKV_KR keys x 16 heads)
//   softmax_keys_major (softmax.h) -> P^T[n][M], the accumulators rescaled lazily
//   O[M][D] += P x V                          (V = the same key rows; tiles of SKV_MR heads x 16 columns)
// Products in float32 (AVX2 + FMA tiles; plain loops in builds without them), one parallel
// region over the units (run_units).
#pragma once

#include "softmax.h"

namespace openmla {

constexpr int64_t SKV_BLOCK = 128;     // keys per block: 128 x 512 floats = 256 KB of keys, from L2 in P x V
constexpr int64_t SKV_MAX_HEADS = 64;  // heads of one unit (Q^T: 512 x 64 floats = 128 KB)

// One paged store of entries: row ``pos`` of sequence ``b`` at page table[b][pos / page_size].
struct EntryStore {
  const uint8_t* base = nullptr;
  int64_t page_stride = 0, row_stride = 0, page_size = 1;  // bytes, bytes, rows
  const int32_t* table = nullptr;
  int64_t table_stride = 0;
  const uint8_t* row(int64_t b, int64_t pos) const {
    const int64_t page = table[b * table_stride + pos / page_size];
    return base + page * page_stride + (pos % page_size) * row_stride;
  }
};

struct SharedKVArgs {
  const float* q = nullptr;  // [T, H, D] float32, contiguous
  int64_t T = 0, H = 0, D = 0;
  const int64_t* seq = nullptr;  // [T] each query row's sequence
  const int64_t* pos = nullptr;  // [T] its absolute position
  EntryStore raw, comp;
  bool compressed = false;
  int64_t window = 1, rate = 1;
  const int32_t* indices = nullptr;  // [T, topk] or null (compressed entries by rule)
  int64_t topk = 0;
  float scale = 1.f;
  const float* sink = nullptr;  // [H] or null
  float* out = nullptr;         // [T, H, D] float32
  float* lse = nullptr;         // [T, H] float32
};

// The keys of one query row in order: its window's raw entries, then its compressed entries.
struct KeyCursor {
  const SharedKVArgs& a;
  int64_t b, t;
  int64_t k, k_end;  // raw positions still to read
  int64_t w = 0, w_end = 0;  // compressed: entries (rule) or index slots (indices) still to read
  int64_t limit = 0;         // compressed entries the row may see: w < (p + 1) / rate

  KeyCursor(const SharedKVArgs& args, int64_t row) : a(args), b(args.seq[row]), t(row) {
    const int64_t p = a.pos[row];
    k = std::max<int64_t>(0, p - a.window + 1);
    k_end = p + 1;
    if (a.compressed) {
      limit = (p + 1) / a.rate;
      w_end = a.indices ? a.topk : limit;
    }
  }

  // Up to ``max`` next key rows into ``rows``; returns how many (0: none left).
  int64_t next(const uint8_t** rows, int64_t max) {
    int64_t n = 0;
    for (; k < k_end && n < max; ++k) rows[n++] = a.raw.row(b, k);
    if (a.indices) {
      const int32_t* idx = a.indices + t * a.topk;
      for (; w < w_end && n < max; ++w) {
        const int64_t e = idx[w];
        if (e >= 0 && e < limit) rows[n++] = a.comp.row(b, e);
      }
    } else {
      for (; w < w_end && n < max; ++w) rows[n++] = a.comp.row(b, w);
    }
    return n;
  }

  int64_t upper_bound() const { return (k_end - k) + (w_end - w); }
};

#if defined(__AVX2__) && defined(__FMA__)
#define OPENMLA_SKV_AVX2 1
#define OPENMLA_SKV_UNROLL _Pragma("GCC unroll 16")
constexpr int SKV_KR = 6;  // keys per score tile: 6 keys x 16 heads = 12 accumulators of the 16 ymm registers
constexpr int SKV_MR = 6;  // heads per P x V tile: 6 heads x 16 columns = 12 accumulators

inline __m256i skv_lane_mask(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// S[k][0:cols] = sum_d K[k][d] * QT[d][0:cols] for KR key rows (cols <= 8 * NV; Q^T's columns
// past cols are zero padding, read but not stored).
template <int KR, int NV>
inline void skv_score_tile(const float* const* K, const float* QT, int64_t ldq, int64_t D, float* S, int64_t lds, int64_t cols) {
  __m256 acc[KR][NV];
  OPENMLA_SKV_UNROLL
  for (int k = 0; k < KR; ++k)
    OPENMLA_SKV_UNROLL
    for (int v = 0; v < NV; ++v) acc[k][v] = _mm256_setzero_ps();
  const float* kr[KR];
  OPENMLA_SKV_UNROLL
  for (int k = 0; k < KR; ++k) kr[k] = K[k];
  for (int64_t d = 0; d < D; ++d) {
    __m256 q[NV];
    OPENMLA_SKV_UNROLL
    for (int v = 0; v < NV; ++v) q[v] = _mm256_loadu_ps(QT + d * ldq + 8 * v);
    OPENMLA_SKV_UNROLL
    for (int k = 0; k < KR; ++k) {
      const __m256 x = _mm256_broadcast_ss(kr[k] + d);
      OPENMLA_SKV_UNROLL
      for (int v = 0; v < NV; ++v) acc[k][v] = _mm256_fmadd_ps(x, q[v], acc[k][v]);
    }
  }
  OPENMLA_SKV_UNROLL
  for (int v = 0; v < NV; ++v) {
    const int64_t c = cols - 8 * v;
    OPENMLA_SKV_UNROLL
    for (int k = 0; k < KR; ++k) {
      if (c >= 8) _mm256_storeu_ps(S + k * lds + 8 * v, acc[k][v]);
      else if (c > 0) _mm256_maskstore_ps(S + k * lds + 8 * v, skv_lane_mask(c), acc[k][v]);
    }
  }
}

template <int KR>
inline void skv_score_keys(const float* const* K, const float* QT, int64_t ldq, int64_t D, float* S, int64_t M) {
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int64_t cols = std::min<int64_t>(16, M - m0);
    if (cols > 8) skv_score_tile<KR, 2>(K, QT + m0, ldq, D, S + m0, M, cols);
    else skv_score_tile<KR, 1>(K, QT + m0, ldq, D, S + m0, M, cols);
  }
}

// O[m][l0 : l0 + 8 NV] += sum_j PT[j][m] * V[j][l0 : l0 + 8 NV] for MR heads (O rows ldo apart).
template <int MR, int NV>
inline void skv_pv_tile(const float* const* V, int64_t l0, const float* PT, int64_t ldp, int64_t n, float* O, int64_t ldo) {
  __m256 acc[MR][NV];
  OPENMLA_SKV_UNROLL
  for (int m = 0; m < MR; ++m)
    OPENMLA_SKV_UNROLL
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_loadu_ps(O + m * ldo + l0 + 8 * v);
  for (int64_t j = 0; j < n; ++j) {
    __m256 x[NV];
    OPENMLA_SKV_UNROLL
    for (int v = 0; v < NV; ++v) x[v] = _mm256_loadu_ps(V[j] + l0 + 8 * v);
    const float* p = PT + j * ldp;
    OPENMLA_SKV_UNROLL
    for (int m = 0; m < MR; ++m) {
      const __m256 s = _mm256_broadcast_ss(p + m);
      OPENMLA_SKV_UNROLL
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_fmadd_ps(s, x[v], acc[m][v]);
    }
  }
  OPENMLA_SKV_UNROLL
  for (int m = 0; m < MR; ++m)
    OPENMLA_SKV_UNROLL
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(O + m * ldo + l0 + 8 * v, acc[m][v]);
}

template <int NV>
inline void skv_pv_columns(const float* const* V, int64_t l0, const float* PT, int64_t M, int64_t n, float* O, int64_t D) {
  const int64_t groups = ceil_div(M, SKV_MR);
  for (int64_t g = 0; g < groups; ++g) {  // near-equal groups of at most SKV_MR heads
    const int64_t m0 = M * g / groups;
    const float* p = PT + m0;
    float* o = O + m0 * D;
    switch (M * (g + 1) / groups - m0) {
      case 6: skv_pv_tile<6, NV>(V, l0, p, M, n, o, D); break;
      case 5: skv_pv_tile<5, NV>(V, l0, p, M, n, o, D); break;
      case 4: skv_pv_tile<4, NV>(V, l0, p, M, n, o, D); break;
      case 3: skv_pv_tile<3, NV>(V, l0, p, M, n, o, D); break;
      case 2: skv_pv_tile<2, NV>(V, l0, p, M, n, o, D); break;
      default: skv_pv_tile<1, NV>(V, l0, p, M, n, o, D); break;
    }
  }
}
#endif

// Keys-major scores of n key rows: S[j][m] = K[j] . q_m (QT [D][ldq]: Q^T, zero columns past M).
inline void skv_scores(const float* const* K, int64_t n, const float* QT, int64_t ldq, int64_t D, int64_t M, float* S) {
#if defined(OPENMLA_SKV_AVX2)
  for (int64_t j0 = 0; j0 < n; j0 += SKV_KR) {
    const float* const* k = K + j0;
    float* s = S + j0 * M;
    switch (std::min<int64_t>(SKV_KR, n - j0)) {
      case 6: skv_score_keys<6>(k, QT, ldq, D, s, M); break;
      case 5: skv_score_keys<5>(k, QT, ldq, D, s, M); break;
      case 4: skv_score_keys<4>(k, QT, ldq, D, s, M); break;
      case 3: skv_score_keys<3>(k, QT, ldq, D, s, M); break;
      case 2: skv_score_keys<2>(k, QT, ldq, D, s, M); break;
      default: skv_score_keys<1>(k, QT, ldq, D, s, M); break;
    }
  }
#else
  for (int64_t j = 0; j < n; ++j) {
    float* s = S + j * M;
    std::fill(s, s + M, 0.f);
    for (int64_t d = 0; d < D; ++d) {
      const float x = K[j][d];
      const float* qt = QT + d * ldq;
      for (int64_t m = 0; m < M; ++m) s[m] += x * qt[m];
    }
  }
#endif
}

// O[m][:] += sum_j PT[j][m] * V[j][:] over n key rows (O [M][D]).
inline void skv_pv(const float* const* V, int64_t n, const float* PT, int64_t M, int64_t D, float* O) {
  int64_t l0 = 0;
#if defined(OPENMLA_SKV_AVX2)
  for (; l0 + 16 <= D; l0 += 16) skv_pv_columns<2>(V, l0, PT, M, n, O, D);
  for (; l0 + 8 <= D; l0 += 8) skv_pv_columns<1>(V, l0, PT, M, n, O, D);
#endif
  if (l0 == D) return;
  for (int64_t m = 0; m < M; ++m) {
    float* o = O + m * D;
    for (int64_t j = 0; j < n; ++j) {
      const float p = PT[j * M + m];
      const float* v = V[j];
      for (int64_t l = l0; l < D; ++l) o[l] += p * v[l];
    }
  }
}

// One unit: query row t, heads [h0, h0 + M). E: the stores' entry type.
template <typename E>
void shared_kv_unit(const SharedKVArgs& a, int64_t t, int64_t h0, int64_t M) {
  const int64_t D = a.D, ldq = round_up(M, 8), n_pad = round_up(SKV_BLOCK, 32);
  float* QT = scratch<float>(S_QT, D * ldq);
  const float* q = a.q + (t * a.H + h0) * D;
  pack_b_transposed<float>(q, D, M, D, QT, ldq, 0);
  zero_b_columns<float>(QT, D, ldq, M, ldq);
  // O needs no zeroing: softmax_keys_major zeroes a row's accumulator when its first visible
  // block moves the reference from -inf, and finish_row reads no O of a row without a sum.
  float* O = scratch<float>(S_ACC, M * D);
  float* ref = scratch<float>(S_ROWS, 2 * M);
  float* sum = ref + M;
  std::fill(ref, ref + M, NEG_INF);
  std::fill(sum, sum + M, 0.f);
  int32_t* lo = scratch<int32_t>(S_PTRS, 2 * M);
  int32_t* hi = lo + M;
  float* S = scratch<float>(S_SCORES, n_pad * M);
  float* PT = scratch<float>(S_SCORES_T, n_pad * M);
  float* P = scratch<float>(S_PROBS, M * n_pad);
  const uint8_t** src = scratch<const uint8_t*>(S_KPACK, 2 * SKV_BLOCK);
  const float** rows = reinterpret_cast<const float**>(src + SKV_BLOCK);
  float* keys = std::is_same_v<E, float> ? nullptr : scratch<float>(S_KEYS, SKV_BLOCK * D);

  KeyCursor cur(a, t);
  for (int64_t n; (n = cur.next(src, SKV_BLOCK)) > 0;) {
    for (int64_t j = 0; j < n; ++j) {
      if constexpr (std::is_same_v<E, float>) {
        rows[j] = reinterpret_cast<const float*>(src[j]);
      } else {
        convert_row(reinterpret_cast<const E*>(src[j]), keys + j * D, D);
        rows[j] = keys + j * D;
      }
    }
    skv_scores(rows, n, QT, ldq, D, M, S);
    std::fill(lo, lo + M, 0);
    std::fill(hi, hi + M, (int32_t)n);
    softmax_keys_major<float>(S, M, n, round_up(n, 32), lo, hi, a.scale, ref, sum, O, D, D, PT, P);
    skv_pv(rows, n, PT, M, D, O);
  }
  for (int64_t m = 0; m < M; ++m) {
    const int64_t r = t * a.H + h0 + m;
    // A NaN or infinite entry among the row's keys (the sum is then NaN or inf: exp_u20 maps NaN to inf):
    // NaN out and LSE, as the oracle's (finish_row would write zeros or a finite row).
    if (!std::isfinite(sum[m])) {
      std::fill(a.out + r * D, a.out + (r + 1) * D, std::numeric_limits<float>::quiet_NaN());
      a.lse[r] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const float sink = a.sink ? a.sink[h0 + m] : std::numeric_limits<float>::quiet_NaN();
    finish_row(O + m * D, D, ref[m], sum[m], sink, a.out + r * D, a.lse + r);
  }
}

template <typename E>
void run_shared_kv(const SharedKVArgs& a) {
  if (a.T <= 0 || a.H <= 0) return;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  // Head blocks: at most SKV_MAX_HEADS heads a unit, more blocks (of at least 16 heads) when
  // there are fewer rows than threads.
  const int64_t min_blocks = ceil_div(a.H, SKV_MAX_HEADS), max_blocks = std::max(min_blocks, ceil_div(a.H, 16));
  const int64_t hb = std::clamp<int64_t>(ceil_div(threads, a.T), min_blocks, max_blocks);
  double keys = 0;
  for (int64_t t = 0; t < a.T; ++t) keys += (double)KeyCursor(a, t).upper_bound();
  const double work_s = keys * (4.0 * a.H * a.D / EST_FLOPS_PER_S + a.D * 4.0 * hb / EST_BYTES_PER_S);
  run_units(a.T * hb, work_s, false, [&](int64_t u) {
    const int64_t t = u / hb, i = u % hb;
    const int64_t h0 = a.H * i / hb, h1 = a.H * (i + 1) / hb;
    shared_kv_unit<E>(a, t, h0, h1 - h0);
  });
}

}  // namespace openmla
