"""How `make test` spreads the suite over pytest-xdist workers (``-n N --dist loadgroup``).

The longest tests are demo stacks (moto, mosquitto, fleetd, several agents with torchrun): each
takes ~0.75 of a core while it runs, and a box with too many of them at once measures nothing
right. They play one after another in lanes: with N workers, N - 1 lanes (one with 2 workers), each
on a worker of its own, and the other tests spread over what is left, longest first, test by test
as with ``--dist load``. The stacks are dealt to the lanes longest first, each to the lane with
the least work so far (their wall times below), so the lanes end together. `make test` uses 3
workers, two lanes: a stack takes ~0.6 of a core while it runs, so two of them and the smaller
tests keep the 2-core box ~87 % busy (2026-11-29: 1,300 s from a fresh clone, against ~1,630 s
with one lane, which was the wall). An earlier try of two lanes (2026-11-27) failed two tests,
one of them a product race fixed since (docs/measurements/2026-11-test-suite.md). ``TEST_LANES``
caps the lanes, to try more workers than lanes + 1: four workers with two lanes kept the box
~99 % busy and took 1,380 s, three 1,427 s the same day: within one run's noise (2026-11-29,
docs/measurements).

A module whose module-scoped fixture plays something expensive is one group too, so the fixture
runs once, not once per worker; the deploy image's tests share one built image and port 8883.

Why a scheduler of our own: xdist's loadgroup reads ``xdist_group`` marks by renaming each test's
node id, which pytest 9 no longer lets it do (the groups were silently ignored). The scheduler
below is xdist's own scope scheduler with the scope read from here instead; a test not listed is a
scope of its own.
"""

from __future__ import annotations

import functools
import os

import pytest

# Node id prefix -> its wall seconds on the 2-core box (a fresh clone's make test, 2026-11-27;
# storm, trace wave and scaling: run alone on the idle box after they began to end when their
# story is told, fleetd/demo/story.py). Every test under a prefix stays in one lane.
STACKS = {
    "tests/test_demo.py::test_storm_": 166,
    "tests/test_demo.py::test_a_trace_wave_": 94,
    "tests/test_demo.py::test_scaling_scenario_": 101,
    "tests/test_partitions.py::": 200,  # one module-scoped scenario
    "tests/test_demo_job_file.py::test_a_plain_ddp_": 199,
    "tests/test_demo.py::test_short_scenario_": 191,
    "tests/test_demo_lifecycle.py::": 158,  # two one-node demos that end the job
    "tests/test_chaos_bench.py::": 146,
    "tests/test_demo_job_file.py::test_a_submitted_version_": 135,
    "tests/test_demo.py::test_tiny_budget_": 131,
    "tests/test_framework_e2e.py::": 117,
    "tests/test_demo_job_file.py::": 66,
    "tests/test_demo.py::test_sigterm_": 39,
    "tests/test_demo_team.py::": 100,  # three job controllers, their stores and nodes, the team loop
}
# Node id prefix -> group, for tests that share a module fixture or a resource.
SHARED = {
    "tests/test_agent_mqtt_tls.py::": "module-agent-mqtt-tls",
    "tests/test_deploy_mosquitto.py::": "module-deploy-mosquitto",
    "tests/test_deploy_broker_stock.py::": "module-deploy-mosquitto",  # uses its PKI fixture
    "tests/test_deploy_image.py::": "module-deploy-image",  # one image build for both modules
    "tests/test_deploy_flow.py::": "module-deploy-image",  # one machine at a time (port 8883)
    "tests/test_sim_policies.py::": "module-sim-policies",
}


def lanes_for(workers: int) -> int:
    """N - 1 lanes for N workers (one for two); ``TEST_LANES`` sets the count (at most N - 1)."""
    default = 1 if workers <= 2 else workers - 1
    asked = int(os.environ.get("TEST_LANES", "0") or 0)
    return min(asked, default) if asked > 0 else default


@functools.cache
def _deal(lanes: int) -> dict[str, int]:
    """Stack prefix -> lane: longest first, each to the least loaded lane (LPT)."""
    load = [0.0] * lanes
    dealt: dict[str, int] = {}
    for prefix, seconds in sorted(STACKS.items(), key=lambda kv: (-kv[1], kv[0])):
        lane = min(range(lanes), key=lambda i: (load[i], i))
        dealt[prefix] = lane
        load[lane] += seconds
    return dealt


def _stack_of(nodeid: str) -> str | None:
    # The longest matching prefix: "test_demo_job_file.py::test_a_plain_ddp_" before the module's.
    matches = [p for p in STACKS if nodeid.startswith(p)]
    return max(matches, key=len) if matches else None


def group_of(nodeid: str, lanes: int = 1) -> str | None:
    stack = _stack_of(nodeid)
    if stack is not None:
        return f"e2e-{_deal(lanes)[stack]}"
    return next((g for prefix, g in SHARED.items() if nodeid.startswith(prefix)), None)


def longest_first(items: list[pytest.Item]) -> None:
    """Orders the work longest first: the stacks, the other slow tests, then the rest, so that the
    many short tests fill in at the end and no lane starts late. Stable: a module keeps its order."""

    def rank(item: pytest.Item) -> int:
        if _stack_of(item.nodeid) is not None:
            return 0
        return 1 if item.get_closest_marker("slow") else 2

    items.sort(key=rank)


def make_scheduler(config: pytest.Config, log):
    """The scheduler for ``--dist loadgroup`` (None: xdist's own, for any other mode)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    lanes = lanes_for(int(config.getoption("numprocesses") or 0))

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid, lanes) or nodeid

    return LaneScheduling(config, log)
