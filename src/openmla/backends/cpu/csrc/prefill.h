// Prefill (up-projected, MHA) attention over one chunk of keys, flash style on brgemm.
//
// Inputs are one chunk's up-projected keys (k_nope [S, H*Dn], v [S, H*Dv]) and their shared rope
// rows [S, R], with, per sequence, the buffer rows and key positions of its keys. A unit is one
// sequence, one head and a range of its queries: it packs that head's K^T and V for the keys
// the queries can see (VNNI for bf16), then walks query blocks of PREFILL_BLOCK_M rows against
// key blocks of PREFILL_BLOCK_N keys with the online softmax of common.h. Several chunks of
// one call merge through a float32 running state (``first`` / ``last``).
#pragma once

#include <algorithm>
#include <vector>

#include "operands.h"
#include "softmax.h"

namespace openmla {

// Tuning, measured on a 2-core AMX Xeon (bench/RESULTS.md).
constexpr int64_t PREFILL_BLOCK_M = 64;   // query rows per block
constexpr int64_t PREFILL_BLOCK_N = 256;  // keys per block

struct PrefillArgs {
  const void* q = nullptr;  // [T, H, Dq] compute type, contiguous (Dq = Dn + R)
  int64_t T = 0, H = 0, Dq = 0;
  const void* k = nullptr;  // nope keys: row s, head h at k + s * k_ld + h * Dn
  int64_t k_ld = 0;
  const void* v = nullptr;  // values: row s, head h at v + s * v_ld + h * Dv
  int64_t v_ld = 0;
  const void* rope = nullptr;  // shared rope keys: row s at rope + s * rope_ld
  int64_t rope_ld = 0;
  int64_t Dn = 0, Dv = 0, R = 0;
  const int32_t* offsets = nullptr;     // [B + 1] query rows per sequence
  const int32_t* cache_lens = nullptr;  // [B]: query i of sequence b sits at cache_lens[b] + i
  const int64_t* k_row0 = nullptr;      // [B] first buffer row of sequence b's keys
  const int64_t* k_pos0 = nullptr;      // [B] position of that row
  const int64_t* k_count = nullptr;     // [B] keys of sequence b in this chunk
  int64_t B = 0;
  Mask mask;
  float scale = 1.f;
  float* state_o = nullptr;  // [T * H, Dv] running state across chunks (unused when first && last)
  float* state_ref = nullptr;
  float* state_sum = nullptr;
  bool first = true, last = true;
  const float* sink = nullptr;  // [H] (sink_stride 0) or [B, H] (sink_stride H)
  int64_t sink_stride = 0;
  void* out = nullptr;  // [T, H, Dv] compute type (when last)
  float* lse = nullptr;  // [T, H] (when last)
};

struct PrefillUnit {
  int32_t b, h;
  int64_t i0, i1;  // query indices within the sequence
  int64_t cost;
};

// A NaN / inf value of a packed V block. It leaves the block (a query that does not see its key
// would multiply it by a zero probability, and 0 x NaN would leak NaN into that query's row) and
// comes back as p x value for the queries that see it: 0 x inf = NaN for a -inf score, +-inf for a
// finite one, as the reference's P x V. One pass over the block, next to the GEMMs that read it;
// nothing is kept unless a value is non-finite.
struct OddValue {
  int64_t block, row, col;
  float value;
};

template <typename T>
inline void take_nonfinite(T* v, int64_t n, int64_t Dv, int64_t block, std::vector<OddValue>& odd) {
  using Bits = std::conditional_t<std::is_same_v<T, float>, uint32_t, uint16_t>;
  constexpr Bits EXP = std::is_same_v<T, float> ? 0x7F800000u : std::is_same_v<T, Half> ? 0x7C00 : 0x7F80;  // inf or NaN
  Bits* bits = reinterpret_cast<Bits*>(v);
  bool any = false;
  for (int64_t i = 0; i < n; ++i) any |= (bits[i] & EXP) == EXP;  // a vectorised look first: usually none
  if (!any) return;
  for (int64_t i = 0; i < n; ++i)
    if ((bits[i] & EXP) == EXP) {
      // float: [row][col]; 16-bit types: VNNI-2 pairs of rows (operands.h), [row / 2][col][row % 2]
      const int64_t row = std::is_same_v<T, float> ? i / Dv : 2 * (i / (2 * Dv)) + i % 2;
      const int64_t col = std::is_same_v<T, float> ? i % Dv : (i % (2 * Dv)) / 2;
      odd.push_back({block, row, col, static_cast<float>(v[i])});
      bits[i] = 0;
    }
}

// O += p x value for the rows of a block (m rows, probabilities P with stride ldp) that see each
// of the block's odd values (row r sees the block's columns [c0[r], c1[r])).
template <typename T>
inline void add_odd_values(const OddValue* first, const OddValue* last, int64_t m, const int32_t* c0, const int32_t* c1,
                           const T* P, int64_t ldp, float* O, int64_t ldo) {
  for (const OddValue* e = first; e != last; ++e)
    for (int64_t r = 0; r < m; ++r)
      if (c0[r] <= e->row && e->row < c1[r]) O[r * ldo + e->col] += static_cast<float>(P[r * ldp + e->row]) * e->value;
}

template <typename T>
struct PrefillKernel {
  const PrefillArgs& a;

