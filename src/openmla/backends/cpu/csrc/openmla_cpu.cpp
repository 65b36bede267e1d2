// The native CPU kernels of openmla as torch operators (torch.ops.openmla_cpu.*).
//
// One translation unit on purpose: every cold compile of a TU that includes ATen costs tens
// of seconds. Arguments arrive validated by openmla (kernels.py checks layouts); the checks
// here guard memory safety only.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "cache_write.h"
#include "decode.h"
#include "heads_gemm.h"
#include "prefill.h"
#include "shared_kv.h"

namespace openmla {
namespace {

template <typename T>
const T* ptr_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->data_ptr<T>() : nullptr;
}

void check_cpu_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "openmla cpu: ", name, " must be a contiguous CPU tensor");
}

void check_out(const at::Tensor& t, at::IntArrayRef shape, at::ScalarType dtype, const char* name) {
  check_cpu_contiguous(t, name);
  TORCH_CHECK(t.sizes() == shape && t.scalar_type() == dtype, "openmla cpu: ", name, " must be ", dtype, " ", shape);
}

PagedCache paged_cache(const at::Tensor& pages, const at::Tensor& block_table, int64_t fmt, double kv_scale, int64_t L,
                       int64_t R) {
  check_cpu_contiguous(block_table, "block_table");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2, "openmla cpu: block_table must be int32 [B, P]");
  PagedCache c = PagedCache::of(pages, fmt, kv_scale, L, R);
  c.table = block_table.data_ptr<int32_t>();
  c.table_stride = block_table.size(1);
  return c;
}

Mask make_mask(int64_t kind, int64_t window, int64_t chunk) {
  TORCH_CHECK(kind >= CAUSAL && kind <= CHUNKED, "openmla cpu: unknown mask kind ", kind);
  TORCH_CHECK(kind != CHUNKED || chunk > 0, "openmla cpu: chunked mask needs chunk > 0");
  return Mask{kind, window, chunk};
}

void decode_op(const at::Tensor& q, const at::Tensor& pages, const at::Tensor& block_table,
                                             const at::Tensor& cache_lens, const at::Tensor& offsets, int64_t fmt,
                                             double kv_scale, int64_t kv_lora_rank, double scale, int64_t mask_kind,
                                             int64_t window, int64_t chunk, const std::optional<at::Tensor>& sparse_indices,
                                             const std::optional<at::Tensor>& topk_lengths, bool physical,
                                             const std::optional<at::Tensor>& attn_sink, int64_t num_partitions,
                                             const at::Tensor& out, const at::Tensor& lse) {
  check_cpu_contiguous(q, "q");
  TORCH_CHECK(q.dim() == 3 && (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat), "openmla cpu: q must be bf16/fp32 [T, H, D]");
  check_cpu_contiguous(cache_lens, "cache_lens");
  check_cpu_contiguous(offsets, "offsets");
  DecodeArgs a;
  a.q = q.data_ptr();
  a.T = q.size(0);
  a.H = q.size(1);
  a.D = q.size(2);
  TORCH_CHECK(a.D % 2 == 0 && kv_lora_rank > 0 && kv_lora_rank <= a.D, "openmla cpu: bad widths");
  a.cache = paged_cache(pages, block_table, fmt, kv_scale, kv_lora_rank, a.D - kv_lora_rank);
  a.cache_lens = cache_lens.data_ptr<int32_t>();
  a.offsets = offsets.data_ptr<int32_t>();
  a.B = cache_lens.size(0);
  a.mask = make_mask(mask_kind, window, chunk);
  a.scale = static_cast<float>(scale);
  if (fmt == FMT_E4M3) {  // one scale per layer: fold it into the scores and the output
    a.cache.e4m3_unscaled = true;
    a.scale *= a.cache.kv_scale;
    a.out_scale = a.cache.kv_scale;
  }
  if (sparse_indices.has_value() && sparse_indices->defined()) {
    TORCH_CHECK(sparse_indices->scalar_type() == at::kInt && sparse_indices->dim() == 2 && sparse_indices->stride(1) == 1,
                "openmla cpu: sparse_indices must be int32 [T, K] with unit last stride");
    a.sparse = sparse_indices->data_ptr<int32_t>();
    a.sparse_stride = sparse_indices->stride(0);
    a.sparse_cols = sparse_indices->size(1);
  }
  a.topk = ptr_or_null<int32_t>(topk_lengths);
  a.physical = physical;
  if (attn_sink.has_value() && attn_sink->defined()) {
    check_cpu_contiguous(*attn_sink, "attn_sink");
    a.sink = attn_sink->data_ptr<float>();
    a.sink_stride = attn_sink->dim() == 2 ? a.H : 0;
  }
  a.num_partitions = num_partitions;
  check_out(out, {a.T, a.H, kv_lora_rank}, q.scalar_type(), "out");
  check_out(lse, {a.T, a.H}, at::kFloat, "lse");
  a.out = out.data_ptr();
  a.lse = lse.data_ptr<float>();
  if (q.scalar_type() == at::kBFloat16) run_decode<BFloat16>(a);
  else run_decode<float>(a);
}

