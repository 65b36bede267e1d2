// Absorbed (MQA) decode over the paged latent cache.
//
// Work is cut into units: one sequence's query rows (tokens x heads, at most DECODE_MAX_ROWS)
// against one part of their key range (split-KV), or for sparse attention one token's heads
// against one part of its listed keys. A unit walks its keys in blocks:
//   scores  S[n, M] = keys[n, D] x Q^T        (keys-major: the cache rows are the A operand,
//                                              read in place from the pages when possible)
//   S^T, online softmax per query row -> P[M, n] in the compute type
//   O[M, L] += P x V                          (V = the first L key columns, packed for B)
// Parts of one row group are merged by LSE by whichever unit finishes last, so a call is one
// parallel region. Dense units over an fp8 cache with float32 products run decode_reg.h's tiles
// instead in AVX2 builds (fp8 dequantised next to the products, no key buffer); bf16 products on a
// CPU with AVX512-BF16 and without AMX, and float32 products in AVX-512 and AVX2 + FMA builds, run
// decode_tiles.h's register tiles (no brgemm, no V pack). A key some query rows of a block do not
// see and whose scores are not finite (a NaN key of this step) is kept out of that block's P x V
// and added for the rows that see it (add_unseen: the NaN rule, docs/api.md).
#pragma once

#include "amx.h"
#include "decode_reg.h"
#include "decode_tiles.h"
#include "operands.h"
#include "softmax.h"

#include <memory>

