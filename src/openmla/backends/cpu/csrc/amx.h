// Own AMX micro-kernel for the skinny products of decode: C[M,N] (+)= A[M,K] x B, bf16 in,
// float32 out, A row-major, B in VNNI-2 layout ([K/2][ldb][2]), M and N multiples of 16, K of
// 32. Every tile is 16 rows x 64 bytes, so one tile configuration serves a whole decode unit
// (scores and P x V alike), and P x V can read V straight from the pages (amx_pv_direct).
//
// Compiled only where the build machine's compiler targets AMX (-march=native); used only where
// the CPU has AMX-BF16 and AMX-TILE, Linux grants the tile state, oneDNN is not capped below
// AMX (ONEDNN_MAX_CPU_ISA), and (test builds only) set_own_amx has not turned it off.
#pragma once

#include "common.h"

#include <string>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__) && defined(__x86_64__)
#define OPENMLA_OWN_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace openmla {

#if defined(OPENMLA_TEST_HOOKS)
// Test builds: a switch to compare against brgemm, and a count of the units the kernel ran.
inline std::atomic<bool>& own_amx_switch() {
  static std::atomic<bool> on{true};
  return on;
}

inline std::atomic<int64_t>& own_amx_units() {
  static std::atomic<int64_t> n{0};
  return n;
}
#endif

// Whether this process can run the micro-kernel (checked once).
inline bool own_amx_supported() {
#if defined(OPENMLA_OWN_AMX)
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 22) & 1u) || !((d >> 24) & 1u)) return false;  // AMX-BF16, AMX-TILE
    if (const char* isa = std::getenv("ONEDNN_MAX_CPU_ISA")) {  // follow a cap set for oneDNN
      std::string s(isa);
      for (auto& ch : s) ch = (char)std::toupper((unsigned char)ch);
      if (s.find("AMX") == std::string::npos && s != "ALL" && s != "DEFAULT") return false;
    }
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

inline bool own_amx_enabled() {
#if defined(OPENMLA_TEST_HOOKS)
  if (!own_amx_switch().load(std::memory_order_relaxed)) return false;
#endif
  return own_amx_supported();
}

#if defined(OPENMLA_OWN_AMX)

// Tiles 0-3 accumulate C; 4-7 hold A and B operands.
inline void amx_configure() {
  alignas(64) uint8_t cfg[64] = {};  // palette 1; colsb[i] at 16 + 2i; rows[i] at 48 + i
  cfg[0] = 1;
  for (int i = 0; i < 8; ++i) {
    cfg[16 + 2 * i] = 64;
    cfg[48 + i] = 16;
  }
  asm volatile("" : : "r"(cfg) : "memory");  // the stores above happen (ldtilecfg reads them)
  _tile_loadconfig(cfg);
}

// Hand the tiles back (and tell ATen's brgemm that its configuration is gone).
inline void amx_release() { at::native::cpublas::brgemm_release(true); }

