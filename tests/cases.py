"""Test-side name for ``openmla.testing`` (random cases, rel_err, tolerances)."""

from openmla.testing import TOL, Case, make_case, rel_err, small_config  # noqa: F401
