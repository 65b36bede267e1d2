"""Test-side name for ``openmla.testing`` (random cases, comparisons, tolerances)."""

from openmla.testing import (  # noqa: F401
    MASK_CASES, TOL, Case, assert_close, assert_lse, make_case, rel_err, small_config,
)
