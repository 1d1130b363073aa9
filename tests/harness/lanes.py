"""How `make test` spreads the suite over pytest-xdist workers (``-n N --dist loadgroup``).

Most end-to-end tests wait on real timeouts (notices, cuts, cooldowns), not on the CPU. The
longest ones (each a real demo stack: moto, mosquitto, fleetd, several agents with torchrun) are
played in order in lanes, one lane per worker: with 2 workers one lane, so no two of them ever
run at once and the other worker runs everything else beside it; with 3 or more workers every
lane in GROUPS gets a worker of its own, the rest share what is left. `make test` uses 2 workers:
with 4 (three lanes, two or three demo stacks at once) the suite took 19 min instead of ~25, and
one of two such runs failed the scaling demo: on a saturated box the throughput it measured at 3
nodes (4.69 steps/s) was above what the toy job can do (3.33), so node 3 looked worth its price
and the fleet grew to 4 instead of draining it. A module whose
module-scoped fixture plays something expensive is one group too, so the fixture runs once, not
once per worker.

Why a scheduler of our own: xdist's loadgroup reads ``xdist_group`` marks by renaming each test's
node id, which pytest 9 no longer lets it do (the groups were silently ignored). The scheduler
below is xdist's own scope scheduler with the scope read from GROUPS instead; a test not listed
is a scope of its own, so the rest is spread test by test as with ``--dist load``.
"""

from __future__ import annotations

import pytest

# Node id prefix -> group. Lanes balanced on the durations of a 3-worker run on the 2-core box
# (seconds, comments; 2026-11-26). Each lane holds demo stacks (moto, mosquitto, fleetd, several
# agents with torchrun, ~0.9 of a core each while they run), so no two run in one lane at once.
GROUPS = {
    "tests/test_demo.py::test_storm_": "e2e-a",  # 269
    "tests/test_demo.py::test_a_trace_wave_": "e2e-a",  # 170
    "tests/test_demo.py::test_short_scenario_": "e2e-a",  # 113
    "tests/test_demo.py::test_sigterm_": "e2e-a",  # 45
    "tests/test_demo_lifecycle.py::": "e2e-c",  # two one-node demos that end the job
    "tests/test_demo_job_file.py::": "e2e-c",  # three demos of a job file: 175 + 120 + 70
    "tests/test_demo.py::test_scaling_scenario_": "e2e-b",  # 195
    "tests/test_chaos_bench.py::": "e2e-b",  # 266
    "tests/test_demo.py::test_tiny_budget_": "e2e-b",  # 170
    "tests/test_partitions.py::": "e2e-c",  # 184: one module-scoped scenario
    "tests/test_framework_e2e.py::": "e2e-c",  # 60 + 50
    "tests/test_agent_mqtt_tls.py::": "module-agent-mqtt-tls",
    "tests/test_deploy_mosquitto.py::": "module-deploy-mosquitto",
    "tests/test_deploy_broker_stock.py::": "module-deploy-mosquitto",  # uses its PKI fixture
    "tests/test_deploy_image.py::": "module-deploy-image",  # one image build for both tests
    "tests/test_deploy_flow.py::": "module-deploy-image",  # one machine at a time (port 8883); one image
    "tests/test_sim_policies.py::": "module-sim-policies",
}


def group_of(nodeid: str) -> str | None:
    return next((g for prefix, g in GROUPS.items() if nodeid.startswith(prefix)), None)


def longest_first(items: list[pytest.Item]) -> None:
    """Orders the work longest first: the lanes, the other slow tests, then the rest, so that the
    many short tests fill in at the end and no lane starts late. Stable: a module keeps its order."""

    def rank(item: pytest.Item) -> int:
        if (group_of(item.nodeid) or "").startswith("e2e-"):
            return 0
        return 1 if item.get_closest_marker("slow") else 2

    items.sort(key=rank)


def make_scheduler(config: pytest.Config, log):
    """The scheduler for ``--dist loadgroup`` (None: xdist's own, for any other mode)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    # Two workers: one lane, so no two demo stacks ever run at once (they run beside the unit
    # tests, as `make demo` beside a test run does). Three or more: the lanes as listed.
    one_lane = (config.getoption("numprocesses") or 0) <= 2

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            group = group_of(nodeid)
            if group is not None and one_lane and group.startswith("e2e-"):
                return "e2e"
            return group or nodeid

    return LaneScheduling(config, log)