// One block of MT x NT output tiles over the whole K. Strides in bytes; ``a``/``b``/``c`` point
// at the block's first A row, B column and C element. The tile instructions are asm without
// memory operands as far as the compiler knows: the caller fences around the whole product.
template <int MT, int NT>
inline void amx_block(int64_t K, const char* a, int64_t lda, const char* b, int64_t ldb, char* c, int64_t ldc, bool add) {
  static_assert((NT == 1 && MT <= 4) || (MT == 1 && NT <= 4) || (MT == 2 && NT == 2), "unsupported block");
  constexpr int NC = MT * NT;
  const int64_t a_row16 = 16 * lda;  // next A tile (16 rows down)
  const int64_t b_k32 = 16 * ldb;    // next 32 k values of B (16 VNNI rows)
  // c tile t at row tile t / NT, column tile t % NT
  auto c_at = [&](int t) { return c + (t / NT) * 16 * ldc + (t % NT) * 64; };
  if (add) {
    _tile_loadd(0, c_at(0), ldc);
    if constexpr (NC > 1) _tile_loadd(1, c_at(1), ldc);
    if constexpr (NC > 2) _tile_loadd(2, c_at(2), ldc);
    if constexpr (NC > 3) _tile_loadd(3, c_at(3), ldc);
  } else {
    _tile_zero(0);
    if constexpr (NC > 1) _tile_zero(1);
    if constexpr (NC > 2) _tile_zero(2);
    if constexpr (NC > 3) _tile_zero(3);
  }
  for (int64_t k = 0; k < K; k += 32, a += 64, b += b_k32) {
    if constexpr (NT == 1) {  // one B tile, A tiles rotate through 4-6
      _tile_loadd(7, b, ldb);
      _tile_loadd(4, a, lda);
      _tile_dpbf16ps(0, 4, 7);
      if constexpr (MT > 1) {
        _tile_loadd(5, a + a_row16, lda);
        _tile_dpbf16ps(1, 5, 7);
      }
      if constexpr (MT > 2) {
        _tile_loadd(6, a + 2 * a_row16, lda);
        _tile_dpbf16ps(2, 6, 7);
      }
      if constexpr (MT > 3) {
        _tile_loadd(4, a + 3 * a_row16, lda);
        _tile_dpbf16ps(3, 4, 7);
      }
    } else if constexpr (MT == 1) {  // one A tile, B tiles rotate through 4-6
      _tile_loadd(7, a, lda);
      _tile_loadd(4, b, ldb);
      _tile_dpbf16ps(0, 7, 4);
      if constexpr (NT > 1) {
        _tile_loadd(5, b + 64, ldb);
        _tile_dpbf16ps(1, 7, 5);
      }
      if constexpr (NT > 2) {
        _tile_loadd(6, b + 128, ldb);
        _tile_dpbf16ps(2, 7, 6);
      }
      if constexpr (NT > 3) {
        _tile_loadd(4, b + 192, ldb);
        _tile_dpbf16ps(3, 7, 4);
      }
    } else {  // 2 x 2
      _tile_loadd(4, a, lda);
      _tile_loadd(6, b, ldb);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, b + 64, ldb);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, a + a_row16, lda);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c_at(0), ldc);
  if constexpr (NC > 1) _tile_stored(1, c_at(1), ldc);
  if constexpr (NC > 2) _tile_stored(2, c_at(2), ldc);
  if constexpr (NC > 3) _tile_stored(3, c_at(3), ldc);
}

// C[M,N] (+)= A[M,K] x B with the tiles configured by amx_configure (same argument order and
// element strides as gemm()).
inline void amx_gemm(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add, const BFloat16* A,
                     const BFloat16* B, float* C) {
  const char* a = reinterpret_cast<const char*>(A);
  const char* b = reinterpret_cast<const char*>(B);
  char* c = reinterpret_cast<char*>(C);
  const int64_t la = 2 * lda, lb = 4 * ldb, lc = 4 * ldc;
  asm volatile("" ::: "memory");  // operands written before are in memory
  if (N == 16) {  // tall: up to 4 row tiles share one B tile (scores: keys x 16 query rows)
    for (int64_t m = 0; m < M; m += 64) {
      const char* am = a + m * la;
      char* cm = c + m * lc;
      switch (std::min<int64_t>(4, (M - m) / 16)) {
        case 4: amx_block<4, 1>(K, am, la, b, lb, cm, lc, add); break;
        case 3: amx_block<3, 1>(K, am, la, b, lb, cm, lc, add); break;
        case 2: amx_block<2, 1>(K, am, la, b, lb, cm, lc, add); break;
        default: amx_block<1, 1>(K, am, la, b, lb, cm, lc, add);
      }
    }
  } else if (M == 16) {  // wide: one A tile against up to 4 column tiles (P x V)
    for (int64_t n = 0; n < N; n += 64) {
      const char* bn = b + n * 4;
      char* cn = c + n * 4;
      switch (std::min<int64_t>(4, (N - n) / 16)) {
        case 4: amx_block<1, 4>(K, a, la, bn, lb, cn, lc, add); break;
        case 3: amx_block<1, 3>(K, a, la, bn, lb, cn, lc, add); break;
        case 2: amx_block<1, 2>(K, a, la, bn, lb, cn, lc, add); break;
        default: amx_block<1, 1>(K, a, la, bn, lb, cn, lc, add);
      }
    }
  } else {
    for (int64_t m = 0; m < M; m += 32) {
      for (int64_t n = 0; n < N; n += 32) {
        const char* am = a + m * la;
        const char* bn = b + n * 4;
        char* cmn = c + m * lc + n * 4;
        const bool two_m = M - m >= 32, two_n = N - n >= 32;
        if (two_m && two_n) amx_block<2, 2>(K, am, la, bn, lb, cmn, lc, add);
        else if (two_m) amx_block<2, 1>(K, am, la, bn, lb, cmn, lc, add);
        else if (two_n) amx_block<1, 2>(K, am, la, bn, lb, cmn, lc, add);
        else amx_block<1, 1>(K, am, la, bn, lb, cmn, lc, add);
      }
    }
  }
  asm volatile("" ::: "memory");  // results stored by the tiles are read after this
}