void write_cache_op(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& freqs, const at::Tensor& gamma,
                          const at::Tensor& pages, const at::Tensor& block_table, const at::Tensor& cache_lens,
                          const at::Tensor& offsets, int64_t fmt, double kv_scale, int64_t kv_lora_rank, double eps,
                          bool interleaved, const at::Tensor& q_out) {
  check_cpu_contiguous(q, "q");
  check_cpu_contiguous(gamma, "gamma");
  check_cpu_contiguous(cache_lens, "cache_lens");
  check_cpu_contiguous(offsets, "offsets");
  TORCH_CHECK(kv.dim() == 2 && kv.stride(1) == 1 && freqs.dim() == 2 && freqs.stride(1) == 1, "openmla cpu: kv/freqs rows must be contiguous");
  TORCH_CHECK(gamma.scalar_type() == at::kFloat && gamma.size(0) == kv_lora_rank, "openmla cpu: gamma must be float32 [L]");
  TORCH_CHECK(freqs.scalar_type() == at::kFloat || freqs.scalar_type() == at::kDouble, "openmla cpu: freqs must be float32/64");
  WriteArgs a;
  a.q = q.data_ptr();
  a.q_type = q.scalar_type();
  a.T = q.size(0);
  a.H = q.size(1);
  a.Dq = q.size(2);
  a.kv = kv.data_ptr();
  a.kv_type = kv.scalar_type();
  a.kv_ld = kv.stride(0);
  a.freqs = freqs.data_ptr();
  a.freqs_f64 = freqs.scalar_type() == at::kDouble;
  a.freqs_ld = freqs.stride(0);
  a.gamma = gamma.data_ptr<float>();
  a.cache = paged_cache(pages, block_table, fmt, kv_scale, kv_lora_rank, kv.size(1) - kv_lora_rank);
  a.cache_lens = cache_lens.data_ptr<int32_t>();
  a.offsets = offsets.data_ptr<int32_t>();
  a.B = cache_lens.size(0);
  a.eps = eps;
  a.interleaved = interleaved;
  check_out(q_out, q.sizes(), q.scalar_type(), "q_out");
  a.q_out = q_out.data_ptr();
  run_cache_write(a);
}

// Entry columns [col0, col1) of the cache rows of n position spans (sequence seq[i], positions
// pos0[i] .. pos0[i] + count[i] - 1), laid end to end, dequantised into ``dtype``.
void gather_op(const at::Tensor& pages, const at::Tensor& block_table, const at::Tensor& seq, const at::Tensor& pos0,
                     const at::Tensor& count, int64_t fmt, double kv_scale, int64_t kv_lora_rank, int64_t rope_dim,
                     int64_t col0, int64_t col1, const at::Tensor& out) {
  PagedCache c = paged_cache(pages, block_table, fmt, kv_scale, kv_lora_rank, rope_dim);
  check_cpu_contiguous(seq, "seq");
  check_cpu_contiguous(pos0, "pos0");
  check_cpu_contiguous(count, "count");
  const int64_t n = seq.size(0);
  const int64_t* sq = seq.data_ptr<int64_t>();
  const int64_t* p0 = pos0.data_ptr<int64_t>();
  const int64_t* cnt = count.data_ptr<int64_t>();
  std::vector<int64_t> start(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) start[i + 1] = start[i] + cnt[i];
  const int64_t rows = start[n], W = col1 - col0;
  const at::ScalarType dtype = out.scalar_type();
  check_out(out, {rows, W}, dtype, "out");
  auto body = [&](auto* dst) {
    at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
      int64_t i = std::upper_bound(start.begin(), start.end(), r0) - start.begin() - 1;
      for (int64_t r = r0; r < r1; ++r) {
        while (r >= start[i + 1]) ++i;
        c.load(c.logical(sq[i], p0[i] + (r - start[i])), dst + r * W, col0, col1);
      }
    });
  };
  if (dtype == at::kBFloat16) body(out.data_ptr<BFloat16>());
  else if (dtype == at::kFloat) body(out.data_ptr<float>());
  else TORCH_CHECK(false, "openmla cpu: gather dtype must be bf16/fp32");
}

