// The per-token cache write in one pass: RMSNorm of the latent, RoPE of the key rope part, the
// store at the token's physical row (quantised for the fp8 and NVFP4 formats), and q's rope rotation.
//
// The entry is computed in float64 (as the float64 reference) and rounded once to the cache
// type; fp8_e4m3 stores round(float32(entry) / kv_scale), fp8_ds_mla quantises each group of
// 128 latent values by its amax / 448 and keeps the rope part in bfloat16 (openmla.fp8), a NaN
// stored as the e4m3 NaN byte, byte for byte as the torch writer (docs/fp8.md); the
// NVFP4 records quantise the float32 entry as openmla.nvfp4 does (store_nvfp4).
// q's rope part is rotated in float32.
//
// The rows write (write_rows_op) stores given entries (already normed and roped: vLLM's) at given
// physical rows of one layer, through the same quantisers (store_float).
#pragma once

#include "operands.h"

namespace openmla {

constexpr float FP8_MAX = 448.f;
static_assert(DS_GROUP % VL == 0, "an fp8_ds_mla group is whole vectors");

struct WriteArgs {
  const void* q = nullptr;  // [T, H, Dq], rows contiguous
  at::ScalarType q_type = at::kFloat;
  int64_t T = 0, H = 0, Dq = 0;
  const void* kv = nullptr;  // [T, L + R], row stride kv_ld
  at::ScalarType kv_type = at::kFloat;
  int64_t kv_ld = 0;
  const void* freqs = nullptr;  // [max_pos, R] interleaved (cos, sin), row stride freqs_ld
  bool freqs_f64 = false;
  int64_t freqs_ld = 0;
  const float* gamma = nullptr;  // [L]
  PagedCache cache;              // written through base
  const int32_t* cache_lens = nullptr;
  const int32_t* offsets = nullptr;
  int64_t B = 0;
  double eps = 1e-6;
  bool interleaved = true;
  void* q_out = nullptr;  // [T, H, Dq] in q_type
};

template <typename S>
inline void load_float(const void* src, int64_t i, float* dst, int64_t n) {
  convert_row(static_cast<const S*>(src) + i, dst, n);
}

inline void load_any(at::ScalarType t, const void* src, int64_t i, float* dst, int64_t n) {
  switch (t) {
    case at::kBFloat16: load_float<BFloat16>(src, i, dst, n); break;
    case at::kHalf: load_float<Half>(src, i, dst, n); break;
    default: load_float<float>(src, i, dst, n);
  }
}

inline void store_any(at::ScalarType t, void* dst, int64_t i, const float* src, int64_t n) {
  switch (t) {
    case at::kBFloat16: convert_row(src, static_cast<BFloat16*>(dst) + i, n); break;
    case at::kHalf: convert_row(src, static_cast<Half*>(dst) + i, n); break;
    default: std::memcpy(static_cast<float*>(dst) + i, src, n * sizeof(float));
  }
}

// float -> e4m3 byte as openmla.fp8.quantize_e4m3 (torch's clamp, then its conversion): nearest
// even, saturating at +-448, NaN kept as the NaN byte (0x7F / 0xFF). std::min/max would turn a
// NaN into -448 (their comparisons are false for NaN), so NaN goes straight to the conversion.
inline uint8_t fp8_bits(float x) {
  if (std::isnan(x)) return c10::Float8_e4m3fn(x).x;
  return c10::Float8_e4m3fn(std::min(FP8_MAX, std::max(-FP8_MAX, x))).x;
}

// fp8_bits(x[j] / s) for j < n: the division and the clamp vectorised (a NaN passed through as it
// is, sign included, as fp8_bits does), then the conversion in a loop of its own, which the compiler
// vectorises (one fused loop with the NaN branch does not). ``buf``: n floats.
inline void fp8_row(const float* x, float s, uint8_t* dst, int64_t n, float* buf) {
  const fVec vs(s), lo(-FP8_MAX), hi(FP8_MAX);
  int64_t j = 0;
  for (; j + VL <= n; j += VL) {
    const fVec y = fVec::loadu(x + j) / vs;
    fVec::blendv(at::vec::minimum(at::vec::maximum(y, lo), hi), y, y.isnan()).store(buf + j);  // a NaN keeps its sign
  }
  for (; j < n; ++j) {
    const float y = x[j] / s;
    buf[j] = std::isnan(y) ? y : std::min(FP8_MAX, std::max(-FP8_MAX, y));
  }
  for (j = 0; j < n; ++j) dst[j] = c10::Float8_e4m3fn(buf[j]).x;
}

// float -> e2m1 code: nearest, ties to the even code, saturating at +-6, the sign bit kept (-0.1
// -> 8); NaN -> 0 or 8 (openmla.nvfp4.e2m1_encode: its midpoint comparisons, one per code step).
inline uint8_t e2m1_code(float x) {
  const float v = std::fabs(x);
  const int c = (v > 0.25f) + (v >= 0.75f) + (v > 1.25f) + (v >= 1.75f) + (v > 2.5f) + (v >= 3.5f) + (v > 5.f);
  return (uint8_t)(c | (std::signbit(x) ? 8 : 0));
}

struct CacheWriter {
  const WriteArgs& a;

