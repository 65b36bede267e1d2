"""Shared by the triton test modules: every buffer the backend allocates starts as NaN."""

import pytest


@pytest.fixture(autouse=True)
def poison(nan_buffers):
    """Backend buffers start as NaN: an unwritten output element can never pass."""