void prefill_chunk_op(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& rope, const at::Tensor& offsets,
    const at::Tensor& cache_lens, const at::Tensor& k_row0, const at::Tensor& k_pos0, const at::Tensor& k_count,
    double scale, int64_t mask_kind, int64_t window, int64_t chunk, const std::optional<at::Tensor>& state_o,
    const std::optional<at::Tensor>& state_ref, const std::optional<at::Tensor>& state_sum, bool first, bool last,
    const std::optional<at::Tensor>& attn_sink, const at::Tensor& out, const at::Tensor& lse) {
  check_cpu_contiguous(q, "q");
  for (const at::Tensor* t : {&offsets, &cache_lens, &k_row0, &k_pos0, &k_count}) check_cpu_contiguous(*t, "index");
  TORCH_CHECK(k.dim() == 2 && v.dim() == 2 && rope.dim() == 2 && k.stride(1) == 1 && v.stride(1) == 1 && rope.stride(1) == 1,
              "openmla cpu: k, v, rope must be 2-d with contiguous rows");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() && rope.scalar_type() == q.scalar_type(),
              "openmla cpu: q, k, v, rope must share the compute dtype");
  PrefillArgs a;
  a.q = q.data_ptr();
  a.T = q.size(0);
  a.H = q.size(1);
  a.Dq = q.size(2);
  a.R = rope.size(1);
  a.Dn = a.Dq - a.R;
  a.Dv = v.size(1) / a.H;
  TORCH_CHECK(k.size(1) == a.H * a.Dn && a.Dn % 2 == 0 && a.R % 2 == 0, "openmla cpu: k must be [S, H*Dn] with even widths");
  a.k = k.data_ptr();
  a.k_ld = k.stride(0);
  a.v = v.data_ptr();
  a.v_ld = v.stride(0);
  a.rope = rope.data_ptr();
  a.rope_ld = rope.stride(0);
  TORCH_CHECK(q.scalar_type() != at::kBFloat16 || (a.k_ld % 2 == 0 && a.rope_ld % 2 == 0), "openmla cpu: bf16 rows need even strides");
  a.offsets = offsets.data_ptr<int32_t>();
  a.cache_lens = cache_lens.data_ptr<int32_t>();
  a.k_row0 = k_row0.data_ptr<int64_t>();
  a.k_pos0 = k_pos0.data_ptr<int64_t>();
  a.k_count = k_count.data_ptr<int64_t>();
  a.B = cache_lens.size(0);
  a.mask = make_mask(mask_kind, window, chunk);
  a.scale = static_cast<float>(scale);
  a.first = first;
  a.last = last;
  if (!(first && last)) {
    TORCH_CHECK(state_o.has_value() && state_ref.has_value() && state_sum.has_value(), "openmla cpu: chunked prefill needs its state");
    a.state_o = state_o->data_ptr<float>();
    a.state_ref = state_ref->data_ptr<float>();
    a.state_sum = state_sum->data_ptr<float>();
  }
  if (attn_sink.has_value() && attn_sink->defined()) {
    check_cpu_contiguous(*attn_sink, "attn_sink");
    a.sink = attn_sink->data_ptr<float>();
    a.sink_stride = attn_sink->dim() == 2 ? a.H : 0;
  }
  if (last) {
    check_out(out, {a.T, a.H, a.Dv}, q.scalar_type(), "out");
    check_out(lse, {a.T, a.H}, at::kFloat, "lse");
    a.out = out.data_ptr();
    a.lse = lse.data_ptr<float>();
  }
  if (q.scalar_type() == at::kBFloat16) run_prefill<BFloat16>(a);
  else run_prefill<float>(a);
}

