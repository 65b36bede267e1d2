"""Compile and load the native CPU kernels (``csrc/``) with ``torch.utils.cpp_extension``.

The library is built on first use (about a minute on 2 cores, one translation unit) or ahead
of time by ``openmla build``, into a folder keyed by the torch version, the CPU's instruction
set flags and a hash of the sources: a machine (or torch) change gets its own build, a cached
one loads in milliseconds. The code is compiled for the build machine (``-march=native``);
oneDNN's brgemm picks AMX or AVX-512 at run time.

The cache-format and mask codes come from ``openmla.kernel_codes`` (one table for Python and C++):
before compiling, the build writes its ``header()`` into the build folder as ``codes.h`` (on the
include path; ``csrc/common.h`` includes it), and the header's text is part of the key.

Tests set ``OPENMLA_CPU_TEST_HOOKS=1`` (tests/conftest.py): that process builds and loads a
variant with test hooks (NaN-filled scratch, a switch for the own AMX kernel, a count of its
units) under its own key; the library users load has none of them.

``OPENMLA_CPU_ISA=avx2`` (or ``avx512``) compiles for less than the CPU has (no AVX-512 / no AMX),
under its own key: the other ISAs' kernel paths then run on a newer CPU (with
``ONEDNN_MAX_CPU_ISA=AVX2`` for oneDNN's side, bf16 then computes in float32 as on an AVX2 CPU).

Where no compiler is found or the build fails, :func:`load` warns once and returns False, and
the ``cpu`` backend reports itself unavailable (callers fall back to the ``torch`` backend).
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import warnings
from pathlib import Path

import torch

from ... import kernel_codes

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("openmla_cpu.cpp",)
OP_NAMESPACE = "openmla_cpu"

_state: dict = {}  # "loaded": bool, "error": str


def test_hooks() -> bool:
    """Whether this process builds the test variant (``OPENMLA_CPU_TEST_HOOKS=1``)."""
    return os.environ.get("OPENMLA_CPU_TEST_HOOKS") == "1"


def cpu_flags() -> list[str]:
    """The CPU's instruction-set flags (``/proc/cpuinfo``), or the machine name elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return sorted(set(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return [platform.machine(), platform.processor()]


ISA_CAPS = {  # OPENMLA_CPU_ISA: build for less than this CPU has (tests of the other ISAs' paths)
    "avx2": ["-mno-avx512f", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"],
    "avx512": ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"],
}


def isa_cap() -> str:
    """``OPENMLA_CPU_ISA`` (``avx2`` or ``avx512``): compile as if the CPU had no more than that
    (AVX2: no AVX-512, no AMX), to run those kernels' paths on a newer CPU; empty: all it has."""
    isa = os.environ.get("OPENMLA_CPU_ISA", "").lower()
    return isa if isa in ISA_CAPS else ""


def compile_flags(flags: list[str]) -> list[str]:
    """``-march=native`` plus the ATen vector width matching it (``at::vec`` picks its 512- or
    256-bit implementation from ``CPU_CAPABILITY_*``), less what ``OPENMLA_CPU_ISA`` caps."""
    have = set(flags)
    out = ["-O3", "-fopenmp", "-march=native", "-DNDEBUG"]
    cap = isa_cap()
    out += ISA_CAPS.get(cap, [])
    if cap == "avx2":
        have = {f for f in have if not f.startswith(("avx512", "amx"))}
    if test_hooks():
        out.append("-DOPENMLA_TEST_HOOKS")
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= have:
        out.append("-DCPU_CAPABILITY_AVX512")
    elif {"avx2", "fma"} <= have:
        out.append("-DCPU_CAPABILITY_AVX2")
    return out


def build_key() -> str:
    """Hash of the torch version, the CPU flags, the kernel sources and the generated codes header."""
    h = hashlib.sha256()
    h.update(torch.__version__.encode())
    h.update(" ".join(cpu_flags()).encode())
    h.update(b"test-hooks" if test_hooks() else b"")
    h.update(isa_cap().encode())
    h.update(kernel_codes.header().encode())
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    """``$OPENMLA_CACHE_DIR`` (default ``~/.cache/openmla``) / ``cpu-kernels`` / ``torch-<version>-<key>``."""
    root = Path(os.environ.get("OPENMLA_CACHE_DIR") or Path.home() / ".cache" / "openmla")
    return root / "cpu-kernels" / f"torch-{torch.__version__.replace('+', '_')}-{build_key()}"


def write_codes_header(folder: Path) -> Path:
    """``folder/codes.h`` from ``openmla.kernel_codes`` (rewritten only when its text differs, so
    an unchanged header never triggers a rebuild)."""
    path, text = folder / "codes.h", kernel_codes.header()
    if not path.exists() or path.read_text() != text:
        tmp = path.with_suffix(f".h.{os.getpid()}")
        tmp.write_text(text)
        tmp.replace(path)  # atomic: a parallel build never reads half a header
    return path


def load(verbose: bool = False) -> bool:
    """Build (if needed) and load the kernels into ``torch.ops.openmla_cpu``; False (with one
    warning per process) when that is impossible here."""
    if "loaded" in _state:
        return _state["loaded"]
    try:
        from torch.utils import cpp_extension

        folder = build_dir()
        folder.mkdir(parents=True, exist_ok=True)
        name = f"openmla_cpu_{folder.name.rsplit('-', 1)[-1]}"
        write_codes_header(folder)
        if verbose or not (folder / f"{name}.so").exists():
            print(f"openmla: compiling the native CPU kernels into {folder} (once per machine and torch version)",
                  file=sys.stderr, flush=True)
        cpp_extension.load(
            name=name, sources=[str(CSRC / s) for s in SOURCES], extra_cflags=compile_flags(cpu_flags()),
            extra_ldflags=["-fopenmp"], extra_include_paths=[str(folder)], build_directory=str(folder),
            is_python_module=False, verbose=verbose,
        )
        _state["loaded"] = True
    except Exception as exc:  # no compiler, a failed build, an unsupported platform
        _state["loaded"] = False
        _state["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
        warnings.warn(f"openmla: the native CPU kernels are unavailable ({_state['error']}); using the torch backend",
                      RuntimeWarning, stacklevel=2)
    return _state["loaded"]


def unavailable_reason() -> str | None:
    """Why the kernels cannot load here (None when they load)."""
    return None if load() else _state.get("error", "unknown")


def ops():
    """The operators (``torch.ops.openmla_cpu``), loading them if needed; RuntimeError when
    they cannot load here."""
    if not load():
        raise RuntimeError(f"openmla: the native CPU kernels are unavailable ({_state.get('error')})")
    return getattr(torch.ops, OP_NAMESPACE)
