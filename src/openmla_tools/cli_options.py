"""What every ``openmla`` command's options mean (model dtypes, cache formats) and the console
they print to; shared by ``openmla_tools.cli`` and ``openmla_tools.hf.cli``."""

from __future__ import annotations

import argparse

import torch

try:
    from rich.console import Console
except ModuleNotFoundError as e:  # a plain ``pip install openmla``: the library without its tools
    if e.name != "rich":
        raise
    raise SystemExit("the openmla command needs the tools extra (rich, matplotlib): "
                     "pip install -e \".[tools]\" in a clone of openmla (or pip install rich)") from None

from openmla import hardware

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CACHE_DTYPES = ("same", "fp8_e4m3", "fp8_ds_mla", "nvfp4_ds_mla", "nvfp4_fp8rope")
AUTO_DTYPE_HELP = "model dtype (auto: bf16 where this CPU multiplies bf16 at full speed, else fp32)"

console = Console()


def model_dtype(args: argparse.Namespace) -> torch.dtype:
    """``--dtype``; ``auto`` asks ``openmla.hardware`` (bf16 where the CPU has bf16 dot products)."""
    return hardware.model_dtype(DTYPES.get(args.dtype))


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def cache_dtype(args: argparse.Namespace) -> str | None:
    """``--cache-dtype``: ``same`` stores entries in the model dtype (None), else a quantised format
    (fp8, or NVFP4 for L=512, R=64 models; ``openmla.formats``)."""
    return None if args.cache_dtype == "same" else args.cache_dtype