namespace openmla {

// Tuning, measured on a 2-core AMX Xeon (bench/RESULTS.md).
constexpr int64_t DECODE_BLOCK = 256;     // keys per block (four 64-key pages)
constexpr int64_t DECODE_MAX_ROWS = 128;  // query rows (tokens x heads) of one unit
constexpr int64_t INPLACE_MIN_PAGE = 16;  // bf16 pages of at least this many rows are read in place
constexpr int64_t MIN_PART_KEYS = 512;    // automatic split-KV never cuts parts smaller than this

struct DecodeArgs {
  const void* q = nullptr;  // [T, H, D] in the compute type, contiguous
  int64_t T = 0, H = 0, D = 0;
  PagedCache cache;
  const int32_t* cache_lens = nullptr;  // [B]
  const int32_t* offsets = nullptr;     // [B + 1]
  int64_t B = 0;
  Mask mask;
  float scale = 1.f;
  const int32_t* sparse = nullptr;  // [T, sparse_stride] or null (dense)
  int64_t sparse_stride = 0, sparse_cols = 0;
  const int32_t* topk = nullptr;  // [B] or null
  bool physical = true;
  const float* sink = nullptr;  // [H] (sink_stride 0) or [B, H] (sink_stride H)
  int64_t sink_stride = 0;
  int64_t num_partitions = 0;  // 0: automatic
  float out_scale = 1.f;       // final outputs are multiplied by this (a folded fp8_e4m3 kv_scale)
  void* out = nullptr;         // [T, H, L] in the compute type
  float* lse = nullptr;        // [T, H]
};

struct DecodeUnit {
  int32_t b, t0, nt, h0, nh;  // sequence, first token row, tokens, first head, heads
  int32_t group, part;
  int64_t k_lo, k_hi;  // key positions (dense) or sparse slots of this part
  int64_t cost;
};

struct DecodeGroup {
  int32_t nparts = 1;
  int64_t partial = 0;  // first row of this group's parts in the partial buffers
  int64_t rows = 0;     // M
};

struct DecodePlan {
  std::vector<DecodeUnit> units;
  std::vector<DecodeGroup> groups;
  int64_t partial_rows = 0;
  double work_s = 0;  // estimated single-thread seconds
  bool inplace = false;
  int64_t align = DECODE_BLOCK;  // key grid that blocks and part cuts follow
};

template <typename T>
bool decode_inplace(const DecodeArgs& a) {
  return std::is_same_v<T, BFloat16> && a.sparse == nullptr && a.cache.fmt == FMT_BF16 &&
         a.cache.page_size >= INPLACE_MIN_PAGE && a.cache.row_stride % 2 == 0;
}

// Key blocks of a dense range: the grid cell of a position and its rows.
struct KeyBlock {
  int64_t base;    // position of block row 0
  int64_t rows;    // rows the score GEMM computes
  int64_t a, b;    // visible positions [a, b) of this block (within the unit's range)
};

inline KeyBlock next_block(const DecodePlan& plan, int64_t page_size, int64_t pos, int64_t k_hi) {
  const int64_t G = plan.align;
  if (!plan.inplace) {
    const int64_t end = std::min(k_hi, (pos / G + 1) * G);
    return {pos, end - pos, pos, end};
  }
  if (page_size <= DECODE_BLOCK) {  // whole pages, G = pages per block * page_size
    const int64_t end = std::min(k_hi, (pos / G + 1) * G);
    const int64_t base = pos / page_size * page_size;
    return {base, ceil_div(end, page_size) * page_size - base, pos, end};
  }
  // long pages: slabs of DECODE_BLOCK rows inside a page
  const int64_t page0 = pos / page_size * page_size;
  const int64_t slab = page0 + (pos - page0) / DECODE_BLOCK * DECODE_BLOCK;
  const int64_t slab_end = std::min(slab + DECODE_BLOCK, page0 + page_size);
  return {slab, slab_end - slab, pos, std::min(k_hi, slab_end)};
}

inline DecodePlan plan_decode(const DecodeArgs& a, bool inplace) {
  DecodePlan plan;
  plan.inplace = inplace;
  const int64_t ps = a.cache.page_size;
  if (inplace) plan.align = ps <= DECODE_BLOCK ? (DECODE_BLOCK / ps) * ps : ps;
  struct Pending {
    int32_t b, t0, nt, h0, nh;
    int64_t lo, hi;
  };
  std::vector<Pending> pend;
  const int64_t H = a.H;
  const int64_t head_chunks = ceil_div(H, DECODE_MAX_ROWS);
  for (int64_t b = 0; b < a.B; ++b) {
    const int64_t n = a.offsets[b + 1] - a.offsets[b];
    if (n <= 0) continue;
    const int64_t c = a.cache_lens[b], kv_len = c + n;
    const int64_t tok_chunk = std::max<int64_t>(1, DECODE_MAX_ROWS / H);
    for (int64_t hc = 0; hc < head_chunks; ++hc) {
      const int64_t h0 = H * hc / head_chunks, h1 = H * (hc + 1) / head_chunks;
      if (a.sparse) {
        int64_t slots = a.sparse_cols;
        if (a.topk) slots = std::min<int64_t>(slots, std::max<int32_t>(0, a.topk[b]));
        for (int64_t i = 0; i < n; ++i)
          pend.push_back({(int32_t)b, (int32_t)(a.offsets[b] + i), 1, (int32_t)h0, (int32_t)(h1 - h0), 0, slots});
      } else {
        const int64_t chunks = ceil_div(n, tok_chunk);
        for (int64_t ci = 0; ci < chunks; ++ci) {
          const int64_t i0 = n * ci / chunks, i1 = n * (ci + 1) / chunks;
          auto [lo, hi] = a.mask.key_range(c + i0, c + i1 - 1, kv_len);
          pend.push_back({(int32_t)b, (int32_t)(a.offsets[b] + i0), (int32_t)(i1 - i0), (int32_t)h0, (int32_t)(h1 - h0), lo, hi});
        }
      }
    }
  }
  const int64_t align = a.sparse ? DECODE_BLOCK : plan.align;
  int64_t total = 0;
  for (auto& p : pend) total += (p.hi - p.lo + DECODE_BLOCK) * p.nt * p.nh;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t target = std::max<int64_t>(1, total / (2 * threads));
  for (size_t g = 0; g < pend.size(); ++g) {
    const Pending& p = pend[g];
    const int64_t keys = p.hi - p.lo, M = p.nt * p.nh;
    int64_t parts;
    if (a.num_partitions > 0) {
      parts = std::min<int64_t>(a.num_partitions, std::max<int64_t>(1, ceil_div(keys, std::min(align, keys + 1))));
    } else {
      const int64_t cost = (keys + DECODE_BLOCK) * M;
      parts = std::clamp<int64_t>(ceil_div(cost, target), 1, std::max<int64_t>(1, keys / MIN_PART_KEYS));
    }
    DecodeGroup grp;
    grp.nparts = (int32_t)parts;
    grp.rows = M;
    if (parts > 1) {
      grp.partial = plan.partial_rows;
      plan.partial_rows += parts * M;
    }
    plan.groups.push_back(grp);
    int64_t prev = p.lo;
    for (int64_t i = 0; i < parts; ++i) {
      int64_t cut = p.hi;
      if (i + 1 < parts) {
        cut = p.lo + keys * (i + 1) / parts;
        if (!a.sparse) cut = (cut + align / 2) / align * align;
        cut = std::clamp(cut, prev, p.hi);
      }
      plan.units.push_back({p.b, p.t0, p.nt, p.h0, p.nh, (int32_t)g, (int32_t)i, prev, cut, (cut - prev + DECODE_BLOCK) * M});
      plan.work_s += (double)(cut - prev) * (2.0 * M * (2 * a.D) / EST_FLOPS_PER_S + a.cache.row_stride / EST_BYTES_PER_S);
      prev = cut;
    }
  }
  std::stable_sort(plan.units.begin(), plan.units.end(), [](const DecodeUnit& x, const DecodeUnit& y) { return x.cost > y.cost; });
  return plan;
}

// Up to this many query rows, bf16 decode on the own AMX kernel reads V as stored, from the pages
// or the key buffer (amx_pv_direct: twice the tile products, no repack); above, the doubled
// products cost more.
constexpr int64_t DIRECT_V_MAX_ROWS = 32;


template <typename T>
struct DecodeKernel {
  const DecodeArgs& a;
  const DecodePlan& plan;
  float* partial_o;    // [partial_rows, L]
  float* partial_lse;  // [partial_rows]
  std::atomic<int32_t>* done;  // per group

  int64_t L() const { return a.cache.L; }

  float sink_of(int64_t b, int64_t h) const {
    return a.sink ? a.sink[b * a.sink_stride + h] : std::numeric_limits<float>::quiet_NaN();
  }

  // One unit's state: its query rows, their softmax statistics and accumulators, and the
  // per-thread buffers of one key block.
  struct Unit {
    const DecodeUnit& u;
    int64_t M, n_max;
    bool own;       // products on the own AMX micro-kernel
    bool direct;    // P x V reads V rows as they are (amx_pv_direct), O in even/odd chunk order
    bool tiles;     // products in register tiles (decode_tiles.h: bf16 on AVX-512-BF16, float32)
    T* QT;          // [D][M] Q^T, the B operand of the score product (VNNI pairs for bf16)
    float* O;       // [M][L] accumulators
    float *ref, *sum;
    int32_t *c0, *c1;    // [M] visible block rows of each query row
    int32_t *tlo, *thi;  // [nt] visible key positions of each token (dense)
    uint64_t* unseen;    // [n_max / 64 + 1] block rows with a non-finite score a column does not see
    float* S;            // [n_max][M] scores, keys-major
    T *PT, *P;           // [n_max][M] and [M][n_max] probabilities
    const T** rows;      // [n_max] a block's key rows
  };

