"""Test-side name for ``openmla.testing`` (random cases, comparisons, tolerances)."""

from openmla.testing import (  # noqa: F401
    EDGE_SCENARIOS, MASK_CASES, NO_ROPE_SCENARIOS, TOL, Case, Scenario, assert_close, assert_close_nan, assert_lse, make_case,
    rel_err, scenario_case, small_config,
)
