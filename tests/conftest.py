"""Run the Triton kernels through Triton's interpreter when no CUDA device is present, load the
native CPU kernels' test build, and register the hypothesis profiles.

The flag must be set before triton is first imported (transformers may import it), so it is
set here, when pytest loads this file, before any test module is collected.

Hypothesis: the ``ci`` profile (the default) is derandomized, with a fixed example count and no
deadline, so ``make test`` runs the same examples in the same time on every machine; each
property test sets its own ``max_examples`` to fit the budget. ``HYPOTHESIS_PROFILE=explore``
draws fresh random examples (and 10x as many where a test asks for ``scaled(n)``).
"""

import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, os.path.dirname(__file__))  # `from cases import ...` from any test module

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["OPENMLA_CPU_TEST_HOOKS"] = "1"  # the native kernels' test build (NaN scratch, own-AMX switch), never the users' one

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]
settings.register_profile("ci", derandomize=True, database=None, max_examples=10, deadline=None, print_blob=True,
                          suppress_health_check=_SLOW_OK)
settings.register_profile("explore", max_examples=100, deadline=None, print_blob=True, suppress_health_check=_SLOW_OK)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``): its small
    ops run as fast on one, and do not stall when another process takes a core."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def nan_buffers(monkeypatch):
    """Every buffer a backend fills (``openmla.workspace.empty_output``) and every new scratch
    buffer starts as NaN for the test, so an element a kernel leaves unwritten shows."""
    from openmla import workspace

    monkeypatch.setattr(workspace, "POISON", True)
    workspace.clear()  # no scratch buffer left from another test