  void run(const DecodeUnit& u) const {
    const int64_t M = (int64_t)u.nt * u.nh, D = a.D, L = this->L();
    const int64_t n_max = plan.inplace ? std::max<int64_t>(round_up(plan.align, 32), round_up(DECODE_BLOCK, 32)) : DECODE_BLOCK;
    // Products on the own AMX micro-kernel where the shapes allow (M, D, L in whole tiles; in
    // place, pages in whole tiles), else on brgemm.
    Unit w{u, M, n_max, own_amx_unit(M)};
#if defined(OPENMLA_OWN_AMX)
    if (w.own) {
      amx_configure();
#if defined(OPENMLA_TEST_HOOKS)
      own_amx_units().fetch_add(1, std::memory_order_relaxed);
#endif
    }
#endif
    const bool reg = reg_dequant();
    w.tiles = !reg && reg_tiles(w);
    // the register tiles read whole vectors of Q^T columns (decode_reg.h: 8; decode_tiles.h: its lanes)
    const int64_t ldq = reg ? round_up(M, 8) : w.tiles ? round_up(M, tile_lanes()) : M;
    w.QT = scratch<T>(S_QT, D * ldq);
    const T* q = static_cast<const T*>(a.q);
    for (int64_t i = 0; i < u.nt; ++i) pack_b_transposed<T>(q + ((u.t0 + i) * a.H + u.h0) * D, D, u.nh, D, w.QT, ldq, i * u.nh);
    zero_b_columns<T>(w.QT, D, ldq, M, ldq);
    w.O = scratch<float>(S_ACC, M * L);
    w.ref = scratch<float>(S_ROWS, 2 * M);
    w.sum = w.ref + M;
    std::fill(w.ref, w.ref + M, NEG_INF);
    std::fill(w.sum, w.sum + M, 0.f);
    const int64_t ints = round_up(2 * M + 2 * u.nt, 2);
    w.c0 = scratch<int32_t>(S_PTRS, ints + 2 * (w.n_max / 64 + 1));
    w.c1 = w.c0 + M;
    w.tlo = w.c1 + M;
    w.thi = w.tlo + u.nt;
    w.unseen = reinterpret_cast<uint64_t*>(w.c0 + ints);
    w.S = scratch<float>(S_SCORES, round_up(n_max, 16) * M);
    w.PT = scratch<T>(S_SCORES_T, n_max * M);
    w.P = scratch<T>(S_PROBS, M * n_max);
    w.rows = scratch<const T*>(S_KPACK, n_max);

    w.direct = direct_v(w);
    if (reg) {
      token_ranges(w);
      walk_dense_reg(w, ldq);
    } else if (w.tiles && !a.sparse) {
      token_ranges(w);
      walk_dense_tiles(w);
    } else if (a.sparse) {
      walk_sparse(w);
    } else {
      token_ranges(w);
      walk_dense(w);
    }
#if defined(OPENMLA_OWN_AMX)
    if (w.direct) interleave_pairs(w.O, M, L, L);
    if (w.own) amx_release();
#endif
    finish(u, w.O, w.ref, w.sum);
  }

  void mm(const Unit& w, int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc, bool add, const T* A,
          const T* B, float* C) const {
#if defined(OPENMLA_OWN_AMX)
    if constexpr (std::is_same_v<T, BFloat16>) {
      if (w.own) return amx_gemm(m, n, k, lda, ldb, ldc, add, A, B, C);
    }
#endif
    gemm(m, n, k, lda, ldb, ldc, add, A, B, C);
  }

  // Each token's visible key positions within the unit's range.
  void token_ranges(Unit& w) const {
    const DecodeUnit& u = w.u;
    const int64_t c = a.cache_lens[u.b], kv_len = c + (a.offsets[u.b + 1] - a.offsets[u.b]);
    const int64_t i_first = u.t0 - a.offsets[u.b];
    for (int64_t i = 0; i < u.nt; ++i) {
      auto [lo, hi] = a.mask.key_range(c + i_first + i, c + i_first + i, kv_len);
      w.tlo[i] = (int32_t)std::max(lo, u.k_lo);
      w.thi[i] = (int32_t)std::min(hi, u.k_hi);
    }
  }

  // The block rows each query row sees.
  void block_columns(Unit& w, const KeyBlock& kb) const {
    const DecodeUnit& u = w.u;
    for (int64_t i = 0; i < u.nt; ++i) {
      const int32_t lo = (int32_t)std::max<int64_t>(w.tlo[i], kb.a) - (int32_t)kb.base;
      const int32_t hi = (int32_t)std::min<int64_t>(w.thi[i], kb.b) - (int32_t)kb.base;
      for (int64_t h = 0; h < u.nh; ++h) {
        w.c0[i * u.nh + h] = lo;
        w.c1[i * u.nh + h] = std::max(lo, hi);
      }
    }
  }

  // Scores of a block read in place, page by page (pages without a visible row skipped).
  void score_pages(const Unit& w, const KeyBlock& kb) const {
    const int64_t row_elems = a.cache.row_stride / (int64_t)sizeof(T);
    const int64_t seg = std::min(a.cache.page_size, kb.rows);
    for (int64_t r = 0; r < kb.rows; r += seg) {
      if (kb.base + r + seg <= kb.a || kb.base + r >= kb.b) continue;
      const T* A = reinterpret_cast<const T*>(a.cache.logical(w.u.b, kb.base + r));
      mm(w, seg, w.M, a.D, row_elems, w.M, w.M, false, A, w.QT, w.S + r * w.M);
    }
  }