  // An NVFP4 record from the float32 entry x [576] (openmla.nvfp4's recipes, in float32 as it
  // computes them): per group of 16 the e4m3 scale (nvfp4_ds_mla: e4m3(amax * fp32(1/6));
  // nvfp4_fp8rope: e4m3(max(amax / 6, 2^-9)), bumped up one step when it lands below), then
  // e2m1(x * fp32(1 / scale)) (0 times x for a zero or NaN scale); a group with a NaN gets the
  // NaN scale. The rope part in bf16 (nvfp4_ds_mla) or e4m3 (nvfp4_fp8rope).
  void store_nvfp4(uint8_t* dst, const float* x) const {
    const bool ds = a.cache.fmt == FMT_NVFP4_DS;
    const float* tab = e4m3_table();
    for (int64_t g = 0; g < NV_GROUPS; ++g) {
      const float* v = x + NV_GROUP * g;
      float amax = 0.f;
      bool nan = false;
      for (int64_t i = 0; i < NV_GROUP; ++i) {
        nan |= std::isnan(v[i]);
        amax = std::max(amax, std::fabs(v[i]));
      }
      uint8_t sb;
      if (nan) {
        sb = 0x7F;
      } else if (ds) {
        sb = fp8_bits(amax * (1.f / 6.f));
      } else {
        const float target = std::max(amax / 6.f, tab[0x01]);  // the floor: e4m3's smallest value, 2^-9
        sb = fp8_bits(target);
        if (tab[sb] < target && sb < 0x7E) ++sb;  // positive e4m3 bytes are ordered as their values
      }
      const float dec = tab[sb];
      const float inv = dec > 0.f ? 1.f / dec : 0.f;
      for (int64_t i = 0; i < NV_GROUP / 2; ++i)
        dst[8 * g + i] = (uint8_t)(e2m1_code(v[2 * i] * inv) | (e2m1_code(v[2 * i + 1] * inv) << 4));
      dst[nv_scale_at(a.cache.fmt, g)] = sb;
    }
    if (ds) {
      std::memset(dst + NV_DS_SCALES + NV_GROUPS, 0, NV_DS_ROPE - NV_DS_SCALES - NV_GROUPS);
      convert_row(x + NV_LATENT, reinterpret_cast<BFloat16*>(dst + NV_DS_ROPE), NV_ROPE);
    } else {
      for (int64_t j = 0; j < NV_ROPE; ++j) dst[NV_FR_ROPE + j] = fp8_bits(x[NV_LATENT + j]);
    }
  }

  // (cos, sin) of rope pair i at position p.
  std::pair<double, double> cos_sin(int64_t p, int64_t i) const {
    if (a.freqs_f64) {
      const double* f = static_cast<const double*>(a.freqs) + p * a.freqs_ld;
      return {f[2 * i], f[2 * i + 1]};
    }
    const float* f = static_cast<const float*>(a.freqs) + p * a.freqs_ld;
    return {f[2 * i], f[2 * i + 1]};
  }

  int64_t pair_a(int64_t i, int64_t R) const { return a.interleaved ? 2 * i : i; }
  int64_t pair_b(int64_t i, int64_t R) const { return a.interleaved ? 2 * i + 1 : i + R / 2; }

