"""The CPU backends the scenario test modules run on: ``torch`` (pure PyTorch) and ``cpu`` (the
native kernels). A module opts in with an autouse fixture that sets its ``BACKEND`` global:

    @pytest.fixture(autouse=True, params=CPU_BACKENDS)
    def backend(request, monkeypatch):
        monkeypatch.setattr(sys.modules[__name__], "BACKEND", use_backend(request.param, monkeypatch))
"""

from __future__ import annotations

import math

import pytest
import torch

CPU_BACKENDS = ("torch", "cpu")


def use_backend(name: str, monkeypatch) -> str:
    """Prepare ``name`` for one test: for ``cpu``, skip where the kernels do not build, and make
    every output the kernels fill, and every thread's scratch memory, start as NaN."""
    if name == "cpu":
        from openmla.backends.cpu import available, kernels

        if not available():
            pytest.skip("the native cpu backend did not build here")
        monkeypatch.setattr(kernels, "_alloc", lambda shape, dtype: torch.full(shape, math.nan, dtype=dtype))
        kernels.poison_scratch()
    return name