// W [H, M, K] (unit last stride; bf16: even strides and offset) -> its per-head brgemm B operands
// W[h]^T, packed [H, K/2, M, 2] (bf16) or [H, K, M] (float32).
void pack_heads_op(const at::Tensor& w, const at::Tensor& packed) {
  const at::ScalarType dtype = w.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "openmla cpu: pack_heads takes bf16/fp32");
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 3 && w.stride(2) == 1, "openmla cpu: w must be a CPU [H, M, K] with unit last stride");
  const int64_t H = w.size(0), M = w.size(1), K = w.size(2);
  const bool bf16 = dtype == at::kBFloat16;
  TORCH_CHECK(!bf16 || (K % 2 == 0 && w.stride(0) % 2 == 0 && w.stride(1) % 2 == 0 && reinterpret_cast<uintptr_t>(w.data_ptr()) % 4 == 0),
              "openmla cpu: bf16 w needs an even K, even strides and a 4-byte aligned start (its rows are read in pairs)");
  check_out(packed, {H, K * M}, dtype, "packed");
  if (bf16) pack_heads<BFloat16>(w.data_ptr<BFloat16>(), w.stride(0), w.stride(1), H, M, K, packed.data_ptr<BFloat16>());
  else pack_heads<float>(w.data_ptr<float>(), w.stride(0), w.stride(1), H, M, K, packed.data_ptr<float>());
}

// out[t, h, :M] = W[h] x x[t, h, :K] and out[t, h, M:] = x[t, h, K:] (query absorption with its
// rope part, or the output projection): x [T, H, K + copy] with unit last stride, ``packed`` from
// pack_heads of W [H, M, K], out [T, H, M + copy] contiguous, all bf16 or all float32.
void heads_gemm_op(const at::Tensor& x, const at::Tensor& packed, int64_t m, int64_t k, const at::Tensor& out) {
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "openmla cpu: heads_gemm takes bf16/fp32");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1, "openmla cpu: x must be a CPU [T, H, D] with unit last stride");
  HeadsGemmArgs a;
  a.T = x.size(0);
  a.H = x.size(1);
  a.M = m;
  a.K = k;
  a.copy = x.size(2) - k;
  TORCH_CHECK(m > 0 && k > 0 && a.copy >= 0 && (dtype != at::kBFloat16 || k % 2 == 0), "openmla cpu: heads_gemm widths");
  check_out(packed, {a.H, k * m}, dtype, "packed");
  check_out(out, {a.T, a.H, m + a.copy}, dtype, "out");
  a.x = x.data_ptr();
  a.x_st = x.stride(0);
  a.x_sh = x.stride(1);
  a.packed = packed.data_ptr();
  a.out = out.data_ptr();
  a.o_st = out.stride(0);
  a.o_sh = out.stride(1);
  if (dtype == at::kBFloat16) run_heads_gemm<BFloat16>(a);
  else run_heads_gemm<float>(a);
}

EntryStore entry_store(const at::Tensor& blocks, const at::Tensor& block_table, at::ScalarType dtype, int64_t D, const char* name) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.dim() == 3 && blocks.size(2) == D && blocks.stride(2) == 1 &&
                  blocks.scalar_type() == dtype,
              "openmla cpu: ", name, " blocks must be CPU [P, S, D] ", dtype, " with unit last stride");
  check_cpu_contiguous(block_table, name);
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2, "openmla cpu: ", name, " block_table must be int32 [B, P]");
  EntryStore s;
  const int64_t elem = blocks.element_size();
  s.base = static_cast<const uint8_t*>(blocks.data_ptr());
  s.page_stride = blocks.stride(0) * elem;
  s.row_stride = blocks.stride(1) * elem;
  s.page_size = blocks.size(1);
  s.table = block_table.data_ptr<int32_t>();
  s.table_stride = block_table.size(1);
  return s;
}