  // Softmax of a block's scores (S [rows][M]) into P [M][round_up(rows, 32)]; whether a row has a
  // non-finite score in a column that does not see it (w.unseen: see softmax_keys_major).
  bool softmax(Unit& w, int64_t rows) const {
    return softmax_keys_major<T>(w.S, w.M, rows, round_up(rows, 32), w.c0, w.c1, a.scale, w.ref, w.sum, w.O, L(), L(), w.PT,
                                 w.P, w.unseen);
  }

  // The NaN rule for keys some query rows of a block do not see (several tokens of a sequence in
  // the decode form: a NaN or infinite key written in this step, after an earlier query's
  // position): each flagged block row j (w.unseen, rows < n) is added here for the query rows that
  // see it, O[m] += P[m][j] V[j] as the products would (0 x inf = NaN for a -inf score, as the
  // float64 reference), then ``drop(j)`` takes it out of the block's P x V, so the rows that do
  // not see it never multiply it (0 x NaN). V[j]: the row's values (L of them). Rare: the common
  // case flags nothing.
  template <class Drop>
  void add_unseen(Unit& w, int64_t n, const T* const* V, Drop drop) const {
    const int64_t M = w.M, L = this->L();
    for (int64_t j = 0; j < n; ++j) {
      if (!(w.unseen[j >> 6] >> (j & 63) & 1)) continue;
      const T* v = V[j];
      for (int64_t m = 0; m < M; ++m) {
        if (!(w.c0[m] <= j && j < w.c1[m])) continue;
        const float p = static_cast<float>(w.PT[j * M + m]);
        float* o = w.O + m * L;
        for (int64_t l = 0; l < L; ++l) {
          // the own AMX kernel's direct P x V keeps each 32-column chunk as its even, then odd columns
          const int64_t at = w.direct ? (l & ~int64_t(31)) + ((l & 1) << 4) + ((l & 31) >> 1) : l;
          o[at] += p * static_cast<float>(v[l]);
        }
      }
      drop(j);
    }
  }

  // P x V with V packed from w.rows (VNNI pairs for bf16) unless ``packed`` already in Vp.
  // float32 products take the keys in multiples of 8 (brgemm builds one kernel per size: at most
  // 32 of them), so a short context is not padded to 32 keys; bf16 keeps 32-key blocks.
  void pv_packed(Unit& w, int64_t rows, T* Vp, bool packed) const {
    const int64_t n_pad = round_up(rows, 32), k = std::is_same_v<T, float> ? round_up(rows, 8) : n_pad;
    if (!packed) pack_b_rows<T>(w.rows, rows, k, L(), Vp);
    mm(w, w.M, L(), k, n_pad, L(), L(), true, w.P, Vp, w.O);
  }

  // Dense keys in blocks; pages read in place (bf16) or entries converted into a key buffer.
  void walk_dense(Unit& w) const {
    const DecodeUnit& u = w.u;
    const int64_t D = a.D, L = this->L();
    T* Vp = w.direct ? nullptr : scratch<T>(S_VPACK, w.n_max * L);
    T* keys = scratch<T>(S_KEYS, round_up(w.n_max, 16) * D);
    for (int64_t pos = u.k_lo; pos < u.k_hi;) {
      const KeyBlock kb = next_block(plan, a.cache.page_size, pos, u.k_hi);
      if (plan.inplace) {
        // Packed, V first: that pass streams the block's rows from memory (the rope columns
        // prefetched alongside), so the score product then reads them from cache.
        if (!w.direct) {
          block_rows(u.b, kb, w.rows);
          pack_b_rows<T>(w.rows, kb.rows, round_up(kb.rows, 32), L, Vp, (D - L) * (int64_t)sizeof(T));
        }
        score_pages(w, kb);
      } else {
        const int64_t stored = a.cache.stored_bytes();
        for (int64_t r = 0; r < kb.rows; ++r) {
          if (r + PACK_AHEAD < kb.rows) prefetch_bytes(a.cache.logical(u.b, kb.base + r + PACK_AHEAD), stored);
          a.cache.load<T>(a.cache.logical(u.b, kb.base + r), keys + r * D, 0, D);
          w.rows[r] = keys + r * D;
        }
        mm(w, round_up(kb.rows, std::is_same_v<T, float> ? 8 : 16), w.M, D, D, w.M, w.M, false, keys, w.QT, w.S);
      }
      block_columns(w, kb);
      const bool unseen = softmax(w, kb.rows);
      if (unseen && !w.direct) {  // flagged rows out of the packed V (in place: it was packed first)
        if (plan.inplace) block_rows(u.b, kb, w.rows);
        add_unseen(w, kb.rows, w.rows, [&](int64_t j) {
          w.rows[j] = nullptr;
          const int64_t k0 = std::is_same_v<T, float> ? j : j & ~int64_t(1);
          if (plan.inplace) pack_b_rows_range<T>(w.rows, kb.rows, k0, k0 + k_pair<T>(), L, Vp);
        });
      } else if (unseen && !plan.inplace) {  // direct from the key buffer: the flagged rows zeroed
        for (int64_t r = 0; r < kb.rows; ++r) w.rows[r] = keys + r * D;
        add_unseen(w, kb.rows, w.rows, [&](int64_t j) { zero_fill(keys + j * D, L * sizeof(T)); });
      } else if (unseen) {  // direct from the pages: pv_pages stages the groups holding flagged rows
        block_rows(u.b, kb, w.rows);
        add_unseen(w, kb.rows, w.rows, [](int64_t) {});
      }
      if (!w.direct) pv_packed(w, kb.rows, Vp, plan.inplace);
      else if (plan.inplace) pv_pages(w, kb, unseen);
      else pv_buffer(w, keys, kb.rows);
      pos = kb.b;
    }
  }