  void token(int64_t t, int64_t b, int64_t p, float* buf) const {
    const int64_t L = a.cache.L, R = a.cache.R, W = L + R;
    float* x = buf;      // [W] the input row
    double* e = reinterpret_cast<double*>(buf + round_up(W, 16));  // [W] the entry
    load_any(a.kv_type, a.kv, t * a.kv_ld, x, W);
    double ss = 0.0;
    for (int64_t j = 0; j < L; ++j) ss += (double)x[j] * x[j];
    const double inv = 1.0 / std::sqrt(ss / (double)L + a.eps);
    for (int64_t j = 0; j < L; ++j) e[j] = (double)x[j] * inv * (double)a.gamma[j];
    for (int64_t i = 0; i < R / 2; ++i) {
      auto [cs, sn] = cos_sin(p, i);
      const double xa = x[L + pair_a(i, R)], xb = x[L + pair_b(i, R)];
      e[L + pair_a(i, R)] = xa * cs - xb * sn;
      e[L + pair_b(i, R)] = xa * sn + xb * cs;
    }
    store(const_cast<uint8_t*>(a.cache.logical(b, p)), e, buf + round_up(W, 16) * 3, x);  // x is read: its room is free

    // q: nope part copied, rope part rotated in float32.
    const int64_t Dq = a.Dq, Dn = Dq - R;
    float* qrow = buf + round_up(W, 16) * 3 + round_up(W, 16);
    for (int64_t h = 0; h < a.H; ++h) {
      const int64_t off = (t * a.H + h) * Dq;
      load_any(a.q_type, a.q, off, qrow, Dq);
      for (int64_t i = 0; i < R / 2; ++i) {
        auto [cs, sn] = cos_sin(p, i);
        const float c = (float)cs, s = (float)sn;
        const float xa = qrow[Dn + pair_a(i, R)], xb = qrow[Dn + pair_b(i, R)];
        qrow[Dn + pair_a(i, R)] = xa * c - xb * s;
        qrow[Dn + pair_b(i, R)] = xa * s + xb * c;
      }
      store_any(a.q_type, a.q_out, off, qrow, Dq);
    }
  }

  // Round the float64 entry e [L+R] into the stored row ``dst`` (tmp, buf: L+R floats each).
  void store(uint8_t* dst, const double* e, float* tmp, float* buf) const {
    const int64_t W = a.cache.L + a.cache.R;
    for (int64_t j = 0; j < W; ++j) tmp[j] = (float)e[j];
    store_float(dst, tmp, buf);
  }

  // The float32 entry tmp [L+R] as the stored row ``dst`` (quantised as the format says; buf: L+R
  // floats of scratch).
  void store_float(uint8_t* dst, const float* tmp, float* buf) const {
    const int64_t L = a.cache.L, R = a.cache.R, W = L + R;
    switch (a.cache.fmt) {
      case FMT_BF16: convert_row(tmp, reinterpret_cast<BFloat16*>(dst), W); break;
      case FMT_F16: convert_row(tmp, reinterpret_cast<Half*>(dst), W); break;
      case FMT_F32: std::memcpy(dst, tmp, W * sizeof(float)); break;
      case FMT_E4M3:
        fp8_row(tmp, a.cache.kv_scale, dst, W, buf);
        break;
      case FMT_NVFP4_DS:
      case FMT_NVFP4_FP8ROPE: store_nvfp4(dst, tmp); break;
      default: {  // fp8_ds_mla
        for (int64_t g = 0; g < L / DS_GROUP; ++g) {
          // openmla.fp8.pack_ds_mla's scale: amax / 448, or 1 for an all-zero group and (its NaN
          // amax failing ``amax > 0``) for a group holding a NaN, whose NaN values stay NaN.
          // The group's |x| max in vectors (at::vec::maximum propagates a NaN), then across lanes.
          fVec vmax(0.f);
          for (int64_t j = g * DS_GROUP; j < (g + 1) * DS_GROUP; j += VL) vmax = at::vec::maximum(vmax, fVec::loadu(tmp + j).abs());
          alignas(64) float lanes[VL];
          vmax.store(lanes);
          float amax = 0.f;
          bool nan = false;
          for (int64_t i = 0; i < VL; ++i) {
            nan |= std::isnan(lanes[i]);
            amax = std::max(amax, lanes[i]);
          }
          const float scale = amax > 0.f && !nan ? amax / FP8_MAX : 1.f;
          fp8_row(tmp + g * DS_GROUP, scale, dst + g * DS_GROUP, DS_GROUP, buf);
          std::memcpy(dst + L + 4 * g, &scale, 4);
        }
        convert_row(tmp + L, reinterpret_cast<BFloat16*>(dst + L + 4 * (L / DS_GROUP)), R);
      }
    }
  }
};

inline void run_cache_write(const WriteArgs& a) {
  std::vector<int32_t> seq(a.T);
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t t = a.offsets[b]; t < a.offsets[b + 1]; ++t) seq[t] = (int32_t)b;
  CacheWriter w{a};
  const int64_t W = a.cache.L + a.cache.R;
  at::parallel_for(0, a.T, 16, [&](int64_t t0, int64_t t1) {
    float* buf = scratch<float>(S_KEYS, round_up(W, 16) * 4 + a.Dq);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = seq[t];
      w.token(t, b, a.cache_lens[b] + (t - a.offsets[b]), buf);
    }
  });
}