// DeepSeek-V4 shared-KV attention (shared_kv.h): q [T, H, D] float32; raw (and compressed)
// entries bf16 / fp16 / float32 [P, S, D]; seq, pos int64 [T]; indices int32 [T, K] or none
// (compressed entries by rule; rate 0: no compressed stream); out [T, H, D], lse [T, H] float32.
void shared_kv_op(const at::Tensor& q, const at::Tensor& raw_blocks, const at::Tensor& raw_table, const at::Tensor& seq,
                  const at::Tensor& pos, int64_t window, double scale, const std::optional<at::Tensor>& comp_blocks,
                  const std::optional<at::Tensor>& comp_table, int64_t rate, const std::optional<at::Tensor>& indices,
                  const std::optional<at::Tensor>& attn_sink, const at::Tensor& out, const at::Tensor& lse) {
  check_cpu_contiguous(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "openmla cpu: q must be float32 [T, H, D]");
  SharedKVArgs a;
  a.q = q.data_ptr<float>();
  a.T = q.size(0);
  a.H = q.size(1);
  a.D = q.size(2);
  const at::ScalarType dtype = raw_blocks.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, "openmla cpu: entries must be bf16/fp16/fp32");
  a.raw = entry_store(raw_blocks, raw_table, dtype, a.D, "raw");
  for (const auto* t : {&seq, &pos}) {
    check_cpu_contiguous(*t, "seq/pos");
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->size(0) == a.T, "openmla cpu: seq/pos must be int64 [T]");
  }
  a.seq = seq.data_ptr<int64_t>();
  a.pos = pos.data_ptr<int64_t>();
  TORCH_CHECK(window >= 1, "openmla cpu: window must be >= 1");
  a.window = window;
  a.scale = static_cast<float>(scale);
  a.compressed = rate > 0;
  if (a.compressed) {
    TORCH_CHECK(comp_blocks.has_value() && comp_table.has_value(), "openmla cpu: rate > 0 needs the compressed store");
    a.comp = entry_store(*comp_blocks, *comp_table, dtype, a.D, "compressed");
    a.rate = rate;
    if (indices.has_value() && indices->defined()) {
      check_cpu_contiguous(*indices, "indices");
      TORCH_CHECK(indices->scalar_type() == at::kInt && indices->dim() == 2 && indices->size(0) == a.T,
                  "openmla cpu: indices must be int32 [T, K]");
      a.indices = indices->data_ptr<int32_t>();
      a.topk = indices->size(1);
    }
  }
  if (attn_sink.has_value() && attn_sink->defined()) {
    check_cpu_contiguous(*attn_sink, "attn_sink");
    TORCH_CHECK(attn_sink->scalar_type() == at::kFloat && attn_sink->numel() == a.H, "openmla cpu: attn_sink must be float32 [H]");
    a.sink = attn_sink->data_ptr<float>();
  }
  check_out(out, {a.T, a.H, a.D}, at::kFloat, "out");
  check_out(lse, {a.T, a.H}, at::kFloat, "lse");
  a.out = out.data_ptr<float>();
  a.lse = lse.data_ptr<float>();
  if (dtype == at::kBFloat16) run_shared_kv<BFloat16>(a);
  else if (dtype == at::kHalf) run_shared_kv<Half>(a);
  else run_shared_kv<float>(a);
}

#if defined(OPENMLA_TEST_HOOKS)
// Test builds only (OPENMLA_CPU_TEST_HOOKS=1, see build.py) ---------------------------------
// Fill every thread's scratch memory with NaN bytes, so a kernel that reads scratch it did not
// write shows it.
void poison_scratch() {
  at::parallel_for(0, at::get_num_threads(), 1, [](int64_t, int64_t) {
    ThreadScratch& s = thread_scratch();
    for (int i = 0; i < NUM_SLOTS; ++i)
      if (s.ptr[i]) std::memset(s.ptr[i], 0xff, s.cap[i]);
  });
}

// Turn the own AMX micro-kernel on or off (to compare it with brgemm); returns whether it runs now.
bool set_own_amx(bool on) {
  own_amx_switch().store(on);
  return own_amx_enabled();
}

int64_t own_amx_unit_count() { return own_amx_units().load(); }

// Turn decode_reg.h's path (fp8 caches, float32 products) on or off; returns whether it runs
// now (False in builds without it: AVX-512 ones, or no AVX2 + F16C).
bool set_reg_dequant(bool on) {
  reg_dequant_switch().store(on);
#if defined(OPENMLA_REG_DEQUANT)
  return on;
#else
  return false;
#endif
}

int64_t reg_dequant_unit_count() { return reg_dequant_units().load(); }

// Turn decode_tiles.h's bf16 register tiles on or off; returns whether bf16 decode runs on them
// now (False in builds without AVX512_BF16 and on CPUs with AMX).
bool set_bf16_tiles(bool on) {
  bf16_tiles_switch().store(on);
#if defined(OPENMLA_BF16_TILES)
  return on && !own_amx_supported();
#else
  return false;
#endif
}

int64_t bf16_tiles_unit_count() { return bf16_tiles_units().load(); }

// Turn decode_tiles.h's float32 register tiles on or off (off: brgemm's float32 path); returns
// whether float32 decode runs on them now (False in builds without AVX-512 or AVX2 + FMA).
bool set_f32_tiles(bool on) {
  f32_tiles_switch().store(on);
#if defined(OPENMLA_F32_TILES)
  return on;
#else
  return false;
#endif
}