  int64_t kv_len(int64_t b) const { return a.cache_lens[b] + (a.offsets[b + 1] - a.offsets[b]); }

  // Visible keys of query position p within this chunk's keys of sequence b.
  std::pair<int64_t, int64_t> keys_of(int64_t b, int64_t p_lo, int64_t p_hi) const {
    auto [lo, hi] = a.mask.key_range(p_lo, p_hi, kv_len(b));
    lo = std::max(lo, a.k_pos0[b]);
    hi = std::min(hi, a.k_pos0[b] + a.k_count[b]);
    return {lo, std::max(lo, hi)};
  }

  void run(const PrefillUnit& u) const {
    constexpr int64_t BM = PREFILL_BLOCK_M, BN = PREFILL_BLOCK_N;
    const int64_t b = u.b, h = u.h, H = a.H, Dq = a.Dq, Dn = a.Dn, Dv = a.Dv;
    const int64_t c = a.cache_lens[b], q_row0 = a.offsets[b];
    auto [klo, khi] = keys_of(b, c + u.i0, c + u.i1 - 1);
    const int64_t nk = khi - klo, nblk = ceil_div(nk, BN);

    // This head's K^T ([Dq][BN] per block) and V ([BN][Dv] per block), packed for B.
    T* Kp = scratch<T>(S_KPACK, std::max<int64_t>(1, nblk) * Dq * BN);
    T* Vp = scratch<T>(S_VPACK, std::max<int64_t>(1, nblk) * BN * Dv);
    const T** vrows = scratch<const T*>(S_PTRS, BN);
    std::vector<OddValue> odd;  // in block order
    const T* k = static_cast<const T*>(a.k);
    const T* v = static_cast<const T*>(a.v);
    const T* rope = static_cast<const T*>(a.rope);
    for (int64_t j = 0; j < nblk; ++j) {
      const int64_t n = std::min(BN, nk - j * BN);
      const int64_t row = a.k_row0[b] + (klo - a.k_pos0[b]) + j * BN;
      T* kb = Kp + j * Dq * BN;
      pack_b_transposed<T>(k + row * a.k_ld + h * Dn, a.k_ld, n, Dn, kb, BN, 0);
      pack_b_transposed<T>(rope + row * a.rope_ld, a.rope_ld, n, a.R, kb + Dn * BN, BN, 0);
      zero_b_columns<T>(kb, Dq, BN, n, BN);
      for (int64_t r = 0; r < n; ++r) vrows[r] = v + (row + r) * a.v_ld + h * Dv;
      pack_b_rows<T>(vrows, n, BN, Dv, Vp + j * BN * Dv);
      take_nonfinite(Vp + j * BN * Dv, BN * Dv, Dv, j, odd);
    }

    float* S = scratch<float>(S_SCORES, BM * BN);
    T* P = std::is_same_v<T, float> ? reinterpret_cast<T*>(S) : scratch<T>(S_PROBS, BM * BN);
    float* O = scratch<float>(S_ACC, BM * Dv);
    float* rowf = scratch<float>(S_ROWS, 2 * BM);
    float *ref = rowf, *sum = rowf + BM;
    int32_t* cols = scratch<int32_t>(S_QT, 4 * BM);
    int32_t *rlo = cols, *rhi = cols + BM, *c0 = cols + 2 * BM, *c1 = cols + 3 * BM;
    const T* q = static_cast<const T*>(a.q);

    for (int64_t qa = u.i0; qa < u.i1; qa += BM) {
      const int64_t m = std::min(BM, u.i1 - qa);
      std::fill(ref, ref + m, NEG_INF);
      std::fill(sum, sum + m, 0.f);
      int64_t ulo = khi, uhi = klo;
      for (int64_t r = 0; r < m; ++r) {
        auto [lo, hi] = keys_of(b, c + qa + r, c + qa + r);
        rlo[r] = (int32_t)(lo - klo);
        rhi[r] = (int32_t)(hi - klo);
        if (lo < hi) {
          ulo = std::min(ulo, lo);
          uhi = std::max(uhi, hi);
        }
      }
      const T* A = q + ((q_row0 + qa) * H + h) * Dq;
      for (int64_t j = (ulo - klo) / BN; ulo < uhi && j * BN < uhi - klo; ++j) {
        // columns up to the last one any row sees (the causal diagonal ends a block early)
        const int64_t n = std::min(BN, round_up(uhi - klo - j * BN, 2 * VL));
        gemm(m, n, Dq, H * Dq, BN, BN, false, A, Kp + j * Dq * BN, S);
        for (int64_t r = 0; r < m; ++r) {
          c0[r] = (int32_t)std::clamp<int64_t>(rlo[r] - j * BN, 0, n);
          c1[r] = (int32_t)std::clamp<int64_t>(rhi[r] - j * BN, c0[r], n);
        }
        softmax_block<T>(S, BN, m, n, c0, c1, a.scale, ref, sum, O, Dv, Dv, P, BN);
        gemm(m, Dv, n, BN, Dv, Dv, true, P, Vp + j * BN * Dv, O);
        if (!odd.empty()) {
          auto by_block = [](const OddValue& e, int64_t blk) { return e.block < blk; };
          const auto o0 = std::lower_bound(odd.begin(), odd.end(), j, by_block);
          const auto o1 = std::lower_bound(o0, odd.end(), j + 1, by_block);
          add_odd_values<T>(odd.data() + (o0 - odd.begin()), odd.data() + (o1 - odd.begin()), m, c0, c1, P, BN, O, Dv);
        }
      }
      for (int64_t r = 0; r < m; ++r) finish(b, (q_row0 + qa + r) * H + h, O + r * Dv, ref[r], sum[r]);
    }
  }

