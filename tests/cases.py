"""Test-side name for ``openmla.testing`` (random cases, comparisons, tolerances)."""

from openmla.testing import TOL, Case, assert_close, assert_lse, make_case, rel_err, small_config  # noqa: F401