// P x V with V read as stored (no VNNI repack). A bf16 tile product pairs adjacent k values, so
// a tile loaded straight from 16 cache rows (16 keys x 32 columns) reads as 16 column pairs.
// P is given twice, zero-interleaved: pe[m][2j] = P[m][j] and po[m][2j + 1] = P[m][j], zeros
// elsewhere; against pe the tile gives the even columns of its 32, against po the odd ones.
// Twice the tile products of a packed V and none of the packing, which is the better trade
// when the products are short (few query rows).
//   O' [M][L] (+=): each 32-column chunk holds its 16 even columns, then its 16 odd ones
//                   (interleave_pairs restores the order); M a multiple of 16, L of 32
//   pe, po [M][ldp] (elements): key group g (16 keys) at columns [32 g, 32 g + 32)
//   v[g]: the first of key group g's 16 rows, rows ld_v elements apart
inline void amx_pv_direct(int64_t M, int64_t L, int64_t groups, const BFloat16* pe, const BFloat16* po, int64_t ldp,
                          const BFloat16* const* v, int64_t ld_v, float* O, int64_t ldo) {
  const int64_t lp = 2 * ldp, lv = 2 * ld_v, lo = 4 * ldo;
  asm volatile("" ::: "memory");
  for (int64_t m = 0; m < M; m += 16) {
    const char* ae = reinterpret_cast<const char*>(pe + m * ldp);
    const char* ao = reinterpret_cast<const char*>(po + m * ldp);
    for (int64_t c = 0; c < L; c += 64) {
      const bool two = c + 64 <= L;  // two 32-column chunks (four output tiles) per pass
      char* oc = reinterpret_cast<char*>(O + m * ldo + c);
      _tile_loadd(0, oc, lo);
      _tile_loadd(1, oc + 64, lo);
      if (two) {
        _tile_loadd(2, oc + 128, lo);
        _tile_loadd(3, oc + 192, lo);
      }
      for (int64_t g = 0; g < groups; ++g) {
        const char* vg = reinterpret_cast<const char*>(v[g] + c);
        _tile_loadd(4, ae + 64 * g, lp);
        _tile_loadd(5, ao + 64 * g, lp);
        _tile_loadd(6, vg, lv);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        if (two) {
          _tile_loadd(7, vg + 64, lv);
          _tile_dpbf16ps(2, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, oc, lo);
      _tile_stored(1, oc + 64, lo);
      if (two) {
        _tile_stored(2, oc + 128, lo);
        _tile_stored(3, oc + 192, lo);
      }
    }
  }
  asm volatile("" ::: "memory");
}

// pe and po (see amx_pv_direct) from P [M][ld] (n columns, a multiple of 16).
inline void zero_interleave(const BFloat16* P, int64_t ld, int64_t M, int64_t n, BFloat16* pe, BFloat16* po, int64_t ldp) {
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(P + m * ld);
    uint32_t* e = reinterpret_cast<uint32_t*>(pe + m * ldp);
    uint32_t* o = reinterpret_cast<uint32_t*>(po + m * ldp);
    for (int64_t j = 0; j < n; j += 16) {
      const __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j)));
      _mm512_storeu_si512(e + j, x);
      _mm512_storeu_si512(o + j, _mm512_slli_epi32(x, 16));
    }
  }
}

// O' as amx_pv_direct leaves it back to plain column order, in place.
inline void interleave_pairs(float* O, int64_t M, int64_t L, int64_t ldo) {
  alignas(64) static const int32_t lo_idx[16] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23};
  alignas(64) static const int32_t hi_idx[16] = {8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i vlo = _mm512_load_si512(lo_idx), vhi = _mm512_load_si512(hi_idx);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t c = 0; c < L; c += 32) {
      float* p = O + m * ldo + c;
      const __m512 e = _mm512_loadu_ps(p), o = _mm512_loadu_ps(p + 16);
      _mm512_storeu_ps(p, _mm512_permutex2var_ps(e, vlo, o));
      _mm512_storeu_ps(p + 16, _mm512_permutex2var_ps(e, vhi, o));
    }
  }
}

#endif  // OPENMLA_OWN_AMX

}  // namespace openmla