  // Whether this unit runs decode_reg.h's tiles: float32 products over a dense fp8 or NVFP4 cache, in an
  // AVX2 + FMA + F16C build without AVX-512 (sparse units gather their listed rows into the key
  // buffer).
  bool reg_dequant() const {
#if defined(OPENMLA_REG_DEQUANT)
#if defined(OPENMLA_TEST_HOOKS)
    if (!reg_dequant_switch().load(std::memory_order_relaxed)) return false;
#endif
    return std::is_same_v<T, float> && a.sparse == nullptr &&
           (a.cache.fmt == FMT_E4M3 || a.cache.fmt == FMT_DS_MLA || is_nvfp4(a.cache.fmt));
#else
    return false;
#endif
  }

  // Dense keys of an fp8 or NVFP4 cache in blocks, dequantised next to the products (decode_reg.h).
  void walk_dense_reg(Unit& w, int64_t ldq) const {
#if defined(OPENMLA_REG_DEQUANT)
    if constexpr (std::is_same_v<T, float>) {
#if defined(OPENMLA_TEST_HOOKS)
      reg_dequant_units().fetch_add(1, std::memory_order_relaxed);
#endif
      const DecodeUnit& u = w.u;
      const int64_t D = a.D, L = this->L(), M = w.M;
      const int64_t ldk = round_up(D, 8);
      const bool nv = is_nvfp4(a.cache.fmt);  // stripes built with their scales: no P^T copies
      const int64_t groups = a.cache.fmt == FMT_DS_MLA ? L / DS_GROUP : 1, group_w = L / groups;
      const int64_t stored = a.cache.stored_bytes();
      const float score_scale = a.cache.fmt == FMT_E4M3 ? a.scale * E4M3_PANEL_SCALE : a.scale;  // the panel's 2^-8
      float* panel = scratch<float>(S_STAGE, SCORE_KR * ldk);
      float* PTg = nv ? nullptr : scratch<float>(S_KEYS, groups * w.n_max * M);  // P^T times each group's factor
      float* factor = scratch<float>(S_VPACK, round_up(w.n_max, 16) + 16 * w.n_max);
      float* Vs = factor + round_up(w.n_max, 16);  // the V stripe, 64-byte aligned as the slot
      const uint8_t** rows = scratch<const uint8_t*>(S_KPACK, w.n_max);
      for (int64_t pos = u.k_lo; pos < u.k_hi;) {
        const KeyBlock kb = next_block(plan, a.cache.page_size, pos, u.k_hi);
        const int64_t n = kb.rows;
        for (int64_t r = 0; r < n; ++r) rows[r] = a.cache.logical(u.b, kb.base + r);
        for (int64_t j0 = 0; j0 < n; j0 += SCORE_KR) {
          const int64_t kr = std::min<int64_t>(SCORE_KR, n - j0);
          for (int64_t r = j0 + SCORE_KR; r < std::min(n, j0 + 2 * SCORE_KR); ++r) prefetch_bytes(rows[r], stored);
          for (int64_t k = 0; k < kr; ++k) panel_row(a.cache, rows[j0 + k], panel + k * ldk);
          float* S = w.S + j0 * M;
          switch (kr) {
            case 6: score_tiles<6>(panel, ldk, w.QT, ldq, D, S, M); break;
            case 5: score_tiles<5>(panel, ldk, w.QT, ldq, D, S, M); break;
            case 4: score_tiles<4>(panel, ldk, w.QT, ldq, D, S, M); break;
            case 3: score_tiles<3>(panel, ldk, w.QT, ldq, D, S, M); break;
            case 2: score_tiles<2>(panel, ldk, w.QT, ldq, D, S, M); break;
            default: score_tiles<1>(panel, ldk, w.QT, ldq, D, S, M); break;
          }
        }
        block_columns(w, kb);
        softmax_keys_major<T>(w.S, M, n, round_up(n, 32), w.c0, w.c1, score_scale, w.ref, w.sum, w.O, L, L, w.PT, w.P);
        if (nv) {  // one 16-column stripe per latent group, its keys' scales applied
          for (int64_t g = 0; g < NV_GROUPS; ++g) {
            v_stripe_nvfp4(a.cache.fmt, rows, g, n, Vs);
            pv_stripe(Vs, w.PT, M, n, w.O + NV_GROUP * g, L);
          }
          pos = kb.b;
          continue;
        }
        for (int64_t g = 0; g < groups; ++g) {
          for (int64_t r = 0; r < n; ++r) factor[r] = pv_factor(a.cache, rows[r], g);
          float* pg = PTg + g * n * M;
          scale_probs(w.PT, n, M, factor, pg);
          const int64_t l_end = (g + 1) * group_w;
          int64_t l0 = g * group_w;
          for (; l0 + 16 <= l_end; l0 += 16) pv_rows(rows, l0, pg, M, n, w.O, L, Vs);
          if (l0 < l_end) pv_tail(rows, l0, l_end, pg, M, n, w.O, L);
        }
        pos = kb.b;
      }
      return;
    }
#endif
    TORCH_CHECK(false, "openmla cpu: the register-dequantising decode needs an AVX2 + F16C build without AVX-512");
  }