// The rows write: entries [n, L+R] (bfloat16, float16 or float32, unit last stride) stored at physical rows
// rows[i] (int64 [n]) of one layer's pages [P, S, W] in format fmt; a negative row is skipped (a
// padding token). An entry already in a native cache's dtype is copied as its bytes (as torch's
// index_copy_, NaN payloads kept); any other is read as float32 and stored by store_float, a bf16
// rope part of bf16 entries copied as its bytes (torch's cast to bf16 is then a no-op).
inline void write_rows_op(const at::Tensor& entries, const at::Tensor& pages, const at::Tensor& rows, int64_t fmt,
                          double kv_scale, int64_t kv_lora_rank) {
  TORCH_CHECK(entries.device().is_cpu() && entries.dim() == 2 && entries.stride(1) == 1,
              "openmla cpu: entries must be a CPU [n, L+R] tensor with unit last stride");
  const at::ScalarType et = entries.scalar_type();
  TORCH_CHECK(et == at::kBFloat16 || et == at::kHalf || et == at::kFloat, "openmla cpu: entries must be bf16, fp16 or float32");
  TORCH_CHECK(rows.device().is_cpu() && rows.is_contiguous() && rows.scalar_type() == at::kLong && rows.dim() == 1 &&
                  rows.size(0) == entries.size(0), "openmla cpu: rows must be a contiguous int64 [n] tensor");
  const int64_t W = entries.size(1), L = kv_lora_rank, R = W - L;
  WriteArgs a;
  a.cache = PagedCache::of(pages, fmt, kv_scale, L, R);
  const PagedCache& c = a.cache;
  const int64_t elem = pages.element_size();
  const int64_t n = entries.size(0), num_rows = pages.size(0) * pages.size(1), ld = entries.stride(0) * entries.element_size();
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(row[i] < num_rows, "openmla cpu: row ", row[i], " is past the ", num_rows, " rows");
  const bool raw = (fmt == FMT_BF16 && et == at::kBFloat16) || (fmt == FMT_F16 && et == at::kHalf) || (fmt == FMT_F32 && et == at::kFloat);
  const uint8_t* src = static_cast<const uint8_t*>(entries.data_ptr());
  const int64_t elem_in = entries.element_size();
  // Where a record keeps the rope part in bfloat16 and the entries are bfloat16: its byte offset.
  const int64_t bf16_rope_at = et != at::kBFloat16 ? -1 : fmt == FMT_DS_MLA ? L + 4 * (L / DS_GROUP) : fmt == FMT_NVFP4_DS ? NV_DS_ROPE : -1;
  CacheWriter w{a};
  at::parallel_for(0, n, 64, [&](int64_t i0, int64_t i1) {
    float* tmp = scratch<float>(S_KEYS, 2 * round_up(W, 16));
    for (int64_t i = i0; i < i1; ++i) {
      if (row[i] < 0) continue;
      uint8_t* dst = const_cast<uint8_t*>(c.phys(row[i]));
      if (raw) {
        std::memcpy(dst, src + i * ld, W * elem);
      } else {
        load_any(et, src + i * ld, 0, tmp, W);
        w.store_float(dst, tmp, tmp + round_up(W, 16));
        if (bf16_rope_at >= 0)  // bf16 rope values kept as their bytes (NaN payloads too, as torch's no-op cast)
          std::memcpy(dst + bf16_rope_at, src + i * ld + L * elem_in, R * elem_in);
      }
    }
  });
}

}  // namespace openmla
