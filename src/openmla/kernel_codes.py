"""The integer codes the kernels take, defined once for Python and C++: cache formats and mask kinds.

The format codes are the format objects' (``openmla.formats``: ``CacheFormat.codes``, one per
storage dtype a native kernel reads), the mask codes are ``MASKS`` below. Python reads them as
``FORMAT_CODES`` (a native format keyed by its storage dtype, the others by name) and
``MASK_CODES``; the cpu backend's build (``backends/cpu/build.py``) writes ``header()`` into its
build folder as ``codes.h`` before compiling, which ``csrc/common.h`` includes, so the C++ enums
``CacheFormat`` (``FMT_*``) and ``MaskKind`` are this table. The Triton kernels take the mask codes
too (their format switch is their own constexpr).
"""

from __future__ import annotations

import torch

from .formats import FORMATS
from .masks import MaskKind

__all__ = ["FORMAT_CODES", "MASK_CODES", "MASKS", "header"]

# mask kind -> (C++ enumerator, code)
MASKS: dict[MaskKind, tuple[str, int]] = {
    MaskKind.CAUSAL: ("CAUSAL", 0),
    MaskKind.NULL: ("NULL_MASK", 1),
    MaskKind.SLIDING_WINDOW_CAUSAL: ("SLIDING_CAUSAL", 2),
    MaskKind.SLIDING_WINDOW_NONCAUSAL: ("SLIDING_NONCAUSAL", 3),
    MaskKind.CHUNKED_CAUSAL: ("CHUNKED", 4),
}
MASK_CODES: dict[MaskKind, int] = {kind: code for kind, (_, code) in MASKS.items()}


def _format_enumerators() -> list[tuple[torch.dtype | str, str, int]]:
    """(key, C++ enumerator, code) of every format code, in code order."""
    out = []
    for fmt in FORMATS.values():
        for dtype, code in zip(fmt.storage, fmt.codes):
            if code is not None:
                out.append((dtype if fmt.is_native else fmt.name, *code))
    return sorted(out, key=lambda e: e[2])


FORMAT_CODES: dict[torch.dtype | str, int] = {key: code for key, _, code in _format_enumerators()}


def header() -> str:
    """The C++ header of both enums (``codes.h``), generated from these tables."""
    def enum(name: str, items: list[tuple[str, int]]) -> str:
        return f"enum {name} : int64_t {{ " + ", ".join(f"{n} = {c}" for n, c in items) + " };"

    return "\n".join([
        "// Generated from openmla.kernel_codes by backends/cpu/build.py before each build: do not edit.",
        "#pragma once",
        "",
        "#include <cstdint>",
        "",
        "namespace openmla {",
        "",
        "// Cache formats (openmla.formats): native entries, fp8_e4m3 (entry / kv_scale), fp8_ds_mla records",
        "// (L fp8 latent values, L/128 float32 scales, R bfloat16 rope values), the two NVFP4 records.",
        enum("CacheFormat", [(n, c) for _, n, c in _format_enumerators()]),
        "",
        "// Mask kinds (openmla.masks): same kinds and rule as the Python masks.",
        enum("MaskKind", list(MASKS.values())),
        "",
        "}  // namespace openmla",
        "",
    ])
