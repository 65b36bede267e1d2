"""Shared by the triton test modules: where the backend can run (``require_triton``), and every
buffer the backend allocates starting as NaN (``poison``, autouse where imported)."""

import pytest
import torch

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")


def require_triton():
    """The triton backend's ``_common`` when it can run here (CUDA, or the interpreter); else skip
    (the module, when called at its top): triton missing, or imported before TRITON_INTERPRET=1
    was set (tests/conftest.py sets it before anything imports triton)."""
    pytest.importorskip("triton", reason="triton is not installed (pip install 'openmla[triton]')")
    from openmla.backends.triton import _common

    if not CUDA and not _common.INTERPRET:
        pytest.skip("the triton backend was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)
    return _common


@pytest.fixture(autouse=True)
def poison(nan_buffers):
    """Backend buffers start as NaN: an unwritten output element can never pass."""
