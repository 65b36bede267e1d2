"""Resource use of a compiled kernel, read from what the toolchain reports.

NVIDIA: ``ptxas -v`` (Triton runs it with ``-v``; its log is printed when
``TRITON_DUMP_PTXAS_LOG`` is on): registers per thread, stack frame, spill stores and loads, and
static shared memory; Triton's dynamic shared memory is ``metadata.shared``.

AMD: the amdgcn assembly's kernel metadata and LLVM's summary comments: VGPRs (arch + acc,
unified on gfx942), AGPRs, SGPRs, VGPR spills (to scratch memory), SGPR spills (into VGPR lanes,
or scratch when none is free), scratch bytes per lane, and LLVM's own wave occupancy (registers
only); LDS is ``metadata.shared`` (Triton allocates it at launch).
"""

from __future__ import annotations

import re

_PTXAS = {
    "regs": r"Used (\d+) registers",
    "stack": r"(\d+) bytes stack frame",
    "spill_stores": r"(\d+) bytes spill stores",
    "spill_loads": r"(\d+) bytes spill loads",
    "static_smem": r"(\d+) bytes smem",
}

_AMDGCN = {
    "vgprs": r"^; TotalNumVgprs: (\d+)",
    "agprs": r"^; NumAgprs: (\d+)",
    "sgprs": r"^; TotalNumSgprs: (\d+)",
    "scratch": r"^; ScratchSize: (\d+)",
    "llvm_occupancy": r"^; Occupancy: (\d+)",
    "vgpr_spills": r"^\s+\.vgpr_spill_count:\s+(\d+)",
    "sgpr_spills": r"^\s+\.sgpr_spill_count:\s+(\d+)",
}


def _first_ints(patterns: dict, text: str) -> dict:
    out = {}
    for key, pattern in patterns.items():
        m = re.search(pattern, text, re.MULTILINE)
        out[key] = int(m.group(1)) if m else None
    return out


def nvidia_usage(ptxas_log: str, shared: int) -> dict:
    """Registers, spills and shared memory from one kernel's ``ptxas -v`` log."""
    use = _first_ints(_PTXAS, ptxas_log)
    if use["regs"] is None:
        raise ValueError("no 'Used N registers' line in the ptxas log (was the kernel compiled, not read from a cache?)")
    use = {k: v or 0 for k, v in use.items()}
    use["smem"] = shared + use.pop("static_smem")
    return use


def amd_usage(amdgcn: str, shared: int) -> dict:
    """Registers, spills, scratch and LDS from one kernel's amdgcn assembly."""
    use = _first_ints(_AMDGCN, amdgcn)
    if use["vgprs"] is None or use["sgprs"] is None:
        raise ValueError("no register summary in the amdgcn assembly")
    use = {k: v or 0 for k, v in use.items()}
    use["smem"] = shared
    return use
