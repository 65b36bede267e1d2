"""openmla's decode against llama.cpp's ggml ``FLASH_ATTN_EXT`` on the same MLA shapes, alternating runs.

Run: ``.venv/bin/python bench/bench_ggml.py --ggml PATH [--threads 2] [--rounds 3] [--reps 5]
[--shapes 16:1x4096 ...] [--types f32 f16 bf16 q8_0]``

Nothing is fetched at run time. ``PATH`` is a ggml checkout built with CMake (llama.cpp's ``ggml/``
folder, or the ggml repository), built for this CPU, e.g.::

    git clone https://github.com/ggml-org/llama.cpp && cd llama.cpp/ggml   # (or ggml-org/ggml)
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF
    cmake --build build -j   # libggml-base, libggml-cpu, libggml

(llama.cpp's ``test-backend-ops perf -o FLASH_ATTN_EXT`` times the same operator, but only on its
built-in shape list; this script compiles ``bench/ggml_flash_attn.cpp`` against the build instead,
so the shapes are exactly the ones below.)

Shapes ``H:BxS`` (one new token per sequence, H query heads over one latent KV head, S cached
tokens + the new one: S + 1 keys, K = 576, V = K's first 512 as llama.cpp runs MLA; scale
1/sqrt(192)). Cache formats side by side:

| ggml K/V | openmla cache | equivalent? |
|---|---|---|
| f32 | float32 | yes |
| f16 | float16 | yes |
| bf16 | bfloat16 | yes |
| q8_0 (int8, a scale per 32 values) | fp8_e4m3 (one scale per layer) | no: the nearest 8-bit format openmla has |

openmla runs ``plan.decode`` on a plan made once (an engine's per-layer call: the kernel, its
wrappers and output allocation), absorbed queries in the type ggml multiplies them in: ggml takes
float32 queries and converts them to K's dot type (``q_to_vec_dot`` in ggml-cpu's flash attention:
f16, bf16, q8_0), so openmla gets float16 / bfloat16 queries for those caches (a float32 query is
multiplied in float32 by openmla, never rounded: half bf16's speed) and float32 for f32 and fp8,
page size 64, pages in a shuffled order. Each round times ggml (a fresh process, ``--reps``
repetitions after a warm-up) then openmla (``--reps`` repetitions) in alternating order; the
figure is the best repetition of all rounds, wall time with ``--threads`` threads and process
CPU time (which holds when other processes share the box). Ratios are ggml time / openmla time
(above 1: openmla faster). ``--ab`` (the kernels' test build) times openmla twice per round,
its register tiles on and off (off: brgemm, the kernel before them), columns ``brgemm ms`` and
``x brgemm``. JSON: ``bench/out/ggml.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"
L, R, PAGE = 512, 64, 64
SHAPES = ["16:1x4096", "16:8x4096", "128:1x4096", "128:8x4096", "16:1x32768"]
OPENMLA_FORMAT = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "q8_0": "fp8_e4m3"}


def parse(shape: str) -> tuple[int, int, int]:
    h, bs = shape.split(":")
    b, s = bs.split("x")
    return int(h), int(b), int(s)


def build_driver(ggml: Path) -> Path:
    """Compile ``ggml_flash_attn.cpp`` against the ggml build under ``ggml`` (its ``include/`` and ``build/``)."""
    include = next((p for p in (ggml / "include", ggml / "ggml" / "include") if (p / "ggml.h").exists()), None)
    libs = sorted({p.parent for p in ggml.rglob("libggml-base.so")})
    if include is None or not libs:
        raise SystemExit(f"--ggml {ggml}: no include/ggml.h or no built libggml-base.so under it (build it first: see --help)")
    OUT.mkdir(exist_ok=True)
    exe = OUT / "ggml_flash_attn"
    lib = libs[0]
    cmd = ["g++", "-O2", "-std=c++17", str(HERE / "ggml_flash_attn.cpp"), f"-I{include}", f"-L{lib}", "-lggml", "-lggml-cpu",
           "-lggml-base", f"-Wl,-rpath,{lib}", "-o", str(exe)]
    subprocess.run(cmd, check=True)
    return exe


def ggml_times(exe: Path, kind: str, H: int, B: int, S: int, threads: int, reps: int) -> list[tuple[float, float]]:
    out = subprocess.run([str(exe), kind, str(H), str(B), str(S), str(threads), str(reps)], check=True,
                         capture_output=True, text=True).stdout
    return [(float(w) / 1e3, float(c) / 1e3) for w, c in (line.split() for line in out.strip().splitlines())]


def openmla_step(kind: str, H: int, B: int, S: int, seed: int = 0):
    """A plan over ``B`` sequences of ``S`` cached random entries in openmla's format matching ``kind``, and q."""
    import openmla
    from openmla.fp8 import quantize_e4m3

    fmt = OPENMLA_FORMAT[kind]
    pages = B * -(-(S + 1) // PAGE) + 4
    kv_scale = 0.05
    cache = openmla.PagedLatentCache(1, pages, page_size=PAGE, head_dim=L + R, dtype=fmt, kv_scale=kv_scale)
    g = torch.Generator().manual_seed(seed)
    cache.allocator._free = torch.randperm(pages, generator=g).tolist()
    entries = torch.randn(pages * PAGE, L + R, generator=g)
    stored = quantize_e4m3(entries, kv_scale) if fmt == "fp8_e4m3" else entries.to(fmt)
    cache.blocks.view(-1, cache.blocks.shape[-1]).copy_(stored)
    ids = list(range(B))
    cache.commit(cache.prepare(ids, [S] * B))
    batch = cache.prepare(ids, [1] * B)
    q = torch.randn(B, H, L + R, generator=g) * 0.3
    if fmt in (torch.float16, torch.bfloat16):
        q = q.to(fmt)  # as ggml rounds its float32 queries to K's type
    step = openmla.plan(batch, scale=192 ** -0.5, backend="cpu")
    return lambda: step.decode(q, 0, kv_lora_rank=L)


def openmla_times(fn, reps: int) -> list[tuple[float, float]]:
    fn()
    times = []
    for _ in range(reps):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        times.append((time.perf_counter() - w0, time.process_time() - c0))
    return times


def roofline(threads: int) -> tuple[float, float]:
    """This run's bf16 2048^3 matmul rate (FLOP/s) and copy bandwidth (bytes/s), best of 5, ``threads`` threads."""
    a, b = torch.randn(2048, 2048).bfloat16(), torch.randn(2048, 2048).bfloat16()
    x = torch.ones(256 << 20, dtype=torch.uint8)
    y = torch.zeros_like(x)
    mm, cp = [], []
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        mm.append(time.perf_counter() - t)
        t = time.perf_counter()
        y.copy_(x)
        cp.append(time.perf_counter() - t)
    return 2 * 2048 ** 3 / min(mm), 2 * (256 << 20) / min(cp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ggml", type=Path, required=True, help="a ggml checkout with a CMake build (see above)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shapes", nargs="+", default=SHAPES)
    ap.add_argument("--types", nargs="+", default=list(OPENMLA_FORMAT), choices=list(OPENMLA_FORMAT))
    ap.add_argument("--ab", action="store_true", help="openmla with its register tiles on and off (test build)")
    args = ap.parse_args()
    variants = ["tiles", "brgemm"] if args.ab else ["tiles"]
    if args.ab:
        os.environ["OPENMLA_CPU_TEST_HOOKS"] = "1"
    from openmla.backends.cpu import build

    def use(v: str) -> None:
        if args.ab:
            build.ops().set_bf16_tiles(v == "tiles")
            build.ops().set_f32_tiles(v == "tiles")

    exe = build_driver(args.ggml.resolve())
    torch.set_num_threads(args.threads)
    rate, bw = roofline(args.threads)
    print(f"{args.threads} threads; this run: bf16 matmul {rate / 1e9:.0f} GFLOP/s, copy {bw / 1e9:.1f} GB/s")
    print(f"{'shape':>12} {'K/V':>5} {'ggml ms':>9} {'openmla ms':>11} {'x (wall)':>9} {'x (cpu)':>8}"
          + (f" {'brgemm ms':>10} {'x brgemm':>9}" if args.ab else ""))
    rows = []
    for shape in args.shapes:
        H, B, S = parse(shape)
        for kind in args.types:
            fn = openmla_step(kind, H, B, S)
            ggml_t, ours_t, before_t = [], [], []
            for r in range(args.rounds):
                first, second = (("ggml", "openmla") if r % 2 == 0 else ("openmla", "ggml"))
                for who in (first, second):
                    if who == "ggml":
                        ggml_t += ggml_times(exe, kind, H, B, S, args.threads, args.reps)
                    else:
                        for v in variants if r % 2 == 0 else variants[::-1]:
                            use(v)
                            (ours_t if v == "tiles" else before_t).extend(openmla_times(fn, args.reps))
                        use("tiles")
            gw, gc = min(t[0] for t in ggml_t), min(t[1] for t in ggml_t)
            ow, oc = min(t[0] for t in ours_t), min(t[1] for t in ours_t)
            row = dict(shape=shape, kv=kind, openmla_format=str(OPENMLA_FORMAT[kind]), ggml_wall_ms=gw * 1e3,
                       ggml_cpu_ms=gc * 1e3, openmla_wall_ms=ow * 1e3, openmla_cpu_ms=oc * 1e3, ratio_wall=gw / ow,
                       ratio_cpu=gc / oc)
            extra = ""
            if before_t:
                bw_, bc_ = min(t[0] for t in before_t), min(t[1] for t in before_t)
                row.update(brgemm_wall_ms=bw_ * 1e3, brgemm_cpu_ms=bc_ * 1e3, ratio_wall_brgemm=gw / bw_, ratio_cpu_brgemm=gc / bc_)
                extra = f" {bw_ * 1e3:10.2f} {gw / bw_:9.2f}"
            rows.append(row)
            print(f"{shape:>12} {kind:>5} {gw * 1e3:9.2f} {ow * 1e3:11.2f} {gw / ow:9.2f} {gc / oc:8.2f}{extra}", flush=True)
    OUT.mkdir(exist_ok=True)
    (OUT / "ggml.json").write_text(json.dumps(dict(threads=args.threads, matmul_bf16=rate, copy=bw, rows=rows), indent=1))


if __name__ == "__main__":
    main()
