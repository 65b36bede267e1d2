// bf16 decode products in AVX-512-BF16 register tiles (CPUs with AVX512_BF16 and without AMX:
// Zen 4 and later, Cooper Lake), in place of brgemm and its packed V.
//
// A decode unit's M query rows (tokens x heads) against a key block, both products as small
// GEMMs blocked in zmm registers, vdpbf16ps (32 bf16 products into 16 float32 lanes) throughout:
//   scores  S[j][m] = K[j] . Q[m]: a tile of KR keys x 16*NV query columns, the query pairs
//           (Q^T in VNNI pairs, [D/2][ldq][2], packed once per unit) loaded once per key tile
//           and column group and reused by the KR keys; each key's pair broadcast from its
//           cache row where it lies (no key copy, no transposition).
//   P x V   O[m][l] += sum_j P[m][j] V[j][l]: a tile of MR query rows x 32 latent columns; two
//           keys' V rows are interleaved in registers (vpunpck{l,h}wd: the VNNI pairs along the
//           keys that vdpbf16ps takes, columns in a fixed lane order that the tile undoes when it
//           stores O), each P pair broadcast from PP [n/2][M] (the softmax's keys-major P^T,
//           two keys interleaved: one 32-bit word per row). V is read as stored: no pack pass.
// Blocking is chosen from M at run time (score_tiles); the sizes fill the 32 zmm registers with
// accumulators and keep >= 6 of them independent (vdpbf16ps latency). Rows are pointers: cache
// rows in place, a converted key buffer, or a zero row (keys a query row does not see: P = 0
// there, and unwritten cache rows may hold NaN).
// float32 decode products in register tiles of the build's widest float vectors (AVX-512: 16
// lanes, 32 registers; AVX2 + FMA: 8 lanes, 16 registers), in place of brgemm's float32 path
// (float32 and float16 caches, and bf16 caches where bf16 computes in float32: AVX2 builds):
//   scores  the same tile shape as the bf16 one (score_tile over the vector traits F32x: KR keys
//           x NV vectors of query columns, one key value broadcast per row of FMAs; Q^T [D][ldq]);
//   P x V   O[m][c..] += PT[j][m] V[j][c..]: MR query rows x 2 vectors of latent columns, P
//           broadcast from the softmax's keys-major P^T, V read as the rows lie (key buffer or
//           a float32 page in place): no pack pass, no P transpose.
#pragma once

#include "common.h"

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define OPENMLA_BF16_TILES 1
#endif

namespace openmla {

#if defined(OPENMLA_TEST_HOOKS)
// Test builds: switch the tiles off (brgemm then runs, as before them) and count their units.
inline std::atomic<bool>& bf16_tiles_switch() {
  static std::atomic<bool> on{true};
  return on;
}
inline std::atomic<int64_t>& bf16_tiles_units() {
  static std::atomic<int64_t> n{0};
  return n;
}
#endif

// Lines of the next key block asked into L2 while P x V runs on this one (one per key pair of
// a tile): the score tiles of the next block then find their keys there instead of waiting on
// memory, so the cache stream overlaps the products.
struct BlockPrefetch {
  const uint8_t* const* rows = nullptr;  // the rows to fetch, ``n`` of them, ``bytes`` each
  int64_t n = 0, bytes = 0, r = 0, off = 0;
  inline void one() {
    if (r >= n) return;
    __builtin_prefetch(rows[r] + off, 0, 2);
    off += 64;
    if (off >= bytes) {
      off = 0;
      ++r;
    }
  }
};

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__)
#define OPENMLA_F32_TILES 1
#elif defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__) && defined(__FMA__)
#define OPENMLA_F32_TILES 1
#endif

#if defined(OPENMLA_TEST_HOOKS)
// Test builds: switch the float32 tiles off (brgemm's float32 path then runs) and count their units.
inline std::atomic<bool>& f32_tiles_switch() {
  static std::atomic<bool> on{true};
  return on;
}
inline std::atomic<int64_t>& f32_tiles_units() {
  static std::atomic<int64_t> n{0};
  return n;
}
#endif

#if defined(OPENMLA_BF16_TILES) || defined(OPENMLA_F32_TILES)
#define OPENMLA_TILE_UNROLL _Pragma("GCC unroll 32")

