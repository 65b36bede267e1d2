// ggml's FLASH_ATTN_EXT on MLA decode shapes, timed on ggml's CPU backend (bench/bench_ggml.py builds and runs it).
//
// Usage: ggml_flash_attn TYPE H B S THREADS REPS
//   TYPE: f32 | f16 | bf16 | q8_0 (the K cache; V is a view of K's first 512 values, as llama.cpp runs MLA)
//   one new query token per sequence, H query heads over one latent KV head (K = 576, V = 512), B sequences of
//   S + 1 keys each, no mask (a decode token sees its whole context)
// Prints one line per timed repetition: "wall_ms cpu_ms" (process CPU time).

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <vector>

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

static double cpu_ms() {
    timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static void fill(ggml_tensor* t, std::mt19937& rng, float sigma) {
    const int64_t n = ggml_nelements(t), row = t->ne[0];
    std::normal_distribution<float> dist(0.0f, sigma);
    std::vector<float> src(n);
    for (auto& x : src) x = dist(rng);
    std::vector<uint8_t> dst(ggml_nbytes(t));
    ggml_quantize_chunk(t->type, src.data(), dst.data(), 0, n / row, row, nullptr);  // f32/f16/bf16 convert, q8_0 quantizes
    ggml_backend_tensor_set(t, dst.data(), 0, dst.size());
}

int main(int argc, char** argv) {
    if (argc != 7) {
        std::fprintf(stderr, "usage: %s f32|f16|bf16|q8_0 H B S THREADS REPS\n", argv[0]);
        return 2;
    }
    const std::string name = argv[1];
    const ggml_type type = name == "f32" ? GGML_TYPE_F32 : name == "f16" ? GGML_TYPE_F16
                         : name == "bf16" ? GGML_TYPE_BF16 : name == "q8_0" ? GGML_TYPE_Q8_0 : GGML_TYPE_COUNT;
    if (type == GGML_TYPE_COUNT) {
        std::fprintf(stderr, "unknown type %s\n", name.c_str());
        return 2;
    }
    const int64_t H = std::atoll(argv[2]), B = std::atoll(argv[3]), S = std::atoll(argv[4]);
    const int threads = std::atoi(argv[5]), reps = std::atoi(argv[6]);
    const int64_t DK = 576, DV = 512, KV = S + 1;

    ggml_init_params params = {ggml_tensor_overhead() * 16 + ggml_graph_overhead(), nullptr, true};
    ggml_context* ctx = ggml_init(params);
    ggml_tensor* q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, DK, 1, H, B);  // [head dim, tokens, heads, sequences]
    ggml_tensor* k = ggml_new_tensor_4d(ctx, type, DK, KV, 1, B);
    ggml_tensor* v = ggml_view_4d(ctx, k, DV, KV, 1, B, k->nb[1], k->nb[2], k->nb[3], 0);
    ggml_tensor* out = ggml_flash_attn_ext(ctx, q, k, v, nullptr, 1.0f / std::sqrt(192.0f), 0.0f, 0.0f);
    ggml_flash_attn_ext_set_prec(out, GGML_PREC_F32);
    ggml_cgraph* gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);

    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(backend, threads);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    std::mt19937 rng(0);
    fill(q, rng, 0.3f);
    fill(k, rng, 1.0f);

    ggml_backend_graph_compute(backend, gf);  // warm-up: thread pool, pages touched
    for (int r = 0; r < reps; ++r) {
        const double c0 = cpu_ms();
        const auto t0 = std::chrono::steady_clock::now();
        ggml_backend_graph_compute(backend, gf);
        const auto t1 = std::chrono::steady_clock::now();
        const double c1 = cpu_ms();
        std::printf("%.4f %.4f\n", std::chrono::duration<double, std::milli>(t1 - t0).count(), c1 - c0);
    }
    ggml_backend_buffer_free(buf);
    ggml_backend_free(backend);
    ggml_free(ctx);
    return 0;
}
