"""Shared by the triton test modules: every buffer the backend allocates starts as NaN."""

import pytest
import torch

from openmla.backends.triton import _common


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    """Backend buffers start as NaN: an unwritten output element can never pass."""
    def nan_empty(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(_common, "empty", nan_empty)