  // Whether this unit's products run in AVX-512-BF16 register tiles: bf16 in a build with
  // AVX512_BF16, on a CPU without AMX (there the own AMX kernel or brgemm's AMX kernels run).
  bool bf16_tiles(const Unit& w) const {
#if defined(OPENMLA_BF16_TILES)
#if defined(OPENMLA_TEST_HOOKS)
    if (!bf16_tiles_switch().load(std::memory_order_relaxed)) return false;
#endif
    return std::is_same_v<T, BFloat16> && !w.own && !own_amx_supported();
#else
    (void)w;
    return false;
#endif
  }

  // Whether this unit runs on the register tiles: bf16 as above, float32 in any build with
  // AVX-512 or AVX2 + FMA (brgemm's float32 kernels are what they replace, on AMX CPUs too).
  bool reg_tiles(const Unit& w) const {
    if constexpr (std::is_same_v<T, BFloat16>) {
      return bf16_tiles(w);
    } else {
#if defined(OPENMLA_F32_TILES)
#if defined(OPENMLA_TEST_HOOKS)
      if (!f32_tiles_switch().load(std::memory_order_relaxed)) return false;
#endif
      (void)w;
      return true;
#else
      (void)w;
      return false;
#endif
    }
  }

  // Query columns per vector of the register tiles (Q^T's rows are padded to a multiple).
  static constexpr int64_t tile_lanes() {
#if defined(OPENMLA_F32_TILES)
    if constexpr (std::is_same_v<T, float>) return F32x::W;
#endif
    return 16;
  }

  // float32 cache pages read in place by the float32 tiles (no key buffer: the rows are the
  // operands as stored).
  bool f32_rows_in_place() const {
    return std::is_same_v<T, float> && a.sparse == nullptr && a.cache.fmt == FMT_F32 && a.cache.row_stride % 4 == 0;
  }

  // One key block on the register tiles: block rows ``rows`` (rows [ra, rb) seen by some query
  // row, the others ``zero``; bf16: the row at rb is set to it when rb is odd): scores, softmax
  // (keys-major P^T only), P x V (bf16: P pairs in ``PP``, [n_max / 2 + 1][M]). ``stream``: the
  // rows are cache pages read in place (the score tiles ask for them ahead).
  void tile_products(Unit& w, const T** rows, int64_t ra, int64_t rb, const T* zero, int32_t* PP, bool stream,
                     BlockPrefetch pf = {}) const {
    const int64_t M = w.M, L = this->L();
    (void)M, (void)L, (void)zero, (void)PP, (void)ra;
#if defined(OPENMLA_BF16_TILES)
    if constexpr (std::is_same_v<T, BFloat16>) {
      if (rb & 1) rows[rb] = zero;
      score_tiles<BF16x>(rows + ra, rb - ra, w.QT, round_up(M, 16), a.D, w.S + ra * M, M, stream);
      if (softmax_pt(w, rb)) add_unseen(w, rb, rows, [&](int64_t j) { rows[j] = zero; });
      // rows past rb are seen by none: a short context is not padded to its page
      const int64_t j0 = ra & ~int64_t(1), pairs = (round_up(rb, 2) - j0) / 2;
      pair_probs(w.PT + j0 * M, M, pairs, PP);
      pv_tiles(rows + j0, pairs, PP, M, w.O, L, L, pf);
      return;
    }
#endif
#if defined(OPENMLA_F32_TILES)
    if constexpr (std::is_same_v<T, float>) {
      score_tiles<F32x>(rows + ra, rb - ra, w.QT, round_up(M, F32x::W), a.D, w.S + ra * M, M, stream);
      if (softmax_pt(w, rb)) add_unseen(w, rb, rows, [&](int64_t j) { rows[j] = zero; });
      pv_tiles_f32<F32x>(rows + ra, rb - ra, w.PT + ra * M, M, w.O, L, L, pf);
      return;
    }
#endif
    TORCH_CHECK(false, "openmla cpu: no register tiles in this build for this compute type");
  }

  // The softmax of a block for the tiles: keys-major P^T only (the tiles broadcast from it).
  bool softmax_pt(Unit& w, int64_t rows) const {
    return softmax_keys_major<T>(w.S, w.M, rows, round_up(rows, 32), w.c0, w.c1, a.scale, w.ref, w.sum, w.O, L(), L(), w.PT,
                                 static_cast<T*>(nullptr), w.unseen);
  }

  // The tiles' P pairs (slot S_VPACK: no packed V on the tiles).
  int32_t* tile_pairs(const Unit& w) const { return scratch<int32_t>(S_VPACK, (w.n_max / 2 + 1) * w.M); }

  // A zero row of D values (scratch slot S_STAGE, which the tiles' walks use for nothing else).
  const T* tile_zero_row() const {
    T* z = scratch<T>(S_STAGE, round_up(a.D, 32));
    zero_fill(z, round_up(a.D, 32) * sizeof(T));
    return z;
  }

