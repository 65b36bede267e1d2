// The online softmax every attention kernel uses (query-major for prefill, keys-major for
// decode), the transposes it needs, and how finished rows and partial results are written.
#pragma once

#include "operands.h"

namespace openmla {

// Online softmax -------------------------------------------------------------------------
// Lazy rescaling: a row's reference only moves when a block's max exceeds it by this margin
// (e^8 ~ 3e3 stays exact in float32 sums and relative in bf16), so the accumulator is
// rescaled rarely and the P x V product adds straight into it.
constexpr float RESCALE_MARGIN = 8.f;

// The NaN rule (docs/api.md): a visible score that is NaN or +inf (a NaN or infinite value in q
// or in a key the row sees) makes the row's output and LSE NaN, as the float64 reference's
// max-then-exp does. The maxima below propagate NaN, a row whose block max is NaN or +inf gets a
// NaN ``sum`` (kept through every later block: sums only add and scale), and ``finish_row`` /
// ``merge_parts`` turn a non-finite sum or a NaN part LSE into a NaN row.
constexpr float POS_INF = std::numeric_limits<float>::infinity();
constexpr float NAN_F = std::numeric_limits<float>::quiet_NaN();

// Lane-wise max that propagates NaN from either operand (at::vec::maximum: max, unordered
// compare, or).
inline fVec fast_max(const fVec& a, const fVec& b) { return at::vec::maximum(a, b); }

inline float reduce_max(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return fast_max(x, y); }, v);
}

// Scalar max / min that keep a NaN of either side (std::max / std::min drop a NaN second argument).
inline float nan_max(float a, float b) { return std::isnan(b) ? b : std::max(a, b); }
inline float nan_min(float a, float b) { return std::isnan(b) ? b : std::min(a, b); }

// Whether a block max poisons its row: NaN or +inf (exp(s - max) would be NaN for that score).
inline bool poisons(float mx) { return !(mx < POS_INF); }

inline float reduce_sum(const fVec& v) {
  return at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, v);
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
    for (; j < b; ++j) ext = pos ? nan_max(ext, s[j]) : nan_min(ext, s[j]);
    const float mx = ext * scale;
    if (poisons(mx)) {  // a NaN or +inf score: the row is NaN (the NaN rule above)
      sum[m] = NAN_F;
      zero_fill(p, n_pad * sizeof(T));
      continue;
    }
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
// visible), through the keys-major scratch PT [n_pad][M] (P null: PT only, for the register tiles).
//
// ``unseen`` (null, or ceil(n_pad / 64) words): bit j set where block row j has a non-finite raw
// score in a column that does not see it (a NaN or infinite key of this step that an earlier query
// row does not see; in MLA its values are part of the key, so its scores are non-finite for every
// column): the caller keeps such rows out of P x V (0 x NaN) and adds them for the columns that see
// them. Only rows that not every column of a chunk sees are checked (none in the common case).
// Returns whether any bit is set.
template <typename T>
bool softmax_keys_major(const float* S, int64_t M, int64_t rows, int64_t n_pad, const int32_t* lo, const int32_t* hi,
                        float scale, float* ref, float* sum, float* O, int64_t ldo, int64_t Dv, T* PT, T* P,
                        uint64_t* unseen = nullptr) {
  using iVec = at::vec::Vectorized<int32_t>;
  const fVec vscale(scale), vneg(NEG_INF), vzero(0.f), vinf(POS_INF);
  alignas(64) float bm[VL];
  bool any_unseen = false;
  int64_t ulo = n_pad, uhi = 0;  // rows some column sees
  if (unseen) {
    std::fill(unseen, unseen + ceil_div(n_pad, (int64_t)64), uint64_t(0));
    for (int64_t m = 0; m < M; ++m) {
      if (lo[m] < hi[m]) {
        ulo = std::min<int64_t>(ulo, lo[m]);
        uhi = std::max<int64_t>(uhi, hi[m]);
      }
    }
  }
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
    for (int64_t j = ulo; j < uhi; ++j) {  // rows seen by some column, not by all of this chunk's
      if (j >= alo && j < ahi) {
        j = ahi - 1;
        continue;
      }
      const fVec x = fVec::loadu(S + j * M + c, w);
      if (((x.abs() < vinf) | visible(j)).zero_mask()) {  // a lane not seeing row j with a non-finite score
        unseen[j >> 6] |= uint64_t(1) << (j & 63);
        any_unseen = true;
      }
    }
    fVec vmax = vneg;
    for (int64_t j = glo; j < ghi; ++j) {
      const fVec x = fVec::loadu(S + j * M + c, w) * vscale;
      vmax = (j >= alo && j < ahi) ? fast_max(vmax, x) : fVec::blendv(vmax, fast_max(vmax, x), visible(j));
    }
    vmax.store(bm);
    for (int64_t m = c; m < c + w; ++m) {
      if (lo[m] >= hi[m]) continue;
      if (poisons(bm[m - c])) {
        sum[m] = NAN_F;  // the row is NaN (the NaN rule above); its probabilities below are never read
      } else {
        raise_reference(bm[m - c], ref[m], sum[m], O + m * ldo, Dv);
      }
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
  if (P) transpose<T>(PT, M, P, n_pad, n_pad, M);
  return any_unseen;
}

// Finished row: out = O / sum * out_scale (zeros when nothing was seen), lse = ref + log(sum)
// (-inf then), and with a sink logit (not NaN) out *= 1 / (1 + e^(sink - lse)); the LSE leaves
// it out. A non-finite sum (the NaN rule above) gives a NaN row and a NaN LSE.
template <typename OutT>
void finish_row(const float* O, int64_t Dv, float ref, float sum, float sink, OutT* out, float* lse, float out_scale = 1.f) {
  if (!std::isfinite(sum)) {
    std::fill(out, out + Dv, static_cast<OutT>(NAN_F));
    *lse = NAN_F;
    return;
  }
  if (!(sum > 0.f)) {
    zero_fill(out, Dv * sizeof(OutT));
    *lse = NEG_INF;
    return;
  }
  const float l = ref + std::log(sum);
  float f = out_scale / sum;
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
// w_p = e^(lse_p - max), lse = max + log(sum_p w_p); all-empty rows give zeros and -inf, a NaN
// part (the NaN rule above) a NaN sum.
// Leaves the merged row in ``acc`` (unnormalised: returns (ref, sum) with acc = o * sum).
inline std::pair<float, float> merge_parts(const float* const* o, const float* lse, int64_t parts, int64_t Dv, float* acc) {
  float mx = NEG_INF;
  for (int64_t p = 0; p < parts; ++p) mx = nan_max(mx, lse[p]);
  zero_fill(acc, Dv * sizeof(float));
  if (std::isnan(mx)) return {NAN_F, NAN_F};
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