// Vector traits of the tiles: E the operand type, V the float32 accumulator (W lanes), Q an
// operand vector, STEP values of a row per product lane (bf16 pairs: 2), REGS vector registers.
#if defined(CPU_CAPABILITY_AVX512)
struct Zmm {
  using V = __m512;
  static constexpr int W = 16, REGS = 32;
  static inline __mmask16 lanes(int64_t n) { return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1); }
  static inline V zero() { return _mm512_setzero_ps(); }
  static inline V load(const float* p) { return _mm512_loadu_ps(p); }
  static inline V load_n(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(lanes(n), p); }
  static inline void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static inline void store_n(float* p, V v, int64_t n) { _mm512_mask_storeu_ps(p, lanes(n), v); }
  static inline V set1(float x) { return _mm512_set1_ps(x); }
  static inline V fma(V acc, V a, V b) { return _mm512_fmadd_ps(a, b, acc); }
};
#if defined(OPENMLA_F32_TILES)
struct F32x : Zmm {
  using E = float;
  using Q = __m512;
  static constexpr int STEP = 1;
  static inline Q load_q(const float* p) { return _mm512_loadu_ps(p); }
  static inline Q bcast(const float* k, int64_t d) { return _mm512_set1_ps(k[d]); }
  static inline V madd(V acc, Q b, Q q) { return _mm512_fmadd_ps(b, q, acc); }
};
#endif
#if defined(OPENMLA_BF16_TILES)
struct BF16x : Zmm {
  using E = BFloat16;
  using Q = __m512bh;
  static constexpr int STEP = 2;
  static inline Q load_q(const BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static inline Q bcast(const BFloat16* k, int64_t d) { return (__m512bh)_mm512_set1_epi32(reinterpret_cast<const int32_t*>(k)[d]); }
  static inline V madd(V acc, Q b, Q q) { return _mm512_dpbf16_ps(acc, b, q); }
};
#endif
#else  // AVX2 + FMA: 8 lanes, 16 registers
struct F32x {
  using V = __m256;
  using E = float;
  using Q = __m256;
  static constexpr int W = 8, REGS = 16, STEP = 1;
  static inline __m256i lanes(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)std::clamp<int64_t>(n, 0, 8)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static inline V zero() { return _mm256_setzero_ps(); }
  static inline V load(const float* p) { return _mm256_loadu_ps(p); }
  static inline V load_n(const float* p, int64_t n) { return _mm256_maskload_ps(p, lanes(n)); }
  static inline void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static inline void store_n(float* p, V v, int64_t n) { _mm256_maskstore_ps(p, lanes(n), v); }
  static inline V set1(float x) { return _mm256_set1_ps(x); }
  static inline V fma(V acc, V a, V b) { return _mm256_fmadd_ps(a, b, acc); }
  static inline Q load_q(const float* p) { return _mm256_loadu_ps(p); }
  static inline Q bcast(const float* k, int64_t d) { return _mm256_broadcast_ss(k + d); }
  static inline V madd(V acc, Q b, Q q) { return _mm256_fmadd_ps(b, q, acc); }
};
#endif

// S[k][0:cols] = K[k] . Q^T[:, 0:cols] for kr <= KR keys (rows K[0..kr)); QT [steps][ldq][STEP]
// (bf16: VNNI pairs), columns past cols zero padding (read, not stored). S rows lds floats apart.
template <class X, int KR, int NV>
inline void score_tile(const typename X::E* const* K, int64_t kr, const typename X::E* QT, int64_t ldq, int64_t steps,
                       float* S, int64_t lds, int64_t cols) {
  typename X::V acc[KR][NV];
  const typename X::E* kp[KR];
  OPENMLA_TILE_UNROLL
  for (int k = 0; k < KR; ++k) {
    kp[k] = K[k < kr ? k : kr - 1];
    OPENMLA_TILE_UNROLL
    for (int v = 0; v < NV; ++v) acc[k][v] = X::zero();
  }
  const typename X::E* q = QT;
  for (int64_t d = 0; d < steps; ++d, q += ldq * X::STEP) {
    typename X::Q qv[NV];
    OPENMLA_TILE_UNROLL
    for (int v = 0; v < NV; ++v) qv[v] = X::load_q(q + X::W * X::STEP * v);
    OPENMLA_TILE_UNROLL
    for (int k = 0; k < KR; ++k) {
      const typename X::Q b = X::bcast(kp[k], d);
      OPENMLA_TILE_UNROLL
      for (int v = 0; v < NV; ++v) acc[k][v] = X::madd(acc[k][v], b, qv[v]);
    }
  }
  OPENMLA_TILE_UNROLL
  for (int k = 0; k < KR; ++k) {
    if (k >= kr) break;
    OPENMLA_TILE_UNROLL
    for (int v = 0; v < NV; ++v) {
      const int64_t c = cols - X::W * v;
      if (c >= X::W) X::store(S + k * lds + X::W * v, acc[k][v]);
      else if (c > 0) X::store_n(S + k * lds + X::W * v, acc[k][v], c);
    }
  }
}

// A column group's last (partial) tile: as many vectors as its columns need.
template <class X, int KR, int NV>
inline void score_group(const typename X::E* const* K, int64_t kr, const typename X::E* QT, int64_t ldq, int64_t steps,
                        float* S, int64_t lds, int64_t cols) {
  if constexpr (NV > 1) {
    if (cols <= X::W * (NV - 1)) return score_group<X, KR, NV - 1>(K, kr, QT, ldq, steps, S, lds, cols);
  }
  score_tile<X, KR, NV>(K, kr, QT, ldq, steps, S, lds, cols);
}

// Keys the score tiles ask for ahead of the tile they multiply: at H = 16 one core consumes a
// key row (1152 bytes) every ~100 ns, faster than the hardware prefetchers follow 8 rows at once
// (16 against 0 and 32: 0.84 / 0.92 / 0.87 of brgemm's time, Zen 4, H=16, 8 x 4096, one thread).
constexpr int64_t SCORE_PREFETCH_KEYS = 16;

template <class X, int KR, int NV>
inline void score_tiles_nv(const typename X::E* const* K, int64_t n, const typename X::E* QT, int64_t ldq, int64_t D,
                           float* S, int64_t M, bool stream) {
  const int64_t steps = D / X::STEP, bytes = stream ? D * (int64_t)sizeof(typename X::E) : 0;
  for (int64_t r = 0; r < std::min(n, SCORE_PREFETCH_KEYS); ++r)
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(K[r]) + b, _MM_HINT_T0);
  for (int64_t j = 0; j < n; j += KR) {
    for (int64_t r = j + SCORE_PREFETCH_KEYS; r < std::min(n, j + SCORE_PREFETCH_KEYS + KR); ++r)
      for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(K[r]) + b, _MM_HINT_T0);
    for (int64_t m0 = 0; m0 < M; m0 += X::W * NV)
      score_group<X, KR, NV>(K + j, std::min<int64_t>(KR, n - j), QT + X::STEP * m0, ldq, steps, S + j * M + m0, M, M - m0);
  }
}

