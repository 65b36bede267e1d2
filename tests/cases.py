"""Test-side name for ``openmla_tools.testing`` (random cases, comparisons, tolerances)."""

from openmla_tools.testing import (  # noqa: F401
    EDGE_SCENARIOS, MASK_CASES, NO_ROPE_SCENARIOS, TOL, Case, Scenario, assert_close, assert_close_nan, assert_lse, make_case,
    rel_err, scenario_case, small_config,
)