  // Leave row ``row`` (= token * H + head) in the running state, merged, or finished.
  void finish(int64_t b, int64_t row, const float* O, float ref, float sum) const {
    const int64_t Dv = a.Dv, h = row % a.H;
    const float sink = a.sink ? a.sink[b * a.sink_stride + h] : std::numeric_limits<float>::quiet_NaN();
    T* out = static_cast<T*>(a.out) + row * Dv;
    if (a.first && a.last) {
      finish_row(O, Dv, ref, sum, sink, out, a.lse + row);
      return;
    }
    float* so = a.state_o + row * Dv;
    float &sref = a.state_ref[row], &ssum = a.state_sum[row];
    // A non-finite sum (softmax.h's NaN rule: a NaN or +inf score) makes the running sum NaN for
    // good: finish_row then writes a NaN row and LSE.
    if (a.first) {
      if (sum > 0.f) std::memcpy(so, O, Dv * sizeof(float));
      else zero_fill(so, Dv * sizeof(float));
      sref = sum > 0.f ? ref : NEG_INF;
      ssum = std::isfinite(sum) ? sum : NAN_F;
    } else if (std::isnan(ssum)) {
    } else if (!std::isfinite(sum)) {
      ssum = NAN_F;
    } else if (sum > 0.f) {
      if (!(ssum > 0.f)) {
        std::memcpy(so, O, Dv * sizeof(float));
        sref = ref;
        ssum = sum;
      } else {
        const float mx = std::max(sref, ref), fs = std::exp(sref - mx), fc = std::exp(ref - mx);
        at::vec::map2([fs, fc](fVec x, fVec y) { return x * fVec(fs) + y * fVec(fc); }, so, so, O, Dv);
        ssum = ssum * fs + sum * fc;
        sref = mx;
      }
    }
    if (a.last) finish_row(so, Dv, sref, ssum, sink, out, a.lse + row);
  }
};

template <typename T>
void run_prefill(const PrefillArgs& a) {
  std::vector<PrefillUnit> units;
  int64_t active = 0;
  for (int64_t b = 0; b < a.B; ++b) active += a.offsets[b + 1] > a.offsets[b];
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t want = 4 * threads;  // units to spread: enough for the queue to balance
  const int64_t splits = active * a.H >= want ? 1 : ceil_div(want, std::max<int64_t>(1, active * a.H));
  PrefillKernel<T> k{a};
  for (int64_t b = 0; b < a.B; ++b) {
    const int64_t n = a.offsets[b + 1] - a.offsets[b];
    if (n <= 0) continue;
    const int64_t parts = std::clamp<int64_t>(splits, 1, ceil_div(n, PREFILL_BLOCK_M));
    for (int64_t s = 0; s < parts; ++s) {
      // cuts on block edges, so that only the last unit has a partial query block
      const int64_t i0 = ceil_div(n * s / parts, PREFILL_BLOCK_M) * PREFILL_BLOCK_M;
      const int64_t i1 = s + 1 == parts ? n : ceil_div(n * (s + 1) / parts, PREFILL_BLOCK_M) * PREFILL_BLOCK_M;
      if (i0 >= i1) continue;
      const int64_t c = a.cache_lens[b];
      auto [lo0, hi0] = k.keys_of(b, c + i0, c + i0);
      auto [lo1, hi1] = k.keys_of(b, c + i1 - 1, c + i1 - 1);
      const int64_t cost = (i1 - i0) * ((hi0 - lo0) + (hi1 - lo1) + 2 * PREFILL_BLOCK_N) / 2;
      for (int64_t h = 0; h < a.H; ++h) units.push_back({(int32_t)b, (int32_t)h, i0, i1, cost});
    }
  }
  std::stable_sort(units.begin(), units.end(), [](const PrefillUnit& x, const PrefillUnit& y) { return x.cost > y.cost; });
  double work_s = 0;
  for (const PrefillUnit& u : units) work_s += (double)u.cost * 2.0 * (a.Dq + a.Dv) / EST_FLOPS_PER_S;
  run_units((int64_t)units.size(), work_s, std::is_same_v<T, BFloat16>, [&](int64_t i) { k.run(units[i]); });
}

}  // namespace openmla
