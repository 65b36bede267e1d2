"""The calls one decode-step layer makes from ``MLAPlan.run`` to the kernels (no timing).

Run: ``.venv/bin/python bench/calls_per_step.py [--backend cpu] [--tree]``

DeepSeek-V3 attention dims of a TP=8 shard (H=16, L=512, R=64, Dn=128, Dv=128), 4 sequences of
5-100 cached tokens and one new token each. After one warm call, a profiler hook counts the
Python calls (openmla's and all) and the C calls of one more ``plan.run``; ``--tree`` prints the
openmla frames as a call tree, with the torch operator calls that enter a kernel.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import openmla  # noqa: E402
from openmla_tools.testing import make_case, small_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--tree", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = small_config(num_heads=16, L=512, R=64, Dn=128, Dv=128)
    case = make_case([100, 37, 64, 5], [1, 1, 1, 1], config=cfg, seed=1)
    plan = openmla.plan(case.batch, scale=case.scale, backend=args.backend)
    run_args = case.run_args()
    plan.run(*run_args)  # warm: native build, packed weights, first-use tensors
    events: list[tuple[int, str, str]] = []
    depth = [0]

    def hook(frame, event, arg):
        if event == "call":
            depth[0] += 1
            events.append((depth[0], frame.f_globals.get("__name__", "?"), frame.f_code.co_name))
        elif event == "return":
            depth[0] -= 1
        elif event == "c_call":
            events.append((depth[0] + 1, "C", getattr(arg, "__qualname__", getattr(arg, "__name__", "?"))))

    sys.setprofile(hook)
    plan.run(*run_args)
    sys.setprofile(None)
    py = [e for e in events if e[1] != "C"]
    ours = [e for e in py if e[1].startswith("openmla")]
    print(f"backend {plan.backend_name}, form {plan.form}: {len(py)} Python calls ({len(ours)} openmla), "
          f"{len(events) - len(py)} C calls")
    if args.tree:
        for d, mod, name in events:
            if mod.startswith("openmla"):
                print("  " * (d - 1) + f"{mod.removeprefix('openmla.')}.{name}")
            elif mod == "torch._ops" and name == "__call__":
                print("  " * (d - 1) + "-> torch.ops (kernel)")


if __name__ == "__main__":
    main()