// Scores of n keys (rows K[0..n), D values each; bf16: D even) against M query columns: S [n][M],
// QT's rows ldq columns apart (a multiple of X::W). Blocking by M and the registers:
// 32 registers: 8 keys x 16 columns up to 16 query rows, 8 x 32 up to 32, 8 x 48 up to 48, 6 x 64
// beyond (8-24 accumulators); 16 registers: 8 keys x 8 columns up to 8 rows, 6 x 16 beyond
// (8 / 12 accumulators). A row's last column group takes the vectors it needs. ``stream``: the
// rows come from memory (cache pages in place), so the tiles ask for them ahead; a key buffer's
// rows were just written, and are not.
template <class X>
inline void score_tiles(const typename X::E* const* K, int64_t n, const typename X::E* QT, int64_t ldq, int64_t D,
                        float* S, int64_t M, bool stream = true) {
  if (n <= 0) return;
  if constexpr (X::REGS >= 32) {
    if (M <= X::W) score_tiles_nv<X, 8, 1>(K, n, QT, ldq, D, S, M, stream);
    else if (M <= 2 * X::W) score_tiles_nv<X, 8, 2>(K, n, QT, ldq, D, S, M, stream);
    else if (M <= 3 * X::W) score_tiles_nv<X, 8, 3>(K, n, QT, ldq, D, S, M, stream);
    else score_tiles_nv<X, 6, 4>(K, n, QT, ldq, D, S, M, stream);
  } else {
    if (M <= X::W) score_tiles_nv<X, 8, 1>(K, n, QT, ldq, D, S, M, stream);
    else score_tiles_nv<X, 6, 2>(K, n, QT, ldq, D, S, M, stream);
  }
}
#endif

#if defined(OPENMLA_F32_TILES)
// Keys ahead whose V columns a P x V tile asks into L1 (the rows lie a cache row apart, on
// shuffled pages: no stride for the hardware to follow).
constexpr int64_t PV_PREFETCH_KEYS = 8;

