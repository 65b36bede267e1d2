"""What ``openmla.hf.attach``'s self-check costs: attach with it (``verify=True``) against without.

Run: ``.venv/bin/python bench/bench_attach_check.py [--v3-dtype bfloat16] [--reps 3] [--threads 2]``

- ``v3-layer``: one DeepSeek-V3-shaped decoder layer (H=128, hidden 7168, q LoRA 1536, L=512,
  R=64, Dn=Dv=128, its dense MLP of 18432; vocab cut to 256: the embeddings take no part in the
  check), random weights, the same model attached again each repetition;
- ``tiny <family>``: every preset family's test-size model (hidden 64, 2-4 layers, float32).

Process CPU time (holds when another process shares the box) and wall time, the best of
``--reps``; the check's cost is the difference. Results go to bench/RESULTS.md by hand.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
import transformers

from openmla.hf import attach, detach, presets
from openmla.hf.presets import PRESETS


def timed(model, verify: bool, reps: int, pages: int = 16, page_size: int = 16) -> tuple[float, float]:
    best = (float("inf"), float("inf"))
    for _ in range(reps):
        c0, w0 = time.process_time(), time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            attach(model, num_pages=pages, page_size=page_size, verify=verify)
        c1, w1 = time.process_time(), time.perf_counter()
        detach(model)
        best = min(best, (c1 - c0, w1 - w0))
    return best


def v3_layer(dtype: torch.dtype) -> torch.nn.Module:
    cfg = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=7168, intermediate_size=18432, num_hidden_layers=1, num_attention_heads=128,
        num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, first_k_dense_replace=1, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None)
    torch.manual_seed(0)
    return transformers.DeepseekV3ForCausalLM._from_config(cfg, dtype=dtype).eval()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--v3-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--skip-tiny", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {args.threads} threads")
    print(f"{'model':28} {'cpu s (no check)':>17} {'cpu s (check)':>14} {'wall s (no check)':>18} {'wall s (check)':>15}")
    rows = [("v3-layer " + args.v3_dtype, v3_layer(getattr(torch, args.v3_dtype)))]
    if not args.skip_tiny:
        rows += [("tiny " + name, presets.build(name, "test")) for name in sorted(PRESETS)]
    for name, model in rows:
        plain, checked = timed(model, False, args.reps), timed(model, True, args.reps)
        print(f"{name:28} {plain[0]:17.3f} {checked[0]:14.3f} {plain[1]:18.3f} {checked[1]:15.3f}")


if __name__ == "__main__":
    main()