  // Dense keys in blocks on the register tiles: bf16 pages (and float32 pages for float32
  // products) read in place, the next block's rows prefetched during this one's P x V; other
  // formats (and short bf16 pages) converted into the key buffer; rows no query row sees point at
  // a zero row.
  void walk_dense_tiles(Unit& w) const {
    const DecodeUnit& u = w.u;
    const int64_t D = a.D;
#if defined(OPENMLA_TEST_HOOKS)
    if constexpr (std::is_same_v<T, float>) {
#if defined(OPENMLA_F32_TILES)
      f32_tiles_units().fetch_add(1, std::memory_order_relaxed);
#endif
    } else {
      bf16_tiles_units().fetch_add(1, std::memory_order_relaxed);
    }
#endif
    const bool in_place = plan.inplace || f32_rows_in_place();
    const T* zero = tile_zero_row();
    int32_t* PP = std::is_same_v<T, BFloat16> ? tile_pairs(w) : nullptr;
    T* keys = in_place ? nullptr : scratch<T>(S_KEYS, round_up(w.n_max, 16) * D);
    const uint8_t** ahead = in_place ? scratch<const uint8_t*>(S_KEYS, w.n_max) : nullptr;
    const int64_t stored = a.cache.stored_bytes();
    for (int64_t pos = u.k_lo; pos < u.k_hi;) {
      const KeyBlock kb = next_block(plan, a.cache.page_size, pos, u.k_hi);
      const int64_t ra = kb.a - kb.base, rb = kb.b - kb.base;
      for (int64_t r = 0; r < ra; ++r) w.rows[r] = zero;
      if (in_place) {
        for (int64_t r = ra; r < rb; ++r) w.rows[r] = reinterpret_cast<const T*>(a.cache.logical(u.b, kb.base + r));
      } else {
        for (int64_t r = ra; r < rb; ++r) {
          if (r + PACK_AHEAD < rb) prefetch_bytes(a.cache.logical(u.b, kb.base + r + PACK_AHEAD), stored);
          a.cache.load<T>(a.cache.logical(u.b, kb.base + r), keys + r * D, 0, D);
          w.rows[r] = keys + r * D;
        }
      }
      block_columns(w, kb);
      BlockPrefetch pf;
      if (in_place && kb.b < u.k_hi) {
        const KeyBlock nb = next_block(plan, a.cache.page_size, kb.b, u.k_hi);
        pf.rows = ahead;
        pf.n = nb.b - nb.a;
        pf.bytes = D * (int64_t)sizeof(T);
        for (int64_t r = 0; r < pf.n; ++r) ahead[r] = a.cache.logical(u.b, nb.a + r);
      }
      tile_products(w, w.rows, ra, rb, zero, PP, in_place, pf);
      pos = kb.b;
    }
  }

  // Sparse: this token's valid listed keys, compacted, in blocks.
  void walk_sparse(Unit& w) const {
    const DecodeUnit& u = w.u;
    const int64_t D = a.D, b = u.b, t = u.t0;
    T* Vp = w.direct || w.tiles ? nullptr : scratch<T>(S_VPACK, w.n_max * L());
    int32_t* PP = w.tiles && std::is_same_v<T, BFloat16> ? tile_pairs(w) : nullptr;
    const T* zero = w.tiles ? tile_zero_row() : nullptr;
    T* keys = scratch<T>(S_KEYS, round_up(w.n_max, 16) * D);
    const int64_t c = a.cache_lens[b], kv_len = c + (a.offsets[b + 1] - a.offsets[b]);
    const int64_t p = c + (t - a.offsets[b]);
    auto [lo, hi] = a.mask.key_range(p, p, kv_len);
    const int32_t* idx = a.sparse + t * a.sparse_stride;
    int64_t slot = u.k_lo;
#if defined(OPENMLA_TEST_HOOKS)
    if (w.tiles) (std::is_same_v<T, float> ? f32_tiles_units() : bf16_tiles_units()).fetch_add(1, std::memory_order_relaxed);
#endif
    while (slot < u.k_hi) {
      int64_t n = 0;
      for (; slot < u.k_hi && n < DECODE_BLOCK; ++slot) {
        const int64_t e = idx[slot];
        if (e < 0) continue;
        const uint8_t* src;
        if (a.physical) {
          src = a.cache.phys(e);
        } else {
          if (e < lo || e >= hi) continue;
          src = a.cache.logical(b, e);
        }
        a.cache.load<T>(src, keys + n * D, 0, D);
        w.rows[n] = keys + n * D;
        ++n;
      }
      if (n == 0) continue;
      std::fill(w.c0, w.c0 + w.M, 0);
      std::fill(w.c1, w.c1 + w.M, (int32_t)n);
      if (w.tiles) {
        tile_products(w, w.rows, 0, n, zero, PP, false);
        continue;
      }
      mm(w, round_up(n, 16), w.M, D, D, w.M, w.M, false, keys, w.QT, w.S);
      softmax(w, n);
      if (w.direct) pv_buffer(w, keys, n);
      else pv_packed(w, n, Vp, false);
    }
  }

  // A block's cache rows (null where not visible).
  void block_rows(int64_t b, const KeyBlock& kb, const T** rows) const {
    for (int64_t r = 0; r < kb.rows; ++r) {
      const int64_t p = kb.base + r;
      rows[r] = (p >= kb.a && p < kb.b) ? reinterpret_cast<const T*>(a.cache.logical(b, p)) : nullptr;
    }
  }

  // Whether P x V reads V rows as they are (bf16 on the own kernel, few query rows, whole
  // 32-column chunks): from the pages in place, or from the key buffer entries were converted to.
  bool direct_v(const Unit& w) const {
    return std::is_same_v<T, BFloat16> && w.own && w.M <= DIRECT_V_MAX_ROWS && L() % 32 == 0;
  }

  // P x V over a block's key groups of 16 (group g's first row at groups[g], rows ld_v apart):
  // P zero-interleaved into pe / po, then amx_pv_direct.
  void pv_direct(Unit& w, int64_t rows, int64_t g0, int64_t g1, const T* const* groups, int64_t ld_v) const {
#if defined(OPENMLA_OWN_AMX)
    if constexpr (std::is_same_v<T, BFloat16>) {
      const int64_t ldp = 2 * round_up(w.n_max, 32);
      T* pe = scratch<T>(S_VPACK, 2 * w.M * ldp);
      T* po = pe + w.M * ldp;
      zero_interleave(w.P + 16 * g0, round_up(rows, 32), w.M, 16 * (g1 - g0), pe + 32 * g0, po + 32 * g0, ldp);
      amx_pv_direct(w.M, L(), g1 - g0, pe + 32 * g0, po + 32 * g0, ldp, groups + g0, ld_v, w.O, L());
      return;
    }
#endif
    TORCH_CHECK(false, "openmla cpu: V read in place needs the own AMX kernel");
  }