// O[m][c0 + 0:w] += sum_j PT[j][m] V[j][c0 + 0:w] for MR query rows, w <= NC W columns (FULL:
// w = NC W): n keys, V rows V[0..n) read as they lie, PT [n][ldp] the keys-major probabilities.
template <class X, int MR, int NC, bool FULL>
inline void pv_tile_f32(const float* const* V, int64_t n, const float* PT, int64_t ldp, float* O, int64_t ldo, int64_t c0,
                        int64_t w, BlockPrefetch& pf, bool ahead) {
  constexpr int W = X::W;
  typename X::V acc[MR][NC];
  OPENMLA_TILE_UNROLL
  for (int m = 0; m < MR; ++m) {
    const float* o = O + m * ldo + c0;
    OPENMLA_TILE_UNROLL
    for (int c = 0; c < NC; ++c) acc[m][c] = FULL ? X::load(o + W * c) : X::load_n(o + W * c, w - W * c);
  }
  for (int64_t j = 0; j < n; ++j) {
    const float* v = V[j] + c0;
    if (ahead && j + PV_PREFETCH_KEYS < n) {
      const char* ahead = reinterpret_cast<const char*>(V[j + PV_PREFETCH_KEYS] + c0);
      _mm_prefetch(ahead, _MM_HINT_T0);
      if constexpr (NC * W * 4 > 64) _mm_prefetch(ahead + 64, _MM_HINT_T0);
    }
    typename X::V x[NC];
    OPENMLA_TILE_UNROLL
    for (int c = 0; c < NC; ++c) x[c] = FULL ? X::load(v + W * c) : X::load_n(v + W * c, w - W * c);
    const float* p = PT + j * ldp;
    pf.one();
    OPENMLA_TILE_UNROLL
    for (int m = 0; m < MR; ++m) {
      const typename X::V b = X::set1(p[m]);
      OPENMLA_TILE_UNROLL
      for (int c = 0; c < NC; ++c) acc[m][c] = X::fma(acc[m][c], b, x[c]);
    }
  }
  OPENMLA_TILE_UNROLL
  for (int m = 0; m < MR; ++m) {
    float* o = O + m * ldo + c0;
    OPENMLA_TILE_UNROLL
    for (int c = 0; c < NC; ++c) {
      if (FULL) X::store(o + W * c, acc[m][c]);
      else X::store_n(o + W * c, acc[m][c], w - W * c);
    }
  }
}

template <class X, int MR, int NC, bool FULL>
inline void pv_group_f32(int64_t rows, const float* const* V, int64_t n, const float* PT, int64_t ldp, float* O,
                         int64_t ldo, int64_t c0, int64_t w, BlockPrefetch& pf, bool ahead) {
  if constexpr (MR > 1) {
    if (rows < MR) return pv_group_f32<X, MR - 1, NC, FULL>(rows, V, n, PT, ldp, O, ldo, c0, w, pf, ahead);
  }
  pv_tile_f32<X, MR, NC, FULL>(V, n, PT, ldp, O, ldo, c0, w, pf, ahead);
}

// Near-equal groups of at most MR query rows per chunk of NC W latent columns (the chunk's V
// columns stay in L1 across the groups).
template <class X, int MR, int NC>
inline void pv_chunks_f32(const float* const* V, int64_t n, const float* PT, int64_t M, float* O, int64_t ldo, int64_t L,
                          BlockPrefetch& pf) {
  const int64_t groups = ceil_div(M, (int64_t)MR);
  for (int64_t c = 0; c < L; c += NC * X::W) {
    const int64_t w = std::min<int64_t>(NC * X::W, L - c);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t r0 = M * g / groups, r1 = M * (g + 1) / groups;
      // the chunk's V columns are asked into L1 by the first group; the others find them there
      if (w == NC * X::W) pv_group_f32<X, MR, NC, true>(r1 - r0, V, n, PT + r0, M, O + r0 * ldo, ldo, c, w, pf, g == 0);
      else pv_group_f32<X, MR, NC, false>(r1 - r0, V, n, PT + r0, M, O + r0 * ldo, ldo, c, w, pf, g == 0);
    }
  }
}

