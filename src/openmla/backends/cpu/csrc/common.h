// Shared pieces of the native CPU kernels: per-thread scratch, the brgemm wrappers, the work
// queue and the mask's key intervals (operands.h: row conversion and packed operands;
// softmax.h: the online softmax).
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

#include "codes.h"  // the format and mask codes, generated from openmla.kernel_codes by build.py

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
enum Slot { S_QT, S_SCORES, S_SCORES_T, S_PROBS, S_VPACK, S_KPACK, S_KEYS, S_STAGE, S_ACC, S_ROWS, S_PTRS, NUM_SLOTS };

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
// Same kinds and rule as openmla.masks: each query sees one interval of key positions (the kinds,
// MaskKind, are in the generated codes.h).

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

}  // namespace openmla