int64_t f32_tiles_unit_count() { return f32_tiles_units().load(); }
#endif

// Whether brgemm runs bfloat16 with VNNI-packed B on this CPU (oneDNN needs AVX-512).
bool bf16_gemm_supported() {
  try {
    alignas(64) BFloat16 A[32 * 2] = {}, B[32 * 16] = {};
    alignas(64) float C[2 * 16];
    gemm(2, 16, 32, 32, 16, 16, false, A, B, C);
    at::native::cpublas::brgemm_release(true);
    return true;
  } catch (const c10::Error&) {
    return false;
  }
}

// Whether bf16 decode runs on the own AMX micro-kernel here (False where the CPU or the build cannot).
bool own_amx_runs() { return own_amx_enabled(); }

}  // namespace
}  // namespace openmla

TORCH_LIBRARY(openmla_cpu, m) {
  m.def(
      "decode(Tensor q, Tensor pages, Tensor block_table, Tensor cache_lens, Tensor offsets, int fmt, float kv_scale, "
      "int kv_lora_rank, float scale, int mask_kind, int window, int chunk, Tensor? sparse_indices, Tensor? topk_lengths, "
      "bool physical, Tensor? attn_sink, int num_partitions, Tensor(a!) out, Tensor(b!) lse) -> ()",
      &openmla::decode_op);
  m.def(
      "write_cache(Tensor q, Tensor kv, Tensor freqs, Tensor gamma, Tensor(a!) pages, Tensor block_table, Tensor cache_lens, "
      "Tensor offsets, int fmt, float kv_scale, int kv_lora_rank, float eps, bool interleaved, Tensor(b!) q_out) -> ()",
      &openmla::write_cache_op);
  m.def("write_rows(Tensor entries, Tensor(a!) pages, Tensor rows, int fmt, float kv_scale, int kv_lora_rank) -> ()",
        &openmla::write_rows_op);
  m.def(
      "gather(Tensor pages, Tensor block_table, Tensor seq, Tensor pos0, Tensor count, int fmt, float kv_scale, "
      "int kv_lora_rank, int rope_dim, int col0, int col1, Tensor(a!) out) -> ()",
      &openmla::gather_op);
  m.def(
      "prefill_chunk(Tensor q, Tensor k, Tensor v, Tensor rope, Tensor offsets, Tensor cache_lens, Tensor k_row0, "
      "Tensor k_pos0, Tensor k_count, float scale, int mask_kind, int window, int chunk, Tensor(a!)? state_o, "
      "Tensor(b!)? state_ref, Tensor(c!)? state_sum, bool first, bool last, Tensor? attn_sink, Tensor(d!) out, "
      "Tensor(e!) lse) -> ()",
      &openmla::prefill_chunk_op);
  m.def(
      "shared_kv(Tensor q, Tensor raw_blocks, Tensor raw_table, Tensor seq, Tensor pos, int window, float scale, "
      "Tensor? comp_blocks, Tensor? comp_table, int rate, Tensor? indices, Tensor? attn_sink, Tensor(a!) out, "
      "Tensor(b!) lse) -> ()",
      &openmla::shared_kv_op);
  m.def("pack_heads(Tensor w, Tensor(a!) packed) -> ()", &openmla::pack_heads_op);
  m.def("heads_gemm(Tensor x, Tensor packed, int m, int k, Tensor(a!) out) -> ()", &openmla::heads_gemm_op);
  m.def("bf16_gemm_supported() -> bool", &openmla::bf16_gemm_supported);
  m.def("own_amx_runs() -> bool", &openmla::own_amx_runs);
#if defined(OPENMLA_TEST_HOOKS)
  m.def("poison_scratch() -> ()", &openmla::poison_scratch);
  m.def("set_own_amx(bool on) -> bool", &openmla::set_own_amx);
  m.def("own_amx_units() -> int", &openmla::own_amx_unit_count);
  m.def("set_reg_dequant(bool on) -> bool", &openmla::set_reg_dequant);
  m.def("reg_dequant_units() -> int", &openmla::reg_dequant_unit_count);
  m.def("set_bf16_tiles(bool on) -> bool", &openmla::set_bf16_tiles);
  m.def("bf16_tiles_units() -> int", &openmla::bf16_tiles_unit_count);
  m.def("set_f32_tiles(bool on) -> bool", &openmla::set_f32_tiles);
  m.def("f32_tiles_units() -> int", &openmla::f32_tiles_unit_count);
#endif
}