// O [M][ldo] (first L columns) += P x V over n keys. 32 registers: groups of 12 rows x 2
// vectors (24 accumulators; at M = 16, 16 rows x 1 vector, V read once per block, was no faster:
// 13.1-13.9 against 13.3-13.6 ms at H=16 8 x 4096 / 32 x 1024, loaded box); 16 registers: groups
// of 6 rows x 2 vectors (12 accumulators).
template <class X>
inline void pv_tiles_f32(const float* const* V, int64_t n, const float* PT, int64_t M, float* O, int64_t ldo, int64_t L,
                         BlockPrefetch& pf) {
  if (n <= 0) return;
  if constexpr (X::REGS >= 32) {
    pv_chunks_f32<X, 12, 2>(V, n, PT, M, O, ldo, L, pf);
  } else {
    pv_chunks_f32<X, 6, 2>(V, n, PT, M, O, ldo, L, pf);
  }
}
#endif

#if defined(OPENMLA_BF16_TILES)
// Lane orders of a 32-column P x V chunk: vpunpck{l,h}wd of two 32-value rows leave column
// 8q + t (t < 4) in lane 4q + t of ``lo`` and column 8q + 4 + t in lane 4q + t of ``hi``.
struct ChunkPerm {
  __m512i to_lo, to_hi, to_n0, to_n1;
  ChunkPerm() {
    alignas(64) int32_t a[16], b[16], c[16], d[16];
    for (int i = 0; i < 16; ++i) {
      a[i] = 8 * (i >> 2) + (i & 3);      // lo lane i <- natural column (of nat0 | nat1)
      b[i] = 8 * (i >> 2) + 4 + (i & 3);  // hi lane i
      const int q = i >> 3, t = i & 7;
      c[i] = t < 4 ? 4 * q + t : 16 + 4 * q + t - 4;          // natural column i <- lo | hi lane
      d[i] = t < 4 ? 8 + 4 * q + t : 16 + 8 + 4 * q + t - 4;  // natural column 16 + i
    }
    to_lo = _mm512_load_si512(a);
    to_hi = _mm512_load_si512(b);
    to_n0 = _mm512_load_si512(c);
    to_n1 = _mm512_load_si512(d);
  }
};

inline const ChunkPerm& chunk_perm() {
  static const ChunkPerm p;
  return p;
}

// O[m][c0 + 0:w] += sum_j P[m][j] V[j][c0 + 0:w] for MR query rows (w <= 32 columns): V rows
// V[0..2 npairs), PP [npairs][ldpp] the P pairs of the two keys of each pair (row m at m).
template <int MR>
inline void pv_tile(const BFloat16* const* V, int64_t npairs, const int32_t* PP, int64_t ldpp, float* O, int64_t ldo,
                    int64_t c0, int64_t w, BlockPrefetch& pf) {
  const ChunkPerm& pm = chunk_perm();
  const __mmask32 vmask = w >= 32 ? ~(__mmask32)0 : (__mmask32)((1ull << w) - 1);
  const __mmask16 m0 = w >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << w) - 1);
  const __mmask16 m1 = w >= 32 ? (__mmask16)0xffff : w > 16 ? (__mmask16)((1u << (w - 16)) - 1) : (__mmask16)0;
  __m512 lo[MR], hi[MR];
  OPENMLA_TILE_UNROLL
  for (int m = 0; m < MR; ++m) {
    const __m512 n0 = _mm512_maskz_loadu_ps(m0, O + m * ldo + c0), n1 = _mm512_maskz_loadu_ps(m1, O + m * ldo + c0 + 16);
    lo[m] = _mm512_permutex2var_ps(n0, pm.to_lo, n1);
    hi[m] = _mm512_permutex2var_ps(n0, pm.to_hi, n1);
  }
  for (int64_t jp = 0; jp < npairs; ++jp, PP += ldpp) {
    const __m512i v0 = _mm512_maskz_loadu_epi16(vmask, V[2 * jp] + c0);
    const __m512i v1 = _mm512_maskz_loadu_epi16(vmask, V[2 * jp + 1] + c0);
    const __m512bh vl = (__m512bh)_mm512_unpacklo_epi16(v0, v1), vh = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
    pf.one();
    OPENMLA_TILE_UNROLL
    for (int m = 0; m < MR; ++m) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(PP[m]);
      lo[m] = _mm512_dpbf16_ps(lo[m], p, vl);
      hi[m] = _mm512_dpbf16_ps(hi[m], p, vh);
    }
  }
  OPENMLA_TILE_UNROLL
  for (int m = 0; m < MR; ++m) {
    _mm512_mask_storeu_ps(O + m * ldo + c0, m0, _mm512_permutex2var_ps(lo[m], pm.to_n0, hi[m]));
    _mm512_mask_storeu_ps(O + m * ldo + c0 + 16, m1, _mm512_permutex2var_ps(lo[m], pm.to_n1, hi[m]));
  }
}

