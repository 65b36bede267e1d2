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


def poison_workspace(monkeypatch) -> None:
    """Scratch from ``openmla.workspace`` starts as NaN bytes (0xff) for the rest of the test."""
    from openmla import workspace

    monkeypatch.setattr(workspace, "_new", lambda nbytes, device: torch.full((nbytes,), 0xFF, dtype=torch.uint8, device=device))
    workspace.clear()  # buffers made from now on start poisoned


def hooks():
    """The native library's test hooks (the test build: OPENMLA_CPU_TEST_HOOKS=1, set by conftest.py)."""
    from openmla.backends.cpu import build

    return build.ops()


def use_backend(name: str, monkeypatch) -> str:
    """Prepare ``name`` for one test: for ``cpu``, skip where the kernels do not build, and make
    every output the kernels fill, and every thread's scratch memory, start as NaN."""
    if name == "cpu":
        from openmla.backends.cpu import available, kernels

        if not available():
            pytest.skip("the native cpu backend did not build here")
        monkeypatch.setattr(kernels, "_alloc", lambda shape, dtype: torch.full(shape, math.nan, dtype=dtype))
        poison_workspace(monkeypatch)
        hooks().poison_scratch()
    return name
