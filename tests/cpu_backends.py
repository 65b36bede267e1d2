"""The CPU backends the scenario test modules run on: ``torch`` (pure PyTorch) and ``cpu`` (the
native kernels). A module opts in with an autouse fixture that sets its ``BACKEND`` global:

    @pytest.fixture(autouse=True, params=CPU_BACKENDS)
    def backend(request, monkeypatch):
        monkeypatch.setattr(sys.modules[__name__], "BACKEND", use_backend(request.param, monkeypatch))
"""

from __future__ import annotations


import pytest

CPU_BACKENDS = ("torch", "cpu")


def hooks():
    """The native library's test hooks (the test build: OPENMLA_CPU_TEST_HOOKS=1, set by conftest.py)."""
    from openmla.backends.cpu import build

    return build.ops()


def use_backend(name: str, monkeypatch) -> str:
    """Prepare ``name`` for one test: for ``cpu``, skip where the kernels do not build, and make
    every output the kernels fill, and every thread's scratch memory, start as NaN."""
    if name == "cpu":
        from openmla import workspace
        from openmla.backends.cpu import available

        if not available():
            pytest.skip("the native cpu backend did not build here")
        monkeypatch.setattr(workspace, "POISON", True)  # the conftest nan_buffers fixture's switch
        workspace.clear()  # scratch made from now on starts poisoned
        hooks().poison_scratch()
    return name