template <int MR>
inline void pv_rows_mr(const BFloat16* const* V, int64_t npairs, const int32_t* PP, int64_t ldpp, float* O, int64_t ldo,
                       int64_t L, BlockPrefetch& pf) {
  for (int64_t c = 0; c < L; c += 32) pv_tile<MR>(V, npairs, PP, ldpp, O, ldo, c, std::min<int64_t>(32, L - c), pf);
}

// O [M][ldo] (first L columns) += P x V over 2 npairs keys: near-equal groups of at most 12
// query rows (24 accumulators), each over the latent columns in 32-column chunks.
inline void pv_tiles(const BFloat16* const* V, int64_t npairs, const int32_t* PP, int64_t M, float* O, int64_t ldo,
                     int64_t L, BlockPrefetch& pf) {
  if (npairs <= 0) return;
  constexpr int64_t MR = 12;
  const int64_t groups = ceil_div(M, MR);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t r0 = M * g / groups, r1 = M * (g + 1) / groups;
    const int32_t* pp = PP + r0;
    float* o = O + r0 * ldo;
    switch (r1 - r0) {
      case 12: pv_rows_mr<12>(V, npairs, pp, M, o, ldo, L, pf); break;
      case 11: pv_rows_mr<11>(V, npairs, pp, M, o, ldo, L, pf); break;
      case 10: pv_rows_mr<10>(V, npairs, pp, M, o, ldo, L, pf); break;
      case 9: pv_rows_mr<9>(V, npairs, pp, M, o, ldo, L, pf); break;
      case 8: pv_rows_mr<8>(V, npairs, pp, M, o, ldo, L, pf); break;
      case 7: pv_rows_mr<7>(V, npairs, pp, M, o, ldo, L, pf); break;
      case 6: pv_rows_mr<6>(V, npairs, pp, M, o, ldo, L, pf); break;
      case 5: pv_rows_mr<5>(V, npairs, pp, M, o, ldo, L, pf); break;
      case 4: pv_rows_mr<4>(V, npairs, pp, M, o, ldo, L, pf); break;
      case 3: pv_rows_mr<3>(V, npairs, pp, M, o, ldo, L, pf); break;
      case 2: pv_rows_mr<2>(V, npairs, pp, M, o, ldo, L, pf); break;
      default: pv_rows_mr<1>(V, npairs, pp, M, o, ldo, L, pf); break;
    }
  }
}

// PP[jp][m] = (PT[2 jp][m], PT[2 jp + 1][m]) for jp < npairs: keys-major probabilities [n][M]
// (n >= 2 npairs rows) into the pairs pv_tiles broadcasts.
inline void pair_probs(const BFloat16* PT, int64_t M, int64_t npairs, int32_t* PP) {
  for (int64_t jp = 0; jp < npairs; ++jp) {
    const BFloat16* a = PT + 2 * jp * M;
    const BFloat16* b = a + M;
    int32_t* d = PP + jp * M;
    int64_t m = 0;
    for (; m + 32 <= M; m += 32) {
      const __m512i x = _mm512_loadu_si512(a + m), y = _mm512_loadu_si512(b + m);
      // unpack within 128-bit lanes, then restore the column order across lanes
      const __m512i lo = _mm512_unpacklo_epi16(x, y), hi = _mm512_unpackhi_epi16(x, y);
      const __m512i r0 = _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), hi);
      const __m512i r1 = _mm512_permutex2var_epi64(lo, _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15), hi);
      _mm512_storeu_si512(d + m, r0);
      _mm512_storeu_si512(d + m + 16, r1);
    }
    for (; m + 16 <= M; m += 16) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + m));
      const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + m));
      const __m256i lo = _mm256_unpacklo_epi16(x, y), hi = _mm256_unpackhi_epi16(x, y);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + m), _mm256_permute2x128_si256(lo, hi, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + m + 8), _mm256_permute2x128_si256(lo, hi, 0x31));
    }
    for (; m < M; ++m) {
      uint16_t u, v;
      std::memcpy(&u, a + m, 2);
      std::memcpy(&v, b + m, 2);
      d[m] = (int32_t)((uint32_t)u | ((uint32_t)v << 16));
    }
  }
}
#endif

}  // namespace openmla
