"""Budget invariants at scale: >= 10,000 random runs through the planner (issue 4).

Same scenarios and checks as tests/test_policy_budget_props.py (tests/policy_fixtures.py): random
price paths, notices, capacity outages, utilisation and throughput; after every planned action
spend <= total_usd, burn <= max_usd_per_hour, and never below min_nodes while a node still fits.

    .venv/bin/python bench/budget_props.py [--examples 10000] [--max-passes 40]

Prints a few lines of numbers; the last line is one JSON object. Exit status 1 on any violation.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hypothesis import HealthCheck, given, settings  # noqa: E402

from tests.policy_fixtures import Outcome, run_scenario, scenarios  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=10_000)
    ap.add_argument("--max-passes", type=int, default=40)
    args = ap.parse_args()

    outcomes: list[Outcome] = []
    failures: list[str] = []

    @settings(
        max_examples=args.examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(scenarios(max_passes=args.max_passes))
    def check(sc) -> None:
        out = run_scenario(sc)
        outcomes.append(out)
        if out.violations:
            failures.extend(out.violations)
            raise AssertionError(out.violations)

    started = time.perf_counter()
    try:
        check()
        ok = True
    except AssertionError:
        ok = False
    wall = time.perf_counter() - started
    passes = sum(o.passes for o in outcomes)
    result = {
        "examples": len(outcomes),
        "planner_passes": passes,
        "checks": sum(o.checks for o in outcomes),
        "runs_stopped_at_cap": sum(o.stopped for o in outcomes),
        "runs_above_90pct_of_budget": sum(o.max_spent_share > 0.9 for o in outcomes),
        "max_spent_share": round(max((o.max_spent_share for o in outcomes), default=0.0), 6),
        "violations": len(failures),
        "wall_s": round(wall, 2),
        "us_per_plan": round(1e6 * wall / passes, 1) if passes else None,
        "ok": ok,
    }
    print(f"examples run: {result['examples']} ({passes} planner passes, {wall:.1f} s)")
    print(f"runs stopped at the cap: {result['runs_stopped_at_cap']}; highest spend/total: {result['max_spent_share']}")
    if failures:
        print("first violation:", failures[0])
    print(json.dumps(result))
    return 0 if ok and len(outcomes) >= args.examples else 1


if __name__ == "__main__":
    sys.exit(main())