  // V in place: whole key groups straight from the pages, the (at most two) groups the block
  // only partly sees staged with zeros for the rest (unwritten rows may hold anything).
  void pv_pages(Unit& w, const KeyBlock& kb, bool unseen = false) const {
    const int64_t L = this->L(), row_elems = a.cache.row_stride / (int64_t)sizeof(T);
    const T** groups = w.rows;
    const int64_t g0 = (kb.a - kb.base) / 16, g1 = ceil_div(kb.b - kb.base, 16);
    // staged: the groups a block only partly sees, and (unseen) those holding a flagged row, zeroed
    T* stage = scratch<T>(S_STAGE, (unseen ? g1 - g0 : 2) * 16 * row_elems);
    auto flagged = [&](int64_t r) { return unseen && (w.unseen[r >> 6] >> (r & 63) & 1); };
    int64_t staged = 0;
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p0 = kb.base + 16 * g;
      bool whole = p0 >= kb.a && p0 + 16 <= kb.b;
      for (int64_t r = 16 * g; whole && unseen && r < 16 * g + 16; ++r) whole = !flagged(r);
      if (whole) {
        groups[g] = reinterpret_cast<const T*>(a.cache.logical(w.u.b, p0));
        continue;
      }
      T* st = stage + (staged++) * 16 * row_elems;
      for (int64_t r = 0; r < 16; ++r) {
        const int64_t p = p0 + r;
        if (p >= kb.a && p < kb.b && !flagged(16 * g + r)) std::memcpy(st + r * row_elems, a.cache.logical(w.u.b, p), L * sizeof(T));
        else zero_fill(st + r * row_elems, L * sizeof(T));
      }
      groups[g] = st;
    }
    pv_direct(w, kb.rows, g0, g1, groups, row_elems);
  }

  // V from the key buffer (n rows of D, every one visible); rows up to the next 16 zeroed.
  void pv_buffer(Unit& w, T* keys, int64_t n) const {
    const int64_t D = a.D, n16 = round_up(n, 16);
    zero_fill(keys + n * D, (n16 - n) * D * sizeof(T));
    const T** groups = w.rows;
    for (int64_t g = 0; g < n16 / 16; ++g) groups[g] = keys + 16 * g * D;
    pv_direct(w, n, 0, n16 / 16, groups, D);
  }

  bool own_amx_unit(int64_t M) const {
    if (!std::is_same_v<T, BFloat16> || !own_amx_enabled()) return false;
    if (M % 16 != 0 || a.D % 32 != 0 || L() % 16 != 0) return false;
    return !plan.inplace || a.cache.page_size % 16 == 0;
  }

  void finish(const DecodeUnit& u, const float* O, const float* ref, const float* sum) const {
    const int64_t M = (int64_t)u.nt * u.nh, L = this->L();
    const DecodeGroup& g = plan.groups[u.group];
    T* out = static_cast<T*>(a.out);
    if (g.nparts == 1) {
      for (int64_t m = 0; m < M; ++m) {
        const int64_t row = (u.t0 + m / u.nh) * a.H + u.h0 + m % u.nh;
        finish_row(O + m * L, L, ref[m], sum[m], sink_of(u.b, u.h0 + m % u.nh), out + row * L, a.lse + row, a.out_scale);
      }
      return;
    }
    const int64_t base = g.partial + (int64_t)u.part * M;
    for (int64_t m = 0; m < M; ++m) {
      finish_row(O + m * L, L, ref[m], sum[m], std::numeric_limits<float>::quiet_NaN(), partial_o + (base + m) * L,
                 partial_lse + base + m);
    }
    if (done[u.group].fetch_add(1, std::memory_order_acq_rel) + 1 != g.nparts) return;
    // Last part of the group: merge every part's rows.
    float* acc = scratch<float>(S_SCORES, L);  // the unit's scores are no longer needed
    std::vector<const float*> po(g.nparts);
    std::vector<float> pl(g.nparts);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t p = 0; p < g.nparts; ++p) {
        po[p] = partial_o + (g.partial + p * M + m) * L;
        pl[p] = partial_lse[g.partial + p * M + m];
      }
      auto [r, s] = merge_parts(po.data(), pl.data(), g.nparts, L, acc);
      const int64_t row = (u.t0 + m / u.nh) * a.H + u.h0 + m % u.nh;
      finish_row(acc, L, r, s, sink_of(u.b, u.h0 + m % u.nh), out + row * L, a.lse + row, a.out_scale);
    }
  }
};

template <typename T>
void run_decode(const DecodeArgs& a) {
  const DecodePlan plan = plan_decode(a, decode_inplace<T>(a));
  std::unique_ptr<float[]> partial(new float[plan.partial_rows * (a.cache.L + 1) + 1]);  // every row is written
  std::unique_ptr<std::atomic<int32_t>[]> done(new std::atomic<int32_t>[plan.groups.size() + 1]);
  for (size_t g = 0; g < plan.groups.size(); ++g) done[g].store(0);
  DecodeKernel<T> k{a, plan, partial.get(), partial.get() + plan.partial_rows * a.cache.L, done.get()};
  run_units((int64_t)plan.units.size(), plan.work_s, std::is_same_v<T, BFloat16>, [&](int64_t i) { k.run(plan.units[i]); });
}

}  // namespace openmla
