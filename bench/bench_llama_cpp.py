"""openmla's decode beside ggml's ``FLASH_ATTN_EXT`` (llama.cpp's attention op) at MLA shapes.

Run: ``.venv/bin/python bench/bench_llama_cpp.py --ggml PATH [--threads 2] [--rounds 3] [--reps 5]``

Nothing is fetched: ``--ggml`` names a local llama.cpp or ggml checkout that has been built for the
CPU. How to build one (any recent llama.cpp or ggml; the ggml tree that llama.cpp vendors works
the same way):

    git clone https://github.com/ggml-org/llama.cpp && cd llama.cpp      # or ggml-org/ggml
    cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=ON   # ggml: -DGGML_BUILD_TESTS=ON
    cmake --build build --target test-backend-ops -j

That builds ``libggml*.so`` (llama.cpp: ``build/bin``; ggml: ``build/src``) and ggml's own op
benchmark ``test-backend-ops`` (``build/bin/test-backend-ops perf -o FLASH_ATTN_EXT -b CPU`` times
its built-in cases, none of them at MLA widths). This script instead compiles
``bench/ggml_fa_mla.c`` (a 100-line driver over ggml's public API) against those headers and
libraries and times ``ggml_flash_attn_ext`` with DeepSeek's absorbed MLA shapes: q ``[576, 1, H,
B]`` float32, one KV head, K ``[576, S, 1, B]`` in the named type, V a view of K's first 512
values (as llama.cpp's MLA path passes it), no mask, ``GGML_PREC_F32``, on ``--threads`` threads.

openmla's side: the native op (``kernels.decode``) on the same shapes with the cache format that
matches: f32 -> float32 cache, f16 -> float16 cache, bf16 -> bf16 cache (openmla's compute type
follows the CPU: bf16 products on AVX512-BF16, float32 elsewhere). q8_0 has **no equivalent** in
openmla (per-32-value int8 blocks with an f16 scale); the 8-bit row beside it is openmla's
``fp8_e4m3`` (one scale per layer), named as such. Rounds alternate ggml and openmla in a shuffled
order; each reports its best and median of ``--reps`` calls; the ratio is ggml's best over
openmla's best. JSON: ``bench/out/llama_cpp.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
OUT = HERE / "out" / "llama_cpp.json"
SHAPES = ["16:1x4096", "16:8x4096", "128:1x4096", "128:8x4096"]
TYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "q8_0": "fp8_e4m3"}


def find_ggml(root: Path) -> tuple[Path, Path]:
    """(include dir, library dir) of a built llama.cpp or ggml checkout."""
    inc = next((p for p in (root / "ggml" / "include", root / "include") if (p / "ggml.h").exists()), None)
    lib = next((p for p in (root / "build" / "bin", root / "build" / "src", root / "build" / "ggml" / "src", root / "build")
                if any(p.glob("libggml-cpu*"))), None)
    if inc is None or lib is None:
        sys.exit(f"no ggml.h or libggml-cpu under {root}: build it first (see this script's docstring)")
    return inc, lib


def build_driver(inc: Path, lib: Path, tmp: Path) -> Path:
    exe = tmp / "ggml_fa_mla"
    cmd = ["cc", "-O2", "-o", str(exe), str(HERE / "ggml_fa_mla.c"), f"-I{inc}", f"-L{lib}", "-lggml", "-lggml-base",
           "-lggml-cpu", f"-Wl,-rpath,{lib}"]
    subprocess.run(cmd, check=True)
    return exe


def openmla_case(H: int, B: int, S: int, fmt, page: int = 64):
    from openmla.backends.cpu import kernels
    from openmla.masks import MaskVariant

    g = torch.Generator().manual_seed(0)
    per = -(-S // page)
    vals = torch.rand(B * per, page, 576, generator=g) * 2 - 1
    if fmt == "fp8_e4m3":
        pages, code, qdt = vals.to(torch.float8_e4m3fn).view(torch.uint8), kernels.FORMAT_CODES["fp8_e4m3"], torch.bfloat16
    else:
        pages, code, qdt = vals.to(fmt), kernels.FORMAT_CODES[fmt], fmt
    dtype = kernels.compute_dtype(qdt)
    table = torch.randperm(B * per, generator=g).to(torch.int32).view(B, per).contiguous()
    layer = kernels.PagedLayer(pages, table, torch.full((B,), S - 1, dtype=torch.int32), torch.arange(B + 1, dtype=torch.int32),
                               code)
    q = ((torch.rand(B, H, 576, generator=g) * 2 - 1) * 0.3).to(dtype)
    mask = MaskVariant()
    return lambda: kernels.decode(q, layer, kv_lora_rank=512, scale=1 / 24, mask=mask, dtype=dtype), str(dtype).replace("torch.", "")


def time_openmla(fn, reps: int) -> tuple[float, float]:
    fn()
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return min(t) * 1e3, statistics.median(t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ggml", type=Path, required=True, help="a built llama.cpp or ggml checkout")
    ap.add_argument("--ggml-lib", type=Path, help="the folder of libggml*.so when the build is not under --ggml/build")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--shapes", nargs="+", default=SHAPES)
    ap.add_argument("--types", nargs="+", default=list(TYPES), choices=list(TYPES))
    args = ap.parse_args()
    sys.path.insert(0, str(HERE.parent / "src"))
    torch.set_num_threads(args.threads)
    inc, lib = find_ggml(args.ggml.resolve())
    lib = args.ggml_lib.resolve() if args.ggml_lib else lib
    res: dict = {"threads": args.threads, "loadavg_before": os.getloadavg(), "ggml": str(args.ggml), "ggml_lib": str(lib),
                 "utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "rows": {}}
    with tempfile.TemporaryDirectory() as tmp:
        exe = build_driver(inc, lib, Path(tmp))
        cases = {}
        for s in args.shapes:
            h, bs = s.split(":")
            b, n = bs.split("x")
            for t in args.types:
                cases[(s, t)] = (int(h), int(b), int(n))
        runs: dict = {k: {"ggml": [], "openmla": []} for k in cases}
        fns = {}
        for _ in range(args.rounds):
            order = [(k, impl) for k in cases for impl in ("ggml", "openmla")]
            random.shuffle(order)
            for (s, t), impl in order:
                H, B, S = cases[(s, t)]
                if impl == "ggml":
                    out = subprocess.run([str(exe), str(H), str(B), str(S), t, str(args.threads), str(args.reps)],
                                         capture_output=True, text=True, check=True).stdout.split()
                    runs[(s, t)]["ggml"].append((float(out[0]), float(out[1])))
                else:
                    if (s, t) not in fns:
                        fns[(s, t)] = openmla_case(H, B, S, TYPES[t])
                    runs[(s, t)]["openmla"].append(time_openmla(fns[(s, t)][0], args.reps))
    print(f"threads {args.threads}, load {os.getloadavg()[0]:.2f}; best ms (median of rounds' medians)")
    for (s, t), r in runs.items():
        g_best, o_best = min(x[0] for x in r["ggml"]), min(x[0] for x in r["openmla"])
        g_med, o_med = statistics.median(x[1] for x in r["ggml"]), statistics.median(x[1] for x in r["openmla"])
        om_fmt = "fp8_e4m3 (q8_0 has no equivalent)" if t == "q8_0" else t
        res["rows"][f"{s} {t}"] = {"ggml_best_ms": g_best, "ggml_median_ms": g_med, "openmla_best_ms": o_best,
                                   "openmla_median_ms": o_med, "openmla_cache": om_fmt, "openmla_compute": fns[(s, t)][1],
                                   "ratio_best": g_best / o_best, "ratio_median": g_med / o_med}
        print(f"  {s:>11} K/V {t:>5}: ggml {g_best:8.2f} ({g_med:8.2f})  openmla [{om_fmt}, {fns[(s, t)][1]}] "
              f"{o_best:7.2f} ({o_med:7.2f})  ggml / openmla {g_best / o_best:5.1f}x ({g_med / o_med:4.1f}x)")
    res["loadavg_after"] = os.getloadavg()
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
