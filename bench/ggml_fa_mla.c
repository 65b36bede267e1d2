// ggml's FLASH_ATTN_EXT at MLA decode shapes, timed on the CPU backend (bench/bench_llama_cpp.py
// compiles this against a local llama.cpp or ggml build; nothing is fetched).
//
// Usage: ggml_fa_mla H B S TYPE THREADS REPS
//   q [576, 1, H, B] f32; K [576, S, 1, B] of TYPE (f32, f16, bf16, q8_0); V a view of K's
//   first 512 values (one KV head, DeepSeek's absorbed MLA: the latent is both K and V);
//   no mask (every key visible). Prints one line: "best_ms median_ms".
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml-cpu.h"
#include "ggml.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static int cmp_double(const void* a, const void* b) {
  const double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

int main(int argc, char** argv) {
  if (argc != 7) {
    fprintf(stderr, "usage: %s H B S TYPE THREADS REPS\n", argv[0]);
    return 2;
  }
  const int64_t H = atoll(argv[1]), B = atoll(argv[2]), S = atoll(argv[3]);
  const char* tname = argv[4];
  const int threads = atoi(argv[5]), reps = atoi(argv[6]);
  enum ggml_type tk = GGML_TYPE_F16;
  if (!strcmp(tname, "f32")) tk = GGML_TYPE_F32;
  else if (!strcmp(tname, "f16")) tk = GGML_TYPE_F16;
  else if (!strcmp(tname, "bf16")) tk = GGML_TYPE_BF16;
  else if (!strcmp(tname, "q8_0")) tk = GGML_TYPE_Q8_0;
  else {
    fprintf(stderr, "unknown type %s\n", tname);
    return 2;
  }
  const int64_t D = 576, L = 512;
  const size_t k_bytes = ggml_row_size(tk, D) * S * B;
  struct ggml_init_params ip = {.mem_size = k_bytes + (size_t)(D * H * B + L * H * B) * 4 + ((size_t)512 << 20),
                                .mem_buffer = NULL, .no_alloc = false};
  struct ggml_context* ctx = ggml_init(ip);
  struct ggml_tensor* q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, D, 1, H, B);
  struct ggml_tensor* k = ggml_new_tensor_4d(ctx, tk, D, S, 1, B);
  struct ggml_tensor* v = ggml_view_4d(ctx, k, L, S, 1, B, k->nb[1], k->nb[2], k->nb[3], 0);
  srand(1);
  float* row = malloc(sizeof(float) * D);
  for (int64_t i = 0; i < D * H * B; ++i) ((float*)q->data)[i] = 0.3f * ((float)rand() / RAND_MAX * 2 - 1);
  for (int64_t r = 0; r < S * B; ++r) {
    for (int64_t j = 0; j < D; ++j) row[j] = (float)rand() / RAND_MAX * 2 - 1;
    char* dst = (char*)k->data + r * k->nb[1];
    if (tk == GGML_TYPE_F32) memcpy(dst, row, D * sizeof(float));
    else if (tk == GGML_TYPE_F16) ggml_fp32_to_fp16_row(row, (ggml_fp16_t*)dst, D);
    else if (tk == GGML_TYPE_BF16) ggml_fp32_to_bf16_row(row, (ggml_bf16_t*)dst, D);
    else ggml_quantize_chunk(tk, row, dst, 0, 1, D, NULL);
  }
  struct ggml_tensor* out = ggml_flash_attn_ext(ctx, q, k, v, NULL, 1.0f / 24.0f, 0.0f, 0.0f);
  ggml_flash_attn_ext_set_prec(out, GGML_PREC_F32);
  struct ggml_cgraph* gf = ggml_new_graph(ctx);
  ggml_build_forward_expand(gf, out);
  ggml_graph_compute_with_ctx(ctx, gf, threads);  // warm-up
  double* t = malloc(sizeof(double) * reps);
  for (int i = 0; i < reps; ++i) {
    const double t0 = now_s();
    ggml_graph_compute_with_ctx(ctx, gf, threads);
    t[i] = now_s() - t0;
  }
  qsort(t, reps, sizeof(double), cmp_double);
  printf("%.4f %.4f\n", t[0] * 1e3, t[reps / 2] * 1e3);
  free(t);
  free(row);
  ggml_free(ctx);
  return 0;
}
