"""Budget invariants over random price paths, interruptions and telemetry (issue 4, "Must show").

For every drawn scenario, after every planned action: spend never exceeds budget.total_usd, the
burn of the kept fleet never exceeds budget.max_usd_per_hour, and the planner never plans below
fleet.min_nodes while a node still fits the budget. bench/budget_props.py runs >= 10,000 examples.
"""

import pytest
from hypothesis import HealthCheck, given, settings

from tests.policy_fixtures import Scenario, run_scenario, scenarios


def _holds(sc: Scenario) -> None:
    out = run_scenario(sc)
    assert out.violations == [], out.violations
    assert out.passes == sc.passes


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(scenarios(max_passes=30))
def test_budget_invariants_hold_over_random_runs(sc: Scenario) -> None:
    """The working loop's draw (`make test-fast`): 200 runs, ~2 s."""
    _holds(sc)


# The full suite's draw: 2,000 runs, ~20 CPU-s, more than the working loop's budget can carry.
@pytest.mark.slow
@settings(
    max_examples=2000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
@given(scenarios(max_passes=30))
def test_budget_invariants_hold_over_2000_random_runs(sc: Scenario) -> None:
    _holds(sc)
